"""The ablation grid of Table 1: rows x objective modes x seeds of `vase train`, gathered into the table.

Each run of the grid is an ordinary `vase train` run in its own directory under the grid's root,
named `<row>-<mode>-s<seed>` (`-` is written `none`, `SD-[41]` is written `SD-41`). So a grid can
be stopped at any moment and started again with the same command: finished runs (those with a
results.json) are kept, interrupted ones continue from their last checkpoint with `--resume`, and
a directory that holds a run of a *different* configuration is refused before anything starts.

How the runs are executed is the business of `vase.grid_backends` (child processes here, or Ray
tasks on a cluster); this module plans the runs and builds Table 1 from them (`vase.table1`).
"""
from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from vase.checkpoint import kept_steps, write_atomic
from vase.config import CONFIG_VERSION, KEPT_NOT_TRAINED, Config, build_config, load_run_config, option_overrides
from vase.config_checks import setting as setting_of
from vase.config_sections import CHOICES
from vase.config_values import comma_list
from vase.errors import ConfigError, VaseError

if TYPE_CHECKING:
    from vase.progress_file import GridSteps

# The rows of the paper's Table 1, in its order.
TABLE1_ROWS = ("-", "S", "D", "A", "SA", "DA", "SD", "SDA", "SD-[41]")
MODES = CHOICES["objective.mode"]
# The sequence of the paper's Table 1 (§4): moving Fashion -> MNIST -> moving MNIST.
PAPER_SEQUENCE = "moving_fashion,mnist,moving_mnist"
# Settings that say where this machine keeps things, not what is trained: a grid may be resumed
# with another data root (or on another machine) without counting as a different run.
WHERE_NOT_WHAT = {"data.root", "data.download", "train.progress"}


def _distinct(items: list, text: str, what: str, example: str) -> tuple:
    """The items of a comma list, refused when there are none or one is named twice."""
    if not items:
        raise ConfigError(f"no {what}s given: use e.g. {example}")
    if len(set(items)) != len(items):
        raise ConfigError(f"{what} list {text!r} names a {what} twice")
    return tuple(items)


def parse_seeds(text: str) -> tuple[int, ...]:
    """'0-4' -> (0, 1, 2, 3, 4); '0,2,7' -> (0, 2, 7); both forms can be mixed ('0-2,5')."""
    seeds: list[int] = []
    for part in comma_list(text):
        try:
            if "-" in part[1:]:
                lo, hi = (int(v) for v in part.split("-", 1))
                if hi < lo:
                    raise ValueError
                seeds.extend(range(lo, hi + 1))
            else:
                seeds.append(int(part))
        except ValueError:
            raise ConfigError(f"bad seed list {text!r}: use numbers and ranges, e.g. 0-4 or 0,2,7") from None
    return _distinct(seeds, text, "seed", "0-4 or 0,2,7")


def parse_rows(text: str) -> tuple[str, ...]:
    """'SDA,-' -> ('SDA', '-'); 'all' -> every row of Table 1. Each row is checked and normalised."""
    if text.strip().lower() == "all":
        return TABLE1_ROWS
    rows = []
    for part in comma_list(text):
        cfg = Config()
        cfg.set_ablation(part)  # raises a ConfigError naming the valid rows
        rows.append(cfg.ablation())
    return _distinct(rows, text, "row", "SDA,- or all")


def parse_modes(text: str) -> tuple[str, ...]:
    modes = tuple(comma_list(text))
    unknown = [m for m in modes if m not in MODES]
    if not modes or unknown or len(set(modes)) != len(modes):
        raise ConfigError(f"bad mode list {text!r}: use disentangled, entangled or both (comma-separated)")
    return modes


def row_slug(row: str) -> str:
    """A Table 1 row as a directory name part: '-' -> 'none', 'SD-[41]' -> 'SD-41'."""
    return "none" if row == "-" else row.replace("[", "").replace("]", "")


