"""A run's figures as RGB arrays (H, W, 3): latent use, cross-domain reconstructions (Fig. 4B), the
atypicality profile and the probe curves (Fig. 2 bottom).

One function per figure, read from a run's `vase.evaluator.Evaluator`, so TensorBoard (at every
boundary) and `vase inspect` (from any kept checkpoint) draw the same pictures from the same code.
"""
from __future__ import annotations

import numpy as np
import torch

from vase.metrics.plots import (
    atypicality_figure,
    cross_domain_figure,
    latent_use_figure,
    probe_curves_figure,
)
from vase.visualize import cross_domain_panel

# Held-out images of the source environment in a one-environment cross-domain figure.
CROSS_DOMAIN_ROWS = 6


def latent_use(run) -> np.ndarray:
    _, rows, _ = run.slot_tables()
    return latent_use_figure(rows, run.cfg.inference.used_kl)


def cross_domain(run, source: int | None = None, rows: int = CROSS_DOMAIN_ROWS) -> np.ndarray:
    """Every environment seen so far, its first held-out image (the traversals' seed) decoded under
    every slot; with `source`, `rows` held-out images of that one environment instead, each with
    its own error under every slot."""
    learner = run.learner
    slots = max(1, learner.inference.n_envs)
    trained, _, errors = run.slot_tables()
    names = [env.name for env in run.envs]
    if source is None:
        images = torch.stack([x[0] for x in run.held_out[: len(trained)]])
        labels, own = names[: len(trained)], trained
    else:
        images = run.held_out[source][:rows]
        errors = [[learner.reconstruction_error(x[None], s) for s in range(slots)] for x in images]
        # An environment the run has not reached yet has no slot of its own: frame the classifier's pick.
        slot = trained[source] if source < len(trained) else learner.infer_slot(images)
        labels, own = [f"{names[source]} #{i}" for i in range(len(images))], [slot] * len(images)
    panel = cross_domain_panel(learner, images, slots)
    return cross_domain_figure(panel.numpy(), labels, errors, own)


def atypicality_profile(run) -> np.ndarray | None:
    record, mask = run.record, run.cfg.mask
    if not record.alpha:
        return None
    return atypicality_figure(record.alpha_steps, np.asarray(record.alpha), mask.lambda_low, mask.lambda_high,
                              run.stream.ends)


def probe_curves(run) -> np.ndarray | None:
    if not (run.probes and run.probes.history):
        return None
    return probe_curves_figure(run.probes.history, run.stream.ends)


FIGURES = {
    "latent_use": latent_use,
    "cross_domain": cross_domain,
    "atypicality_profile": atypicality_profile,
    "probe_curves": probe_curves,
}


def run_figures(run) -> dict[str, np.ndarray]:
    """Every figure the run's state can draw, by name (the TensorBoard tag after "figures/")."""
    figures = {name: draw(run) for name, draw in FIGURES.items()}
    return {name: fig for name, fig in figures.items() if fig is not None}
