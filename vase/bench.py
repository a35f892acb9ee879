"""`vase bench`: how fast is a training step on this machine, and why (docs/benchmarks.md).

One run measures, for each preset:

1. training throughput of the plain CCI-VAE step ("-") and of the full VASE step (SDA) with past
   environments (dreaming on), and their ratio;
2. analytic FLOPs of each step (from the layer shapes of the passes the step actually ran) and the
   achieved FLOP/s as a fraction of this machine's peak, measured in the same run by a dense matmul
   and a dense conv microbenchmark;
3. the share of a trainer-like loop iteration spent outside the networks (data gather, inference
   bookkeeping, logging conversions);
4. the VASE step with 1 versus 8 past environments;
5. the peak resident memory of a default training run (a subprocess), and what the data occupies;

plus, side by side, the code before the speed work (the "channels_last" layer implementation with
glibc's default allocator, run in a plain child process) and a straightforward NCHW PyTorch
implementation of the same networks and loss, so every speed-up is a ratio measured in one run.

All timings are interleaved round-robin (variant A, B, C, A, B, C, ...) and reported as medians, so
a load that comes and goes affects every variant alike; absolute numbers still depend on what else
the machine runs (the load average is recorded with the results).
"""
from __future__ import annotations

import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn
from torch.nn import functional as F

from vase import kernels, networks
from vase import learner as learner_module
from vase.config import Config, ModelConfig, build_config
from vase.errors import ConfigError
from vase.learner import Learner
from vase.networks import IMAGE_SIZE, Decoder, Encoder, EnvironmentClassifier, he_init, use_implementation
from vase.objective import capacity, kl_per_latent, mdl_loss
from vase.stream import Stream

# The targets (docs/benchmarks.md explains each).
TARGETS = {
    "paper_plain_fraction_of_matmul_peak": 0.70,  # plain step of the paper preset, >= this
    "cpu_speedup_vs_reference": 1.3,  # cpu preset plain step vs the straightforward NCHW one, >=
    "vase_cost_over_flop_ratio": 1.1,  # (SDA time / plain time) / (SDA FLOPs / plain FLOPs), <=
    "outside_model_fraction": 0.10,  # of a trainer-like loop iteration, <
    "eight_vs_one_env": 1.10,  # step time with 8 past environments / with 1, <=
    "peak_memory_bytes": 3 * 1024**3,  # default training run, <
}
WARMUP_STEPS = 3
SYNTHETIC_IMAGES = 4096
MATMUL_N = 2048
# The dense conv microbenchmark: 3x3, 128 -> 128 channels, 16x16, batch 64, channels_last.
CONV_SHAPE = (64, 128, 16, 16)
LOAD_NOTE = (
    "Absolute numbers depend on what else this machine runs (see the load average); every ratio "
    "compares variants timed interleaved in this run (medians)."
)


# =====================================================================================================
# FLOP counting from layer shapes
# =====================================================================================================
@dataclass
class LayerCost:
    name: str
    kind: str  # "conv", "deconv" or "linear"
    macs: int  # multiply-accumulates for ONE example


