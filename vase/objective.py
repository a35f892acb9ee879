"""The MDL objective on current data (eq. 3) and its pieces, as pure functions (eq. 3)."""
from __future__ import annotations

import torch
from torch.nn import functional as F

from vase.config import ObjectiveConfig


def reconstruction_nll(logits: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """-log p(x|z,s) under Bernoulli pixels, summed over pixels: one value per example (B,).

    Summing (not averaging) over pixels keeps gamma and C in the units the paper tuned them in.
    """
    return F.binary_cross_entropy_with_logits(logits, x, reduction="none").flatten(1).sum(1)


def kl_per_latent(mu: torch.Tensor, logvar: torch.Tensor) -> torch.Tensor:
    """KL(N(mu, sigma^2) || N(0, 1)) per example and latent, in nats: (B, N)."""
    return 0.5 * (mu.pow(2) + logvar.exp() - 1.0 - logvar)


def prior_where_masked(mu: torch.Tensor, logvar: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The posterior parameters of eq. 2: where mask = 0 the latent is the prior, mu = 0, log sigma^2 = 0.

    Select before computing anything from them. A masked latent gets no gradient, so its encoder
    output can drift far (log sigma^2 of 90 was seen when every latent was masked, in the "A" row on
    moving MNIST); exp then overflows, and inf * 0 is NaN in the loss and in its gradient.
    """
    keep = mask.bool()
    return torch.where(keep, mu, 0.0), torch.where(keep, logvar, 0.0)


def masked_kl(mu: torch.Tensor, logvar: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """KL of the masked posterior (eq. 2) per example (B,): masked latents equal the prior, so add 0."""
    return kl_per_latent(*prior_where_masked(mu, logvar, mask)).sum(1)


def masked_sample(mu: torch.Tensor, logvar: torch.Tensor, mask: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Reparameterised sample of eq. 2.

    Where mask = 1, z = mu + sigma * eps; where mask = 0, z = 0 + 1 * eps = eps ~ N(0, 1) exactly,
    and no gradient reaches mu or sigma of that latent (`prior_where_masked` selects first, so an
    overflowing sigma of a masked latent never enters the arithmetic).
    """
    mu, logvar = prior_where_masked(mu, logvar, mask)
    return mu + (0.5 * logvar).exp() * noise


def capacity(step: int, cfg: ObjectiveConfig) -> float:
    """C(t): linear from 0 to C_max over capacity_ramp_steps, then held (Burgess et al. 2017).

    A pure function of the global step, so evaluation can never advance it and resume cannot drift.
    """
    if cfg.capacity_ramp_steps == 0:
        return cfg.capacity_max
    return cfg.capacity_max * min(1.0, step / cfg.capacity_ramp_steps)


def environment_capacity(step: int, start: tuple[int, float | torch.Tensor] | None,
                         cfg: ObjectiveConfig) -> float | torch.Tensor:
    """The capacity target of an environment allocated at step t_s carrying KL_s nats then, start = (t_s, KL_s).

    With objective.new_env_ramp_steps = R > 0 [ours, the rule own_capacity_ramp]:
    min(C(t), KL_s + C_max (t - t_s) / R), so a new environment whose known latents are masked grows
    its capacity as the first one did instead of meeting C(t) at once. With R = 0, and for the first
    environment (start None), it is C(t), eq. 3. KL_s may be a 0-d tensor (the allocating batch's
    own KL, not yet read to the host); the target is then one too.
    """
    target = capacity(step, cfg)
    if cfg.new_env_ramp_steps == 0 or start is None:
        return target
    t_s, kl_s = start
    climb = kl_s + cfg.capacity_max * (step - t_s) / cfg.new_env_ramp_steps
    return torch.clamp(climb, max=target) if torch.is_tensor(climb) else min(target, climb)


def capacity_penalty(kl: torch.Tensor, target: float, form: str) -> torch.Tensor:
    """|KL - C|^2 (form "squared", eq. 8 of the paper and its poster) or |KL - C| (form "absolute",
    Burgess et al.'s CCI-VAE), of the batch's mean KL. The two have different units, so gamma is
    calibrated per form (docs/regime.md)."""
    gap = kl.mean() - target
    return gap.pow(2) if form == "squared" else gap.abs()


def mdl_loss(recon: torch.Tensor, kl: torch.Tensor, target: float, cfg: ObjectiveConfig,
             fresh_atypical: torch.Tensor | None = None) -> torch.Tensor:
    """Eq. 3 / eq. 8: E[-log p(x|z,s)] + gamma |KL - C|^2 (or |KL - C|, objective.capacity_form),
    means over the batch.

    `target`: C in nats, C(t) (`capacity`) or the environment's own target (`environment_capacity`).
    The entangled baseline is the plain VAE (beta = 1).

    `fresh_atypical`: the summed atypicality (eq. 4) of a new environment's fresh latents on this
    batch, a penalty in units of gamma with weight fresh_aggregate_weight ([ours], see
    ObjectiveConfig and `vase.rules.FreshLatentPenalty`).
    """
    if cfg.mode == "entangled":
        return recon.mean() + kl.mean()
    loss = recon.mean() + cfg.gamma * capacity_penalty(kl, target, cfg.capacity_form)
    if cfg.fresh_aggregate_weight and fresh_atypical is not None:
        loss = loss + cfg.gamma * cfg.fresh_aggregate_weight * fresh_atypical
    return loss
