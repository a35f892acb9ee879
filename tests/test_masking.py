"""A: atypicality (eq. 4) and the hysteresis mask (eq. 5)."""
import torch

from vase.config import MaskConfig
from vase.masking import AllOnes, Masks, atypicality, hysteresis, information
from vase.objective import kl_per_latent
from vase.slots import Slots, from_split_layout


def test_alpha_is_zero_for_prior_matching_posteriors():
    # Posteriors N(mu_b, s^2) whose mixture has mean 0 and variance 1: mu ~ +-0.6, s^2 = 0.64.
    mu = torch.tensor([[0.6], [-0.6]]).repeat(50, 1)
    logvar = torch.full_like(mu, torch.log(torch.tensor(0.64)).item())
    assert float(atypicality(mu, logvar)) < 1e-6
    # The plain prior posterior too.
    assert float(atypicality(torch.zeros(10, 3), torch.zeros(10, 3)).abs().max()) < 1e-6


def test_alpha_is_large_for_collapsed_or_shifted_latents():
    collapsed = atypicality(torch.full((32, 1), 0.3), torch.full((32, 1), -6.0))
    shifted = atypicality(torch.full((32, 1), 3.0) + 0.1 * torch.randn(32, 1), torch.zeros(32, 1))
    assert float(collapsed) > 2.0
    assert float(shifted) > 4.0


def test_alpha_matches_moment_formula():
    mu, logvar = torch.tensor([[1.0], [3.0]]), torch.tensor([[0.0], [0.0]])
    m, v = 2.0, (1 + 1 + 1 + 9) / 2 - 4  # mean(sigma^2 + mu^2) - m^2 = 2
    expected = 0.5 * (v + m * m - 1 - torch.log(torch.tensor(v)))
    assert torch.allclose(atypicality(mu, logvar), expected.reshape(1))


def test_information_ignores_a_shared_shift_of_the_posterior_means():
    """KL = I + alpha: a shift common to every image adds KL and alpha alike, no information."""
    informative_mu = torch.tensor([[0.6], [-0.6]]).repeat(50, 1)
    logvar = torch.full_like(informative_mu, torch.log(torch.tensor(0.64)).item())

    def info(mu, lv):
        return information(kl_per_latent(mu, lv).mean(0), atypicality(mu, lv))

    expected = -0.5 * torch.log(torch.tensor(0.64))  # KL of N(+-0.6, 0.64) to N(0,1); alpha = 0
    assert torch.allclose(info(informative_mu, logvar), expected.reshape(1), atol=1e-5)
    # The same latent shifted by 3 for every image: KL grows by 4.5 nats, information does not.
    shifted = informative_mu + 3.0
    assert float(kl_per_latent(shifted, logvar).mean()) > float(expected) + 4.4
    assert torch.allclose(info(shifted, logvar), expected.reshape(1), atol=1e-4)
    # A pure shift carries nothing, and the estimate never goes negative.
    assert float(info(torch.full((32, 1), 3.0), torch.zeros(32, 1))) == 0.0


def test_hysteresis_keeps_state_between_thresholds():
    cfg = MaskConfig(lambda_low=1.0, lambda_high=2.0)
    prev = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 0.0])
    alpha = torch.tensor([1.5, 1.5, 2.5, 2.5, 0.5, 0.5])
    assert torch.equal(hysteresis(alpha, prev, cfg), torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0]))


def test_masks_per_environment_and_switch_off():
    cfg = MaskConfig(lambda_low=0.5, lambda_high=1.0, ema=0.0)
    masks, slots = Masks(cfg), Slots(k_max=3, latents=2)
    masks.update(slots[0], torch.tensor([3.0, 0.0]), None)
    masks.update(slots[1], torch.tensor([0.0, 3.0]), None)
    assert torch.equal(masks.applied(slots[0]), torch.tensor([0.0, 1.0]))
    assert torch.equal(masks.applied(slots[1]), torch.tensor([1.0, 0.0]))
    assert torch.equal(masks.applied(slots[2]), torch.ones(2))  # an unused slot leaves every latent free
    assert torch.equal(AllOnes().applied(slots[0]), torch.ones(2))  # A off


