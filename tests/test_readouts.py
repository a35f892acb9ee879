"""The read-outs of `vase eval --readouts` tell a code that lacks identity from one that holds it
nonlinearly (docs/regime.md, "The regime")."""
import numpy as np
import torch

from vase.config import build_config
from vase.evaluation import FrozenEncoder
from vase.objective import kl_per_latent
from vase.probing import positions
from vase.readouts import Readout, codes_and_nats, position_readouts, readout_accuracies, readouts_text


def _rings(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Three classes on concentric rings in two latents (no line separates them), plus a noise latent."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 3, n)
    angle = rng.uniform(0, 2 * np.pi, n)
    radius = 1.0 + labels + rng.normal(0, 0.1, n)
    codes = np.column_stack([radius * np.cos(angle), radius * np.sin(angle), rng.normal(size=(n, 1))])
    return codes, labels


def test_nonlinear_read_outs_find_identity_that_no_line_separates():
    codes, labels = _rings(3000, 0)
    test_codes, test_labels = _rings(600, 1)
    acc = readout_accuracies(codes, labels, test_codes, test_labels, probe_images=500, seed=0)
    assert acc["linear"] < 0.6 and acc["linear_more"] < 0.6  # chance is 1/3
    assert acc["neighbours"] > 0.95 and acc["mlp"] > 0.95


def test_a_code_without_identity_stays_at_chance_under_every_read_out():
    rng = np.random.default_rng(2)
    codes, test_codes = rng.normal(size=(3000, 6)), rng.normal(size=(600, 6))
    labels, test_labels = rng.integers(0, 3, 3000), rng.integers(0, 3, 600)
    acc = readout_accuracies(codes, labels, test_codes, test_labels, probe_images=500, seed=0)
    assert all(abs(value - 1 / 3) < 0.08 for value in acc.values()), acc


def test_the_first_linear_read_out_fits_only_the_probes_number_of_images():
    """With two images per class the linear read-out is far worse than with all of them, on a
    linearly separable code, so it must be fitting the first `probe_images` alone."""
    rng = np.random.default_rng(3)
    labels, test_labels = rng.integers(0, 10, 4000), rng.integers(0, 10, 800)
    centres = rng.normal(0, 1.0, (10, 8))
    codes = centres[labels] + rng.normal(0, 0.6, (4000, 8))
    test_codes = centres[test_labels] + rng.normal(0, 0.6, (800, 8))
    acc = readout_accuracies(codes, labels, test_codes, test_labels, probe_images=20, seed=0)
    assert acc["linear_more"] > 0.9 and acc["linear"] < acc["linear_more"] - 0.1


def test_the_text_names_each_environment_and_its_image_counts():
    rows = [Readout(60000, "moving_fashion", 2000, 20000, 0.612, 0.634, 0.651, 0.694, 0.733, [0.05, 6.9, 0.0, 5.1])]
    text = readouts_text(rows)
    assert "step 60000" in text
    assert "moving_fashion   | 61.2 (2,000)          | 63.4 (20,000) | 65.1       | 69.4       | 73.3" in text
    assert "moving_fashion   | total 12.1: z1 6.9, z3 5.1" in text  # z0's 0.05 nat is below the line
    assert readouts_text([]).startswith("no environment")
    assert "position MSE" not in text  # nothing moves in this row


def test_position_is_read_from_mu_and_from_the_hidden_layer_each_on_its_own():
    """x and y linear in the hidden layer, absent from μ: the hidden read-out finds them, μ's scores
    what a constant predictor does, Var(x)/2 + Var(y)/2 = 1/12 for uniform positions."""
    rng = np.random.default_rng(4)
    weights = rng.normal(size=(2, 6))

    def sample(n):
        xy = rng.uniform(0, 1, (n, 2))
        hidden = np.column_stack([xy @ weights + 0.001 * rng.normal(size=(n, 6)), rng.normal(size=(n, 4))])
        return rng.normal(size=(n, 5)), hidden, xy

    codes, hidden, xy = sample(4000)
    test_codes, test_hidden, test_xy = sample(800)
    mse = position_readouts(codes, hidden, xy, test_codes, test_hidden, test_xy)
    assert mse["position_hidden"] < 1e-4
    assert abs(mse["position_mu"] - 1 / 12) < 0.01


def test_positions_are_the_x_and_y_factors_of_the_indexed_items():
    class Env:
        factors = {"x": np.array([0.1, 0.2, 0.3]), "y": np.array([0.9, 0.8, 0.7]), "class": np.array([0, 1, 2])}

    np.testing.assert_array_equal(positions(Env(), np.array([2, 0])), [[0.3, 0.7], [0.1, 0.9]])


def test_the_text_gives_the_position_read_outs_in_units_of_1e_4():
    row = Readout(60000, "moving_fashion", 2000, 20000, 0.6, 0.6, 0.6, 0.6, 0.7, [6.9], position_mu=0.00412,
                  position_hidden=0.00051)
    assert "  moving_fashion   | mu 41.2 | hidden layer 5.1" in readouts_text([row])


class _Images:
    """An environment of fixed images, read by index as a run's environments are."""

    def __init__(self, x: torch.Tensor):
        self.x = x

    def batch(self, idx: torch.Tensor) -> torch.Tensor:
        return self.x[idx]


def test_the_hidden_read_out_reads_the_layer_that_mu_is_a_linear_map_of():
    """The hidden codes are the fc layer's ReLU outputs: non-negative, and μ and the nats are what
    the encoder's head makes of them, image by image, in the order of the indices."""
    torch.manual_seed(0)
    encode = FrozenEncoder(build_config("cpu", ["model.channels=4,4,6,6", "model.hidden=8"]).model)
    x = torch.rand(40, 1, 64, 64, generator=torch.Generator().manual_seed(1))
    indices = np.array([5, 3, 39, 0, 17])
    mu, hidden, nats = codes_and_nats(_Images(x), indices, encode)
    assert mu.shape == (5, 24) and hidden.shape == (5, 8) and hidden.min() >= 0.0
    head_mu, head_logvar = encode.net.head(torch.as_tensor(hidden, dtype=torch.float32)).chunk(2, dim=1)
    np.testing.assert_allclose(mu, head_mu.detach().numpy(), rtol=1e-5, atol=1e-6)
    direct = encode.posterior(x[torch.as_tensor(indices)])
    np.testing.assert_allclose(mu, direct.mu.numpy(), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(nats, kl_per_latent(head_mu.double(), head_logvar.double()).mean(0).detach().numpy(),
                               rtol=1e-4)
