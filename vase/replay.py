"""Eq. 6's evidence batch by batch, from a kept checkpoint (`vase eval RUN_DIR --replay STEP`).

A run's events record the verdicts that changed its environment, not the batches that led to them
(the pending ones) or what moved their evidence. A checkpoint holds everything a step reads,
the generator included, so stepping the run's learner on from one reproduces the run's own steps
exactly (resume is exact: docs/reliability.md) and can show each one: q_psi's pick, eq. 6's two
tests, the KL of the batch against the capacity target C(t) (eq. 3), eq. 4's atypicality of its
most atypical latents, and the latents eq. 5 turned on or off in the slot it trained. A latent that
turns on in a settled slot adds its KL to eq. 3's at once (docs/regime.md, "The extended study so
far"). Nothing is written: the run's folder is read, never changed.

The replay can also change what the run did at its checkpoint, to measure what a flip of eq. 5
costs: `turn_on` sets a latent that a slot masks on, as eq. 5 leaves it when it turns one on (its
entry of a^s 1, its smoothed alpha just under lambda_low), and `capacity_form` steps on under the
other form of eq. 8's capacity term. Each environment's held-out error under its own slot, before
and after the replayed steps, says what the steps cost it (docs/regime.md, "The extended study
so far": a flip made by hand).
"""
from __future__ import annotations

import dataclasses
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from vase.config_sections import CHOICES
from vase.errors import VaseError

# Steps in a row with the batch's KL within SETTLED_NATS of C(t): eq. 3's capacity term is met again.
SETTLED_RUN, SETTLED_NATS = 10, 1.0


@dataclass
class ReplayedStep:
    step: int
    true_env: int  # the sequence's stage the batch comes from
    verdict: str
    predicted: int  # s_hat, q_psi's pick
    env: int  # the slot the batch trained under
    error: float  # eq. 6's reconstruction error under s_hat (nan where the batch was not judged)
    threshold: float
    disagreeing: list[int]  # latents where the mask test failed
    kl: float  # the batch's KL over its unmasked latents (eq. 3)
    capacity: float  # C(t), the KL eq. 3 asks for
    reconstruction: float
    mdl: float  # eq. 3 whole: reconstruction + gamma * the capacity term
    alpha: dict[int, float]  # eq. 4's atypicality of the shown latents
    mask_on: list[int]  # latents a^env (eq. 5) turned on in this step
    mask_off: list[int]  # and turned off

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class Replay:
    steps: list[ReplayedStep]
    turned_on: tuple[int, int] | None  # (slot, latent) set on at the checkpoint, or None
    capacity_form: str  # eq. 8's form the steps trained under
    run_capacity_form: str  # the run's own
    own_slot: list[dict]  # per environment seen: its slot and held-out error before and after
    latent_on_at_end: bool | None = None  # the latent turned on, in its slot after the last step

    def as_dict(self) -> dict:
        return {"steps": [r.as_dict() for r in self.steps], "turned_on": self.turned_on,
                "capacity_form": self.capacity_form, "run_capacity_form": self.run_capacity_form,
                "own_slot": self.own_slot, "settled_from": settled_from(self.steps),
                "latent_on_at_end": self.latent_on_at_end}


def settled_from(rows: list[ReplayedStep]) -> int | None:
    """The first step from which the batch's KL stays within SETTLED_NATS of C(t) for SETTLED_RUN
    steps in a row (None: not within these steps)."""
    for i in range(len(rows) - SETTLED_RUN + 1):
        if all(abs(r.kl - r.capacity) <= SETTLED_NATS for r in rows[i:i + SETTLED_RUN]):
            return rows[i].step
    return None


def turn_on(run, slot: int, latent: int) -> None:
    """Set latent on in slot's a^s as eq. 5's hysteresis leaves a latent it turns on: a^s 1 and the
    smoothed alpha just under lambda_low, so that it stays on until alpha rises above lambda_high."""
    learner, cfg = run.learner, run.cfg
    if not cfg.mask.enabled:
        raise VaseError("--turn-on needs A: with mask.enabled off every latent of every slot is on")
    if not 0 <= latent < cfg.model.latents:
        raise VaseError(f"--turn-on {slot}:{latent}: the run has latents 0-{cfg.model.latents - 1}")
    allocated = [s for s in range(len(learner.slots)) if learner.slots[s].initialised]
    if slot not in allocated:
        raise VaseError(f"--turn-on {slot}:{latent}: at step {learner.step} the run has allocated slots "
                        f"{', '.join(map(str, allocated)) or 'none'}")
    record = learner.slots[slot]
    if record.mask[latent] > 0:
        raise VaseError(f"--turn-on {slot}:{latent}: z{latent} is already on in slot {slot} at step {learner.step}")
    low = learner.inference.mask_cfg.lambda_low
    record.mask, record.alpha = record.mask.clone(), record.alpha.clone()
    record.mask[latent] = 1.0
    record.alpha[latent] = low * (1 - 1e-3)


def own_slot_errors(run) -> list[tuple[str, int, float]]:
    """Each environment seen so far: its name, its own slot and its held-out error there, now."""
    return [(stage["true_env"], stage["inferred_env"], run.learner.reconstruction_error(x, stage["inferred_env"]))
            for stage, x in zip(run.inferred_environments(), run.held_out)]


