"""`vase eval --atypicality`: alpha (eq. 4) of held-out batches, against closed-form values."""
from __future__ import annotations

import math

import pytest
import torch

from vase.networks import Posterior
from vase.probing import SlotReading
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

    alpha, info, picks = batch_atypicality(shifted_encoder(2.0), images_of, len(images), batches=3,
                                           batch_size=64, generator=torch.Generator().manual_seed(0))
    assert picks is None  # no slots given
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


def test_each_batch_is_read_on_the_slot_q_psi_picks_and_on_each_slots_latents():
    # A stand-in q_psi on the hidden layer (here mu): an image of +1 is slot 1's, one of -1 slot 0's,
    # each all but surely; eq. 6 averages q_psi over the batch, so a batch goes to slot 1 where
    # most of its images are +1 (a tie favours slot 0: its images are the surer). Batches of 64
    # drawn from 100 images of +1 and 100 of -1 at logvar 0.
    def classifier(hidden):
        return torch.stack([torch.zeros(len(hidden)), 50 * (hidden[:, 1] - 0.2)], 1)

    images = torch.cat([torch.ones(100), -torch.ones(100)])
    drawn = []

    def images_of(indices):
        drawn.append(images[indices])
        return images[indices]

    masks = torch.tensor([[1.0, 0.0], [1.0, 1.0]])  # slot 0 masks latent 1; slot 1 masks nothing
    alpha, info, picks = batch_atypicality(shifted_encoder(2.0), images_of, len(images), batches=6,
                                           batch_size=64, generator=torch.Generator().manual_seed(1),
                                           slots=SlotReading(masks, classifier))
    assert picks == [int(batch.mean() > 0) for batch in drawn] and len(set(picks)) == 2
    row = Typicality(step=10, environment="mnist", alpha=alpha, information=info, picks=picks, slot_masks=masks)
    by_slot = row.information_by_slot()
    # Latent 0 carries nothing (it is shifted alike for every image), so slot 0, which leaves only
    # latent 0 unmasked, reads 0 nats; slot 1 reads latent 1's 0.5 log(2 - m^2), averaged.
    expected = sum(0.5 * math.log(2 - batch.mean().item() ** 2) for batch in drawn) / len(drawn)
    assert by_slot == pytest.approx([0.0, expected], abs=1e-5)
    assert row.picked() == {0: picks.count(0), 1: picks.count(1)}
    assert row.as_dict()["information_by_slot"] == pytest.approx(by_slot)
    text = typicality_text([row], (0.3, 1.0))
    assert f"q_psi picks slot 0 x{picks.count(0)}, slot 1 x{picks.count(1)}" in text
    assert f"s0 0.0  s1 {expected:.1f}" in text
    assert "q_psi picks" not in typicality_text([Typicality(10, "mnist", alpha, info)], (0.3, 1.0))
