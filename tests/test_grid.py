"""`vase grid`: the ablation grid planned, run (locally and on Ray), resumed, and gathered into Table 1.

The fast tests drive the planner and the backends with stand-in child programs; the slow ones train
tiny real grids and compare every cell with the `vase train` run it stands for.
"""
from __future__ import annotations

import io
import json
import os
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner
from test_cli import TINY, invoke, tiny_args
from test_reliability import KILLER, comparable, read_results

from cli import main
from vase import grid as grid_module
from vase.config import build_config
from vase.errors import ConfigError, VaseError
from vase.grid import (
    DONE,
    NEW,
    RESUME,
    TABLE1_ROWS,
    GridSpec,
    dry_run_lines,
    parse_modes,
    parse_rows,
    parse_seeds,
    plan,
    run_grid,
    train_arguments,
)
from vase.grid_backends import Job, LocalBackend, Outcome, execute, pack_dir, receive, unpack_dir

SEQUENCE = "moving_shapes_a,shapes_b"
STEPS = "10"


def tiny_spec(root: Path, data_root: Path, rows=("SDA", "-"), modes=("disentangled",), seeds=(0,)) -> GridSpec:
    overrides = tuple(f"{k}={v}" for k, v in TINY.items() if k != "train.threads")
    return GridSpec(tuple(rows), tuple(modes), tuple(seeds), root, "cpu", SEQUENCE, STEPS, overrides, 1, str(data_root))


def grid_cli_args(root: Path, data_root: Path, rows: str = "SDA,-") -> list[str]:
    args = ["grid", "--rows", rows, "--modes", "disentangled", "--seeds", "0", "--sequence", SEQUENCE, "--steps",
            STEPS, "--root", str(root), "--data-root", str(data_root), "--no-progress"]
    for key, value in TINY.items():
        if key != "train.threads":
            args += ["--set", f"{key}={value}"]
    return args


