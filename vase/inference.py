"""S: environment inference (eq. 6).

The learner is never told which environment a batch comes from. For each batch it asks the
auxiliary classifier for the most likely past environment s_hat, then accepts s_hat only if
  (a) the batch reconstructs under s_hat with error <= kappa * L_s_hat, and
  (b) the batch's own mask a(x) agrees with a^s_hat on the latents either of them uses;
otherwise it allocates a new environment.

Our additions [ours] that make this usable on a real stream, each a named setting or a few lines:
- The current environment is tested first, and s_hat only when it fails. Right after an
  allocation the classifier has not learnt the new slot yet and keeps predicting the old one;
  one batch of the new environment that slips through the old environment's test would then be
  trained under the old slot, move its statistics, and the old slot would absorb the new data.
- A "new" verdict must hold on `patience` consecutive batches (a single batch is a noisy witness).
  While a verdict is pending the batch is trained under the current environment, but that
  environment's statistics (L_s, usage, mask) are not updated with it.
- For `cooldown` steps after an allocation the new environment trains unjudged, so that its
  statistics settle first. A change of the current environment's own mask re-opens that settling
  period: L_s was measured with the old mask, and the decoder input has just changed.
- When both the current environment and s_hat fail, the other past environments are tried in the
  order of q_psi(s|x) before a new one is allocated. This costs extra decodes only on failing
  batches (a handful at each boundary), and makes re-identification robust to a classifier that
  has drifted towards the newest environment. A past environment must also agree in latent usage
  (`foreign_latents`).
- Latent usage is read as information, KL minus atypicality (`vase.masking.information`), not as
  KL: a latent whose mean is merely shifted costs KL but encodes no factor.
- A switch back into a past environment is on probation for `cooldown` steps: if the stream leaves
  that environment again within them, the batches trained there were not its data, and its
  statistics (L_s, usage, mask) are restored to what they were before the switch.
"""
from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from vase.config import InferenceConfig
from vase.masking import LatentMasks, information

RECONSTRUCTION = "reconstruction"
MASK = "mask"
USAGE = "usage"


@dataclass
class Decision:
    step: int
    env: int  # the environment this batch is trained under
    predicted: int  # s_hat from the classifier
    verdict: str  # "first", "same", "switch", "pending", "new" or "full"
    reasons: list[str] = field(default_factory=list)  # why the candidates failed
    error: float = float("nan")  # reconstruction error under the first candidate
    threshold: float = float("nan")  # kappa * L for that candidate
    disagreeing: list[int] = field(default_factory=list)  # latents whose mask (or usage) test failed there
    tried: list = field(default_factory=list)  # [candidate, its failed tests] for every env tried
    restored: int | None = None  # a past environment left while on probation: its statistics rolled back

    def as_dict(self) -> dict:
        return asdict(self)

    @property
    def allocated(self) -> bool:
        return self.verdict in ("first", "new")


@dataclass
class Probation:
    """A past environment just switched back into, and its statistics from before the switch [ours]."""

    env: int
    since: int  # the step of the switch
    error: torch.Tensor  # L_env
    usage: torch.Tensor
    recorded: bool
    mask: dict  # `LatentMasks.row(env)`


