"""S: the decision rule of eq. 6 on hand-made inputs."""
import io

import pytest
import torch

from vase.config import InferenceConfig, MaskConfig
from vase.inference import MASK, RECONSTRUCTION, EnvironmentInference
from vase.masking import LatentMasks

N = 4


def setup(patience=3, k_max=3, cooldown=0):
    cfg = InferenceConfig(kappa=1.5, error_margin=0.0, patience=patience, cooldown=cooldown, used_kl=0.1, error_ema=0.0)
    inf = EnvironmentInference(cfg, k_max=k_max, latents=N, use_masks=True)
    masks = LatentMasks(k_max, N, MaskConfig(lambda_low=0.5, lambda_high=1.0, ema=0.0))
    return inf, masks


def decide(inf, masks, step, error, alpha=None, info=None, probs=None):
    alpha = torch.zeros(N) if alpha is None else alpha
    info = torch.tensor([1.0, 1.0, 0.0, 0.0]) if info is None else info
    probs = torch.tensor([1.0, 0.0, 0.0]) if probs is None else probs
    d = inf.infer(step, probs, alpha, info, masks, lambda env: error[env] if isinstance(error, dict) else error)
    if d.allocated:
        masks.start(d.env, alpha, inf.maskable(d.env))
    if d.verdict != "pending":
        masks.update(d.env, alpha, inf.maskable(d.env))
        inf.record(d.env, error[d.env] if isinstance(error, dict) else error, info)
    return d


def test_first_batch_is_environment_zero_and_good_batches_stay():
    inf, masks = setup()
    assert decide(inf, masks, 0, 100.0).verdict == "first"
    for t in range(1, 5):
        d = decide(inf, masks, t, 120.0)
        assert (d.verdict, d.env) == ("same", 0)


def test_bad_reconstruction_allocates_after_patience():
    inf, masks = setup(patience=3)
    decide(inf, masks, 0, 100.0)
    verdicts = [decide(inf, masks, t, 400.0) for t in range(1, 4)]
    assert [d.verdict for d in verdicts] == ["pending", "pending", "new"]
    assert verdicts[-1].env == 1 and RECONSTRUCTION in verdicts[-1].reasons
    assert all(d.env == 0 for d in verdicts[:2])  # doubtful batches train under the current env


def test_mask_disagreement_alone_allocates():
    inf, masks = setup(patience=1)
    decide(inf, masks, 0, 100.0)  # env 0 uses latents 0 and 1
    decide(inf, masks, 1, 100.0, alpha=torch.zeros(N))
    # A second environment that uses latent 2 only, so latent 2 is "owned" by env 1.
    d = decide(inf, masks, 2, 400.0, info=torch.tensor([0.0, 0.0, 1.0, 0.0]))
    assert d.verdict == "new" and d.env == 1
    # Back to env-0-like data whose reconstruction is fine under env 0, but latent 2 (env 1's)
    # does not matter; latent 0 (env 0 uses it) is now atypical: a mask disagreement.
    masks.update(0, torch.zeros(N), torch.tensor([False, False, True, False]))
    inf.current = 0
    masks.masks[0] = torch.ones(N)
    inf.usage[1] = torch.tensor([1.0, 0.0, 1.0, 0.0])  # env 1 also used latent 0, so it is maskable for env 0
    d = decide(inf, masks, 3, {0: 100.0, 1: 400.0, 2: 400.0}, alpha=torch.tensor([3.0, 0.0, 0.0, 0.0]))
    assert MASK in d.reasons and d.verdict == "new"


def test_a_masked_latent_counts_against_its_environment_only_when_its_masking_is_settled():
    """Rule 3, the 'gained' side: a latent env masks, typical and informative on the batch, is
    evidence only if env's smoothed alpha is clearly atypical (above lambda_high). Inside the
    hysteresis band the latent is in transition within env, and the batch is no evidence."""
    inf, masks = setup(patience=1)
    decide(inf, masks, 0, 100.0)
    informative = torch.tensor([1.0, 1.0, 0.0, 1.0])
    for smoothed, fails in [(0.7, False), (2.0, True)]:  # lambda band is (0.5, 1.0)
        masks.masks[0, 3], masks.alpha[0, 3] = 0.0, smoothed
        d = decide(inf, masks, 1, 100.0, alpha=torch.zeros(N), info=informative)
        assert (MASK in d.reasons) == fails
        assert (3 in d.disagreeing) == fails