@dataclass(frozen=True)
class GridRun:
    """One cell of the grid: a Table 1 row, an objective mode and a seed."""

    row: str
    mode: str
    seed: int
    root: Path

    @property
    def name(self) -> str:
        return f"{row_slug(self.row)}-{self.mode}-s{self.seed}"

    @property
    def run_dir(self) -> Path:
        return self.root / self.name

    @property
    def log(self) -> Path:
        """The run's console output (outside its directory, which `vase train` must find empty)."""
        return self.root / "logs" / f"{self.name}.log"


@dataclass(frozen=True)
class GridSpec:
    """What a grid trains: the same `vase train` settings for every cell, varied by row, mode and seed."""

    rows: tuple[str, ...]
    modes: tuple[str, ...]
    seeds: tuple[int, ...]
    root: Path
    preset: str = "cpu"
    sequence: str = PAPER_SEQUENCE
    steps: str | None = None
    overrides: tuple[str, ...] = ()
    threads: int = 1  # torch threads per run (recorded as train.threads: it changes float sums)
    data_root: str | None = None
    download: bool = False
    device: str = "auto"  # each run's --device; not part of its config, so it does not change the cell
    schedule: str = "short"
    # Each seed's SDA cell trains to its first stage's end, and the other rows branch from there
    # (docs/usage.md, rows that share a first stage).
    share_first_stage: bool = False

    def runs(self) -> list[GridRun]:
        root = Path(self.root).absolute()  # Ray tasks run in another working directory
        return [GridRun(row, mode, seed, root) for mode in self.modes for row in self.rows for seed in self.seeds]

    def settings(self, run: GridRun) -> list[str]:
        """The overrides that make `run`'s config, exactly as `vase train` would build them."""
        data_root = str(Path(self.data_root).absolute()) if self.data_root else None
        return [
            *self.overrides,
            f"train.threads={self.threads}",
            *option_overrides(self.sequence, self.steps, run.mode == "entangled", run.seed, data_root, self.download),
        ]

    def config(self, run: GridRun) -> Config:
        return build_config(self.preset, self.settings(run), run.row, self.schedule)

    def to_dict(self) -> dict:
        return {"rows": list(self.rows), "modes": list(self.modes), "seeds": list(self.seeds), "preset": self.preset,
                "sequence": self.sequence, "steps": self.steps, "overrides": list(self.overrides),
                "threads": self.threads, "schedule": self.schedule, "share_first_stage": self.share_first_stage}


# -- what each run needs ----------------------------------------------------------------------------
NEW, RESUME, DONE = "new", "resume", "done"
BRANCH = "branch"  # a new cell that starts from its SDA cell's first stage end (--share-first-stage)
SHARED_ROW = "SDA"


def _field_differences(a: dict, b: dict, ignored: set[str]) -> list[tuple[str, object, object]]:
    """(section.field, a's value, b's value) for every setting of two config dicts that differs."""
    out = []
    for section in sorted(set(a) | set(b)):
        sa, sb = a.get(section), b.get(section)
        if isinstance(sa, dict) and isinstance(sb, dict):
            for key in sorted(set(sa) | set(sb)):
                if f"{section}.{key}" not in ignored and sa.get(key) != sb.get(key):
                    out.append((f"{section}.{key}", sa.get(key), sb.get(key)))
        elif sa != sb:
            out.append((section, sa, sb))
    return out


def config_differences(saved: Config, wanted: Config) -> list[str]:
    """'section.field: saved -> wanted' for every setting that differs (where things live, which
    checkpoints are kept, and settings neither run's training reads, excepted)."""
    ignored = WHERE_NOT_WHAT | KEPT_NOT_TRAINED | (saved.inert_settings() & wanted.inert_settings())
    return [f"{name}: {was!r} -> {now!r}" for name, was, now in
            _field_differences(saved.to_dict(), wanted.to_dict(), ignored)]


