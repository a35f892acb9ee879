"""A run's progress file (vase/progress_file.py): when the callback writes it, what a reader makes of
a missing or broken one, and how the grid sums its runs' steps."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from vase.progress_file import PROGRESS_FILE, GridSteps, ProgressFile, read_progress


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def fake_trainer(run_dir: Path, total: int = 100, step: int = 0) -> SimpleNamespace:
    return SimpleNamespace(run_dir=run_dir, stream=SimpleNamespace(total_steps=total),
                           learner=SimpleNamespace(step=step))


def test_the_file_is_written_at_the_start_at_most_once_per_interval_and_at_the_end(tmp_path):
    clock = Clock()
    callback, trainer = ProgressFile(every_s=5.0, clock=clock), fake_trainer(tmp_path, total=100)
    callback.on_train_start(trainer, 40)  # a resumed run starts from its checkpoint
    assert json.loads((tmp_path / PROGRESS_FILE).read_text()) == {"step": 40, "total": 100}
    clock.now = 4.9
    callback.on_step(trainer, SimpleNamespace(done=41))
    assert read_progress(tmp_path) == 40  # within the interval: not written
    clock.now = 5.0
    callback.on_step(trainer, SimpleNamespace(done=42))
    assert read_progress(tmp_path) == 42
    clock.now = 9.0
    callback.on_step(trainer, SimpleNamespace(done=43))
    assert read_progress(tmp_path) == 42  # the interval counts from the last write
    trainer.learner.step = 57  # stopped (a Ctrl-C) or finished: the end is written whatever the clock says
    callback.on_train_end(trainer)
    assert read_progress(tmp_path) == 57


def test_a_missing_or_broken_file_reads_as_none(tmp_path):
    assert read_progress(tmp_path) is None
    for text in ["", "{", "[]", '{"total": 9}', '{"step": "7"}', '{"step": -1}', '{"step": 2.5}']:
        (tmp_path / PROGRESS_FILE).write_text(text)
        assert read_progress(tmp_path) is None, text
    (tmp_path / PROGRESS_FILE).write_text('{"step": 7, "total": 9}')
    assert read_progress(tmp_path) == 7


def test_the_grid_counts_each_run_from_its_file_capped_at_its_length_and_a_finished_run_whole(tmp_path):
    runs = {name: (tmp_path / name, total, 0) for name, total in [("a", 100), ("b", 50), ("c", 30)]}
    for path, _, _ in runs.values():
        path.mkdir()
    steps = GridSteps(runs)
    assert steps.total == 180 and steps.done() == 0  # no file yet: nothing done
    (tmp_path / "a" / PROGRESS_FILE).write_text('{"step": 25, "total": 100}')
    (tmp_path / "b" / PROGRESS_FILE).write_text('{"step": 80, "total": 50}')  # never more than the run's length
    assert steps.done() == 25 + 50
    steps.end("c")  # ended well on a node whose files the driver does not see
    assert steps.done() == 25 + 50 + 30


def test_a_branch_counts_from_its_branch_step_and_a_branch_that_trains_from_0_counts_whole(tmp_path):
    # "sda" trains steps 0-100; "none" is branched from its step 60, so the grid trains 100 + 40 steps
    runs = {"sda": (tmp_path / "sda", 100, 0), "none": (tmp_path / "none", 100, 60)}
    for path, _, _ in runs.values():
        path.mkdir()
    steps = GridSteps(runs)
    assert steps.total == 140 and steps.done() == 0
    (tmp_path / "sda" / PROGRESS_FILE).write_text('{"step": 60, "total": 100}')
    (tmp_path / "none" / PROGRESS_FILE).write_text('{"step": 60, "total": 100}')  # just branched: nothing of its own
    assert steps.done() == 60
    (tmp_path / "none" / PROGRESS_FILE).write_text('{"step": 75, "total": 100}')
    assert steps.done() == 60 + 15
    steps.end("none")
    assert steps.done() == 60 + 40
    steps.start_at("sda", 0)  # unchanged
    steps.start_at("none", 0)  # the branch could not be made: it trains all its 100 steps
    assert steps.total == 200 and steps.done() == 60 + 100