def test_returning_environment_is_reidentified_by_the_classifier():
    inf, masks = setup(patience=1)
    decide(inf, masks, 0, 100.0)
    decide(inf, masks, 1, {0: 400.0, 1: 100.0})  # new env 1
    assert inf.n_envs == 2 and inf.current == 1
    d = decide(inf, masks, 2, {0: 110.0, 1: 400.0}, probs=torch.tensor([0.9, 0.1, 0.0]))
    assert (d.verdict, d.env) == ("switch", 0) and inf.n_envs == 2


def test_full_slots_warn_and_keep_training():
    inf, masks = setup(patience=1, k_max=2)
    decide(inf, masks, 0, 100.0)
    decide(inf, masks, 1, {0: 400.0, 1: 100.0})
    with pytest.warns(UserWarning, match="all 2 slots"):
        d = decide(inf, masks, 2, 10_000.0, probs=torch.tensor([0.0, 1.0]))
    assert d.verdict == "full" and d.env == 1 and inf.n_envs == 2


def test_error_margin_absorbs_noise_of_a_near_perfect_environment():
    inf, masks = setup(patience=1)
    inf.cfg.error_margin = 25.0
    decide(inf, masks, 0, 1.0)
    assert decide(inf, masks, 1, 3.0).verdict == "same"  # 3 > 1.5 * 1 but within the margin
    assert decide(inf, masks, 2, 40.0).verdict == "new"


def test_new_environment_trains_unjudged_during_cooldown():
    inf, masks = setup(patience=1, cooldown=5)
    decide(inf, masks, 0, 100.0)
    # Inside the cooldown even a terrible batch is not judged...
    assert decide(inf, masks, 1, 10_000.0).verdict == "same"
    inf.errors[0] = 100.0  # (its error is still recorded into L_0; reset it for the next check)
    # ...and the first judged step (5) allocates at once.
    assert decide(inf, masks, 5, 10_000.0).verdict == "new"
    assert decide(inf, masks, 6, 10_000.0).verdict == "same"  # the new env's own cooldown


def test_a_past_environment_the_classifier_ranks_second_is_still_reidentified():
    inf, masks = setup(patience=1)
    decide(inf, masks, 0, 100.0)
    decide(inf, masks, 1, {0: 400.0, 1: 100.0})  # new env 1
    decide(inf, masks, 2, {0: 400.0, 1: 400.0, 2: 100.0})  # new env 2
    assert inf.n_envs == 3 and inf.current == 2
    # The data is env 0's again, but the classifier has drifted to env 1: both the current env and
    # s_hat fail, and env 0, ranked next, passes.
    d = decide(inf, masks, 3, {0: 110.0, 1: 400.0, 2: 400.0}, probs=torch.tensor([0.2, 0.7, 0.1]))
    assert (d.verdict, d.env, d.predicted) == ("switch", 0, 1) and inf.n_envs == 3


def test_a_change_of_the_current_mask_reopens_the_settling_period():
    inf, masks = setup(patience=1, cooldown=5)
    decide(inf, masks, 0, 100.0)
    for t in range(1, 6):
        decide(inf, masks, t, 100.0)
    inf.resettle(0, 6)  # the learner calls this when a^0 changes while training in env 0
    assert not inf.recorded[0]  # L_0 is learnt again under the new mask
    assert decide(inf, masks, 7, 10_000.0).verdict == "same"  # unjudged while it settles
    assert inf.errors[0] == 10_000.0
    inf.errors[0] = 100.0
    assert decide(inf, masks, 11, 10_000.0).verdict == "new"  # judged again after the cooldown


