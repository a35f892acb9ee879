"""The end-of-run latent-use table (Fig. 3's reading): KL per latent on each environment's held-out
images, that environment's mask, and the active latents, checked on an analytic posterior."""
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from vase.config import build_config
from vase.evaluator import Evaluator
from vase.learner import Learner
from vase.networks import Posterior


def with_factors(class_, **factors):
    """A held-out test environment stand-in: its factor matrix and names, class first."""
    names = ["class", *factors]
    matrix = np.stack([np.asarray(class_, np.float32), *(np.asarray(v, np.float32) for v in factors.values())], 1)
    return SimpleNamespace(factor_matrix=lambda: matrix, factor_names=lambda: names)


def frozen(learner):
    """The evaluator's FrozenEncoder stand-in: mu(x) of the learner's (hand-made) encoder."""
    return SimpleNamespace(load=lambda state: SimpleNamespace(posterior=learner.model.encoder))


class FixedEncoder(torch.nn.Module):
    """mu = 2 on latent 0 and 0.5 on latent 2, unit variance everywhere: KL = mu^2 / 2 per latent."""

    def __init__(self, latents: int, hidden: int):
        super().__init__()
        self.latents, self.hidden = latents, hidden

    def forward(self, x):
        mu = torch.zeros(x.shape[0], self.latents)
        mu[:, 0], mu[:, 2] = 2.0, 0.5
        return Posterior(mu, torch.zeros_like(mu), torch.zeros(x.shape[0], self.hidden))


def test_latent_use_reports_kl_mask_and_active_latents():
    cfg = build_config("cpu", ["inference.used_kl=0.1"], ablation="A")  # S off: every batch is slot 0
    learner = Learner(cfg)
    learner.model.encoder = FixedEncoder(cfg.model.latents, cfg.model.hidden)
    learner.slots[0].mask[2] = 0.0  # slot 0 masks latent 2
    learner.slots[0].usage = torch.tensor(
        [1.5] + [0.0] * (cfg.model.latents - 2) + [0.05]
    )  # used while training: latent 0
    fake = SimpleNamespace(
        cfg=cfg, learner=learner, envs=[SimpleNamespace(name="one")], held_out=[torch.rand(5, 1, 64, 64)],
        test_envs=[with_factors(class_=[0, 1, 0, 1, 0], x=[0, 1, 2, 3, 4])], frozen_encoder=frozen(learner),
    )
    (row,) = Evaluator.latent_use(fake, [0])
    assert row["true_env"] == "one" and row["slot"] == 0
    assert row["kl_per_latent"][0] == 2.0 and row["kl_per_latent"][2] == 0.125
    assert sum(row["kl_per_latent"]) == 2.125
    assert row["masked"] == [2]
    assert row["active"] == [0]  # latent 2 carries KL but is masked; the rest carry none
    assert row["used_in_training"] == [0]  # the last latent's usage (0.05) is below used_kl
    assert row["usage_per_latent"] == [1.5] + [0.0] * (cfg.model.latents - 2) + [0.05]  # the values behind it

    from vase.summary import summary_text

    results = {"ablation": "A", "mode": "disentangled", "preset": "cpu", "steps": 1, "wall_time_s": 1.0,
               "environments_inferred": 1, "environments_true": 1, "inferred_vs_true": [], "latent_use": [row]}
    text = summary_text(results, Path("run"))
    assert f"1/{cfg.model.latents} latents used by some slot while it trained" in text
    assert "slot 0: used [0], masked [2]; active on its held-out images now: 1/" in text
    assert "the same count at other thresholds (usage above 0.1 / 0.25 / 0.5 / 1 nat): 1 / 1 / 1 / 1" in text
    # Constant codes carry no linear signal: every |r| is 0, and ties keep the latents' order.
    assert "strongest latents per factor (|r| of the posterior sample): x z0 0.00, z1 0.00, z2 0.00" in text


