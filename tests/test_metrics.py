"""Tests of the model-free metric library: probes, MIG/DCI, Table 1 / R-matrix summaries, plots."""
import math
import warnings

import numpy as np
import pytest

from vase.metrics.continual import (
    ProbeCurve,
    average_forgetting,
    backward_transfer,
    curve_change,
    format_table1_row,
    kind_of,
    mean_std_over_seeds,
    probe_matrix,
    probe_name,
    table1_stats,
    to_table1_units,
    value_at,
)
from vase.metrics.disentanglement import dci, dci_completeness, dci_disentanglement, factor_labels, mig
from vase.metrics.plots import (
    atypicality_figure,
    latent_use_figure,
    latent_use_matrix,
    probe_colours,
    probe_curves_figure,
)
from vase.metrics.probes import object_id_accuracy, position_mse

# ---------------------------------------------------------------------------------------------
# probes


def _split(a, n):
    return a[:n], a[n:]


def test_object_id_linearly_separable_is_perfect():
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 5, 600)
    codes = np.eye(5)[labels] * 3.0 + 0.05 * rng.normal(size=(600, 5))
    (ctr, cte), (ltr, lte) = _split(codes, 400), _split(labels, 400)
    assert object_id_accuracy(ctr, ltr, cte, lte, seed=0) == 1.0


def test_object_id_random_codes_near_chance():
    rng = np.random.default_rng(1)
    labels = rng.integers(0, 5, 2000)
    codes = rng.normal(size=(2000, 8))
    (ctr, cte), (ltr, lte) = _split(codes, 1000), _split(labels, 1000)
    assert abs(object_id_accuracy(ctr, ltr, cte, lte, seed=0) - 1 / 5) < 0.1


def test_object_id_single_training_class_predicts_it():
    codes = np.zeros((4, 2))
    assert object_id_accuracy(codes, np.array([3, 3]), codes[:2], np.array([3, 1]), seed=0) == 0.5


def test_position_mse_true_positions_is_zero():
    xy = np.random.default_rng(2).random((600, 2))
    assert position_mse(xy[:400], xy[:400], xy[400:], xy[400:]) < 1e-6


def test_position_mse_uninformative_codes_is_the_variance():
    rng = np.random.default_rng(3)
    xy, codes = rng.random((2000, 2)), rng.normal(size=(2000, 4))
    # A constant predictor scores Var(U[0,1]) = 1/12 per coordinate.
    assert position_mse(codes[:1000], xy[:1000], codes[1000:], xy[1000:]) == pytest.approx(1 / 12, rel=0.1)


# ---------------------------------------------------------------------------------------------
# disentanglement: the sanity checks of disentanglement_lib (identity ~1, constant ~0, duplicated
# and mixed low) on 4 independent discrete factors.


@pytest.fixture(scope="module")
def factors():
    rng = np.random.default_rng(0)
    return np.stack([rng.integers(0, n, 2000) for n in (5, 6, 8, 10)], axis=1).astype(np.float64)


def _scores(factors, codes):
    return mig(factors, codes, np.random.default_rng(0))["mig"], dci(factors, codes, np.random.default_rng(0))


def test_identity_codes_score_near_one(factors):
    m, d = _scores(factors, factors)
    assert m > 0.95
    assert d["disentanglement"] > 0.95 and d["completeness"] > 0.95 and d["informativeness"] > 0.95


def test_constant_codes_score_zero(factors):
    m, d = _scores(factors, np.zeros((len(factors), 4)))
    assert m == 0.0 and d["disentanglement"] == 0.0 and d["completeness"] == 0.0


def test_duplicated_codes_have_low_mig(factors):
    m, d = _scores(factors, np.repeat(factors, 2, axis=1))
    assert m < 0.05
    # Each factor is split evenly over two of 8 latents: completeness 1 - log 2 / log 8 = 2/3.
    assert d["completeness"] == pytest.approx(2 / 3, abs=0.05)


def test_mixed_codes_score_low(factors):
    rng = np.random.default_rng(5)
    rotation, _ = np.linalg.qr(rng.normal(size=(4, 4)))
    standardised = (factors - factors.mean(0)) / factors.std(0)
    m, d = _scores(factors, standardised @ rotation)
    assert m < 0.3 and d["disentanglement"] < 0.3 and d["completeness"] < 0.3


