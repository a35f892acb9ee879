"""The training loop over a sequence of environments: stream, probes, logging, checkpoints."""
from __future__ import annotations

import json
import shutil
import signal
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.tensorboard import SummaryWriter
from tqdm.auto import tqdm

from vase import kernels
from vase.checkpoint import has_checkpoint, load_checkpoint, save_checkpoint, save_weights, write_atomic
from vase.config import Config
from vase.data.environments import load_sequence
from vase.device import configure_determinism, describe
from vase.errors import CheckpointError, NumericalError, VaseError
from vase.evaluation import (
    ENCODER_DIR,
    FrozenEncoder,
    disentanglement_scores,
    encoder_path,
    factor_latents,
    held_out_images,
)
from vase.learner import Learner, StepOutput
from vase.masking import atypicality, information
from vase.objective import kl_per_latent
from vase.probing import PosteriorSamples, ProbeSuite
from vase.stream import Stream
from vase.visualize import mask_image, reconstruction_grid, traversal_grid

PANEL = 8  # images per environment in the reconstruction and traversal panels


class InterruptBetweenSteps:
    """Ctrl-C (SIGINT) during training takes effect between two steps, not inside one.

    A KeyboardInterrupt raised at an arbitrary bytecode can land inside a library's critical
    section, for example inside TensorBoard's event writer, whose close() in the loop's `finally`
    needs the same locks. In CI a grid run once did not stop within the grid's 30 s grace after
    its SIGINT and was killed before it printed how to resume; we could not reproduce it, and this
    is the likely cause. So the handler only records the request, and the loop raises
    KeyboardInterrupt at the next step boundary, at most one step (or one probe, boundary
    evaluation or checkpoint) later. A second Ctrl-C interrupts at once, for a user who will not
    wait, but only from REPEAT_AFTER_S on: a Ctrl-C in the terminal of `vase grid` reaches its runs
    directly and again, milliseconds later, from the grid, and that is one request. Outside the
    main thread, where Python cannot install signal handlers, and where SIGINT
    is ignored (a parent asked for that), nothing changes.
    """

    REPEAT_AFTER_S = 1.0

    def __init__(self):
        self.requested = False
        self._first = 0.0

    def _handle(self, signum, frame):
        if not self.requested:
            self.requested, self._first = True, time.monotonic()
        elif time.monotonic() - self._first >= self.REPEAT_AFTER_S:
            raise KeyboardInterrupt

    def install(self):
        """Take over SIGINT; returns the function that gives the previous handler back."""
        if threading.current_thread() is not threading.main_thread() or \
                signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
            return lambda: None
        previous = signal.signal(signal.SIGINT, self._handle)
        return lambda: signal.signal(signal.SIGINT, previous)

    def check(self) -> None:
        if self.requested:
            raise KeyboardInterrupt


def _per_latent(values: torch.Tensor) -> list[float]:
    """A per-latent reading (nats) for results.json, to 4 decimals."""
    return [round(float(v), 4) for v in values]


def run_dir_for(cfg: Config, run_dir: str | None, root: str = "runs") -> Path:
    if run_dir:
        return Path(run_dir)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    name = cfg.ablation().replace("[", "").replace("]", "")
    return Path(root) / f"{stamp}-{name}-{cfg.objective.mode}-seed{cfg.train.seed}"


