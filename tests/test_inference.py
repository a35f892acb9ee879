"""S: the decision rule of eq. 6 on hand-made inputs."""


import pytest
import torch

from vase.config import Config, InferenceConfig, MaskConfig
from vase.inference import MASK, RECONSTRUCTION, build

N = 4


def setup(patience=3, k_max=3, cooldown=0):
    """The `vase` rule set on hand-made inputs: the inference, and its slots (a^s, alpha, L_s, usage)."""
    cfg = Config(inference=InferenceConfig(kappa=1.5, error_margin=0.0, patience=patience, cooldown=cooldown,
                                           used_kl=0.1, error_ema=0.0),
                 mask=MaskConfig(lambda_low=0.5, lambda_high=1.0, ema=0.0))
    cfg.model.k_max, cfg.model.latents = k_max, N
    inf = build(cfg)
    return inf, inf.slots


def decide(inf, slots, step, error, alpha=None, info=None, probs=None):
    alpha = torch.zeros(N) if alpha is None else alpha
    info = torch.tensor([1.0, 1.0, 0.0, 0.0]) if info is None else info
    probs = torch.tensor([1.0, 0.0, 0.0]) if probs is None else probs
    d = inf.infer(step, probs, alpha, info, lambda env: error[env] if isinstance(error, dict) else error)
    if d.allocated:
        inf.start(d.env, alpha, inf.maskable(d.env))
    if d.verdict != "pending":
        inf.masking.update(slots[d.env], alpha, inf.maskable(d.env))
        slots[d.env].record(error[d.env] if isinstance(error, dict) else error, info, inf.cfg.error_ema)
    return d


def test_first_batch_is_environment_zero_and_good_batches_stay():
    inf, slots = setup()
    assert decide(inf, slots, 0, 100.0).verdict == "first"
    for t in range(1, 5):
        d = decide(inf, slots, t, 120.0)
        assert (d.verdict, d.env) == ("same", 0)


def test_bad_reconstruction_allocates_after_patience():
    inf, slots = setup(patience=3)
    decide(inf, slots, 0, 100.0)
    verdicts = [decide(inf, slots, t, 400.0) for t in range(1, 4)]
    assert [d.verdict for d in verdicts] == ["pending", "pending", "new"]
    assert verdicts[-1].env == 1 and RECONSTRUCTION in verdicts[-1].reasons
    assert all(d.env == 0 for d in verdicts[:2])  # doubtful batches train under the current env


def test_mask_disagreement_alone_allocates():
    inf, slots = setup(patience=1)
    decide(inf, slots, 0, 100.0)  # env 0 uses latents 0 and 1
    decide(inf, slots, 1, 100.0, alpha=torch.zeros(N))
    # A second environment that uses latent 2 only, so latent 2 is "owned" by env 1.
    d = decide(inf, slots, 2, 400.0, info=torch.tensor([0.0, 0.0, 1.0, 0.0]))
    assert d.verdict == "new" and d.env == 1
    # Back to env-0-like data whose reconstruction is fine under env 0, but latent 2 (env 1's)
    # does not matter; latent 0 (env 0 uses it) is now atypical: a mask disagreement.
    inf.masking.update(slots[0], torch.zeros(N), torch.tensor([False, False, True, False]))
    inf.current = 0
    slots[0].mask = torch.ones(N)
    slots[1].usage = torch.tensor([1.0, 0.0, 1.0, 0.0])  # env 1 also used latent 0, so it is maskable for env 0
    d = decide(inf, slots, 3, {0: 100.0, 1: 400.0, 2: 400.0}, alpha=torch.tensor([3.0, 0.0, 0.0, 0.0]))
    assert MASK in d.reasons and d.verdict == "new"


def test_a_masked_latent_counts_against_its_environment_only_when_its_masking_is_settled():
    """Rule 3, the 'gained' side: a latent env masks, typical and informative on the batch, is
    evidence only if env's smoothed alpha is clearly atypical (above lambda_high). Inside the
    hysteresis band the latent is in transition within env, and the batch is no evidence."""
    inf, slots = setup(patience=1)
    decide(inf, slots, 0, 100.0)
    informative = torch.tensor([1.0, 1.0, 0.0, 1.0])
    for smoothed, fails in [(0.7, False), (2.0, True)]:  # lambda band is (0.5, 1.0)
        slots[0].mask[3], slots[0].alpha[3] = 0.0, smoothed
        d = decide(inf, slots, 1, 100.0, alpha=torch.zeros(N), info=informative)
        assert (MASK in d.reasons) == fails
        assert (3 in d.disagreeing) == fails


