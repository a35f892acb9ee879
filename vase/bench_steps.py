"""`vase bench`: what is timed: synthetic data, and the learner's (or the reference's) step built
from a Spec and timed one step at a time, or inside a trainer-like loop (docs/benchmarks.md)."""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable

import torch

from vase import conv_paths
from vase import learner as learner_module
from vase.bench_flops import PassRecorder
from vase.bench_reference import ReferenceStep
from vase.bench_variants import Spec
from vase.config import build_config
from vase.conv_paths import use_implementation
from vase.errors import ConfigError
from vase.learner import Learner
from vase.networks import IMAGE_SIZE
from vase.stream import Stream

WARMUP_STEPS = 3
SYNTHETIC_IMAGES = 4096


class SyntheticEnvironment:
    """Environment-like: uint8 (N, 1, 64, 64) images, batches gathered and converted like the real one."""

    name = "synthetic"

    def __init__(self, n: int, channels: int = 1, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        # Sparse bright blobs, roughly like sprites on a black canvas.
        self.images = ((torch.rand(n, channels, IMAGE_SIZE, IMAGE_SIZE, generator=g) < 0.1) * 255).to(torch.uint8)

    def __len__(self) -> int:
        return self.images.shape[0]

    def batch(self, idx: torch.Tensor) -> torch.Tensor:
        return self.images[idx].float().div_(255)


def prepare_environments(learner, n_envs: int) -> None:
    """Put a fresh learner in the state of a run that has allocated `n_envs` environments and is
    training the last one, so every step is a "same" verdict with dreams of the other n_envs - 1:
    huge running errors L_s (the reconstruction test passes), no latent usage yet (the mask test
    agrees), and a classifier that names the current environment (as a trained one would)."""
    cfg = learner.cfg
    if n_envs > cfg.model.k_max:
        raise ConfigError(f"{n_envs} environments need model.k_max >= {n_envs}")
    inf = learner.inference
    inf.n_envs, inf.current, inf.pending = n_envs, n_envs - 1, 0
    for s in range(n_envs):  # a fresh learner's slots have no usage yet
        inf.slots[s].error, inf.slots[s].recorded = torch.tensor(1e12, device=learner.device), True
        inf.start(s, torch.zeros(cfg.model.latents, device=learner.device), None)
    with torch.no_grad():
        learner.classifier.linear.bias[n_envs - 1] += 50.0
    learner.snapshot.sync(learner.model)


@contextmanager
def _num_threads(n: int):
    """torch.set_num_threads(n) for the duration (n = 0: unchanged)."""
    before = torch.get_num_threads()
    if n > 0:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if n > 0:
            torch.set_num_threads(before)


class Variant:
    """Builds the learner (or reference) of a Spec and times single steps on synthetic data."""

    def __init__(self, spec: Spec):
        self.spec = spec
        with self._settings():
            self._build()

    @contextmanager
    def _settings(self):
        """The variant's thread count and code routes, for its build and each of its runs."""
        saved = conv_paths.TRANSPOSED_WEIGHT_GRAD, learner_module.FUSED_ADAM
        conv_paths.TRANSPOSED_WEIGHT_GRAD, learner_module.FUSED_ADAM = (
            self.spec.transposed_weight_grad,
            self.spec.fused_adam,
        )
        try:
            with _num_threads(self.spec.threads):
                yield
        finally:
            conv_paths.TRANSPOSED_WEIGHT_GRAD, learner_module.FUSED_ADAM = saved

    def _build(self) -> None:
        spec = self.spec
        cfg = build_config(spec.preset, list(spec.overrides), spec.ablation if spec.kind != "reference" else "-")
        self.cfg = cfg
        self.generator = torch.Generator().manual_seed(1)
        self.stream = Stream([SyntheticEnvironment(SYNTHETIC_IMAGES, cfg.model.image_channels)], [10**9],
                             cfg.train.batch_size)
        self.t = 0
        self.verdicts: dict[str, int] = {}
        self.passes: list[tuple[str, int, bool]] = []
        if spec.kind == "reference":
            self.learner = ReferenceStep(cfg)
        else:
            self.learner = Learner(cfg)
            use_implementation(self.learner.model, spec.implementation)
            use_implementation(self.learner.snapshot.model, spec.implementation)
            if spec.n_envs:
                prepare_environments(self.learner, spec.n_envs)
        for _ in range(WARMUP_STEPS):
            self._one()
        if spec.kind != "reference":
            recorder = PassRecorder(self.learner)
            self._one()
            recorder.close()
            self.passes = recorder.passes
        self.verdicts = {}

    def _batch(self) -> torch.Tensor:
        x = self.stream.batch(self.t, self.generator)
        self.t += 1
        return x

    def _one(self) -> dict:
        x = self._batch()
        c0, t0 = time.process_time(), time.perf_counter()
        out = self.learner.training_step(x)
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        if self.spec.kind != "reference":
            self.verdicts[out.decision.verdict] = self.verdicts.get(out.decision.verdict, 0) + 1
        return {"step": dt, "cpu": dc}

    def run(self, n: int) -> list[dict]:
        with self._settings():
            if self.spec.kind == "loop":
                return LoopTimer(self).run(n)
            return [self._one() for _ in range(n)]

    def info(self) -> dict:
        return {"verdicts": dict(self.verdicts), "passes": self.passes}


class LoopTimer:
    """A Trainer-like loop iteration (stream batch, learner step, bookkeeping and logging-like float()
    conversions) with the time inside the networks measured by wrapping, for the duration of the run,
    the network forwards, torch.autograd.backward and the optimizers' steps; the loss formulas are
    timed by wrapping the objective functions the learner calls."""

    OBJECTIVE = ("atypicality", "kl_per_latent", "masked_kl", "masked_sample", "mdl_loss", "reconstruction_nll",
                 "encoder_proximity", "decoder_proximity")

    def __init__(self, variant: Variant):
        self.v = variant
        self.acc = {"nets": 0.0, "objective": 0.0}

    def _wrap(self, fn: Callable, bucket: str) -> Callable:
        acc = self.acc

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                acc[bucket] += time.perf_counter() - t0
        return timed

    def run(self, n: int) -> list[dict]:
        import vase.learner as learner_module

        learner = self.v.learner
        patched: list[tuple[object, str, object, bool]] = []

        def patch(obj, name, bucket):
            own = name in vars(obj)
            original = getattr(obj, name)
            patched.append((obj, name, vars(obj).get(name), own))
            setattr(obj, name, self._wrap(original, bucket))

        for model in (learner.model, learner.snapshot.model):
            patch(model.encoder, "forward", "nets")
            patch(model.decoder, "forward", "nets")
        patch(learner.classifier, "forward", "nets")
        patch(learner.optimizer, "step", "nets")
        patch(learner.classifier_optimizer, "step", "nets")
        patch(torch.autograd, "backward", "nets")
        for name in self.OBJECTIVE:
            if hasattr(learner_module, name):
                patch(learner_module, name, "objective")
        rows = []
        try:
            for _ in range(n):
                self.acc["nets"] = self.acc["objective"] = 0.0
                c0, t0 = time.process_time(), time.perf_counter()
                x = self.v.stream.batch(self.v.t, learner.generator)
                self.v.t += 1
                t1 = time.perf_counter()
                out = learner.training_step(x)
                t2 = time.perf_counter()
                # What the Evaluator and TensorBoardLogger callbacks do with a step's output (every step here).
                self.v.verdicts[out.decision.verdict] = self.v.verdicts.get(out.decision.verdict, 0) + 1
                logged = [float(v) for v in out.kl_per_latent] + [float(a) for a in out.alpha]
                logged += [float(m) for m in out.mask] + list(out.losses.values())
                t3 = time.perf_counter()
                nets, objective = self.acc["nets"], self.acc["objective"]
                rows.append({
                    "step": t3 - t0, "cpu": time.process_time() - c0, "data": t1 - t0,
                    "nets": nets, "objective": objective,
                    "bookkeeping": (t2 - t1) - nets - objective, "logging": t3 - t2,
                })
        finally:
            for obj, name, value, own in reversed(patched):
                if own:
                    setattr(obj, name, value)
                else:
                    delattr(obj, name)
        return rows
