"""Continual-learning summaries of probe curves: Table 1, the R matrix, forgetting and BWT (docs/probes.md).

All functions are pure and work on ``ProbeCurve`` records. Values are kept **raw** everywhere:
accuracy as a fraction in [0, 1] and MSE in squared [0, 1]-position units. Only the Table 1
formatter (``format_table1_row``, via ``to_table1_units``) converts to the paper's units, % for
accuracy and ×1e-4 for MSE.

Sign conventions (documented in ``docs/probes.md``):

- Table 1 CHANGE keeps the paper's raw sign, final − at-end-of-training: a **negative** accuracy
  change and a **positive** MSE change mean forgetting.
- ``average_forgetting`` is oriented so that **positive means worse** for both kinds, and
  ``backward_transfer`` so that **negative means worse** for both kinds; for MSE (lower is better)
  both are computed on −MSE.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

ACCURACY = "accuracy"
MSE = "mse"
KINDS = (ACCURACY, MSE)
# Probe names are f"{PROBE_PREFIX[kind]}/{environment name}" (vase.probing, plots, results JSON).
PROBE_PREFIX = {ACCURACY: "object_id", MSE: "position_mse"}
# Table 1 column group of each probe kind.
TABLE1_PREFIX = {ACCURACY: "object_id", MSE: "position"}
# Paper units: accuracy in %, MSE in 1e-4 (Table 1 header "MIN (*1E-4)").
TABLE1_SCALE = {ACCURACY: 100.0, MSE: 1e4}


@dataclass(frozen=True)
class ProbeCurve:
    """One probed quantity of one environment over the run.

    ``env_index`` is the environment's position in the training sequence; ``steps`` are the
    (increasing) global steps at which the probe was evaluated and ``values`` the probe values.
    """

    name: str
    kind: str  # "accuracy" (higher is better) or "mse" (lower is better)
    env_index: int
    steps: Sequence[int]
    values: Sequence[float]

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"ProbeCurve.kind must be one of {KINDS}, got {self.kind!r}")
        if len(self.steps) != len(self.values):
            raise ValueError(f"curve {self.name!r}: {len(self.steps)} steps but {len(self.values)} values")
        if any(b < a for a, b in zip(self.steps, self.steps[1:])):
            raise ValueError(f"curve {self.name!r}: steps must be non-decreasing")


def probe_name(kind: str, env_name: str) -> str:
    """The name of the ``kind`` probe of an environment, e.g. "object_id/moving_shapes_a"."""
    return f"{PROBE_PREFIX[kind]}/{env_name}"


def kind_of(name: str) -> str:
    """The kind ("accuracy" or "mse") of a probe name made by ``probe_name``."""
    prefix = name.split("/", 1)[0]
    for kind, known in PROBE_PREFIX.items():
        if prefix == known:
            return kind
    raise ValueError(f"probe name {name!r} does not start with one of {sorted(PROBE_PREFIX.values())}")


def value_at(curve: ProbeCurve, step: int) -> float:
    """The curve's value at the last evaluation at or before ``step`` (NaN if there is none).

    The trainer evaluates at every boundary (docs/probes.md, "3. When probes run"), so at a boundary this is the value
    measured exactly then.
    """
    index = int(np.searchsorted(np.asarray(curve.steps), step, side="right")) - 1
    return float(curve.values[index]) if index >= 0 else math.nan


def best_value(curve: ProbeCurve) -> float:
    """MAX accuracy or MIN MSE over the whole run (Table 1), NaN for an empty curve."""
    if len(curve.values) == 0:
        return math.nan
    return float(max(curve.values) if curve.kind == ACCURACY else min(curve.values))


def curve_change(curve: ProbeCurve, env_end_steps: Sequence[int]) -> float:
    """Table 1 CHANGE: final value − value when the curve's environment finished training.

    NaN when it cannot be measured: the environment's training has not ended, or no evaluation
    followed its end (its CHANGE would be 0 by construction, e.g. the last environment of the
    sequence; leaving it out mirrors how forgetting leaves out the last task).
    """
    if curve.env_index >= len(env_end_steps) or len(curve.steps) == 0:
        return math.nan
    end = env_end_steps[curve.env_index]
    if curve.steps[-1] <= end:
        return math.nan
    return float(curve.values[-1]) - value_at(curve, end)


def table1_stats(curves: Sequence[ProbeCurve], env_end_steps: Sequence[int]) -> dict:
    """Table 1 columns of one run, averaged over curves of the same kind (docs/probes.md).

    Returns raw values ``object_id_max``, ``object_id_change`` (accuracy curves) and
    ``position_min``, ``position_change`` (MSE curves), each a mean over the curves where it is
    defined (NaN if none), and ``curves``: the per-curve breakdown. ``env_end_steps[j]`` is the
    step at which training on environment j ended.
    """
    per_curve = [
        {
            "name": c.name,
            "kind": c.kind,
            "env_index": c.env_index,
            "best": best_value(c),
            "change": curve_change(c, env_end_steps),
        }
        for c in curves
    ]
    stats: dict = {}
    for kind in KINDS:
        rows = [r for r in per_curve if r["kind"] == kind]
        best_key, change_key = table1_keys(kind)
        stats[best_key] = nanmean([r["best"] for r in rows])
        stats[change_key] = nanmean([r["change"] for r in rows])
    stats["curves"] = per_curve
    return stats


def probe_matrix(curves: Sequence[ProbeCurve], env_end_steps: Sequence[int], kind: str) -> np.ndarray:
    """R (T × T): R[i, j] = probe value of environment i at the end of training on environment j.

    T = len(env_end_steps), the environments whose training has ended. Entries above the diagonal
    (j < i, environment i not yet trained) are kept: they are the zero-shot / forward-transfer
    values of the representation. Rows of environments without a curve of this ``kind`` (e.g. a
    static environment has no position probe) are NaN.
    """
    t = len(env_end_steps)
    matrix = np.full((t, t), math.nan)
    for curve in curves:
        if curve.kind == kind and curve.env_index < t:
            matrix[curve.env_index] = [value_at(curve, step) for step in env_end_steps]
    return matrix


def average_forgetting(matrix: np.ndarray, kind: str = ACCURACY) -> float:
    """Average forgetting (Chaudhry et al. 2018, "Riemannian Walk"), positive = worse.

    f_i = max_{j < T−1} R[i, j] − R[i, T−1] for each environment i < T−1 with a probe, averaged.
    As in Chaudhry et al. the max runs over every earlier column, including zero-shot ones. For MSE
    it is computed on −R, i.e. f_i = R[i, T−1] − min_{j < T−1} R[i, j]. NaN if T < 2.
    """
    scores = _higher_is_better(matrix, kind)
    if scores.shape[0] < 2:
        return math.nan
    past = scores[:-1, :-1]
    rows = [i for i in range(past.shape[0]) if not np.all(np.isnan(past[i]))]
    return nanmean([np.nanmax(past[i]) - scores[i, -1] for i in rows])


def backward_transfer(matrix: np.ndarray, kind: str = ACCURACY) -> float:
    """Backward transfer (Lopez-Paz & Ranzato 2017, GEM), negative = forgetting.

    BWT = mean_{i < T−1} (R[i, T−1] − R[i, i]). For MSE it is computed on −R, i.e.
    mean (R[i, i] − R[i, T−1]), so a rising MSE gives a negative BWT too. NaN if T < 2.
    """
    scores = _higher_is_better(matrix, kind)
    if scores.shape[0] < 2:
        return math.nan
    return nanmean([scores[i, -1] - scores[i, i] for i in range(scores.shape[0] - 1)])


def table1_keys(kind: str) -> tuple[str, str]:
    """The (best, change) keys of a kind in Table 1 column order, e.g. ("object_id_max", ...)."""
    prefix = TABLE1_PREFIX[kind]
    return (f"{prefix}_max" if kind == ACCURACY else f"{prefix}_min"), f"{prefix}_change"


def to_table1_units(stats: dict) -> dict:
    """The four Table 1 numbers in the paper's units: accuracy in %, MSE in 1e-4."""
    # None is how a NaN comes back from results JSON: still "not measurable".
    return {
        key: math.nan if stats[key] is None else stats[key] * TABLE1_SCALE[kind]
        for kind in KINDS
        for key in table1_keys(kind)
    }


