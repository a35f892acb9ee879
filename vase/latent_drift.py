"""Which latents carry the shared encoder's drift on an environment (`vase eval --own-slot STEPS
--by-latent`).

`vase eval --own-slot` decodes an environment's held-out images under its own slot from the codes
of an older encoder, and so splits what the slot lost into its decoder's part and the encoder's
(docs/regime.md, "The slot or the shared encoder"). This module splits the encoder's part over the
latents: the error from the older codes with one latent at a time given today's code instead. A
latent whose code did not move, or that the slot masks, adds nothing; the increments need not sum
to the whole change, since a decoder is not additive in its latents.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from vase.checkpoint import load_weights
from vase.evaluation import FrozenEncoder, open_with_encoders
from vase.objective import kl_per_latent


def latent_increments(error: Callable[[torch.Tensor], float], then: torch.Tensor, now: torch.Tensor) -> list[float]:
    """error(codes) with latent j of `then` replaced by its value in `now`, minus error(then), per j."""
    base = error(then)
    increments = []
    for j in range(then.shape[1]):
        codes = then.clone()
        codes[:, j] = now[:, j]
        increments.append(error(codes) - base)
    return increments


def correlations(then: torch.Tensor, now: torch.Tensor) -> torch.Tensor:
    """Pearson's r between each latent's codes then and now over the images (0 where either is
    constant): near 1 when a code was shifted or rescaled, not reordered."""
    a, b = then - then.mean(0), now - now.mean(0)
    return (a * b).sum(0) / (a.norm(dim=0) * b.norm(dim=0)).clamp_min(1e-12)


def own_slot_drift_by_latent(run_dir: Path, steps: list[int], device: torch.device | str = "cpu",
                             checkpoint_step: int | None = None) -> list[dict]:
    """For each step and environment the checkpoint has seen: its held-out error under its own slot
    from the codes of the encoder saved at that step and from today's, and per latent the increment
    of `latent_increments`, the slot's mask, the KL (nats) then and now, how far the codes moved and
    how well the new codes still follow the old ones (`correlations`)."""
    run, paths = open_with_encoders(run_dir, steps, device, checkpoint_step)
    learner = run.learner
    encode = FrozenEncoder(run.cfg.model, device)
    # What does not depend on the step: per environment its slot, held-out images, today's codes,
    # their KL and error, and the slot's mask.
    stages = []
    for stage, x in zip(run.inferred_environments(), run.held_out):
        slot = stage["inferred_env"]
        with torch.no_grad():
            now = learner.model.encoder(x)
        stages.append((stage, x, now, kl_per_latent(now.mu, now.logvar).mean(0).tolist(),
                       learner.reconstruction_error(x, slot, now.mu), learner.mask(slot).flatten().tolist()))
    rows = []
    for step, path in paths.items():
        encode.load(load_weights(path))
        for stage, x, now, kl_now, error_now, mask in stages:
            slot = stage["inferred_env"]
            then = encode.posterior(x)

            def error(codes: torch.Tensor) -> float:
                return learner.reconstruction_error(x, slot, codes)

            increments = latent_increments(error, then.mu, now.mu)
            kl_then = kl_per_latent(then.mu, then.logvar).mean(0).tolist()
            shift = (now.mu - then.mu).pow(2).mean(0).sqrt().tolist()
            corr = correlations(then.mu, now.mu).tolist()
            latents = [{"latent": j, "nats": increments[j], "masked": mask[j] == 0.0, "kl_then": kl_then[j],
                        "kl_now": kl_now[j], "rms_shift": shift[j], "correlation": corr[j]}
                       for j in range(len(increments))]
            rows.append({"step": step, "environment": stage["true_env"], "slot": slot,
                         "error_then": error(then.mu), "error_now": error_now,
                         "checkpoint_step": learner.step, "latents": latents})
    return rows


def latent_drift_text(rows: list[dict], top: int = 6) -> str:
    """`own_slot_drift_by_latent` as text: per step and environment, the latents that add most."""
    lines = [f"held-out error (nats/image) under each environment's own slot with the decoders of step "
             f"{rows[0]['checkpoint_step']}: from the codes of the encoder of each step, from today's, and from "
             f"the older codes with one latent given today's code (the {top} that add most)"]
    for row in rows:
        lines.append(f"  encoder {row['step']}, {row['environment']} (slot {row['slot']}): "
                     f"{row['error_then']:.1f} -> {row['error_now']:.1f}")
        lines.append(f"    {'latent':>13} {'+nats':>8} {'KL then':>8} {'KL now':>8} {'rms shift':>10} {'r':>6}")
        for lat in sorted(row["latents"], key=lambda r: -r["nats"])[:top]:
            name = f"z{lat['latent']}" + (" (masked)" if lat["masked"] else "")
            lines.append(f"    {name:>13} {lat['nats']:>8.1f} {lat['kl_then']:>8.2f} {lat['kl_now']:>8.2f} "
                         f"{lat['rms_shift']:>10.3f} {lat['correlation']:>6.3f}")
    return "\n".join(lines)
