"""The rule registry (`vase.rules`): each rule on a hand-made case where it changes the outcome and
one where it does not, and the stand-ins of S, A and D when they are off."""
import dataclasses
import re
from pathlib import Path
from unittest.mock import patch

import pytest
import torch

from vase import config_sections
from vase.config import Config, InferenceConfig, MaskConfig, build_config
from vase.dreaming import NoDreams
from vase.errors import ConfigError
from vase.inference import MASK, SingleEnvironment, build
from vase.learner import Learner
from vase.masking import AllOnes
from vase.objective import environment_capacity, mdl_loss
from vase.rules import HOOKS, RULE_SETS, RULES, Rule, as_configured
from vase.table1 import row_label

N = 4


def case_config(with_s=True, mask_ema=0.0, with_a=True) -> Config:
    cfg = Config(inference=InferenceConfig(kappa=1.5, error_margin=25.0, patience=3, cooldown=5, used_kl=0.1,
                                           error_ema=0.0, enabled=with_s),
                 mask=MaskConfig(lambda_low=0.5, lambda_high=1.0, ema=mask_ema, enabled=with_a))
    cfg.model.k_max, cfg.model.latents = 4, N
    return cfg


def with_rules(names, cfg=None, **kwargs):
    """The inference of `cfg` (default: `case_config(**kwargs)`) under a rule set of exactly `names`."""
    cfg = case_config(**kwargs) if cfg is None else cfg
    with patch.dict(RULE_SETS, {"case": tuple(names)}):
        cfg.inference.rules = "case"
        return build(cfg)


def objective(names):
    cfg = case_config()
    cfg.objective.new_env_ramp_steps = 1000
    with patch.dict(RULE_SETS, {"case": tuple(names)}):
        cfg.inference.rules = "case"
        return as_configured(cfg).objective


def onehot(s):
    return torch.nn.functional.one_hot(torch.tensor(s), 4).float()


def decide(inf, step, error, info=(1.0, 1.0, 0.0, 0.0), probs=None):
    """One batch through eq. 6 and the bookkeeping, as the learner runs them (alpha 0: every latent typical)."""
    alpha, info = torch.zeros(N), torch.tensor(info)
    probs = onehot(0) if probs is None else probs
    error_under = (lambda env: error.get(env, 100.0)) if isinstance(error, dict) else (lambda env: error)
    d = inf.infer(step, probs, alpha, info, error_under)
    if d.allocated:
        inf.start(d.env, alpha, inf.maskable(d.env))
    inf.bookkeeping(d, error_under(d.env), info, alpha, inf.mask(d.env), inf.maskable(d.env))
    return d


# -- one case per rule: the outcome of a rule set with and without the rule ---------------------------------
def verdict_of(error, step=10, first=100.0):
    """The verdict on a batch of `error` at `step`, after a first batch of `first` at step 0."""
    def run(names):
        inf = with_rules(names)
        decide(inf, 0, first)
        return decide(inf, step, error).verdict
    return run


def error_after_a_batch(error):
    def run(names):
        inf = with_rules(names)
        decide(inf, 0, 100.0)
        decide(inf, 10, error)
        return float(inf.slots[0].error)
    return run


def mask_after(alpha0, previous0, mask_ema=0.0):
    def run(names):
        inf = with_rules(names, mask_ema=mask_ema)
        decide(inf, 0, 100.0)
        inf.slots[0].mask[0] = previous0
        inf.masking.update(inf.slots[0], torch.tensor([alpha0, 0.0, 0.0, 0.0]), inf.maskable(0))
        return inf.slots[0].mask.tolist()
    return run


def reading(alpha):
    def run(names):
        return with_rules(names).reading(torch.ones(N), torch.full((N,), alpha)).tolist()
    return run


def verdict_with_a_masked_latent_smoothed_at(smoothed):
    def run(names):
        inf = with_rules(names)
        decide(inf, 0, 100.0)
        inf.slots[0].mask[3], inf.slots[0].alpha[3] = 0.0, smoothed
        return decide(inf, 1, 100.0, info=(1.0, 1.0, 0.0, 1.0)).verdict  # latent 3 typical and informative
    return run


