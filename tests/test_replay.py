"""`vase eval RUN_DIR --replay STEP`: the run's own steps again, from a kept checkpoint, in memory."""
from __future__ import annotations

import json

import pytest
import torch
from test_cli import fails_in_one_line, invoke, sprite_data, tiny_args  # noqa: F401 (sprite_data is a fixture)
from test_reliability import read_results, scalar_series

from vase.checkpoint import load_checkpoint
from vase.errors import VaseError
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
    rows = replay(run, STAGE, 3 * STAGE).steps
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
    rows = replay(flipping, STAGE, 2 * STAGE).steps
    assert any(r.mask_on or r.mask_off for r in rows)  # the case can fail: eq. 5 moved some a^s here
    for r in rows:
        assert not set(r.mask_on) & set(r.mask_off)
        assert not masks[r.env, r.mask_on].any() and masks[r.env, r.mask_off].all()  # each is a change
        masks[r.env, r.mask_on], masks[r.env, r.mask_off] = True, False
    assert torch.equal(masks, slot_masks(flipping, 3 * STAGE))  # the stage end's kept checkpoint
    changed = next(r for r in rows if r.mask_on)
    line = next(line for line in replay_text(replay(flipping, STAGE, 2 * STAGE)).splitlines()
                if line.split()[0] == str(changed.step))
    assert line.endswith(" ".join([f"+z{n}" for n in changed.mask_on] + [f"-z{n}" for n in changed.mask_off]))


