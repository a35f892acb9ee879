"""The piece-wise stationary training stream (docs/method.md, the model).

The stream knows which environment each step draws from; the learner is never told. The true
identity is used only for evaluation (probes, the inferred-vs-true report).
"""
from __future__ import annotations

import bisect
import itertools

import torch


class Stream:
    def __init__(self, envs: list, steps: list[int], batch_size: int):
        self.envs = envs
        self.steps = steps
        self.batch_size = batch_size
        self.ends = list(itertools.accumulate(steps))  # step at which each environment's training ends

    @property
    def total_steps(self) -> int:
        return self.ends[-1]

    def env_index(self, step: int) -> int:
        return bisect.bisect_right(self.ends, step)

    def is_boundary(self, step: int) -> bool:
        """True when `step` is the last step of an environment."""
        return step + 1 in self.ends

    def batch(self, step: int, generator: torch.Generator) -> torch.Tensor:
        """A uniformly sampled batch of the environment that is active at `step` (one gather, no loop)."""
        env = self.envs[self.env_index(step)]
        idx = torch.randint(len(env), (self.batch_size,), generator=generator, device=generator.device)
        return env.batch(idx)