def test_constant_factor_is_skipped_and_none_varying_is_nan(factors):
    with_constant = np.concatenate([factors, np.ones((len(factors), 1))], axis=1)
    rng = np.random.default_rng(0)
    assert mig(with_constant, factors, rng)["mig"] == pytest.approx(mig(factors, factors, rng)["mig"])
    assert math.isnan(mig(with_constant, factors, rng)["mig_per_factor"][-1])
    ones = np.ones((10, 2))
    assert math.isnan(mig(ones, ones, rng)["mig"])
    assert math.isnan(dci(ones, ones, rng)["disentanglement"])


def test_dci_is_reproducible_from_rng(factors):
    noisy = factors + np.random.default_rng(9).normal(size=factors.shape)
    a = dci(factors, noisy, np.random.default_rng(3))
    assert a == dci(factors, noisy, np.random.default_rng(3))


def test_dci_scores_of_hand_made_importance():
    # Latent 0 serves factor 0 only, latent 1 splits evenly over both factors.
    importance = np.array([[1.0, 0.0], [0.5, 0.5]])
    # Latent weights 1/2, 1/2; per-latent scores 1 and 0.
    assert dci_disentanglement(importance) == pytest.approx(0.5)
    # Factor 0 over latents (2/3, 1/3); factor 1 on latent 1 alone.
    h = -(2 / 3 * math.log(2 / 3) + 1 / 3 * math.log(1 / 3)) / math.log(2)
    assert dci_completeness(importance) == pytest.approx(((1 - h) + 1) / 2)


def test_continuous_factors_are_binned():
    values = np.linspace(0, 1, 1000)[:, None]
    labels = factor_labels(values, n_bins=20)
    assert labels.min() == 0 and labels.max() == 19
    assert factor_labels(np.array([[3.0], [7.0], [3.0]]))[:, 0].tolist() == [0, 1, 0]


# ---------------------------------------------------------------------------------------------
# continual: hand-made curves, hand-computed numbers.

END_STEPS = [10, 20, 30]
STEPS = [0, 10, 20, 30]


@pytest.fixture
def curves():
    return [
        ProbeCurve("object_id/a", "accuracy", 0, STEPS, [0.2, 0.8, 0.6, 0.5]),
        ProbeCurve("object_id/b", "accuracy", 1, STEPS, [0.1, 0.3, 0.9, 0.7]),
        ProbeCurve("object_id/c", "accuracy", 2, STEPS, [0.05, 0.1, 0.4, 0.6]),
        ProbeCurve("position_mse/a", "mse", 0, STEPS, [0.08, 0.002, 0.003, 0.004]),
        ProbeCurve("position_mse/c", "mse", 2, STEPS, [0.09, 0.05, 0.04, 0.001]),
    ]


def test_value_at_takes_last_evaluation_not_after_step(curves):
    assert value_at(curves[0], 15) == 0.8
    assert value_at(curves[0], 30) == 0.5
    assert math.isnan(value_at(curves[0], -1))


def test_change_is_final_minus_value_at_end_of_own_training(curves):
    assert curve_change(curves[0], END_STEPS) == pytest.approx(0.5 - 0.8)
    assert curve_change(curves[3], END_STEPS) == pytest.approx(0.004 - 0.002)
    # The last environment has no evaluation after its end: not measurable.
    assert math.isnan(curve_change(curves[2], END_STEPS))
    # An environment whose training has not ended yet: not measurable.
    assert math.isnan(curve_change(curves[2], END_STEPS[:2]))


def test_table1_stats_hand_computed(curves):
    stats = table1_stats(curves, END_STEPS)
    assert stats["object_id_max"] == pytest.approx((0.8 + 0.9 + 0.6) / 3)
    assert stats["object_id_change"] == pytest.approx(((0.5 - 0.8) + (0.7 - 0.9)) / 2)  # -0.25
    assert stats["position_min"] == pytest.approx((0.002 + 0.001) / 2)
    assert stats["position_change"] == pytest.approx(0.002)
    assert [c["name"] for c in stats["curves"]] == [c.name for c in curves]
    assert to_table1_units(stats)["object_id_change"] == pytest.approx(-25.0)
    assert to_table1_units(stats)["position_change"] == pytest.approx(20.0)


