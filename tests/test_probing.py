"""Tests of the probe runner: fixed probe sets, correct probe values, no side effects, summaries."""
import json
import math
import random
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from vase.errors import CheckpointError
from vase.probing import ProbeSuite, draw_probe_sets

N_CLASSES = 5
NOISE = 8


@dataclass
class Cfg:  # the fields of vase.config.ProbeConfig that the suite reads
    every: int = 10
    train_size: int = 150
    test_size: int = 100
    seed: int = 7
    reading: str = "mean"


class FakeEnv:
    """Images that carry their factors in fixed pixels, so an "oracle" encoder can read them.

    Row 0 holds the one-hot class, row 1 the (x, y) position, row 2 per-item noise.
    """

    def __init__(self, name, n=300, moving=True, has_class=True, family="shapes", seed=0):
        rng = np.random.default_rng(seed)
        self.name, self.family, self.moving, self.n = name, family, moving, n
        self.factors = {"x": rng.random(n).astype(np.float32), "y": rng.random(n).astype(np.float32)}
        if has_class:
            self.factors["class"] = rng.integers(0, N_CLASSES, n).astype(np.int64)
        self.noise = rng.normal(size=(n, NOISE)).astype(np.float32)

    def __len__(self):
        return self.n

    def batch(self, idx):
        assert idx.dtype == torch.long
        i = idx.numpy()
        images = torch.zeros(len(i), 1, 64, 64)
        if "class" in self.factors:
            images[:, 0, 0, :N_CLASSES] = torch.from_numpy(
                np.eye(N_CLASSES, dtype=np.float32)[self.factors["class"][i]]
            )
        images[:, 0, 1, 0] = torch.from_numpy(self.factors["x"][i])
        images[:, 0, 1, 1] = torch.from_numpy(self.factors["y"][i])
        images[:, 0, 2, :NOISE] = torch.from_numpy(self.noise[i])
        return images


def oracle(images):
    return torch.cat([images[:, 0, 0, :N_CLASSES], images[:, 0, 1, :2]], dim=1).numpy()


def noise_only(images):
    return images[:, 0, 2, :NOISE].numpy()


@pytest.fixture
def envs():
    return [
        FakeEnv("moving_a", seed=1),
        FakeEnv("static_b", moving=False, seed=2),
        FakeEnv("moving_b", seed=3),
    ]


def test_probe_names_per_environment(envs):
    values = ProbeSuite(envs, Cfg()).evaluate(oracle, step=0)
    assert sorted(values) == [
        "object_id/moving_a",
        "object_id/moving_b",
        "object_id/static_b",
        "position_mse/moving_a",
        "position_mse/moving_b",
    ]


def test_oracle_codes_give_perfect_probes(envs):
    values = ProbeSuite(envs, Cfg()).evaluate(oracle, step=0)
    assert all(values[f"object_id/{e.name}"] == 1.0 for e in envs)
    assert values["position_mse/moving_a"] < 1e-6 and values["position_mse/moving_b"] < 1e-6


def test_uninformative_codes_give_chance(envs):
    values = ProbeSuite(envs, Cfg(train_size=200, test_size=100)).evaluate(noise_only, step=0)
    for e in envs:
        assert abs(values[f"object_id/{e.name}"] - 1 / N_CLASSES) < 0.1
    assert values["position_mse/moving_a"] == pytest.approx(1 / 12, rel=0.3)


def test_evaluate_leaves_global_rng_and_model_untouched(envs):
    torch.manual_seed(0)
    linear = torch.nn.Linear(64 * 64, 6)
    params = [p.detach().clone() for p in linear.parameters()]

    def encode(images):
        return linear(images.flatten(1)).numpy()

    def sampling_encode(images):  # draws from the global RNG on purpose
        mu = linear(images.flatten(1))
        return (mu + torch.randn_like(mu) + float(np.random.rand()) + random.random()).numpy()

    torch_state, numpy_state, python_state = torch.get_rng_state(), np.random.get_state(), random.getstate()
    suite = ProbeSuite(envs, Cfg())
    suite.evaluate(encode, step=0)
    suite.evaluate(sampling_encode, step=1)
    assert torch.equal(torch.get_rng_state(), torch_state)
    after = np.random.get_state()
    assert after[0] == numpy_state[0] and np.array_equal(after[1], numpy_state[1]) and after[2:] == numpy_state[2:]
    assert random.getstate() == python_state
    assert all(torch.equal(p, q) for p, q in zip(linear.parameters(), params))
    assert all(p.grad is None for p in linear.parameters())


