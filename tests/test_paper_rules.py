"""The `paper` rule set (inference.rules=paper): eq. 6 as written, on hand-made inputs and streams."""
import torch

from vase.config import Config, InferenceConfig, MaskConfig, build_config
from vase.inference import MASK, RECONSTRUCTION, build
from vase.learner import Learner
from vase.rules import RULE_SETS

N = 4


def setup(patience=2, k_max=4):
    """The `paper` rule set on hand-made inputs: the inference, and its slots (a^s, alpha, L_s, usage)."""
    cfg = Config(inference=InferenceConfig(rules="paper", kappa=1.5, patience=patience, used_kl=0.1, error_ema=0.0),
                 mask=MaskConfig(0.5, 1.0, ema=0.0))
    cfg.model.k_max, cfg.model.latents = k_max, N
    inf = build(cfg)
    return inf, inf.slots


def decide(inf, slots, step, error, probs, alpha=None, kl=None):
    alpha = torch.zeros(N) if alpha is None else alpha
    kl = torch.tensor([1.0, 1.0, 0.0, 0.0]) if kl is None else kl
    d = inf.infer(step, probs, alpha, kl, lambda env: error.get(env, 1000.0))
    if d.allocated:
        inf.start(d.env, alpha, inf.maskable(d.env))
    if d.verdict != "pending":
        inf.masking.update(slots[d.env], alpha, inf.maskable(d.env))
        slots[d.env].record(error.get(d.env, 1000.0), kl, inf.cfg.error_ema)
    return d


def onehot(s, k=4):
    return torch.nn.functional.one_hot(torch.tensor(s), k).float()


def test_eq6_accepts_the_classifiers_pick_when_both_tests_pass():
    inf, slots = setup()
    assert decide(inf, slots, 0, {0: 100.0}, onehot(0)).verdict == "first"
    d = decide(inf, slots, 1, {0: 149.0}, onehot(0))  # 149 <= 1.5 * 100
    assert (d.verdict, d.env, d.reasons) == ("same", 0, [])


def test_eq6_allocates_on_the_reconstruction_test_after_patience():
    inf, slots = setup(patience=2)
    decide(inf, slots, 0, {0: 100.0}, onehot(0))
    first = decide(inf, slots, 1, {0: 151.0}, onehot(0))
    assert (first.verdict, first.env, first.reasons) == ("pending", 0, [RECONSTRUCTION])
    second = decide(inf, slots, 2, {0: 151.0}, onehot(0))
    assert (second.verdict, second.env) == ("new", 1) and inf.n_envs == 2


def test_eq6_allocates_when_the_batch_mask_disagrees_on_a_used_latent():
    inf, slots = setup(patience=1)
    decide(inf, slots, 0, {0: 100.0}, onehot(0))
    atypical_used = torch.tensor([2.0, 0.0, 0.0, 0.0])  # latent 0, used by env 0, turns atypical
    d = decide(inf, slots, 1, {0: 100.0}, onehot(0), alpha=atypical_used)
    assert (d.verdict, d.reasons, d.disagreeing) == ("new", [MASK], [0])


def test_eq6_ignores_disagreement_on_latents_neither_uses():
    inf, slots = setup(patience=1)
    decide(inf, slots, 0, {0: 100.0}, onehot(0))
    atypical_spare = torch.tensor([0.0, 0.0, 0.0, 2.0])  # latent 3: KL 0 in env 0 and in the batch
    d = decide(inf, slots, 1, {0: 100.0}, onehot(0), alpha=atypical_spare)
    assert d.verdict == "same"


def test_eq6_switches_to_the_classifiers_pick_and_has_no_other_candidates():
    """A batch of environment 0 after environment 1: the classifier names 0 and 0's tests pass, so
    it switches; with the classifier naming 1 instead, eq. 6 tests only 1, fails, and allocates."""
    inf, slots = setup(patience=1)
    decide(inf, slots, 0, {0: 100.0}, onehot(0))
    decide(inf, slots, 1, {0: 500.0, 1: 500.0}, onehot(0))  # new slot 1
    decide(inf, slots, 2, {0: 500.0, 1: 400.0}, onehot(1))
    back = decide(inf, slots, 3, {0: 100.0, 1: 900.0}, onehot(0))
    assert (back.verdict, back.env) == ("switch", 0)
    wrong = decide(inf, slots, 4, {0: 100.0, 1: 900.0}, onehot(1))
    assert (wrong.verdict, wrong.env, wrong.reasons) == ("new", 2, [RECONSTRUCTION])


def test_the_paper_set_masks_any_atypical_latent():
    inf, _ = setup()
    assert inf.maskable(0).all()


def test_a_synthetic_stream_with_a_known_answer_matches_eq6_step_by_step():
    """Three stationary pieces with errors that only the environment's own slot explains, and a
    classifier that knows the slots: eq. 6 must give exactly 0..., then 1..., then back to 0."""
    inf, slots = setup(patience=3)
    truth = [0] * 20 + [1] * 20 + [0] * 20
    assigned = []
    for t, s in enumerate(truth):
        error = {e: (100.0 if e == s else 1000.0) for e in range(4)}
        # The classifier names the old slot for the first batches of a new environment (never trained on it).
        probs = onehot(0) if (s == 1 and inf.n_envs < 2) else onehot(s)
        assigned.append(decide(inf, slots, t, error, probs).env)
    assert assigned == [0] * 22 + [1] * 18 + [0] * 20
    assert inf.n_envs == 2


def test_the_learner_runs_the_paper_set_with_eq3_as_written():
    cfg = build_config("cpu", ["model.channels=8,8,8,8", "model.hidden=32", "model.latents=6", "model.k_max=4",
                               "dream.batch_size=8", "train.batch_size=16", "inference.rules=paper"], "SDA")
    learner = Learner(cfg)
    assert learner.inference.rule_names == RULE_SETS["paper"]
    assert learner.inference.reading(torch.ones(6), torch.ones(6)).tolist() == [1.0] * 6  # KL, not information
    assert learner.objective.fresh_aggregate_weight == 0.0
    assert cfg.objective.fresh_aggregate_weight == 1.0  # the config itself is unchanged
    out = learner.training_step(torch.rand(16, 1, 64, 64).round())
    assert out.decision.verdict == "first"
