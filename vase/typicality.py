"""How atypical (eq. 4) each environment's held-out batches are under a run's saved encoders.

Eq. 6's mask test can only tell a new environment from a past one if some latent the past one
relies on turns atypical on the new data (paper §3.3). `vase eval RUN --atypicality STEPS`
measures that premise after the fact: for each saved encoder step and each environment of the
sequence, alpha on random held-out batches of the training batch size, as eq. 5 would see them,
one batch at a time, and the information each latent carries on those batches (KL minus alpha,
`vase.masking.information`). Where the run kept its slots at that step, also the slot q_psi picks
for each batch and the information on the latents each slot leaves unmasked: what an environment
keeps where its own slot reads it. docs/regime.md ("Why moving MNIST joined moving Fashion's slot",
"Table 1 under the paper's reading") reads it.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from vase.checkpoint import load_weights
from vase.config import Config
from vase.data.environments import load_sequence
from vase.evaluation import FrozenEncoder, encoders_at, kept_slots
from vase.masking import atypicality, information
from vase.objective import kl_per_latent
from vase.probing import SlotReading

QUANTILES = (0.1, 0.5, 0.9)
INFORMATIVE, INFORMATION_SHOWN = 8, 0.05  # the text shows at most 8 latents, those above 0.05 nat


@dataclass
class Typicality:
    """alpha of `batches` held-out batches of one environment under one saved encoder."""

    step: int
    environment: str
    alpha: torch.Tensor  # (batches, N): eq. 4 on each batch
    information: torch.Tensor  # (batches, N): nats each latent carries on each batch
    picks: list[int] | None = None  # the slot q_psi picks for each batch, where the run kept its slots
    slot_masks: torch.Tensor | None = None  # (slots, N): each slot's mask a^s at this step

    def information_by_slot(self) -> list[float] | None:
        """Nats the batches carry, on average, on the latents each slot leaves unmasked."""
        if self.slot_masks is None:
            return None
        return (self.slot_masks * self.information.mean(0)).sum(1).tolist()

    def picked(self) -> dict[int, int] | None:
        """How many batches q_psi sends to each slot."""
        if self.picks is None:
            return None
        return {slot: self.picks.count(slot) for slot in sorted(set(self.picks))}

    def top(self) -> torch.Tensor:
        """Each batch's highest alpha over the latents: what eq. 5 compares with lambda_high."""
        return self.alpha.max(1).values

    def top_quantiles(self) -> list[float]:
        return torch.quantile(self.top(), torch.tensor(QUANTILES, dtype=self.alpha.dtype)).tolist()

    def top_latent(self) -> int:
        """The latent that holds the batch's highest alpha most often (the lowest index on ties)."""
        return int(torch.bincount(self.alpha.argmax(1), minlength=self.alpha.shape[1]).argmax())

    def as_dict(self) -> dict:
        return {"step": self.step, "environment": self.environment, "top_alpha_quantiles": dict(
            zip((f"p{round(q * 100)}" for q in QUANTILES), self.top_quantiles())),
            "top_latent": self.top_latent(), "mean_alpha": self.alpha.mean(0).tolist(),
            "mean_information": self.information.mean(0).tolist(),
            "information_by_slot": self.information_by_slot(), "picks": self.picks}


@torch.no_grad()
def batch_atypicality(encode, images_of, n_images: int, batches: int, batch_size: int,
                      generator: torch.Generator, slots: SlotReading | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, list[int] | None]:
    """(batches, N) alpha and information of `batches` batches drawn at random (with `generator`)
    from n_images images, and the slot `slots` picks for each (None without slots);
    `images_of(indices)` gives the images, `encode(x)` the posterior."""
    alphas, infos, picks = [], [], []
    for _ in range(batches):
        post = encode(images_of(torch.randint(n_images, (batch_size,), generator=generator)))
        alpha = atypicality(post.mu, post.logvar)
        alphas.append(alpha.cpu())
        infos.append(information(kl_per_latent(post.mu, post.logvar).mean(0), alpha).cpu())
        if slots is not None:
            picks.append(slots.slot_of(post.hidden))
    return torch.stack(alphas), torch.stack(infos), picks if slots is not None else None


def run_typicality(run_dir: Path, cfg: Config, steps: list[int], batches: int = 40, seed: int = 0,
                   device: torch.device | str = "cpu") -> list[Typicality]:
    """Typicality of every environment of the run's sequence (config `cfg`) under its encoder of
    each step."""
    kept = encoders_at(run_dir, steps, cfg.probe.every)
    envs = list({env.name: env.to(device) for env in load_sequence(cfg.data, "test", progress=False)}.values())
    encode = FrozenEncoder(cfg.model, device)
    generator = torch.Generator().manual_seed(seed)
    out = []
    for step in steps:
        encode.load(load_weights(kept[step]))
        slots = kept_slots(run_dir, cfg, step, device)
        masks = None if slots is None else slots.masks.cpu()
        for env in envs:
            alpha, info, picks = batch_atypicality(encode.posterior, env.batch, len(env), batches,
                                                   cfg.train.batch_size, generator, slots)
            out.append(Typicality(step, env.name, alpha, info, picks, masks))
    return out


def _largest(values: torch.Tensor, above: float, most: int | None = None) -> str:
    """'z<i> <value>' for the latents whose value is above `above`, largest first, at most `most`."""
    order = torch.argsort(values, descending=True)[:most].tolist()
    return " ".join(f"z{i} {values[i]:.2f}" for i in order if values[i] > above)


def typicality_text(rows: list[Typicality], lambdas: tuple[float, float]) -> str:
    """One line per step and environment: the quantiles of the batches' highest alpha, the latents
    whose mean alpha is above lambda_low, and the latents that carry the most information; where
    the run kept its slots, a second line with q_psi's picks and the information on each slot's
    unmasked latents."""
    n = len(rows[0].top()) if rows else 0
    lines = [f"alpha (eq. 4) of {n} held-out batches per environment; eq. 5's band is "
             f"lambda_low {lambdas[0]:g} .. lambda_high {lambdas[1]:g}",
             f"  {'step':>7}  {'environment':16} top alpha p10 / p50 / p90  (mostly)  mean alpha above lambda_low"
             f"  |  most information (nats, mean over the batches)"]
    for row in rows:
        q = row.top_quantiles()
        above = _largest(row.alpha.mean(0), lambdas[0])
        carried = _largest(row.information.mean(0), INFORMATION_SHOWN, INFORMATIVE)
        lines.append(f"  {row.step:>7}  {row.environment:16} {q[0]:6.2f} / {q[1]:.2f} / {q[2]:.2f}"
                     f"  (z{row.top_latent()})  {above or '-'}  |  {carried or '-'}")
        by_slot = row.information_by_slot()
        if by_slot is not None:
            picked = ", ".join(f"slot {slot} x{count}" for slot, count in row.picked().items())
            nats = "  ".join(f"s{slot} {value:.1f}" for slot, value in enumerate(by_slot))
            lines.append(f"  {'':>7}  {'':16} q_psi picks {picked}  |  nats on each slot's unmasked latents: {nats}")
    return "\n".join(lines)
