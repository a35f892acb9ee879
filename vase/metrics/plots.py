"""Figures for TensorBoard as RGB uint8 arrays (H, W, 3): probe curves, atypicality and latent use
(Fig. 2 bottom), and cross-domain reconstructions (Fig. 4B).

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
from vase.summary import latent_union

FIGSIZE = (7.0, 5.0)
DPI = 100


def probe_colours(names: Sequence[str]) -> dict[str, str]:
    """One colour per environment, so that its identity and position curves match across the two
    panels: probe name ("kind/environment") -> matplotlib's cycle colour "C<i>"."""
    envs = sorted({name.split("/", 1)[1] for name in names})
    return {name: f"C{envs.index(name.split('/', 1)[1]) % 10}" for name in names}


def probe_curves_figure(history: Sequence[tuple[int, dict]], env_end_steps: Sequence[int]) -> np.ndarray:
    """Probe values vs step (paper Fig. 2 bottom): object-ID accuracies on top, position MSE below.

    ``history`` is ``ProbeSuite.history``: (step, {probe name: value}) pairs. One line per probe;
    dotted vertical lines mark the ends of environments' training.
    """
    fig = Figure(figsize=FIGSIZE, dpi=DPI)
    ax_acc, ax_mse = fig.subplots(2, 1, sharex=True)
    names = sorted({name for _, values in history for name in values})
    colours = probe_colours(names)
    for name in names:
        points = [(step, values[name]) for step, values in history if name in values]
        steps, ys = zip(*points)
        ax = ax_acc if kind_of(name) == ACCURACY else ax_mse
        ax.plot(steps, ys, marker=".", color=colours[name], label=name.split("/", 1)[1])
    ax_acc.set_ylabel("object-ID accuracy")
    ax_acc.set_ylim(0.0, 1.0)
    ax_mse.set_ylabel("position MSE")
    ax_mse.set_xlabel("step")
    for ax, kind in ((ax_acc, ACCURACY), (ax_mse, MSE)):
        _mark_boundaries(ax, env_end_steps)
        if any(kind_of(n) == kind for n in names):
            ax.legend(fontsize="small", loc="best")
    return figure_to_rgb(fig)


def own_slot_figure(rows: Sequence[dict], env_end_steps: Sequence[int], after_stage: Sequence[float]) -> np.ndarray:
    """Each environment's held-out error under its own slot with the decoders of one checkpoint,
    decoded from the codes of the encoder of each saved step (`vase.evaluation.own_slot_rows`): a
    line per environment, its error just after its own stage as a dashed level of its colour, and
    the stage ends dotted. Where a line climbs after its stage, the encoder's codes drifted away
    from what the slot decodes (docs/regime.md, "The slot or the shared encoder")."""
    fig = Figure(figsize=FIGSIZE, dpi=DPI)
    ax = fig.subplots()
    names = list(dict.fromkeys((r["environment"], r["slot"]) for r in rows))
    for i, (name, slot) in enumerate(names):
        points = [(r["step"], r["error"]) for r in rows if (r["environment"], r["slot"]) == (name, slot)]
        steps, errors = zip(*points)
        line, = ax.plot(steps, errors, marker=".", label=f"{name} (slot {slot})")
        if i < len(after_stage):
            ax.axhline(after_stage[i], color=line.get_color(), linestyle="--", linewidth=1.0)
    ax.set_yscale("log")
    ax.set_xlabel("step of the encoder")
    ax.set_ylabel("held-out error under its own slot (nats)")
    ax.set_title(f"decoders of step {rows[0]['checkpoint_step']}; dashed: each environment after its stage",
                 fontsize="small")
    _mark_boundaries(ax, env_end_steps)
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


def latent_use_matrix(rows: Sequence[dict]) -> np.ndarray:
    """(E, N) information per latent, in nats, of each row of `Evaluator.latent_use`, with the latents
    its slot masks set to NaN: a masked latent feeds prior noise (eq. 2), so it carries nothing
    there whatever the encoder says."""
    info = np.array([row["info_per_latent"] for row in rows], dtype=np.float64)
    for e, row in enumerate(rows):
        info[e, row["masked"]] = np.nan
    return info