def run_status(spec: GridSpec, run: GridRun) -> str:
    """NEW, RESUME or DONE; a VaseError if the directory holds something else than this run."""
    path = run.run_dir
    if not path.exists() or (path.is_dir() and not any(path.iterdir())):
        return NEW
    if not (path / "config.json").is_file():
        raise VaseError(f"{path} exists but is not a vase run (no config.json)")
    try:
        saved = load_run_config(path)
    except ConfigError as e:
        raise VaseError(f"{path}: {e}") from None
    diff = config_differences(saved, spec.config(run))
    if diff:
        shown = "; ".join(diff[:3]) + (f"; and {len(diff) - 3} more" if len(diff) > 3 else "")
        raise VaseError(f"{path} holds a run with other settings ({shown})")
    return DONE if (path / "results.json").is_file() else RESUME


def first_stage_source(run: GridRun) -> GridRun:
    """The cell a row branches from under --share-first-stage: SDA, same mode and seed."""
    return GridRun(SHARED_ROW, run.mode, run.seed, run.root)


def shares_first_stage(spec: GridSpec, run: GridRun) -> bool:
    """Whether `run`'s first stage is its SDA cell's (docs/usage.md, rows that share a first stage):
    not for SDA itself, nor for D without S, which dreams its one environment from the snapshot as
    soon as one exists, while with S the dreams wait for a past environment."""
    cfg = spec.config(run)
    return run.row != SHARED_ROW and not (cfg.dream.enabled and not cfg.inference.enabled)


def first_stage_end(spec: GridSpec, run: GridRun) -> int:
    return spec.config(run).data.stage_ends()[0]


def check_sharing(spec: GridSpec) -> None:
    """Refuse --share-first-stage where no row could branch, in one line, before anything starts."""
    from vase.branching import check_rules_keep_one_slot

    if SHARED_ROW not in spec.rows:
        raise VaseError(f"--share-first-stage branches the other rows from {SHARED_ROW}'s first stage: "
                        f"add {SHARED_ROW} to --rows")
    for run in spec.runs():
        if run.row != SHARED_ROW:
            continue
        cfg = spec.config(run)
        if len(cfg.data.stage_ends()) < 2:
            raise VaseError("--share-first-stage needs a sequence of two environments or more: with one, "
                            "the first stage is the whole run")
        try:
            check_rules_keep_one_slot(cfg)
        except VaseError as e:
            raise VaseError(f"--share-first-stage: {e}") from None


def plan(spec: GridSpec) -> list[tuple[GridRun, str]]:
    """Every run with its status. All conflicts are reported at once, before anything starts."""
    if spec.share_first_stage:
        check_sharing(spec)
    planned, conflicts = [], []
    for run in spec.runs():
        try:
            status = run_status(spec, run)
            if status == NEW and spec.share_first_stage and shares_first_stage(spec, run):
                status = BRANCH
            planned.append((run, status))
        except VaseError as e:
            conflicts.append(str(e))
    if conflicts:
        raise VaseError("the grid's root already holds runs that this grid would not make; use another "
                        "--root or move them away. " + " | ".join(conflicts[:5])
                        + (f" | and {len(conflicts) - 5} more" if len(conflicts) > 5 else ""))
    return planned


def train_arguments(spec: GridSpec, run: GridRun, status: str) -> list[str]:
    """The `vase train` arguments that make (or continue) `run`."""
    if status == RESUME:
        args = ["train", "--resume", str(run.run_dir), "--no-progress", "--device", spec.device]
        if spec.data_root:
            args += ["--data-root", str(Path(spec.data_root).absolute())]
        saved, wanted = load_run_config(run.run_dir), spec.config(run)
        for name in sorted(KEPT_NOT_TRAINED):  # the grid's command says which checkpoints its runs keep from now on
            if setting_of(saved, name) != setting_of(wanted, name):
                args += ["--set", f"{name}={_setting_text(setting_of(wanted, name))}"]
        return args
    args = ["train", "--preset", spec.preset, f"--ablation={run.row}", "--run-dir", str(run.run_dir), "--no-progress",
            "--device", spec.device, "--schedule", spec.schedule]
    for setting in spec.settings(run):
        args += ["--set", setting]
    return args


