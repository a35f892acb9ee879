"""Eq. 3 and eq. 2 against analytic values."""
import json
import math

import pytest
import torch

from vase.config import ObjectiveConfig, build_config, load_run_config
from vase.objective import (
    capacity,
    environment_capacity,
    kl_per_latent,
    masked_kl,
    masked_sample,
    mdl_loss,
    reconstruction_nll,
)


def test_kl_of_standard_normal_posterior_is_zero():
    mu, logvar = torch.zeros(5, 24), torch.zeros(5, 24)
    assert torch.equal(kl_per_latent(mu, logvar), torch.zeros(5, 24))


def test_kl_matches_closed_form():
    mu, logvar = torch.tensor([[1.0, -2.0]]), torch.tensor([[math.log(4.0), 0.0]])
    # KL(N(m, s^2) || N(0,1)) = (m^2 + s^2 - 1 - log s^2) / 2
    expected = torch.tensor([[(1 + 4 - 1 - math.log(4)) / 2, (4 + 1 - 1 - 0) / 2]])
    assert torch.allclose(kl_per_latent(mu, logvar), expected)


def test_reconstruction_is_bernoulli_nll_summed_over_pixels():
    x = torch.zeros(2, 1, 64, 64)
    x[0, 0, 0, :10] = 1.0
    logits = torch.zeros(2, 1, 64, 64)  # p = 0.5 everywhere: -log 0.5 per pixel
    assert torch.allclose(reconstruction_nll(logits, x), torch.full((2,), 4096 * math.log(2.0)))
    # One confident pixel by hand: x = 1, logit = 2 -> -log sigmoid(2) = log(1 + e^-2)
    logits2 = torch.full((1, 1, 1, 1), 2.0)
    assert torch.allclose(reconstruction_nll(logits2, torch.ones(1, 1, 1, 1)), torch.tensor([math.log1p(math.exp(-2))]))


def test_capacity_schedule_is_linear_then_flat():
    cfg = ObjectiveConfig(capacity_max=25.0, capacity_ramp_steps=100)
    assert capacity(0, cfg) == 0.0
    assert capacity(50, cfg) == pytest.approx(12.5)
    assert capacity(100, cfg) == 25.0
    assert capacity(10_000, cfg) == 25.0
    assert capacity(7, ObjectiveConfig(capacity_ramp_steps=0, capacity_max=3.0)) == 3.0


def test_mdl_loss_disentangled_and_entangled():
    recon, kl = torch.tensor([100.0, 200.0]), torch.tensor([10.0, 20.0])
    cfg = ObjectiveConfig(gamma=2.0, capacity_max=25.0, capacity_ramp_steps=100, capacity_form="absolute")
    # step 40: C = 10; mean KL 15 -> 150 + 2 * |15 - 10|
    assert float(mdl_loss(recon, kl, capacity(40, cfg), cfg)) == pytest.approx(160.0)
    cfg.mode = "entangled"
    assert float(mdl_loss(recon, kl, capacity(40, cfg), cfg)) == pytest.approx(165.0)


def test_the_atypicality_penalty_pulls_a_shifted_latent_back_and_leaves_an_informative_one_alone():
    """What the fresh-latent penalty descends. Latent 0: every image shifted to mean 2 (KL 2 nats, no
    information). Latent 1: means +-sqrt(0.9) with variance 0.1, so the aggregate is exactly N(0, 1)
    (KL 0.9 nats, all of it information)."""
    from vase.masking import atypicality

    mu = torch.tensor([[2.0, 0.9 ** 0.5], [2.0, -(0.9 ** 0.5)]] * 4, requires_grad=True)
    logvar = torch.tensor([[0.0, math.log(0.1)]] * 8, requires_grad=True)
    alpha = atypicality(mu, logvar)
    assert alpha.tolist() == pytest.approx([2.0, 0.0], abs=1e-6)
    alpha.sum().backward()
    assert torch.all(mu.grad[:, 0] > 0)  # descending moves every mean of latent 0 towards 0
    assert torch.allclose(mu.grad[:, 1], torch.zeros(8), atol=1e-6)
    assert torch.allclose(logvar.grad[:, 1], torch.zeros(8), atol=1e-6)