def check_run_dir(path: Path, resume: bool = False, overwrite: bool = False) -> None:
    """Refuse a run directory that cannot be used, before anything is loaded or written."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise VaseError(f"run directory {path} exists and is not a directory")
    if resume or not (path.exists() and any(path.iterdir())):
        return
    if not overwrite:
        raise VaseError(
            f"run directory {path} already exists; pass --resume {path} to continue it or --overwrite to replace it"
        )
    if not (path / "config.json").is_file():  # --overwrite deletes vase runs only, never other folders
        raise VaseError(f"refusing to --overwrite {path}: it is not a vase run directory (it has no config.json)")


def prepare_run_dir(path: Path, cfg: Config, resume: bool = False, overwrite: bool = False) -> None:
    """Create a new run directory holding config.json, written before the first step so that a run
    killed at any later moment can be resumed. Call it once the data has loaded, so that bad input
    leaves no directory behind."""
    check_run_dir(path, resume, overwrite)
    path = Path(path)
    if resume:
        return
    if path.exists() and any(path.iterdir()):
        shutil.rmtree(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise VaseError(f"cannot create run directory {path} ({e.strerror or e})") from e
    write_atomic(path / "config.json", cfg.to_json().encode())


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

    @classmethod
    def empty(cls) -> "RunRecord":
        return cls([], [], 0, [], [], [], [], 0.0)


class Trainer:
    def __init__(self, cfg: Config, run_dir: Path, progress: bool = True, device: torch.device | str = "cpu"):
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.progress = progress and cfg.train.progress
        self.device = torch.device(device)
        if cfg.train.threads > 0:
            torch.set_num_threads(cfg.train.threads)
        configure_determinism(self.device, cfg.train.deterministic)
        # The images live on the device as uint8; batches are drawn and converted there.
        self.envs = [env.to(self.device) for env in load_sequence(cfg.data, "train", progress=self.progress)]
        self.test_envs = [env.to(self.device) for env in load_sequence(cfg.data, "test", progress=self.progress)]
        self.stream = Stream(self.envs, cfg.data.env_steps(), cfg.train.batch_size)
        # Probes see the encoder exactly as `vase eval` rebuilds it from the saved weights (a plain
        # Encoder, not the trained one's channels_last copy), so both give bit-identical numbers.
        # Built before the Learner, which then seeds the global RNG for its own weights.
        self.frozen_encoder = FrozenEncoder(cfg.model, self.device)
        self.learner = Learner(cfg, self.device)
        self.probes = ProbeSuite(self.test_envs, cfg.probe) if cfg.probe.enabled else None
        self.record = RunRecord.empty()
        self.held_out = [held_out_images(env) for env in self.test_envs]
        self.writer: SummaryWriter | None = None
        self.last_checkpoint: int | None = None
        self._slot_tables: tuple | None = None  # (step, slots, latent use, cross-domain errors)

    # -- state -----------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "learner": self.learner.state_dict(),
            "record": vars(self.record).copy(),
            "probes": self.probes.state_dict() if self.probes else {},
        }

    def load_state_dict(self, state: dict) -> None:
        """The state of a checkpoint, with nothing on disk changed (`vase inspect` reads runs so)."""
        self.learner.load_state_dict(state["learner"])
        self.record = RunRecord(**state["record"])
        if self.probes:
            self.probes.load_state_dict(state["probes"])

    def resume(self) -> int:
        """Restore the newest good checkpoint and return its step (0 for a run killed before its first).

        Everything that must continue bit for bit is in the checkpoint: weights, optimizers, masks,
        inference state, the learner's generator and the global torch RNG, the run record and the
        probe history. What a killed run wrote after its checkpoint is dropped: encoders saved at
        later probe points here, TensorBoard events via purge_step in `train`.
        """
        if not has_checkpoint(self.run_dir):
            warnings.warn(f"{self.run_dir} was stopped before its first checkpoint; training it again from step 0")
            self._discard_after(0)
            return 0
        state, _ = load_checkpoint(self.run_dir)  # on the CPU; each part moves to its device
        self.load_state_dict(state)
        self.last_checkpoint = self.learner.step
        self._discard_after(self.learner.step)
        return self.learner.step

    def _discard_after(self, step: int) -> None:
        for path in (self.run_dir / "checkpoints" / ENCODER_DIR).glob("step-*.pt"):
            if int(path.stem.split("-")[1]) > step:
                path.unlink()
        if step == 0:
            shutil.rmtree(self.run_dir / "tb", ignore_errors=True)

    def checkpoint(self) -> None:
        # Events up to this step reach the disk with the checkpoint; later ones are purged on resume.
        self.writer.flush()
        try:
            save_checkpoint(
                self.run_dir, self.state_dict(), {"step": self.learner.step, "ablation": self.cfg.ablation()}
            )
        except CheckpointError as e:
            raise CheckpointError(f"{e} ({self._checkpoint_note()})") from None
        self.last_checkpoint = self.learner.step

    # -- the loop ----------------------------------------------------------------------------------------
    def train(self, resume: bool = False) -> dict:
        start = self.resume() if resume else 0
        # Every event of step t is logged at t + 1 (steps done), so the checkpoint at `start` holds
        # the events up to `start`; purge_step drops those a killed run logged after it.
        self.writer = SummaryWriter(str(self.run_dir / "tb"), purge_step=start + 1 if start else None)
        total = self.stream.total_steps
        began = time.perf_counter() - self.record.wall_time
        bar = tqdm(total=total, initial=start, disable=not self.progress, desc="vase train", unit="step")
        interrupt = InterruptBetweenSteps()
        restore_sigint = interrupt.install()
        try:
            for step in range(start, total):
                interrupt.check()  # a Ctrl-C that came during the previous step stops the run here
                x = self.stream.batch(step, self.learner.generator)
                try:
                    out = self.learner.training_step(x)
                except NumericalError as e:
                    raise NumericalError(f"{e}; {self._checkpoint_note()}") from None
                self._record(out)
                true_env = self.stream.env_index(step)
                boundary = self.stream.is_boundary(step)
                if (step + 1) % self.cfg.train.log_every == 0 or boundary:
                    self._log_scalars(out, true_env)
                    bar.set_postfix(env=f"{true_env}->{out.decision.env}", loss=f"{out.losses['total']:.1f}")
                if (step + 1) % self.cfg.train.image_every == 0:
                    self._log_reconstructions(step + 1, true_env)
                if self.probes and ((step + 1) % self.cfg.probe.every == 0 or boundary):
                    self._probe(step + 1, true_env if boundary else None)
                if boundary:
                    self._boundary(step + 1, true_env)
                self.record.wall_time = time.perf_counter() - began
                if boundary or (step + 1) % self.cfg.train.checkpoint_every == 0:
                    self.checkpoint()
                bar.update(1)
        finally:
            bar.close()
            self.writer.close()
            restore_sigint()
        results = self.results()
        write_atomic(self.run_dir / "results.json", json.dumps(results, indent=2).encode())
        return results

    def _checkpoint_note(self) -> str:
        if self.last_checkpoint is None:
            return "no checkpoint had been written yet"
        return f"last good checkpoint: step {self.last_checkpoint} in {self.run_dir / 'checkpoints'}"

    # -- bookkeeping ------------------------------------------------------------------------------------
    def _record(self, out: StepOutput) -> None:
        d = out.decision
        self.record.assigned.append(d.env)
        if d.verdict == "pending":
            self.record.pending += 1
        elif d.verdict != "same":
            self.record.events.append(d.as_dict())
            if d.verdict in ("first", "new", "full"):
                restored = "" if d.restored is None else \
                    f"; environment {d.restored} was left on probation and its statistics restored"
                self.writer.add_text(
                    "inference/events",
                    f"step {d.step}: {d.verdict} -> environment {d.env} (predicted {d.predicted}; "
                    f"failed on: {', '.join(d.reasons) or '-'}; error {d.error:.1f} vs threshold {d.threshold:.1f}; "
                    f"mask or usage disagreed on latents {d.disagreeing or '-'}; "
                    f"tried: {'; '.join(f'{env}: ' + (', '.join(r) or 'passed') for env, r in d.tried) or '-'}"
                    f"{restored})",
                    d.step + 1,
                )

    def _log_scalars(self, out: StepOutput, true_env: int) -> None:
        w, t = self.writer, out.step + 1
        for name, value in out.losses.items():
            w.add_scalar(f"loss/{name}", value, t)
        w.add_scalar("capacity/C", out.extra["capacity"], t)
        w.add_scalar("inference/assigned_env", out.decision.env, t)
        w.add_scalar("inference/true_env", true_env, t)
        w.add_scalar("inference/n_envs", self.learner.inference.n_envs, t)
        # One host read for the three per-latent readings (they may live on an accelerator).
        kl, alpha, mask = torch.stack([out.kl_per_latent, out.alpha, out.mask]).tolist()
        for n, (k, a, m) in enumerate(zip(kl, alpha, mask)):
            w.add_scalar(f"kl/z{n:02d}", k, t)
            w.add_scalar(f"atypicality/z{n:02d}", a, t)
            w.add_scalar(f"mask/z{n:02d}", m, t)
        self.record.alpha_steps.append(t)
        self.record.alpha.append(alpha)

    def _log_reconstructions(self, step: int, true_env: int) -> None:
        for i in range(true_env + 1):
            x = self.held_out[i][:PANEL]
            slot = self.learner.infer_slot(x)
            self.writer.add_image(
                f"reconstruction/{self.envs[i].name}",
                reconstruction_grid(x, self.learner.reconstruct_mean(x, slot)),
                step,
            )

    def _probe(self, step: int, finished_env: int | None) -> None:
        # The encoder at every probe point is kept, so `vase eval` can recompute these exact numbers.
        weights = self.learner.model.encoder.state_dict()
        save_weights(encoder_path(self.run_dir, step), weights)
        encode = self.frozen_encoder.load(weights)
        if self.cfg.probe.reading == "sample":
            encode = PosteriorSamples(encode, self.learner, self.cfg.probe.seed + step)
        values = self.probes.evaluate(encode, step)
        for name, value in values.items():
            self.writer.add_scalar(f"probe/{name}", value, step)
        if finished_env is not None:
            self.probes.mark_boundary(finished_env, step)

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

    def _boundary(self, step: int, true_env: int) -> None:
        self.record.recon_matrix.append(self.heldout_errors(len(self.envs) - 1))
        encode = self.frozen_encoder.load(self.learner.model.encoder.state_dict())
        scores = disentanglement_scores(self.test_envs, encode, true_env, self.cfg.probe.seed)
        self.record.disentanglement.append(scores)
        for env, values in scores["scores"].items():
            for name, value in values.items():
                self.writer.add_scalar(f"disentanglement/{env}/{name}", value, step)
        self._log_reconstructions(step, true_env)
        for i in range(true_env + 1):
            slot = self.learner.infer_slot(self.held_out[i][:PANEL])
            grid = traversal_grid(self.learner, self.held_out[i][0], slot, self.cfg.inference.used_kl)
            self.writer.add_image(f"traversal/{self.envs[i].name}", grid, step)
        self.writer.add_image(
            "mask/environments", mask_image(self.learner.slots.stack("mask"), self.learner.inference.n_envs), step
        )
        self._log_figures(step)

    def _log_figures(self, step: int) -> None:
        from vase.figures import run_figures

        for name, fig in run_figures(self).items():
            self.writer.add_image(f"figures/{name}", fig, step, dataformats="HWC")

    # -- results ------------------------------------------------------------------------------------------
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

    def results(self) -> dict:
        inferred = self.inferred_environments()
        _, use, cross = self.slot_tables()
        out = {
            "ablation": self.cfg.ablation(),
            "rules": self.cfg.inference.rules,
            "capacity_form": self.cfg.objective.capacity_form,
            "mode": self.cfg.objective.mode,
            "preset": self.cfg.preset,
            "sequence": self.cfg.data.env_names(),
            "steps_per_env": self.cfg.data.env_steps(),
            "seed": self.cfg.train.seed,
            "steps": self.learner.step,
            "wall_time_s": round(self.record.wall_time, 1),
            "device": describe(self.device),
            # The route decides the last bits of every gradient, so it is part of what reproduces a run.
            "weight_gradients": kernels.route(self.cfg.model.weight_grad_kernel),
            "environments_inferred": self.learner.inference.n_envs,
            "environments_true": len(set(self.cfg.data.env_names())),
            "inferred_vs_true": inferred,
            "inference_events": self.record.events,
            "pending_batches": self.record.pending,
            "final_masks": self.learner.slots.stack("mask")[: max(1, self.learner.inference.n_envs)].int().tolist(),
            "heldout_reconstruction_matrix": self.record.recon_matrix,
            "cross_domain_errors": cross,
            "latent_use": use,
            "disentanglement": self.record.disentanglement,
        }
        if self.probes:
            out["probes"] = self.probes.results()
        return out
