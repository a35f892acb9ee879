"""`vase train --branch RUN_DIR --at STEP`: a new run from another run's kept checkpoint."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from test_cli import invoke, sprite_data, tiny_args  # noqa: F401 (sprite_data is a fixture)
from test_reliability import assert_same_learner, comparable, learner_state, read_results, scalar_series

from cli import main
from vase import checkpoint
from vase.config import load_run_config

STAGE = 8  # steps per environment: stages end at 8, 16 and 24
# S, D and A off: the CCI-VAE, "-"
SWITCHES_OFF = ("--set", "inference.enabled=false", "--set", "dream.enabled=false", "--set", "mask.enabled=false")


@pytest.fixture(scope="module")
def straight(tmp_path_factory, sprite_data):  # noqa: F811
    run = tmp_path_factory.mktemp("branching") / "straight"
    result = invoke(tiny_args(run, sprite_data, steps=STAGE))
    assert result.exit_code == 0, result.output
    return run


def branch(source: Path, target: Path, *extra: str):
    return CliRunner().invoke(main, ["train", "--branch", str(source), "--run-dir", str(target), "--no-progress",
                                     *extra])


def test_a_branch_without_overrides_is_the_source_run_from_its_step_on(straight, tmp_path):
    result = branch(straight, tmp_path / "b", "--at", str(STAGE))
    assert result.exit_code == 0, result.output
    b = tmp_path / "b"
    assert_same_learner(learner_state(b), learner_state(straight))
    assert comparable(read_results(b)) == comparable(read_results(straight))
    assert scalar_series(b / "tb") == scalar_series(straight / "tb")
    assert checkpoint.kept_steps(b) == checkpoint.kept_steps(straight) == [STAGE, 2 * STAGE, 3 * STAGE]
    assert json.loads((b / "branch.json").read_text()) == {"source": str(straight), "step": STAGE, "overrides": []}
    assert read_results(b)["branch"] == {"source": "straight", "step": STAGE, "overrides": []}
    assert read_results(straight)["branch"] is None


def test_a_branch_killed_while_it_copies_leaves_no_run_and_the_next_attempt_branches(
        straight, tmp_path, monkeypatch):
    """The copy goes to a hidden staging folder renamed into place, so a kill half-way leaves nothing
    that `--resume` or `vase grid` would take for a run, and the same command then branches."""
    import vase.branching

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    b = tmp_path / "b"
    with monkeypatch.context() as m:
        m.setattr(vase.branching, "save_checkpoint", killed)  # after the encoders and TensorBoard are copied
        assert branch(straight, b, "--at", str(STAGE)).exit_code != 0
    assert not b.exists() and (tmp_path / ".b.partial" / "tb").is_dir()
    result = branch(straight, b, "--at", str(STAGE))
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]
    assert_same_learner(learner_state(b), learner_state(straight))


def test_a_branch_with_other_rules_keeps_the_history_before_its_step(straight, tmp_path):
    b = tmp_path / "paper"
    result = branch(straight, b, "--at", str(STAGE), "--set", "inference.rules=paper")
    assert result.exit_code == 0, result.output
    assert load_run_config(b).inference.rules == "paper" and load_run_config(straight).inference.rules != "paper"
    before = [e for e in read_results(straight)["inference_events"] if e["step"] < STAGE]
    assert [e for e in read_results(b)["inference_events"] if e["step"] < STAGE] == before
    assert read_results(b)["probes"]["history"][0] == read_results(straight)["probes"]["history"][0]


def test_the_switches_turned_off_at_the_first_stage_end_train_the_cci_vae_run(straight, sprite_data, tmp_path):  # noqa: F811
    """Before the first allocation S, D and A change nothing of the model (one slot, no past
    environment to dream, no other slot's latents to mask), so "-" branched from SDA at the end of
    the first stage is the "-" run trained from scratch, bit for bit (docs/usage.md, rows that share
    a first stage)."""
    scratch = tmp_path / "scratch"
    assert invoke(tiny_args(scratch, sprite_data, steps=STAGE) + ["--ablation=-"]).exit_code == 0
    b = tmp_path / "b"
    result = branch(straight, b, "--at", str(STAGE), *SWITCHES_OFF)
    assert result.exit_code == 0, result.output
    ours, theirs = learner_state(b), learner_state(scratch)
    assert ours["step"] == theirs["step"] == 3 * STAGE
    for key in theirs["model"]:
        assert torch.equal(ours["model"][key], theirs["model"][key]), key
    assert torch.equal(ours["generator"], theirs["generator"]) and torch.equal(ours["torch_rng"], theirs["torch_rng"])
    ran, made = read_results(b), read_results(scratch)
    assert ran["ablation"] == made["ablation"] == "-"
    for key in ("probes", "heldout_reconstruction_matrix", "latent_use"):
        assert ran[key] == made[key], key
    # not trivially: the state it started from is SDA's, whose classifier trained through the stage
    source_at, scratch_at = (checkpoint.load_checkpoint(run, STAGE)[0]["learner"] for run in (straight, scratch))
    classifier = source_at["classifier"]
    assert any(not torch.equal(classifier[k], scratch_at["classifier"][k]) for k in classifier)


def test_a_branch_not_yet_trained_says_it_has_come_as_far_as_its_step(straight, tmp_path):
    from vase.branching import plan_branch, write_branch
    from vase.progress_file import read_progress

    target = tmp_path / "b"
    write_branch(plan_branch(straight, STAGE, ["inference.enabled=false"]), target)
    assert read_progress(target) == STAGE
    assert json.loads((target / "progress.json").read_text())["total"] == 3 * STAGE


@pytest.mark.parametrize("links", [True, False])
def test_a_branch_shares_the_files_its_source_wrote_once_and_neither_changes_the_others(
        straight, tmp_path, monkeypatch, links):
    """The kept checkpoints and the probe points' encoders before the step are hard links where the
    filesystem has them (else copies): a rewrite in the source renames a new file over the name, and
    the branch's keeps the old bytes."""
    import os

    import vase.branching
    from vase.branching import plan_branch, write_branch
    from vase.checkpoint import kept_path, write_atomic
    from vase.evaluation import encoder_path

    if not links:
        def no_links(*args):
            raise OSError("hard links not supported")
        monkeypatch.setattr(vase.branching.os, "link", no_links)
    target = tmp_path / "b"
    write_branch(plan_branch(straight, 2 * STAGE, []), target)
    shared = [(kept_path(straight, STAGE), kept_path(target, STAGE)),
              (encoder_path(straight, STAGE), encoder_path(target, STAGE))]
    for source_file, branch_file in shared:
        assert branch_file.read_bytes() == source_file.read_bytes()
        assert os.path.samefile(source_file, branch_file) == links
    assert checkpoint.kept_steps(target) == [STAGE, 2 * STAGE]
    source_file, branch_file = shared[0]
    before = branch_file.read_bytes()
    try:
        write_atomic(source_file, b"rewritten")
        assert branch_file.read_bytes() == before
    finally:
        write_atomic(source_file, before)


def test_a_branch_may_change_the_length_of_the_stages_after_its_step(straight, tmp_path):
    result = branch(straight, tmp_path / "b", "--at", str(STAGE), "--steps", f"{STAGE},{STAGE},4")
    assert result.exit_code == 0, result.output
    assert read_results(tmp_path / "b")["steps"] == 2 * STAGE + 4


@pytest.mark.parametrize("extra, message", [
    ([], "--branch RUN_DIR needs --at STEP"),
    (["--at", "3"], "no checkpoint of step 3"),
    (["--at", str(STAGE), "--set", "model.latents=4"], "model.latents shaped; these cannot change at a branch"),
    (["--at", str(STAGE), "--set", "train.seed=3"], "train.seed shaped"),
    (["--at", str(STAGE), "--seed", "3"], "drop --seed"),
    (["--at", str(2 * STAGE), "--steps", "6"], "must keep the stages trained by step 16 as they were"),
    (["--at", str(STAGE), "--sequence", "shapes_b,moving_shapes_a,moving_shapes_b"], "data.sequence shaped"),
    (["--at", str(3 * STAGE)], "nothing to train after step 24"),
])
def test_a_branch_that_cannot_continue_the_state_is_refused_in_one_line_and_writes_nothing(
        straight, tmp_path, extra, message):
    result = branch(straight, tmp_path / "b", *extra)
    assert result.exit_code != 0 and message in result.output, result.output
    assert "Traceback" not in result.output and not (tmp_path / "b").exists()


def _edit_state(source: Path, step: int, edit) -> None:
    state, meta = checkpoint.load_checkpoint(source, step)
    edit(state)
    checkpoint.save_checkpoint(source, state, meta, keep=True)


def _edit_config(source: Path, section: str, name: str, value) -> None:
    config = json.loads((source / "config.json").read_text())
    config[section][name] = value
    (source / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("edit, message", [
    (lambda s: _edit_state(s, 2 * STAGE, lambda st: st["learner"]["inference"].update(n_envs=2)),
     "inferred 2 environments by step 16"),
    (lambda s: _edit_state(s, 2 * STAGE, lambda st: st["record"].update(pending=3)),
     "held 3 pending batches out of training by step 16"),
    (lambda s: _edit_config(s, "inference", "rules", "paper"), "may mask latents of its one slot"),
])
def test_switching_inference_off_where_the_source_did_not_train_as_one_slot_is_refused(
        straight, tmp_path, edit, message):
    """A "-" branch is the "-" run only if the source trained as it would have: one slot, no pending
    batch held out, no latent of the slot masked. Hand-made sources that break each are refused."""
    source = tmp_path / "source"
    shutil.copytree(straight, source)
    edit(source)
    result = branch(source, tmp_path / "late", "--at", str(2 * STAGE), *SWITCHES_OFF)
    assert result.exit_code != 0 and message in result.output, result.output
    assert "Traceback" not in result.output and not (tmp_path / "late").exists()


def test_switching_inference_off_before_the_first_allocation_trains(straight, tmp_path):
    source = tmp_path / "source"
    shutil.copytree(straight, source)
    _edit_state(source, 2 * STAGE, lambda st: st["learner"]["inference"].update(n_envs=2))
    assert branch(source, tmp_path / "early", "--at", str(STAGE), *SWITCHES_OFF).exit_code == 0


def test_a_branch_onto_its_own_source_is_refused_and_the_source_is_kept(straight):
    before = learner_state(straight)
    result = branch(straight, straight, "--at", str(STAGE), "--overwrite")
    assert result.exit_code != 0 and "give a --run-dir other than" in result.output
    assert_same_learner(learner_state(straight), before)


def test_at_without_branch_and_branch_with_resume_are_refused(straight, tmp_path):
    alone = CliRunner().invoke(main, ["train", "--at", "8", "--run-dir", str(tmp_path / "x")])
    assert alone.exit_code != 0 and "--at goes with --branch RUN_DIR" in alone.output
    both = CliRunner().invoke(main, ["train", "--resume", str(straight), "--branch", str(straight), "--at", "8"])
    assert both.exit_code != 0 and "drop --branch, --at" in both.output
