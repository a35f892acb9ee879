"""`vase eval --atypicality`: alpha (eq. 4) of held-out batches, against closed-form values."""
from __future__ import annotations

import math

import pytest
import torch

from vase.networks import Posterior
from vase.typicality import Typicality, batch_atypicality, typicality_text


def shifted_encoder(shift: float):
    """mu = (shift, image value), logvar 0: latent 0 is shifted alike for every image."""
    def encode(x: torch.Tensor) -> Posterior:
        mu = torch.stack([torch.full_like(x, shift), x], 1)
        return Posterior(mu, torch.zeros_like(mu), mu)
    return encode


def test_batch_atypicality_and_information_match_the_closed_form():
    # Latent 0: every image at mean 2 with unit variance, so the aggregate is N(2, 1) and
    # alpha = (1 + 4 - 1 - log 1) / 2 = 2. Latent 1: mu = +-1 with unit variance; a batch with a
    # share p at +1 has mean m = 2p - 1 and variance 1 + 1 - m^2, so alpha = (1 - log(2 - m^2)) / 2.
    images = torch.tensor([1.0, -1.0]).repeat(32)
    drawn = []

    def images_of(indices):
        drawn.append(images[indices])
        return images[indices]

    alpha, info = batch_atypicality(shifted_encoder(2.0), images_of, len(images), batches=3, batch_size=64,
                                    generator=torch.Generator().manual_seed(0))
    assert alpha.shape == info.shape == (3, 2)
    assert torch.allclose(alpha[:, 0], torch.full((3,), 2.0))
    # Latent 0's KL per image, (4 + 1 - 1 - 0) / 2 = 2, is all atypicality: it carries nothing.
    assert torch.allclose(info[:, 0], torch.zeros(3), atol=1e-6)
    for a, i, batch in zip(alpha[:, 1], info[:, 1], drawn):
        m = batch.mean().item()
        assert a.item() == pytest.approx(0.5 * (1 - math.log(2 - m * m)), abs=1e-5)
        # Latent 1's KL per image is (1 + 1 - 1 - 0) / 2 = 0.5; the rest of it after alpha is
        # information, 0.5 log(2 - m^2) (0.5 log 2 for a balanced batch).
        assert i.item() == pytest.approx(0.5 * math.log(2 - m * m), abs=1e-5)


def test_typicality_reads_the_top_of_each_batch():
    alpha = torch.tensor([[0.1, 0.9, 0.0], [0.2, 0.1, 0.5], [0.0, 1.5, 0.3]])
    info = torch.tensor([[0.0, 2.0, 0.01], [0.0, 3.0, 0.03], [0.0, 1.0, 0.02]])
    row = Typicality(step=100, environment="moving_mnist", alpha=alpha, information=info)
    assert row.top().tolist() == pytest.approx([0.9, 0.5, 1.5])
    assert row.top_quantiles() == pytest.approx([0.58, 0.9, 1.38])  # linear interpolation
    assert row.top_latent() == 1  # the batch's highest alpha is z1's in two batches of three
    d = row.as_dict()
    assert d["top_alpha_quantiles"]["p50"] == pytest.approx(0.9) and d["top_latent"] == 1
    text = typicality_text([row], (0.3, 1.0))
    assert "moving_mnist" in text and "(z1)" in text
    assert "z1 0.83" in text and "z2 0.27" not in text  # only mean alpha above lambda_low is listed
    assert text.endswith("|  z1 2.00")  # the informative latents; z2's 0.02 nat is below what is shown
    assert d["mean_information"] == pytest.approx([0.0, 2.0, 0.02])
