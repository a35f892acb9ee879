"""`vase bench`: what is timed: synthetic data, the learner's step and a straightforward reference
step, each variant built in this process or in a plain child process (docs/benchmarks.md)."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.nn import functional as F

from vase import conv_paths
from vase import learner as learner_module
from vase.bench_flops import PassRecorder
from vase.config import Config, ModelConfig, build_config
from vase.conv_paths import use_implementation
from vase.errors import ConfigError
from vase.learner import Learner
from vase.networks import IMAGE_SIZE, he_init
from vase.objective import capacity, kl_per_latent, mdl_loss
from vase.stream import Stream

WARMUP_STEPS = 3
SYNTHETIC_IMAGES = 4096


# =====================================================================================================
# What is timed
# =====================================================================================================
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


class ReferenceVAE(nn.Module):
    """The straightforward implementation of the same networks: nn.Sequential, default NCHW format."""

    def __init__(self, m: ModelConfig):
        super().__init__()
        ch = m.channel_list()
        c, r = [m.image_channels, *ch], [*reversed(ch), m.image_channels]
        feat = ch[-1] * (IMAGE_SIZE // 16) ** 2
        enc: list[nn.Module] = []
        for a, b in zip(c[:-1], c[1:]):
            enc += [nn.Conv2d(a, b, 4, 2, 1), nn.ReLU()]
        self.encoder = nn.Sequential(*enc, nn.Flatten(), nn.Linear(feat, m.hidden), nn.ReLU(),
                                     nn.Linear(m.hidden, 2 * m.latents))
        dec: list[nn.Module] = [nn.Linear(m.latents + m.k_max, m.hidden), nn.ReLU(), nn.Linear(m.hidden, feat),
                                nn.ReLU(), nn.Unflatten(1, (ch[-1], IMAGE_SIZE // 16, IMAGE_SIZE // 16))]
        for i, (a, b) in enumerate(zip(r[:-1], r[1:])):
            dec.append(nn.ConvTranspose2d(a, b, 4, 2, 1))
            if i < len(r) - 2:
                dec.append(nn.ReLU())
        self.decoder = nn.Sequential(*dec)
        he_init(self)


def reference_from(model: nn.Module, m: ModelConfig) -> ReferenceVAE:
    """A ReferenceVAE holding the weights of a vase VAE (the same function, computed plainly)."""
    ref = ReferenceVAE(m)
    enc_linear = [i for i, mod in enumerate(ref.encoder) if isinstance(mod, nn.Linear)]
    dec_linear = [i for i, mod in enumerate(ref.decoder) if isinstance(mod, nn.Linear)]
    enc_conv = [i for i, mod in enumerate(ref.encoder) if isinstance(mod, nn.Conv2d)]
    dec_conv = [i for i, mod in enumerate(ref.decoder) if isinstance(mod, nn.ConvTranspose2d)]
    pairs = list(zip(enc_conv, [c for c, _ in conv_paths._layers(model.encoder.convs)]))
    pairs += list(zip(enc_linear, [model.encoder.fc, model.encoder.head]))
    with torch.no_grad():
        for i, src in pairs:
            ref.encoder[i].weight.copy_(src.weight)
            ref.encoder[i].bias.copy_(src.bias)
        for i, src in zip(dec_linear + dec_conv, [model.decoder.fc1, model.decoder.fc2,
                                                   *[c for c, _ in conv_paths._layers(model.decoder.deconvs)]]):
            ref.decoder[i].weight.copy_(src.weight)
            ref.decoder[i].bias.copy_(src.bias)
    return ref


class ReferenceStep:
    """One plain-VAE step of the reference: encode, reparameterise, decode under env 0, the same MDL
    loss (eq. 3), Adam."""

    def __init__(self, cfg: Config, device: torch.device | str = "cpu"):
        torch.manual_seed(cfg.train.seed)
        self.cfg = cfg
        self.model = ReferenceVAE(cfg.model).to(device)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=cfg.train.lr)
        self.step = 0

    def training_step(self, x: torch.Tensor) -> float:
        mu, logvar = self.model.encoder(x).chunk(2, dim=1)
        z = mu + (0.5 * logvar).exp() * torch.randn_like(mu)
        onehot = torch.zeros(x.shape[0], self.cfg.model.k_max, device=x.device)
        onehot[:, 0] = 1.0
        logits = self.model.decoder(torch.cat([z, onehot], dim=1))
        recon = F.binary_cross_entropy_with_logits(logits, x, reduction="none").flatten(1).sum(1)
        loss = mdl_loss(recon, kl_per_latent(mu, logvar).sum(1), capacity(self.step, self.cfg.objective),
                        self.cfg.objective)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        self.step += 1
        return float(loss.detach())


@dataclass
class Spec:
    """A picklable description of one timed variant (built in this process or in the plain child)."""

    key: str
    label: str
    preset: str
    kind: str = "learner"  # "learner", "reference" or "loop"
    ablation: str = "-"
    overrides: tuple[str, ...] = ()
    implementation: str = "fast"
    n_envs: int = 0  # >0: prepare_environments(learner, n_envs)
    process: str = "main"  # "main" (allocator tuned, current code) or "plain" (a fresh default process)
    threads: int = 0  # >0: torch threads while this variant runs (0: the run's setting)
    # The routes of the current code, or the earlier ones for before/after figures:
    transposed_weight_grad: str = "swapped"  # conv_paths.TRANSPOSED_WEIGHT_GRAD
    fused_adam: bool = True  # learner.FUSED_ADAM


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
                # What Trainer._record / _log_scalars do with a step's output (every step here).
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


# =====================================================================================================
# The plain child process: the code as it was before the speed work, in a default process
# =====================================================================================================
def _worker_main() -> None:
    """Child process loop (`python -c "from vase.bench_steps import _worker_main; _worker_main()"`): build
    variants and time steps on request, pickled messages over stdin/stdout. glibc's allocator is left
    at its defaults here (conv_paths.keep_freed_memory is not applied), as in a process that never tuned it."""
    import pickle

    conv_paths._allocator_tuned = True
    # The protocol owns the original stdout; anything printed goes to stderr.
    reply = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    requests = sys.stdin.buffer
    variants: dict[str, Variant] = {}
    while True:
        try:
            msg = pickle.load(requests)
        except EOFError:
            return
        try:
            if msg[0] == "quit":
                answer = ("ok", None)
            elif msg[0] == "threads":
                if msg[1] > 0:
                    torch.set_num_threads(msg[1])
                answer = ("ok", torch.get_num_threads())
            elif msg[0] == "build":
                variants[msg[1].key] = Variant(msg[1])
                answer = ("ok", None)
            elif msg[0] == "run":
                answer = ("ok", variants[msg[1]].run(msg[2]))
            elif msg[0] == "info":
                answer = ("ok", variants[msg[1]].info())
            else:
                answer = ("error", f"unknown request {msg[0]!r}")
        except Exception as e:  # report to the parent instead of hanging it
            answer = ("error", f"{type(e).__name__}: {e}")
        pickle.dump(answer, reply)
        reply.flush()
        if msg[0] == "quit":
            return


class PlainProcess:
    """A fresh Python process running `_worker_main`; it runs only while this process waits for it, so
    the two never compete for the cores."""

    def __init__(self, threads: int):
        import pickle

        self._pickle = pickle
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from vase.bench_steps import _worker_main; _worker_main()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        )
        # The same thread count as this process (the library default is the same in both).
        self.call("threads", threads if threads > 0 else torch.get_num_threads())

    def call(self, *msg):
        self._pickle.dump(msg, self.proc.stdin)
        self.proc.stdin.flush()
        try:
            status, value = self._pickle.load(self.proc.stdout)
        except EOFError:
            raise RuntimeError(f"the bench child process exited (code {self.proc.poll()})") from None
        if status != "ok":
            raise RuntimeError(f"bench child process: {value}")
        return value

    def close(self) -> None:
        try:
            self.call("quit")
        except (OSError, RuntimeError, EOFError):
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class RemoteVariant:
    def __init__(self, spec: Spec, plain: PlainProcess):
        self.spec, self.plain = spec, plain
        plain.call("build", spec)

    def run(self, n: int) -> list[dict]:
        return self.plain.call("run", self.spec.key, n)

    def info(self) -> dict:
        return self.plain.call("info", self.spec.key)