def maskable_in_env_1(usage0):
    def run(names):
        inf = with_rules(names)
        decide(inf, 0, 100.0, info=usage0)
        decide(inf, 1, {0: 1000.0, 1: 100.0}, info=(0.0, 0.0, 1.0, 0.0))
        return inf.maskable(1).tolist()
    return run


def maskable_of_one_slot(learnt):
    def run(names):
        inf = with_rules(names, with_s=False)
        decide(inf, 0, 100.0)
        inf.slots[0].learnt = torch.tensor(learnt)
        return inf.maskable(0).tolist()
    return run


def mdl_with(**penalty):
    def run(names):
        return float(mdl_loss(torch.tensor([10.0]), torch.tensor([5.0]), 5.0, objective(names), **penalty))
    return run


def capacity_of_a_slot_allocated_at(allocated):
    """The capacity target at step 4,000 of a slot allocated at `allocated` carrying 2 nats (C(t) at
    C_max 25 from step 3,000 on; a ramp of 1,000 steps where the rule is in the set)."""
    def run(names):
        return environment_capacity(4000, (allocated, 2.0), objective(names))
    return run


PAPER = RULE_SETS["paper"]
# rule -> (a case where it changes the outcome, a case where it does not, the other rules of both runs)
CASES = {
    "debouncing": (verdict_of(1000.0), verdict_of(120.0), ()),
    "frozen_while_pending": (error_after_a_batch(1000.0), error_after_a_batch(120.0), ("debouncing",)),
    "hysteresis": (mask_after(0.7, 0.0), mask_after(2.0, 0.0), ()),
    "smoothed_atypicality": (mask_after(3.0, 1.0, mask_ema=0.9), mask_after(0.0, 1.0, mask_ema=0.9), ()),
    "settling": (verdict_of(1000.0, step=1), verdict_of(1000.0, step=10), ()),
    "information": (reading(0.5), reading(0.0), ()),
    "error_margin": (verdict_of(3.0, step=1, first=1.0), verdict_of(40.0, step=1, first=1.0), ()),
    "settled_masks": (verdict_with_a_masked_latent_smoothed_at(0.7), verdict_with_a_masked_latent_smoothed_at(2.0),
                      ()),
    "others_latents_only": (maskable_in_env_1((2.0, 0.0, 0.0, 0.0)), maskable_in_env_1((2.0, 2.0, 2.0, 2.0)), ()),
    "learnt_latents_only": (maskable_of_one_slot([False, True, False, False]), maskable_of_one_slot([True] * 4), ()),
    "fresh_latent_penalty": (mdl_with(fresh_atypical=torch.tensor(2.0)), mdl_with(), ()),
    "own_capacity_ramp": (capacity_of_a_slot_allocated_at(3500), capacity_of_a_slot_allocated_at(2000), ()),
}


@pytest.mark.parametrize("name", list(RULES))
def test_each_rule_changes_the_outcome_of_its_case_and_not_of_another(name):
    assert name in CASES, f"rule {name!r} has no test case in CASES"
    fires, quiet, others = CASES[name]
    assert fires((*others, name)) != fires(others)
    assert quiet((*others, name)) == quiet(others)


def test_every_case_names_a_rule():
    assert set(CASES) <= set(RULES)


@pytest.mark.parametrize("rule", list(RULES.values()), ids=list(RULES))
def test_each_rule_documents_itself_and_owns_real_settings(rule):
    doc = rule.__doc__ or ""
    assert "Fixes:" in doc or "No failure measured" in doc, "the docstring names the failure the rule fixes"
    assert "Setting" in doc
    sections = {f.name: getattr(Config(), f.name) for f in dataclasses.fields(Config)}
    fields = {f"{name}.{f.name}" for name, section in sections.items() if dataclasses.is_dataclass(section)
              for f in dataclasses.fields(section)}
    assert set(rule.settings) <= fields and set(rule.as_printed) <= set(rule.settings)
    overridden = {name for name in vars(rule) if name in dir(Rule) and not name.startswith("_")}
    attributes = {"name", "settings", "as_printed", "with_s", "marks_learnt", "state_dict", "load_state_dict"}
    assert overridden <= set(HOOKS) | attributes, "a rule acts through the hooks of `Rule`"


