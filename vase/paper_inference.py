"""The `paper` rule set of environment inference: eq. 6 as written, and nothing else.

For each batch:
  s_hat = argmax_s of the batch-averaged q_psi(s|x)                       (docs/method.md, networks)
  s = s_hat   if  error(x | s_hat, a^s_hat) <= kappa * L_s_hat  and  a(x) = a^s_hat
                 on the latents that either uses                             (eq. 6)
  s = r + 1   otherwise (a new environment)

with only what the spec adds to make it run on a stream: the "new" verdict must hold on `patience`
consecutive batches (debouncing; while it is pending the batch trains under the current
environment and updates no statistics), a(x) is eq. 5's hysteresis relative to a^s_hat, and
latent use is read as KL per latent (the paper's reading). Every latent may be masked (eq. 5).

Shares `Decision` and the checkpoint layout of `vase.inference.EnvironmentInference`, whose named
rules this set leaves out (docs/method.md).
"""
from __future__ import annotations

import warnings
from typing import Callable

import torch

from vase.config import InferenceConfig
from vase.inference import MASK, RECONSTRUCTION, Decision
from vase.masking import LatentMasks


class PaperInference:
    """State of eq. 6: the environments allocated so far, their running errors L_s and KL usage."""

    def __init__(self, cfg: InferenceConfig, k_max: int, latents: int, use_masks: bool,
                 device: torch.device | str = "cpu"):
        self.cfg = cfg
        self.k_max = k_max
        self.use_masks = use_masks
        self.device = torch.device(device)
        self.n_envs = 0
        self.current = 0
        self.errors = torch.zeros(k_max, device=device)  # L_s
        self.usage = torch.zeros(k_max, latents, device=device)  # running KL per latent while training in s
        self.recorded = torch.zeros(k_max, dtype=torch.bool)
        self.pending = 0
        self.full_warned = False

    @staticmethod
    def reading(kl: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
        """Per-latent use of a batch as the paper reads it: its mean KL."""
        return kl

    def past_environments(self) -> list[int]:
        return [s for s in range(self.n_envs) if s != self.current]

    def used(self, env: int) -> torch.Tensor:
        return self.usage[env] > self.cfg.used_kl

    def maskable(self, env: int) -> torch.Tensor:
        """Eq. 5 masks any atypical latent."""
        return torch.ones(self.usage.shape[1], dtype=torch.bool, device=self.device)

    def predict(self, probs: torch.Tensor) -> int:
        return int(probs[: self.n_envs].argmax())

    def threshold(self, env: int) -> float:
        return self.cfg.kappa * float(self.errors[env])

    def mask_disagreement(self, env: int, alpha: torch.Tensor, usage: torch.Tensor, masks: LatentMasks) -> torch.Tensor:
        """Latents, among those that env or the batch uses, where a(x) differs from a^env."""
        either = self.used(env) | (usage > self.cfg.used_kl)
        return either & (masks.batch_mask(alpha, env) != masks.mask(env))

    def infer(self, step: int, probs: torch.Tensor, alpha: torch.Tensor, usage: torch.Tensor, masks: LatentMasks,
              error_under: Callable[[int], float]) -> Decision:
        if self.n_envs == 0:
            return self._allocate(step, 0, "first", [])
        predicted = self.predict(probs)
        error, threshold = error_under(predicted), self.threshold(predicted)
        reasons, latents = [], []
        if error > threshold:
            reasons.append(RECONSTRUCTION)
        if self.use_masks:
            latents = self.mask_disagreement(predicted, alpha, usage, masks).nonzero().flatten().tolist()
            if latents:
                reasons.append(MASK)
        tried = [[predicted, reasons]]
        if not reasons:
            verdict = "same" if predicted == self.current else "switch"
            self.current, self.pending = predicted, 0
            return Decision(step, predicted, predicted, verdict, [], error, threshold, [], tried)
        self.pending += 1
        if self.pending < self.cfg.patience:
            return Decision(step, self.current, predicted, "pending", reasons, error, threshold, latents, tried)
        if self.n_envs >= self.k_max:
            if not self.full_warned:
                warnings.warn(f"step {step}: the stream looks like a new environment but all {self.k_max} slots "
                              f"(model.k_max) are used; training continues in environment {self.current}", stacklevel=2)
                self.full_warned = True
            self.pending = 0
            return Decision(step, self.current, predicted, "full", reasons, error, threshold, latents, tried)
        decision = self._allocate(step, self.n_envs, "new", reasons)
        decision.predicted, decision.error, decision.threshold = predicted, error, threshold
        decision.disagreeing, decision.tried = latents, tried
        return decision

    def _allocate(self, step: int, env: int, verdict: str, reasons: list[str]) -> Decision:
        self.n_envs, self.current, self.pending = env + 1, env, 0
        self.recorded[env] = False
        return Decision(step, env, env, verdict, reasons)

    def resettle(self, env: int, step: int) -> None:
        """Eq. 6 has no settling period: a changed mask changes nothing here."""

    def record(self, env: int, error: torch.Tensor, usage: torch.Tensor) -> None:
        """Fold a trained batch into L_env and the KL usage of env (running averages)."""
        if not self.recorded[env]:
            self.errors[env], self.usage[env] = error, usage
            self.recorded[env] = True
            return
        e = self.cfg.error_ema
        self.errors[env] = e * self.errors[env] + (1 - e) * error
        self.usage[env] = e * self.usage[env] + (1 - e) * usage

    def state_dict(self) -> dict:
        return {"n_envs": self.n_envs, "current": self.current, "errors": self.errors.clone(),
                "usage": self.usage.clone(), "recorded": self.recorded.clone(), "pending": self.pending,
                "full_warned": self.full_warned}

    def load_state_dict(self, d: dict) -> None:
        self.n_envs, self.current = int(d["n_envs"]), int(d["current"])
        self.errors, self.usage = d["errors"].to(self.device, copy=True), d["usage"].to(self.device, copy=True)
        self.recorded = d["recorded"].to("cpu", copy=True)
        self.pending, self.full_warned = int(d["pending"]), bool(d["full_warned"])
