"""A: latent masks from atypicality (eq. 4-5)."""
from __future__ import annotations

import torch

from vase.config import MaskConfig
from vase.slots import Slot


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

    Only `maskable` latents can be switched off (default: all). See `Masks` for why.
    """
    on = alpha < cfg.lambda_low
    off = alpha > cfg.lambda_high
    if maskable is not None:
        off = off & maskable
        on = on | ~maskable
    return torch.where(off, torch.zeros_like(previous), torch.where(on, torch.ones_like(previous), previous))


def start_mask(slot: Slot, alpha: torch.Tensor, maskable: torch.Tensor | None, cfg: MaskConfig) -> None:
    """A newly allocated environment takes the batch's own mask (its latents' typicality now)."""
    slot.start(alpha, hysteresis(alpha, torch.ones_like(alpha), cfg, maskable))


class Masks:
    """A on: each slot's mask a^s is applied to its batches (eq. 2) and updated from them (eq. 5).

    Which latents may be masked is the inference's `maskable(s)` (`vase.rules`: every latent as
    printed; `others_latents_only`, `learnt_latents_only`). Masking exists to stop an environment
    from retraining latents that encode factors already learnt (paper §3.3).
    """

    def __init__(self, cfg: MaskConfig):
        self.cfg = cfg

    def applied(self, slot: Slot) -> torch.Tensor:
        return slot.mask

    def update(self, slot: Slot, alpha: torch.Tensor, maskable: torch.Tensor | None,
               used: torch.Tensor | None = None) -> None:
        """Fold one batch's alpha into a^s (EMA then hysteresis).

        `used` (the latents s's usage record counts as used) marks those whose smoothed alpha is
        settled as learnt; the mask itself is decided before, on the previous batches' `learnt`.
        """
        if not slot.initialised:
            start_mask(slot, alpha, maskable, self.cfg)
        else:
            slot.alpha = self.cfg.ema * slot.alpha + (1 - self.cfg.ema) * alpha
            slot.mask = hysteresis(slot.alpha, slot.mask, self.cfg, maskable)
        if used is not None:
            slot.learnt = slot.learnt | (used & (slot.alpha < self.cfg.lambda_low))

    def disagreement(self, slot: Slot, alpha: torch.Tensor, scope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Latents on which the batch's own mask a(x) (eq. 5's hysteresis relative to a^s) contradicts
        a^s, the second test of eq. 6, among `scope`: (latents a(x) may switch off, latents it may
        switch on)."""
        on = slot.mask.bool()
        lost = on & (alpha > self.cfg.lambda_high) & scope[0]
        gained = ~on & (alpha < self.cfg.lambda_low) & scope[1]
        return lost | gained


class AllOnes:
    """A off: every latent of every slot is always on; no mask is updated or tested."""

    def applied(self, slot: Slot) -> torch.Tensor:
        return torch.ones_like(slot.mask)

    def update(self, slot: Slot, alpha: torch.Tensor, maskable: torch.Tensor | None,
               used: torch.Tensor | None = None) -> None:
        """A off: nothing to update."""

    def disagreement(self, slot: Slot, alpha: torch.Tensor, scope: tuple[torch.Tensor, torch.Tensor]) -> None:
        return None
