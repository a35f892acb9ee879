"""Which slot q_psi names, on real data and on dreams, and which slots eq. 6's tests would accept
(`vase eval RUN_DIR --classifier`).

Eq. 6 tests a batch only against the slot q_psi names, so a returning environment is re-identified
only if q_psi names its slot. q_psi learns from real images of the current slot and from dreams of
the past ones: this reading shows what it learnt, on each environment's held-out images and on
dreams of each slot drawn from the snapshot as eq. 7 draws them (docs/regime.md, "q_psi's prior").
Beside it, eq. 6's two tests of each held-out batch against every slot, not only the one q_psi
names: whether a wrong verdict came from q_psi's pick or from the tests themselves. Environments
outside the run's sequence can be read too (`--also`): what q_psi keys on, e.g. whether static
Fashion goes to the slot of the moving Fashion it resembles or of the static digits it shares no
object with.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch.nn import functional as F

from vase.data.environments import load_environment
from vase.evaluation import held_out_images
from vase.evidence import Evidence
from vase.inference import most_likely_slot
from vase.rules import MASK, RECONSTRUCTION


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


def held_out_sources(evaluator, also: tuple[str, ...] = ()) -> list[tuple[str, torch.Tensor]]:
    """(name, held-out images) of each environment of the run's sequence, then of each environment
    named in `also` that the sequence does not hold, loaded from the test split with the run's data
    settings."""
    sources = [(env.name, x) for env, x in zip(evaluator.test_envs, evaluator.held_out)]
    device = evaluator.learner.device
    known = {name for name, _ in sources}
    for name in [name for name in dict.fromkeys(also) if name not in known]:
        env = load_environment(name, "test", evaluator.cfg.data, progress=False).to(device)
        sources.append((name, held_out_images(env)))
    return sources


@torch.no_grad()
def slot_picks(evaluator, sources: list[tuple[str, torch.Tensor]] | None = None, dreams_per_slot: int = 512,
               seed: int = 0) -> list[SlotPicks]:
    """For the learner of `evaluator` (a run opened at a checkpoint): q_psi on the held-out images of
    each of `sources` (default: the run's environments), then on `dreams_per_slot` dreams of each
    allocated slot, z ~ N(0, I) decoded by the snapshot (a generator seeded with `seed`, so the
    reading repeats)."""
    learner = evaluator.learner
    n_envs, batch = learner.inference.n_envs, learner.cfg.train.batch_size
    encoder, classifier = learner.model.encoder.eval(), learner.classifier.eval()
    rows = [picks_of(classifier, encoder(x).hidden, n_envs, batch, name)
            for name, x in (sources or held_out_sources(evaluator))]
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


@dataclass
class SlotTests:
    """Eq. 6's tests of one environment's held-out batches against each allocated slot."""

    environment: str
    named: list[int]  # s_hat of each batch
    passes: list[list[bool]]  # [slot][batch]: both tests passed
    failed_reconstruction: list[int]  # per slot, batches whose error exceeds the threshold
    failed_mask: list[int]  # per slot, batches whose mask a(x) disagrees with a^s
    error: list[float]  # per slot, the batches' mean error (nats per image, as the step measures it)
    threshold: list[float]  # per slot, kappa * L_s plus the error margin

    def passed(self) -> list[int]:
        return [sum(batches) for batches in self.passes]

    def taken(self) -> dict[str, int]:
        """What eq. 6 does with each batch judged alone: s_hat where s_hat passes, else a new slot
        (before patience and settling, which look at the batches around it)."""
        verdicts = [f"slot {s}" if self.passes[s][b] else "new" for b, s in enumerate(self.named)]
        return {v: verdicts.count(v) for v in sorted(set(verdicts))}

    def as_dict(self) -> dict:
        return {**asdict(self), "passed": self.passed(), "taken": self.taken()}


@torch.no_grad()
def slot_tests(evaluator, sources: list[tuple[str, torch.Tensor]] | None = None) -> list[SlotTests]:
    """For the learner of `evaluator`: the held-out images of each of `sources` (default: the run's
    environments) in batches of the training batch size, each one encoded, read (eq. 4 and the rule
    set's latent use) and reconstructed as a training step does, then tested against every allocated
    slot with the rule set's own tests (`EnvironmentInference.failures` on `vase.evidence`). Reads the
    learner's state and writes none of it (the reparameterisation noise comes from its generator)."""
    learner = evaluator.learner
    inference, batch = learner.inference, learner.cfg.train.batch_size
    slots = range(inference.n_envs)
    rows = []
    for name, x in (sources or held_out_sources(evaluator)):
        named, passes = [], [[] for _ in slots]
        reasons_of = [[] for _ in slots]
        errors = [[] for _ in slots]
        for start in range(0, x.shape[0] - batch + 1, batch):
            enc = learner.encode(x[start:start + batch], None)
            evidence = Evidence(inference, enc.probs, enc.alpha, enc.usage,
                                lambda s: learner.eq6_error(enc, s, None))
            named.append(evidence.predicted())
            for s in slots:
                tests = evidence.tests(s)
                reasons, _ = inference.failures(tests)
                passes[s].append(not reasons)
                reasons_of[s].append(reasons)
                errors[s].append(tests.error)
        rows.append(SlotTests(
            name, named, passes,
            [sum(RECONSTRUCTION in r for r in reasons_of[s]) for s in slots],
            [sum(MASK in r for r in reasons_of[s]) for s in slots],
            [round(sum(errors[s]) / len(errors[s]), 1) for s in slots],
            [round(inference.threshold(float(inference.slots[s].error)), 1) for s in slots]))
    return rows


def slot_tests_text(rows: list[SlotTests]) -> str:
    n = len(rows[0].passes) if rows else 0
    lines = ["eq. 6's tests of each environment's held-out batches against every slot: mean error / threshold",
             "(nats), batches passing both tests, and failing the reconstruction (r) or the mask (m) test;",
             "then what eq. 6 does with each batch alone (s_hat if it passes, else a new slot)",
             f"  {'':24}" + "".join(f"{'slot ' + str(s):>26}" for s in range(n)) + "   eq. 6 takes"]
    for row in rows:
        passed = row.passed()
        cells = [f"{row.error[s]:.0f}/{row.threshold[s]:.0f} {passed[s]}/{len(row.named)} "
                 f"r{row.failed_reconstruction[s]} m{row.failed_mask[s]}" for s in range(n)]
        taken = ", ".join(f"{v} x{k}" for v, k in row.taken().items())
        lines.append(f"  {row.environment:24}" + "".join(f"{cell:>26}" for cell in cells) + f"   {taken}")
    return "\n".join(lines)
