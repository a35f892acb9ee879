"""Which slot q_psi names, on real data and on dreams (`vase eval RUN_DIR --classifier`).

Eq. 6 tests a batch only against the slot q_psi names, so a returning environment is re-identified
only if q_psi names its slot. q_psi learns from real images of the current slot and from dreams of
the past ones: this reading shows what it learnt, on each environment's held-out images and on
dreams of each slot drawn from the snapshot as eq. 7 draws them (docs/method.md, "q_psi's prior").
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch.nn import functional as F

from vase.inference import most_likely_slot


@dataclass
class SlotPicks:
    source: str  # "<environment>" (its held-out images) or "dreams of slot <s>"
    mean_q: list[float]  # q_psi(s|x) averaged over the images, for each allocated slot s
    named: dict[int, int]  # slot -> how many batches eq. 6 would test against it (s_hat per batch)

    def as_dict(self) -> dict:
        return asdict(self)


def picks_of(classifier: torch.nn.Module, hidden: torch.Tensor, n_envs: int, batch_size: int,
             source: str) -> SlotPicks:
    """q_psi's mean probabilities over the images of `hidden` (encoder features), and s_hat for each
    whole batch of `batch_size` of them, in order."""
    mean_q = F.softmax(classifier(hidden), dim=1)[:, :n_envs].mean(0)
    named: dict[int, int] = {}
    for start in range(0, hidden.shape[0] - batch_size + 1, batch_size):
        slot = most_likely_slot(classifier, hidden[start:start + batch_size], n_envs)
        named[slot] = named.get(slot, 0) + 1
    return SlotPicks(source, [round(float(q), 4) for q in mean_q], dict(sorted(named.items())))


@torch.no_grad()
def slot_picks(evaluator, dreams_per_slot: int = 512, seed: int = 0) -> list[SlotPicks]:
    """For the learner of `evaluator` (a run opened at a checkpoint): q_psi on each environment's
    held-out images, then on `dreams_per_slot` dreams of each allocated slot, z ~ N(0, I) decoded by
    the snapshot (a generator seeded with `seed`, so the reading repeats)."""
    learner = evaluator.learner
    n_envs, batch = learner.inference.n_envs, learner.cfg.train.batch_size
    encoder, classifier = learner.model.encoder.eval(), learner.classifier.eval()
    rows = [picks_of(classifier, encoder(x).hidden, n_envs, batch, env.name)
            for env, x in zip(evaluator.test_envs, evaluator.held_out)]
    generator = torch.Generator(device=learner.device).manual_seed(seed)
    for slot in range(n_envs):
        dreams = learner.snapshot.dream([slot], dreams_per_slot, learner.cfg.model.latents, generator)
        rows.append(picks_of(classifier, encoder(dreams.x).hidden, n_envs, batch, f"dreams of slot {slot}"))
    return rows


def slot_picks_text(rows: list[SlotPicks], step: int, current: int) -> str:
    n = len(rows[0].mean_q) if rows else 0
    lines = [f"q_psi at step {step} ({n} slots, the current one {current}): its mean q(s|x) on each "
             "environment's held-out images and on dreams of each slot, and the slot eq. 6 would test "
             "each batch against",
             f"  {'':24}" + "".join(f"{'slot ' + str(s):>8}" for s in range(n)) + "   batches named"]
    for row in rows:
        named = ", ".join(f"slot {s} x{k}" for s, k in row.named.items())
        lines.append(f"  {row.source:24}" + "".join(f"{q:8.2f}" for q in row.mean_q) + f"   {named}")
    return "\n".join(lines)
