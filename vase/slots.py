"""One record per environment slot: everything eq. 5-6 keep for an environment s.

A slot holds its mask a^s and the smoothed atypicality that drives it (eq. 5), the latents it has
learnt (`vase.rules.LearntLatentsOnly`), its running reconstruction error L_s (eq. 6) and its running
latent usage (information or KL per latent, as the rule set reads it). `Slots` is the k_max records
of a learner, with their checkpoint layout.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from vase.device import wide_float

# The fields of a slot and, for checkpoints, the ones that live on the host (read by `if`s).
TENSORS = ("mask", "alpha", "learnt", "error", "usage")
FLAGS = ("initialised", "recorded")


@dataclass
class Slot:
    mask: torch.Tensor  # a^s (eq. 5): 1 keeps a latent, 0 replaces it by the prior (eq. 2)
    alpha: torch.Tensor  # eq. 4's atypicality, smoothed over the batches trained in s
    learnt: torch.Tensor  # bool per latent: used while settled (never cleared)
    error: torch.Tensor  # L_s (eq. 6), a 0-d float32 tensor
    usage: torch.Tensor  # running per-latent use while training in s
    initialised: bool = False  # a^s has started from a batch
    recorded: bool = False  # L_s and usage hold at least one batch

    @classmethod
    def empty(cls, latents: int, device: torch.device) -> Slot:
        """A slot never trained: every latent on (spare capacity, eq. 5), nothing recorded."""
        zeros = torch.zeros(latents, device=device)
        return cls(torch.ones(latents, device=device), zeros, torch.zeros(latents, dtype=torch.bool, device=device),
                   torch.zeros((), device=device), zeros.clone())

    def start(self, alpha: torch.Tensor, mask: torch.Tensor) -> None:
        """A newly allocated environment takes the batch's alpha and its mask from that batch (eq. 5)."""
        self.alpha, self.mask = alpha.clone(), mask
        self.learnt = torch.zeros_like(self.learnt)
        self.initialised = True

    def record(self, error: torch.Tensor | float, usage: torch.Tensor, ema: float) -> None:
        """Fold a trained batch's error (a 0-d tensor, read on the device) into L_s and its usage per
        latent into the running usage (EMAs with weight `ema` on the past)."""
        device = self.usage.device
        if not torch.is_tensor(error):
            error = torch.tensor(error, dtype=torch.float64, device=device)
        if not self.recorded:
            self.error, self.usage = error.to(device, torch.float32, copy=True), usage.to(self.usage, copy=True)
            self.recorded = True
            return
        # (1 - ema) * error is rounded once from double precision, as a Python float would be, so the
        # running average is the same number whether the error comes as a tensor or as a float.
        self.error = ema * self.error + ((1 - ema) * error.to(wide_float(device))).float()
        self.usage = ema * self.usage + (1 - ema) * usage


class Slots:
    """The k_max slot records of a learner, indexed by environment."""

    def __init__(self, k_max: int, latents: int, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.records = [Slot.empty(latents, self.device) for _ in range(k_max)]

    def __getitem__(self, env: int) -> Slot:
        return self.records[env]

    def __setitem__(self, env: int, slot: Slot) -> None:
        self.records[env] = slot

    def __len__(self) -> int:
        return len(self.records)

    def stack(self, name: str) -> torch.Tensor:
        """One field of every slot, stacked: (k_max, ...) for tensors, a host bool tensor for flags."""
        if name in FLAGS:
            return torch.tensor([getattr(s, name) for s in self.records], dtype=torch.bool)
        return torch.stack([getattr(s, name) for s in self.records])

    # -- checkpointing ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {name: self.stack(name) for name in TENSORS + FLAGS}

    def load_state_dict(self, d: dict) -> None:
        self.records = [row(d, s, self.device) for s in range(len(d["mask"]))]


def row(d: dict, s: int, device: torch.device) -> Slot:
    """Slot s of a stacked state dict (`Slots.state_dict`)."""
    return Slot(**{name: d[name][s].to(device, copy=True) for name in TENSORS},
                **{name: bool(d[name][s]) for name in FLAGS})


def from_split_layout(inference: dict, masks: dict) -> dict:
    """A checkpoint's inference state in the slot layout (`EnvironmentInference.state_dict`), from the
    split layout a format-2 checkpoint may hold: L_s, usage and the recorded flags stacked in the
    inference's state, and the masks in an entry of their own ("masks"). Returns a new dict."""
    new = {k: v for k, v in inference.items() if k not in ("errors", "usage", "recorded")}
    learnt = masks.get("learnt", torch.zeros_like(masks["masks"], dtype=torch.bool))  # absent: nothing learnt
    new["slots"] = {"mask": masks["masks"], "alpha": masks["alpha"], "learnt": learnt,
                    "initialised": masks["initialised"], "error": inference["errors"], "usage": inference["usage"],
                    "recorded": inference["recorded"]}
    return new
