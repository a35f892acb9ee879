"""S: environment inference (eq. 6), and its stand-in when S is off.

The learner is never told which environment a batch comes from. For each batch it asks the
auxiliary classifier q_psi for the most likely past environment s_hat, then accepts s_hat only if
  (a) the batch reconstructs under s_hat with error <= kappa * L_s_hat, and
  (b) the batch's own mask a(x) agrees with a^s_hat on the latents either of them uses;
otherwise it allocates a new environment. `EnvironmentInference` runs exactly that, and calls the
hooks of the rule set `inference.rules` at defined points (`vase.rules`, docs/method.md). With S
off, `SingleEnvironment` puts every batch in environment 0.

The per-environment state (a^s, its smoothed alpha, L_s, latent usage) is one record per slot
(`vase.slots`); the masks are applied and updated by A or its stand-in (`vase.masking`).
"""
from __future__ import annotations

import copy
import warnings
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch
from torch.nn import functional as F

from vase import rules
from vase.config import Config
from vase.evidence import Evidence, Tests
from vase.masking import AllOnes, Masks, start_mask
from vase.rules import MASK, RECONSTRUCTION
from vase.slots import Slots


@dataclass
class Decision:
    step: int
    env: int  # the environment this batch is trained under
    predicted: int  # s_hat from the classifier
    verdict: str  # "first", "same", "switch", "pending", "new" or "full"
    reasons: list[str] = field(default_factory=list)  # the tests of eq. 6 that s_hat failed
    error: float = float("nan")  # reconstruction error under s_hat
    threshold: float = float("nan")  # kappa * L_s_hat (plus the error margin)
    disagreeing: list[int] = field(default_factory=list)  # latents whose mask test failed there

    def as_dict(self) -> dict:
        return asdict(self)

    @property
    def allocated(self) -> bool:
        return self.verdict in ("first", "new")

    @property
    def is_event(self) -> bool:
        """A verdict that changes the environment trained (an allocation or a switch back to a past
        one) or refuses a slot: what results.json and TensorBoard list as inference events."""
        return self.verdict in ("first", "switch", "new", "full")


def fresh_activity() -> dict:
    """One rule's counterfactual count (inference.counterfactuals): the batches the set without it
    decided otherwise, their first and last step, and the longest run of them in a row, counted
    from `counted_from` (a run resumed from a count without it counts from the resume)."""
    return {"changed": 0, "first_step": None, "last_step": None,
            "in_a_row": 0, "longest": 0, "longest_last_step": None, "counted_from": None}