def replay(run_dir: Path, step: int, count: int, latents: list[int] | None = None, top: int = 3,
           device: str = "cpu", turned_on: tuple[int, int] | None = None,
           capacity_form: str | None = None, progress: bool = False) -> Replay:
    """Train `count` steps of the run from its kept checkpoint of `step`, in memory, and return what
    each one saw. `latents`: whose alpha to show (default: each batch's `top` most atypical).
    `turned_on`: (slot, latent) to set on before the first step; `capacity_form`: eq. 8's form to
    step on under (default: the run's). `progress`: a bar on standard error, as the steps take as long
    as the run's own."""
    from vase.inspection import open_run
    from vase.progress_bar import progress_bar

    forms = CHOICES["objective.capacity_form"]
    if capacity_form is not None and capacity_form not in forms:
        raise VaseError(f"--capacity-form {capacity_form}: give one of {', '.join(forms)}")
    run = open_run(run_dir, step, device=device)
    learner, stream = run.learner, run.stream
    n_latents = run.cfg.model.latents
    bad = [n for n in latents or () if not 0 <= n < n_latents]
    if bad:
        raise VaseError(f"--latents {','.join(map(str, bad))}: the run has latents 0-{n_latents - 1}")
    if step >= stream.total_steps:
        raise VaseError(f"--replay {step}: the run's sequence ends at step {stream.total_steps}")
    before = own_slot_errors(run)  # the run's own state: the cost of a flip includes its decoding
    if turned_on is not None:
        turn_on(run, *turned_on)
    run_form = learner.objective.capacity_form
    if capacity_form is not None:
        learner.objective = dataclasses.replace(learner.objective, capacity_form=capacity_form)
    rows, steps = [], range(step, min(step + count, stream.total_steps))
    for t in progress_bar(len(steps), "vase eval --replay", disable=not progress, iterable=steps):
        masks = learner.slots.stack("mask").cpu()
        out = learner.training_step(stream.batch(t, learner.generator))
        d, alpha = out.decision, out.alpha.float().cpu()
        run.record.assigned.append(d.env)  # in memory, as the run records it: each stage's own slot after
        was, now = masks[d.env].bool(), learner.slots[d.env].mask.cpu().bool()
        shown = latents if latents else alpha.argsort(descending=True)[:top].tolist()
        rows.append(ReplayedStep(
            step=t, true_env=stream.env_index(t), verdict=d.verdict, predicted=d.predicted, env=d.env,
            error=float(d.error), threshold=float(d.threshold), disagreeing=list(d.disagreeing),
            kl=float(out.losses["kl"]), capacity=float(out.extra["capacity"]),
            reconstruction=float(out.losses["reconstruction"]), mdl=float(out.losses["mdl"]),
            alpha={int(n): round(float(alpha[n]), 3) for n in shown},
            mask_on=(now & ~was).nonzero().flatten().tolist(),
            mask_off=(was & ~now).nonzero().flatten().tolist()))
    # Environments first met during the replay have no error before it.
    after = own_slot_errors(run)
    errors = {(name, slot): error for name, slot, error in before}
    own = [{"environment": name, "slot": slot, "before": errors.get((name, slot)), "after": error}
           for name, slot, error in after]
    on_at_end = None if turned_on is None else bool(learner.slots[turned_on[0]].mask[turned_on[1]] > 0)
    return Replay(rows, turned_on, learner.objective.capacity_form, run_form, own, on_at_end)


def replay_text(result: Replay) -> str:
    rows = result.steps
    head = (f"{'step':>7} {'stage':>5} {'verdict':>8} {'q_psi':>5} {'slot':>4} {'error / threshold':>17} "
            f"{'KL / C(t)':>12} {'eq. 3':>8}  mask test fails on; alpha (eq. 4); a^slot turned on (+) / off (-)")
    lines = ["each batch as the run trained it, stepped on from its checkpoint (nothing is written)", head]
    for r in rows:
        tested = "" if r.error != r.error else f"{r.error:.1f} / {r.threshold:.1f}"
        fails = ",".join(f"z{n}" for n in r.disagreeing) or "-"
        alpha = " ".join(f"z{n} {a:.2f}" for n, a in r.alpha.items())
        changed = " ".join([f"+z{n}" for n in r.mask_on] + [f"-z{n}" for n in r.mask_off])
        lines.append(f"{r.step:>7} {r.true_env:>5} {r.verdict:>8} {r.predicted:>5} {r.env:>4} {tested:>17} "
                     f"{r.kl:>5.1f} / {r.capacity:<4.1f} {r.mdl:>8.1f}  {fails}; {alpha}"
                     + (f"; {changed}" if changed else ""))
    return "\n".join(lines + summary_lines(result))


def summary_lines(result: Replay) -> list[str]:
    """What the replayed steps did: the changes made at the checkpoint, eq. 3 over the steps, and
    each environment's held-out error under its own slot before and after them."""
    rows, lines = result.steps, []
    if result.turned_on is not None:
        slot, latent = result.turned_on
        end = "on" if result.latent_on_at_end else "off"
        lines.append(f"z{latent} set on in slot {slot} before the first step (alpha just under lambda_low); "
                     f"after the last: {end}")
    if result.capacity_form != result.run_capacity_form:
        lines.append(f"eq. 8's capacity term: {result.capacity_form} (the run's: {result.run_capacity_form})")
    if rows:
        settled = settled_from(rows)
        when = f"from {settled}" if settled is not None else "not within these steps"
        lines.append(f"eq. 3 over these steps: at most {max(r.mdl for r in rows):.1f}, median "
                     f"{statistics.median(r.mdl for r in rows):.1f}; KL within {SETTLED_NATS:g} nat of C(t) for "
                     f"{SETTLED_RUN} steps in a row {when}")
    if result.own_slot:
        lines.append("held-out error (nats/image) under each environment's own slot, before -> after:")
        for r in result.own_slot:
            before = "-" if r["before"] is None else f"{r['before']:.1f}"
            lines.append(f"  {r['environment']} (slot {r['slot']}): {before} -> {r['after']:.1f}")
    return lines