def dry_run_lines(spec: GridSpec) -> list[str]:
    """What `vase grid --dry-run` prints: each run, its status (with the steps an interrupted or
    running one has done, from its progress file) and the `vase train` command it needs."""
    from vase.progress_file import read_progress

    lines = []
    planned = plan(spec)
    sources = {first_stage_source(run).name for run, status in planned if status == BRANCH}
    for run, status in planned:
        done = read_progress(run.run_dir) if status == RESUME else None
        where = "" if done is None else f" (step {done:,} of {spec.config(run).data.total_steps():,})"
        if status == BRANCH:
            source = first_stage_source(run)
            what = (f"vase train --branch {source.run_dir} --at {first_stage_end(spec, run)} --run-dir {run.run_dir} "
                    + " ".join(f"--set {o}" for o in branch_overrides(spec, run)))
        else:
            what = "kept" if status == DONE else "vase " + " ".join(train_arguments(spec, run, status))
            end = first_stage_end(spec, run)
            if run.name in sources and status != DONE and end not in kept_steps(run.run_dir):
                what += f" --until {end}, then again with --resume"
        lines.append(f"{status:6s} {run.name}{where}: {what}")
    return lines


# -- rows that share a first stage ---------------------------------------------------------------------
def _setting_text(value) -> str:
    """A config value as `--set` reads it (lists as comma text)."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    return str(value)


def branch_overrides(spec: GridSpec, run: GridRun) -> list[str]:
    """The `--set`s that turn the SDA cell's config into `run`'s: the row's switches."""
    source, wanted = spec.config(first_stage_source(run)).to_dict(), spec.config(run).to_dict()
    return [f"{name}={_setting_text(value)}" for name, _, value in _field_differences(source, wanted, WHERE_NOT_WHAT)
            if "." in name]


def start_branch(spec: GridSpec, run: GridRun) -> str | None:
    """Write `run`'s directory as a branch of its SDA cell's first stage end; None if done, else why
    the cell trains from step 0 instead (the source allocated a second slot or held batches pending
    in that stage, so the rows' first stages differ)."""
    from vase.branching import check_trained_as_one_slot, plan_branch, write_branch
    from vase.trainer import prepare_run_dir

    source, step = first_stage_source(run), first_stage_end(spec, run)
    try:
        branch = plan_branch(source.run_dir, step, branch_overrides(spec, run), spec.data_root, spec.download)
        check_trained_as_one_slot(load_run_config(source.run_dir, spec.data_root, spec.download), branch.state, step)
        differences = config_differences(branch.cfg, spec.config(run))
        if differences:
            return f"the branch's settings differ from the cell's ({'; '.join(differences[:3])})"
    except VaseError as e:
        return str(e)
    prepare_run_dir(run.run_dir, branch.cfg, fill=lambda target: write_branch(branch, target))
    return None


def prepare_data(spec: GridSpec, progress: bool = True) -> None:
    """Load (download, render and cache) the sequence once before the runs start, so that a missing
    file fails the grid at once and parallel runs do not render or download the same data side by side."""
    from vase.data.environments import load_sequence

    cfg = spec.config(spec.runs()[0]).data
    for split in ("train", "test"):
        load_sequence(cfg, split, progress=progress)


