"""Eq. 7's coverage (vase/dream_coverage.py): zero without drift, the closed-form Bernoulli KL of a
known decoder change, a drift that only real data can see, one that the reconstructions of the
real codes see too, and the reading in a run, through a resume."""
from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from vase.config import build_config
from vase.dream_coverage import COVERAGE_TERMS, coverage
from vase.dreaming import Snapshot
from vase.networks import Posterior
from vase.trainer import Trainer, prepare_run_dir

LATENTS, PIXELS = 3, 64 * 64


class Encoder(nn.Module):
    """mu = `shift` on latent 0 for bright images (mean above 0.5), else 0; sigma 0.1."""

    def __init__(self, shift: float = 0.0):
        super().__init__()
        self.shift = nn.Parameter(torch.tensor(shift))

    def forward(self, x):
        bright = (x.flatten(1).mean(1) > 0.5).float()
        mu = torch.zeros(x.shape[0], LATENTS)
        mu[:, 0] = 6.0 * bright + self.shift * bright
        return Posterior(mu, torch.full_like(mu, math.log(0.01)), torch.zeros(x.shape[0], 1))


class Decoder(nn.Module):
    """Dark images (logit `base`) everywhere, plus `far` on every pixel where z_0 > 4."""

    def __init__(self, base: float = -2.0, far: float = 0.0):
        super().__init__()
        self.base, self.far = nn.Parameter(torch.tensor(base)), nn.Parameter(torch.tensor(far))

    def forward(self, z, env):
        logit = self.base + self.far * (z[:, 0] > 4).float()
        return logit[:, None, None, None].expand(z.shape[0], 1, 64, 64)


class Model(nn.Module):
    def __init__(self, encoder: Encoder, decoder: Decoder):
        super().__init__()
        self.encoder, self.decoder = encoder, decoder


def bernoulli_kl(p: float, q: float) -> float:
    return p * math.log(p / q) + (1 - p) * math.log((1 - p) / (1 - q))


BRIGHT = torch.full((32, 1, 64, 64), 0.9)  # real images of a slot whose codes lie at z_0 = 6
ALL_USED = torch.ones(LATENTS)


def read(model, reference, mask=ALL_USED):
    return coverage(model, Snapshot(reference), BRIGHT, 0, mask, torch.Generator().manual_seed(0))


def test_no_drift_reads_exactly_zero():
    model = Model(Encoder(), Decoder(far=1.0))
    c = read(model, model)
    assert [getattr(c, t) for t in COVERAGE_TERMS] == [0.0] * 5


def test_a_decoder_change_everywhere_reads_the_closed_form_kl_on_both():
    reference, model = Model(Encoder(), Decoder(base=-2.0)), Model(Encoder(), Decoder(base=-1.0))
    expected = PIXELS * bernoulli_kl(torch.sigmoid(torch.tensor(-2.0)).item(), torch.sigmoid(torch.tensor(-1.0)).item())
    c = read(model, reference)
    assert c.decoder_real == pytest.approx(expected, rel=1e-5)
    assert c.decoder_dream == pytest.approx(expected, rel=1e-5)


def test_a_change_where_dreams_never_go_is_seen_on_real_data_only():
    # The decoder changed only for z_0 > 4, where the real codes lie (z_0 = 6 +- 0.1) and prior
    # samples almost never do; the encoder changed only on bright images, and dreams are dark.
    reference = Model(Encoder(), Decoder(far=0.0))
    model = Model(Encoder(shift=1.0), Decoder(far=3.0))
    c = read(model, reference)
    p, q = torch.sigmoid(torch.tensor([-2.0, 1.0])).tolist()
    assert c.decoder_real == pytest.approx(PIXELS * bernoulli_kl(p, q), rel=1e-5)
    assert c.encoder_real == pytest.approx(1.0)  # ||6 + 1 - 6||^2, sigmas equal
    assert c.decoder_dream == 0.0 and c.encoder_dream == 0.0
    # The reference decodes the real codes dark (far = 0), so a change on bright images only is
    # out of the reconstructions' sight: the gap is the real pixels'.
    assert c.encoder_recon == 0.0