def test_fresh_latent_penalty_is_weighted_in_units_of_gamma():
    recon, kl = torch.tensor([100.0, 200.0]), torch.tensor([10.0, 20.0])
    cfg = ObjectiveConfig(
        gamma=2.0, capacity_max=25.0, capacity_ramp_steps=100, fresh_aggregate_weight=0.0, capacity_form="absolute"
    )
    fresh = torch.tensor(3.0)
    assert float(mdl_loss(recon, kl, capacity(40, cfg), cfg, fresh_atypical=fresh)) == pytest.approx(160.0)
    cfg.fresh_aggregate_weight = 0.5
    assert float(mdl_loss(recon, kl, capacity(40, cfg), cfg, fresh_atypical=fresh)) == pytest.approx(163.0)
    cfg.mode = "entangled"
    assert float(mdl_loss(recon, kl, capacity(40, cfg), cfg, fresh_atypical=fresh)) == pytest.approx(165.0)


def test_with_fresh_weight_1_capacity_filler_earns_nothing_and_information_still_pays():
    """Below its target, eq. 3 rewards any KL. A fresh latent narrowed alike for every image
    (sigma^2 0.2, mean 0: KL without information, KL = alpha) gets no gradient at all from eq. 3 plus
    the penalty at weight 1; an informative one (means +-sqrt(0.8), sigma^2 0.2: the aggregate is
    N(0, 1), alpha = 0) keeps eq. 3's push towards more KL."""
    from vase.masking import atypicality

    cfg = ObjectiveConfig(
        gamma=100.0, capacity_max=25.0, capacity_ramp_steps=0, fresh_aggregate_weight=1.0, capacity_form="absolute"
    )
    mu = torch.tensor([[0.0, 0.8 ** 0.5], [0.0, -(0.8 ** 0.5)]] * 4, requires_grad=True)
    logvar = torch.full((8, 2), math.log(0.2), requires_grad=True)
    alpha = atypicality(mu, logvar)
    kl = kl_per_latent(mu, logvar)
    assert alpha.tolist() == pytest.approx([kl[:, 0].mean().item(), 0.0], abs=1e-6)
    loss = mdl_loss(torch.zeros(8), kl.sum(1), capacity(0, cfg), cfg, fresh_atypical=alpha.sum())
    loss.backward()
    assert torch.allclose(mu.grad[:, 0], torch.zeros(8), atol=1e-5)
    assert torch.allclose(logvar.grad[:, 0], torch.zeros(8), atol=1e-5)
    # Descending narrows latent 1 further (more KL) and spreads its means (more information).
    assert torch.all(logvar.grad[:, 1] > 0) and torch.all(mu.grad[:, 1] * mu[:, 1].detach() < 0)
    cfg.fresh_aggregate_weight = 0.0  # eq. 3 alone rewards the filler as much as the information
    mu.grad, logvar.grad = None, None
    mdl_loss(torch.zeros(8), kl_per_latent(mu, logvar).sum(1), capacity(0, cfg), cfg).backward()
    assert torch.all(logvar.grad[:, 0] > 0)


def test_masked_latents_get_prior_noise_no_kl_and_no_gradient():
    mu = torch.randn(8, 4, requires_grad=True)
    logvar = torch.randn(8, 4, requires_grad=True)
    mask = torch.tensor([1.0, 0.0, 1.0, 0.0])
    noise = torch.randn(8, 4)
    z = masked_sample(mu, logvar, mask, noise)
    assert torch.equal(z[:, 1], noise[:, 1]) and torch.equal(z[:, 3], noise[:, 3])
    kl = masked_kl(mu, logvar, mask)
    assert torch.allclose(kl, kl_per_latent(mu, logvar)[:, [0, 2]].sum(1))
    (z.sum() + kl.sum()).backward()
    assert torch.all(mu.grad[:, [1, 3]] == 0) and torch.all(logvar.grad[:, [1, 3]] == 0)
    assert torch.all(mu.grad[:, [0, 2]] != 0)


