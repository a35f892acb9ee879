"""The evaluation of a run while it trains, as a callback: probes, held-out and cross-domain errors,
latent use, MIG/DCI at boundaries, and results.json.

`vase.evaluation` holds the measurements themselves and `vase eval`'s replay of them from saved
encoders; this module decides when they run during training, keeps their history in the
checkpoint and assembles the run's results. `vase inspect` and the TensorBoard figures
(`vase.figures`) read a run through its Evaluator.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from vase import kernels, rules
from vase.callbacks import Callback, StepEnd
from vase.checkpoint import load_weights, save_weights
from vase.config import Config
from vase.device import describe, host
from vase.dream_coverage import coverage
from vase.dreaming import Snapshot
from vase.evaluation import (
    FrozenEncoder,
    disentanglement_scores,
    encoder_path,
    factor_latents,
    held_out_images,
    saved_encoders,
    slots_path,
)
from vase.learner import Learner
from vase.masking import atypicality, information
from vase.objective import kl_per_latent
from vase.probing import PosteriorSamples, ProbeSuite, SlotReading
from vase.stream import Stream


def _per_latent(values: torch.Tensor) -> list[float]:
    """A per-latent reading (nats) for results.json, to 4 decimals."""
    return [round(float(v), 4) for v in values]


@dataclass
class RunRecord:
    """Evaluation-side state that must survive a resume (plain containers only)."""

    assigned: list[int]  # inferred environment of every step so far
    events: list[dict]  # every decision other than "same" and "pending"
    pending: int
    alpha_steps: list[int]
    alpha: list[list[float]]
    recon_matrix: list[list[float]]  # [i][j]: held-out error of true env i after true env j
    disentanglement: list[dict]  # MIG/DCI of the sprite environments at each boundary
    wall_time: float
    # vase.dream_coverage at every probe point, from the model at reference_step to the model now
    dream_coverage: list[dict] = field(default_factory=list)
    reference_step: int = 0
    # [i]: mu of stage i's held-out images at the end of stage i, for `stage_code_errors`
    stage_codes: list[list[list[float]]] = field(default_factory=list)

    @classmethod
    def empty(cls) -> "RunRecord":
        return cls([], [], 0, [], [], [], [], 0.0)


class Evaluator(Callback):
    """Measures the run at the loop's hook points and keeps the record behind results.json."""

    def __init__(self, cfg: Config, learner: Learner, envs: list, test_envs: list, stream: Stream,
                 frozen_encoder: FrozenEncoder):
        self.cfg, self.learner, self.envs, self.test_envs, self.stream = cfg, learner, envs, test_envs, stream
        # Probes see the encoder exactly as `vase eval` rebuilds it from the saved weights (a plain
        # Encoder, not the trained one's channels_last copy), so both give bit-identical numbers.
        self.frozen_encoder = frozen_encoder
        self.probes = ProbeSuite(test_envs, cfg.probe) if cfg.probe.enabled else None
        self.record = RunRecord.empty()
        self.held_out = [held_out_images(env) for env in test_envs]
        self._slot_tables: tuple | None = None  # (step, slots, latent use, cross-domain errors)
        # The model at the last probe point, for vase.dream_coverage: what eq. 7 held since then.
        covered = cfg.probe.dream_coverage and cfg.dream.enabled
        self.reference = Snapshot(learner.model) if covered else None
        self._began = time.perf_counter()

    # -- state -----------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        state = {"record": vars(self.record).copy(), "probes": self.probes.state_dict() if self.probes else {}}
        if self.reference:
            state["coverage_reference"] = self.reference.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.record = RunRecord(**state["record"])
        if self.probes:
            self.probes.load_state_dict(state["probes"])
        if self.reference and "coverage_reference" in state:
            self.reference.load_state_dict(state["coverage_reference"])
        elif self.reference:  # a checkpoint written without the reading starts its window here
            self.reference.sync(self.learner.model)
            self.record.reference_step = self.learner.step

    # -- hooks -------------------------------------------------------------------------------------------
    def on_resume(self, trainer, step: int) -> None:
        # Encoders of probe points after the checkpoint belong to work the resume throws away.
        for saved, path in saved_encoders(trainer.run_dir).items():
            if saved > step:
                path.unlink()

    def on_train_start(self, trainer, start: int) -> None:
        # The wall time adds up every process's training up to the checkpoint it resumed from.
        self._began = time.perf_counter() - self.record.wall_time

    def on_step(self, trainer, step: StepEnd) -> None:
        d = step.out.decision
        self.record.assigned.append(d.env)
        if d.verdict == "pending":
            self.record.pending += 1
        elif d.is_event:
            self.record.events.append(d.as_dict())
        if step.logged:
            self.record.alpha_steps.append(step.done)
            self.record.alpha.append(step.per_latent[1])
        if step.every(self.cfg.probe.every) or step.boundary:
            if self.probes:
                self._probe(trainer, step.done, step.true_env if step.boundary else None)
            if self.reference:
                self._cover(step.done)

    def on_boundary(self, trainer, step: StepEnd) -> None:
        self.record.recon_matrix.append(self.heldout_errors(len(self.envs) - 1))
        encode = self.frozen_encoder.load(self.learner.model.encoder.state_dict())
        self.record.stage_codes.append(encode(self.held_out[step.true_env]).tolist())  # for stage_code_errors
        self.record.disentanglement.append(
            disentanglement_scores(self.test_envs, encode, step.true_env, self.cfg.probe.seed))

    def on_checkpoint(self, trainer) -> None:
        # Only what a checkpoint holds counts: work a kill throws away is not timed (docs/reliability.md).
        self.record.wall_time = time.perf_counter() - self._began

    def _probe(self, trainer, step: int, finished_env: int | None) -> None:
        # The encoder and the slots at every probe point are kept, so `vase eval` can recompute
        # these exact numbers under either reading (docs/probes.md).
        weights = self.learner.model.encoder.state_dict()
        save_weights(encoder_path(trainer.run_dir, step), weights)
        slots = SlotReading.of(self.learner)
        save_weights(slots_path(trainer.run_dir, step), slots.state_dict())
        encode = self.frozen_encoder.load(weights)
        if self.cfg.probe.reading == "sample":
            encode = PosteriorSamples(encode, slots, self.cfg.probe.seed + step)
        self.probes.evaluate(encode, step)
        if finished_env is not None:
            self.probes.mark_boundary(finished_env, step)

    def _cover(self, step: int) -> None:
        """Eq. 7's coverage of every environment whose stage ended before the window began and
        whose slot is dreamt (vase.dream_coverage), then the window starts again here."""
        since = self.record.reference_step
        dreamt = set(self.learner.inference.dream_environments())
        generator = torch.Generator(device=self.learner.device).manual_seed(self.cfg.probe.seed + step)
        for i, row in enumerate(self.inferred_environments()):
            slot = row["inferred_env"]
            if self.stream.ends[i] > since or slot not in dreamt:
                continue
            c = coverage(self.learner.model, self.reference, self.held_out[i], slot, self.learner.mask(slot), generator)
            self.record.dream_coverage.append(
                {"step": step, "since": since, "true_env": row["true_env"], "slot": slot, **c.as_dict()})
        self.reference.sync(self.learner.model)
        self.record.reference_step = step

    def covered_at(self, step: int) -> list[dict]:
        """The dream-coverage readings taken at `step` (none where no window ended there). Called
        every step: readings are appended in step order, so only the tail is read."""
        rows = self.record.dream_coverage
        first = len(rows)
        while first and rows[first - 1]["step"] == step:
            first -= 1
        return rows[first:]

    def probed_at(self, step: int) -> dict[str, float]:
        """The probe values of the evaluation at `step`, or none if the probes did not run there."""
        if self.probes and self.probes.history and self.probes.history[-1][0] == step:
            return self.probes.history[-1][1]
        return {}

    # -- measurements ------------------------------------------------------------------------------------
    @torch.no_grad()
    def heldout_errors(self, upto: int) -> list[float]:
        """Held-out reconstruction error (nats per image) of each true environment up to `upto`,
        under the slot the classifier picks for it (0 when S is off), decoded from mu."""
        return [self.learner.reconstruction_error(x, self.learner.infer_slot(x)) for x in self.held_out[: upto + 1]]

    def cross_domain_errors(self, upto: int) -> list[list[float]]:
        """[i][s]: held-out error (nats per image) of true environment i, up to `upto`, decoded under
        every allocated slot s with a^s (the paper's cross-domain reconstruction, Fig. 4B, as numbers).
        Eq. 6's reconstruction test reads one entry of a row against kappa * L_s; the row shows
        which slots would explain the data, which is what decides a merge."""
        slots = range(max(1, self.learner.inference.n_envs))
        return [[self.learner.reconstruction_error(x, s) for s in slots] for x in self.held_out[: upto + 1]]

    def stage_code_errors(self, slots: list[int]) -> list[float | None]:
        """[i]: held-out error (nats per image) of stage i's environment now under the slot it trained
        in (`slots`), decoded from the codes the encoder gave its images at the end of its stage. Against
        the same error from today's codes it splits what the slot lost since its stage: this much is
        the decoder's (and the mask's) doing, the rest the shared encoder's drift on real images
        (docs/regime.md, "The slot or the shared encoder"). None for a stage not finished yet. The
        codes come through the frozen encoder, so `vase eval` rebuilds them bit for bit from the
        encoders saved at the stage ends (`codes_from_saved_encoders`)."""
        codes = [torch.tensor(c, device=self.learner.device) for c in self.record.stage_codes]
        return [self.learner.reconstruction_error(x, s, codes[i]) if i < len(codes) else None
                for i, (x, s) in enumerate(zip(self.held_out, slots))]

    def codes_from_saved_encoders(self, run_dir) -> None:
        """Rebuild the stage codes from the encoders saved at the stage ends (`vase eval` on a run
        whose checkpoint predates them): the same numbers the run computes at its boundaries."""
        saved = saved_encoders(run_dir)
        codes = []
        for stage, end in enumerate(e for e in self.stream.ends if e <= self.learner.step):
            if end not in saved:
                break
            encode = self.frozen_encoder.load(load_weights(saved[end]))
            codes.append(encode(self.held_out[stage]).tolist())
        self.record.stage_codes = codes

    @torch.no_grad()
    def latent_use(self, slots: list[int]) -> list[dict]:
        """Per true environment, at the end, as the paper reads Fig. 3's latent-use matrix: the slot
        it was trained under (`slots`, the majority of its steps), the latents that slot used while
        it trained (its running usage, in nats of information, above used_kl; with S off, slot 0's
        usage at the end), that slot's mask, and, on the environment's held-out images now, the
        mean KL of each latent and the unmasked latents above used_kl.

        KL alone can be met without information: a latent whose mean is shifted by a constant costs
        KL but tells the decoder nothing. So each row also has the information of each latent,
        mean KL minus the atypicality alpha (eq. 4), an estimate of I(x; z_n) (E_x KL(q(z_n|x) || p)
        = I(x; z_n) + KL(q(z_n) || p)), and the unmasked latents whose information is above used_kl.
        Last, for each factor other than the class (x and y on the digits), the latents whose
        posterior samples correlate most strongly with it (`vase.metrics.factor_latents`)."""
        rows = []
        used_kl = self.cfg.inference.used_kl
        frozen = self.frozen_encoder.load(self.learner.model.encoder.state_dict())
        for env, test_env, x, slot in zip(self.envs, self.test_envs, self.held_out, slots):
            post = self.learner.model.encoder(x)
            kl = kl_per_latent(post.mu, post.logvar).mean(0)
            info = information(kl, atypicality(post.mu, post.logvar))
            mask = self.learner.mask(slot)
            rows.append({
                "true_env": env.name, "slot": slot,
                "used_in_training": self.learner.inference.used(slot).nonzero().flatten().tolist(),
                # The running usage itself, so a reader can count "used" at any threshold: the
                # count at used_kl is one reading of it, not the only sensible one.
                "usage_per_latent": _per_latent(self.learner.slots[slot].usage),
                "masked": (mask == 0).nonzero().flatten().tolist(),
                "kl_per_latent": _per_latent(kl),
                "info_per_latent": _per_latent(info),
                "active": ((kl > used_kl) & mask.bool()).nonzero().flatten().tolist(),
                "informative": ((info > used_kl) & mask.bool()).nonzero().flatten().tolist(),
                # Fig. 2-3's position claim: which latents carry x and y in each environment. Read
                # through the frozen encoder, as the probes are, so `vase eval` recomputes it exactly.
                "factor_latents": factor_latents(test_env, frozen, x),
            })
        return rows

    def inferred_environments(self) -> list[dict]:
        """For each true environment: the slot most of its steps went to, and the allocation delay."""
        rows, start = [], 0
        assigned = torch.tensor(self.record.assigned, dtype=torch.long)
        for env, end in zip(self.envs, self.stream.ends):
            seg = assigned[start:end]
            if len(seg) == 0:
                break
            majority = int(torch.mode(seg).values)
            first = int((seg == majority).nonzero()[0])
            rows.append({
                "true_env": env.name,
                "inferred_env": majority,
                "share": float((seg == majority).float().mean()),
                "delay_steps": first,
            })
            start = end
        return rows

    def slot_tables(self) -> tuple[list[int], list[dict], list[list[float]]]:
        """For the environments seen so far: the slot each trained under, its latent-use row and its
        cross-domain errors. Computed once per step: the last boundary's figures and `results` both
        read them at the end of a run (several passes over the held-out sets)."""
        if self._slot_tables is None or self._slot_tables[0] != self.learner.step:
            trained = [row["inferred_env"] for row in self.inferred_environments()]
            self._slot_tables = (self.learner.step, trained, self.latent_use(trained),
                                 self.cross_domain_errors(len(trained) - 1))
        return self._slot_tables[1:]

    # -- results.json ------------------------------------------------------------------------------------
    def results(self, begun: int | None = None) -> dict:
        """What results.json holds; `begun` limits Table 1 to the environments a run in progress
        has begun (`ProbeSuite.results`, `vase.in_progress`)."""
        inferred = self.inferred_environments()
        _, use, cross = self.slot_tables()
        cfg, learner = self.cfg, self.learner
        rule_names = list(rules.chosen(cfg))
        out = {
            "ablation": cfg.ablation(),
            "rules": cfg.inference.rules,
            "rules_without": cfg.inference.without,
            "rule_names": rule_names,
            "gamma": cfg.objective.gamma,
            "capacity_form": cfg.objective.capacity_form,
            "capacity_max": cfg.objective.capacity_max,
            "capacity_ramp_steps": cfg.objective.capacity_ramp_steps,
            "new_env_ramp_steps": cfg.objective.new_env_ramp_steps,
            "snapshot_every": cfg.dream.snapshot_every,
            "sync_at_allocation": cfg.dream.sync_at_allocation,
            "dream_weights": [cfg.dream.encoder_weight, cfg.dream.decoder_weight],
            "dream_images": cfg.dream.images,
            "pending_batches_train": "frozen_while_pending" not in rule_names,
            "mode": cfg.objective.mode,
            "preset": cfg.preset,
            "sequence": cfg.data.sequence,
            "steps_per_env": cfg.data.env_steps(),
            "seed": cfg.train.seed,
            "steps": learner.step,
            "wall_time_s": round(self.record.wall_time, 1),
            "device": describe(learner.device),
            "host": host(),
            # The route decides the last bits of every gradient, so it is part of what reproduces a run.
            "weight_gradients": kernels.route(cfg.model.weight_grad_kernel, cfg.model.channels),
            "environments_inferred": learner.inference.n_envs,
            "environments_true": len(set(cfg.data.sequence)),
            "inferred_vs_true": inferred,
            "inference_events": self.record.events,
            "pending_batches": self.record.pending,
            # inference.counterfactuals: per rule acting on the verdict alone, the batches it decided.
            "rule_activity": learner.inference.activity,
            "final_masks": learner.slots.stack("mask")[: max(1, learner.inference.n_envs)].int().tolist(),
            "heldout_reconstruction_matrix": self.record.recon_matrix,
            "cross_domain_errors": cross,
            "own_slot_errors_stage_codes": self.stage_code_errors([row["inferred_env"] for row in inferred]),
            "latent_use": use,
            "disentanglement": self.record.disentanglement,
            "dream_coverage": self.record.dream_coverage,
        }
        if self.probes:
            out["probes"] = self.probes.results(begun)
        return out
