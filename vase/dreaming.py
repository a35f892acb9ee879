"""D: the dreaming feedback loop (eq. 7)."""
from __future__ import annotations

import copy
from typing import NamedTuple

import torch
from torch.nn import functional as F

from vase.config import DreamConfig
from vase.networks import IMAGE_SIZE, VAE, Posterior


class Dreams(NamedTuple):
    """A batch imagined by the frozen snapshot (phi', theta')."""

    z: torch.Tensor  # (B', N) prior samples
    env: torch.Tensor  # (B',) past environments s'
    x: torch.Tensor  # (B', C, 64, 64) sigmoid(decoder_theta'(z, s')): the dream images
    logits: torch.Tensor  # the snapshot's decoder logits, for the decoder KL
    posterior: Posterior  # q_phi'(z|x') of the snapshot encoder


class Snapshot:
    """A frozen copy of encoder and decoder, re-synced every tau steps (`Dreaming`)."""

    def __init__(self, model: VAE):
        self.model = copy.deepcopy(model).requires_grad_(False).eval()
        self.passes = self.imagine  # the no-gradient passes of a dream (a CUDA graph replay on CUDA)
        self.uploaded: tuple[tuple, torch.Tensor | None] = ((), None)  # (environments, on their device)

    def sync(self, model: VAE) -> None:
        self.model.load_state_dict(model.state_dict())

    @torch.no_grad()
    def dream(self, past: list[int], n: int, latents: int, generator: torch.Generator,
              sample: bool = False) -> Dreams:
        """Sample s' uniformly from the past environments (per dream) and z ~ N(0, I), then decode;
        with `sample`, x' is drawn from the decoded Bernoulli pixels instead of being their means.

        Drawing s' per sample keeps the cost of a step independent of how many environments exist.
        """
        device = generator.device
        choice = torch.randint(len(past), (n,), generator=generator, device=device)
        env = self.environments(past, device)[choice]
        z = torch.randn(n, latents, generator=generator, device=device)
        if not sample:
            return Dreams(z, env, *self.passes(z, env))
        # The uniforms are drawn here, not inside the passes, so a CUDA graph replays them as an input.
        shape = (n, self.model.decoder.image_channels, IMAGE_SIZE, IMAGE_SIZE)
        return Dreams(z, env, *self.passes(z, env, torch.rand(shape, generator=generator, device=device)))

    def environments(self, past: list[int], device: torch.device) -> torch.Tensor:
        """`past` as a tensor on `device`, uploaded only when the list changes: an upload from the
        host waits for the device to catch up (docs/devices.md), and the list changes only when the
        inference allocates or switches."""
        key = (tuple(past), device)
        if self.uploaded[0] != key:
            self.uploaded = (key, torch.tensor(past, dtype=torch.long, device=device))
        return self.uploaded[1]

    @torch.no_grad()
    def imagine(self, z: torch.Tensor, env: torch.Tensor,
                uniform: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, Posterior]:
        """(x', the decoder's logits, q_phi'(z|x')) of the snapshot for codes z under environments env:
        x' the pixels' means, or with `uniform` a Bernoulli draw of them (pixel on where u < p)."""
        logits = self.model.decoder(z, env).float()
        x = torch.sigmoid(logits)
        if uniform is not None:
            x = (uniform < x).to(x.dtype)
        return x, logits, Posterior(*(p.float() for p in self.model.encoder(x)))

    def state_dict(self) -> dict:
        return self.model.state_dict()

    def load_state_dict(self, d: dict) -> None:
        self.model.load_state_dict(d)


class Dreaming:
    """D on: each step dreams of the environments the inference names, from the snapshot, which is
    re-synced every tau steps (paper §3.5), and also when a new environment is allocated with
    dream.sync_at_allocation [ours, off by default: docs/regime.md, "The snapshot at an arrival"]."""

    def __init__(self, cfg: DreamConfig, snapshot: Snapshot):
        self.cfg, self.snapshot = cfg, snapshot

    def dream(self, envs: list[int], latents: int, generator: torch.Generator) -> Dreams | None:
        if not envs:
            return None
        return self.snapshot.dream(envs, self.cfg.batch_size, latents, generator, self.cfg.images == "sample")

    def new_environment(self, model: VAE) -> None:
        """An environment was allocated: re-sync the snapshot (dream.sync_at_allocation [ours]),
        so the past environments are dreamt by the model that knew them last."""
        if self.cfg.sync_at_allocation:
            self.snapshot.sync(model)

    def stepped(self, step: int, model: VAE) -> None:
        """Step `step` is done: every tau steps the snapshot takes the model's weights."""
        if (step + 1) % self.cfg.snapshot_every == 0:
            self.snapshot.sync(model)


class NoDreams:
    """D off: no dreams, so no eq. 7 term, and the snapshot is left alone."""

    def dream(self, envs: list[int], latents: int, generator: torch.Generator) -> None:
        return None

    def new_environment(self, model: VAE) -> None:
        pass

    def stepped(self, step: int, model: VAE) -> None:
        pass


def encoder_proximity(current: Posterior, snapshot: Posterior) -> torch.Tensor:
    """W2 between diagonal Gaussians, ||mu - mu'||^2 + ||sigma - sigma'||^2, mean over dreams (eq. 7)."""
    sigma, sigma_old = (0.5 * current.logvar).exp(), (0.5 * snapshot.logvar).exp()
    return ((current.mu - snapshot.mu).pow(2) + (sigma - sigma_old).pow(2)).sum(1).mean()


def decoder_proximity(logits: torch.Tensor, snapshot_logits: torch.Tensor) -> torch.Tensor:
    """KL(Bern(p_theta') || Bern(p_theta)) summed over pixels, mean over dreams (eq. 7).

    KL(p'||p) = CE(p', p) - H(p'); both terms as BCE-with-logits for numerical stability, so
    identical logits give exactly zero.
    """
    target = torch.sigmoid(snapshot_logits)
    cross = F.binary_cross_entropy_with_logits(logits, target, reduction="none")
    entropy = F.binary_cross_entropy_with_logits(snapshot_logits, target, reduction="none")
    return (cross - entropy).flatten(1).sum(1).mean()