class ShiftedAndInformativeEncoder(torch.nn.Module):
    """Latent 0: mu = 2 on every image (KL 2 nats, no information). Latent 1: mu = +2 or -2 by image
    (KL 2 nats; the batch aggregate has mean 0, variance 5, so alpha = (5 - 1 - log 5) / 2)."""

    def __init__(self, latents: int, hidden: int):
        super().__init__()
        self.latents, self.hidden = latents, hidden

    def forward(self, x):
        mu = torch.zeros(x.shape[0], self.latents)
        mu[:, 0] = 2.0
        mu[:, 1] = torch.tensor([2.0, -2.0]).repeat(x.shape[0] // 2)
        return Posterior(mu, torch.zeros_like(mu), torch.zeros(x.shape[0], self.hidden))


def test_latent_use_tells_information_from_a_constant_shift():
    import math

    cfg = build_config("cpu", ["inference.used_kl=0.1"], ablation="A")
    learner = Learner(cfg)
    learner.model.encoder = ShiftedAndInformativeEncoder(cfg.model.latents, cfg.model.hidden)
    x_position = [1.0, -1.0, 1.1, -1.1, 0.9, -0.9]  # follows latent 1's sign
    fake = SimpleNamespace(
        cfg=cfg, learner=learner, envs=[SimpleNamespace(name="one")], held_out=[torch.rand(6, 1, 64, 64)],
        test_envs=[with_factors(class_=[0, 1, 2, 0, 1, 2], x=x_position, y=[0.0, 0, 1, 1, 0, 0])],
        frozen_encoder=frozen(learner),
    )
    (row,) = Evaluator.latent_use(fake, [0])
    assert row["kl_per_latent"][:2] == [2.0, 2.0]
    assert row["active"] == [0, 1]  # both carry KL ...
    assert row["info_per_latent"][0] == 0.0  # ... but the shifted one tells the decoder nothing
    assert abs(row["info_per_latent"][1] - (2.0 - 0.5 * (4.0 - math.log(5.0)))) < 1e-3
    assert row["informative"] == [1]
    # x follows latent 1, whose sample is its mean (variance 4) plus unit posterior noise, so its
    # |r| is that of the mean times sqrt(4 / 5). y is uncorrelated with every latent (|r| 0).
    r_mean = abs(np.corrcoef([2.0, -2.0] * 3, x_position)[0, 1])
    assert row["factor_latents"]["x"][0] == [1, round(r_mean * (4 / 5) ** 0.5, 3)]
    assert row["factor_latents"]["y"][0] == [0, 0.0]
    assert set(row["factor_latents"]) == {"x", "y"}  # never the class


def test_summary_warns_of_an_environment_whose_slot_carries_no_information():
    from vase.summary import summary_text

    def row(env, informative):
        return {"true_env": env, "slot": 0, "used_in_training": [0], "masked": [], "active": [0, 1],
                "kl_per_latent": [1.0, 2.0], "informative": informative}

    results = {"ablation": "SDA", "mode": "disentangled", "preset": "cpu", "steps": 1, "wall_time_s": 1.0,
               "environments_inferred": 2, "environments_true": 2, "inferred_vs_true": [],
               "latent_use": [row("moving_fashion", [1]), row("mnist", [])]}
    text = summary_text(results, Path("run"))
    assert "warning: no latent carries information for mnist at the end" in text
    results["latent_use"][1]["informative"] = [0]
    assert "warning" not in summary_text(results, Path("run"))
    del results["latent_use"][1]["informative"]  # results from before the field: no verdict
    assert "warning" not in summary_text(results, Path("run"))


def test_the_used_count_at_other_thresholds_reads_the_largest_usage_of_any_slot():
    from vase.summary import USAGE_READINGS, used_at_thresholds

    rows = [{"usage_per_latent": [0.2, 0.6, 0.0, 0.05]}, {"usage_per_latent": [0.05, 1.2, 0.3, 0.1]}]
    assert USAGE_READINGS == (0.1, 0.25, 0.5, 1.0)
    # Largest per latent: 0.2, 1.2, 0.3, 0.1. "Above" is strict, as used_kl's test is (0.1 is not used).
    assert used_at_thresholds(rows) == {0.1: 3, 0.25: 2, 0.5: 1, 1.0: 1}
    assert used_at_thresholds([{"used_in_training": [0]}]) is None  # results.json from before the field