def test_resettling_a_past_environment_changes_nothing():
    inf, masks = setup(patience=1, cooldown=5)
    decide(inf, masks, 0, 100.0)
    decide(inf, masks, 10, {0: 400.0, 1: 100.0})  # env 1 is current
    inf.resettle(0, 20)
    assert inf.settling_since == 10 and inf.recorded[0]


def test_a_past_environment_is_refused_when_the_batch_uses_a_latent_only_another_relies_on():
    inf, masks = setup(patience=1, k_max=5)
    uses_01 = torch.tensor([1.5, 1.5, 0.0, 0.0])  # env 0: latents 0 and 1 (say, position)
    uses_013 = torch.tensor([1.5, 1.5, 0.0, 2.0])  # env 1 adds latent 3 (say, digit identity)
    decide(inf, masks, 0, 100.0, info=uses_01)
    decide(inf, masks, 1, {0: 400.0, 1: 100.0}, info=uses_013)  # new env 1
    decide(inf, masks, 2, {0: 400.0, 1: 400.0, 2: 100.0}, info=uses_01)  # new env 2 is current
    # A batch like env 1's, which also fits env 0's reconstruction threshold and masks: env 0
    # never used latent 3, env 1 relies on it (2 nats) and the batch carries 1.8 of it.
    d = decide(inf, masks, 3, {0: 110.0, 1: 400.0, 2: 400.0, 3: 100.0}, info=torch.tensor([1.5, 1.5, 0.0, 1.8]),
               probs=torch.tensor([0.9, 0.05, 0.05, 0.0, 0.0]))
    assert d.verdict == "new" and d.env == 3
    assert d.tried == [[2, ["reconstruction"]], [0, ["usage"]], [1, ["reconstruction"]]]
    # A batch of env 0 that carries a little of latent 3 (0.4 < 0.5 * 2.0) is re-identified.
    inf.current = 2
    d = decide(inf, masks, 4, {0: 110.0, 1: 400.0, 2: 400.0, 3: 400.0}, info=torch.tensor([1.5, 1.5, 0.0, 0.4]),
               probs=torch.tensor([0.9, 0.05, 0.05, 0.0, 0.0]))
    assert (d.verdict, d.env) == ("switch", 0)


def test_the_current_environment_is_never_refused_for_usage():
    inf, masks = setup(patience=1)
    decide(inf, masks, 0, 100.0, info=torch.tensor([1.5, 0.0, 0.0, 0.0]))
    decide(inf, masks, 1, {0: 400.0, 1: 100.0}, info=torch.tensor([0.0, 0.0, 0.0, 2.0]))  # env 1 uses latent 3
    decide(inf, masks, 2, {0: 100.0, 1: 400.0}, probs=torch.tensor([1.0, 0.0, 0.0]),
           info=torch.tensor([1.5, 0.0, 0.0, 0.0]))  # back to env 0, now current
    assert inf.current == 0
    # Env 0 starts to use latent 3 as well (C(t) grows): no verdict against the current env.
    assert inf.foreign_latents(0, torch.tensor([1.5, 0.0, 0.0, 1.8])).any()
    d = decide(inf, masks, 3, {0: 100.0, 1: 400.0}, info=torch.tensor([1.5, 0.0, 0.0, 1.8]))
    assert (d.verdict, d.env) == ("same", 0)