def test_a_masked_latent_that_drifted_to_overflow_adds_nothing_and_poisons_nothing():
    """Masked latents get no gradient, so their encoder outputs can drift until exp(log sigma^2)
    overflows (seen in the "A" row: log sigma^2 of 90 at step 4,053). The KL, the aggregate penalty
    and their gradients must stay those of the unmasked latents, not inf * 0 = NaN."""
    from vase.masking import atypicality
    from vase.objective import prior_where_masked

    torch.manual_seed(0)
    mu = torch.randn(8, 4, requires_grad=True)
    base = torch.randn(8, 4)
    logvar = (base + torch.tensor([0.0, 100.0, 0.0, 0.0])).requires_grad_()  # latent 1: exp overflows
    assert torch.isinf(logvar[:, 1].exp()).all()
    mask = torch.tensor([1.0, 0.0, 1.0, 1.0])
    kl = masked_kl(mu, logvar, mask)
    assert torch.isfinite(kl).all()
    assert torch.allclose(kl, kl_per_latent(mu[:, [0, 2, 3]], logvar[:, [0, 2, 3]]).sum(1))
    alpha = atypicality(*prior_where_masked(mu, logvar, mask))
    assert alpha[1] == 0 and torch.allclose(alpha[[0, 2, 3]], atypicality(mu, logvar)[[0, 2, 3]])
    (kl.sum() + alpha.sum()).backward()
    assert torch.isfinite(mu.grad).all() and torch.isfinite(logvar.grad).all()
    assert torch.all(mu.grad[:, 1] == 0) and torch.all(logvar.grad[:, 1] == 0)


def test_runs_from_before_the_fresh_latent_penalty_resume_without_it(tmp_path):
    assert build_config("cpu").objective.fresh_aggregate_weight == 1.0
    d = build_config("cpu").to_dict()
    (tmp_path / "config.json").write_text(json.dumps(d))
    assert load_run_config(tmp_path).objective.fresh_aggregate_weight == 1.0
    del d["objective"]["fresh_aggregate_weight"]
    (tmp_path / "config.json").write_text(json.dumps(d))
    assert load_run_config(tmp_path).objective.fresh_aggregate_weight == 0.0  # as they were trained


@pytest.mark.parametrize("form", ["squared", "absolute"])
def test_the_capacity_term_value_and_gradient_by_hand(form):
    """KL per example 30 and 26 (mean 28), C = 25, gamma = 100: squared 100 * 3^2 = 900 with
    d/dKL_i = 100 * 2 * 3 / 2 = 300 per example; absolute 100 * 3 = 300 with 100 / 2 = 50."""
    cfg = ObjectiveConfig(gamma=100.0, capacity_form=form)
    kl = torch.tensor([30.0, 26.0], requires_grad=True)
    recon = torch.tensor([10.0, 20.0])
    loss = mdl_loss(recon, kl, 25.0, cfg)
    loss.backward()
    value, grad = (900.0, 300.0) if form == "squared" else (300.0, 50.0)
    assert float(loss.detach()) == pytest.approx(15.0 + value)
    assert kl.grad.tolist() == pytest.approx([grad, grad])


def test_the_squared_capacity_term_pulls_kl_towards_c_from_both_sides_in_proportion():
    cfg = ObjectiveConfig(gamma=10.0, capacity_form="squared")
    grads = []
    for value in (20.0, 24.0, 25.0, 27.0):
        kl = torch.tensor([value], requires_grad=True)
        mdl_loss(torch.zeros(1), kl, 25.0, cfg).backward()
        grads.append(float(kl.grad))
    assert grads == pytest.approx([-100.0, -20.0, 0.0, 40.0])