def layer_costs(module: nn.Module, *example: torch.Tensor) -> list[LayerCost]:
    """MACs per example of every conv, transposed conv and linear layer of `module`, in call order,
    from the shapes seen in one no-grad forward of `example` (a batch of one).

    conv: each output element costs Cin/groups * kh * kw MACs; transposed conv: each INPUT element
    is spread over Cout/groups * kh * kw outputs; linear: each output costs in_features MACs.
    """
    costs: list[LayerCost] = []
    handles = []

    def hook(name):
        def record(mod, inputs, output):
            if isinstance(mod, nn.ConvTranspose2d):
                kh, kw = mod.kernel_size
                macs = inputs[0][0].numel() * (mod.out_channels // mod.groups) * kh * kw
                costs.append(LayerCost(name, "deconv", macs))
            elif isinstance(mod, nn.Conv2d):
                kh, kw = mod.kernel_size
                macs = output[0].numel() * (mod.in_channels // mod.groups) * kh * kw
                costs.append(LayerCost(name, "conv", macs))
            else:
                costs.append(LayerCost(name, "linear", output[0].numel() * mod.in_features))
        return record

    for name, mod in module.named_modules():
        if isinstance(mod, (nn.Conv2d, nn.ConvTranspose2d, nn.Linear)):
            handles.append(mod.register_forward_hook(hook(name)))
    # The "fast" layers call the conv weights functionally; run the stacks as modules so hooks fire.
    saved = networks.run_stack
    networks.run_stack = lambda stack, h, *route: stack(h)
    try:
        with torch.no_grad():
            module(*example)
    finally:
        networks.run_stack = saved
        for h in handles:
            h.remove()
    return costs


def pass_flops(costs: list[LayerCost], batch: int, train: bool, input_grad: bool = True) -> float:
    """FLOPs of one pass over `batch` examples: 2 per MAC forward; a trained pass adds the backward,
    an input gradient and a weight gradient per layer (2x the forward), minus the first layer's input
    gradient when its input needs none (data, or a detached hidden layer)."""
    fwd = 2.0 * batch * sum(c.macs for c in costs)
    if not train:
        return fwd
    bwd = 2.0 * fwd
    if not input_grad and costs:
        bwd -= 2.0 * batch * costs[0].macs
    return fwd + bwd


@dataclass
class ModelCosts:
    encoder: list[LayerCost]
    decoder: list[LayerCost]
    classifier: list[LayerCost]

    @classmethod
    def of(cls, m: ModelConfig) -> "ModelCosts":
        x = torch.zeros(1, m.image_channels, IMAGE_SIZE, IMAGE_SIZE)
        z, env = torch.zeros(1, m.latents), torch.zeros(1, dtype=torch.long)
        return cls(
            layer_costs(Encoder(m), x),
            layer_costs(Decoder(m), z, env),
            layer_costs(EnvironmentClassifier(m), torch.zeros(1, m.hidden)),
        )

    def flops(self, role: str, batch: int, train: bool) -> float:
        # The encoder's input is data and the classifier's input is detached: no input gradient.
        return pass_flops(getattr(self, role), batch, train, input_grad=role == "decoder")


class PassRecorder:
    """Records (role, batch, trained) of every encoder/decoder/classifier pass a learner runs, so the
    step's FLOPs are counted for the passes that actually happened."""

    def __init__(self, learner):
        self.passes: list[tuple[str, int, bool]] = []
        self.handles = []
        for model, trained in ((learner.model, True), (learner.snapshot.model, False)):
            for role in ("encoder", "decoder"):
                self._watch(getattr(model, role), role, trained)
        self._watch(learner.classifier, "classifier", True)

    def _watch(self, mod: nn.Module, role: str, trained: bool) -> None:
        def record(m, inputs, output):
            self.passes.append((role, int(inputs[0].shape[0]), trained and torch.is_grad_enabled()))
        self.handles.append(mod.register_forward_hook(record))

    def close(self) -> None:
        for h in self.handles:
            h.remove()


# =====================================================================================================
# Peak microbenchmarks
# =====================================================================================================
class Peaks:
    """Dense matmul and dense conv throughput, sampled between the rounds of the step timings."""

    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.a = torch.randn(MATMUL_N, MATMUL_N, generator=g)
        self.b = torch.randn(MATMUL_N, MATMUL_N, generator=g)
        b, c, h, w = CONV_SHAPE
        self.x = torch.randn(CONV_SHAPE, generator=g).contiguous(memory_format=torch.channels_last)
        self.w = torch.randn(c, c, 3, 3, generator=g).contiguous(memory_format=torch.channels_last)
        self.conv_flops = 2.0 * b * h * w * c * c * 9
        self.mm: list[float] = []
        self.conv: list[float] = []
        torch.mm(self.a, self.b)
        F.conv2d(self.x, self.w, padding=1)

    def sample(self, reps: int = 2) -> None:
        for _ in range(reps):
            t0 = time.perf_counter()
            torch.mm(self.a, self.b)
            self.mm.append(2.0 * MATMUL_N**3 / (time.perf_counter() - t0))
            t0 = time.perf_counter()
            F.conv2d(self.x, self.w, padding=1)
            self.conv.append(self.conv_flops / (time.perf_counter() - t0))

    def summary(self) -> dict:
        return {
            "matmul": {"what": f"torch.mm {MATMUL_N}x{MATMUL_N} float32", "peak_flops": max(self.mm),
                       "median_flops": statistics.median(self.mm), "samples": len(self.mm)},
            "conv": {"what": f"conv2d 3x3 {CONV_SHAPE[1]}->{CONV_SHAPE[1]} on {CONV_SHAPE} channels_last float32",
                     "peak_flops": max(self.conv), "median_flops": statistics.median(self.conv),
                     "samples": len(self.conv)},
        }


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
    inf.n_envs, inf.current = n_envs, n_envs - 1
    inf.errors[:n_envs] = 1e12
    inf.recorded[:n_envs] = True
    inf.usage.zero_()
    inf.pending, inf.settling_since = 0, -(10**9)
    for s in range(n_envs):
        learner.masks.start(s, torch.zeros(cfg.model.latents, device=learner.device))
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
    pairs = list(zip(enc_conv, [c for c, _ in networks._layers(model.encoder.convs)]))
    pairs += list(zip(enc_linear, [model.encoder.fc, model.encoder.head]))
    with torch.no_grad():
        for i, src in pairs:
            ref.encoder[i].weight.copy_(src.weight)
            ref.encoder[i].bias.copy_(src.bias)
        for i, src in zip(dec_linear + dec_conv, [model.decoder.fc1, model.decoder.fc2,
                                                   *[c for c, _ in networks._layers(model.decoder.deconvs)]]):
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
    transposed_weight_grad: str = "swapped"  # networks.TRANSPOSED_WEIGHT_GRAD
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
        saved = networks.TRANSPOSED_WEIGHT_GRAD, learner_module.FUSED_ADAM
        networks.TRANSPOSED_WEIGHT_GRAD, learner_module.FUSED_ADAM = (
            self.spec.transposed_weight_grad,
            self.spec.fused_adam,
        )
        try:
            with _num_threads(self.spec.threads):
                yield
        finally:
            networks.TRANSPOSED_WEIGHT_GRAD, learner_module.FUSED_ADAM = saved

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
    """Child process loop (`python -c "from vase.bench import _worker_main; _worker_main()"`): build
    variants and time steps on request, pickled messages over stdin/stdout. glibc's allocator is left
    at its defaults here (networks.keep_freed_memory is not applied), as in a process that never tuned it."""
    import pickle

    networks._allocator_tuned = True
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
            [sys.executable, "-c", "from vase.bench import _worker_main; _worker_main()"],
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


# =====================================================================================================
# Peak memory of a default training run
# =====================================================================================================
def _train_child(steps: int, env: dict[str, str], echo: Callable[[str], None], what: str) -> dict:
    """Run `vase train --steps STEPS` (every other setting at its default) in a child process and
    return its exit code, wall time and peak resident set size (ru_maxrss from wait4: that child's own,
    not the maximum over every child of this process)."""
    with tempfile.TemporaryDirectory(prefix="vase-bench-") as tmp:
        cmd = [sys.executable, "-c", "import sys; from cli import main; sys.argv[0] = 'vase'; main()",
               "train", "--steps", str(steps), "--run-dir", str(Path(tmp) / "run"), "--no-progress"]
        echo(f"  memory: vase train --steps {steps} ({what}) in a child process ...")
        t0 = time.perf_counter()
        with open(Path(tmp) / "train.log", "w+") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=os.getcwd(),
                                    env={**os.environ, **env})
            _, status, usage = os.wait4(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(status)
            log.seek(0)
            tail = log.read()[-2000:]
    out = {"returncode": proc.returncode, "wall_s": time.perf_counter() - t0,
           # Linux reports ru_maxrss in KiB.
           "peak_rss_bytes": usage.ru_maxrss * 1024}
    if proc.returncode != 0:
        out["error"] = tail
    return out


def measure_memory(steps: int, echo: Callable[[str], None], compare: bool = True) -> dict:
    """Peak memory of the default training run (`vase train --steps STEPS`), what its data occupies,
    and (compare) the same run with glibc's default allocator settings (VASE_KEEP_FREED_MEMORY=0)."""
    cfg = build_config("cpu", [f"data.steps_per_env={steps}"])
    out = {"command": f"vase train --steps {steps} --no-progress (run dir in a temporary folder)",
           **_train_child(steps, {}, echo, "defaults"), "data_bytes": None}
    if out["returncode"] != 0:
        return out
    if compare:
        out["without_kept_memory"] = _train_child(steps, {networks.KEEP_FREED_MEMORY_ENV: "0"}, echo,
                                                  f"{networks.KEEP_FREED_MEMORY_ENV}=0")
    try:
        out["data_bytes"], out["data_detail"] = _data_bytes(cfg)
    except Exception as e:  # the figure is informative only
        out["data_error"] = f"{type(e).__name__}: {e}"
    return out


def _data_bytes(cfg: Config) -> tuple[int, dict]:
    """Bytes of the images and factors the default run loads (train and test splits, from the cache
    the child just filled)."""
    from vase.data.environments import load_sequence

    detail, total = {}, 0
    for split in ("train", "test"):
        for env in load_sequence(cfg.data, split, progress=False):
            n = env.images.element_size() * env.images.nelement()
            n += sum(int(a.nbytes) for a in env.factors.values())
            detail[f"{env.name}/{split}"] = n
            total += n
    return total, detail


# =====================================================================================================
# The run
# =====================================================================================================
def machine_info() -> dict:
    cpu = ""
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and not cpu:
                cpu = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    cpu = cpu or platform.processor() or "unknown"
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "cpu_model": cpu,
        "cores": os.cpu_count(),
        "simd": [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile") if f in flags],
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "native_kernels": kernels.status(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load_average_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


# The weight gradients of the release before our kernel (vase/kernels).
ONEDNN_WGRAD = "model.weight_grad_kernel=onednn"


def default_specs(preset: str) -> list[Spec]:
    p = preset
    specs = [
        Spec(f"{p}/plain", 'plain step "-"', p),
        Spec(f"{p}/vase", "VASE step SDA, 2 past envs", p, ablation="SDA", n_envs=3),
        Spec(
            f"{p}/vase_1past", "SDA, 1 past env (k_max 10)", p, ablation="SDA", overrides=("model.k_max=10",), n_envs=2
        ),
        Spec(
            f"{p}/vase_8past", "SDA, 8 past envs (k_max 10)", p, ablation="SDA", overrides=("model.k_max=10",), n_envs=9
        ),
        Spec(f"{p}/loop", "trainer-like loop, SDA 2 past", p, kind="loop", ablation="SDA", n_envs=3),
        Spec(f"{p}/plain_1thread", 'plain step "-", 1 thread', p, threads=1),
        Spec(f"{p}/plain_onednn_wgrad", 'plain "-", oneDNN weight gradients', p, overrides=(ONEDNN_WGRAD,)),
        Spec(
            f"{p}/plain_nchw_wgrad",
            'plain "-", NCHW deconv wgrad + multi-tensor Adam',
            p,
            overrides=(ONEDNN_WGRAD,),
            transposed_weight_grad="nchw",
            fused_adam=False,
        ),
        Spec(
            f"{p}/plain_cl", 'plain "-", old layers + kept memory', p, implementation="channels_last", fused_adam=False
        ),
        Spec(
            f"{p}/before_plain",
            'plain "-", before (old code, plain process)',
            p,
            implementation="channels_last",
            process="plain",
            fused_adam=False,
        ),
        Spec(
            f"{p}/before_vase",
            "SDA 2 past, before (old code, plain process)",
            p,
            ablation="SDA",
            implementation="channels_last",
            n_envs=3,
            process="plain",
            fused_adam=False,
        ),
        Spec(f"{p}/reference", "reference NCHW (plain process)", p, kind="reference", process="plain"),
        Spec(f"{p}/reference_kept", "reference NCHW + kept memory (this process)", p, kind="reference"),
    ]
    return specs


def _median(rows: list[dict], key: str = "step") -> float:
    return statistics.median(r[key] for r in rows)


def _quartiles(rows: list[dict], key: str = "step") -> list[float]:
    vals = sorted(r[key] for r in rows)
    if len(vals) < 2:
        return [vals[0], vals[0]]
    q = statistics.quantiles(vals, n=4)
    return [q[0], q[2]]


def measure(specs: list[Spec], steps: int, threads: int, peaks: Peaks, echo: Callable[[str], None],
            rounds: int | None = None) -> dict[str, dict]:
    """Time every spec round-robin; return per-spec rows, info and costs."""
    # One fresh process per "plain" variant: glibc's allocator behaves as in a standalone run only if
    # no other model's activations have shaped the heap before.
    plain: list[PlainProcess] = []
    try:
        built: dict[str, object] = {}
        for s in specs:
            echo(f"  building {s.key} ...")
            if s.process == "plain":
                plain.append(PlainProcess(threads))
                built[s.key] = RemoteVariant(s, plain[-1])
            else:
                built[s.key] = Variant(s)
        rounds = rounds or max(1, min(steps, 5))
        per_round = max(1, math.ceil(steps / rounds))
        rows: dict[str, list[dict]] = {s.key: [] for s in specs}
        for r in range(rounds):
            echo(f"  round {r + 1}/{rounds} ({per_round} step(s) per variant)")
            peaks.sample()
            order = specs[r % len(specs):] + specs[: r % len(specs)]
            for s in order:
                rows[s.key] += built[s.key].run(per_round)
        peaks.sample()
        return {s.key: {"spec": s, "rows": rows[s.key], "info": built[s.key].info()} for s in specs}
    finally:
        for proc in plain:
            proc.close()


# Step-time ratios of two variants timed in the same run: (name, the slower variant, the faster one).
TIME_RATIOS = [
    ("eight_over_one_env_time", "vase_8past", "vase_1past"),
    ("speedup_vs_reference", "reference", "plain"),
    ("speedup_vs_reference_kept_memory", "reference_kept", "plain"),
    ("speedup_plain_vs_before", "before_plain", "plain"),
    ("speedup_vase_vs_before", "before_vase", "vase"),
    ("speedup_from_kept_memory", "before_plain", "plain_cl"),
    ("speedup_from_layers", "plain_cl", "plain"),
    ("speedup_from_swapped_wgrad_and_fused_adam", "plain_nchw_wgrad", "plain_onednn_wgrad"),
    ("speedup_from_native_wgrad", "plain_onednn_wgrad", "plain"),
]


def summarise_preset(preset: str, measured: dict[str, dict], peaks: Peaks) -> dict:
    batch = build_config(preset).train.batch_size
    peak_mm = max(peaks.mm)
    peak_conv = max(peaks.conv)
    out: dict = {"batch_size": batch, "variants": {}}
    for key, m in measured.items():
        spec: Spec = m["spec"]
        name = key.split("/", 1)[1]
        vcfg = build_config(preset, list(spec.overrides))
        costs = ModelCosts.of(vcfg.model)
        batch = vcfg.train.batch_size
        passes = m["info"].get("passes") or []
        if spec.kind == "reference":
            flops = costs.flops("encoder", batch, True) + costs.flops("decoder", batch, True)
        else:
            flops = sum(costs.flops(role, b, trained) for role, b, trained in passes)
        med = _median(m["rows"])
        v = {
            "label": spec.label, "process": spec.process, "implementation": spec.implementation,
            "threads": spec.threads or None,
            "ablation": spec.ablation, "n_envs": spec.n_envs, "overrides": list(spec.overrides),
            "steps_timed": len(m["rows"]), "median_step_s": med, "quartiles_step_s": _quartiles(m["rows"]),
            # CPU time of the timing process (all its threads): less sensitive to other processes
            # than wall time, but it counts OpenMP spin-waiting and page-fault handling too.
            "median_cpu_s": _median(m["rows"], "cpu"),
            "images_per_s": batch / med, "flops_per_step": flops, "flops_per_s": flops / med,
            "fraction_of_matmul_peak": flops / med / peak_mm, "fraction_of_conv_peak": flops / med / peak_conv,
            "passes": [list(p) for p in passes], "verdicts": m["info"].get("verdicts", {}),
        }
        if spec.kind == "loop":
            sections = {k: statistics.median(r[k] for r in m["rows"]) for k in m["rows"][0] if k != "cpu"}
            outside = [(r["data"] + r["bookkeeping"] + r["logging"]) / r["step"] for r in m["rows"]]
            v["sections_median_s"] = sections
            v["outside_model_fraction"] = statistics.median(outside)
            v["objective_fraction"] = statistics.median(r["objective"] / r["step"] for r in m["rows"])
        out["variants"][name] = v
    V = out["variants"]

    def ratio(a, b):
        return V[a]["median_step_s"] / V[b]["median_step_s"]

    r = {}
    if "plain" in V and "vase" in V:
        r["vase_over_plain_time"] = ratio("vase", "plain")
        r["vase_over_plain_flops"] = V["vase"]["flops_per_step"] / V["plain"]["flops_per_step"]
        r["vase_cost_over_flop_ratio"] = r["vase_over_plain_time"] / r["vase_over_plain_flops"]
    for key, slower, faster in TIME_RATIOS:
        if slower in V and faster in V:
            r[key] = ratio(slower, faster)
    if "loop" in V:
        r["outside_model_fraction"] = V["loop"]["outside_model_fraction"]
    out["ratios"] = r
    return out


def check_targets(results: dict) -> list[dict]:
    rows = []
    P = results["presets"]

    def add(name, value, op, target, detail):
        if value is None:
            return
        met = value >= target if op == ">=" else (value <= target if op == "<=" else value < target)
        rows.append({"target": name, "value": value, "op": op, "threshold": target, "met": bool(met), "detail": detail})

    if "paper" in P and "plain" in P["paper"]["variants"]:
        add("paper plain step, fraction of matmul peak", P["paper"]["variants"]["plain"]["fraction_of_matmul_peak"],
            ">=", TARGETS["paper_plain_fraction_of_matmul_peak"], "achieved FLOP/s / max matmul FLOP/s")
    if "cpu" in P:
        add("cpu plain step, speed-up vs NCHW reference", P["cpu"]["ratios"].get("speedup_vs_reference"), ">=",
            TARGETS["cpu_speedup_vs_reference"], "reference time / our time")
    for p, res in P.items():
        rr = res["ratios"]
        add(f"{p}: VASE step cost / its FLOP ratio", rr.get("vase_cost_over_flop_ratio"), "<=",
            TARGETS["vase_cost_over_flop_ratio"], "(SDA time / plain time) / (SDA FLOPs / plain FLOPs)")
        add(f"{p}: time outside the model", rr.get("outside_model_fraction"), "<", TARGETS["outside_model_fraction"],
            "(data + bookkeeping + logging) / loop iteration")
        add(f"{p}: 8 past envs / 1 past env", rr.get("eight_over_one_env_time"), "<=", TARGETS["eight_vs_one_env"],
            "step time ratio")
    mem = results.get("memory")
    if mem and mem.get("returncode") == 0:
        add("default run peak memory (bytes)", mem["peak_rss_bytes"], "<", TARGETS["peak_memory_bytes"], "ru_maxrss")
    return rows


# =====================================================================================================
# Output
# =====================================================================================================
def _ms(s: float) -> str:
    return f"{s * 1e3:8.1f}"


def format_report(results: dict) -> str:
    m = results["machine"]
    pk = results["peaks"]
    lines = [
        f"vase bench  {m['date']}",
        f"machine: {m['cpu_model']}, {m['cores']} cores ({', '.join(m['simd'])}), torch {m['torch']}, "
        f"{m['torch_threads']} threads",
        f"our weight-gradient kernel (vase.kernels): {m.get('native_kernels', 'n/a')}",
        f"load average: start {_load(m.get('load_average_start'))}, end {_load(m.get('load_average_end'))}",
        LOAD_NOTE,
        "",
        f"peak (max of {pk['matmul']['samples']} samples taken between the rounds): "
        f"matmul {pk['matmul']['peak_flops'] / 1e9:.1f} GFLOP/s (median {pk['matmul']['median_flops'] / 1e9:.1f}); "
        f"conv {pk['conv']['peak_flops'] / 1e9:.1f} GFLOP/s (median {pk['conv']['median_flops'] / 1e9:.1f})",
    ]
    for preset, res in results["presets"].items():
        lines += ["", f"preset {preset}, batch {res['batch_size']}",
                  f"  {'variant':44s} {'ms/step':>8s} {'cpu ms':>8s} {'img/s':>7s} {'GFLOP':>7s} {'GFLOP/s':>8s} "
                  f"{'%mm':>5s} {'%conv':>6s}"]
        for name, v in res["variants"].items():
            lines.append(
                f"  {v['label'][:44]:44s} {_ms(v['median_step_s'])} {_ms(v['median_cpu_s'])} {v['images_per_s']:7.0f} "
                f"{v['flops_per_step'] / 1e9:7.2f} {v['flops_per_s'] / 1e9:8.1f} "
                f"{100 * v['fraction_of_matmul_peak']:4.0f}% {100 * v['fraction_of_conv_peak']:5.0f}%"
            )
        r = res["ratios"]
        if "plain" in res["variants"] and "fraction_of_median_matmul" in res["variants"]["plain"]:
            pv = res["variants"]["plain"]
            lines.append(f"  plain step: {100 * pv['fraction_of_matmul_peak']:.0f}% of the best matmul sample, "
                         f"{100 * pv['fraction_of_median_matmul']:.0f}% of the median one")
        if "vase_over_plain_time" in r:
            lines.append(
                f"  VASE / plain: time x{r['vase_over_plain_time']:.2f}, FLOPs x{r['vase_over_plain_flops']:.2f}"
                f" -> cost per FLOP x{r['vase_cost_over_flop_ratio']:.2f}"
            )
        if "eight_over_one_env_time" in r:
            lines.append(f"  8 past envs / 1 past env: x{r['eight_over_one_env_time']:.2f}")
        loop = res["variants"].get("loop")
        if loop:
            s = loop["sections_median_s"]
            lines.append(
                f"  loop iteration (medians, ms): data {s['data'] * 1e3:.1f}, nets {s['nets'] * 1e3:.1f}, objective "
                f"{s['objective'] * 1e3:.1f}, bookkeeping {s['bookkeeping'] * 1e3:.1f}, "
                f"logging {s['logging'] * 1e3:.2f}"
                f" -> outside the model {100 * loop['outside_model_fraction']:.1f}%"
            )
        for key, text in (("speedup_vs_reference", "speed-up vs reference NCHW"),
                          ("speedup_vs_reference_kept_memory", "speed-up vs reference NCHW with kept memory"),
                          ("speedup_plain_vs_before", "plain step speed-up vs before"),
                          ("speedup_vase_vs_before", "VASE step speed-up vs before"),
                          ("speedup_from_kept_memory", "  of which kept freed memory (old layers)"),
                          ("speedup_from_layers", "  of which the layer implementation"),
                          ("speedup_from_swapped_wgrad_and_fused_adam",
                           "  of which swapped-conv deconv weight gradients and fused Adam"),
                          ("speedup_from_native_wgrad", "  of which our weight-gradient kernel (vase.kernels)")):
            if key in r:
                lines.append(f"  {text}: x{r[key]:.2f}")
        odd = {n: v["verdicts"] for n, v in res["variants"].items()
               if v["n_envs"] and set(v["verdicts"]) - {"same"}}
        if odd:
            lines.append(f"  note: some VASE steps were not 'same' verdicts: {odd}")
    mem = results.get("memory")
    if mem:
        lines.append("")
        if mem.get("returncode") == 0:
            data = f"{mem['data_bytes'] / 2**20:.0f} MiB" if mem.get("data_bytes") else "unknown"
            lines.append(f"memory: peak RSS of `{mem['command']}`: {mem['peak_rss_bytes'] / 2**30:.2f} GiB "
                         f"({mem['wall_s']:.0f} s); data (train+test images and factors): {data}")
            base = mem.get("without_kept_memory")
            if base and base.get("returncode") == 0:
                lines.append(f"  the same run with {networks.KEEP_FREED_MEMORY_ENV}=0 (glibc defaults): "
                             f"{base['peak_rss_bytes'] / 2**30:.2f} GiB ({base['wall_s']:.0f} s)")
        else:
            lines.append(f"memory: the training child failed (exit {mem.get('returncode')}):\n{mem.get('error', '')}")
    if results.get("targets"):
        lines += ["", "targets:"]
        for t in results["targets"]:
            val = t["value"]
            shown = f"{val / 2**30:.2f} GiB" if "bytes" in t["target"] else f"{val:.3f}"
            thr = f"{t['threshold'] / 2**30:.0f} GiB" if "bytes" in t["target"] else f"{t['threshold']}"
            lines.append(f"  [{'met ' if t['met'] else 'MISS'}] {t['target']}: {shown} (target {t['op']} {thr})")
    return "\n".join(lines)


def _load(x) -> str:
    return " ".join(f"{v:.2f}" for v in x) if x else "n/a"


def _jsonable(obj):
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, Spec):
        return asdict(obj)
    return obj


def run_bench(presets: list[str], steps: int = 20, json_out: str | None = None, skip_memory: bool = False, *,
              threads: int = 0, memory_steps: int = 100, specs: dict[str, list[Spec]] | None = None,
              echo: Callable[[str], None] | None = None, log: Callable[[str], None] | None = None) -> dict:
    """Measure everything for each preset, print the table, write the JSON and return the results.

    `specs` replaces the default variants per preset (tests use a few tiny ones); `echo` prints the
    report (default: stdout) and `log` the progress (default: stderr).
    """
    echo = echo or (lambda s: print(s, flush=True))
    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    if steps < 1:
        raise ConfigError("bench --steps must be at least 1")
    if threads > 0:
        torch.set_num_threads(threads)
    networks.keep_freed_memory()
    results: dict = {"machine": machine_info(), "steps": steps, "note": LOAD_NOTE, "targets_definition": TARGETS}
    peaks = Peaks()
    peaks.sample()
    results["presets"] = {}
    for preset in presets:
        log(f"preset {preset}:")
        chosen = (specs or {}).get(preset) or default_specs(preset)
        measured = measure(chosen, steps, threads, peaks, log)
        results["presets"][preset] = summarise_preset(preset, measured, peaks)
    results["peaks"] = peaks.summary()
    # FLOP fractions use the final peak (max over every sample of the run).
    for res in results["presets"].values():
        for v in res["variants"].values():
            v["fraction_of_matmul_peak"] = v["flops_per_s"] / results["peaks"]["matmul"]["peak_flops"]
            v["fraction_of_conv_peak"] = v["flops_per_s"] / results["peaks"]["conv"]["peak_flops"]
            # The peak is the best matmul sample; the steps are medians, so they also absorb the
            # machine's typical interference. The median matmul sample is the like-for-like figure.
            v["fraction_of_median_matmul"] = v["flops_per_s"] / results["peaks"]["matmul"]["median_flops"]
    if not skip_memory:
        results["memory"] = measure_memory(memory_steps, log)
    results["machine"]["load_average_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    results["targets"] = check_targets(results)
    report = format_report(results)
    results["report"] = report
    path = Path(json_out) if json_out else Path("runs") / "bench" / f"bench-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_jsonable(results), indent=2))
    echo(report)
    echo(f"\nresults: {path}")
    results["json_path"] = str(path)
    return results