# -- the table ---------------------------------------------------------------------------------------
def write_table(spec: GridSpec, runs: list[GridRun]) -> str | None:
    """Table 1 of the finished runs, written to <root>/table1.txt and table1.json; None if none finished."""
    from vase.table1 import load_results, table1_rows, table1_text

    finished = [r.run_dir for r in runs if (r.run_dir / "results.json").is_file()]
    if not finished:
        return None
    rows = table1_rows(load_results(finished))
    text = table1_text(rows)
    root = Path(spec.root)
    write_atomic(root / "table1.txt", (text + "\n").encode())
    write_atomic(root / "table1.json", json.dumps({"grid": spec.to_dict(), "config_version": CONFIG_VERSION,
                                                   "runs": [str(p.name) for p in finished], "rows": rows},
                                                  indent=2).encode())
    return text


# -- the driver --------------------------------------------------------------------------------------
PROGRESS_POLL_S = 2.0


def _watch(refresh, stop: threading.Event) -> None:
    while not stop.wait(PROGRESS_POLL_S):
        refresh()


@dataclass
class GridReport:
    planned: list[tuple[GridRun, str]]  # every run and its status before this invocation
    finished: list[str]  # names of runs that ended well in this invocation
    failed: list[tuple[str, str]]  # (name, why it failed followed by its log's last lines)
    table: str | None


def run_grid(spec: GridSpec, backend, echo=print, progress: bool = True) -> GridReport:
    """Train every run of the grid that is not finished yet, then write and return Table 1.

    With --share-first-stage, an SDA cell whose rows branch from it first trains to its first
    stage's end and pauses there; as it does, those rows are branched and they and the cell go on
    to their ends. Every other run starts at once, so no worker waits on a first stage that is not
    its run's."""
    planned = plan(spec)
    counts = {s: sum(1 for _, st in planned if st == s) for s in (NEW, RESUME, DONE, BRANCH)}
    echo(
        f"vase grid: {len(planned)} run{'' if len(planned) == 1 else 's'} under {spec.root}: "
        f"{counts[DONE]} finished, {counts[RESUME]} to resume, {counts[NEW]} to start"
        + (f", {counts[BRANCH]} to branch from {SHARED_ROW}'s first stage" if counts[BRANCH] else "")
    )
    if any(status != DONE for _, status in planned):
        prepare_data(spec, progress=progress)
    status_of = {run.name: status for run, status in planned}
    branching = [run for run, status in planned if status == BRANCH]
    # the SDA cells to train to their first stage's end before their rows can branch
    waiting: dict[str, tuple[GridRun, list[GridRun]]] = {}
    for run in branching:
        source = first_stage_source(run)
        if status_of[source.name] != DONE and first_stage_end(spec, source) not in kept_steps(source.run_dir):
            waiting.setdefault(source.name, (source, []))[1].append(run)
    lines: list[str] = []
    training = [run for run, status in planned if status != DONE]
    steps = grid_steps(spec, training, {run.name for run in branching})

    def branched(runs: list[GridRun]) -> list[GridRun]:
        for run in runs:
            why = start_branch(spec, run)
            lines.append(f"branch {run.name} from {first_stage_source(run).name} at step {first_stage_end(spec, run):,}"
                         if why is None else f"note   {run.name} trains from step 0: {why}")
            if why is not None:
                steps.start_at(run.name, 0)
        return runs

    later = {run.name for _, rows in waiting.values() for run in rows} | set(waiting)
    now = [(source, first_stage_end(spec, source)) for source, _ in waiting.values()]
    now += [(run, None) for run in branched([r for r in branching if r.name not in later])]
    now += [(run, None) for run, status in planned if status in (NEW, RESUME) and run.name not in later]

    paused: set[str] = set()

    def then(source: GridRun) -> list[GridRun]:
        """What follows the first stage of `source`: its rows, branched, and the cell itself."""
        paused.add(source.name)
        return branched(waiting[source.name][1]) + [source]

    finished, failed = _train(spec, backend, now, then, echo, progress, lines, training, steps)
    for name, _ in list(failed):
        if name in waiting and name not in paused:  # its first stage failed, so its rows never started
            failed += [(run.name, f"not started: {name}, whose first stage it branches from, failed")
                       for run in waiting[name][1]]
    return GridReport(planned, finished, failed, write_table(spec, [run for run, _ in planned]))