def test_the_text_and_json_carry_each_step(run):
    result = invoke(["eval", str(run), "--replay", str(2 * STAGE), "--count", "2", "--latents", "0,5"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()  # the progress bar is on standard error
    assert lines[0].startswith("each batch as the run trained it")
    assert lines[2].split()[0] == str(2 * STAGE) and "z0 " in lines[2] and "z5 " in lines[2]
    assert lines[4].startswith("eq. 3 over these steps: at most") and lines[5].startswith("held-out error")
    assert len(lines) == 6 + 3  # one line per environment: two seen by the checkpoint, the third in the replay
    as_json = json.loads(invoke(["eval", str(run), "--replay", str(2 * STAGE), "--count", "2", "--json"]).stdout)
    assert [row["step"] for row in as_json["steps"]] == [2 * STAGE, 2 * STAGE + 1]
    assert [r["environment"] for r in as_json["own_slot"]] == [line.split()[0] for line in lines[6:]]
    assert as_json["own_slot"][-1]["before"] is None and as_json["own_slot"][0]["before"] is not None
    assert lines[-1].split(": ")[1].startswith("- -> ")
    assert as_json["turned_on"] is None and as_json["capacity_form"] == as_json["run_capacity_form"] == "squared"


def test_the_replay_shows_its_progress_on_standard_error_unless_asked_not_to(run):
    args = ["eval", str(run), "--replay", str(2 * STAGE), "--count", "3"]
    shown, hidden = invoke(args), invoke(args + ["--no-progress"])
    bar = shown.stderr.splitlines()  # off a terminal: dated lines, the last one at the bar's close
    assert bar and all("vase eval --replay" in line for line in bar) and "3/3" in bar[-1], shown.stderr
    assert hidden.stderr == "" and hidden.stdout == shown.stdout


@pytest.mark.parametrize("extra, message", [
    (["--replay", "3"], "no checkpoint of step 3"),
    (["--replay", str(3 * STAGE)], f"ends at step {3 * STAGE}"),
    (["--replay", str(STAGE), "--latents", "0,99"], "--latents 99"),
    (["--replay", str(STAGE), "--latents", "a"], "give latents as integers"),
    (["--replay", str(STAGE), "--classifier"], "--classifier and --replay are separate readings"),
    (["--count", "3"], "--count, --latents, --turn-on and --capacity-form go with --replay STEP"),
    (["--count", "20"], "go with --replay STEP"),  # the default's value, given
    (["--latents", "1"], "go with --replay STEP"),
    (["--turn-on", "0:1"], "go with --replay STEP"),
    (["--capacity-form", "absolute"], "go with --replay STEP"),
    (["--replay", str(STAGE), "--turn-on", "1"], "give SLOT:LATENT"),
    (["--replay", str(STAGE), "--turn-on", "0:99"], "the run has latents 0-"),
    (["--replay", str(STAGE), "--turn-on", "5:1"], "allocated slots 0"),
])
def test_bad_replays_are_refused_in_one_line(run, extra, message):
    fails_in_one_line(invoke(["eval", str(run), *extra]), message)


def test_the_own_slot_errors_after_a_replay_are_those_of_the_checkpoint_it_reaches(run):
    from vase.inspection import open_run
    from vase.replay import own_slot_errors

    result = replay(run, STAGE, STAGE)
    reached = own_slot_errors(open_run(run, 2 * STAGE))  # the stage end's kept checkpoint
    assert [(r["environment"], r["slot"]) for r in result.own_slot] == [(n, s) for n, s, _ in reached]
    assert [r["after"] for r in result.own_slot] == pytest.approx([e for _, _, e in reached], rel=1e-6)
    before = {(n, s): e for n, s, e in own_slot_errors(open_run(run, STAGE))}
    # The environment met during the replay has no error before it; the first one has.
    assert [r["before"] for r in result.own_slot] == [before.get((r["environment"], r["slot"]))
                                                     for r in result.own_slot]
    assert result.own_slot[0]["before"] is not None and result.own_slot[-1]["before"] is None


@pytest.fixture(scope="module")
def kept(tmp_path_factory, sprite_data):  # noqa: F811
    """The flipping run, with a checkpoint kept at every step to turn latents on from."""
    path = tmp_path_factory.mktemp("replay") / "kept"
    result = invoke(tiny_args(path, sprite_data, steps=STAGE, inference__rules="paper", train__keep_every=1,
                              mask__lambda_low=0.04, mask__lambda_high=0.05))
    assert result.exit_code == 0, result.output
    return path


def a_masked_latent(run):
    """(step, slot, latent): the first step from STAGE on whose batch trains in a slot that masks a
    latent the batch does not push off again (alpha at most lambda_high), so that turning it on
    keeps the batch in its slot."""
    from vase.config import load_run_config

    high = load_run_config(run, trains=False).mask.lambda_high
    for r in replay(run, STAGE, 2 * STAGE, latents=list(range(10))).steps:
        off = (~slot_masks(run, r.step)[r.env]).nonzero().flatten().tolist()
        usable = [n for n in off if n < 10 and r.alpha[n] <= high]
        if r.verdict == "same" and usable:
            return r.step, r.env, usable[0]
    raise AssertionError("no step of the run masks a latent: the case cannot test the flip")


def test_a_latent_turned_on_adds_its_kl_to_eq_3_at_once(kept):
    from vase.inspection import open_run
    from vase.objective import kl_per_latent

    step, slot, latent = a_masked_latent(kept)
    as_run_replay = replay(kept, step, 1)
    as_run = as_run_replay.steps[0]
    flipped = replay(kept, step, 1, turned_on=(slot, latent))
    # "before" is the run's own state, read before the flip; the flip's decoding counts in "after".
    assert [r["before"] for r in flipped.own_slot] == [r["before"] for r in as_run_replay.own_slot]
    assert flipped.steps[0].env == slot and flipped.turned_on == (slot, latent)
    run = open_run(kept, step)
    x = run.stream.batch(step, run.learner.generator)
    with torch.no_grad():
        post = run.learner.model.encoder(x)
    added = float(kl_per_latent(post.mu, post.logvar).mean(0)[latent])
    assert added > 0.01  # the case can fail: the latent carries KL on this batch
    assert flipped.steps[0].kl == pytest.approx(as_run.kl + added, rel=1e-4)
    assert flipped.steps[0].capacity == as_run.capacity
    assert flipped.latent_on_at_end == (latent not in flipped.steps[0].mask_off)
    on = int(slot_masks(kept, step)[slot].nonzero()[0])
    with pytest.raises(VaseError, match=f"z{on} is already on in slot {slot} at step {step}"):
        replay(kept, step, 1, turned_on=(slot, on))


@pytest.mark.parametrize("form", ["squared", "absolute"])
def test_the_replay_steps_on_under_the_capacity_form_asked(kept, form):
    from vase.config import load_run_config

    gamma = load_run_config(kept, trains=False).objective.gamma
    result = replay(kept, STAGE, 4, capacity_form=form)
    assert result.capacity_form == form and result.run_capacity_form == "squared"
    for r in result.steps:  # eq. 8 with the paper's rules: reconstruction + gamma * the capacity term
        gap = abs(r.kl - r.capacity)
        assert r.mdl == pytest.approx(r.reconstruction + gamma * (gap ** 2 if form == "squared" else gap), rel=1e-5)
    text = replay_text(result)
    assert ("eq. 8's capacity term: absolute (the run's: squared)" in text) == (form == "absolute")