def test_only_maskable_latents_can_be_switched_off():
    cfg = MaskConfig(lambda_low=0.5, lambda_high=1.0, ema=0.0)
    masks, slots = Masks(cfg), Slots(k_max=2, latents=3)
    maskable = torch.tensor([True, False, True])
    masks.update(slots[0], torch.tensor([3.0, 3.0, 0.0]), maskable)
    assert torch.equal(masks.applied(slots[0]), torch.tensor([0.0, 1.0, 1.0]))
    # A batch's own mask relative to a^0 follows the same rule.
    batch_mask = hysteresis(torch.tensor([3.0, 3.0, 3.0]), slots[0].mask, cfg, maskable)
    assert torch.equal(batch_mask, torch.tensor([0.0, 1.0, 0.0]))


def test_maskable_latents_are_those_other_environments_use():
    from vase.config import Config, InferenceConfig
    from vase.inference import build

    cfg = Config(inference=InferenceConfig(used_kl=0.1))
    cfg.model.k_max, cfg.model.latents = 3, 3
    inf = build(cfg)
    inf.allocate(0, 0, "first", [])
    inf.slots[0].record(100.0, torch.tensor([2.0, 0.0, 0.0]), inf.cfg.error_ema)
    inf.allocate(10, 1, "new", [])
    inf.slots[1].record(100.0, torch.tensor([0.0, 0.0, 1.5]), inf.cfg.error_ema)
    assert inf.maskable(1).tolist() == [True, False, False]
    assert inf.maskable(0).tolist() == [False, False, True]


def test_a_single_slot_masks_only_the_latents_it_has_learnt():
    """With S off there is one slot. A latent it is learning is atypical until it settles; masking it
    then would stop the learning for good (the "A" and "DA" rows closed all 24 latents that way)."""
    cfg = MaskConfig(lambda_low=0.3, lambda_high=1.0, ema=0.0)
    masks, slots = Masks(cfg), Slots(k_max=1, latents=3)
    slot = slots[0]

    def step(alpha, used):
        masks.update(slot, torch.tensor(alpha), slot.learnt.clone(), torch.tensor(used))
        return slot.mask

    # Latent 0 is being learnt (used, atypical), 1 is used and settled, 2 is unused but atypical.
    for _ in range(3):
        assert step([2.0, 0.1, 2.0], [True, True, False]).tolist() == [1.0, 1.0, 1.0]
    assert slot.learnt.tolist() == [False, True, False]
    step([0.1, 0.1, 2.0], [True, True, False])  # latent 0 settles: now a learnt factor
    assert slot.learnt.tolist() == [True, True, False]
    # New data shifts every latent: the learnt ones are protected, the never-learnt one stays spare.
    assert step([2.0, 2.0, 2.0], [True, True, False]).tolist() == [0.0, 0.0, 1.0]
    # Masked latents carry nothing, so their usage decays; they stay learnt and reopen only when typical.
    assert step([2.0, 0.1, 2.0], [False, False, False]).tolist() == [0.0, 1.0, 1.0]
    assert slot.learnt.tolist() == [True, True, False]
    # The record is part of the checkpoint, and a checkpoint without it loads as "nothing learnt".
    restored = Slots(k_max=1, latents=3)
    restored.load_state_dict(slots.state_dict())
    assert torch.equal(restored[0].learnt, slot.learnt)
    state = slots.state_dict()
    old_masks = {"masks": state["mask"], "alpha": state["alpha"], "initialised": state["initialised"]}
    old_inference = {"errors": state["error"], "usage": state["usage"], "recorded": state["recorded"]}
    restored.load_state_dict(from_split_layout(old_inference, old_masks)["slots"])
    assert not restored[0].learnt.any() and torch.equal(restored[0].mask, slot.mask)