def test_the_rule_sets_are_lists_of_registered_rules():
    assert tuple(RULE_SETS) == config_sections.RULE_SETS
    assert RULE_SETS["vase"] == tuple(RULES)
    assert set(RULE_SETS["paper"]) <= set(RULES)


def test_docs_name_every_rule_object():
    """docs/method.md's table of rules names each rule by its code identifier."""
    text = (Path(__file__).parent.parent / "docs" / "method.md").read_text()
    table = text[text.index("## Rules beyond eq. 6"): text.index("## The regime")]
    for name, rule in RULES.items():
        assert re.search(rf"`(vase\.rules\.)?{rule.__name__}`", table), rule.__name__
        assert f"`{name}`" in table, name


def test_the_paper_set_reads_eq3_and_the_margin_as_printed():
    cfg = build_config("cpu", ["inference.rules=paper"])
    printed = as_configured(cfg)
    assert (printed.inference.error_margin, printed.objective.fresh_aggregate_weight) == (0.0, 0.0)
    assert (printed.mask.lambda_low, printed.mask.ema, printed.inference.patience) == (
        cfg.mask.lambda_low, cfg.mask.ema, cfg.inference.patience)
    assert as_configured(build_config("cpu", [])) == build_config("cpu", [])


# -- stand-ins when a switch is off ---------------------------------------------------------------------------
def test_with_s_off_every_batch_is_environment_0_without_a_classifier():
    inf = with_rules(RULE_SETS["vase"], with_s=False)
    assert isinstance(inf, SingleEnvironment) and inf.dream_environments() == []
    verdicts = [decide(inf, t, 100.0 if t < 3 else 10_000.0, probs=onehot(2)) for t in range(6)]
    assert [(d.verdict, d.env) for d in verdicts] == [("first", 0)] + [("same", 0)] * 5 and inf.n_envs == 1
    assert inf.classify(torch.zeros(2, 8), 2) == (None, None) and inf.train_classifier(None, 0, 2, None) == {}
    assert inf.dream_environments() == [0] and inf.past_environments() == []
    assert inf.rule("others_latents_only") is None and inf.rule("learnt_latents_only") is not None


def test_with_a_off_every_mask_is_all_ones_and_never_tested():
    inf = with_rules(PAPER, with_a=False)
    assert isinstance(inf.masking, AllOnes)
    decide(inf, 0, 100.0)
    inf.slots[0].mask = torch.tensor([0.0, 0.0, 1.0, 1.0])  # as if eq. 5 had masked latents 0 and 1
    assert inf.mask(0).tolist() == [1.0] * N
    inf.masking.update(inf.slots[0], torch.full((N,), 5.0), inf.maskable(0))
    assert inf.slots[0].mask.tolist() == [0.0, 0.0, 1.0, 1.0]
    d = decide(inf, 1, 100.0, info=(1.0, 1.0, 1.0, 1.0))  # disagrees with a^0 on latents 0 and 1
    assert MASK not in d.reasons and d.verdict == "same"


def test_with_d_off_there_are_no_dreams_and_the_snapshot_is_left_alone():
    cfg = build_config("cpu", ["model.channels=8,8,8,8", "model.hidden=32", "model.latents=6", "model.k_max=4",
                               "train.batch_size=16", "dream.snapshot_every=1"], "SA")
    lrn = Learner(cfg)
    assert isinstance(lrn.dreaming, NoDreams)
    before = {k: v.clone() for k, v in lrn.snapshot.state_dict().items()}
    for _ in range(3):
        out = lrn.training_step(torch.rand(16, 1, 64, 64).round())
        assert lrn.dream() is None and "dream_encoder" not in out.losses
    assert all(torch.equal(before[k], v) for k, v in lrn.snapshot.state_dict().items())
    assert NoDreams().dream([0, 1], 6, lrn.generator) is None


def test_a_rule_left_out_with_without_is_gone_and_its_setting_takes_the_printed_value():
    """inference.without drops named rules from the chosen set, for the one-rule-out runs that test
    whether the long regime still needs a rule."""
    cfg = case_config()
    cfg.inference.without = ["error_margin", "information"]
    names = build(cfg).rule_names
    assert "information" not in names and "error_margin" not in names
    assert set(names) == set(RULE_SETS["vase"]) - {"information", "error_margin"}
    assert as_configured(cfg).inference.error_margin == 0.0  # eq. 6's kappa * L_s with no slack
    assert as_configured(case_config()).inference.error_margin == 25.0


