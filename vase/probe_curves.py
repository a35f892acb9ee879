"""Runs' probe readings side by side at chosen steps (`vase table --curves`).

A study of the paper's regime trains for days, and what it shows in between is how each
environment's identity and position probes move while later stages train (docs/regime.md, "The
extended study so far"). Every probe point's readings are in a run's history: results.json holds it
for a finished run, and each checkpoint for a run still training, so the table needs neither the
data nor a forward pass.
"""
from __future__ import annotations

import json
from pathlib import Path

from vase.checkpoint import has_checkpoint, load_checkpoint
from vase.config import load_run_config
from vase.config_values import comma_list
from vase.errors import VaseError

READINGS = {"mean": "μ(x) of every latent", "sample": "the paper's reading"}  # docs/probes.md


def parse_steps(text: str) -> list[int]:
    """'60000-68000:4000,90000' -> [60000, 64000, 68000, 90000]: steps, and ranges START-END:EVERY
    that include END when EVERY reaches it."""
    steps: list[int] = []
    for part in comma_list(text):
        try:
            if "-" in part:
                span, _, every = part.partition(":")
                start, end = (int(v) for v in span.split("-", 1))
                if not every or int(every) < 1 or end < start:
                    raise ValueError
                steps.extend(range(start, end + 1, int(every)))
            else:
                steps.append(int(part))
        except ValueError:
            raise VaseError(f"bad steps {text!r}: give steps and ranges START-END:EVERY separated by "
                            "commas, e.g. 60000-180000:4000 or 2000,60000") from None
    if not steps or min(steps) < 0:
        raise VaseError(f"bad steps {text!r}: give at least one step, none of them negative")
    return sorted(set(steps))


def probe_history(run_dir: Path) -> dict[int, dict[str, float]]:
    """Each probe point's readings of a run: from results.json when it has finished, else from its
    newest checkpoint."""
    results = Path(run_dir) / "results.json"
    if results.exists():
        try:
            history = json.loads(results.read_text())["probes"]["history"]
        except (ValueError, KeyError, TypeError) as e:
            raise VaseError(f"{results} holds no probe history ({e})") from None
        return {int(point["step"]): point["values"] for point in history}
    if not has_checkpoint(Path(run_dir)):
        raise VaseError(f"{run_dir} has neither results.json nor a checkpoint: is it a vase run directory?")
    state, _ = load_checkpoint(Path(run_dir))
    return {int(step): values for step, values in state["probes"]["history"]}


def _cell(values: dict[str, float] | None, envs: list[str]) -> str:
    """'53.3 / 38.8; 48.3': each environment's identity % and, where it has one, position MSE 1e-4."""
    if values is None:
        return ""
    parts = []
    for env in envs:
        identity, position = values.get(f"object_id/{env}"), values.get(f"position_mse/{env}")
        if identity is None:
            continue
        parts.append(f"{100 * identity:.1f}" + ("" if position is None else f" / {1e4 * position:.1f}"))
    return "; ".join(parts)


def column_names(run_dirs: list[Path]) -> list[str]:
    """Each run's folder name, with as many of its parent folders as the given paths need to tell
    runs of one name apart: a branch beside its source, or the same seed of two studies."""
    parts = [Path(run_dir).parts for run_dir in run_dirs]
    for depth in range(1, max(map(len, parts)) + 1):
        names = ["/".join(p[-depth:]) for p in parts]
        if len(set(names)) == len(names):
            return names
    return names  # the same folder given twice


def curves_markdown(run_dirs: list[Path], steps: list[int], envs: list[str] | None = None) -> str:
    """A markdown table: a row per step, a column per run; `envs` (default: each run's sequence)
    picks the environments each cell reads, in that order."""
    runs = []
    for name, run_dir in zip(column_names(run_dirs), run_dirs):
        cfg = load_run_config(run_dir, trains=False)
        sequence = list(dict.fromkeys(cfg.data.sequence))
        unknown = [env for env in envs or [] if env not in sequence]
        if unknown:
            raise VaseError(f"{run_dir} has no environment {', '.join(unknown)}: its sequence is {','.join(sequence)}")
        runs.append((name, envs or sequence, cfg.probe.reading, probe_history(run_dir)))
    if not any(step in history for *_, history in runs for step in steps):
        probed = sorted({s for *_, history in runs for s in history})
        raise VaseError(f"no run has a probe point at those steps; they probed at {_span(probed)}")
    reads = {name: f"{'; '.join(chosen)} ({READINGS[reading]})" for name, chosen, reading, _ in runs}
    legend = next(iter(reads.values())) if len(set(reads.values())) == 1 else \
        "; ".join(f"{name}: {text}" for name, text in reads.items())
    lines = [f"Each cell: identity % / position MSE 1e-4 of {legend}.", "",
             "| step | " + " | ".join(name for name, *_ in runs) + " |",
             "|---|" + "---|" * len(runs)]
    for step in steps:
        lines.append(f"| {step:,} | " + " | ".join(_cell(history.get(step), chosen)
                                                  for _, chosen, _, history in runs) + " |")
    return "\n".join(lines)


def _span(steps: list[int]) -> str:
    if not steps:
        return "no step yet"
    gaps = {b - a for a, b in zip(steps, steps[1:])}
    every = f" every {gaps.pop():,}" if len(gaps) == 1 else ""
    return f"{steps[0]:,}–{steps[-1]:,}{every}"
