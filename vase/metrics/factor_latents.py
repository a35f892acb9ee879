"""Which latents carry each ground-truth factor: the reading behind the paper's Fig. 2-3 claim that
"the two positional latents are active for two moving datasets but not for the static MNIST".

For every varying factor other than the object class, the latents whose posterior sample
z_n ~ q(z_n|x) correlates most strongly with it, computed in closed form from the means and
variances: |cov(mu_n, f)| / sqrt((var(mu_n) + E[sigma_n^2]) var(f)). The sample, not the mean,
because the correlation of the mean alone is blind to scale: a latent whose mean moves a little
with x, under much posterior noise, has a mean |r| near 1 but carries almost nothing. On the
digits, such latents (mean spread 0.1-0.6, posterior variance 0.2-1) tied the real position
latent (spread 0.9-1.5, variance 0.01 or less) at a mean |r| of 0.8-0.9. A pure function of arrays,
like the metrics in `disentanglement`.
"""
from __future__ import annotations

import numpy as np

CLASS = "class"
TOP = 3  # latents kept per factor


def abs_correlations(mu: np.ndarray, factor: np.ndarray, var: np.ndarray | None = None) -> np.ndarray:
    """|Pearson r| of each latent's posterior sample with one factor (of the mean where `var`, the
    posterior variances, is None); 0 for a latent that does not vary."""
    mu, factor = np.asarray(mu, np.float64), np.asarray(factor, np.float64)
    m = mu - mu.mean(0)
    f = factor - factor.mean()
    spread = (m**2).sum(0) + (0.0 if var is None else np.asarray(var, np.float64).sum(0))
    scale = np.sqrt(spread * (f**2).sum())
    with np.errstate(invalid="ignore", divide="ignore"):
        r = np.where(scale > 0, np.abs(m.T @ f) / scale, 0.0)
    return r


def strongest_latents(
    mu: np.ndarray, factors: np.ndarray, names: list[str], var: np.ndarray | None = None, top: int = TOP
) -> dict[str, list]:
    """{factor: [[latent, |r|], ...]}, the `top` latents by |r|, strongest first, for every column
    of `factors` (named by `names`) except the class. More than one is kept because a factor can
    be spread over several latents, and the first alone would hide that."""
    factors = np.asarray(factors, np.float64)
    out = {}
    for j, name in enumerate(names):
        if name == CLASS:
            continue
        r = abs_correlations(mu, factors[:, j], var)
        order = np.argsort(-r, kind="stable")[:top]
        out[name] = [[int(i), round(float(r[i]), 3)] for i in order]
    return out

