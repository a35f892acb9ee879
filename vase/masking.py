"""A: latent masks from atypicality (eq. 4-5)."""
from __future__ import annotations

import torch

from vase.config import MaskConfig


def atypicality(mu: torch.Tensor, logvar: torch.Tensor) -> torch.Tensor:
    """alpha_n = KL(E_batch[q(z_n|x)] || N(0,1)) (eq. 4), one value per latent (N,).

    The batch aggregate is a Gaussian mixture; we replace it by the Gaussian with the mixture's
    first two moments (eq. 4-5), whose KL to N(0,1) is closed-form.
    """
    m = mu.mean(0)
    v = (logvar.exp() + mu.pow(2)).mean(0) - m.pow(2)
    v = v.clamp_min(1e-8)
    return 0.5 * (v + m.pow(2) - 1.0 - v.log())


def information(kl: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """Per-latent information I(x; z_n) estimated from a batch: its mean KL minus its atypicality.

    E_x KL(q(z_n|x) || p) = I(x; z_n) + KL(q(z_n) || p), and eq. 4's alpha_n estimates the second
    term. A latent whose mean is shifted by the same amount for every image costs KL but tells the
    decoder nothing; this reading gives it ~0. Clamped at 0: the moment approximation of alpha is
    not exact, and on a batch the difference can dip below zero.
    """
    return (kl - alpha).clamp_min(0)


def hysteresis(
    alpha: torch.Tensor, previous: torch.Tensor, cfg: MaskConfig, maskable: torch.Tensor | None = None
) -> torch.Tensor:
    """Eq. 5 with two thresholds: off above lambda_high, on below lambda_low, else unchanged.

    Only `maskable` latents can be switched off (default: all). See `LatentMasks` for why.
    """
    on = alpha < cfg.lambda_low
    off = alpha > cfg.lambda_high
    if maskable is not None:
        off = off & maskable
        on = on | ~maskable
    return torch.where(off, torch.zeros_like(previous), torch.where(on, torch.ones_like(previous), previous))


class LatentMasks:
    """One mask a^s per environment slot, plus the smoothed atypicality that drives it.

    A new slot starts with every latent on: unused latents have alpha ~ 0 and are spare capacity.

    Which latents may be masked is the caller's `maskable` argument [ours]. Masking exists to stop
    an environment from retraining latents that encode factors already learnt (paper §3.3). A latent
    that is being learnt right now is atypical too, until its aggregate posterior settles to the
    prior, and masking it would stop that learning: masked latents get no gradient (eq. 2), so
    their atypicality never falls again.
    - With environment inference on, the learner passes the latents that *other* environments use.
    - With S off there is one slot, and the learner passes its `learnt` latents: those it has used
      (usage above `used_kl`) while their smoothed alpha was settled below lambda_low. Literal eq. 5
      (every latent maskable) masked latents while they were being learnt and closed all 24 of
      them in the "A" and "DA" rows (docs/method.md).
    """

    def __init__(self, k_max: int, latents: int, cfg: MaskConfig, device: torch.device | str = "cpu"):
        self.cfg = cfg
        self.device = torch.device(device)
        self.masks = torch.ones(k_max, latents, device=device)
        self.alpha = torch.zeros(k_max, latents, device=device)
        self.initialised = torch.zeros(k_max, dtype=torch.bool)  # host-side: read by `if`s
        self.learnt = torch.zeros(k_max, latents, dtype=torch.bool, device=device)  # used while settled; never cleared

    def mask(self, env: int) -> torch.Tensor:
        if not self.cfg.enabled:
            return torch.ones_like(self.masks[env])
        return self.masks[env]

    def batch_mask(self, alpha: torch.Tensor, env: int, maskable: torch.Tensor | None = None) -> torch.Tensor:
        """a(x) for the agreement test of eq. 6: the hysteresis rule relative to a^env."""
        return hysteresis(alpha, self.mask(env), self.cfg, maskable)

    def start(self, env: int, alpha: torch.Tensor, maskable: torch.Tensor | None = None) -> None:
        """A newly allocated environment takes the batch's own mask (its latents' typicality now)."""
        self.alpha[env] = alpha
        self.masks[env] = hysteresis(alpha, torch.ones_like(alpha), self.cfg, maskable)
        self.initialised[env] = True
        self.learnt[env] = False

    def update(
        self, env: int, alpha: torch.Tensor, maskable: torch.Tensor | None = None, used: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Fold one batch's alpha into a^env (EMA then hysteresis) and return the new mask.

        `used` (the latents env's usage record counts as used) marks those whose smoothed alpha is
        settled as learnt; the mask itself is decided before, on the previous batches' `learnt`.
        """
        if not self.initialised[env]:
            self.start(env, alpha, maskable)
        else:
            self.alpha[env] = self.cfg.ema * self.alpha[env] + (1 - self.cfg.ema) * alpha
            self.masks[env] = hysteresis(self.alpha[env], self.masks[env], self.cfg, maskable)
        if used is not None:
            self.learnt[env] |= used & (self.alpha[env] < self.cfg.lambda_low)
        return self.mask(env)

    def row(self, env: int) -> dict:
        """The state of one environment's mask, to restore with `restore_row`."""
        return {
            "mask": self.masks[env].clone(),
            "alpha": self.alpha[env].clone(),
            "initialised": bool(self.initialised[env]),
            "learnt": self.learnt[env].clone(),
        }

    def restore_row(self, env: int, row: dict) -> None:
        self.masks[env], self.alpha[env], self.initialised[env] = row["mask"], row["alpha"], row["initialised"]
        self.learnt[env] = row["learnt"]

    def state_dict(self) -> dict:
        return {
            "masks": self.masks.clone(),
            "alpha": self.alpha.clone(),
            "initialised": self.initialised.clone(),
            "learnt": self.learnt.clone(),
        }

    def load_state_dict(self, d: dict) -> None:
        self.masks = d["masks"].to(self.device, copy=True)
        self.alpha = d["alpha"].to(self.device, copy=True)
        self.initialised = d["initialised"].to("cpu", copy=True)
        # Checkpoints written before the single-slot rule have no record: nothing learnt yet.
        self.learnt = d["learnt"].to(self.device, copy=True) if "learnt" in d else \
            torch.zeros_like(self.masks, dtype=torch.bool)
