"""The training loop over a sequence of environments and its checkpoints.

Evaluation (`vase.evaluator`) and TensorBoard logging (`vase.tensorboard_logger`) subscribe to
the loop's hook points as callbacks (`vase.callbacks`).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
import warnings
from pathlib import Path
from typing import Callable

import torch

from vase.branching import branch_origin
from vase.callbacks import Callback, StepEnd
from vase.checkpoint import has_checkpoint, load_checkpoint, save_checkpoint, write_atomic
from vase.config import Config
from vase.data.environments import load_sequence
from vase.device import configure_denormals, configure_determinism
from vase.errors import CheckpointError, NumericalError, VaseError
from vase.evaluation import FrozenEncoder
from vase.evaluator import Evaluator
from vase.learner import Learner
from vase.progress_bar import progress_bar
from vase.progress_file import ProgressFile
from vase.stream import Stream
from vase.tensorboard_logger import TensorBoardLogger

# The clock of train.checkpoint_minutes; a module name, so that tests can drive it.
now = time.monotonic


class InterruptBetweenSteps:
    """Ctrl-C (SIGINT) or SIGTERM during training takes effect between two steps, not inside one.

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
        """Take over SIGINT and SIGTERM (a scheduler's stop, e.g. Slurm's at a job's time limit);
        returns the function that gives the previous handlers back."""
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        # An ignored signal stays ignored (a parent asked for that), and one whose handler was not
        # set from Python (getsignal gives None) is left alone, since it could not be given back.
        previous = {sig: handler for sig in (signal.SIGINT, signal.SIGTERM)
                    if (handler := signal.getsignal(sig)) not in (signal.SIG_IGN, None)}
        for sig in previous:
            signal.signal(sig, self._handle)

        def restore():
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return restore


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


def prepare_run_dir(path: Path, cfg: Config, resume: bool = False, overwrite: bool = False,
                    fill: Callable[[Path], None] | None = None) -> None:
    """Create a new run directory holding config.json, written before the first step so that a run
    killed at any later moment can be resumed. Call it once the data has loaded, so that bad input
    leaves no directory behind. `fill` writes what the run starts from (a branch's checkpoint) into
    a hidden staging folder beside it, which is renamed into place with its config.json, so that a
    kill while it copies leaves no half-filled run, only staging that the next attempt replaces."""
    check_run_dir(path, resume, overwrite)
    path = Path(path)
    if resume:
        return
    if path.exists() and any(path.iterdir()):
        shutil.rmtree(path)
    staged = fill is not None
    staging = path.with_name(f".{path.name}.partial") if staged else path
    try:
        if staged and staging.exists():
            shutil.rmtree(staging)
        staging.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise VaseError(f"cannot create run directory {path} ({e.strerror or e})") from e
    if staged:
        fill(staging)
    write_atomic(staging / "config.json", cfg.to_json().encode())
    if staged:
        if path.exists():
            path.rmdir()  # empty: a folder the user made for the run
        os.replace(staging, path)


