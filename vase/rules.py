"""Every addition to eq. 3-6, one named rule each, and the rule sets made of them (docs/method.md,
"Rules beyond eq. 6").

A rule set is a list of rule names, chosen with `inference.rules`. `paper` is eq. 6 as written, with
the spec's debouncing and eq. 5's hysteresis on a smoothed alpha; `vase` has every rule. The
inference (`vase.inference.EnvironmentInference`) runs eq. 3-6 as printed and calls the rules'
hooks at defined points (`Rule`). A rule acts in one of two ways:
- through hooks, for a rule that changes what eq. 6 decides or what a slot records;
- through settings it owns (`as_printed`): left out of the set, each takes the value that gives
  the printed equation (`as_configured`), e.g. `inference.error_margin` 0 for kappa * L_s alone.
  The objective's additions to eq. 3 ([ours] terms, `vase.objective.mdl_loss` and
  `environment_capacity`) are rules of this kind.
"""
from __future__ import annotations

import copy
from typing import TYPE_CHECKING, ClassVar

import torch

from vase import config
from vase.masking import information

if TYPE_CHECKING:
    from vase.inference import Decision, EnvironmentInference

# The tests of eq. 6 a candidate environment can fail, as `Decision.reasons` names them.
RECONSTRUCTION, MASK = "reconstruction", "mask"