@pytest.fixture(scope="module")
def sprite_data(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("sprite_data")


# -- parsing the grid ------------------------------------------------------------------------------------
def test_seed_lists_and_ranges():
    assert parse_seeds("0-4") == (0, 1, 2, 3, 4)
    assert parse_seeds("0-2,7") == (0, 1, 2, 7)
    assert parse_seeds("3") == (3,)
    for bad in ("a", "3-1", "1,1", "0-2,2", ""):
        with pytest.raises(ConfigError):
            parse_seeds(bad)


def test_rows_are_checked_and_normalised():
    assert parse_rows("all") == TABLE1_ROWS and len(TABLE1_ROWS) == 9
    assert parse_rows("sda, -,SD-[41]") == ("SDA", "-", "SD-[41]")
    for bad in ("SDX", "SDA,SDA", ","):
        with pytest.raises(ConfigError):
            parse_rows(bad)
    assert parse_modes("entangled,disentangled") == ("entangled", "disentangled")
    with pytest.raises(ConfigError):
        parse_modes("beta")


def test_every_cell_of_the_paper_grid_is_its_own_run_with_its_own_switches(tmp_path):
    spec = GridSpec(TABLE1_ROWS, ("disentangled", "entangled"), (0, 1, 2, 3, 4), tmp_path)
    runs = spec.runs()
    assert len(runs) == 9 * 2 * 5 == len({r.run_dir for r in runs}) == len({r.log for r in runs})
    for run in runs:
        cfg = spec.config(run)
        assert cfg.ablation() == run.row
        assert cfg.objective.mode == run.mode and cfg.train.seed == run.seed and cfg.train.threads == 1
        assert cfg.data.sequence == ["moving_fashion", "mnist", "moving_mnist"]
        assert run.run_dir.parent == tmp_path.absolute() and "[" not in run.name


def test_the_train_arguments_of_a_cell_build_exactly_its_config(tmp_path, monkeypatch):
    """What the child `vase train` builds from the arguments is the config the planner compares with."""
    captured = {}

    class Capture:
        def __init__(self, cfg, path, progress=True, device="cpu"):
            captured["cfg"] = cfg
            raise VaseError("captured")

    monkeypatch.setattr("vase.trainer.Trainer", Capture)
    spec = replace(tiny_spec(tmp_path / "grid", tmp_path / "data", rows=TABLE1_ROWS, modes=("entangled",), seeds=(3,)),
                   overrides=("mask.lambda_high=2.5",))
    for run in spec.runs():
        result = CliRunner().invoke(main, train_arguments(spec, run, NEW))
        assert "captured" in result.output, result.output
        assert captured.pop("cfg").to_dict() == spec.config(run).to_dict(), run.name


# -- planning: new, resume, done, conflict ----------------------------------------------------------------
def test_plan_tells_new_resumed_and_finished_runs_apart_and_refuses_foreign_ones(tmp_path):
    spec = tiny_spec(tmp_path / "grid", tmp_path / "data", seeds=(0, 1, 2))
    runs = {r.name: r for r in spec.runs()}
    partial, finished, empty = runs["SDA-disentangled-s0"], runs["SDA-disentangled-s1"], runs["none-disentangled-s0"]
    for run in (partial, finished):
        run.run_dir.mkdir(parents=True)
        # Where the data lives is not what is trained: another data root is the same run.
        (run.run_dir / "config.json").write_text(build_config("cpu", spec.settings(run) + ["data.root=/elsewhere"],
                                                              run.row).to_json())
    (finished.run_dir / "results.json").write_text("{}")
    empty.run_dir.mkdir()
    status = {run.name: s for run, s in plan(spec)}
    assert status[partial.name] == RESUME and status[finished.name] == DONE and status[empty.name] == NEW
    assert sum(s == NEW for s in status.values()) == 4
    assert train_arguments(spec, partial, RESUME)[:3] == ["train", "--resume", str(partial.run_dir)]

    # Which checkpoints are kept is not what is trained: the grid resumes the run and keeps them from now on.
    keeping = replace(spec, overrides=spec.overrides + ("train.keep_every=2000",))
    assert {run.name: s for run, s in plan(keeping)}[partial.name] == RESUME
    assert train_arguments(keeping, partial, RESUME)[-2:] == ["--set", "train.keep_every=2000"]
    assert "--set" not in train_arguments(spec, partial, RESUME)

    other = replace(spec, steps="15")  # the same folders, other settings: refused, naming the difference
    with pytest.raises(VaseError, match=r"other settings \(data.steps_per_env: \[10\] -> \[15\]\)"):
        plan(other)
    stray = runs["none-disentangled-s2"].run_dir
    stray.mkdir()
    (stray / "notes.txt").write_text("mine")
    with pytest.raises(VaseError, match="not a vase run"):
        plan(spec)
    assert (stray / "notes.txt").read_text() == "mine"


def _forget_fresh_penalty(saved):  # written before objective.fresh_aggregate_weight existed: loaded with 0
    del saved["objective"]["fresh_aggregate_weight"]


def _heavier_decoder_weight(saved):  # written with --set dream.decoder_weight=10
    saved["dream"]["decoder_weight"] = 10.0


@pytest.mark.parametrize("age_config, difference", [
    # With S off no environment is ever allocated, so the fresh-latent penalty cannot act in "-"; in SDA it can.
    (_forget_fresh_penalty, r"objective.fresh_aggregate_weight: 0.0 -> 1.0"),
    # Without dreams the decoder weight is never read; in SDA it is.
    (_heavier_decoder_weight, r"dream.decoder_weight: 10.0 -> 1.0"),
])
def test_older_runs_count_where_the_changed_setting_cannot_act(tmp_path, age_config, difference):
    spec = tiny_spec(tmp_path / "grid", tmp_path / "data", seeds=(0,))
    runs = {r.name: r for r in spec.runs()}
    changed = "SDA-disentangled-s0"
    for name in ("none-disentangled-s0", changed):
        run = runs[name]
        saved = json.loads(spec.config(run).to_json())
        age_config(saved)
        run.run_dir.mkdir(parents=True)
        (run.run_dir / "config.json").write_text(json.dumps(saved))
        (run.run_dir / "results.json").write_text("{}")
    with pytest.raises(VaseError, match=rf"{changed} holds a run with other settings \({difference}\)"):
        plan(spec)
    runs[changed].run_dir.joinpath("config.json").unlink()
    runs[changed].run_dir.joinpath("results.json").unlink()
    status = {run.name: s for run, s in plan(spec)}
    assert status["none-disentangled-s0"] == DONE and status[changed] == NEW


def test_the_new_environment_settings_are_inert_exactly_where_no_environment_is_allocated_under_eq3():
    setting = "objective.fresh_aggregate_weight"
    inert = {
        (row, mode): setting
        in build_config("cpu", [] if mode == "disentangled" else ["objective.mode=entangled"], row).inert_settings()
        for row in TABLE1_ROWS
        for mode in ("disentangled", "entangled")
    }
    assert {key for key, value in inert.items() if not value} == {
        (row, "disentangled") for row in ("S", "SA", "SD", "SDA", "SD-[41]")}


def test_the_decoder_weight_is_inert_exactly_where_eq7s_decoder_term_is_off():
    inert = {row: "dream.decoder_weight" in build_config("cpu", [], row).inert_settings()
             for row in ("-", "S", "A", "SA", "SD-[41]", "D", "DA", "SD", "SDA")}
    assert inert == {"-": True, "S": True, "A": True, "SA": True, "SD-[41]": True,
                     "D": False, "DA": False, "SD": False, "SDA": False}


def test_the_sync_at_allocation_is_inert_exactly_where_no_snapshot_meets_an_allocation():
    inert = {row: "dream.sync_at_allocation" in build_config("cpu", [], row).inert_settings()
             for row in ("-", "S", "A", "SA", "D", "DA", "SD", "SDA", "SD-[41]")}
    assert inert == {"-": True, "S": True, "A": True, "SA": True, "D": True, "DA": True,
                     "SD": False, "SDA": False, "SD-[41]": False}


# -- the backends with stand-in children ------------------------------------------------------------------
# A stand-in for `python -m cli`: exits with the code given as its last argument, after one line of output.
STAND_IN = [sys.executable, "-c", "import sys; print('child', *sys.argv[1:]); sys.exit(int(sys.argv[-1]))"]


def test_local_backend_reports_each_run_and_keeps_going_after_a_failure(tmp_path):
    jobs = [Job(f"j{i}", ["train", str(code)], str(tmp_path / f"r{i}"), str(tmp_path / "logs" / f"j{i}.log"))
            for i, code in enumerate([0, 3, 0])]
    seen = {}
    LocalBackend(2, command=STAND_IN).run(jobs, lambda job, outcome: seen.update({job.name: outcome}))
    assert set(seen) == {"j0", "j1", "j2"}
    assert [seen[n].ok for n in ("j0", "j1", "j2")] == [True, False, True]
    assert seen["j1"].returncode == 3 and "child train 3" in seen["j1"].log_tail
    assert (tmp_path / "logs" / "j1.log").read_text().startswith("$ vase train 3")
    assert seen["j0"].files is None  # same machine: nothing to send back


def test_local_backend_runs_the_jobs_that_a_finished_job_brings(tmp_path):
    def job(name: str, code: int) -> Job:
        return Job(name, ["train", str(code)], str(tmp_path / name), str(tmp_path / "logs" / f"{name}.log"))

    seen = []

    def on_done(done, outcome):
        seen.append((done.name, outcome.ok))
        return {"first": [job("second", 0), job("third", 4)]}.get(done.name)

    LocalBackend(2, command=STAND_IN).run([job("first", 0), job("other", 0)], on_done)
    assert sorted(seen) == [("first", True), ("other", True), ("second", True), ("third", False)]
    assert seen.index(("first", True)) < min(seen.index(("second", True)), seen.index(("third", False)))


def test_a_run_on_another_machine_travels_back_to_the_driver(tmp_path):
    """What a Ray task on another node returns lands where the driver's grid expects the run."""
    node, driver = tmp_path / "node", tmp_path / "driver"
    (node / "run" / "checkpoints").mkdir(parents=True)
    (node / "run" / "checkpoints" / "latest.pt").write_bytes(os.urandom(1000))
    (node / "run" / "results.json").write_text('{"seed": 0}')
    job = Job("run", ["train", "0"], str(node / "run"), str(node / "run.log"))
    outcome = execute(job, driver_host="another-machine", command=STAND_IN)
    assert outcome.ok and outcome.files is not None and outcome.log is not None

    at_driver = Job("run", job.arguments, str(driver / "run"), str(driver / "logs" / "run.log"))
    (driver / "run").mkdir(parents=True)
    (driver / "run" / "stale.txt").write_text("from an earlier attempt")
    receive(at_driver, outcome)
    for name in ("checkpoints/latest.pt", "results.json"):
        assert (driver / "run" / name).read_bytes() == (node / "run" / name).read_bytes()
    assert not (driver / "run" / "stale.txt").exists()
    assert (driver / "logs" / "run.log").read_bytes() == (node / "run.log").read_bytes()


def test_a_resumed_run_is_unpacked_on_a_node_that_lacks_it(tmp_path):
    source = tmp_path / "driver" / "run"
    (source / "checkpoints").mkdir(parents=True)
    (source / "config.json").write_text("{}")
    (source / "checkpoints" / "latest.pt").write_bytes(b"weights")
    job = Job("run", ["train", "0"], str(tmp_path / "node" / "run"), str(tmp_path / "node" / "run.log"),
              files=pack_dir(source))
    assert execute(job, driver_host="another-machine", command=STAND_IN).ok
    assert (tmp_path / "node" / "run" / "checkpoints" / "latest.pt").read_bytes() == b"weights"


def test_unpack_refuses_paths_outside_the_run(tmp_path):
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("../escaped.txt")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    with pytest.raises(tarfile.TarError):
        unpack_dir(buf.getvalue(), tmp_path / "run")
    assert not (tmp_path / "escaped.txt").exists()


# -- the driver with a stand-in backend -------------------------------------------------------------------
class FakeTraining:
    """Writes what a finished (or failed) `vase train` leaves behind, without training."""

    def __init__(self, spec: GridSpec, fail: set[str]):
        self.spec, self.fail, self.ran = spec, fail, []

    def run(self, jobs, on_done):
        runs = {r.name: r for r in self.spec.runs()}
        for job in jobs:
            self.ran.append(job.name)
            run = runs[job.name]
            run.run_dir.mkdir(parents=True, exist_ok=True)
            (run.run_dir / "config.json").write_text(self.spec.config(run).to_json())
            if job.name in self.fail:
                on_done(job, Outcome(1, 0.1, "here", "Error: something broke"))
                continue
            table1 = {"object_id_max": 0.5 + run.seed / 100, "object_id_change": -0.01, "position_min": 0.004,
                      "position_change": 0.0002}
            results = {"mode": run.mode, "ablation": run.row, "sequence": SEQUENCE.split(","), "seed": run.seed,
                       "pending_batches_train": False, "sync_at_allocation": False, "rule_names": [],
                       "dream_weights": [10.0, 1.0], "environments_inferred": 2,
                       "probes": {"table1": table1},
                       "latent_use": [{"used_in_training": [0, 1], "informative": [0]}]}
            (run.run_dir / "results.json").write_text(json.dumps(results))
            on_done(job, Outcome(0, 0.1, "here"))


def test_the_driver_reports_failures_writes_the_table_and_reruns_only_what_is_missing(tmp_path, sprite_data):
    spec = tiny_spec(tmp_path / "grid", sprite_data, seeds=(0, 1))
    first = FakeTraining(spec, fail={"none-disentangled-s1"})
    lines = []
    report = run_grid(spec, first, echo=lines.append, progress=False)
    assert sorted(first.ran) == sorted(r.name for r in spec.runs())
    assert [name for name, _ in report.failed] == ["none-disentangled-s1"]
    assert "something broke" in report.failed[0][1] and any(line.startswith("FAILED none-") for line in lines)
    table = json.loads((tmp_path / "grid" / "table1.json").read_text())
    seeds = {row["ablation"]: row["seeds"] for row in table["rows"]}
    assert seeds == {"SDA": [0, 1], "-": [0]}
    assert report.table == (tmp_path / "grid" / "table1.txt").read_text().rstrip("\n")

    second = FakeTraining(spec, fail=set())
    report = run_grid(spec, second, echo=lines.append, progress=False)
    assert second.ran == ["none-disentangled-s1"] and not report.failed
    assert any("4 runs under" in x and "3 finished, 1 to resume, 0 to start" in x for x in lines)
    assert {
        row["ablation"]: row["seeds"] for row in json.loads((tmp_path / "grid" / "table1.json").read_text())["rows"]
    } == {"SDA": [0, 1], "-": [0, 1]}


class ProgressTraining(FakeTraining):
    """Each run writes a progress file and waits for the grid's bar to read it before it ends."""

    def __init__(self, spec: GridSpec, fail: set[str], bars: list):
        super().__init__(spec, fail)
        self.bars = bars

    def run(self, jobs, on_done):
        runs = {r.name: r for r in self.spec.runs()}
        for job in jobs:
            run = runs[job.name]
            run.run_dir.mkdir(parents=True, exist_ok=True)
            (run.run_dir / "progress.json").write_text(json.dumps({"step": 4, "total": 10}))
            seen = self.bars[0].n
            deadline = time.monotonic() + 10
            while self.bars[0].n < seen + 4 and time.monotonic() < deadline:
                time.sleep(0.01)
            super().run([job], on_done)


def test_the_grid_bar_counts_the_runs_steps_as_they_train(tmp_path, sprite_data, monkeypatch):
    import tqdm.auto

    import vase.progress_bar

    bars = []

    class Bar(tqdm.auto.tqdm):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "file": io.StringIO()})
            self.history = [self.n]
            bars.append(self)

        def update(self, n=1):
            super().update(n)
            self.history.append(self.n)

    monkeypatch.setattr(vase.progress_bar, "tqdm", Bar)
    monkeypatch.setattr(grid_module, "PROGRESS_POLL_S", 0.01)
    spec = tiny_spec(tmp_path / "grid", sprite_data, seeds=(0, 1))  # 4 runs of 2 x 10 steps
    run_grid(spec, ProgressTraining(spec, fail={"none-disentangled-s1"}, bars=bars), echo=lambda s: None)
    bar = next(b for b in bars if b.desc == "vase grid")  # not the bar of the sprites made on first use
    assert bar.unit == "step" and bar.total == 4 * 20
    # Each run is read at 4 steps while it trains, then counts whole when it ends well; the failed one
    # stays at what its file says.
    assert 4 in bar.history and 20 + 4 in bar.history
    assert bar.history[-1] == 3 * 20 + 4
    assert bar.history == sorted(bar.history)


