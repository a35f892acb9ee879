"""Ambiguous inputs (paper §4, Fig. 5A): what q_psi(s|x) makes of interpolations between two
environments, and how the context of the batch moves the decision.

An ambiguous input is x(w) = (1 - w) a + w b, a pixel-wise interpolation between a held-out image a
of environment A and one, b, of environment B, for weights w from 0 (pure A) to 1 (pure B). The
paper shows its categorical perception (a sharp switch of q(s=A|x) despite smooth changes in w),
a decision boundary that moves with the batch's context, and latents specific to either
environment whose inferred variance grows with the ambiguity.

What is measured [ours: the paper's protocol is in its unpublished appendix]:
- per example, q(s=A|x(w)), the classifier's softmax: it depends on x alone (no batch statistics
  in the encoder), so it is the same in every context;
- per batch, the softmax averaged over the batch (docs/method.md, networks), which decides the slot (eq. 6's
  s_hat): each batch holds `pairs` ambiguous images and as many real held-out images, of which
  the share `context` comes from A and the rest from B;
- sharpness: the width in w over which the per-example q(s=A|x) falls from 0.9 to 0.1;
- switch point per context: the w at which the batch-averaged q(s=A) falls below 0.5.
"""
from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn import functional as F

WEIGHTS = torch.linspace(0.0, 1.0, 11)
CONTEXTS = (0.0, 0.25, 0.5, 0.75, 1.0)
PAIRS = 16


def interpolate(a: torch.Tensor, b: torch.Tensor, weights: torch.Tensor = WEIGHTS) -> torch.Tensor:
    """(W, P, C, H, W') inputs (1 - w) a + w b for images a, b (P, C, H, W'); written as two
    products, not `torch.lerp`, so that w = 0 and w = 1 give a and b exactly."""
    w = weights.to(a.dtype)[:, None, None, None, None]
    return (1 - w) * a[None] + w * b[None]


def specific_latents(usage: torch.Tensor, slot_a: int, slot_b: int, used_kl: float) -> tuple[list[int], list[int]]:
    """Latents slot A uses and slot B does not, and the reverse, from the running usage record
    (information per latent while each slot trained, `vase.slots.Slot.usage`)."""
    used_a, used_b = usage[slot_a] > used_kl, usage[slot_b] > used_kl
    return (used_a & ~used_b).nonzero().flatten().tolist(), (used_b & ~used_a).nonzero().flatten().tolist()


def crossing(weights: list[float], values: list[float], level: float) -> float | None:
    """The first w at which a falling curve drops below `level`, linearly interpolated between the
    measured weights; None when it never starts at or above the level or never drops below it."""
    if values[0] < level:
        return None
    for i in range(1, len(values)):
        if values[i] < level:
            w0, w1, v0, v1 = weights[i - 1], weights[i], values[i - 1], values[i]
            return w0 + (w1 - w0) * (v0 - level) / (v0 - v1)
    return None


@dataclass
class AmbiguityResult:
    env_a: str
    env_b: str
    slot_a: int
    slot_b: int
    weights: list[float]
    contexts: list[float]
    batch_q_a: list[list[float]]  # [context][weight]: batch-averaged q(s=A)
    predicted: list[list[int]]  # [context][weight]: the slot the batch average picks
    example_q_a: list[float]  # [weight]: mean over the ambiguous examples of q(s=A|x)
    example_q_a_std: list[float]
    mu: list[list[float]]  # [weight][latent]: mean over the pairs of mu(x(w))
    sigma: list[list[float]]
    latents_a: list[int]
    latents_b: list[int]
    sharpness: float | None
    switch: list[float | None]  # per context

    def summary(self) -> list[str]:
        def show(w):
            return "never" if w is None else f"w = {w:.2f}"

        return [
            (f"ambiguity between {self.env_a} (slot {self.slot_a}) and {self.env_b} (slot {self.slot_b}): "
             f"x = (1 - w) {self.env_a} + w {self.env_b}"),
            "  per example, q(s=A|x) falls from 0.9 to 0.1 over a width of "
            + ("- (it does not cross both levels)" if self.sharpness is None else f"{self.sharpness:.2f} in w"),
            "  batch-averaged q(s=A) falls below 0.5 (the slot switches) at: "
            + "; ".join(f"{100 * c:.0f}% real from A: {show(s)}" for c, s in zip(self.contexts, self.switch)),
            (f"  latents only {self.env_a}'s slot uses: {self.latents_a or '-'}; only {self.env_b}'s: "
             f"{self.latents_b or '-'}"),
        ]

    def write_csv(self, grid_path: Path, latents_path: Path) -> None:
        with open(grid_path, "w", newline="") as f:
            out = csv.writer(f)
            out.writerow(["share_real_from_a", "weight_b", "batch_q_a", "predicted_slot", "example_q_a_mean",
                          "example_q_a_std", "switch_weight", "sharpness"])
            for c, context in enumerate(self.contexts):
                switch = "" if self.switch[c] is None else f"{self.switch[c]:.4f}"
                for i, w in enumerate(self.weights):
                    out.writerow([context, f"{w:.2f}", f"{self.batch_q_a[c][i]:.4f}", self.predicted[c][i],
                                  f"{self.example_q_a[i]:.4f}", f"{self.example_q_a_std[i]:.4f}", switch,
                                  "" if self.sharpness is None else f"{self.sharpness:.4f}"])
        with open(latents_path, "w", newline="") as f:
            out = csv.writer(f)
            out.writerow(["weight_b", "latent", "only_used_by", "mu_mean", "sigma_mean"])
            for latents, env in ((self.latents_a, self.env_a), (self.latents_b, self.env_b)):
                for n in latents:
                    for i, w in enumerate(self.weights):
                        out.writerow([f"{w:.2f}", n, env, f"{self.mu[i][n]:.4f}", f"{self.sigma[i][n]:.4f}"])