def _switch_back_into_env_0(cooldown):
    """Env 0, then env 1, then a batch that passes env 0's tests only: a switch back into env 0."""
    inf, masks = setup(patience=1, cooldown=cooldown, k_max=4)
    decide(inf, masks, 0, 100.0, info=torch.tensor([1.0, 1.0, 0.0, 0.0]))
    decide(inf, masks, 30, {0: 400.0, 1: 100.0}, info=torch.tensor([0.0, 0.0, 1.0, 0.0]))  # new env 1
    d = decide(inf, masks, 60, {0: 100.0, 1: 400.0}, info=torch.tensor([1.0, 1.0, 0.0, 0.0]))
    assert (d.verdict, d.env) == ("switch", 0)
    before = (inf.errors[0].clone(), inf.usage[0].clone(), masks.alpha[0].clone())
    # A batch trained in env 0 that is not env 0's data: it carries latent 3 and shifts alpha there.
    d = decide(inf, masks, 61, 120.0, info=torch.tensor([1.0, 1.0, 0.0, 2.0]),
               alpha=torch.tensor([0.0, 0.0, 0.0, 0.4]))
    assert (d.verdict, d.env) == ("same", 0) and inf.usage[0, 3] == 2.0 and inf.errors[0] == 120.0
    return inf, masks, before


@pytest.mark.parametrize("left_after, restored", [(5, True), (30, False)])
def test_a_past_environment_left_within_the_cooldown_of_a_switch_gets_its_statistics_back(left_after, restored):
    """Rule 12: no environment lasts less than `cooldown` steps, so a switch into a past
    environment that the stream leaves sooner was a mistake, and what its batches wrote into that
    environment's L_s, usage and mask is undone. After the cooldown it is that environment's data."""
    inf, masks, (error, usage, alpha) = _switch_back_into_env_0(cooldown=20)
    d = decide(inf, masks, 60 + left_after, 10_000.0, info=torch.tensor([0.0, 0.0, 0.0, 2.0]))
    assert (d.verdict, d.env) == ("new", 2)
    assert d.restored == (0 if restored else None)
    assert torch.equal(inf.usage[0], usage) == restored
    assert (inf.errors[0] == error) == restored
    assert torch.equal(masks.alpha[0], alpha) == restored
    assert inf.probation is None


def test_probation_survives_a_checkpoint():
    inf, masks, (error, usage, alpha) = _switch_back_into_env_0(cooldown=20)
    resumed, resumed_masks = setup(patience=1, cooldown=20, k_max=4)
    # Through the bytes a checkpoint holds, and the safe loader that reads them.
    saved = io.BytesIO()
    torch.save({"inference": inf.state_dict(), "masks": masks.state_dict()}, saved)
    state = torch.load(io.BytesIO(saved.getvalue()), weights_only=True)
    resumed.load_state_dict(state["inference"])
    resumed_masks.load_state_dict(state["masks"])
    d = decide(resumed, resumed_masks, 65, 10_000.0)
    assert d.restored == 0 and torch.equal(resumed.usage[0], usage) and torch.equal(resumed_masks.alpha[0], alpha)


@pytest.mark.parametrize("past_usage, fails", [(False, True), (True, False)])
def test_on_probation_the_mask_test_reads_the_latents_used_before_the_switch(past_usage, fails):
    """Rule 3 after a switch back: a latent env 0 starts using now has a smoothed alpha from before
    env 0 left (settled low), so reading it as a settled latent that turned atypical is stale
    evidence. With `probation_relies_on_past_usage` only the latents used before the switch count."""
    inf, masks, _ = _switch_back_into_env_0(cooldown=20)
    inf.cfg.probation_relies_on_past_usage = past_usage
    inf.cfg.patience = 5  # a failing batch stays pending, in env 0
    assert inf.used(0)[3] and not inf.probation.usage[3] > inf.cfg.used_kl  # latent 3: new in this visit
    d = decide(inf, masks, 62, 100.0, info=torch.tensor([1.0, 1.0, 0.0, 2.0]),
               alpha=torch.tensor([0.0, 0.0, 0.0, 3.0]))
    assert (MASK in d.reasons) == fails and (3 in d.disagreeing) == fails
    # After the cooldown the switch has lasted; the probation ends and the running usage counts.
    masks.alpha[0, 3] = 0.0
    d = decide(inf, masks, 90, 100.0, info=torch.tensor([1.0, 1.0, 0.0, 2.0]),
               alpha=torch.tensor([0.0, 0.0, 0.0, 3.0]))
    assert inf.probation is None and MASK in d.reasons