def test_table1_without_curves_of_a_kind_is_nan(curves):
    stats = table1_stats(curves[:3], END_STEPS)
    assert math.isnan(stats["position_min"]) and math.isnan(stats["position_change"])


def test_format_table1_row(curves):
    stats = table1_stats(curves, END_STEPS)
    assert format_table1_row(stats, "SDA") == "SDA        | 76.7 | -25.0 | 15.0 | +20.0"
    std = {k: 0.01 if k.startswith("object") else 1e-5 for k in stats if k != "curves"}
    assert format_table1_row(stats, "SDA", std) == (
        "SDA        | 76.7 (±1.0) | -25.0 (±1.0) | 15.0 (±0.1) | +20.0 (±0.1)"
    )


def test_format_table1_row_from_results_json(curves):
    # NaN is stored as null in results.json; the formatter must read it back as "n/a".
    stats = table1_stats(curves[:3], END_STEPS)
    stats = {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in stats.items()}
    assert format_table1_row(stats, "-") == "-          | 76.7 | -25.0 | n/a | n/a"


def test_mean_std_over_seeds():
    runs = [
        {"object_id_max": 0.8, "object_id_change": -0.1, "position_min": 0.001, "position_change": 0.002},
        {"object_id_max": 0.9, "object_id_change": -0.3, "position_min": 0.003, "position_change": float("nan")},
    ]
    mean, std = mean_std_over_seeds(runs)
    assert mean["object_id_max"] == pytest.approx(0.85) and std["object_id_max"] == pytest.approx(0.05)
    assert mean["object_id_change"] == pytest.approx(-0.2) and std["object_id_change"] == pytest.approx(0.1)
    assert mean["position_change"] == pytest.approx(0.002) and std["position_change"] == 0.0


def test_probe_matrix_rows_are_envs_columns_are_boundaries(curves):
    acc = probe_matrix(curves, END_STEPS, "accuracy")
    np.testing.assert_allclose(acc, [[0.8, 0.6, 0.5], [0.3, 0.9, 0.7], [0.1, 0.4, 0.6]])
    mse = probe_matrix(curves, END_STEPS, "mse")
    np.testing.assert_allclose(mse[0], [0.002, 0.003, 0.004])
    assert np.all(np.isnan(mse[1]))  # environment b has no position probe


def test_forgetting_and_bwt_hand_computed(curves):
    acc = probe_matrix(curves, END_STEPS, "accuracy")
    assert average_forgetting(acc, "accuracy") == pytest.approx(((0.8 - 0.5) + (0.9 - 0.7)) / 2)
    assert backward_transfer(acc, "accuracy") == pytest.approx(((0.5 - 0.8) + (0.7 - 0.9)) / 2)
    # MSE on -R: rising MSE is positive forgetting and negative BWT; the NaN row is skipped.
    mse = probe_matrix(curves, END_STEPS, "mse")
    assert average_forgetting(mse, "mse") == pytest.approx(0.004 - 0.002)
    assert backward_transfer(mse, "mse") == pytest.approx(0.002 - 0.004)


def test_forgetting_max_includes_zero_shot_columns():
    matrix = np.array([[0.5, 0.9, 0.4], [0.6, 0.7, 0.65], [0.0, 0.0, 0.9]])
    # Chaudhry: max over all j < T-1, here the zero-shot-after column beats the diagonal of env 0.
    assert average_forgetting(matrix) == pytest.approx(((0.9 - 0.4) + (0.7 - 0.65)) / 2)
    assert backward_transfer(matrix) == pytest.approx(((0.4 - 0.5) + (0.65 - 0.7)) / 2)
    assert math.isnan(average_forgetting(matrix[:1, :1])) and math.isnan(backward_transfer(matrix[:1, :1]))


def test_probe_names_round_trip():
    assert probe_name("accuracy", "mnist") == "object_id/mnist"
    assert kind_of(probe_name("mse", "moving_mnist")) == "mse"
    with pytest.raises(ValueError):
        kind_of("loss/mnist")
    with pytest.raises(ValueError):
        ProbeCurve("x", "f1", 0, [0], [1.0])