def latent_use_figure(rows: Sequence[dict], used_kl: float) -> np.ndarray:
    """The paper's latent-use picture (§4.1, Fig. 2): environments by latents, each cell the
    information the latent carries on that environment's held-out images under its slot. Masked
    cells are crossed; the title counts the latents informative (above `used_kl`) in some row, as
    the run summary does. Values are printed where they reach 0.5 nat, so the weak tail reads apart
    from the real factors."""
    info = latent_use_matrix(rows)
    shown = np.nan_to_num(info, nan=0.0)
    top = shown.max()  # information is >= 0, so a masked cell's 0 never raises it; all masked is 0
    fig = Figure(figsize=(FIGSIZE[0], 1.2 + 0.45 * len(rows)), dpi=DPI)
    ax = fig.subplots()
    image = ax.imshow(shown, cmap="Greens", vmin=0.0, vmax=max(1.0, top), aspect="auto")
    for e, n in zip(*np.nonzero(np.isnan(info))):
        ax.plot(n, e, marker="x", color="red", markersize=6)
    for e, n in zip(*np.nonzero(shown >= 0.5)):
        ax.text(n, e, f"{info[e, n]:.1f}", ha="center", va="center", fontsize=5.5,
                color="white" if info[e, n] > 0.6 * top else "black")
    ax.set_xticks(range(info.shape[1]))
    ax.set_xticklabels([str(n) for n in range(info.shape[1])], fontsize=6)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"{row['true_env']} (slot {row['slot']})" for row in rows], fontsize=7)
    ax.set_xlabel("latent")
    used = len(latent_union(rows, "informative"))
    ax.set_title(f"information per latent (nats, KL − α); × masked; {used}/{info.shape[1]} above {used_kl:g}",
                 fontsize=8)
    fig.colorbar(image, ax=ax, fraction=0.03)
    return figure_to_rgb(fig)


def cross_domain_figure(
    panel: np.ndarray, row_labels: Sequence[str], errors: Sequence[Sequence[float]], trained: Sequence[int]
) -> np.ndarray:
    """Cross-domain reconstructions (Fig. 4B): one row per environment, its input image and then its
    reconstruction under every slot (`vase.visualize.cross_domain_panel`, (R, 1 + S, C, H, W)).

    Under each reconstruction is that environment's held-out error under the slot (``errors``,
    (R, S), nats per image), and the slot the environment trained under (``trained[r]``) is framed
    in green, so the off-diagonal cells read as "what this slot makes of that data".
    """
    panel, errors = np.asarray(panel), np.asarray(errors)
    rows, cols = panel.shape[:2]
    fig = Figure(figsize=(1.15 * cols + 1.2, 1.25 * rows + 0.4), dpi=DPI)
    axes = np.asarray(fig.subplots(rows, cols, squeeze=False))
    for r in range(rows):
        for c in range(cols):
            ax = axes[r, c]
            ax.imshow(panel[r, c].mean(0), cmap="gray", vmin=0.0, vmax=1.0)
            ax.set_xticks([])
            ax.set_yticks([])
            if r == 0:
                ax.set_title("input" if c == 0 else f"slot {c - 1}", fontsize=8)
            if c == 0:
                ax.set_ylabel(row_labels[r], fontsize=7)
            else:
                ax.set_xlabel(f"{errors[r, c - 1]:.0f} nats", fontsize=7)
                if c - 1 == trained[r]:
                    for spine in ax.spines.values():
                        spine.set_edgecolor("green")
                        spine.set_linewidth(2.5)
    return figure_to_rgb(fig)


def traversal_figure(
    mosaic: np.ndarray, frame: int, values: Sequence[float], row_labels: Sequence[str], colours: np.ndarray,
    slot_labels: Sequence[str], title: str,
) -> np.ndarray:
    """Latent traversals (Fig. 2 top, Fig. 3A) with the paper's row colours for every slot at once.

    ``mosaic`` is (H, W, 3) in [0, 1]: `torchvision.utils.make_grid` of L rows by len(values)
    frames of side ``frame`` with 2-pixel padding. ``colours`` is (L, S, 3): in the side bar, column
    s says whether slot s uses the row's latent (green), masks it (red) or leaves it spare (grey),
    so a latent shared between environments reads as a green band across their columns.
    """
    rows, step = len(row_labels), frame + 2
    inch = 0.5 / frame * step  # one frame ~0.5 inch
    bar_w, img_w = 0.22 * len(slot_labels), inch * len(values)
    width, height = max(1.3 + bar_w + 0.1 + img_w + 0.1, 5.0), inch * rows + 1.0
    fig = Figure(figsize=(width, height), dpi=DPI)
    bottom, top = 0.45 / height, 1 - 0.55 / height
    ax_bar = fig.add_axes((1.3 / width, bottom, bar_w / width, top - bottom))
    ax_img = fig.add_axes(((1.4 + bar_w) / width, bottom, img_w / width, top - bottom))
    ax_bar.imshow(colours, aspect="auto", interpolation="nearest")
    ax_bar.set_xticks(range(len(slot_labels)))
    ax_bar.set_xticklabels(slot_labels, fontsize=7)
    ax_bar.set_yticks(range(rows))
    ax_bar.set_yticklabels(row_labels, fontsize=7)
    ax_bar.set_xlabel("slot", fontsize=7)
    ax_img.imshow(mosaic, aspect="auto", interpolation="nearest")
    ax_img.set_xticks([2 + step * i + frame / 2 for i in range(len(values))])
    ax_img.set_xticklabels([f"{round(v, 1) + 0.0:+.1f}" for v in values], fontsize=7)
    ax_img.set_yticks([])
    ax_img.set_xlabel("latent value", fontsize=7)
    fig.suptitle(title, fontsize=8, y=1 - 0.05 / height, va="top")
    return figure_to_rgb(fig, tight=False)  # fixed axes: the rows stay aligned with the bar