class Trainer:
    """The loop over a sequence of environments and its checkpoints; all else is a `Callback`.

    `callbacks` are the subscribers besides the run's `Evaluator`, which always comes first and
    whose results `train` returns (default: a `TensorBoardLogger` and the run's progress file,
    `vase.progress_file`; `[]` writes neither).
    """

    def __init__(self, cfg: Config, run_dir: Path, progress: bool = True, device: torch.device | str = "cpu",
                 callbacks: list[Callback] | None = None):
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.progress = progress and cfg.train.progress
        self.device = torch.device(device)
        if cfg.train.threads > 0:
            torch.set_num_threads(cfg.train.threads)
        configure_determinism(self.device, cfg.train.deterministic)
        configure_denormals(cfg.train.flush_denormals)
        # The images live on the device as uint8; batches are drawn and converted there.
        self.envs = [env.to(self.device) for env in load_sequence(cfg.data, "train", progress=self.progress)]
        test_envs = [env.to(self.device) for env in load_sequence(cfg.data, "test", progress=self.progress)]
        self.stream = Stream(self.envs, cfg.data.env_steps(), cfg.train.batch_size)
        # Built before the Learner, which then seeds the global RNG for its own weights.
        frozen_encoder = FrozenEncoder(cfg.model, self.device)
        self.learner = Learner(cfg, self.device)
        self.evaluator = Evaluator(cfg, self.learner, self.envs, test_envs, self.stream, frozen_encoder)
        self.callbacks = [self.evaluator, *([TensorBoardLogger(), ProgressFile()] if callbacks is None else callbacks)]
        self.last_checkpoint: int | None = None
        self.checkpointed_at = now()

    def _call(self, hook: str, *args) -> None:
        for callback in self.callbacks:
            getattr(callback, hook)(self, *args)

    # -- state -----------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        state = {"learner": self.learner.state_dict()}
        for callback in self.callbacks:
            part = callback.state_dict()
            taken = sorted(part.keys() & state.keys())
            if taken:  # one callback's state would overwrite another's
                raise ValueError(f"{type(callback).__name__} reuses the checkpoint entries {taken}")
            state.update(part)
        return state

    def load_state_dict(self, state: dict) -> None:
        """The state of a checkpoint, with nothing on disk changed (`vase inspect` reads runs so)."""
        self.learner.load_state_dict(state["learner"])
        for callback in self.callbacks:
            callback.load_state_dict(state)

    def resume(self) -> int:
        """Restore the newest good checkpoint and return its step (0 for a run killed before its first).

        Everything that must continue bit for bit is in the checkpoint: weights, optimizers, masks,
        inference state, the learner's generator and the global torch RNG, and the callbacks' state
        (the evaluator's run record and probe history). What a killed run wrote after its
        checkpoint is dropped by the callbacks that wrote it (`Callback.on_resume`).
        """
        if not has_checkpoint(self.run_dir):
            warnings.warn(f"{self.run_dir} was stopped before its first checkpoint; training it again from step 0")
            self._call("on_resume", 0)
            return 0
        state, _ = load_checkpoint(self.run_dir)  # on the CPU; each part moves to its device
        self.load_state_dict(state)
        self.last_checkpoint = self.learner.step
        self._call("on_resume", self.learner.step)
        return self.learner.step

    def checkpoint(self, keep: bool = False) -> None:
        """Save the run's state; with `keep` (a stage end, or train.keep_every) it also stays for good
        (`vase.checkpoint`)."""
        self._call("on_checkpoint")
        try:
            save_checkpoint(
                self.run_dir, self.state_dict(), {"step": self.learner.step, "ablation": self.cfg.ablation()}, keep
            )
        except CheckpointError as e:
            raise CheckpointError(f"{e} ({self._checkpoint_note()})") from None
        self.last_checkpoint = self.learner.step
        self.checkpointed_at = now()

    def _checkpoint_due(self) -> bool:
        """train.checkpoint_minutes of wall clock have passed since the last checkpoint (or the start):
        a run killed without a chance to checkpoint (SIGKILL, a lost node) loses at most that much."""
        minutes = self.cfg.train.checkpoint_minutes
        return minutes > 0 and now() - self.checkpointed_at >= 60 * minutes

    # -- the loop ----------------------------------------------------------------------------------------
    def train(self, resume: bool = False, until: int | None = None) -> dict | None:
        """Train to the sequence's end and return the results; or, with `until` before the end,
        train to step `until`, checkpoint there and return None: a paused run that `resume`
        continues exactly (how `vase grid --share-first-stage` stops its sources at a stage end)."""
        start = self.resume() if resume else 0
        self.checkpointed_at = now()
        self._call("on_train_start", start)
        total = self.stream.total_steps
        pause = until is not None and until < total
        stop = max(start, until) if pause else total
        bar = progress_bar(total, "vase train", initial=start, disable=not self.progress)
        interrupt = InterruptBetweenSteps()
        restore_sigint = interrupt.install()
        try:
            for t in range(start, stop):
                if interrupt.requested:  # a Ctrl-C or SIGTERM that came during the previous step
                    self._stop_between_steps()
                x = self.stream.batch(t, self.learner.generator)
                try:
                    out = self.learner.training_step(x)
                except NumericalError as e:
                    raise NumericalError(f"{e}; {self._checkpoint_note()}") from None
                boundary = self.stream.is_boundary(t)
                step = StepEnd(out, self.stream.env_index(t), boundary,
                               logged=(t + 1) % self.cfg.train.log_every == 0 or boundary)
                self._call("on_step", step)
                if step.logged:
                    # the next redraw shows it: a log gets a line a minute, not one per logged step
                    bar.set_postfix(env=f"{step.true_env}->{out.decision.env}", loss=f"{out.losses['total']:.1f}",
                                    refresh=False)
                if boundary:
                    self._call("on_boundary", step)
                keep = boundary or self.cfg.train.keeps(step.done)
                if keep or step.every(self.cfg.train.checkpoint_every) or self._checkpoint_due():
                    self.checkpoint(keep=keep)
                bar.update(1)
            if pause and self.learner.step > (self.last_checkpoint or 0):
                self.checkpoint()
        finally:
            bar.close()
            self._call("on_train_end")
            restore_sigint()
        if pause:
            return None
        results = self.evaluator.results() | {"branch": branch_origin(self.run_dir)}
        write_atomic(self.run_dir / "results.json", json.dumps(results, indent=2).encode())
        return results

    def _stop_between_steps(self) -> None:
        """Checkpoint the steps trained since the last checkpoint, then stop: an interrupted run, or
        one a cluster's scheduler ends with SIGTERM at its time limit, resumes where it stopped
        instead of up to `train.checkpoint_every` steps earlier. Between two steps the state is a
        checkpoint's like any other, so the resume is as exact."""
        if self.learner.step > (self.last_checkpoint or 0):
            try:
                self.checkpoint()
            except CheckpointError as e:
                warnings.warn(f"{e}; stopping without it")
        raise KeyboardInterrupt

    def _checkpoint_note(self) -> str:
        if self.last_checkpoint is None:
            return "no checkpoint had been written yet"
        return f"last good checkpoint: step {self.last_checkpoint} in {self.run_dir / 'checkpoints'}"