def test_a_change_on_what_the_real_codes_decode_to_is_seen_on_their_reconstructions():
    # The reference decodes z_0 > 4 bright (logit -2 + 3): the real codes come back as bright
    # images, which the changed encoder reads as the real ones, while prior codes decode dark.
    # The gap is then the codes': p(z) seldom draws where the real codes lie.
    reference = Model(Encoder(), Decoder(far=3.0))
    model = Model(Encoder(shift=1.0), Decoder(far=3.0))
    c = read(model, reference)
    assert c.encoder_real == pytest.approx(1.0) and c.encoder_recon == pytest.approx(1.0)
    assert c.encoder_dream == 0.0


def test_a_masked_latent_is_prior_noise_in_the_real_codes_too():
    # With latent 0 masked, the real codes are drawn where the dreams are (eq. 2): the decoder's
    # change beyond z_0 = 4 is out of sight of both.
    reference = Model(Encoder(), Decoder(far=0.0))
    model = Model(Encoder(), Decoder(far=3.0))
    c = read(model, reference, mask=torch.tensor([0.0, 1.0, 1.0]))
    assert c.decoder_real == 0.0 and c.decoder_dream == 0.0


# A run with D on and S off: two sprite environments of 4 steps, probe points every 4 steps, a
# checkpoint every 3, so the window of steps 4-8 crosses the checkpoint at 6.
SETTINGS = [
    "data.sequence=moving_shapes_a,shapes_b", "data.steps_per_env=4",
    "data.sprite_train_size=200", "data.sprite_test_size=100",
    "probe.train_size=50", "probe.test_size=50", "probe.every=4",
    "train.batch_size=16", "train.threads=1", "train.checkpoint_every=3", "train.log_every=3",
    "dream.batch_size=16", "dream.snapshot_every=2",
]


class StopAt:
    def __init__(self, step):
        self.step = step

    def __getattr__(self, hook):
        return lambda *args: None

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass

    def on_step(self, trainer, step):
        if step.done == self.step:
            raise KeyboardInterrupt


def run(path, root, stop_at=None, resume=False, extra=(), key="dream_coverage"):
    cfg = build_config("cpu", SETTINGS + [f"data.root={root}", *extra], "D")
    trainer = Trainer(cfg, path, progress=False, callbacks=[StopAt(stop_at)] if stop_at else [])
    prepare_run_dir(path, cfg, resume=resume)
    if stop_at:
        with pytest.raises(KeyboardInterrupt):
            trainer.train()
        return None
    trainer.train(resume=resume)
    results = json.loads((path / "results.json").read_text())
    return results[key] if key else results


def test_a_run_reads_the_coverage_of_finished_environments_and_resumes_it_exactly(tmp_path):
    root = tmp_path / "data"
    straight = run(tmp_path / "straight", root)
    # Environment 0's stage ends at step 4, so only the window 4-8 reads it.
    assert [(r["step"], r["since"], r["true_env"], r["slot"]) for r in straight] == [(8, 4, "moving_shapes_a", 0)]
    assert all(straight[0][t] > 0 for t in COVERAGE_TERMS)
    run(tmp_path / "resumed", root, stop_at=7)
    assert run(tmp_path / "resumed", root, resume=True) == straight


def test_the_reading_leaves_training_as_it_was(tmp_path):
    root = tmp_path / "data"
    on = run(tmp_path / "on", root, key=None)
    off = run(tmp_path / "off", root, extra=["probe.dream_coverage=false"], key=None)
    assert on.pop("dream_coverage") and off.pop("dream_coverage") == []
    on.pop("wall_time_s"), off.pop("wall_time_s")
    assert on == off


def test_the_summary_averages_each_environments_intervals():
    from vase.summary import coverage_lines

    rows = [{"true_env": "a", "encoder_real": 1.0, "encoder_recon": 0.8, "encoder_dream": 0.5, "decoder_real": 30.0,
             "decoder_dream": 10.0},
            {"true_env": "b", "encoder_real": 0.0, "encoder_dream": 0.0, "decoder_real": 2.0, "decoder_dream": 2.0},
            {"true_env": "a", "encoder_real": 3.0, "encoder_recon": 1.2, "encoder_dream": 0.5, "decoder_real": 10.0,
             "decoder_dream": 2.0}]
    lines = coverage_lines(rows)
    assert lines[1].split() == "a decoder 20.00 vs 6.00, encoder 2.000 / 1.000 / 0.500 (2 intervals)".split()
    # a row without the reconstructions' term: the other terms only
    assert lines[2].split() == "b decoder 2.00 vs 2.00, encoder 0.000 / 0.000 (1 intervals)".split()
    assert len(lines) == 3
    assert coverage_lines([]) == []
