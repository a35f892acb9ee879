"""Encoder q_phi(z|x), decoder p_theta(x|z,s) and environment classifier q_psi(s|x) (docs/method.md, networks).

The networks only: how their convolutions are computed on each device (the CPU fast paths) is
`vase.conv_paths`, which `place` applies.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn
from torch.nn import functional as F

from vase import conv_paths
from vase.config import ModelConfig

IMAGE_SIZE = 64
# Four stride-2 convs take 64x64 down to 4x4.
FEATURE_SIZE = IMAGE_SIZE // 16


class Posterior(NamedTuple):
    mu: torch.Tensor  # (B, N)
    logvar: torch.Tensor  # (B, N)
    hidden: torch.Tensor  # (B, hidden): the last hidden layer, input of the classifier q_psi


def activation(negative_slope: float) -> nn.Module:
    """The hidden layers' nonlinearity (model.negative_slope): the paper's ReLU at 0, else a leaky ReLU."""
    return nn.LeakyReLU(negative_slope) if negative_slope > 0 else nn.ReLU()


def _conv_stack(channels: list[int], transposed: bool, negative_slope: float) -> nn.Sequential:
    layers: list[nn.Module] = []
    conv = nn.ConvTranspose2d if transposed else nn.Conv2d
    for i, (cin, cout) in enumerate(zip(channels[:-1], channels[1:])):
        layers.append(conv(cin, cout, kernel_size=4, stride=2, padding=1))
        # The decoder's last layer emits Bernoulli logits, so no activation after it.
        if not (transposed and i == len(channels) - 2):
            layers.append(activation(negative_slope))
    return nn.Sequential(*layers)


# -- the networks ----------------------------------------------------------------------------------------
class Encoder(nn.Module):
    """4 convs 4x4/2 -> fc hidden -> (mu, log sigma^2). mu and sigma never see s (eq. 2)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        chans = cfg.channels
        self.convs = _conv_stack([cfg.image_channels, *chans], transposed=False, negative_slope=cfg.negative_slope)
        self.fc = nn.Linear(chans[-1] * FEATURE_SIZE * FEATURE_SIZE, cfg.hidden)
        self.act = activation(cfg.negative_slope)
        self.head = nn.Linear(cfg.hidden, 2 * cfg.latents)
        self.implementation = conv_paths.default_implementation(cfg)
        self.weight_grad_kernel = cfg.weight_grad_kernel

    def forward(self, x: torch.Tensor) -> Posterior:
        h = conv_paths.run_stack(self.convs, x, self.implementation, self.weight_grad_kernel)
        h = self.act(self.fc(h.flatten(1)))
        mu, logvar = self.head(h).chunk(2, dim=1)
        return Posterior(mu, logvar, h)


class Decoder(nn.Module):
    """[z ; one-hot(s)] -> fc hidden -> fc -> 4x4 map -> 4 transposed convs -> Bernoulli logits.

    The spec lists the transposed convs as 128->64->64->C, but four stride-2 steps are needed to
    get from 4x4 back to 64x64, so the decoder mirrors the encoder's channels exactly.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        chans = cfg.channels
        self.k_max = cfg.k_max
        self.image_channels = cfg.image_channels
        self.top_channels = chans[-1]
        self.fc1 = nn.Linear(cfg.latents + cfg.k_max, cfg.hidden)
        self.fc2 = nn.Linear(cfg.hidden, chans[-1] * FEATURE_SIZE * FEATURE_SIZE)
        self.deconvs = _conv_stack([*reversed(chans), cfg.image_channels], transposed=True,
                                   negative_slope=cfg.negative_slope)
        self.act = activation(cfg.negative_slope)
        self.implementation = conv_paths.default_implementation(cfg)
        self.weight_grad_kernel = cfg.weight_grad_kernel

    def forward(self, z: torch.Tensor, env: torch.Tensor) -> torch.Tensor:
        """z: (B, N); env: (B,) int64 environment slots. Returns logits (B, C, 64, 64)."""
        onehot = F.one_hot(env, self.k_max).to(z.dtype)
        h = self.act(self.fc1(torch.cat([z, onehot], dim=1)))
        h = self.act(self.fc2(h)).view(-1, self.top_channels, FEATURE_SIZE, FEATURE_SIZE)
        return conv_paths.run_stack(self.deconvs, h, self.implementation, self.weight_grad_kernel)


class EnvironmentClassifier(nn.Module):
    """q_psi(s|x): one linear layer on the encoder's last hidden layer (docs/method.md, networks)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.linear = nn.Linear(cfg.hidden, cfg.k_max)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # Stop-gradient: the classifier must never move the encoder's weights (docs/method.md, networks).
        return self.linear(hidden.detach())


def he_init(module: nn.Module, negative_slope: float = 0.0) -> None:
    """He (Kaiming) normal weights and zero biases for every conv and linear layer [ours].

    PyTorch's default init shrinks the signal through the 6 layers of the encoder, so mu starts
    almost independent of x (std ~1e-3) and the KL term collapses the posterior before the
    encoder learns anything; He init keeps mu's spread near 0.1 at step 0. Its gain,
    sqrt(2 / (1 + slope^2)), is the ReLU's at slope 0.
    """
    for m in module.modules():
        if isinstance(m, (nn.Conv2d, nn.ConvTranspose2d, nn.Linear)):
            nn.init.kaiming_normal_(m.weight, a=negative_slope, nonlinearity="leaky_relu")
            nn.init.zeros_(m.bias)


class VAE(nn.Module):
    """The encoder/decoder pair that the dreaming snapshot copies (phi, theta)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.encoder = Encoder(cfg)
        self.decoder = Decoder(cfg)
        he_init(self, cfg.negative_slope)
        if cfg.channels_last:
            self.to(memory_format=torch.channels_last)
        conv_paths.keep_freed_memory()

