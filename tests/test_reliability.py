"""Faults and bad inputs (issue 6): exact resume after SIGKILL, atomic and verified checkpoints,
safe loading, numerical faults, and one clear line (never a traceback) for every bad input.

docs/reliability.md lists every row checked here with the behaviour observed.
"""
from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from test_cli import fails_in_one_line, invoke, tiny_args
from test_learner import same_state

from cli import main
from vase import checkpoint
from vase.checkpoint import load_checkpoint, save_checkpoint
from vase.errors import CheckpointError


@pytest.fixture(scope="module")
def sprite_data(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("sprite_data")


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, sprite_data) -> Path:
    """A finished 10-step, one-environment run: latest.pt at step 10, previous.pt at step 5."""
    run = tmp_path_factory.mktemp("finished") / "run"
    result = invoke(tiny_args(run, sprite_data, steps=10) + ["--sequence", "moving_shapes_a"])
    assert result.exit_code == 0, result.output
    return run


@pytest.fixture
def run_copy(finished_run, tmp_path) -> Path:
    """A private copy of the finished run that a test may damage."""
    return Path(shutil.copytree(finished_run, tmp_path / "run"))


def resume(run: Path):
    return CliRunner().invoke(main, ["train", "--resume", str(run), "--no-progress"])


def learner_state(run: Path) -> dict:
    state, _ = load_checkpoint(run)
    return state["learner"]


def assert_same_learner(a: dict, b: dict) -> None:
    """Bit-identical weights of model, classifier and snapshot, and the same step and RNG states."""
    assert a["step"] == b["step"]
    for part in ("model", "classifier", "snapshot"):
        assert a[part].keys() == b[part].keys()
        for key in a[part]:
            assert torch.equal(a[part][key], b[part][key]), f"{part}.{key} differs"
    assert torch.equal(a["generator"], b["generator"]) and torch.equal(a["torch_rng"], b["torch_rng"])
    slots_a, slots_b = a["inference"]["slots"], b["inference"]["slots"]
    for key in ("mask", "alpha", "error", "usage"):
        assert torch.equal(slots_a[key], slots_b[key])


def comparable(results: dict) -> dict:
    """What two runs that trained alike share: all but the wall time and where a branch started."""
    return {k: v for k, v in results.items() if k not in ("wall_time_s", "branch")}


def read_results(run: Path) -> dict:
    return json.loads((run / "results.json").read_text())


# -- bad input: one clear line, no traceback ------------------------------------------------------------
@pytest.mark.parametrize(
    "extra, phrase",
    [
        (
            ["--set", "mask.lambda_low=2.0", "--set", "mask.lambda_high=1.0"],
            "mask.lambda_low (2.0) must be < mask.lambda_high",
        ),
        (["--steps", "0"], "data.steps_per_env must be positive"),
        (["--steps=-3"], "data.steps_per_env must be positive"),
        (["--steps", "ten"], "data.steps_per_env must be a comma-separated list of integers, got 'ten'"),
        (["--set", "train.batch_size=0"], "train.batch_size must be positive"),
        (["--set", "dream.batch_size=-1"], "dream.batch_size must be positive"),
        (["--set", "model.k_max=0"], "model.k_max must be at least 1"),
        (["--set", "objective.gamma=-1"], "objective.gamma must be >= 0"),
        (["--set", "train.no_such_field=1"], "unknown setting 'train.no_such_field'"),
        (["--set", "nosection.x=1"], "unknown setting 'nosection.x'"),
        (["--set", "train.batch_size=big"], "cannot read 'big' as int"),
        (["--ablation", "SDX"], "unknown ablation 'SDX'"),
    ],
    ids=[
        "lambda1>=lambda2",
        "steps0",
        "steps-negative",
        "steps-text",
        "batch0",
        "dream-batch",
        "kmax0",
        "gamma-negative",
        "unknown-field",
        "unknown-section",
        "bad-int",
        "bad-ablation",
    ],
)
def test_bad_setting_fails_in_one_line(tmp_path, extra, phrase):
    result = invoke(tiny_args(tmp_path / "run", tmp_path / "data") + extra)
    fails_in_one_line(result, phrase)
    assert not (tmp_path / "run").exists()  # refused before anything was created


