"""Images for TensorBoard: reconstructions, latent traversals (Fig. 2 top), cross-domain
reconstructions (Fig. 4B) and the mask table."""
from __future__ import annotations

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


@torch.no_grad()
def traversal_grid(learner, image: torch.Tensor, env: int, used_kl: float) -> torch.Tensor:
    """Each row sweeps one latent over -2..2 from the seed image's mu, decoded under env.

    Rows are sorted by the latent's KL on the seed (informative first, as disentangling-vae does),
    and a coloured band on the left says whether env uses the latent (its running information,
    `EnvironmentInference.usage`), masks it, or leaves it spare.
    """
    post = learner.model.encoder(image[None])
    mask = learner.masks.mask(env)
    base = post.mu[0] * mask
    n = base.shape[0]
    values = TRAVERSAL_VALUES.to(base.device, base.dtype)
    z = base.repeat(n * len(values), 1)
    rows = torch.arange(n, device=z.device).repeat_interleave(len(values))
    z[torch.arange(z.shape[0], device=z.device), rows] = values.repeat(n)
    envs = torch.full((z.shape[0],), env, dtype=torch.long, device=z.device)
    frames = torch.sigmoid(learner.model.decoder(z, envs)).cpu()
    frames = frames.expand(-1, 3, -1, -1).reshape(n, len(values), 3, *frames.shape[-2:])
    usage = learner.inference.usage[env].cpu() if learner.cfg.inference.enabled else torch.full((n,), used_kl + 1)
    mask = mask.cpu()
    kl = kl_per_latent(post.mu, post.logvar)[0].cpu()
    order = torch.argsort(kl, descending=True)
    band = torch.empty(n, 1, 3, *frames.shape[-2:])
    for i in range(n):
        colour = MASKED if mask[i] == 0 else (USED if usage[i] > used_kl else SPARE)
        band[i, 0] = torch.tensor(colour)[:, None, None]
    frames = torch.cat([band, frames], dim=1)[order]
    return make_grid(frames.reshape(-1, *frames.shape[2:]), nrow=len(values) + 1, pad_value=1.0)


@torch.no_grad()
def cross_domain_panel(learner, images: torch.Tensor, slots: int) -> torch.Tensor:
    """Fig. 4B: each image encoded once and decoded under every slot s < `slots` with a^s.

    Returns (R, 1 + slots, C, H, W) in [0, 1]: the input, then its reconstruction under each slot.
    mu depends on x only, never on s (spec §2), so what changes along a row is the decoder's
    reading of the same latents: the homologies VASE found between the environments.
    """
    decoded = [learner.reconstruct_mean(images, s) for s in range(slots)]
    return torch.stack([images, *decoded], dim=1).cpu()


def mask_image(masks: torch.Tensor, n_envs: int, scale: int = 12) -> torch.Tensor:
    """The masks a^s of the allocated environments as a (3, H, W) image: rows envs, columns latents."""
    m = masks[: max(n_envs, 1)].float().cpu()
    img = m.repeat_interleave(scale, 0).repeat_interleave(scale, 1)
    return img[None].expand(3, -1, -1)