def test_table1_names_own_capacity_ramp_where_its_ramp_acted():
    """A row is named "with own_capacity_ramp" where a new environment's target ramped: S on, the
    capacity objective, the rule in the run's set and a ramp of more than 0 steps. A results.json
    without `rule_names` was written while the vase set held the rule with a ramp on by default; one
    with `rule_names` but no recorded ramp, while vase did not have the rule."""
    older = {"ablation": "SDA", "rules": "vase", "capacity_form": "squared", "pending_batches_train": False,
             "sync_at_allocation": False, "rules_without": [], "dream_weights": [10.0, 1.0]}
    assert row_label(older) == "SDA (with own_capacity_ramp)"
    assert row_label({**older, "rules_without": ["own_capacity_ramp"]}) == "SDA"
    assert row_label({**older, "rules_without": ["own_capacity_ramp", "settling"]}) == "SDA (without settling)"
    assert row_label({**older, "rules": "paper"}) == "SDA (paper rules)"
    assert row_label({**older, "mode": "entangled"}) == "SDA"
    assert row_label({**older, "ablation": "DA"}) == "DA"
    assert row_label({**older, "rule_names": list(RULE_SETS["vase"])}) == "SDA"  # no ramp recorded
    today = {**older, "rule_names": list(RULE_SETS["vase"])}
    assert row_label({**today, "new_env_ramp_steps": 36000}) == "SDA (with own_capacity_ramp)"
    assert row_label({**today, "new_env_ramp_steps": 0}) == "SDA"  # the short and long schedules
    left_out = [name for name in RULE_SETS["vase"] if name != "own_capacity_ramp"]
    assert row_label({**today, "new_env_ramp_steps": 36000, "rule_names": left_out,
                      "rules_without": ["own_capacity_ramp"]}) == "SDA"
    assert row_label({**today, "new_env_ramp_steps": 36000, "ablation": "-"}) == "-"


def test_without_refuses_a_rule_the_set_does_not_have():
    with pytest.raises(ConfigError, match="does not have: information"):
        build_config("cpu", ["inference.rules=paper", "inference.without=information"]).validate()
    build_config("cpu", ["inference.without=information,settling"]).validate()


