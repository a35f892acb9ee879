"""Eq. 5's mask changes of each slot over a run, read from its TensorBoard (`vase eval --mask-changes`).

Once a slot has settled, a latent that eq. 5's hysteresis turns on or off in it changes what its
environment's code may use, and in the long regime such a flip shows up as a spike of eq. 3 a
few steps long (docs/regime.md, "The extended study so far"). The run's events list allocations
and switches, not these; the logged steps hold the mask of the slot each logged batch trained, so
comparing each slot's masks from one logged step to its next finds every change that lasted at
least one logging interval (`train.log_every`): a shorter one can be missed.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from vase.errors import VaseError
from vase.tensorboard_logger import TB_DIR

SLOT_TAG, ENV_TAG, MASK_PREFIX = "inference/assigned_env", "inference/true_env", "mask/z"


@dataclass(frozen=True)
class MaskChange:
    slot: int
    before: int  # the slot's previous logged step
    after: int  # the logged step whose mask differs
    true_env: int  # the environment the batch of `after` came from
    on: tuple[int, ...]  # latents the slot uses from `after` on
    off: tuple[int, ...]  # latents it no longer uses

    def turned(self) -> str:
        """'on z1 z8; off z3', as the readings print a change."""
        return "; ".join(f"{word} {latent_names(latents)}" for word, latents in (("on", self.on), ("off", self.off))
                         if latents)


@dataclass(frozen=True)
class SlotMasks:
    changes: list[MaskChange]
    last: dict[int, tuple[int, tuple[int, ...]]]  # slot -> (its last logged step, the latents on)
    every: int  # the logging interval


def latent_names(latents: tuple[int, ...]) -> str:
    return " ".join(f"z{z}" for z in latents)


def not_a_purge(record: logging.LogRecord) -> bool:
    """False for TensorBoard's notice that it drops the steps logged after a restart: a resume's
    purge_step, and a branch's copy of its source's events past the branch step, make the reader
    drop what was logged after the checkpoint, as they should, and the notice would be noise on a
    reading's standard error. Its other warnings pass."""
    return not record.getMessage().startswith("Detected out of order event.step")


def logged_scalars(run_dir: Path, wanted) -> dict[str, dict[int, float]]:
    """{tag: {step: value}} of the run's TensorBoard scalars whose tag `wanted(tag)` accepts, with
    every logged step (a resumed run's events after its checkpoint were purged when it resumed)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util.tb_logging import get_logger

    tb = Path(run_dir) / TB_DIR
    if not tb.is_dir():
        raise VaseError(f"{tb} not found: this reading comes from a run's TensorBoard")
    events = EventAccumulator(str(tb), size_guidance={"scalars": 0})
    logger = get_logger()  # the reader's own logger
    logger.addFilter(not_a_purge)
    try:
        events.Reload()
    finally:
        logger.removeFilter(not_a_purge)
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"] if wanted(tag)}


def is_mask_tag(tag: str) -> bool:
    """The tags `masks_from` reads."""
    return tag in (SLOT_TAG, ENV_TAG) or tag.startswith(MASK_PREFIX)


def masks_from(scalars: dict[str, dict[int, float]], run_dir: Path) -> dict[int, tuple[int, int, tuple[int, ...]]]:
    """Each logged step's (slot trained, true environment, mask of that slot), from `logged_scalars`."""
    latents = sorted(tag for tag in scalars if tag.startswith(MASK_PREFIX))
    if SLOT_TAG not in scalars or not latents:
        raise VaseError(f"{Path(run_dir) / TB_DIR} holds no logged masks yet")
    slots, envs = scalars[SLOT_TAG], scalars[ENV_TAG]
    masks = [scalars[tag] for tag in latents]
    return {step: (int(slot), int(envs[step]), tuple(int(m[step] > 0.5) for m in masks))
            for step, slot in sorted(slots.items())}


def read_logged_masks(run_dir: Path) -> dict[int, tuple[int, int, tuple[int, ...]]]:
    """Each logged step's (slot trained, true environment, mask of that slot) from TensorBoard."""
    return masks_from(logged_scalars(run_dir, is_mask_tag), run_dir)


def mask_changes(logged: dict[int, tuple[int, int, tuple[int, ...]]]) -> SlotMasks:
    """Every change of a slot's mask between two of its logged steps, in step order."""
    steps = sorted(logged)
    gaps = [b - a for a, b in zip(steps, steps[1:])]
    last: dict[int, tuple[int, tuple[int, ...]]] = {}
    changes = []
    for step in steps:
        slot, env, mask = logged[step]
        if slot in last and last[slot][1] != mask:
            before, old = last[slot]
            changes.append(MaskChange(slot, before, step, env,
                                      tuple(z for z, (a, b) in enumerate(zip(old, mask)) if b and not a),
                                      tuple(z for z, (a, b) in enumerate(zip(old, mask)) if a and not b)))
        last[slot] = (step, mask)
    used = {slot: (step, tuple(z for z, m in enumerate(mask) if m)) for slot, (step, mask) in last.items()}
    return SlotMasks(changes, used, min(gaps) if gaps else 0)


def mask_changes_text(found: SlotMasks, sequence: list[str]) -> str:
    lines = [f"eq. 5's mask changes, between two logged steps of a slot (logged every {found.every:,} steps; "
             "a shorter change can be missed):"]
    for c in found.changes:
        lines.append(f"  slot {c.slot} ({sequence[c.true_env]}'s batch)  {c.before:>9,} -> {c.after:<9,} {c.turned()}")
    if not found.changes:
        lines.append("  none")
    lines.append("each slot's mask at its last logged step, the latents on:")
    for slot, (step, used) in sorted(found.last.items()):
        lines.append(f"  slot {slot} at {step:,}: {latent_names(used) or 'none'}")
    return "\n".join(lines)
