"""Spikes of eq. 8's loss over a run, and the masked latents close to a flip, read from its
TensorBoard (`vase eval --spikes`).

A latent that eq. 5 turns on in a settled slot adds the nats it carries to eq. 3's KL at once, and
the capacity term's pull on the shared encoder shows as one logged step whose loss is several
times what the stage logged before (docs/regime.md, "The extended study so far"). For each such
step this names the newest checkpoint the run kept before it, so `vase eval --replay` can step its
batches again, and the slot's mask changes logged around it. A masked latent turns on when its
smoothed α falls below λ_low (eq. 5), so the masked latents whose logged α sits inside the
hysteresis band are where the next flip may come.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

from vase.errors import VaseError
from vase.mask_changes import MaskChange, is_mask_tag, logged_scalars, mask_changes, masks_from

LOSS_TAG, KL_TAG, CAPACITY_TAG, ALPHA_PREFIX = "loss/total", "loss/kl", "capacity/C", "atypicality/z"
# [ours] A spike: a logged loss above FACTOR times the median of the WINDOW logged steps of the
# same stage before it, once the stage has logged MIN_HISTORY steps (a new stage's own first steps
# are not compared with the stage before: its data cost other nats).
FACTOR, WINDOW, MIN_HISTORY = 2.5, 40, 10
# Logged steps of a slot whose α the at-risk reading summarises: its most recent ones.
RECENT = 100


@dataclass(frozen=True)
class Spike:
    step: int  # the logged step: its batch is the loop's step - 1 (`StepEnd.done`)
    true_env: int
    slot: int
    loss: float
    median: float  # of the stage's WINDOW logged steps before it
    kl: float
    capacity: float  # C(t)
    replay_from: int | None  # the newest checkpoint kept before the batch, or None
    changes: tuple[MaskChange, ...]  # the slot's mask changes logged around it


@dataclass(frozen=True)
class AtRisk:
    slot: int
    latent: int
    low: float  # the smallest, median and largest α of the slot's RECENT logged batches
    median: float
    high: float
    steps: tuple[int, int]  # the first and last of those logged steps


def find_spikes(loss: dict[int, float], envs: dict[int, float], factor: float = FACTOR) -> list[tuple[int, float]]:
    """(logged step, trailing median) of each logged loss above `factor` times the median of the
    WINDOW logged steps of the same stage before it."""
    spikes, history, stage = [], [], None
    for step in sorted(loss):
        if envs.get(step) != stage:
            stage, history = envs.get(step), []
        if len(history) >= MIN_HISTORY:
            median = statistics.median(history[-WINDOW:])
            if loss[step] > factor * median:
                spikes.append((step, median))
        history.append(loss[step])
    return spikes


def at_risk(logged: dict[int, tuple[int, int, tuple[int, ...]]], alpha: dict[int, dict[int, float]],
            lambda_high: float) -> list[AtRisk]:
    """The latents each slot masks at its last logged step whose median α over the slot's RECENT
    logged batches is below lambda_high, lowest first: inside the hysteresis band or under it."""
    rows, order = [], sorted(logged)
    for slot in sorted({slot for slot, _, _ in logged.values()}):
        steps = [step for step in order if logged[step][0] == slot][-RECENT:]
        mask = logged[steps[-1]][2]
        for latent, on in enumerate(mask):
            values = [alpha[latent][step] for step in steps if step in alpha.get(latent, {})]
            if on or not values:
                continue
            median = statistics.median(values)
            if median < lambda_high:
                rows.append(AtRisk(slot, latent, min(values), median, max(values), (steps[0], steps[-1])))
    return sorted(rows, key=lambda r: r.median)


def read_spikes(run_dir: Path, kept: list[int], lambda_high: float,
                factor: float = FACTOR) -> tuple[list[Spike], list[AtRisk], int]:
    """The run's spikes, its latents at risk and its logging interval, from its TensorBoard and the
    steps of its kept checkpoints."""
    scalars = logged_scalars(run_dir, lambda tag: tag in (LOSS_TAG, KL_TAG, CAPACITY_TAG) or is_mask_tag(tag)
                             or tag.startswith(ALPHA_PREFIX))
    if LOSS_TAG not in scalars:
        raise VaseError(f"{Path(run_dir) / 'tb'} holds no logged loss yet")
    logged = masks_from(scalars, run_dir)
    found = mask_changes(logged)
    envs = {step: env for step, (_, env, _) in logged.items()}
    spikes = []
    for step, median in find_spikes(scalars[LOSS_TAG], envs, factor):
        slot = logged[step][0]
        near = tuple(c for c in found.changes if c.slot == slot and c.before < step + 2 * found.every
                     and c.after > step - 2 * found.every)
        before = [k for k in kept if k < step]  # the batch logged at `step` trained at step - 1
        spikes.append(Spike(step, envs[step], slot, scalars[LOSS_TAG][step], median, scalars[KL_TAG][step],
                            scalars[CAPACITY_TAG][step], before[-1] if before else None, near))
    alpha = {int(tag[len(ALPHA_PREFIX):]): series for tag, series in scalars.items() if tag.startswith(ALPHA_PREFIX)}
    return spikes, at_risk(logged, alpha, lambda_high), found.every


def spikes_text(run_dir: Path, spikes: list[Spike], risky: list[AtRisk], every: int, sequence: list[str],
                factor: float = FACTOR) -> str:
    lines = [f"eq. 8's loss above {factor:g} times the median of the stage's {WINDOW} logged steps before it "
             f"(logged every {every:,} steps):"]
    for s in spikes:
        lines.append(f"  {s.step:>9,}  {sequence[s.true_env]} in slot {s.slot}: {s.loss:.1f} against {s.median:.1f} "
                     f"({s.loss / s.median:.1f} times); KL {s.kl:.1f} against C(t) {s.capacity:.1f}")
        for c in s.changes:
            lines.append(f"             slot {c.slot}'s mask {c.before:,} -> {c.after:,}: {c.turned()}")
        if s.replay_from is None:
            lines.append("             no checkpoint kept before it: train.keep_every keeps them (docs/usage.md)")
        else:
            lines.append(f"             vase eval {run_dir} --replay {s.replay_from} --count {s.step - s.replay_from}")
    if not spikes:
        lines.append("  none")
    lines.append("masked latents whose alpha (eq. 4) on their slot's recent batches has a median under lambda_high, "
                 "lowest first (one turns on when its smoothed alpha falls below lambda_low):")
    for r in risky:
        lines.append(f"  slot {r.slot} z{r.latent}: median {r.median:.2f}, {r.low:.2f}-{r.high:.2f} over logged "
                     f"steps {r.steps[0]:,}-{r.steps[1]:,}")
    if not risky:
        lines.append("  none")
    return "\n".join(lines)
