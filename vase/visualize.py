"""Images as tensors, for TensorBoard and `vase inspect`: reconstructions, latent traversals
(Fig. 2 top, Fig. 3A) and their animation, cross-domain reconstructions (Fig. 4B), the mask table."""
from __future__ import annotations

import math

import torch
from torchvision.utils import make_grid

from vase.objective import kl_per_latent

# Row colours of a traversal: the latent is used by this environment, masked, or spare (Fig. 2 top).
USED, MASKED, SPARE = (0.2, 0.8, 0.2), (0.8, 0.2, 0.2), (0.5, 0.5, 0.5)
TRAVERSAL_VALUES = torch.linspace(-2.0, 2.0, 7)


def reconstruction_grid(originals: torch.Tensor, reconstructions: torch.Tensor) -> torch.Tensor:
    """Originals on the top row, reconstructions below: (3, H, W) in [0,1]."""
    n = originals.shape[0]
    return make_grid(torch.cat([originals, reconstructions]).expand(-1, 3, -1, -1), nrow=n, pad_value=1.0)


def latent_colours(learner, env: int, used_kl: float) -> torch.Tensor:
    """(N, 3) colour per latent for slot env: masked by a^env, used (its running information,
    `vase.slots.Slot.usage`, above used_kl) or spare (Fig. 2 top's row colours). With S off
    there is one slot and no usage record, so every unmasked latent counts as used."""
    mask = learner.mask(env).cpu()
    n = mask.shape[0]
    usage = learner.slots[env].usage if learner.cfg.inference.enabled else torch.full((n,), used_kl + 1)
    colours = torch.tensor([USED if u > used_kl else SPARE for u in usage.tolist()])
    colours[mask == 0] = torch.tensor(MASKED)
    return colours


@torch.no_grad()
def traversal_frames(
    learner, image: torch.Tensor, env: int, latents: torch.Tensor | None = None, values: torch.Tensor = TRAVERSAL_VALUES
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decoded sweeps of `latents` (default: all, by the latent's KL on the seed image, informative
    first, as disentangling-vae does) over `values`, from the seed image's mu under env with a^env.

    Returns (frames (L, V, C, H, W) in [0, 1], latents): row i holds latents[i] swept, every other
    latent kept at the seed's mean (masked ones at the prior mean 0, as eq. 2 decodes them).
    """
    post = learner.model.encoder(image[None])
    base = post.mu[0] * learner.mask(env)
    if latents is None:
        latents = torch.argsort(kl_per_latent(post.mu, post.logvar)[0], descending=True)
    values, latents = values.to(base.device, base.dtype), latents.to(base.device)
    z = base.repeat(len(latents) * len(values), 1)
    rows = latents.repeat_interleave(len(values))
    z[torch.arange(z.shape[0], device=z.device), rows] = values.repeat(len(latents))
    envs = torch.full((z.shape[0],), env, dtype=torch.long, device=z.device)
    frames = torch.sigmoid(learner.model.decoder(z, envs)).cpu()  # pictures are made on the host
    return frames.reshape(len(latents), len(values), *frames.shape[1:]), latents.cpu()


def traversal_grid(learner, image: torch.Tensor, env: int, used_kl: float) -> torch.Tensor:
    """Each row sweeps one latent over -2..2 (`traversal_frames`), with a band on the left coloured
    by `latent_colours`: env uses the latent, masks it, or leaves it spare. (3, H, W) in [0, 1]."""
    frames, latents = traversal_frames(learner, image, env)
    frames = frames.expand(-1, -1, 3, -1, -1)
    band = latent_colours(learner, env, used_kl)[latents][:, None, :, None, None].expand(-1, 1, -1, *frames.shape[-2:])
    frames = torch.cat([band, frames], dim=1)
    return make_grid(frames.reshape(-1, *frames.shape[2:]), nrow=frames.shape[1], pad_value=1.0)


@torch.no_grad()
def cross_domain_panel(learner, images: torch.Tensor, slots: int) -> torch.Tensor:
    """Fig. 4B: each image encoded once and decoded under every slot s < `slots` with a^s.

    Returns (R, 1 + slots, C, H, W) in [0, 1]: the input, then its reconstruction under each slot.
    mu depends on x only, never on s (docs/method.md, networks), so what changes along a row is the decoder's
    reading of the same latents: the homologies VASE found between the environments.
    """
    decoded = [learner.reconstruct_mean(images, s) for s in range(slots)]
    return torch.stack([images, *decoded], dim=1).cpu()


def mask_image(masks: torch.Tensor, n_envs: int, scale: int = 12) -> torch.Tensor:
    """The masks a^s of the allocated environments as a (3, H, W) image: rows envs, columns latents."""
    m = masks[: max(n_envs, 1)].float().cpu()
    img = m.repeat_interleave(scale, 0).repeat_interleave(scale, 1)
    return img[None].expand(3, -1, -1)


def traversal_animation(frames: torch.Tensor, colours: torch.Tensor, band: int = 4) -> list[torch.Tensor]:
    """One (3, H, W) picture per sweep position of `traversal_frames` (L, V, C, H, W): the L rows
    tiled in a square, each tile topped by a band of its latent's `latent_colours`, so a GIF of
    them shows every latent moving at once."""
    tiles, values = frames.shape[0], frames.shape[1]
    bands = colours[:, :, None, None].expand(-1, -1, band, frames.shape[-1])
    columns = max(1, math.ceil(math.sqrt(tiles)))
    return [
        make_grid(torch.cat([bands, frames[:, v].expand(-1, 3, -1, -1)], dim=2), nrow=columns, pad_value=0.5)
        for v in range(values)
    ]