class Rule:
    """A named addition to eq. 3-6. Each hook below is the printed equations' behaviour; a rule
    overrides the hooks it changes, and the inference calls only those, in the set's order."""

    name: ClassVar[str]
    settings: ClassVar[tuple[str, ...]] = ()  # the config fields the rule reads or owns
    as_printed: ClassVar[dict] = {}  # setting -> its value in eq. 3-6 as printed (or a function of the config)
    with_s: ClassVar[bool | None] = None  # True: only with S on; False: only with S off (one slot)
    marks_learnt: ClassVar[bool] = False  # the slot's mask update records its learnt latents

    def reading(self, kl: torch.Tensor, alpha: torch.Tensor, usage: torch.Tensor) -> torch.Tensor:
        """A batch's per-latent use, from its mean KL and atypicality (eq. 4); printed: the KL."""
        return usage

    def unjudged(self, inf: EnvironmentInference, step: int) -> bool:
        """True: the batch trains in the current environment without being judged."""
        return False

    def mask_scope(self, inf: EnvironmentInference, env: int, alpha: torch.Tensor, usage: torch.Tensor,
                   scope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The latents the mask test reads, (switched off by the batch, switched on by the batch);
        printed: the latents env or the batch uses, for both."""
        return scope

    def allocated(self, inf: EnvironmentInference, env: int, step: int) -> None:
        """A new environment env has been allocated."""

    def records(self, decision: Decision) -> bool:
        """False: this batch trains but does not move the statistics of its slot."""
        return True

    def learns(self, inf: EnvironmentInference, decision: Decision) -> bool:
        """False: this batch moves no weights (neither the model's nor q_psi's); printed: it does."""
        return True

    def maskable(self, inf: EnvironmentInference, env: int, latents: torch.Tensor) -> torch.Tensor:
        """Latents a^env may switch off; printed (eq. 5): every latent."""
        return latents

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, d: dict, device: torch.device) -> None:
        """Reads the rule's own keys of the inference's state dict."""


# -- in both sets ------------------------------------------------------------------------------------
class Debouncing(Rule):
    """A "new" verdict must hold on `patience` consecutive batches before a slot is allocated;
    without it the first failing batch allocates. No failure measured: the spec's rationale (eq. 6's
    debouncing), that a single batch is a noisy witness. Setting: `inference.patience`."""

    name = "debouncing"
    settings = ("inference.patience",)
    as_printed = {"inference.patience": 1}


class FrozenWhilePending(Rule):
    """A batch whose "new" verdict is pending moves nothing of the current slot: neither its
    statistics (L_s, usage, mask) nor any weight (the model's, q_psi's, Adam's moments); its losses
    are still logged. Fixes: a new environment's pending batches, most often its first, moved the
    old slot's L_s, and trained the old slot's decoder on the new data, which the snapshot synced
    at the allocation then kept (docs/regime.md, "The pending batches at an arrival"). Setting:
    none."""

    name = "frozen_while_pending"

    def records(self, decision: Decision) -> bool:
        return decision.verdict != "pending"

    def learns(self, inf: EnvironmentInference, decision: Decision) -> bool:
        return decision.verdict != "pending"


class Hysteresis(Rule):
    """Eq. 5 with two thresholds: a latent turns off above lambda_high, on below lambda_low, and
    keeps its state in between; without it lambda_low = lambda_high, eq. 5's single lambda. Fixes:
    alpha on one batch is noisy, and a single threshold flipped latents back and forth
    (docs/method.md). Settings: `mask.lambda_low`, `mask.lambda_high`."""

    name = "hysteresis"
    settings = ("mask.lambda_low", "mask.lambda_high")
    as_printed = {"mask.lambda_low": lambda cfg: cfg.mask.lambda_high}


class SmoothedAtypicality(Rule):
    """Eq. 5 reads alpha averaged over recent batches (an EMA) instead of one batch's. Fixes: alpha on
    one batch of 64 fluctuates by about ±0.3, as much as the gap between a settled latent and
    lambda_low (docs/method.md, "Mask (A)"). Setting: `mask.ema`."""

    name = "smoothed_atypicality"
    settings = ("mask.ema",)
    as_printed = {"mask.ema": 0.0}


# -- the `vase` set --------------------------------------------------------------------------------------
class Settling(Rule):
    """A new environment trains unjudged for `cooldown` steps. Fixes: a slot's L_s, usage and mask
    rest on a handful of batches; judged against them every batch failed and allocations chained
    (slots 1-6 at steps 3509, 3519, ..., 3559 with `paper`). Setting: `inference.cooldown`."""

    name = "settling"
    settings = ("inference.cooldown",)

    def __init__(self):
        self.since = -(10**9)  # the step of the last allocation

    def allocated(self, inf, env, step):
        self.since = step

    def unjudged(self, inf, step):
        return step - self.since < inf.cfg.cooldown

    def state_dict(self):
        return {"settling_since": self.since}

    def load_state_dict(self, d, device):
        self.since = int(d["settling_since"])


class Information(Rule):
    """Latent use is read as information, KL minus alpha (`vase.masking.information`), not KL.
    Fixes: latents shifted or narrowed alike for every image cost KL, counted as used, and failed the
    mask test. Setting: none."""

    name = "information"

    def reading(self, kl, alpha, usage):
        return information(kl, alpha)


class ErrorMargin(Rule):
    """The reconstruction threshold is kappa * L_s + margin. Fixes: static sprites are learnt to under
    1 nat, and kappa * L_s alone is batch noise: on the long sprite run without it, shapes B (0.04
    nats under its slot) was split into a second slot inside its own stage (docs/regime.md). Setting:
    `inference.error_margin`."""

    name = "error_margin"
    settings = ("inference.error_margin",)
    as_printed = {"inference.error_margin": 0.0}


class SettledMasks(Rule):
    """The mask test reads only latents whose smoothed alpha in env is clearly on one side of the
    hysteresis band: one env relies on and has settled on (alpha below lambda_low) that turns
    atypical on the batch, or one env has settled off (above lambda_high) that is typical and
    informative on the batch. Fixes: a latent being learnt (or returning to the prior) is atypical for
    a while and flipped verdicts. Settings: `mask.lambda_low`, `mask.lambda_high`."""

    name = "settled_masks"
    settings = ("mask.lambda_low", "mask.lambda_high")

    def mask_scope(self, inf, env, alpha, usage, scope):
        smoothed, cfg = inf.slots[env].alpha, inf.mask_cfg
        settled_on, settled_off = smoothed < cfg.lambda_low, smoothed > cfg.lambda_high
        return settled_on & inf.used(env), settled_off & (usage > inf.cfg.used_kl)


class OthersLatentsOnly(Rule):
    """A slot may mask only latents other slots use. Fixes: literal eq. 5 masked latents while they
    were being learnt (masked latents get no gradient, so they stay atypical); the A and DA rows
    closed all 24 latents, and so did MNIST's slot in SDA on the long schedule (docs/regime.md).
    Setting: none."""

    name = "others_latents_only"
    with_s = True

    def maskable(self, inf, env, latents):
        return inf.usage_elsewhere(env) > inf.cfg.used_kl


class LearntLatentsOnly(Rule):
    """With S off (one slot), only latents the slot has used while settled (alpha below lambda_low)
    may be masked. Fixes: the same as `others_latents_only`, in the rows without S; on the long
    schedule without it, the A row's slot closed all 24 latents at MNIST's arrival (docs/regime.md).
    Setting: none."""

    name = "learnt_latents_only"
    with_s = False
    marks_learnt = True

    def maskable(self, inf, env, latents):
        return inf.slots[env].learnt.clone()


# -- the objective's additions to eq. 3 (read by `vase.objective`) -------------------------------------------
class FreshLatentPenalty(Rule):
    """In a new environment, gamma times the atypicality of its fresh latents (unmasked, used by no
    other slot) is added to eq. 3, so filler KL earns nothing (`vase.objective.mdl_loss`). Fixes: a
    new slot met its capacity with KL that carries no information, in latents neither spare nor
    informative. Setting: `objective.fresh_aggregate_weight`."""

    name = "fresh_latent_penalty"
    settings = ("objective.fresh_aggregate_weight",)
    as_printed = {"objective.fresh_aggregate_weight": 0.0}


class OwnCapacityRamp(Rule):
    """A new environment's capacity target climbs from the KL it carries when allocated, at
    `new_env_ramp_steps` pace, never above C(t) (`vase.objective.environment_capacity`). Fixes: at
    the extended schedule, MNIST's new slot, its known latents masked, met C(t) = 25 nats at once,
    and the pull on the shared encoder cost moving Fashion 19 points of identity in 2,000 steps
    against 12 in "-" (docs/regime.md). Setting: `objective.new_env_ramp_steps` (0 in the short
    and long schedules, where the runs without it kept every end figure we judge by)."""

    name = "own_capacity_ramp"
    settings = ("objective.new_env_ramp_steps",)
    as_printed = {"objective.new_env_ramp_steps": 0}


RULES: dict[str, type[Rule]] = {rule.name: rule for rule in (
    Debouncing, FrozenWhilePending, Hysteresis, SmoothedAtypicality,
    Settling, Information, ErrorMargin, SettledMasks,
    OthersLatentsOnly, LearntLatentsOnly, FreshLatentPenalty, OwnCapacityRamp,
)}
RULE_SETS: dict[str, tuple[str, ...]] = {
    "vase": tuple(RULES),
    "paper": ("debouncing", "frozen_while_pending", "hysteresis", "smoothed_atypicality"),
}
# The rules that act on a batch's verdict and on nothing else: for them, a run in which leaving one
# out changes no verdict is the run without it (`inference.counterfactuals`).
VERDICT_RULES = ("debouncing", "settling", "error_margin", "settled_masks")
HOOKS = ("reading", "unjudged", "mask_scope", "allocated", "records", "learns", "maskable")


def build(names: tuple[str, ...], with_s: bool) -> list[Rule]:
    """The rules named, in order, that act with S on (`with_s`) or off."""
    return [RULES[name]() for name in names if RULES[name].with_s in (None, with_s)]


def hooks(rules: list[Rule]) -> dict[str, list]:
    """Per hook, the bound methods of the rules that override it, in the set's order."""
    return {hook: [getattr(r, hook) for r in rules if getattr(type(r), hook) is not getattr(Rule, hook)]
            for hook in HOOKS}


def chosen(cfg: config.Config) -> tuple[str, ...]:
    """The rules a run uses: its set (`inference.rules`) less those it leaves out (`inference.without`)."""
    return tuple(name for name in RULE_SETS[cfg.inference.rules] if name not in cfg.inference.without)


def as_configured(cfg: config.Config) -> config.Config:
    """A copy of cfg as eq. 3-6 read it under its rule set: a setting owned by a rule left out of the
    set takes its value in the printed equations. The input is not changed."""
    out = copy.deepcopy(cfg)
    names = chosen(cfg)
    for rule in RULES.values():
        if rule.name in names:
            continue
        for key, value in rule.as_printed.items():
            section, name = key.split(".")
            setattr(getattr(out, section), name, value(cfg) if callable(value) else value)
    return out