def test_returning_environment_is_reidentified_by_the_classifier():
    inf, slots = setup(patience=1)
    decide(inf, slots, 0, 100.0)
    decide(inf, slots, 1, {0: 400.0, 1: 100.0})  # new env 1
    assert inf.n_envs == 2 and inf.current == 1
    d = decide(inf, slots, 2, {0: 110.0, 1: 400.0}, probs=torch.tensor([0.9, 0.1, 0.0]))
    assert (d.verdict, d.env) == ("switch", 0) and inf.n_envs == 2


def test_full_slots_warn_and_keep_training():
    inf, slots = setup(patience=1, k_max=2)
    decide(inf, slots, 0, 100.0)
    decide(inf, slots, 1, {0: 400.0, 1: 100.0})
    with pytest.warns(UserWarning, match="all 2 slots"):
        d = decide(inf, slots, 2, 10_000.0, probs=torch.tensor([0.0, 1.0]))
    assert d.verdict == "full" and d.env == 1 and inf.n_envs == 2


def test_error_margin_absorbs_noise_of_a_near_perfect_environment():
    inf, slots = setup(patience=1)
    inf.cfg.error_margin = 25.0
    decide(inf, slots, 0, 1.0)
    assert decide(inf, slots, 1, 3.0).verdict == "same"  # 3 > 1.5 * 1 but within the margin
    assert decide(inf, slots, 2, 40.0).verdict == "new"


def test_new_environment_trains_unjudged_during_cooldown():
    inf, slots = setup(patience=1, cooldown=5)
    decide(inf, slots, 0, 100.0)
    # Inside the cooldown even a terrible batch is not judged...
    assert decide(inf, slots, 1, 10_000.0).verdict == "same"
    slots[0].error = torch.tensor(100.0)  # (its error is still recorded into L_0; reset it for the next check)
    # ...and the first judged step (5) allocates at once.
    assert decide(inf, slots, 5, 10_000.0).verdict == "new"
    assert decide(inf, slots, 6, 10_000.0).verdict == "same"  # the new env's own cooldown


def _switch_back_into_env_0(cooldown):
    """Env 0, then env 1, then a batch that passes env 0's tests only: a switch back into env 0."""
    inf, slots = setup(patience=1, cooldown=cooldown, k_max=4)
    decide(inf, slots, 0, 100.0, info=torch.tensor([1.0, 1.0, 0.0, 0.0]))
    decide(inf, slots, 30, {0: 400.0, 1: 100.0}, info=torch.tensor([0.0, 0.0, 1.0, 0.0]))  # new env 1
    d = decide(inf, slots, 60, {0: 100.0, 1: 400.0}, info=torch.tensor([1.0, 1.0, 0.0, 0.0]))
    assert (d.verdict, d.env) == ("switch", 0)
    before = (slots[0].error.clone(), slots[0].usage.clone(), slots[0].alpha.clone())
    # A batch trained in env 0 that is not env 0's data: it carries latent 3 and shifts alpha there.
    d = decide(inf, slots, 61, 120.0, info=torch.tensor([1.0, 1.0, 0.0, 2.0]),
               alpha=torch.tensor([0.0, 0.0, 0.0, 0.4]))
    assert (d.verdict, d.env) == ("same", 0) and slots[0].usage[3] == 2.0 and slots[0].error == 120.0
    return inf, slots, before


def test_a_past_environment_left_soon_after_a_switch_keeps_what_its_batches_wrote():
    """Eq. 6 as printed: a batch trained in a past environment updates that environment's L_s,
    usage and mask, and leaving it again undoes nothing."""
    inf, slots, (error, usage, alpha) = _switch_back_into_env_0(cooldown=20)
    d = decide(inf, slots, 65, 10_000.0, info=torch.tensor([0.0, 0.0, 0.0, 2.0]))
    assert (d.verdict, d.env) == ("new", 2)
    assert slots[0].usage[3] == 2.0 and slots[0].error == 120.0
    assert not torch.equal(slots[0].usage, usage) and not torch.equal(slots[0].alpha, alpha)


def test_q_psi_on_features_that_do_not_tell_slots_apart_learns_the_label_frequencies():
    # 64 real images of the current slot and 16 dreams of a past one with the same features: the
    # cross-entropy converges to the frequencies 64:16 (docs/regime.md, "q_psi's prior").
    torch.manual_seed(0)
    q = torch.nn.Linear(8, 2)
    opt = torch.optim.Adam(q.parameters(), lr=0.05)
    labels = torch.cat([torch.zeros(64, dtype=torch.long), torch.ones(16, dtype=torch.long)])
    for _ in range(400):
        features = torch.randn(80, 8)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(q(features), labels).backward()
        opt.step()
    with torch.no_grad():
        p_current = float(torch.softmax(q(torch.randn(4096, 8)), 1)[:, 0].mean())
    assert p_current == pytest.approx(0.8, abs=0.03)