def test_probe_sets_fixed_by_seed(envs):
    a, b, c = ProbeSuite(envs, Cfg(seed=1)), ProbeSuite(envs, Cfg(seed=1)), ProbeSuite(envs, Cfg(seed=2))
    for (tr_a, te_a), (tr_b, te_b), (tr_c, _) in zip(a.sets, b.sets, c.sets):
        assert np.array_equal(tr_a, tr_b) and np.array_equal(te_a, te_b)
        assert not np.array_equal(tr_a, tr_c)
        assert len(tr_a) == 150 and len(te_a) == 100 and not set(tr_a) & set(te_a)
    # Each environment draws its own set (seed + env index), not the same permutation.
    assert not np.array_equal(a.sets[0][0], a.sets[1][0])


def test_small_environment_is_split_in_proportion():
    train, test = draw_probe_sets(50, train_size=150, test_size=100, seed=0)
    assert (len(train), len(test)) == (30, 20) and not set(train) & set(test)
    with pytest.raises(ValueError):
        draw_probe_sets(1, 150, 100, 0)


def test_history_one_entry_per_step(envs):
    suite = ProbeSuite(envs, Cfg())
    suite.evaluate(noise_only, step=0)
    suite.evaluate(oracle, step=0)
    assert [s for s, _ in suite.history] == [0]
    assert suite.history[0][1]["object_id/moving_a"] == 1.0
    with pytest.raises(ValueError):
        suite.evaluate(oracle, step=-1)


def _hand_history():
    # object_id/moving_a: max 0.8, change 0.5 - 0.8; object_id/static_b: max 0.9, change 0.7 - 0.9;
    # position_mse/moving_a: min 0.002, change 0.004 - 0.002. Environment moving_b is last.
    accs_a, accs_b, accs_c = [0.2, 0.8, 0.6, 0.5], [0.1, 0.3, 0.9, 0.7], [0.05, 0.1, 0.4, 0.6]
    mse_a, mse_c = [0.08, 0.002, 0.003, 0.004], [0.09, 0.05, 0.04, 0.001]
    return [
        [step, {
            "object_id/moving_a": accs_a[k], "object_id/static_b": accs_b[k], "object_id/moving_b": accs_c[k],
            "position_mse/moving_a": mse_a[k], "position_mse/moving_b": mse_c[k],
        }]
        for k, step in enumerate([0, 10, 20, 30])
    ]


def _hand_suite(envs):
    suite = ProbeSuite(envs, Cfg())
    state = suite.state_dict()
    state["history"] = _hand_history()
    state["boundaries"] = [[0, 10], [1, 20], [2, 30]]
    suite.load_state_dict(state)
    return suite


def test_results_table1_matrix_forgetting_hand_computed(envs):
    results = _hand_suite(envs).results()
    json.dumps(results, allow_nan=False)  # strict JSON
    t1 = results["table1"]
    assert t1["object_id_max"] == pytest.approx((0.8 + 0.9 + 0.6) / 3)
    assert t1["object_id_change"] == pytest.approx(-0.25)
    assert t1["position_min"] == pytest.approx(0.0015)
    assert t1["position_change"] == pytest.approx(0.002)
    assert results["boundaries"] == [10, 20, 30]
    np.testing.assert_allclose(results["matrix"]["object_id"], [[0.8, 0.6, 0.5], [0.3, 0.9, 0.7], [0.1, 0.4, 0.6]])
    assert results["matrix"]["position"][1] == [None, None, None]  # static_b has no position probe
    assert results["forgetting"]["object_id"] == pytest.approx(0.25)
    assert results["bwt"]["object_id"] == pytest.approx(-0.25)
    assert results["forgetting"]["position"] == pytest.approx(0.002)
    assert results["bwt"]["position"] == pytest.approx(-0.002)


def test_state_dict_round_trip_and_mismatch(envs):
    suite = ProbeSuite(envs, Cfg())
    suite.evaluate(oracle, step=0)
    suite.mark_boundary(0, 0)
    state = json.loads(json.dumps(suite.state_dict()))  # plain python only
    resumed = ProbeSuite(envs, Cfg())
    resumed.load_state_dict(state)
    assert resumed.history == suite.history and resumed.results() == suite.results()
    with pytest.raises(CheckpointError):
        ProbeSuite(envs, Cfg(seed=99)).load_state_dict(state)


