"""The split of an encoder's drift over the latents (vase/latent_drift.py) on an error with a known
answer."""
from __future__ import annotations

import pytest
import torch

from vase.latent_drift import correlations, latent_increments


def test_each_latent_adds_what_its_own_move_costs_under_an_additive_error():
    target = torch.randn(16, 6)

    def error(codes: torch.Tensor) -> float:  # squared distance to the codes the decoder was trained on
        return float((codes - target).pow(2).sum(1).mean())

    now = target.clone()
    now[:, 2] += 0.5
    now[:, 4] -= 2.0
    increments = latent_increments(error, target, now)
    assert increments == pytest.approx([0, 0, 0.25, 0, 4.0, 0], abs=1e-5)


def test_a_latent_the_error_ignores_adds_nothing_and_the_codes_given_are_not_changed():
    then, now = torch.zeros(8, 3), torch.ones(8, 3)
    mask = torch.tensor([1.0, 0.0, 1.0])  # latent 1 masked: decoded at the prior mean whatever its code
    increments = latent_increments(lambda codes: float((codes * mask).sum()), then, now)
    assert increments == [8.0, 0.0, 8.0]
    assert torch.equal(then, torch.zeros(8, 3)) and torch.equal(now, torch.ones(8, 3))


def test_correlations_tell_a_shifted_code_from_a_reordered_one():
    then = torch.randn(200, 3)
    now = torch.stack([2 * then[:, 0] + 1, -then[:, 1], then[torch.randperm(200), 2]], 1)
    r = correlations(then, now)
    assert r[0] == pytest.approx(1.0, abs=1e-5) and r[1] == pytest.approx(-1.0, abs=1e-5)
    assert abs(float(r[2])) < 0.3  # the same values given to other images
    assert float(correlations(torch.ones(5, 1), torch.randn(5, 1))[0]) == 0.0  # a constant code