def test_unknown_environment_lists_the_known_ones(tmp_path):
    result = invoke(tiny_args(tmp_path / "run", tmp_path / "data") + ["--sequence", "mnist,moving_cats"])
    line = fails_in_one_line(result, "unknown environment(s) moving_cats", "known: mnist, moving_mnist")
    assert "moving_shapes_b" in line


def test_unknown_environment_in_a_set_override_is_refused_too(tmp_path):
    result = invoke(tiny_args(tmp_path / "run", tmp_path / "data") + ["--set", "data.sequence=mnist,cats"])
    fails_in_one_line(result, "unknown environment 'cats'", "known environments: mnist")
    assert not (tmp_path / "run").exists()


def test_missing_digit_data_says_how_to_fix(tmp_path):
    result = invoke(tiny_args(tmp_path / "run", tmp_path / "empty_root") + ["--sequence", "mnist"])
    fails_in_one_line(result, "MNIST file missing", "vase data import")
    assert not (tmp_path / "run").exists()  # bad input leaves no run directory to --overwrite


def test_data_root_that_is_not_a_folder(tmp_path, monkeypatch):
    not_a_dir = tmp_path / "root.txt"
    not_a_dir.write_text("x")
    # Through --data-root, click refuses it; through VASE_DATA_ROOT the data layer names the missing file.
    fails_in_one_line(invoke(tiny_args(tmp_path / "a", not_a_dir) + ["--sequence", "mnist"]), "is a file")
    monkeypatch.setenv("VASE_DATA_ROOT", str(not_a_dir))
    args = [a for a in tiny_args(tmp_path / "b", tmp_path) if a not in ("--data-root", str(tmp_path))]
    fails_in_one_line(invoke(args + ["--sequence", "fashion"]), "FashionMNIST file missing")


def test_corrupt_digit_file_is_named(digit_root, tmp_path):
    root = tmp_path / "root"
    shutil.copytree(digit_root / "MNIST" / "raw", root / "MNIST" / "raw", ignore=shutil.ignore_patterns("*-ubyte"))
    victim = root / "MNIST" / "raw" / "train-labels-idx1-ubyte.gz"
    victim.write_bytes(victim.read_bytes()[:100])
    result = invoke(tiny_args(tmp_path / "run", root) + ["--sequence", "mnist"])
    fails_in_one_line(result, "MNIST file corrupt (MD5 mismatch)", "train-labels-idx1-ubyte.gz")


def test_existing_run_dir_is_refused(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "notes.txt").write_text("mine")
    result = invoke(tiny_args(run, tmp_path / "data"))
    fails_in_one_line(result, "already exists", f"--resume {run}", "--overwrite")
    result = invoke(tiny_args(run, tmp_path / "data") + ["--overwrite"])
    fails_in_one_line(result, "refusing to --overwrite", "not a vase run directory")
    assert (run / "notes.txt").read_text() == "mine"
    as_file = tmp_path / "file"
    as_file.write_text("")
    fails_in_one_line(invoke(tiny_args(as_file, tmp_path / "data")), "is a file")


def test_resume_refuses_options_it_would_ignore(run_copy):
    saved = (run_copy / "config.json").read_text()
    result = CliRunner().invoke(main, ["train", "--resume", str(run_copy), "--set", "train.keep_every=2",
                                       "--seed", "3"])
    fails_in_one_line(result, "--resume continues a run with its own config.json", "drop --seed")
    # Of the settings, only those that say which checkpoints are kept may change on a resume.
    result = CliRunner().invoke(main, ["train", "--resume", str(run_copy), "--set", "train.keep_every=2",
                                       "--set", "train.lr=1"])
    fails_in_one_line(result, "only train.keep_every may be set again, not train.lr")
    fails_in_one_line(CliRunner().invoke(main, ["train", "--resume", str(run_copy), "--set", "train.keep_every=-1"]),
                      "train.keep_every must be >= 0")
    assert (run_copy / "config.json").read_text() == saved


