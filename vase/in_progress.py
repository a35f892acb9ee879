"""Table 1 of a run still training (`vase table --in-progress`): the results.json the run would
write if it ended at a checkpoint it keeps.

A study of the paper's regime trains for days (docs/regime.md, "The regime"), and where it stands
is worth reading before it ends. The run is opened at its checkpoint as `vase inspect` opens it, and
the evaluator's own `results` is read, so every figure is the one results.json would give there:
CHANGE covers the stages ended so far. Two figures would mislead and are read over the environments
the run has begun instead: Table 1's MAX (a later environment's is its zero-shot reading) and the
count of true environments (docs/probes.md).
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def results_so_far(run_dir: Path, step: int | None = None, device: torch.device | str = "cpu") -> dict:
    """results.json of `run_dir` at its checkpoint of `step` (default: the newest), with
    `in_progress`: the checkpoint's step and the run's total steps."""
    from vase.inspection import open_run

    evaluator = open_run(Path(run_dir), step, device=device)
    done, total = evaluator.learner.step, evaluator.stream.total_steps
    begun = evaluator.stream.env_index(done - 1) + 1 if done else 0
    out = evaluator.results(begun)
    out["environments_true"] = len(set(evaluator.cfg.data.sequence[:begun]))
    out["in_progress"] = {"step": done, "steps": total}
    return out


def is_in_progress(result: dict) -> bool:
    """Whether a results dict was read from a checkpoint before the run's end."""
    state = result.get("in_progress")
    return bool(state) and state["step"] < state["steps"]