def test_table1_names_the_rules_a_run_left_out():
    today = {"ablation": "SDA", "rules": "vase", "capacity_form": "squared", "pending_batches_train": False,
             "sync_at_allocation": False, "rule_names": list(RULE_SETS["vase"]), "dream_weights": [10.0, 1.0]}
    assert row_label({**today, "rules_without": ["settling"]}) == "SDA (without settling)"
    assert row_label(today) == "SDA"
    # Eq. 3's gamma where it is not the default; a results.json without it ran at the default.
    assert row_label({**today, "gamma": 10.0}) == "SDA (γ 10)"
    assert row_label({**today, "gamma": 100.0}) == "SDA"
    assert row_label({**today, "mode": "entangled", "gamma": 10.0}) == "SDA"
    # C(t) on each environment's own clock (a setting since deleted) is named where S can make an
    # environment return.
    assert row_label({**today, "capacity_clock": "environment"}) == "SDA (C(t) on each environment's clock)"
    assert row_label({**today, "capacity_clock": "run"}) == "SDA"
    assert row_label({**today, "ablation": "DA", "capacity_clock": "environment"}) == "DA"
    assert row_label({**today, "mode": "entangled", "capacity_clock": "environment"}) == "SDA"
    assert row_label({**today, "return_ramp_steps": 200}) == "SDA (return ramp 200)"
    assert row_label({**today, "return_ramp_steps": 0}) == "SDA"
    # Eq. 7's dreams drawn from the snapshot's pixels are named where D is on.
    assert row_label({**today, "dream_images": "sample"}) == "SDA (sampled dreams)"
    assert row_label({**today, "dream_images": "mean"}) == "SDA"
    assert row_label({**today, "ablation": "SA", "dream_images": "sample"}) == "SA"
    # q_psi trained with balanced classes is named where S is on; a results.json without the field
    # predates the rule.
    assert row_label({**today, "balanced_classifier": True}) == "SDA (balanced classifier)"
    assert row_label({**today, "balanced_classifier": False}) == "SDA"
    assert row_label({**today, "ablation": "DA", "balanced_classifier": True}) == "DA"
    # The rule, since deleted, in a run's set with its setting off changed nothing.
    older = {**today, "rule_names": [*today["rule_names"], "balanced_classifier"]}
    assert row_label({**older, "balanced_classifier": False}) == "SDA"
    assert row_label({**older, "balanced_classifier": True}) == "SDA (balanced classifier)"
    # So is eq. 6's error read less the images' entropy (the rule `model_error`, since deleted).
    older = {**today, "rule_names": [*today["rule_names"], "model_error"]}
    assert row_label({**older, "error_less_entropy": True}) == "SDA (eq. 6 error less the images' entropy)"
    assert row_label({**older, "error_less_entropy": False}) == "SDA"
    assert row_label({**older, "ablation": "-", "error_less_entropy": True}) == "-"
    trained = {"ablation": "SDA", "pending_batches_train": True, "sync_at_allocation": False, "rule_names": [],
               "dream_weights": [10.0, 1.0]}
    assert row_label(trained) == "SDA (pending batches trained)"
    assert row_label({"ablation": "SDA"}) == (  # a results.json without the fields
        "SDA (with own_capacity_ramp, snapshot also synced at allocations, eq. 7 weights 1 / 1, "
        "pending batches trained)")
    assert row_label({**trained, "ablation": "DA"}) == "DA"  # without S nothing is pending
    assert row_label({**trained, "rules_without": ["frozen_while_pending"]}) == "SDA (without frozen_while_pending)"
    # Eq. 7's weights are named where they are not the defaults (encoder 10, decoder 1), and a
    # results.json without them was trained at eq. 8's 1 and 1.
    heavier = {**today, "dream_weights": [10.0, 10.0]}
    assert row_label(heavier) == "SDA (eq. 7 weights 10 / 10)"
    assert row_label({**heavier, "ablation": "SA"}) == "SA"  # without D there is no eq. 7
    assert row_label({**heavier, "dream_weights": [1.0, 1.0]}) == "SDA (eq. 7 weights 1 / 1)"
    assert row_label({key: value for key, value in today.items() if key != "dream_weights"}) == (
        "SDA (eq. 7 weights 1 / 1)")


# -- inference.counterfactuals: which rules changed a verdict -------------------------------------------
def counted(names, stream):
    """The rule activity after `stream` (errors per batch, from step 0) under the rule set `names`."""
    cfg = case_config()
    cfg.inference.counterfactuals = True
    inf = with_rules(names, cfg)
    for step, error in enumerate(stream):
        decide(inf, step, error)
    return {name: count["changed"] for name, count in inf.activity.items()}


def test_counterfactuals_count_the_batches_a_rule_decided_and_only_those():
    """kappa 1.5, margin 25: after a batch of 100 nats, 160 passes only with the margin (a batch
    the margin decided), 140 passes without it, and 1000 fails either way (then debouncing, patience
    3, decides two batches: without it the first failing batch allocates, with it the third does)."""
    names = ("debouncing", "frozen_while_pending", "error_margin")
    assert counted(names, [100.0, 140.0, 140.0]) == {"debouncing": 0, "error_margin": 0}
    assert counted(names, [100.0, 160.0, 140.0]) == {"debouncing": 0, "error_margin": 1}
    assert counted(names, [100.0, 1000.0, 1000.0, 1000.0]) == {"debouncing": 2, "error_margin": 0}
    assert counted(("hysteresis",), [100.0, 1000.0]) == {}  # not a verdict rule: not counted
    cfg = case_config()
    assert with_rules(names, cfg).activity == {}  # off by default