def ambiguity_figure(result, strip: np.ndarray) -> np.ndarray:
    """Fig. 5A: ambiguous inputs and what VASE makes of them (`vase.ambiguity.AmbiguityResult`).

    ``strip`` (H, W) in [0, 1] holds one interpolated pair and its reconstructions under both
    slots. Then q(s=A|x) per ambiguous example against the weight of B; the batch-averaged q(s=A)
    that decides the slot (docs/method.md, networks) per context, with its switch points; and mu ± sigma of the
    latents only one of the two slots uses (red: A's, blue: B's), the paper's uncertainty reading.
    """
    w = np.asarray(result.weights)
    fig = Figure(figsize=(9.0, 8.5), dpi=DPI)
    grid = fig.add_gridspec(3, 2, height_ratios=(1.1, 1.0, 1.0))
    ax = fig.add_subplot(grid[0, :])
    ax.imshow(strip, cmap="gray", vmin=0.0, vmax=1.0)
    ax.set_xticks([(i + 0.5) * strip.shape[1] / len(w) for i in range(len(w))])
    ax.set_xticklabels([f"{v:.1f}" for v in w], fontsize=7)
    ax.set_yticks([(i + 0.5) * strip.shape[0] / 3 for i in range(3)])
    ax.set_yticklabels(["input", f"slot {result.slot_a}", f"slot {result.slot_b}"], fontsize=7)
    ax.set_title(f"(1 - w) {result.env_a} + w {result.env_b}", fontsize=8)

    ax = fig.add_subplot(grid[1, 0])
    mean, std = np.asarray(result.example_q_a), np.asarray(result.example_q_a_std)
    ax.plot(w, mean, marker=".", color="black")
    ax.fill_between(w, np.clip(mean - std, 0, 1), np.clip(mean + std, 0, 1), color="grey", alpha=0.3)
    for level in (0.1, 0.9):
        ax.axhline(level, color="grey", linestyle=":", linewidth=1.0)
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel(f"weight w of {result.env_b}", fontsize=8)
    ax.set_ylabel(f"q(s={result.env_a} | x) per example", fontsize=8)
    ax.set_title(f"sharpness (0.9 -> 0.1): {_or_dash(result.sharpness)}", fontsize=8)

    ax = fig.add_subplot(grid[1, 1])
    image = ax.imshow(np.asarray(result.batch_q_a), cmap="RdBu", vmin=0.0, vmax=1.0, aspect="auto",
                      extent=(w[0] - 0.05, w[-1] + 0.05, len(result.contexts) - 0.5, -0.5))
    for c, switch in enumerate(result.switch):
        if switch is not None:
            ax.plot(switch, c, marker="|", color="black", markersize=12)
    ax.set_yticks(range(len(result.contexts)))
    ax.set_yticklabels([f"{100 * c:.0f}%" for c in result.contexts], fontsize=7)
    ax.set_ylabel(f"real samples from {result.env_a}", fontsize=8)
    ax.set_xlabel(f"weight w of {result.env_b}", fontsize=8)
    ax.set_title(f"batch-averaged q(s={result.env_a}); | switch", fontsize=8)
    fig.colorbar(image, ax=ax, fraction=0.05)

    ax = fig.add_subplot(grid[2, :])
    for latents, colour, env in ((result.latents_a, "red", result.env_a), (result.latents_b, "blue", result.env_b)):
        for k, n in enumerate(latents):
            mu, sigma = np.asarray(result.mu)[:, n], np.asarray(result.sigma)[:, n]
            ax.plot(w, mu, color=colour, label=f"{env} only" if k == 0 else None)
            ax.fill_between(w, mu - sigma, mu + sigma, color=colour, alpha=0.12)
    ax.set_xlabel(f"weight w of {result.env_b}", fontsize=8)
    ax.set_ylabel("mu ± sigma (mean over pairs)", fontsize=8)
    if result.latents_a or result.latents_b:
        ax.legend(fontsize="small")
    else:
        ax.set_title("no latent is used by one slot and not the other", fontsize=8)
    return figure_to_rgb(fig)


def _or_dash(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def figure_to_rgb(fig: Figure, tight: bool = True) -> np.ndarray:
    """Render a figure on an Agg canvas and return its pixels as (H, W, 3) uint8."""
    canvas = FigureCanvasAgg(fig)
    if tight:
        fig.tight_layout()
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()


def _mark_boundaries(ax, steps: Sequence[int]) -> None:
    for step in steps:
        ax.axvline(step, color="grey", linestyle=":", linewidth=1.0)
