"""The loop's hook points (vase/callbacks.py): order and count of the hooks on a tiny run, callback
state through a checkpoint and a resume, a run without TensorBoard giving the same results, and the
progress file a run writes through them."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from vase.callbacks import Callback, StepEnd
from vase.config import build_config
from vase.progress_file import PROGRESS_FILE, ProgressFile, read_progress
from vase.tensorboard_logger import TensorBoardLogger
from vase.trainer import Trainer, prepare_run_dir

# Two sprite environments of 4 steps, a checkpoint every 3 steps, probes every 2: checkpoints fall
# both inside an environment (3, 6) and on its boundaries (4, 8), probes both off and on them.
SETTINGS = [
    "data.sequence=moving_shapes_a,shapes_b", "data.steps_per_env=4",
    "data.sprite_train_size=200", "data.sprite_test_size=100",
    "probe.train_size=50", "probe.test_size=50", "probe.every=2",
    "train.batch_size=16", "train.threads=1", "train.checkpoint_every=3", "train.log_every=3",
    "train.image_every=2", "dream.batch_size=16", "dream.snapshot_every=2",
]


class Recorder(Callback):
    """Writes down every hook it gets; counts its steps as state that a resume must bring back."""

    def __init__(self, stop_at: int | None = None):
        self.calls: list[tuple] = []
        self.steps_seen = 0
        self.stop_at = stop_at

    def state_dict(self) -> dict:
        return {"recorder": {"steps_seen": self.steps_seen}}

    def load_state_dict(self, state: dict) -> None:
        self.steps_seen = state["recorder"]["steps_seen"]
        self.calls.append(("load", self.steps_seen))

    def on_resume(self, trainer, step):
        self.calls.append(("resume", step))

    def on_train_start(self, trainer, start):
        self.calls.append(("start", start))

    def on_step(self, trainer, step: StepEnd):
        assert isinstance(step, StepEnd) and step.done == trainer.learner.step
        # The evaluator comes first: this step's decision is already in its record.
        assert len(trainer.evaluator.record.assigned) == step.done
        self.steps_seen += 1
        self.calls.append(("step", step.done, step.true_env, step.boundary, step.logged))
        if step.done == self.stop_at:
            raise KeyboardInterrupt

    def on_boundary(self, trainer, step: StepEnd):
        # ... and has measured the boundary: one held-out error row per finished environment.
        assert len(trainer.evaluator.record.recon_matrix) == step.true_env + 1
        self.calls.append(("boundary", step.done, step.true_env))

    def on_checkpoint(self, trainer):
        self.calls.append(("checkpoint", trainer.learner.step))

    def on_train_end(self, trainer):
        self.calls.append(("end",))


def expected_steps(first: int, last: int) -> list[tuple]:
    """The hooks of steps first..last (steps done) under SETTINGS."""
    calls = []
    for done in range(first, last + 1):
        boundary = done % 4 == 0
        calls.append(("step", done, (done - 1) // 4, boundary, done % 3 == 0 or boundary))
        if boundary:
            calls.append(("boundary", done, (done - 1) // 4))
        if boundary or done % 3 == 0:
            calls.append(("checkpoint", done))
    return calls


@pytest.fixture(scope="module")
def sprite_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("sprite_data")


def make_trainer(run: Path, root: Path, callbacks: list[Callback] | None = None, resume: bool = False) -> Trainer:
    cfg = build_config("cpu", SETTINGS + [f"data.root={root}"])
    trainer = Trainer(cfg, run, progress=False, callbacks=callbacks)
    prepare_run_dir(run, cfg, resume=resume)
    return trainer


def read(run: Path) -> dict:
    results = json.loads((run / "results.json").read_text())
    results.pop("wall_time_s")
    return results


@pytest.fixture(scope="module")
def straight(tmp_path_factory, sprite_root) -> tuple[Path, Recorder]:
    """One run through with the default TensorBoard logger and a Recorder after it."""
    run, recorder = tmp_path_factory.mktemp("runs") / "straight", Recorder()
    trainer = make_trainer(run, sprite_root, [TensorBoardLogger(), recorder])
    trainer.train()
    return run, recorder


def test_hooks_come_in_order_and_once_each(straight):
    _, recorder = straight
    assert recorder.calls == [("start", 0), *expected_steps(1, 8), ("end",)]


def test_a_resumed_run_continues_its_hooks_and_callback_state_from_the_checkpoint(tmp_path, sprite_root, straight):
    run = tmp_path / "run"
    stopped = Recorder(stop_at=6)  # raised from on_step of step 6, before its checkpoint
    with pytest.raises(KeyboardInterrupt):
        make_trainer(run, sprite_root, [stopped]).train()
    assert stopped.calls == [("start", 0), *expected_steps(1, 5), ("step", 6, 1, False, True), ("end",)]

    resumed = Recorder()
    make_trainer(run, sprite_root, [resumed], resume=True).train(resume=True)
    # The newest checkpoint is step 4 (the boundary), which had seen 4 steps; step 6's never happened.
    assert resumed.calls == [("load", 4), ("resume", 4), ("start", 4), *expected_steps(5, 8), ("end",)]
    assert resumed.steps_seen == 8
    assert read(run) == read(straight[0])


def test_without_the_tensorboard_logger_the_results_are_the_same(tmp_path, sprite_root, straight):
    run = tmp_path / "run"
    make_trainer(run, sprite_root, []).train()
    assert not (run / "tb").exists()
    assert (straight[0] / "tb").is_dir()
    assert read(run) == read(straight[0])


def test_two_callbacks_cannot_claim_the_same_checkpoint_entry():
    trainer = SimpleNamespace(learner=SimpleNamespace(state_dict=dict), callbacks=[Recorder(), Recorder()])
    with pytest.raises(ValueError, match=r"reuses the checkpoint entries \['recorder'\]"):
        Trainer.state_dict(trainer)


def test_a_switch_back_to_a_past_environment_is_an_inference_event_in_tensorboard():
    # A return to a past slot is what re-identification looks like; TensorBoard lists it beside
    # the allocations, as results.json does, and leaves the batches that change nothing out.
    from vase.inference import Decision

    texts = []
    logger = TensorBoardLogger()
    logger.writer = SimpleNamespace(add_text=lambda tag, text, step: texts.append((tag, step, text)))
    trainer = SimpleNamespace(evaluator=SimpleNamespace(probed_at=lambda step: {}, covered_at=lambda step: []),
                              cfg=SimpleNamespace(train=SimpleNamespace(image_every=10 ** 9)))
    verdicts = ["first", "same", "pending", "new", "same", "switch", "full"]
    for done, verdict in enumerate(verdicts, start=1):
        decision = Decision(done - 1, 0, 0, verdict)
        step = SimpleNamespace(out=SimpleNamespace(decision=decision), logged=False, done=done,
                               every=lambda n: False)
        logger.on_step(trainer, step)
    assert [(tag, step) for tag, step, _ in texts] == [("inference/events", s) for s in (1, 4, 6, 7)]
    assert "step 5: switch -> environment 0" in texts[2][2]
    assert [Decision(0, 0, 0, v).is_event for v in verdicts] == [True, False, False, True, False, True, True]


class ProgressReader(Callback):
    """Reads the progress file after each step's writer has run."""

    def __init__(self):
        self.seen: list[int | None] = []

    def on_train_start(self, trainer, start):
        self.seen.append(read_progress(trainer.run_dir))

    def on_step(self, trainer, step: StepEnd):
        self.seen.append(read_progress(trainer.run_dir))


def test_the_progress_file_follows_the_loop_and_a_resume_restarts_it_from_the_checkpoint(tmp_path, sprite_root):
    run = tmp_path / "run"
    reader = ProgressReader()
    with pytest.raises(KeyboardInterrupt):
        make_trainer(run, sprite_root, [ProgressFile(every_s=0.0), reader, Recorder(stop_at=6)]).train()
    assert reader.seen == [0, 1, 2, 3, 4, 5, 6]
    assert read_progress(run) == 6  # written again as the loop stopped: ahead of the checkpoint of step 4
    reader = ProgressReader()
    make_trainer(run, sprite_root, [ProgressFile(every_s=0.0), reader], resume=True).train(resume=True)
    assert reader.seen == [4, 5, 6, 7, 8]
    assert json.loads((run / PROGRESS_FILE).read_text()) == {"step": 8, "total": 8}


def test_a_default_run_writes_its_progress_file(tmp_path, sprite_root):
    run = tmp_path / "run"
    make_trainer(run, sprite_root).train()
    assert json.loads((run / PROGRESS_FILE).read_text()) == {"step": 8, "total": 8}