# ---------------------------------------------------------------------------------------------
# plots


def _assert_image(img):
    assert img.ndim == 3 and img.shape[2] == 3 and img.dtype == np.uint8
    assert img.shape[0] > 100 and img.shape[1] > 100
    assert len(np.unique(img.reshape(-1, 3), axis=0)) > 1


def test_probe_curves_figure_is_an_rgb_image():
    history = [
        (0, {"object_id/a": 0.2, "position_mse/a": 0.08}),
        (10, {"object_id/a": 0.8, "position_mse/a": 0.002, "object_id/b": 0.4}),
        (20, {"object_id/a": 0.6, "position_mse/a": 0.003, "object_id/b": 0.9}),
    ]
    _assert_image(probe_curves_figure(history, [10, 20]))


def test_an_environment_has_one_colour_in_both_probe_panels():
    """The identity panel has a static environment the position panel lacks; the shared one must
    still match (matplotlib's own cycle gave it the first colour in one panel, the second in the other)."""
    colours = probe_colours(["object_id/mnist", "object_id/moving_fashion", "position_mse/moving_fashion",
                             "object_id/moving_mnist", "position_mse/moving_mnist"])
    assert colours["object_id/moving_fashion"] == colours["position_mse/moving_fashion"]
    assert colours["object_id/moving_mnist"] == colours["position_mse/moving_mnist"]
    assert len({colours[f"object_id/{env}"] for env in ("mnist", "moving_fashion", "moving_mnist")}) == 3


def test_atypicality_figure_is_an_rgb_image():
    steps = np.arange(50)
    alpha = np.abs(np.random.default_rng(0).normal(size=(50, 6))) * np.linspace(0.1, 5, 6)
    _assert_image(atypicality_figure(steps, alpha, 0.5, 1.5, [20, 40]))


def _use_rows():
    info = [[3.0, 0.05, 2.0, 0.0], [0.2, 1.5, 2.5, 0.0]]
    return [{"true_env": "a", "slot": 0, "info_per_latent": info[0], "masked": [], "informative": [0, 2]},
            {"true_env": "b", "slot": 1, "info_per_latent": info[1], "masked": [0], "informative": [1, 2]}]


def test_latent_use_matrix_blanks_what_the_slot_masks():
    m = latent_use_matrix(_use_rows())
    assert m.shape == (2, 4)
    assert np.isnan(m[1, 0]) and np.isnan(m).sum() == 1
    np.testing.assert_allclose(m[0], [3.0, 0.05, 2.0, 0.0])
    np.testing.assert_allclose(m[1, 1:], [1.5, 2.5, 0.0])


def test_latent_use_figure_is_an_rgb_image_that_shows_the_mask():
    rows = _use_rows()
    img = latent_use_figure(rows, 0.1)
    _assert_image(img)
    rows[0]["masked"] = [2]
    assert not np.array_equal(img, latent_use_figure(rows, 0.1))


def test_latent_use_figure_of_slots_that_mask_every_latent_draws_without_a_warning():
    """Eq. 5 as printed can close all of a slot's latents (docs/method.md): the picture is then all
    crosses, and numpy's all-NaN warning must not reach the run's log."""
    rows = _use_rows()
    for row in rows:
        row["masked"] = [0, 1, 2, 3]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _assert_image(latent_use_figure(rows, 0.1))


def test_cross_domain_figure_is_an_rgb_image_that_frames_the_trained_slot():
    from vase.metrics.plots import cross_domain_figure

    panel = np.random.default_rng(0).random((2, 3, 1, 64, 64))
    errors = np.array([[100.0, 250.0], [300.0, 120.0]])
    img = cross_domain_figure(panel, ["a", "b"], errors, [0, 1])
    _assert_image(img)
    assert not np.array_equal(img, cross_domain_figure(panel, ["a", "b"], errors, [0, 0]))
    green = (img[..., 1] > 100) & (img[..., 0] < 60) & (img[..., 2] < 60)
    assert green.sum() > 100  # the frames are drawn