class EnvironmentInference:
    """S on: eq. 6 over the environments allocated so far, with the hooks of its rule set.

    `cfg` is the run's config as the rule set reads it (`vase.rules.as_configured`); q_psi and its
    optimiser belong to the learner, which checkpoints them.
    """

    with_s = True

    def __init__(self, cfg: Config, slots: Slots, masking: Masks | AllOnes,
                 classifier: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None):
        self.cfg, self.mask_cfg = cfg.inference, cfg.mask
        self.rule_names = rules.chosen(cfg)
        self.rules = rules.build(self.rule_names, self.with_s)
        self.hooks = rules.hooks(self.rules)
        self.marks_learnt = any(rule.marks_learnt for rule in self.rules)
        self.slots, self.masking, self.device = slots, masking, slots.device
        self.classifier, self.optimizer = classifier, optimizer
        self.k_max = len(slots)
        self.n_envs = 0
        self.current = 0
        self.pending = 0  # consecutive batches that failed eq. 6's tests
        self.full_warned = False
        # inference.counterfactuals: per rule acting on the verdict alone, the set without it (its
        # hooks and its settings as printed), and the batches on which that set decided otherwise.
        self.shadows = {name: self.without(cfg, name) for name in rules.VERDICT_RULES
                        if self.cfg.counterfactuals and self.with_s and name in self.rule_names}
        self.activity = {name: fresh_activity() for name in self.shadows}

    def without(self, cfg: Config, name: str):
        """The hooks and inference settings of this rule set less the rule `name`."""
        cut = copy.deepcopy(cfg)
        cut.inference.without = [*cut.inference.without, name]
        return rules.hooks([r for r in self.rules if r.name != name]), rules.as_configured(cut).inference

    @contextmanager
    def viewed_as(self, hooks: dict, cfg):
        """Judge with other hooks and settings for a while; the state is read, never written."""
        saved = self.hooks, self.cfg
        self.hooks, self.cfg = hooks, cfg
        try:
            yield
        finally:
            self.hooks, self.cfg = saved

    def rule(self, name: str) -> rules.Rule | None:
        """The rule of this set called `name`, if it acts here."""
        return next((r for r in self.rules if r.name == name), None)

    # -- q_psi -------------------------------------------------------------------------------------
    def classify(self, hidden: torch.Tensor, batch: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """q_psi's logits on the encoder features of [x; x'], and s's probabilities averaged over the
        real batch (docs/method.md, networks)."""
        logits = self.classifier(hidden)
        return logits, F.softmax(logits[:batch].detach(), dim=1).mean(0)

    def train_classifier(self, logits: torch.Tensor, env: int, batch: int, dreams,
                         learn: bool = True) -> dict[str, torch.Tensor]:
        """q_psi: cross-entropy on the real batch (inferred label) and on dreams (their label); the
        step is taken only where the batch learns (`learns`)."""
        labels = torch.full((batch,), env, dtype=torch.long, device=self.device)
        if dreams is not None:
            labels = torch.cat([labels, dreams.env])
        loss = F.cross_entropy(logits, labels)
        if learn:
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
        return {"classifier": loss.detach()}

    def learns(self, decision: Decision) -> bool:
        """Whether this batch moves the weights (the rule set may hold a pending batch out)."""
        return all(hook(self, decision) for hook in self.hooks["learns"])

    @torch.no_grad()
    def slot_of(self, x: torch.Tensor, encoder: torch.nn.Module) -> int:
        """The slot the classifier would pick for x; evaluation only, no decision."""
        if self.n_envs == 0:
            return 0
        return most_likely_slot(self.classifier, encoder(x).hidden, self.n_envs)

    # -- queries ----------------------------------------------------------------------------------
    def past_environments(self) -> list[int]:
        return [s for s in range(self.n_envs) if s != self.current]

    def dream_environments(self) -> list[int]:
        """The environments dreams are drawn from (eq. 7): the past ones."""
        return self.past_environments()

    def mask(self, env: int) -> torch.Tensor:
        """a^env as applied to the batches of env (all ones with A off)."""
        return self.masking.applied(self.slots[env])

    def reading(self, kl: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
        """A batch's per-latent use as this rule set reads it, from its mean KL and alpha (eq. 4)."""
        usage = kl
        for hook in self.hooks["reading"]:
            usage = hook(kl, alpha, usage)
        return usage

    def used(self, env: int) -> torch.Tensor:
        """Latents env uses: its running usage above used_kl."""
        return self.slots[env].usage > self.cfg.used_kl

    def usage_elsewhere(self, env: int) -> torch.Tensor:
        """Per latent, the largest running usage among the recorded environments other than `env`
        (-inf where there is none)."""
        others = [s for s in range(self.n_envs) if s != env and self.slots[s].recorded]
        if not others:
            return torch.full(self.slots[env].usage.shape, float("-inf"), device=self.device)
        return torch.stack([self.slots[s].usage for s in others]).max(0).values

    def maskable(self, env: int) -> torch.Tensor:
        """Latents a^env may switch off."""
        latents = torch.ones(self.slots[env].mask.shape, dtype=torch.bool, device=self.device)
        for hook in self.hooks["maskable"]:
            latents = hook(self, env, latents)
        return latents

    def predict(self, probs: torch.Tensor) -> int:
        """s_hat = argmax of the batch-averaged q_psi(s|x) over the allocated slots (evaluation; a
        training step reads it with eq. 6's tests, `vase.evidence`)."""
        return int(probs[: self.n_envs].argmax())

    def threshold(self, slot_error: float) -> float:
        """kappa * L_s (eq. 6) for L_s = `slot_error`, plus `inference.error_margin` (`vase.rules.ErrorMargin`)."""
        return self.cfg.kappa * slot_error + self.cfg.error_margin

    def mask_scope(self, env: int, alpha: torch.Tensor, usage: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The latents eq. 6's mask test reads: those env or the batch uses."""
        either = self.used(env) | (usage > self.cfg.used_kl)
        scope = (either, either)
        for hook in self.hooks["mask_scope"]:
            scope = hook(self, env, alpha, usage, scope)
        return scope

    def failures(self, tests: Tests) -> tuple[list[str], list[int]]:
        """Which tests of eq. 6 a batch fails against a slot (none: it passes), from the batch's
        `tests` there (`vase.evidence`), and the latents on which the mask test failed."""
        reasons = [RECONSTRUCTION] if tests.error > self.threshold(tests.slot_error) else []
        latents = list(tests.disagreeing or ())
        if latents:
            reasons.append(MASK)
        return reasons, latents

    # -- the decision -----------------------------------------------------------------------------
    def judge(self, step: int, evidence: Evidence):
        """Eq. 6 on one batch, reading the state and writing none of it: (verdict, env, and s_hat's
        (reasons, error, threshold, latents), or None for a batch left unjudged)."""
        if any(hook(self, step) for hook in self.hooks["unjudged"]):
            return "same", self.current, None
        predicted = evidence.predicted()
        tests = evidence.tests(predicted)
        reasons, latents = self.failures(tests)
        tested = (reasons, tests.error, self.threshold(tests.slot_error), latents)
        if not reasons:
            return ("same" if predicted == self.current else "switch"), predicted, tested
        if self.pending + 1 < self.cfg.patience:
            return "pending", self.current, tested
        if self.n_envs >= self.k_max:
            return "full", self.current, tested
        return "new", self.n_envs, tested

    def count_counterfactuals(self, step: int, verdict: str, env: int, evidence: Evidence) -> None:
        """inference.counterfactuals: the batches on which the set without a rule decides otherwise,
        and the most of them in a row. The set without a rule reads this run's pending count, so a
        batch it would fail is "pending" there; `patience` of them in a row would have allocated a
        slot in the run without it (debouncing, docs/method.md)."""
        for name, (hooks, cfg) in self.shadows.items():
            with self.viewed_as(hooks, cfg):
                other = self.judge(step, evidence)[:2]
            count = self.activity[name]
            if count["counted_from"] is None:
                count["counted_from"] = step
            if other == (verdict, env):
                count["in_a_row"] = 0
                continue
            count["changed"] += 1
            count["first_step"] = step if count["first_step"] is None else count["first_step"]
            count["last_step"] = step
            count["in_a_row"] += 1
            if count["in_a_row"] > count["longest"]:
                count["longest"], count["longest_last_step"] = count["in_a_row"], step

    def infer(self, step: int, probs: torch.Tensor, alpha: torch.Tensor, usage: torch.Tensor,
              error_under: Callable[[int], torch.Tensor | float]) -> Decision:
        """Decide the environment of one batch (eq. 6) from q_psi's `probs`, its atypicality and
        per-latent use (`reading`). `error_under(s)` reconstructs it under s: its mean error, a 0-d
        tensor read with the rest of eq. 6's evidence (`vase.evidence`), or a float."""
        if self.n_envs == 0:
            return self.allocate(step, 0, "first", [])
        evidence = Evidence(self, probs, alpha, usage, error_under)
        verdict, env, tested = self.judge(step, evidence)
        if self.shadows:
            self.count_counterfactuals(step, verdict, env, evidence)
        predicted = evidence.predicted()
        if tested is None:  # unjudged
            self.pending = 0
            return Decision(step, self.current, predicted, "same")
        if verdict in ("same", "switch"):
            self.current, self.pending = env, 0
            return Decision(step, env, predicted, verdict, *tested)
        self.pending += 1
        if verdict == "pending":
            return Decision(step, self.current, predicted, "pending", *tested)
        if verdict == "full":
            if not self.full_warned:
                warnings.warn(
                    f"step {step}: the stream looks like a new environment but all {self.k_max} slots "
                    f"(model.k_max) are used; training continues in environment {self.current}",
                    stacklevel=2,
                )
                self.full_warned = True
            self.pending = 0
            return Decision(step, self.current, predicted, "full", *tested)
        decision = self.allocate(step, self.n_envs, "new", tested[0])
        decision.predicted, decision.error, decision.threshold = predicted, tested[1], tested[2]
        decision.disagreeing = tested[3]
        return decision

    def allocate(self, step: int, env: int, verdict: str, reasons: list[str]) -> Decision:
        self.n_envs, self.current, self.pending = env + 1, env, 0
        self.slots[env].recorded = False
        for hook in self.hooks["allocated"]:
            hook(self, env, step)
        return Decision(step, env, env, verdict, reasons)

    # -- the bookkeeping of eq. 5-6 -----------------------------------------------------------------
    def start(self, env: int, alpha: torch.Tensor, maskable: torch.Tensor) -> None:
        """A newly allocated environment's mask starts from its first batch (eq. 5)."""
        start_mask(self.slots[env], alpha, maskable, self.mask_cfg)

    def bookkeeping(self, decision: Decision, error: torch.Tensor, usage: torch.Tensor, alpha: torch.Tensor,
                    mask: torch.Tensor, maskable: torch.Tensor) -> None:
        """Fold a trained batch into its slot: L_s and the latent use of s (masked latents are prior
        noise, eq. 2, and carry nothing for s), then eq. 5's mask a^s, which was `mask` in the step."""
        if not all(hook(decision) for hook in self.hooks["records"]):
            return
        env = decision.env
        slot = self.slots[env]
        slot.record(error, torch.where(mask.bool(), usage, 0.0), self.cfg.error_ema)
        used = self.used(env) if self.marks_learnt else None
        self.masking.update(slot, alpha, maskable, used)

    # -- checkpointing ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        state = {"n_envs": self.n_envs, "current": self.current, "pending": self.pending,
                 "full_warned": self.full_warned, "slots": self.slots.state_dict(),
                 "rule_activity": copy.deepcopy(self.activity)}
        for rule in self.rules:
            state.update(rule.state_dict())
        return state

    def load_state_dict(self, d: dict) -> None:
        """`d` as `state_dict` writes it; `vase.slots.from_split_layout` converts older checkpoints."""
        self.n_envs, self.current = int(d["n_envs"]), int(d["current"])
        self.pending, self.full_warned = int(d["pending"]), bool(d["full_warned"])
        self.slots.load_state_dict(d["slots"])
        for name, count in d.get("rule_activity", {}).items():  # absent before inference.counterfactuals
            if name in self.activity:
                # a count without the runs in a row counts them from this resume on
                self.activity[name] = {**fresh_activity(), **count}
        for rule in self.rules:
            rule.load_state_dict(d, self.device)


class SingleEnvironment(EnvironmentInference):
    """S off (Table 1's rows without S): every batch is environment 0, with no classifier. The
    slot's statistics and mask are kept as with S, under the rules that act with one slot."""

    with_s = False

    def classify(self, hidden: torch.Tensor, batch: int) -> tuple[None, None]:
        return None, None

    def train_classifier(self, logits, env: int, batch: int, dreams, learn: bool = True) -> dict:
        return {}

    def slot_of(self, x: torch.Tensor, encoder: torch.nn.Module) -> int:
        return 0

    def dream_environments(self) -> list[int]:
        """Environment 0 as the (tau-steps old) snapshot remembers it, once it exists."""
        return list(range(self.n_envs))

    def infer(self, step: int, probs, alpha: torch.Tensor, usage: torch.Tensor, error_under) -> Decision:
        if self.n_envs == 0:
            return self.allocate(step, 0, "first", [])
        return Decision(step, 0, 0, "same")


def most_likely_slot(classifier: torch.nn.Module, hidden: torch.Tensor, n_envs: int) -> int:
    """s_hat for a chunk of images: the argmax, over the n_envs allocated slots, of q_psi(s|x)
    averaged over the chunk (eq. 6's prediction, as `EnvironmentInference.predict` reads it)."""
    return int(F.softmax(classifier(hidden), dim=1).mean(0)[:n_envs].argmax())


def build(cfg: Config, device: torch.device | str = "cpu", classifier: torch.nn.Module | None = None,
          optimizer: torch.optim.Optimizer | None = None) -> EnvironmentInference:
    """S and A as cfg switches them, under its rule set: eq. 6 or one environment, with slots of
    cfg.model.latents latents, and masks applied or all ones."""
    cfg = rules.as_configured(cfg)
    slots = Slots(cfg.model.k_max, cfg.model.latents, device)
    masking = Masks(cfg.mask) if cfg.mask.enabled else AllOnes()
    kind = EnvironmentInference if cfg.inference.enabled else SingleEnvironment
    return kind(cfg, slots, masking, classifier, optimizer)