def test_boundaries_must_follow_the_sequence(envs):
    suite = ProbeSuite(envs, Cfg())
    suite.mark_boundary(1, 20)
    with pytest.raises(ValueError):
        suite.results()
    with pytest.raises(ValueError):
        suite.mark_boundary(3, 30)


def test_repeated_environment_names_are_disambiguated():
    envs = [FakeEnv("a", seed=1), FakeEnv("b", moving=False, has_class=False, seed=2), FakeEnv("a", seed=3)]
    values = ProbeSuite(envs, Cfg()).evaluate(oracle, step=0)
    assert sorted(values) == ["object_id/a#0", "object_id/a#2", "position_mse/a#0", "position_mse/a#2"]
    assert all(not math.isnan(v) for v in values.values())


def _one_step_learner(ablation="SDA"):
    from vase.config import build_config
    from vase.learner import Learner

    cfg = build_config("cpu", ["model.channels=8,8,8,8", "model.hidden=32", "model.latents=6", "model.k_max=4",
                               "train.batch_size=16", "dream.batch_size=8"], ablation)
    learner = Learner(cfg)
    x = (torch.rand(16, 1, 64, 64, generator=torch.Generator().manual_seed(0)) < 0.1).float()
    learner.training_step(x)  # allocates slot 0
    return cfg, learner, x


def test_the_papers_reading_samples_the_masked_posterior_under_the_inferred_slot():
    """z = mu + sigma * eps on the slot's unmasked latents and pure prior noise on its masked ones,
    with the same draws for the same seed."""
    from vase.evaluation import FrozenEncoder
    from vase.probing import PosteriorSamples, SlotReading

    cfg, learner, x = _one_step_learner()
    learner.slots[0].mask = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 1.0])
    encoder = FrozenEncoder(cfg.model).load(learner.model.encoder.state_dict())
    slots = SlotReading.of(learner)
    z = PosteriorSamples(encoder, slots, seed=7)(x)
    eps = torch.randn(z.shape, generator=torch.Generator().manual_seed(7))
    post = encoder.posterior(x)
    keep = learner.slots[0].mask.bool()
    assert torch.allclose(z[:, keep], (post.mu + (0.5 * post.logvar).exp() * eps)[:, keep])
    assert torch.equal(z[:, ~keep], eps[:, ~keep])
    assert torch.equal(z, PosteriorSamples(encoder, slots, seed=7)(x))


def test_the_kept_slots_pick_the_slot_the_inference_picks_and_survive_a_round_trip(tmp_path):
    """SlotReading.slot_of is eq. 6's s_hat (the argmax of the chunk-averaged q_psi over the
    allocated slots), and saving then loading it changes neither the masks nor the pick."""
    from vase.checkpoint import load_weights, save_weights
    from vase.probing import SlotReading

    cfg, learner, x = _one_step_learner()
    inference = learner.inference
    inference.allocate(1, 1, "test", [])  # a second slot, with its own mask
    learner.slots[1].mask = torch.tensor([0.0, 1.0, 1.0, 1.0, 1.0, 0.0])
    hidden = learner.model.encoder(x).hidden
    # The last bias favours a slot not yet allocated: the pick stays among slots 0 and 1.
    for bias, picks in (([0.0, 50.0, 0.0, 0.0], {1}), ([50.0, 0.0, 0.0, 0.0], {0}), ([0.0, 0.0, 90.0, 0.0], {0, 1})):
        with torch.no_grad():
            learner.classifier.linear.bias.copy_(torch.tensor(bias))
        slots = SlotReading.of(learner)
        assert slots.slot_of(hidden) in picks
        assert slots.slot_of(hidden) == inference.slot_of(x, learner.model.encoder)
        save_weights(tmp_path / "slots.pt", slots.state_dict())
        loaded = SlotReading.load(load_weights(tmp_path / "slots.pt"), cfg.model)
        assert torch.equal(loaded.masks, torch.stack([learner.mask(0), learner.mask(1)]))
        assert loaded.slot_of(hidden) == slots.slot_of(hidden)


def test_a_run_without_kept_slots_is_read_the_papers_way_only_with_s_and_a_off(tmp_path):
    from vase.config import build_config
    from vase.errors import VaseError
    from vase.evaluation import slots_at

    plain = slots_at(tmp_path, build_config("cpu", [], "-"), step=10)
    assert plain.classifier is None and torch.equal(plain.masks, torch.ones(1, plain.masks.shape[1]))
    for ablation in ("S", "A", "SDA"):
        with pytest.raises(VaseError, match="kept no slots of step 10"):
            slots_at(tmp_path, build_config("cpu", [], ablation), step=10)