def mean_std_over_seeds(runs: Sequence[dict]) -> tuple[dict, dict]:
    """Mean and (population) std over seeds of the four Table 1 numbers of several runs (docs/probes.md)."""
    keys = [key for kind in KINDS for key in table1_keys(kind)]
    mean = {k: nanmean([r[k] for r in runs]) for k in keys}
    std = {k: nanstd([r[k] for r in runs]) for k in keys}
    return mean, std


def format_table1_row(stats: dict, label: str, std: dict | None = None) -> str:
    """One Table 1 row: label, MAX acc (%), CHANGE acc (%), MIN MSE (×1e-4), CHANGE MSE (×1e-4).

    ``stats`` (and optional ``std``) hold raw values as returned by ``table1_stats`` or
    ``mean_std_over_seeds``; with ``std`` each cell reads "mean (±std)" like the paper.
    """
    values = to_table1_units(stats)
    spread = to_table1_units(std) if std is not None else None
    cells = []
    for key, value in values.items():
        cell = _fmt(value, signed=key.endswith("_change"))
        if spread is not None:
            cell += f" (±{_fmt(spread[key], signed=False)})"
        cells.append(cell)
    return " | ".join([f"{label:<10}"] + cells)


def table1_header() -> str:
    """Column titles matching ``format_table1_row``."""
    return " | ".join([f"{'ablation':<10}", "ID MAX (%)", "ID CHANGE (%)", "POS MIN (1e-4)", "POS CHANGE (1e-4)"])


def _fmt(value: float, signed: bool) -> str:
    if math.isnan(value):
        return "n/a"
    return f"{value:+.1f}" if signed else f"{value:.1f}"


def _higher_is_better(matrix: np.ndarray, kind: str) -> np.ndarray:
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    matrix = np.asarray(matrix, dtype=np.float64)
    return matrix if kind == ACCURACY else -matrix


def nanmean(values) -> float:
    """Mean of the defined values (None and NaN mean "not measurable"); NaN if there are none.

    Unlike ``np.nanmean`` it does not warn on an all-NaN input, which is an ordinary case here
    (e.g. a run without moving environments has no position curves).
    """
    finite = _finite(values)
    return float(finite.mean()) if finite.size else math.nan


def nanstd(values) -> float:
    """Population std of the defined values; NaN if there are none."""
    finite = _finite(values)
    return float(finite.std()) if finite.size else math.nan


def _finite(values) -> np.ndarray:
    values = np.asarray([math.nan if v is None else v for v in values], dtype=np.float64)
    return values[~np.isnan(values)]