def test_the_long_schedule_sets_the_lengths_together_and_overrides_win():
    from vase.config import schedule_settings

    short, long = build_config("cpu"), build_config("cpu", [], "SDA", "long")
    assert long.schedule == "long" and short.schedule == "short" and schedule_settings("short") == {}
    assert long.data.steps_per_env == [12000] and short.data.steps_per_env == [1200]
    assert long.objective.capacity_ramp_steps > short.objective.capacity_ramp_steps
    assert long.probe.every >= short.probe.every and long.inference.cooldown > short.inference.cooldown
    assert build_config("cpu", ["data.steps_per_env=7"], "SDA", "long").data.steps_per_env == [7]


@pytest.mark.parametrize("schedule", ["long", "extended"])
def test_a_long_schedule_gives_the_first_stage_its_full_capacity(schedule):
    """C(t) reaches C_max inside the first stage (docs/regime.md: a ramp longer than a
    stage left moving Fashion at 40 % of C_max)."""
    from vase.objective import capacity

    cfg = build_config("cpu", [], "SDA", schedule)
    stage, ramp = cfg.data.steps_per_env[0], cfg.objective.capacity_ramp_steps
    assert ramp < stage
    assert float(capacity(stage - 1, cfg.objective)) == pytest.approx(cfg.objective.capacity_max)


def test_the_extended_schedule_scales_the_long_one_together():
    """Steps, ramp, τ and settling keep the long schedule's proportions to a stage (docs/regime.md),
    so only the length changes between the two studies."""
    long, extended = build_config("cpu", [], "SDA", "long"), build_config("cpu", [], "SDA", "extended")
    factor = extended.data.steps_per_env[0] / long.data.steps_per_env[0]
    assert factor > 1
    for section, name in [("objective", "capacity_ramp_steps"), ("dream", "snapshot_every"),
                          ("inference", "cooldown")]:
        assert getattr(getattr(extended, section), name) == getattr(getattr(long, section), name) * factor
    assert extended.probe.every >= long.probe.every
    # A new slot's own ramp is C(t)'s, at the extended schedule only (docs/method.md, own capacity ramp).
    assert extended.objective.new_env_ramp_steps == extended.objective.capacity_ramp_steps
    assert long.objective.new_env_ramp_steps == 0 == build_config("cpu").objective.new_env_ramp_steps


def test_a_new_environment_ramps_its_own_capacity_from_the_kl_it_carries():
    """The rule own_capacity_ramp: min(C(t), KL_s + C_max (t - t_s) / R), by hand."""
    cfg = ObjectiveConfig(capacity_max=25.0, capacity_ramp_steps=3000, new_env_ramp_steps=0)
    assert environment_capacity(4500, (4000, 2.0), cfg) == 25.0  # off: C(t), eq. 3
    cfg.new_env_ramp_steps = 1000
    assert environment_capacity(4000, (4000, 2.0), cfg) == 2.0
    assert environment_capacity(4500, (4000, 2.0), cfg) == pytest.approx(2.0 + 12.5)
    assert environment_capacity(5000, (4000, 2.0), cfg) == 25.0  # never above C(t)
    assert environment_capacity(2000, (1900, 30.0), cfg) == pytest.approx(25.0 * 2000 / 3000)
    assert environment_capacity(300, None, cfg) == pytest.approx(2.5)  # the first environment: C(t)
    # The allocating batch's own KL, still a tensor: the same climb, never above C(t).
    assert float(environment_capacity(4000, (4000, torch.tensor(2.0)), cfg)) == 2.0
    assert float(environment_capacity(2000, (2000, torch.tensor(30.0)), cfg)) == pytest.approx(25.0 * 2000 / 3000)


def test_an_unknown_schedule_is_refused():
    from vase.errors import ConfigError

    with pytest.raises(ConfigError, match="unknown schedule 'eternal'"):
        build_config("cpu", [], None, "eternal")