@torch.no_grad()
def class_probabilities(learner, x: torch.Tensor) -> torch.Tensor:
    """q_psi(s|x) per example (B, K_max), the softmax the method averages over a batch (docs/method.md, networks)."""
    return F.softmax(learner.classifier(learner.model.encoder(x).hidden), dim=1)


def context_batch(ambiguous: torch.Tensor, real_a: torch.Tensor, real_b: torch.Tensor, context: float) -> torch.Tensor:
    """The ambiguous images plus as many real ones, the share `context` of them from A."""
    n = ambiguous.shape[0]
    from_a = round(context * n)
    return torch.cat([ambiguous, real_a[:from_a], real_b[: n - from_a]])


@torch.no_grad()
def measure_ambiguity(
    learner, images_a: torch.Tensor, images_b: torch.Tensor, slots: tuple[int, int], names: tuple[str, str],
    used_kl: float, weights: torch.Tensor = WEIGHTS, contexts=CONTEXTS, pairs: int = PAIRS,
) -> AmbiguityResult:
    """Fig. 5A's measurements on held-out images of A and B (at least 2 * `pairs` of each: the first
    `pairs` are interpolated, the next `pairs` are the real context)."""
    slot_a, slot_b = slots
    a, b = images_a[:pairs], images_b[:pairs]
    real_a, real_b = images_a[pairs: 2 * pairs], images_b[pairs: 2 * pairs]
    inputs = interpolate(a, b, weights)
    batch_q, predicted = [[] for _ in contexts], [[] for _ in contexts]
    example_mean, example_std, mu, sigma = [], [], [], []
    for x in inputs:
        q_a = class_probabilities(learner, x)[:, slot_a]
        example_mean.append(float(q_a.mean()))
        example_std.append(float(q_a.std(correction=0)))
        post = learner.model.encoder(x)
        mu.append(post.mu.mean(0).tolist())
        sigma.append(post.logvar.mul(0.5).exp().mean(0).tolist())
        for c, context in enumerate(contexts):
            probs = class_probabilities(learner, context_batch(x, real_a, real_b, context)).mean(0)
            batch_q[c].append(float(probs[slot_a]))
            predicted[c].append(learner.inference.predict(probs))
    w = weights.tolist()
    low, high = crossing(w, example_mean, 0.1), crossing(w, example_mean, 0.9)
    latents_a, latents_b = specific_latents(learner.slots.stack("usage"), slot_a, slot_b, used_kl)
    return AmbiguityResult(
        env_a=names[0], env_b=names[1], slot_a=slot_a, slot_b=slot_b, weights=w, contexts=list(contexts),
        batch_q_a=batch_q, predicted=predicted, example_q_a=example_mean, example_q_a_std=example_std,
        mu=mu, sigma=sigma, latents_a=latents_a, latents_b=latents_b,
        sharpness=None if low is None or high is None else low - high,
        switch=[crossing(w, row, 0.5) for row in batch_q],
    )


@torch.no_grad()
def ambiguity_strip(learner, a: torch.Tensor, b: torch.Tensor, slots: tuple[int, int],
                    weights: torch.Tensor = WEIGHTS) -> torch.Tensor:
    """(3 H, W * len(weights)): one pair interpolated (top) and decoded under slot A and slot B
    (paper Fig. 5A, middle row), single channel in [0, 1]."""
    x = interpolate(a[None], b[None], weights)[:, 0]
    rows = [x] + [learner.reconstruct_mean(x, s) for s in slots]
    return torch.cat([torch.cat(list(row[:, 0]), dim=1) for row in rows], dim=0)
