"""What an old slot lost, split from what the shared encoder's drift costs it
(`Evaluator.stage_code_errors`): the codes of each stage's held-out images at the end of the stage,
decoded at the end under the slot it trained in."""
from __future__ import annotations

import pytest
import torch

from vase.config import build_config
from vase.trainer import Trainer, prepare_run_dir

SETTINGS = [
    "data.sequence=moving_shapes_a,shapes_b", "data.steps_per_env=4",
    "data.sprite_train_size=200", "data.sprite_test_size=100",
    "probe.train_size=50", "probe.test_size=50", "probe.every=2",
    "train.batch_size=16", "train.threads=1", "dream.batch_size=16",
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Trainer:
    root, run = tmp_path_factory.mktemp("sprite_data"), tmp_path_factory.mktemp("runs") / "run"
    cfg = build_config("cpu", SETTINGS + [f"data.root={root}"])
    trainer = Trainer(cfg, run, progress=False, callbacks=[])
    prepare_run_dir(run, cfg)
    trainer.train()
    return trainer


def _perturbed(module: torch.nn.Module, seed: int) -> dict:
    """Add noise to every weight of `module`; return its weights from before."""
    before = {k: v.clone() for k, v in module.state_dict().items()}
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
    return before


def test_each_finished_stage_keeps_the_codes_of_its_end(trained):
    record, held_out = trained.evaluator.record, trained.evaluator.held_out
    assert len(record.stage_codes) == 2
    assert [len(c) for c in record.stage_codes] == [len(x) for x in held_out]
    assert all(len(row) == trained.cfg.model.latents for codes in record.stage_codes for row in codes)


def test_the_last_stage_decodes_its_codes_as_the_encoder_gives_them_now(trained):
    ev = trained.evaluator
    slots = [row["inferred_env"] for row in ev.inferred_environments()]
    errors = ev.stage_code_errors(slots)
    now = ev.learner.reconstruction_error(ev.held_out[-1], slots[-1])
    assert errors[-1] == pytest.approx(now, rel=1e-5)  # the same codes, up to channels_last's last digits


def test_the_encoders_drift_moves_only_the_error_from_todays_codes(trained):
    ev, learner = trained.evaluator, trained.evaluator.learner
    slots = [row["inferred_env"] for row in ev.inferred_environments()]
    x, slot = ev.held_out[0], slots[0]
    staged, now = ev.stage_code_errors(slots), learner.reconstruction_error(x, slot)

    before = _perturbed(learner.model.encoder, seed=1)
    try:
        assert ev.stage_code_errors(slots) == staged
        assert learner.reconstruction_error(x, slot) != pytest.approx(now, rel=1e-3)
    finally:
        learner.model.encoder.load_state_dict(before)

    before = _perturbed(learner.model.decoder, seed=2)
    try:
        assert ev.stage_code_errors(slots)[0] != pytest.approx(staged[0], rel=1e-3)
    finally:
        learner.model.decoder.load_state_dict(before)
    assert ev.stage_code_errors(slots) == staged


def test_the_reading_is_in_results_json_and_rebuilt_from_the_saved_encoders(trained):
    ev = trained.evaluator
    slots = [row["inferred_env"] for row in ev.inferred_environments()]
    assert ev.results()["own_slot_errors_stage_codes"] == ev.stage_code_errors(slots)
    kept = ev.record.stage_codes
    ev.record.stage_codes = []  # as a checkpoint written without them
    try:
        assert ev.stage_code_errors(slots) == [None, None]
        ev.codes_from_saved_encoders(trained.run_dir)
        assert ev.record.stage_codes == kept
    finally:
        ev.record.stage_codes = kept