def grid_steps(spec: GridSpec, runs: list[GridRun], to_branch: set[str]) -> GridSteps:
    """The bar's count of `runs`' steps, each counted from the step the grid trains it from: its
    branch step if it is a branch or is to be branched (`to_branch`), else 0."""
    from vase.branching import branch_origin
    from vase.progress_file import GridSteps

    def start(run: GridRun) -> int:
        if run.name in to_branch:
            return first_stage_end(spec, run)
        origin = branch_origin(run.run_dir)
        return 0 if origin is None else origin["step"]

    return GridSteps({run.name: (run.run_dir, spec.config(run).data.total_steps(), start(run)) for run in runs})


def _train(spec: GridSpec, backend, now: list[tuple[GridRun, int | None]], then, echo, progress: bool,
           lines: list[str], runs: list[GridRun], steps: GridSteps) -> tuple[list[str], list[tuple[str, str]]]:
    """Run `vase train` for each (run, until) on the backend, `until` being the step to pause at (a
    first stage's end) or None for the run's end; when a run pauses, `then(run)` gives the runs that
    follow it, and they join the queue. `lines` collects what to print. Returns the names of the
    runs that ended well, and (name, why) for those that failed."""
    from vase.grid_backends import Job
    from vase.progress_bar import progress_bar

    finished: list[str] = []
    failed: list[tuple[str, str]] = []
    if not now:
        return finished, failed
    pausing: dict[str, int] = {}
    runs_by_name = {run.name: run for run in runs}

    def job(run: GridRun, until: int | None) -> Job:
        if until is not None:
            pausing[run.name] = until
        status = run_status(spec, run)
        return Job(run.name, train_arguments(spec, run, status) + ([] if until is None else ["--until", str(until)]),
                   str(run.run_dir), str(run.log))

    jobs = [job(run, until) for run, until in now]
    # The bar counts the runs' steps, read from their progress files (`steps`), so that a grid of
    # a few long runs moves as they train instead of at their ends.
    bar = progress_bar(steps.total, "vase grid", initial=steps.done(), disable=not progress)
    bar.set_postfix(runs=f"0/{len(runs)} done")
    lock = threading.Lock()

    def refresh() -> None:
        with lock:
            bar.total = steps.total  # grows if a planned branch trains from step 0 instead
            bar.update(steps.done() - bar.n)

    def say(line: str) -> None:
        with lock:
            bar.write(line) if progress else echo(line)

    def flush() -> None:
        while lines:
            say(lines.pop(0))

    def on_done(done: Job, outcome) -> list[Job]:
        minutes, seconds = divmod(int(outcome.seconds), 60)
        follow: list[Job] = []
        if outcome.ok and done.name in pausing:
            say(f"paused {done.name} at step {pausing.pop(done.name):,} in {minutes}m{seconds:02d}s on {outcome.host}")
            follow = [job(run, None) for run in then(runs_by_name[done.name])]
        elif outcome.ok:
            finished.append(done.name)
            steps.end(done.name)
            say(f"done   {done.name} in {minutes}m{seconds:02d}s on {outcome.host}")
        else:
            why = outcome.error or f"exit code {outcome.returncode}; log {done.log}"
            failed.append((done.name, why + ("\n" + outcome.log_tail if outcome.log_tail else "")))
            say(f"FAILED {done.name}: {why}")
        flush()
        with lock:
            bar.set_postfix(runs=f"{len(finished) + len(failed)}/{len(runs)} done")
        refresh()
        return follow

    flush()
    stop = threading.Event()
    watcher = threading.Thread(target=_watch, args=(refresh, stop), daemon=True) if progress else None
    if watcher:
        watcher.start()
    try:
        backend.run(jobs, on_done)
    finally:
        stop.set()
        if watcher:
            watcher.join()
        bar.close()
    return finished, failed
