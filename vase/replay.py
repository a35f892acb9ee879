"""Eq. 6's evidence batch by batch, from a kept checkpoint (`vase eval RUN_DIR --replay STEP`).

A run's events record the verdicts that changed its environment, not the batches that led to them
(the pending ones) or what moved their evidence. A checkpoint holds everything a step reads,
the generator included, so stepping the run's learner on from one reproduces the run's own steps
exactly (resume is exact: docs/reliability.md) and can show each one: q_psi's pick, eq. 6's two
tests, the KL of the batch against the capacity target C(t) (eq. 3), eq. 4's atypicality of its
most atypical latents, and the latents eq. 5 turned on or off in the slot it trained. A latent that
turns on in a settled slot adds its KL to eq. 3's at once (docs/regime.md, "The extended study so
far"). Nothing is written: the run's folder is read, never changed.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from vase.errors import VaseError


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


def replay(run_dir: Path, step: int, count: int, latents: list[int] | None = None, top: int = 3,
           device: str = "cpu") -> list[ReplayedStep]:
    """Train `count` steps of the run from its kept checkpoint of `step`, in memory, and return what
    each one saw. `latents`: whose alpha to show (default: each batch's `top` most atypical)."""
    from vase.inspection import open_run

    run = open_run(run_dir, step, device=device)
    learner, stream = run.learner, run.stream
    n_latents = run.cfg.model.latents
    bad = [n for n in latents or () if not 0 <= n < n_latents]
    if bad:
        raise VaseError(f"--latents {','.join(map(str, bad))}: the run has latents 0-{n_latents - 1}")
    if step >= stream.total_steps:
        raise VaseError(f"--replay {step}: the run's sequence ends at step {stream.total_steps}")
    rows = []
    for t in range(step, min(step + count, stream.total_steps)):
        masks = learner.slots.stack("mask").cpu()
        out = learner.training_step(stream.batch(t, learner.generator))
        d, alpha = out.decision, out.alpha.float().cpu()
        before, after = masks[d.env].bool(), learner.slots[d.env].mask.cpu().bool()
        shown = latents if latents else alpha.argsort(descending=True)[:top].tolist()
        rows.append(ReplayedStep(
            step=t, true_env=stream.env_index(t), verdict=d.verdict, predicted=d.predicted, env=d.env,
            error=float(d.error), threshold=float(d.threshold), disagreeing=list(d.disagreeing),
            kl=float(out.losses["kl"]), capacity=float(out.extra["capacity"]),
            reconstruction=float(out.losses["reconstruction"]), mdl=float(out.losses["mdl"]),
            alpha={int(n): round(float(alpha[n]), 3) for n in shown},
            mask_on=(after & ~before).nonzero().flatten().tolist(),
            mask_off=(before & ~after).nonzero().flatten().tolist()))
    return rows


def replay_text(rows: list[ReplayedStep]) -> str:
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
    return "\n".join(lines)