def test_counterfactuals_count_the_most_batches_in_a_row_a_rule_decided():
    """Kappa 1.5, margin 25, L_s the last batch's error: 160 after 100 and 250 after 160 pass only
    with the margin, 300 after 250 passes without it and ends the run, 460 after 300 passes only
    with the margin again."""
    cfg = case_config()
    cfg.inference.counterfactuals = True
    inf = with_rules(("debouncing", "frozen_while_pending", "error_margin"), cfg)
    thresholds = []
    for step, error in enumerate([100.0, 160.0, 250.0, 300.0, 460.0]):
        if step:
            thresholds.append(inf.cfg.kappa * inf.slots[0].error)
        assert decide(inf, step, error).verdict in ("first", "same")
    without_margin = [e > t for e, t in zip([160.0, 250.0, 300.0, 460.0], thresholds)]
    assert without_margin == [True, True, False, True]
    count = inf.activity["error_margin"]
    assert (count["changed"], count["longest"], count["longest_last_step"], count["in_a_row"]) == (3, 2, 2, 1)
    assert count["counted_from"] == 1 and inf.activity["debouncing"]["longest"] == 0


def test_a_count_without_runs_in_a_row_counts_them_from_its_resume():
    cfg = case_config()
    cfg.inference.counterfactuals = True
    inf = with_rules(("debouncing", "error_margin"), cfg)
    decide(inf, 0, 100.0)
    state = inf.state_dict()
    state["rule_activity"] = {"error_margin": {"changed": 7, "first_step": 3, "last_step": 9}}
    inf.load_state_dict(state)
    decide(inf, 10, 160.0)
    count = inf.activity["error_margin"]
    assert (count["changed"], count["first_step"], count["last_step"]) == (8, 3, 10)
    assert (count["longest"], count["counted_from"]) == (1, 10)


def test_counting_counterfactuals_changes_no_decision_and_no_state():
    stream = [100.0, 160.0, 1000.0, 1000.0, 1000.0, {0: 1000.0, 1: 90.0}, 140.0]
    runs = []
    for on in (False, True):
        cfg = case_config()
        cfg.inference.counterfactuals = on
        inf = with_rules(RULE_SETS["vase"], cfg)
        runs.append(([decide(inf, step, error).as_dict() for step, error in enumerate(stream)], inf))
    (off, inf_off), (on, inf_on) = runs
    assert off == on
    state_off, state_on = inf_off.state_dict(), inf_on.state_dict()
    assert state_off.pop("rule_activity") == {} and sum(c["changed"] for c in state_on.pop("rule_activity").values())
    assert str(state_off) == str(state_on)


def test_the_counts_resume_with_the_inference():
    cfg = case_config()
    cfg.inference.counterfactuals = True
    inf = with_rules(("debouncing", "error_margin"), cfg)
    for step, error in enumerate([100.0, 160.0, 1000.0]):
        decide(inf, step, error)
    resumed = with_rules(("debouncing", "error_margin"), cfg)
    resumed.load_state_dict(inf.state_dict())
    assert resumed.activity == inf.activity and resumed.activity["error_margin"]["first_step"] == 1


def test_the_summary_names_the_batches_each_rule_decided():
    from pathlib import Path

    from vase.summary import summary_text

    results = {"ablation": "SDA", "mode": "disentangled", "preset": "cpu", "steps": 1, "wall_time_s": 1.0,
               "environments_inferred": 1, "environments_true": 1, "inferred_vs_true": [],
               "rule_activity": {"debouncing": {"changed": 2, "first_step": 1, "last_step": 2},
                                 "error_margin": {"changed": 0, "first_step": None, "last_step": None}}}
    assert "debouncing 2 (steps 1-2), error_margin 0" in summary_text(results, Path("run"))
    results["rule_activity"]["debouncing"].update(longest=2, longest_last_step=2, counted_from=1)
    assert "debouncing 2 (steps 1-2, at most 2 in a row ending at step 2), error_margin 0" in summary_text(
        results, Path("run"))
    # resumed at step 5 from a count without the runs in a row, and none since
    results["rule_activity"]["debouncing"].update(longest=0, longest_last_step=None, counted_from=5)
    assert "debouncing 2 (steps 1-2, at most 0 in a row since step 5)" in summary_text(results, Path("run"))
    results["rule_activity"] = {}  # off
    assert "decided" not in summary_text(results, Path("run"))
