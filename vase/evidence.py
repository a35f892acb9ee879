"""What eq. 6 reads of one batch, brought from the device to the host in one read.

Eq. 6 decides on the host: the slot s_hat that q_psi names, the batch's reconstruction error under
s_hat against kappa * L_s_hat, and the latents on which the batch's mask disagrees with a^s_hat.
Read one by one, each of them makes the host wait for the device (docs/devices.md). q_psi names
the current slot on almost every batch, and the current slot's error is the one the batch trains
with, so the current slot's tests are computed before s_hat is known and come back with it in one
read. A batch whose s_hat names another slot costs one more read, for that slot's tests.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from vase.device import wide_float

if TYPE_CHECKING:
    from vase.inference import EnvironmentInference


@dataclass(frozen=True)
class Tests:
    """The host's copy of what eq. 6 tests of a batch against one slot s."""

    error: float  # -log p(x | z^s, s), the batch's mean
    slot_error: float  # L_s
    disagreeing: tuple[int, ...] | None  # latents whose mask test failed; None with A off


class Evidence:
    """Eq. 6's readings of one batch for `inference`, fetched lazily and once per slot and view.

    `error_under(s)` is the batch's mean reconstruction error under s, a 0-d tensor (or a float).
    A view is the inference's hooks at the time of reading: `inference.counterfactuals` judges the
    same batch with other rule sets, whose mask tests read other latents.
    """

    def __init__(self, inference: EnvironmentInference, probs: torch.Tensor, alpha: torch.Tensor,
                 usage: torch.Tensor, error_under: Callable[[int], torch.Tensor | float]):
        self.inference, self.probs, self.alpha, self.usage = inference, probs, alpha, usage
        self.error_under = error_under
        self._predicted: int | None = None
        self._tests: dict[tuple[int, int], Tests] = {}

    def predicted(self) -> int:
        """s_hat: the argmax over the allocated slots of q_psi(s|x) averaged over the batch."""
        if self._predicted is None:
            self.tests(self.inference.current)
        return self._predicted

    def tests(self, env: int) -> Tests:
        """The batch's error under env, L_env and the mask test's disagreeing latents."""
        key = (env, id(self.inference.hooks))
        if key not in self._tests:
            self._tests[key] = self._read(env)
        return self._tests[key]

    def _read(self, env: int) -> Tests:
        """One host read: env's tests, with s_hat if it has not been read yet."""
        inf = self.inference
        slot = inf.slots[env]
        error = self.error_under(env)
        disagreeing = inf.masking.disagreement(slot, self.alpha, inf.mask_scope(env, self.alpha, self.usage))
        parts = {"slot_error": slot.error}
        if torch.is_tensor(error):
            parts["error"] = error
        if self._predicted is None:
            parts["predicted"] = self.probs[: inf.n_envs].argmax()
        if disagreeing is not None:
            parts["disagreeing"] = disagreeing
        # Every value is exact in the device's widest float: float32 errors, small ints, booleans.
        dtype = wide_float(slot.error.device)
        values = torch.cat([part.detach().reshape(-1).to(dtype) for part in parts.values()]).tolist()
        read, at = {}, 0
        for name, part in parts.items():
            read[name], at = values[at:at + part.numel()], at + part.numel()
        if "predicted" in read:
            self._predicted = int(read["predicted"][0])
        latents = None if disagreeing is None else tuple(i for i, v in enumerate(read["disagreeing"]) if v)
        return Tests(error=read["error"][0] if "error" in read else float(error), slot_error=read["slot_error"][0],
                     disagreeing=latents)
