"""Hook points of the training loop, for what runs beside it: evaluation and logging.

The loop (`vase.trainer.Trainer`) draws batches, takes learner steps and writes checkpoints. All
else subscribes to it as a `Callback`, in the way of avalanche's plugins and Lightning's
callbacks: `vase.evaluator.Evaluator` measures the run and assembles results.json, and
`vase.tensorboard_logger.TensorBoardLogger` writes what it measured to TensorBoard.

The trainer calls each hook on every callback in list order, the evaluator first, so a callback
that reads what the evaluator measured sees it in the same hook. A run's hooks come in this order:

    on_resume(step)          only when resuming: drop what a killed run wrote after its checkpoint
    on_train_start(start)    once, before the first step (0, or the resumed checkpoint's step)
    on_step(step)            after every learner step
    on_boundary(step)        after on_step of the last step of each environment
    on_checkpoint()          before each checkpoint is taken (at boundaries, every checkpoint_every)
    on_train_end()           once, when the loop stops: finished, interrupted or failed

A callback with state that must survive a resume returns it from `state_dict`: its entries sit at
the top level of the checkpoint, beside the learner's, and come back through `load_state_dict`.
Callbacks must not change the learner or draw from its generator: the tests require a run without
its TensorBoard logger to give the same results.json.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import torch

from vase.learner import StepOutput

if TYPE_CHECKING:
    from vase.trainer import Trainer


@dataclass(frozen=True)
class StepEnd:
    """One finished training step, as the hooks see it."""

    out: StepOutput
    true_env: int  # the environment the stream drew from; the learner is never told (vase/stream.py)
    boundary: bool  # the last step of true_env's stretch
    logged: bool  # a step whose readings are kept: every train.log_every steps and at every boundary

    @property
    def done(self) -> int:
        """Steps done. Every event of step t is logged at t + 1, so a checkpoint at step t + 1 holds
        them all and a resume can purge later ones (docs/reliability.md)."""
        return self.out.step + 1

    def every(self, n: int) -> bool:
        return self.done % n == 0

    @cached_property
    def per_latent(self) -> tuple[list[float], list[float], list[float]]:
        """KL, atypicality alpha and mask of each latent, as floats: one host read for every
        callback, since the tensors may live on an accelerator."""
        kl, alpha, mask = torch.stack([self.out.kl_per_latent, self.out.alpha, self.out.mask]).tolist()
        return kl, alpha, mask


class Callback:
    """A subscriber to the loop's hook points; every hook does nothing unless overridden."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Take this callback's entries from a whole checkpoint state."""

    def on_resume(self, trainer: Trainer, step: int) -> None:
        """The run continues from its checkpoint of `step` (0: killed before its first)."""

    def on_train_start(self, trainer: Trainer, start: int) -> None:
        pass

    def on_step(self, trainer: Trainer, step: StepEnd) -> None:
        pass

    def on_boundary(self, trainer: Trainer, step: StepEnd) -> None:
        """step.true_env has just finished its training."""

    def on_checkpoint(self, trainer: Trainer) -> None:
        pass

    def on_train_end(self, trainer: Trainer) -> None:
        """Also after an interrupt or an error: release what on_train_start opened."""
