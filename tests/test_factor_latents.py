"""The latents that carry each factor: Pearson correlation on synthetic codes with a known answer."""
import numpy as np

from vase.metrics.factor_latents import abs_correlations, strongest_latents


def test_each_factor_finds_the_latents_built_from_it_whatever_their_sign():
    rng = np.random.default_rng(0)
    n = 500
    x, y, cls = rng.uniform(size=n), rng.uniform(size=n), rng.integers(0, 10, size=n)
    codes = rng.normal(size=(n, 6))
    codes[:, 2] = 3 * x + 0.1 * rng.normal(size=n)
    codes[:, 4] = x + 0.5 * rng.normal(size=n)  # a weaker, second carrier of x
    codes[:, 5] = -y + 0.1 * rng.normal(size=n)  # anticorrelated: |r| counts
    codes[:, 0] = cls  # the class is not a factor we look up
    out = strongest_latents(codes, np.stack([cls, x, y], 1), ["class", "x", "y"])
    assert set(out) == {"x", "y"}
    assert [latent for latent, _ in out["x"][:2]] == [2, 4]
    assert out["x"][0][1] > 0.99 and 0.3 < out["x"][1][1] < 0.8
    assert out["y"][0][0] == 5 and out["y"][0][1] == round(abs(np.corrcoef(codes[:, 5], y)[0, 1]), 3)
    assert all(len(pairs) == 3 for pairs in out.values())
    assert all(a[1] >= b[1] for pairs in out.values() for a, b in zip(pairs, pairs[1:]))  # strongest first


def test_a_constant_latent_scores_zero_not_nan():
    factor = np.arange(10.0)
    codes = np.stack([np.ones(10), factor**2], 1)
    r = abs_correlations(codes, factor)
    assert r[0] == 0.0 and 0.9 < r[1] < 1.0
    assert strongest_latents(codes, factor[:, None], ["x"]) == {"x": [[1, round(float(r[1]), 3)], [0, 0.0]]}


def test_a_latent_whose_mean_barely_moves_under_posterior_noise_does_not_count():
    """The sample's correlation, not the mean's: a mean that tracks x by 0.01 under unit noise
    carries almost nothing, however perfect the mean's own correlation."""
    rng = np.random.default_rng(1)
    x = rng.uniform(-1, 1, size=400)
    mu = np.stack([0.01 * x, x + 0.3 * rng.normal(size=400)], 1)
    var = np.stack([np.ones(400), np.full(400, 0.01)], 1)
    by_mean = abs_correlations(mu, x)
    by_sample = abs_correlations(mu, x, var)
    assert by_mean[0] > 0.999 > by_mean[1]  # the mean alone prefers the leak
    assert by_sample[0] < 0.01 and by_sample[1] > 0.85
    # Closed form of the sample's correlation: cov(mu, x) / sqrt((var(mu) + E[sigma^2]) var(x)).
    expected = np.cov(mu[:, 1], x, bias=True)[0, 1] / np.sqrt((mu[:, 1].var() + 0.01) * x.var())
    assert abs(by_sample[1] - expected) < 1e-12
    assert strongest_latents(mu, x[:, None], ["x"], var, top=1) == {"x": [[1, round(float(by_sample[1]), 3)]]}
