"""A run's progress on disk, `<run_dir>/progress.json`: {"step": steps done, "total": steps of the run}.

A run trained as a child of `vase grid` shows no bar of its own (`--no-progress`), and its
checkpoints come every few thousand steps, so the grid's bar counts steps by reading this file
(`GridSteps`). It is written at the start, every `every_s` seconds of training and at the end. It is
a reading for people only: resume never reads it (it may be ahead of the checkpoint a killed run
continues from), and nothing it holds enters results.json.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from vase.callbacks import Callback, StepEnd
from vase.checkpoint import write_atomic
from vase.errors import CheckpointError

if TYPE_CHECKING:
    from vase.trainer import Trainer

PROGRESS_FILE = "progress.json"


def read_progress(run_dir: str | Path) -> int | None:
    """Steps done by the run in `run_dir` as its progress file says, or None without a readable one."""
    try:
        step = json.loads((Path(run_dir) / PROGRESS_FILE).read_text())["step"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return step if isinstance(step, int) and step >= 0 else None


class ProgressFile(Callback):
    """Writes the run's progress file; at most one write per `every_s` seconds while it trains."""

    def __init__(self, every_s: float = 5.0, clock: Callable[[], float] = time.monotonic):
        self.every_s = every_s
        self.clock = clock
        self.last_write = -float("inf")

    def _write(self, trainer: Trainer, step: int) -> None:
        payload = {"step": step, "total": trainer.stream.total_steps}
        try:
            write_atomic(trainer.run_dir / PROGRESS_FILE, json.dumps(payload).encode())
        except CheckpointError:
            pass  # a full or read-only disk shows up at the next checkpoint, with what to do about it
        self.last_write = self.clock()

    def on_train_start(self, trainer: Trainer, start: int) -> None:
        self._write(trainer, start)

    def on_step(self, trainer: Trainer, step: StepEnd) -> None:
        if self.clock() - self.last_write >= self.every_s:
            self._write(trainer, step.done)

    def on_train_end(self, trainer: Trainer) -> None:
        self._write(trainer, trainer.learner.step)


class GridSteps:
    """Steps the grid trains, read from its runs' progress files.

    A run counts from what its file says (0 without one) until it ends, and then as whole. A run
    branched from another's first stage (--share-first-stage) counts from its branch step: the
    steps before it were trained once, by the run it branches from, and are counted there, so the
    bar's rate and time left stay true when the branches are made. A run on another Ray node
    writes its file there, so the driver sees it only when the run ends, unless the nodes share a
    filesystem.
    """

    def __init__(self, runs: dict[str, tuple[Path, int, int]]):
        self.runs = runs  # name -> (run directory, total steps, step the grid trains it from)
        self.ended: set[str] = set()

    @property
    def total(self) -> int:
        return sum(total - start for _, total, start in self.runs.values())

    def start_at(self, name: str, step: int) -> None:
        """`name` trains from `step` after all (a planned branch that trains from step 0 instead)."""
        run_dir, total, _ = self.runs[name]
        self.runs[name] = (run_dir, total, step)

    def end(self, name: str) -> None:
        self.ended.add(name)

    def done(self) -> int:
        steps = 0
        for name, (run_dir, total, start) in self.runs.items():
            step = total if name in self.ended else min(total, read_progress(run_dir) or 0)
            steps += max(0, step - start)
        return steps