class EnvironmentInference:
    """State of eq. 6: environments allocated so far, their running errors L_s and latent usage."""

    def __init__(self, cfg: InferenceConfig, k_max: int, latents: int, use_masks: bool,
                 device: torch.device | str = "cpu"):
        self.cfg = cfg
        self.device = torch.device(device)
        self.k_max = k_max
        self.use_masks = use_masks
        self.n_envs = 0
        self.current = 0
        self.errors = torch.zeros(k_max, device=device)  # L_s
        self.usage = torch.zeros(k_max, latents, device=device)  # running per-latent information while training in s
        self.recorded = torch.zeros(k_max, dtype=torch.bool)  # host-side: read by `if`s
        self.pending = 0
        self.settling_since = -(10**9)  # step of the last allocation or mask change of `current`
        self.full_warned = False
        self.probation: Probation | None = None

    # Latent usage is read as information, KL minus atypicality [ours]: see `vase.masking.information`.
    reading = staticmethod(information)

    # -- queries ----------------------------------------------------------------------------------
    def past_environments(self) -> list[int]:
        return [s for s in range(self.n_envs) if s != self.current]

    def usage_elsewhere(self, env: int) -> torch.Tensor:
        """Per latent, the largest running usage among the recorded environments other than `env`
        (-inf where there is none)."""
        others = [s for s in range(self.n_envs) if s != env and bool(self.recorded[s])]
        if not others:
            return torch.full((self.usage.shape[1],), float("-inf"), device=self.device)
        return self.usage[others].max(0).values

    def used(self, env: int) -> torch.Tensor:
        """Latents env uses: its running usage (information per latent) above used_kl."""
        return self.usage[env] > self.cfg.used_kl

    def relied_on(self, env: int) -> torch.Tensor:
        """Latents whose turning atypical counts against env in the mask test: the ones it uses, or,
        on probation after a switch back (with `probation_relies_on_past_usage`), the ones it used
        before the switch [ours]. A latent env starts using during the visit has a smoothed alpha
        from before env left, so "settled" would be read from stale evidence."""
        p = self.probation
        past = self.cfg.probation_relies_on_past_usage and p is not None and p.env == env
        return (p.usage if past else self.usage[env]) > self.cfg.used_kl

    def maskable(self, env: int) -> torch.Tensor:
        """Latents that environments other than `env` use: the only ones `env` may mask [ours]."""
        return self.usage_elsewhere(env) > self.cfg.used_kl

    def predict(self, probs: torch.Tensor) -> int:
        """s_hat = argmax of the batch-averaged q_psi(s|x) over the allocated slots (docs/method.md, networks)."""
        return int(probs[: self.n_envs].argmax())

    def threshold(self, env: int) -> float:
        """kappa * L_s (eq. 6) plus an additive margin [ours]."""
        return self.cfg.kappa * float(self.errors[env]) + self.cfg.error_margin

    def failures(
        self, env: int, error: float, alpha: torch.Tensor, information: torch.Tensor, masks: LatentMasks
    ) -> tuple[list[str], list[int]]:
        """Which conditions of eq. 6 the batch fails for candidate `env` (none: it passes), and the
        latents on which the mask test failed."""
        reasons, latents = [], []
        if error > self.threshold(env):
            reasons.append(RECONSTRUCTION)
        if self.use_masks:
            latents = self.mask_disagreement(env, alpha, information, masks).nonzero().flatten().tolist()
            if latents:
                reasons.append(MASK)
        if env != self.current:
            foreign = self.foreign_latents(env, information).nonzero().flatten().tolist()
            if foreign:
                reasons.append(USAGE)
                latents = sorted(set(latents) | set(foreign))
        return reasons, latents

    def foreign_latents(self, env: int, information: torch.Tensor) -> torch.Tensor:
        """Latents that make a batch foreign to the past environment `env` [ours]: env does not
        use them, another environment relies on them, and this batch carries at least
        `foreign_use` times that environment's usage in them. The batch expresses a factor env
        never had.

        Eq. 6 compares masks on the latents either environment uses. A latent env never used is
        unmasked in a^env (spare capacity, alpha ~ 0), so the mask test cannot see it. Two moving
        datasets that share the position latents then pass each other's tests. For example,
        moving MNIST costs fewer nats per image than moving Fashion and fits under Fashion's
        reconstruction threshold. Applied to past environments only: the current one may start
        using a new latent at any time as C(t) grows.
        """
        relied = self.usage_elsewhere(env)
        return ~self.used(env) & (relied > self.cfg.relied_kl) & (information > self.cfg.foreign_use * relied)

    def mask_disagreement(
        self, env: int, alpha: torch.Tensor, information: torch.Tensor, masks: LatentMasks
    ) -> torch.Tensor:
        """Latents on which the batch's own mask a(x) contradicts a^env (the second test of eq. 6).

        Compared only where the verdict is clear on both sides [ours]: a latent env relies on
        (unmasked, used, and settled: its smoothed alpha in env is below lambda_low) turns atypical
        on this batch (alpha > lambda_high), or a latent env masks with a settled reason (smoothed
        alpha above lambda_high) is typical and informative on this batch. A latent whose smoothed
        alpha in env is inside the hysteresis band is in transition within env (being learnt, or
        returning to the prior) and is not evidence either way.
        """
        low, high = masks.cfg.lambda_low, masks.cfg.lambda_high
        a_env = masks.mask(env).bool()
        settled_on, settled_off = masks.alpha[env] < low, masks.alpha[env] > high
        lost = a_env & settled_on & self.relied_on(env) & (alpha > high)
        gained = ~a_env & settled_off & (alpha < low) & (information > self.cfg.used_kl)
        return lost | gained

    # -- the decision -----------------------------------------------------------------------------
    def infer(
        self,
        step: int,
        probs: torch.Tensor,
        alpha: torch.Tensor,
        information: torch.Tensor,
        masks: LatentMasks,
        error_under: Callable[[int], float],
    ) -> Decision:
        """Decide the environment of one batch (eq. 6) from its atypicality and per-latent
        information (`vase.masking.information`). `error_under(s)` reconstructs it under s."""
        if self.n_envs == 0:
            return self._allocate(step, 0, "first", [])
        predicted = self.predict(probs)
        if self.probation is not None and step - self.probation.since >= self.cfg.cooldown:
            self.probation = None  # the switch back has lasted: it was right
        if step - self.settling_since < self.cfg.cooldown:
            # A new environment's L_s, usage and mask rest on a handful of batches; judged against
            # them, every batch of it fails, and freezing them while the verdict is pending would
            # never let them settle. So it trains unjudged for `cooldown` steps [ours].
            self.pending = 0
            return Decision(step, self.current, predicted, "same")
        # The current environment is tested first [ours]: a stream is piece-wise stationary, and a
        # classifier trained for a thousand steps on one environment keeps predicting it for a
        # while after a new one is allocated. Eq. 6's s_hat decides only when the current fails,
        # then the rest in the classifier's order [ours].
        ranked = probs[: self.n_envs].argsort(descending=True, stable=True).tolist()
        candidates = [self.current] + [s for s in ranked if s != self.current]
        first, tried = None, []
        for env in candidates:
            error = error_under(env)
            reasons, latents = self.failures(env, error, alpha, information, masks)
            tried.append([env, reasons])
            if first is None:
                first = (reasons, error, self.threshold(env), latents)
            if not reasons:
                verdict = "same" if env == self.current else "switch"
                restored = self._leave_probation(env, masks)
                if verdict == "switch":
                    self.probation = Probation(env, step, self.errors[env].clone(), self.usage[env].clone(),
                                               bool(self.recorded[env]), masks.row(env))
                self.current, self.pending = env, 0
                return Decision(step, env, predicted, verdict, *first, tried, restored)
        reasons, error, threshold, latents = first
        self.pending += 1
        if self.pending < self.cfg.patience:
            return Decision(step, self.current, predicted, "pending", reasons, error, threshold, latents, tried)
        if self.n_envs >= self.k_max:
            if not self.full_warned:
                warnings.warn(
                    f"step {step}: the stream looks like a new environment but all {self.k_max} slots "
                    f"(model.k_max) are used; training continues in environment {self.current}",
                    stacklevel=2,
                )
                self.full_warned = True
            self.pending = 0
            return Decision(step, self.current, predicted, "full", reasons, error, threshold, latents, tried)
        restored = self._leave_probation(self.n_envs, masks)
        decision = self._allocate(step, self.n_envs, "new", reasons)
        decision.predicted, decision.error, decision.threshold = predicted, error, threshold
        decision.disagreeing, decision.tried, decision.restored = latents, tried, restored
        return decision

    def _leave_probation(self, env: int, masks: LatentMasks) -> int | None:
        """The stream goes to `env`. If that leaves a past environment it switched back into fewer
        than `cooldown` steps ago, restore that environment's statistics and return it [ours].

        No environment lasts less than `cooldown` steps, so such a switch was a mistake: the
        batches it trained there came from somewhere else. Left in, they would make the past
        environment "use" the newcomer's latents (its usage record, and so which latents later
        environments may mask) and shift its L_s and mask. On the digits, moving MNIST passed moving
        Fashion's tests for a few batches before failing them, and Fashion's slot then listed
        latents that only moving MNIST had used. The weights those batches trained are not undone.
        """
        p = self.probation  # `infer` has already ended a probation older than `cooldown` steps
        if p is None or p.env == env:
            return None
        self.probation = None
        self.errors[p.env], self.usage[p.env], self.recorded[p.env] = p.error, p.usage, p.recorded
        masks.restore_row(p.env, p.mask)
        return p.env

    def _allocate(self, step: int, env: int, verdict: str, reasons: list[str]) -> Decision:
        self.n_envs = env + 1
        self.current = env
        self.pending = 0
        self.settling_since = step
        self.recorded[env] = False
        return Decision(step, env, env, verdict, reasons)

    def resettle(self, env: int, step: int) -> None:
        """The mask of `env` changed while training in it: judge it again only after `cooldown`
        steps, with L_env re-learnt under the new mask [ours]."""
        if env == self.current:
            self.settling_since = step
            self.recorded[env] = False

    def record(self, env: int, error: torch.Tensor, information: torch.Tensor) -> None:
        """Fold a trained batch's error (a 0-d tensor, read on the device) into L_env, and its
        information per latent into the usage of env."""
        if not torch.is_tensor(error):
            error = torch.tensor(error, dtype=torch.float64, device=self.device)
        if not self.recorded[env]:
            self.errors[env], self.usage[env] = error, information
            self.recorded[env] = True
            return
        e = self.cfg.error_ema
        # (1 - e) * error is rounded once from double precision, as a Python float would be, so the
        # running average is the same number whether the error comes as a tensor or as a float.
        wide = torch.float32 if error.device.type == "mps" else torch.float64
        self.errors[env] = e * self.errors[env] + ((1 - e) * error.to(wide)).float()
        self.usage[env] = e * self.usage[env] + (1 - e) * information

    # -- checkpointing ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "n_envs": self.n_envs,
            "current": self.current,
            "errors": self.errors.clone(),
            "usage": self.usage.clone(),
            "recorded": self.recorded.clone(),
            "pending": self.pending,
            "settling_since": self.settling_since,
            "full_warned": self.full_warned,
            "probation": None if self.probation is None else asdict(self.probation),
        }

    def load_state_dict(self, d: dict) -> None:
        self.n_envs, self.current = int(d["n_envs"]), int(d["current"])
        self.errors, self.usage = d["errors"].to(self.device, copy=True), d["usage"].to(self.device, copy=True)
        self.recorded = d["recorded"].to("cpu", copy=True)
        self.pending, self.settling_since = int(d["pending"]), int(d["settling_since"])
        self.full_warned = bool(d["full_warned"])
        probation = d.get("probation")  # absent from checkpoints written before probation existed
        if probation is not None:
            probation = {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in probation.items()}
            probation["mask"] = {k: v.to(self.device) if torch.is_tensor(v) else v
                                 for k, v in probation["mask"].items()}
        self.probation = None if probation is None else Probation(**probation)