def test_resume_of_a_directory_that_is_not_a_run(tmp_path):
    fails_in_one_line(resume(tmp_path), "config.json not found")


def test_resume_with_an_incompatible_config_version(run_copy):
    path = run_copy / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | {"version": 99}))
    fails_in_one_line(resume(run_copy), "config version 99", "cannot be resumed")


def test_resume_with_an_incompatible_checkpoint_format(run_copy):
    path = run_copy / "checkpoints" / "latest.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | {"format": 99}))
    fails_in_one_line(resume(run_copy), "incompatible version (checkpoint format 99")


# -- checkpoints: verified, with a fallback; safe loading ----------------------------------------------
def test_truncated_latest_falls_back_to_previous_and_resumes_exactly(finished_run, run_copy):
    latest = run_copy / "checkpoints" / "latest.pt"
    latest.write_bytes(latest.read_bytes()[: latest.stat().st_size // 2])
    result = resume(run_copy)
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output
    assert "latest.pt is truncated or corrupted" in result.stderr
    assert "resuming from the previous checkpoint (step 5)" in result.stderr
    # Steps 5..10 trained again from previous.pt give the very same weights and probes.
    assert_same_learner(learner_state(run_copy), learner_state(finished_run))
    assert comparable(read_results(run_copy)) == comparable(read_results(finished_run))


def test_no_verifiable_checkpoint_is_a_clear_error(run_copy):
    for slot in ("latest", "previous"):
        path = run_copy / "checkpoints" / f"{slot}.pt"
        path.write_bytes(b"garbage")
    fails_in_one_line(resume(run_copy), "no usable checkpoint", "latest.pt is truncated or corrupted")


class Exploit:
    """A pickle that runs a shell command when unpickled."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_malicious_checkpoint_is_refused(run_copy, tmp_path):
    marker = tmp_path / "pwned"
    buffer = io.BytesIO()
    torch.save({"learner": Exploit(marker)}, buffer)
    data = buffer.getvalue()
    directory = run_copy / "checkpoints"
    (directory / "latest.pt").write_bytes(data)
    meta = json.loads((directory / "latest.json").read_text())
    meta["sha256"] = hashlib.sha256(data).hexdigest()  # the checksum matches: only the loader can refuse it
    (directory / "latest.json").write_text(json.dumps(meta))
    fails_in_one_line(resume(run_copy), "refusing to load", "latest.pt", "GLOBAL posix.system")
    with pytest.raises(CheckpointError, match="objects other than tensors"):
        load_checkpoint(run_copy)
    assert not marker.exists()


class KilledHere(BaseException):
    """Stands in for a SIGKILL: nothing after the raise point runs, no cleanup code catches it."""


@pytest.mark.parametrize(
    "dies_at", [0, 1, 2, 3], ids=["before-rotation", "mid-rotation", "json-promoted", "pt-promoted"]
)
def test_a_save_killed_between_renames_leaves_a_verified_checkpoint(tmp_path, monkeypatch, dies_at):
    """Kill the save of step 3 at each of its four renames: loading finds step 3 (fully staged) or step 2."""
    for step in (1, 2):
        save_checkpoint(tmp_path, {"x": torch.tensor([step])}, {"step": step})
    calls, real_replace = [], os.replace

    def replace(src, dst):
        if Path(src).parent.name == "checkpoints" and not str(src).endswith(".tmp"):
            if len(calls) == dies_at:
                raise KilledHere
            calls.append(src)
        real_replace(src, dst)

    monkeypatch.setattr(checkpoint.os, "replace", replace)
    with pytest.raises(KilledHere):
        save_checkpoint(tmp_path, {"x": torch.tensor([3])}, {"step": 3})
    monkeypatch.setattr(checkpoint.os, "replace", real_replace)
    with pytest.warns(UserWarning, match="resuming from the newer checkpoint staged.pt"):
        state, meta = load_checkpoint(tmp_path)
    assert meta["step"] == 3 and int(state["x"]) == 3
    # The next save repairs the layout: latest is step 4 and some other slot still verifies.
    save_checkpoint(tmp_path, {"x": torch.tensor([4])}, {"step": 4})
    state, meta = load_checkpoint(tmp_path)
    assert meta["step"] == 4
    (tmp_path / "checkpoints" / "latest.pt").write_bytes(b"")
    with pytest.warns(UserWarning, match="resuming from"):
        _, meta = load_checkpoint(tmp_path)
    assert meta["step"] in (2, 3)


def test_a_stage_end_checkpoint_stays_after_newer_saves_and_loads_by_its_step(tmp_path):
    for step in (2, 4, 6, 8):
        save_checkpoint(tmp_path, {"x": torch.tensor([step])}, {"step": step}, keep=step == 4)
    assert checkpoint.kept_steps(tmp_path) == [4]
    state, meta = load_checkpoint(tmp_path)  # resume still takes the newest
    assert meta["step"] == 8 and int(state["x"]) == 8
    state, meta = load_checkpoint(tmp_path, 4)  # rotated out of latest/previous long ago
    assert meta["step"] == 4 and int(state["x"]) == 4
    with pytest.raises(CheckpointError, match="here of step 4, 6, 8"):
        load_checkpoint(tmp_path, 5)
    checkpoint.kept_path(tmp_path, 4).write_bytes(b"torn")
    with pytest.raises(CheckpointError, match="step-00000004.pt is truncated or corrupted"):
        load_checkpoint(tmp_path, 4)


def test_a_run_killed_during_its_first_save_has_no_checkpoint(tmp_path, monkeypatch):
    """staged.pt written, staged.json not: nothing to resume from, so `--resume` starts at step 0."""
    real_write = checkpoint.write_atomic

    def write_atomic(path, data):
        if Path(path).name == "staged.json":
            raise KilledHere
        real_write(path, data)

    monkeypatch.setattr(checkpoint, "write_atomic", write_atomic)
    with pytest.raises(KilledHere):
        save_checkpoint(tmp_path, {"x": torch.tensor([1])}, {"step": 1})
    assert (tmp_path / "checkpoints" / "staged.pt").exists()
    assert not checkpoint.has_checkpoint(tmp_path)


def test_disk_full_while_checkpointing_keeps_the_previous_checkpoint(tmp_path, sprite_data, monkeypatch):
    real_open, saves = open, []

    def open_(path, mode="r", *args, **kwargs):
        f = real_open(path, mode, *args, **kwargs)
        if Path(path).name.startswith("staged.pt"):
            saves.append(path)
            if len(saves) > 1:  # the first checkpoint (step 5) succeeds, the second runs out of space
                f.write = lambda data: (_ for _ in ()).throw(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
        return f

    monkeypatch.setattr(checkpoint, "open", open_, raising=False)
    run = tmp_path / "run"
    result = invoke(tiny_args(run, sprite_data, steps=10) + ["--sequence", "moving_shapes_a"])
    fails_in_one_line(
        result, "No space left on device", "checkpoints already on disk are kept", "last good checkpoint: step 5"
    )
    monkeypatch.undo()
    _, meta = load_checkpoint(run)
    assert meta["step"] == 5
    assert not list((run / "checkpoints").glob("*.tmp"))


def test_other_io_errors_are_one_line(tmp_path, sprite_data, monkeypatch):
    """A full disk or read-only folder outside the checkpoints (here: TensorBoard) is no traceback either."""
    from vase import tensorboard_logger

    def read_only(logdir, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), logdir)

    monkeypatch.setattr(tensorboard_logger, "SummaryWriter", read_only)
    result = invoke(tiny_args(tmp_path / "run", sprite_data, steps=10) + ["--sequence", "moving_shapes_a"])
    fails_in_one_line(result, "tb: Read-only file system")


# -- numerical faults ---------------------------------------------------------------------------------
def test_nan_loss_stops_with_the_step_and_keeps_the_checkpoint(tmp_path, sprite_data, monkeypatch):
    from vase.stream import Stream

    real_batch = Stream.batch

    def batch(self, step, generator):
        x = real_batch(self, step, generator)
        return torch.full_like(x, float("nan")) if step == 7 else x

    monkeypatch.setattr(Stream, "batch", batch)
    run = tmp_path / "run"
    result = invoke(tiny_args(run, sprite_data, steps=10) + ["--sequence", "moving_shapes_a"])
    fails_in_one_line(result, "step 7:", "is nan", "last good checkpoint: step 5")
    _, meta = load_checkpoint(run)
    assert meta["step"] == 5
    assert not (run / "results.json").exists()


def test_exploding_learning_rate_stops_clearly(tmp_path, sprite_data):
    result = invoke(tiny_args(tmp_path / "run", sprite_data, steps=10) + ["--sequence", "moving_shapes_a",
                                                                          "--set", "train.lr=1e30"])
    fails_in_one_line(result, "loss term", "is nan", "try a lower train.lr")


# -- exact resume after SIGKILL -------------------------------------------------------------------------
# Runs `vase` in a subprocess that SIGKILLs itself at a chosen point (VASE_TEST_KILL):
#   step:N               right after training step N (mid-environment, before its logging and checkpoint)
#   alloc:N              right after the first environment allocation at step >= N
#   replace:NAME:K       inside the K-th checkpoint save of this process, at the rename of NAME
#                        (latest.pt: staged files written, nothing renamed; latest.json: latest.pt already
#                        moved to previous.pt; staged.pt: latest.json already new, latest.pt still old)
KILLER = r"""
import os, signal, sys

kind, *args = os.environ["VASE_TEST_KILL"].split(":")

def die():
    os.kill(os.getpid(), signal.SIGKILL)

if kind in ("step", "alloc"):
    from vase.learner import Learner

    original = Learner.training_step

    def training_step(self, x):
        out = original(self, x)
        if out.step >= int(args[0]) and (kind == "step" or out.decision.allocated):
            die()
        return out

    Learner.training_step = training_step
elif kind == "replace":
    name, nth, seen, real_replace = args[0], int(args[1]), [], os.replace

    def replace(src, dst, *a, **k):
        if os.path.basename(str(src)) == name:
            seen.append(src)
            if len(seen) == nth:
                die()
        return real_replace(src, dst, *a, **k)

    os.replace = replace

from cli import main

main(sys.argv[1:], prog_name="vase")
"""

# One run, killed again and again: (where this process is killed, what it must say on resuming the
# previous one). Checkpoints fall every 5 steps and at the environment ends 20, 40, 60.
KILL_CHAIN = [
    ("step:2", None),  # before the first checkpoint
    ("alloc:1", "stopped before its first checkpoint"),  # starts again at 0; killed at the allocation of step 5
    ("step:13", None),  # resumes at 5; killed mid-environment, 3 steps after the step-10 checkpoint
    ("replace:latest.pt:2", None),  # resumes at 10; killed in the save of step 20 (a boundary), once staged
    ("replace:latest.json:2", "a checkpoint save was interrupted after"),  # resumes at 20; killed mid-rotation at 30
    ("replace:staged.pt:1", "latest.pt is missing"),  # resumes at 30; killed between the renames of 35
    (None, "latest.pt is missing"),  # resumes at 35 and finishes
]
RESUME_SETTINGS = {"inference__kappa": 0.8, "inference__patience": 1, "model__k_max": 4}


def run_killable(args: list[str], kill: str | None, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("VASE_TEST_KILL", None)
    if kill:
        env["VASE_TEST_KILL"] = kill
    cmd = [sys.executable, "-c", KILLER, *args] if kill else [sys.executable, "-m", "cli", *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def scalar_series(tb_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.mark.slow
def test_sigkill_at_any_moment_then_resume_is_bit_identical(tmp_path, sprite_data):
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    result = invoke(tiny_args(straight, sprite_data, **RESUME_SETTINGS))
    assert result.exit_code == 0, result.output
    events = read_results(straight)["inference_events"]
    assert any(e["verdict"] == "new" and e["step"] >= 1 for e in events), "no allocation after step 0 to kill at"

    for i, (kill, notice) in enumerate(KILL_CHAIN):
        args = (
            tiny_args(killed, sprite_data, **RESUME_SETTINGS)
            if i == 0
            else ["train", "--resume", str(killed), "--no-progress"]
        )
        proc = run_killable(args, kill, tmp_path)
        if kill:
            assert proc.returncode == -signal.SIGKILL, f"{kill}: exit {proc.returncode}\n{proc.stderr[-2000:]}"
        else:
            assert proc.returncode == 0, proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
        if notice is not None:
            assert notice in proc.stderr, (KILL_CHAIN[i - 1][0], proc.stderr[-2000:])

    assert_same_learner(learner_state(killed), learner_state(straight))
    a, b = load_checkpoint(killed)[0]["learner"], load_checkpoint(straight)[0]["learner"]
    for group_a, group_b in zip(a["optimizer"]["state"].values(), b["optimizer"]["state"].values()):
        assert all(torch.equal(group_a[k], group_b[k]) for k in group_a)
    assert comparable(read_results(killed)) == comparable(read_results(straight))
    # TensorBoard: the events a killed process wrote after its checkpoint were purged, none is missing.
    assert scalar_series(killed / "tb") == scalar_series(straight / "tb")
    straight_encoders = sorted(p.name for p in (straight / "checkpoints" / "encoders").iterdir())
    assert sorted(p.name for p in (killed / "checkpoints" / "encoders").iterdir()) == straight_encoders
    # The checkpoints kept at the stage ends are those of the straight run.
    stages = checkpoint.kept_steps(straight)
    assert len(stages) == len(read_results(straight)["sequence"]) and checkpoint.kept_steps(killed) == stages
    for step in stages:
        assert_same_learner(load_checkpoint(killed, step)[0]["learner"], load_checkpoint(straight, step)[0]["learner"])


@pytest.mark.slow
def test_probes_do_not_change_training(tmp_path, sprite_data):
    """Probe evaluations read the encoder only: a run with probes every 10 steps and a run without
    probes end with bit-identical learners (weights, Adam states, masks, RNG streams, C(t) step)."""
    with_probes, without = tmp_path / "with", tmp_path / "without"
    assert invoke(tiny_args(with_probes, sprite_data)).exit_code == 0
    assert invoke(tiny_args(without, sprite_data, probe__enabled="false")).exit_code == 0
    a, b = learner_state(with_probes), learner_state(without)
    assert_same_learner(a, b)
    assert same_state(a["inference"], b["inference"])  # the slots (masks, L_s, usage) and eq. 6's state
    assert "probes" in read_results(with_probes) and "probes" not in read_results(without)


def test_ctrl_c_stops_the_run_between_two_steps_and_prints_how_to_resume(tmp_path, sprite_data, monkeypatch,
                                                                         sigint_handled):
    """SIGINT during a step finishes that step, then stops the run at the step boundary (never
    inside a library's critical section), with the resume line; a second SIGINT is not needed."""
    from vase.learner import Learner

    started, finished = [], []
    real_step = Learner.training_step

    def interrupted_step(self, x):
        started.append(self.step)
        if len(started) == 3:
            os.kill(os.getpid(), signal.SIGINT)  # arrives before the step's own work
        out = real_step(self, x)
        finished.append(self.step)
        return out

    monkeypatch.setattr(Learner, "training_step", interrupted_step)
    before = signal.getsignal(signal.SIGINT)
    run = tmp_path / "run"
    result = CliRunner().invoke(main, tiny_args(run, sprite_data, steps=10) + ["--sequence", "moving_shapes_a"])
    assert result.exit_code == 130, result.output
    assert f"interrupted; resume with: vase train --resume {run}" in result.output
    assert started == [0, 1, 2] and finished == [1, 2, 3]  # the third step completed; no fourth began
    assert signal.getsignal(signal.SIGINT) is before  # the handler is given back
    # What was trained is kept: a checkpoint of step 3, though the run checkpoints every 5 steps.
    assert json.loads((run / "checkpoints" / "latest.json").read_text())["step"] == 3


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_run_stopped_between_checkpoints_keeps_its_steps_and_resumes_exactly(tmp_path, sprite_data, monkeypatch,
                                                                              sig, sigint_handled):
    """Ctrl-C, or a scheduler's SIGTERM at a job's time limit, checkpoints the steps trained since the
    last checkpoint; the resume starts there and ends as the run that was never stopped."""
    from vase.learner import Learner

    def args(run: Path) -> list[str]:
        sequence = ["--sequence", "moving_shapes_a,shapes_b"]
        return tiny_args(run, sprite_data, steps=10, train__checkpoint_every=4) + sequence

    assert CliRunner().invoke(main, args(tmp_path / "straight")).exit_code == 0
    real_step = Learner.training_step

    def stopped_at_6(self, x):
        if self.step == 5:
            os.kill(os.getpid(), sig)
        return real_step(self, x)

    monkeypatch.setattr(Learner, "training_step", stopped_at_6)
    run = tmp_path / "stopped"
    result = CliRunner().invoke(main, args(run))
    assert result.exit_code == 130 and "interrupted; resume with" in result.output
    assert json.loads((run / "checkpoints" / "latest.json").read_text())["step"] == 6
    resumed = []
    monkeypatch.setattr(Learner, "training_step", lambda self, x: (resumed.append(self.step), real_step(self, x))[1])
    assert CliRunner().invoke(main, ["train", "--resume", str(run)]).exit_code == 0
    assert resumed[0] == 6
    assert comparable(read_results(run)) == comparable(read_results(tmp_path / "straight"))


def test_a_run_checkpoints_by_the_clock_too_and_that_changes_nothing_it_trains(tmp_path, sprite_data, monkeypatch):
    """train.checkpoint_minutes: a checkpoint once that much wall clock has passed since the last one,
    counted from any checkpoint; the run trains as one that checkpoints only at its stage ends, and a
    crash loses only the steps since the clock's last checkpoint."""
    from vase import trainer
    from vase.learner import Learner
    from vase.trainer import Trainer

    def args(run: Path, minutes: float) -> list[str]:
        settings = {"train__checkpoint_every": 1000, "train__checkpoint_minutes": minutes}
        return tiny_args(run, sprite_data, steps=10, **settings) + ["--sequence", "moving_shapes_a,shapes_b"]

    assert CliRunner().invoke(main, args(tmp_path / "straight", 0)).exit_code == 0
    straight = comparable(read_results(tmp_path / "straight"))
    clock, saved, crash_at = [0.0], [], [None]
    real_step, real_checkpoint = Learner.training_step, Trainer.checkpoint

    def one_minute_a_step(self, x):
        if self.step == crash_at[0]:
            raise RuntimeError("the machine went away")
        clock[0] += 60.0
        return real_step(self, x)

    def recorded(self, keep=False):
        saved.append(self.learner.step)
        return real_checkpoint(self, keep)

    monkeypatch.setattr(trainer, "now", lambda: clock[0])
    monkeypatch.setattr(Learner, "training_step", one_minute_a_step)
    monkeypatch.setattr(Trainer, "checkpoint", recorded)
    assert CliRunner().invoke(main, args(tmp_path / "clocked", 3)).exit_code == 0
    # Every 3 minutes, and the stage ends at 10 and 20; the end of stage 1 restarts the count.
    assert saved == [3, 6, 9, 10, 13, 16, 19, 20]
    assert comparable(read_results(tmp_path / "clocked")) == straight
    crash_at[0], run = 7, tmp_path / "crashed"
    assert CliRunner().invoke(main, args(run, 3)).exit_code != 0
    assert json.loads((run / "checkpoints" / "latest.json").read_text())["step"] == 6
    crash_at[0] = None
    assert CliRunner().invoke(main, ["train", "--resume", str(run)]).exit_code == 0
    assert comparable(read_results(run)) == straight


def test_train_keep_every_keeps_those_checkpoints_for_good_and_a_branch_from_one_is_the_run(tmp_path, sprite_data):
    """train.keep_every: the checkpoints of every N steps stay beside the stage ends', training is
    unchanged by them, and a branch without overrides from one of them trains on as the run did."""
    def args(run: Path, keep_every: int) -> list[str]:
        settings = {"train__checkpoint_every": 1000, "train__keep_every": keep_every}
        return tiny_args(run, sprite_data, steps=10, **settings) + ["--sequence", "moving_shapes_a,shapes_b"]

    straight, kept = tmp_path / "straight", tmp_path / "kept"
    assert CliRunner().invoke(main, args(straight, 0)).exit_code == 0
    assert CliRunner().invoke(main, args(kept, 4)).exit_code == 0
    assert checkpoint.kept_steps(straight) == [10, 20]
    assert checkpoint.kept_steps(kept) == [4, 8, 10, 12, 16, 20]
    assert comparable(read_results(kept)) == comparable(read_results(straight))
    state, meta = load_checkpoint(kept, step=12)
    assert meta["step"] == 12
    with pytest.raises(CheckpointError, match=r"no checkpoint of step 6 .* here of step 4, 8, 10, 12, 16, 20"):
        load_checkpoint(kept, step=6)
    branch = tmp_path / "branch"
    result = CliRunner().invoke(main, ["train", "--branch", str(kept), "--at", "12", "--run-dir", str(branch),
                                       "--no-progress"])
    assert result.exit_code == 0, result.output
    assert checkpoint.kept_steps(branch) == [4, 8, 10, 12, 16, 20]
    assert comparable(read_results(branch)) == comparable(read_results(straight))


def test_a_resume_may_start_keeping_checkpoints_and_trains_on_as_the_run_did(tmp_path, sprite_data):
    """`--resume RUN --set train.keep_every=N`: from the resume on, every N steps' checkpoint stays for
    good, config.json records N and nothing else changes, and the training is the straight run's."""
    def args(run: Path) -> list[str]:
        return (tiny_args(run, sprite_data, steps=10, train__checkpoint_every=1000)
                + ["--sequence", "moving_shapes_a,shapes_b"])

    straight, run = tmp_path / "straight", tmp_path / "run"
    assert CliRunner().invoke(main, args(straight)).exit_code == 0
    assert CliRunner().invoke(main, args(run) + ["--until", "9"]).exit_code == 0
    before = json.loads((run / "config.json").read_text())
    result = CliRunner().invoke(main, ["train", "--resume", str(run), "--set", "train.keep_every=4", "--no-progress"])
    assert result.exit_code == 0, result.output
    assert checkpoint.kept_steps(run) == [10, 12, 16, 20]  # the stage ends, and every 4 steps after the resume
    after = json.loads((run / "config.json").read_text())
    assert after["train"].pop("keep_every") == 4 and before["train"].pop("keep_every") == 0
    assert after == before
    assert comparable(read_results(run)) == comparable(read_results(straight))


def test_a_second_ctrl_c_interrupts_at_once_unless_it_is_the_grids_echo_of_the_first(monkeypatch, sigint_handled):
    from vase import trainer
    from vase.trainer import InterruptBetweenSteps

    clock = [100.0]
    monkeypatch.setattr(trainer.time, "monotonic", lambda: clock[0])
    interrupt = InterruptBetweenSteps()
    restore = interrupt.install()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        assert interrupt.requested  # recorded, not raised
        clock[0] += 0.01
        os.kill(os.getpid(), signal.SIGINT)  # `vase grid` forwarding the terminal's Ctrl-C: the same request
        clock[0] += InterruptBetweenSteps.REPEAT_AFTER_S
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)  # the user insists
        assert interrupt.requested
    finally:
        restore()
