"""Figures for TensorBoard as RGB uint8 arrays (H, W, 3): probe curves and atypicality (Fig. 2 bottom).

Figures are drawn on their own Agg canvas (``matplotlib.figure.Figure`` + ``FigureCanvasAgg``)
rather than through pyplot, so they work headless and never touch pyplot's global figure state or
the process-wide backend that other code may rely on.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from vase.metrics.continual import ACCURACY, MSE, kind_of

FIGSIZE = (7.0, 5.0)
DPI = 100


def probe_curves_figure(history: Sequence[tuple[int, dict]], env_end_steps: Sequence[int]) -> np.ndarray:
    """Probe values vs step (paper Fig. 2 bottom): object-ID accuracies on top, position MSE below.

    ``history`` is ``ProbeSuite.history``: (step, {probe name: value}) pairs. One line per probe;
    dotted vertical lines mark the ends of environments' training.
    """
    fig = Figure(figsize=FIGSIZE, dpi=DPI)
    ax_acc, ax_mse = fig.subplots(2, 1, sharex=True)
    names = sorted({name for _, values in history for name in values})
    for name in names:
        points = [(step, values[name]) for step, values in history if name in values]
        steps, ys = zip(*points)
        ax = ax_acc if kind_of(name) == ACCURACY else ax_mse
        ax.plot(steps, ys, marker=".", label=name.split("/", 1)[1])
    ax_acc.set_ylabel("object-ID accuracy")
    ax_acc.set_ylim(0.0, 1.0)
    ax_mse.set_ylabel("position MSE")
    ax_mse.set_xlabel("step")
    for ax, kind in ((ax_acc, ACCURACY), (ax_mse, MSE)):
        _mark_boundaries(ax, env_end_steps)
        if any(kind_of(n) == kind for n in names):
            ax.legend(fontsize="small", loc="best")
    return figure_to_rgb(fig)


def atypicality_figure(
    steps: Sequence[int],
    alpha: np.ndarray,
    lambda_low: float,
    lambda_high: float,
    boundaries: Sequence[int],
) -> np.ndarray:
    """Atypicality α_n (eq. 4) per latent vs step, with dashed λ1 and λ2 lines (Fig. 2 bottom).

    ``alpha`` is (T, N): T logged steps by N latents. The y axis is symlog because α spikes far
    above λ at a boundary (that is the signal) while the decision happens around λ ~ 1.
    """
    alpha = np.asarray(alpha, dtype=np.float64)
    fig = Figure(figsize=FIGSIZE, dpi=DPI)
    ax = fig.subplots()
    # A cyclic colour map spreads up to 24 latents over distinguishable hues.
    hues = colormaps["hsv"]
    for n in range(alpha.shape[1]):
        ax.plot(steps, alpha[:, n], color=hues(n / alpha.shape[1]), linewidth=1.0)
    for lam in (lambda_low, lambda_high):
        ax.axhline(lam, color="black", linestyle="--", linewidth=1.0)
    _mark_boundaries(ax, boundaries)
    ax.set_yscale("symlog", linthresh=1.0)
    ax.set_ylim(bottom=0.0)  # α is a KL, never negative
    ax.set_xlabel("step")
    ax.set_ylabel("atypicality α")
    ax.set_title(f"atypicality per latent (λ1={lambda_low:g}, λ2={lambda_high:g})")
    return figure_to_rgb(fig)


def figure_to_rgb(fig: Figure) -> np.ndarray:
    """Render a figure on an Agg canvas and return its pixels as (H, W, 3) uint8."""
    canvas = FigureCanvasAgg(fig)
    fig.tight_layout()
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()


def _mark_boundaries(ax, steps: Sequence[int]) -> None:
    for step in steps:
        ax.axvline(step, color="grey", linestyle=":", linewidth=1.0)
