"""`vase bench`: the straightforward implementation the speed-ups are measured against: the same
networks as nn.Sequential in the default NCHW format, and a plain step with the same loss (eq. 3)."""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from vase import conv_paths
from vase.config import Config, ModelConfig
from vase.networks import IMAGE_SIZE, activation, he_init
from vase.objective import capacity, kl_per_latent, mdl_loss


class ReferenceVAE(nn.Module):
    """The straightforward implementation of the same networks: nn.Sequential, default NCHW format."""

    def __init__(self, m: ModelConfig):
        super().__init__()
        ch = m.channels
        c, r = [m.image_channels, *ch], [*reversed(ch), m.image_channels]
        feat = ch[-1] * (IMAGE_SIZE // 16) ** 2
        slope = m.negative_slope
        enc: list[nn.Module] = []
        for a, b in zip(c[:-1], c[1:]):
            enc += [nn.Conv2d(a, b, 4, 2, 1), activation(slope)]
        self.encoder = nn.Sequential(*enc, nn.Flatten(), nn.Linear(feat, m.hidden), activation(slope),
                                     nn.Linear(m.hidden, 2 * m.latents))
        dec: list[nn.Module] = [nn.Linear(m.latents + m.k_max, m.hidden), activation(slope),
                                nn.Linear(m.hidden, feat), activation(slope),
                                nn.Unflatten(1, (ch[-1], IMAGE_SIZE // 16, IMAGE_SIZE // 16))]
        for i, (a, b) in enumerate(zip(r[:-1], r[1:])):
            dec.append(nn.ConvTranspose2d(a, b, 4, 2, 1))
            if i < len(r) - 2:
                dec.append(activation(slope))
        self.decoder = nn.Sequential(*dec)
        he_init(self, slope)


def reference_from(model: nn.Module, m: ModelConfig) -> ReferenceVAE:
    """A ReferenceVAE holding the weights of a vase VAE (the same function, computed plainly)."""
    ref = ReferenceVAE(m)
    enc_linear = [i for i, mod in enumerate(ref.encoder) if isinstance(mod, nn.Linear)]
    dec_linear = [i for i, mod in enumerate(ref.decoder) if isinstance(mod, nn.Linear)]
    enc_conv = [i for i, mod in enumerate(ref.encoder) if isinstance(mod, nn.Conv2d)]
    dec_conv = [i for i, mod in enumerate(ref.decoder) if isinstance(mod, nn.ConvTranspose2d)]
    pairs = list(zip(enc_conv, [c for c, _ in conv_paths._layers(model.encoder.convs)]))
    pairs += list(zip(enc_linear, [model.encoder.fc, model.encoder.head]))
    with torch.no_grad():
        for i, src in pairs:
            ref.encoder[i].weight.copy_(src.weight)
            ref.encoder[i].bias.copy_(src.bias)
        for i, src in zip(dec_linear + dec_conv, [model.decoder.fc1, model.decoder.fc2,
                                                   *[c for c, _ in conv_paths._layers(model.decoder.deconvs)]]):
            ref.decoder[i].weight.copy_(src.weight)
            ref.decoder[i].bias.copy_(src.bias)
    return ref


class ReferenceStep:
    """One plain-VAE step of the reference: encode, reparameterise, decode under env 0, the same MDL
    loss (eq. 3), Adam."""

    def __init__(self, cfg: Config, device: torch.device | str = "cpu"):
        torch.manual_seed(cfg.train.seed)
        self.cfg = cfg
        self.model = ReferenceVAE(cfg.model).to(device)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=cfg.train.lr)
        self.step = 0

    def training_step(self, x: torch.Tensor) -> float:
        mu, logvar = self.model.encoder(x).chunk(2, dim=1)
        z = mu + (0.5 * logvar).exp() * torch.randn_like(mu)
        onehot = torch.zeros(x.shape[0], self.cfg.model.k_max, device=x.device)
        onehot[:, 0] = 1.0
        logits = self.model.decoder(torch.cat([z, onehot], dim=1))
        recon = F.binary_cross_entropy_with_logits(logits, x, reduction="none").flatten(1).sum(1)
        loss = mdl_loss(recon, kl_per_latent(mu, logvar).sum(1), capacity(self.step, self.cfg.objective),
                        self.cfg.objective)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        self.step += 1
        return float(loss.detach())
