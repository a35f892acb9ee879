"""`vase eval RUN_DIR --replay STEP`: the run's own steps again, from a kept checkpoint, in memory."""
from __future__ import annotations

import json

import pytest
import torch
from test_cli import fails_in_one_line, invoke, sprite_data, tiny_args  # noqa: F401 (sprite_data is a fixture)
from test_reliability import read_results, scalar_series

from vase.checkpoint import load_checkpoint
from vase.replay import replay, replay_text

STAGE = 8  # steps per environment: stages end at 8, 16 and 24, each a kept checkpoint


@pytest.fixture(scope="module")
def run(tmp_path_factory, sprite_data):  # noqa: F811
    path = tmp_path_factory.mktemp("replay") / "run"
    result = invoke(tiny_args(path, sprite_data, steps=STAGE, train__log_every=1))
    assert result.exit_code == 0, result.output
    return path


def files(path):
    return {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(path.rglob("*")) if p.is_file()}


def test_the_replay_is_the_run_itself_and_writes_nothing(run):
    before = files(run)
    rows = replay(run, STAGE, 3 * STAGE)
    assert files(run) == before
    assert [r.step for r in rows] == list(range(STAGE, 3 * STAGE))  # stopped at the sequence's end
    # The run's events after the checkpoint, and the losses it logged at every step, come back.
    events = [(e["step"], e["verdict"], e["env"]) for e in read_results(run)["inference_events"] if e["step"] >= STAGE]
    assert [(r.step, r.verdict, r.env) for r in rows if r.verdict in ("first", "switch", "new", "full")] == events
    logged = scalar_series(run / "tb")
    for tag, field in (("loss/kl", "kl"), ("loss/reconstruction", "reconstruction"), ("capacity/C", "capacity")):
        series = dict(logged[tag])
        assert [getattr(r, field) for r in rows] == pytest.approx([series[r.step + 1] for r in rows], rel=1e-6)
    assert [r.true_env for r in rows] == [1] * STAGE + [2] * STAGE
    assert all(len(r.alpha) == 3 for r in rows)
    assert list(rows[0].alpha.values()) == sorted(rows[0].alpha.values(), reverse=True)


@pytest.fixture(scope="module")
def flipping(tmp_path_factory, sprite_data):  # noqa: F811
    """A run whose masks move: eq. 5 alone, with a threshold that single batches cross."""
    path = tmp_path_factory.mktemp("replay") / "flipping"
    result = invoke(tiny_args(path, sprite_data, steps=STAGE, inference__rules="paper",
                              mask__lambda_low=0.04, mask__lambda_high=0.05))
    assert result.exit_code == 0, result.output
    return path


def slot_masks(run, step):
    state, _ = load_checkpoint(run, step)
    return state["learner"]["inference"]["slots"]["mask"].bool()


def test_the_mask_changes_it_reports_lead_from_one_checkpoint_to_the_next(flipping):
    masks = slot_masks(flipping, STAGE).clone()
    rows = replay(flipping, STAGE, 2 * STAGE)
    assert any(r.mask_on or r.mask_off for r in rows)  # the case can fail: eq. 5 moved some a^s here
    for r in rows:
        assert not set(r.mask_on) & set(r.mask_off)
        assert not masks[r.env, r.mask_on].any() and masks[r.env, r.mask_off].all()  # each is a change
        masks[r.env, r.mask_on], masks[r.env, r.mask_off] = True, False
    assert torch.equal(masks, slot_masks(flipping, 3 * STAGE))  # the stage end's kept checkpoint
    changed = next(r for r in rows if r.mask_on)
    line = next(line for line in replay_text(rows).splitlines() if line.split()[0] == str(changed.step))
    assert line.endswith(" ".join([f"+z{n}" for n in changed.mask_on] + [f"-z{n}" for n in changed.mask_off]))


def test_the_text_and_json_carry_each_step(run):
    result = invoke(["eval", str(run), "--replay", str(2 * STAGE), "--count", "2", "--latents", "0,5"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].startswith("each batch as the run trained it") and len(lines) == 4
    assert lines[2].split()[0] == str(2 * STAGE) and "z0 " in lines[2] and "z5 " in lines[2]
    as_json = json.loads(invoke(["eval", str(run), "--replay", str(2 * STAGE), "--count", "2", "--json"]).output)
    assert [row["step"] for row in as_json] == [2 * STAGE, 2 * STAGE + 1]
    assert replay_text([]).splitlines() == lines[:2]


@pytest.mark.parametrize("extra, message", [
    (["--replay", "3"], "no checkpoint of step 3"),
    (["--replay", str(3 * STAGE)], f"ends at step {3 * STAGE}"),
    (["--replay", str(STAGE), "--latents", "0,99"], "--latents 99"),
    (["--replay", str(STAGE), "--latents", "a"], "give latents as integers"),
    (["--replay", str(STAGE), "--classifier"], "--classifier and --replay are separate readings"),
    (["--count", "3"], "--count and --latents go with --replay STEP"),
    (["--count", "20"], "--count and --latents go with --replay STEP"),  # the default's value, given
    (["--latents", "1"], "--count and --latents go with --replay STEP"),
])
def test_bad_replays_are_refused_in_one_line(run, extra, message):
    fails_in_one_line(invoke(["eval", str(run), *extra]), message)