def test_grid_refuses_bad_input_in_one_line(tmp_path):
    for extra, phrase in ((["--seeds", "4-2"], "bad seed list"), (["--rows", "SDA,SDX"], "unknown ablation"),
                          (["--modes", "beta"], "bad mode list"), (["--set", "train.batch_size=0"], "must be positive"),
                          (["--ray", "--workers", "2"], "--workers is for runs on this machine")):
        result = CliRunner().invoke(main, ["grid", "--root", str(tmp_path / "g"), "--dry-run", *extra])
        assert result.exit_code != 0 and "Traceback" not in result.output
        assert phrase in result.output, result.output
    assert not (tmp_path / "g").exists()


def test_dry_run_lists_each_cell_and_its_command(tmp_path):
    result = CliRunner().invoke(main, ["grid", "--rows", "SD-[41],-", "--seeds", "0-1", "--modes", "entangled",
                                       "--root", str(tmp_path / "g"), "--dry-run"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert len(lines) == 4 and all(line.startswith("new") for line in lines)
    assert "SD-41-entangled-s1: vase train --preset cpu --ablation=SD-[41]" in result.output
    assert "--set objective.mode=entangled" in result.output and not (tmp_path / "g").exists()


def test_dry_run_shows_how_far_an_unfinished_run_has_come(tmp_path, sprite_data):
    spec = tiny_spec(tmp_path / "grid", sprite_data)
    FakeTraining(spec, fail={"none-disentangled-s0"}).run(
        [Job(r.name, [], str(r.run_dir), str(r.log)) for r in spec.runs()], lambda job, outcome: None)
    (spec.root / "none-disentangled-s0" / "progress.json").write_text('{"step": 12, "total": 20}')
    lines = dry_run_lines(spec)
    assert lines[0] == "done   SDA-disentangled-s0: kept"
    assert lines[1].startswith("resume none-disentangled-s0 (step 12 of 20): vase train --resume ")


# -- real tiny grids (slow) -------------------------------------------------------------------------------
def straight_run(tmp_path: Path, data_root: Path, row: str, seed: int = 0) -> dict:
    """The same cell, trained by a plain `vase train` in this process."""
    run = tmp_path / f"straight-{grid_module.row_slug(row)}"
    result = invoke(tiny_args(run, data_root, steps=int(STEPS)) + ["--sequence", SEQUENCE, f"--ablation={row}",
                                                                   "--seed", str(seed)])
    assert result.exit_code == 0, result.output
    return read_results(run)


@pytest.mark.slow
def test_a_grid_trains_each_cell_as_vase_train_would_and_keeps_finished_runs(tmp_path, sprite_data):
    root = tmp_path / "grid"
    result = invoke(grid_cli_args(root, sprite_data) + ["--workers", "2"])
    assert result.exit_code == 0, result.output
    assert "0 finished, 0 to resume, 2 to start" in result.output
    assert "done   SDA-disentangled-s0" in result.output and "done   none-disentangled-s0" in result.output
    for row in ("SDA", "-"):
        cell = root / f"{grid_module.row_slug(row)}-disentangled-s0"
        assert comparable(read_results(cell)) == comparable(straight_run(tmp_path, sprite_data, row))
    table = (root / "table1.txt").read_text()
    assert table.rstrip("\n") in result.output and "  SDA " in table and "  -   " in table

    stamp = (root / "SDA-disentangled-s0" / "results.json").stat().st_mtime_ns
    again = invoke(grid_cli_args(root, sprite_data))
    assert again.exit_code == 0 and "2 finished, 0 to resume, 0 to start" in again.output
    assert (root / "SDA-disentangled-s0" / "results.json").stat().st_mtime_ns == stamp
    assert table.rstrip("\n") in again.output


@pytest.mark.slow
def test_a_killed_grid_resumes_its_runs_exactly(tmp_path, sprite_data, monkeypatch):
    spec = tiny_spec(tmp_path / "grid", sprite_data, rows=("SDA",))
    monkeypatch.setenv("VASE_TEST_KILL", "step:13")  # the child SIGKILLs itself 3 steps after its step-10 checkpoint
    report = run_grid(
        spec, LocalBackend(1, command=[sys.executable, "-c", KILLER]), echo=lambda s: None, progress=False
    )
    assert [name for name, _ in report.failed] == ["SDA-disentangled-s0"] and report.table is None
    assert f"exit code {-signal.SIGKILL}" in report.failed[0][1]
    monkeypatch.delenv("VASE_TEST_KILL")
    assert [status for _, status in plan(spec)] == [RESUME]

    report = run_grid(spec, LocalBackend(1), echo=lambda s: None, progress=False)
    assert report.finished == ["SDA-disentangled-s0"] and not report.failed
    log = (tmp_path / "grid" / "logs" / "SDA-disentangled-s0.log").read_text()
    assert "vase train --resume" in log
    assert comparable(read_results(spec.runs()[0].run_dir)) == comparable(straight_run(tmp_path, sprite_data, "SDA"))


@pytest.mark.slow
def test_a_grid_on_ray_gives_the_same_runs(tmp_path, sprite_data):
    pytest.importorskip("ray")
    root = tmp_path / "grid"
    result = invoke(grid_cli_args(root, sprite_data, rows="SDA") + ["--ray"])
    assert result.exit_code == 0, result.output
    assert comparable(read_results(root / "SDA-disentangled-s0")) == comparable(
        straight_run(tmp_path, sprite_data, "SDA")
    )


@pytest.mark.slow
def test_a_grid_on_ray_shares_the_first_stage_as_this_machine_does(tmp_path, sprite_data):
    """The first stage runs as a Ray task; as it ends, the branch is written on the driver and
    travels to its node with its checkpoint."""
    pytest.importorskip("ray")
    root = tmp_path / "grid"
    result = invoke(grid_cli_args(root, sprite_data, rows="SDA,-") + ["--ray", "--share-first-stage"])
    assert result.exit_code == 0, result.output
    cell = read_results(root / "none-disentangled-s0")
    assert cell["branch"]["step"] == int(STEPS)
    assert comparable(cell) == comparable(straight_run(tmp_path, sprite_data, "-"))


def grid_children(root: Path) -> list[int]:
    """Pids of the `vase train` processes working under `root`."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if " train " in cmdline and str(root) in cmdline:
            pids.append(int(proc.name))
    return pids


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigterm_stops_every_run_of_the_grid_and_the_next_call_resumes_them(tmp_path, sprite_data):
    import subprocess
    import time

    root = tmp_path / "grid"
    args = grid_cli_args(root, sprite_data)
    args[args.index("--steps") + 1] = "400"  # long enough to be stopped mid-run
    # Started with SIGINT ignored, as a shell without job control starts `vase grid &`: the grid
    # stops its runs with SIGINT, so it must not pass that disposition on to them.
    grid = subprocess.Popen([sys.executable, "-m", "cli", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    checkpoints = [
        root / name / "checkpoints" / "latest.json" for name in ("SDA-disentangled-s0", "none-disentangled-s0")
    ]
    deadline = time.monotonic() + 240
    while not all(c.is_file() for c in checkpoints):
        assert grid.poll() is None and time.monotonic() < deadline, (
            grid.stdout.read() if grid.poll() is not None else ""
        )
        time.sleep(0.5)
    assert len(grid_children(root)) == 2
    grid.send_signal(signal.SIGTERM)
    out, _ = grid.communicate(timeout=120)
    assert grid.returncode == 130, out
    assert "run the same command again to resume the grid" in out and "Traceback" not in out
    assert grid_children(root) == []  # no run is left training behind the grid's back
    for name in ("SDA-disentangled-s0", "none-disentangled-s0"):
        assert "interrupted; resume with: vase train --resume" in (root / "logs" / f"{name}.log").read_text()
    dry = invoke(args + ["--dry-run"])
    assert [line.split()[0] for line in dry.output.splitlines()] == ["resume", "resume"], dry.output


def test_failed_runs_make_the_grid_exit_with_one_error_line_naming_their_logs(tmp_path, sprite_data, monkeypatch):
    failing = [sys.executable, "-c", "import sys; print('Error: this run broke'); sys.exit(1)"]
    monkeypatch.setattr("vase.grid_backends.child_command", lambda: failing)
    root = tmp_path / "grid"
    result = CliRunner().invoke(main, grid_cli_args(root, sprite_data))
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert result.output.count("failed: ") == 2 and "Error: this run broke" in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:") and "runs failed" in line]
    assert errors == [f"Error: 2 of 2 runs failed; their logs are in {root / 'logs'}; run the same command again to "
                      "retry them"]
    assert not (root / "table1.txt").exists()


def test_stopping_runs_interrupts_them_all_at_once_and_kills_the_deaf_after_one_grace(monkeypatch):
    import subprocess

    from vase.grid_backends import stop_children

    # Two runs that ignore SIGINT (as a run stuck in a blocking call would) and one that obeys it.
    deaf = "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"
    # Python's own handler, set explicitly: a pytest started with SIGINT ignored would pass that on.
    obeys = ("import signal, time; signal.signal(signal.SIGINT, signal.default_int_handler); "
             "print('up', flush=True); time.sleep(60)")
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
             for code in (deaf, deaf, obeys)]
    for proc in procs:
        assert proc.stdout.readline() == "up\n"  # handlers installed before the signal comes
    waits = []
    real_wait = subprocess.Popen.wait

    def recording_wait(self, timeout=None):
        waits.append(timeout)
        return real_wait(self, timeout)

    monkeypatch.setattr(subprocess.Popen, "wait", recording_wait)
    # A grace long enough for the obeying run to exit on a loaded machine.
    stop_children(procs, grace_s=3.0)
    for proc in procs:
        proc.stdout.close()
    # Killed, killed, and ended by its SIGINT (Python exits through the signal after KeyboardInterrupt).
    assert [proc.returncode for proc in procs] == [-signal.SIGKILL, -signal.SIGKILL, -signal.SIGINT]
    # One grace period in all: the second deaf run is not given a second grace of its own.
    budgets = [w for w in waits if w is not None]
    assert budgets[0] <= 3.0 and budgets[1] <= 0.05 and budgets[2] <= 0.05


# A stand-in run that records the GPU it was given and how many runs held that GPU at once.
SEAT_RECORDER = r"""
import os, sys, time
gpu, out = os.environ.get("CUDA_VISIBLE_DEVICES", "none"), sys.argv[-1]
lock = os.path.join(os.path.dirname(out), f"gpu{gpu}.{os.getpid()}")
open(lock, "w").close()
time.sleep(0.3)
peers = len([f for f in os.listdir(os.path.dirname(out)) if f.startswith(f"gpu{gpu}.")])
os.remove(lock)
open(out, "w").write(f"{gpu} {peers}")
"""


def test_gpu_seats_give_each_run_one_gpu_and_share_each_gpu_by_runs_per_gpu(tmp_path):
    jobs = [Job(f"r{i}", [str(tmp_path / f"r{i}.txt")], str(tmp_path / f"r{i}"), str(tmp_path / f"r{i}.log"))
            for i in range(8)]
    backend = LocalBackend(1, command=[sys.executable, "-c", SEAT_RECORDER], gpus=2, runs_per_gpu=2)
    assert backend.workers == 4
    done = []
    backend.run(jobs, lambda job, outcome: done.append(outcome.ok))
    seats = [(tmp_path / f"r{i}.txt").read_text().split() for i in range(8)]
    assert all(done) and len(done) == 8
    assert {gpu for gpu, _ in seats} == {"0", "1"}
    assert max(int(peers) for _, peers in seats) <= 2


def test_grid_gpus_sets_each_runs_device_to_cuda(tmp_path):
    result = CliRunner().invoke(main, ["grid", "--gpus", "1", "--runs-per-gpu", "3", "--rows", "SDA", "--seeds", "0",
                                       "--modes", "disentangled", "--root", str(tmp_path), "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "--device cuda" in result.output


# -- rows that share a first stage ------------------------------------------------------------------------
def test_share_first_stage_is_refused_in_one_line_where_no_row_could_branch(tmp_path):
    for extra, phrase in ((["--rows", "-,S"], "add SDA to --rows"),
                          (["--set", "inference.rules=paper"],
                           "--share-first-stage: the source's rules (paper) may mask"),
                          (["--sequence", "moving_mnist"], "needs a sequence of two environments or more")):
        result = CliRunner().invoke(main, ["grid", "--root", str(tmp_path / "g"), "--seeds", "0", "--dry-run",
                                           "--share-first-stage", *extra])
        assert result.exit_code != 0 and "Traceback" not in result.output
        assert phrase in result.output, result.output
    assert not (tmp_path / "g").exists()


def test_dry_run_shows_which_cells_branch_and_where_sda_pauses(tmp_path):
    result = CliRunner().invoke(main, ["grid", "--rows", "SDA,-,SD-[41],D", "--seeds", "0", "--modes", "entangled",
                                       "--steps", "30", "--root", str(tmp_path / "g"), "--dry-run",
                                       "--share-first-stage"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].startswith("new    SDA-entangled-s0: vase train") and lines[0].endswith(
        "--until 30, then again with --resume")
    source = tmp_path / "g" / "SDA-entangled-s0"
    assert lines[1] == (f"branch none-entangled-s0: vase train --branch {source} --at 30 --run-dir "
                        f"{tmp_path / 'g' / 'none-entangled-s0'} --set dream.enabled=false "
                        "--set inference.enabled=false --set mask.enabled=false")
    assert lines[2].endswith("--set dream.decoder_term=false --set mask.enabled=false")
    # D without S dreams from the first snapshot on: it trains from step 0
    assert lines[3].startswith("new    D-entangled-s0: vase train --preset cpu --ablation=D ")
    assert not (tmp_path / "g").exists()


class FirstStageOrder:
    """Stands in for the backend and for the branch: records which jobs the grid hands over at its
    start and which each finished job brings, and ends every job at once (those with --until paused)."""

    def __init__(self, fail: set[str] = frozenset()):
        self.fail, self.handed, self.brought, self.branched = fail, [], {}, []

    def start_branch(self, spec, run):
        self.branched.append(run.name)

    def run(self, jobs, on_done):
        def name(job):
            return job.name + (" until " + job.arguments[job.arguments.index("--until") + 1]
                               if "--until" in job.arguments else "")

        self.handed = [name(job) for job in jobs]
        queue = list(jobs)
        while queue:
            job = queue.pop(0)
            follow = on_done(job, Outcome(int(name(job) in self.fail), 0.1, "here")) or []
            if follow:
                self.brought[name(job)] = [name(f) for f in follow]
            queue += follow


@pytest.mark.parametrize("fail", ["", f"SDA-disentangled-s0 until {STEPS}", "SDA-disentangled-s0"])
def test_rows_that_need_no_first_stage_start_with_it_and_branched_rows_follow_its_pause(
        tmp_path, sprite_data, monkeypatch, fail):
    """D trains from step 0 (its first stage is not SDA's), so it starts beside SDA's first stage;
    "-" is branched when that stage ends, and is not started if it fails."""
    spec = replace(tiny_spec(tmp_path / "grid", sprite_data, rows=("SDA", "-", "D")), share_first_stage=True)
    backend = FirstStageOrder({fail})
    monkeypatch.setattr(grid_module, "start_branch", backend.start_branch)
    report = run_grid(spec, backend, echo=lambda s: None, progress=False)
    first_stage = f"SDA-disentangled-s0 until {STEPS}"
    assert backend.handed == [first_stage, "D-disentangled-s0"]
    if fail == first_stage:
        assert backend.brought == {} and backend.branched == [] and report.finished == ["D-disentangled-s0"]
        assert dict(report.failed)["none-disentangled-s0"].startswith("not started: SDA-disentangled-s0")
        return
    assert backend.brought == {first_stage: ["none-disentangled-s0", "SDA-disentangled-s0"]}
    assert backend.branched == ["none-disentangled-s0"]
    if fail:  # SDA failed after its pause: its branched row had started and ended on its own
        assert sorted(report.finished) == ["D-disentangled-s0", "none-disentangled-s0"]
        assert [name for name, _ in report.failed] == ["SDA-disentangled-s0"]
    else:
        assert sorted(report.finished) == ["D-disentangled-s0", "SDA-disentangled-s0", "none-disentangled-s0"]


def test_the_grid_bar_counts_a_shared_first_stage_once_before_and_after_the_branch(tmp_path):
    """A row branched from SDA's first stage trains only the steps after it, so the bar's total is
    SDA's 20 steps and the row's last 10, whether the branch is still to be made or was made in an
    earlier invocation; a row that is no branch counts all its steps."""
    from vase.branching import BRANCH_FILE

    spec = replace(tiny_spec(tmp_path / "grid", tmp_path / "data"), share_first_stage=True)
    sda, none = spec.runs()
    assert grid_module.grid_steps(spec, [sda, none], {none.name}).total == 20 + 10
    assert grid_module.grid_steps(spec, [sda, none], set()).total == 20 + 20
    none.run_dir.mkdir(parents=True)
    (none.run_dir / BRANCH_FILE).write_text(json.dumps({"source": str(sda.run_dir), "step": 10, "overrides": []}))
    assert grid_module.grid_steps(spec, [sda, none], set()).total == 20 + 10


@pytest.mark.slow
def test_rows_branched_from_sdas_first_stage_are_the_rows_trained_from_step_0(tmp_path, sprite_data):
    """Under the default rules S, D and A change nothing before the first allocation, so each row
    branched from SDA's first stage end trains exactly the run `vase train` makes from step 0."""
    root = tmp_path / "grid"
    rows = ("SDA", "-", "S", "A", "SA", "SD", "SD-[41]", "D")
    result = invoke(grid_cli_args(root, sprite_data, rows=",".join(rows)) + ["--share-first-stage", "--workers", "2"])
    assert result.exit_code == 0, result.output
    assert "0 finished, 0 to resume, 2 to start, 6 to branch from SDA's first stage" in result.output
    assert "paused SDA-disentangled-s0" in result.output and "branch S-disentangled-s0 from SDA" in result.output
    source = root / "SDA-disentangled-s0"
    for row in rows:
        cell = root / f"{grid_module.row_slug(row)}-disentangled-s0"
        ran = read_results(cell)
        assert comparable(ran) == comparable(straight_run(tmp_path, sprite_data, row)), row
        if row not in ("SDA", "D"):
            assert ran["branch"]["source"] == source.name and ran["branch"]["step"] == int(STEPS), row
    # D without S dreams slot 0 from the first snapshot on: its first stage is not SDA's
    assert read_results(root / "D-disentangled-s0")["branch"] is None
    assert read_results(source)["branch"] is None
    assert "--until 10" in (root / "logs" / "SDA-disentangled-s0.log").read_text()


@pytest.mark.slow
def test_entangled_rows_share_the_entangled_sdas_first_stage(tmp_path, sprite_data):
    root = tmp_path / "grid"
    args = grid_cli_args(root, sprite_data, rows="SDA,-,SD")
    args[args.index("disentangled")] = "entangled"
    result = invoke(args + ["--share-first-stage", "--workers", "2"])
    assert result.exit_code == 0, result.output
    for row in ("-", "SD"):
        ran = read_results(root / f"{grid_module.row_slug(row)}-entangled-s0")
        assert ran["branch"]["source"] == "SDA-entangled-s0", row
        straight = tmp_path / f"straight-{grid_module.row_slug(row)}"
        made = invoke(tiny_args(straight, sprite_data, steps=int(STEPS)) + ["--sequence", SEQUENCE, f"--ablation={row}",
                                                                             "--entangled"])
        assert made.exit_code == 0, made.output
        assert comparable(ran) == comparable(read_results(straight)), row


@pytest.mark.slow
def test_a_row_whose_source_allocated_in_its_first_stage_trains_from_step_0(tmp_path, sprite_data):
    """Where SDA's first stage is not the row's (here a hand-made second slot at its end), the cell
    is not branched: it trains from step 0, and the grid says why."""
    from test_branching import _edit_state

    spec = replace(tiny_spec(tmp_path / "grid", sprite_data, rows=("SDA", "-")), share_first_stage=True)
    source = spec.runs()[0]
    args = train_arguments(spec, source, NEW) + ["--until", STEPS]
    assert "paused at step 10 of 20" in invoke(args).output and not (source.run_dir / "results.json").exists()
    _edit_state(source.run_dir, int(STEPS), lambda st: st["learner"]["inference"].update(n_envs=2))
    assert [status for _, status in plan(spec)] == [RESUME, grid_module.BRANCH]
    lines = []
    report = run_grid(spec, LocalBackend(2), echo=lines.append, progress=False)
    assert sorted(report.finished) == ["SDA-disentangled-s0", "none-disentangled-s0"] and not report.failed
    assert any(line.startswith("note   none-disentangled-s0 trains from step 0: the source had inferred 2")
               for line in lines), lines
    cell = spec.runs()[1].run_dir
    assert read_results(cell)["branch"] is None
    assert comparable(read_results(cell)) == comparable(straight_run(tmp_path, sprite_data, "-"))
