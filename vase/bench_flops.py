"""`vase bench`: FLOPs of a step from its layer shapes, and this machine's peak (docs/benchmarks.md)."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from vase import conv_paths
from vase.config import ModelConfig
from vase.networks import IMAGE_SIZE, Decoder, Encoder, EnvironmentClassifier

MATMUL_N = 2048
# The dense conv microbenchmark: 3x3, 128 -> 128 channels, 16x16, batch 64, channels_last.
CONV_SHAPE = (64, 128, 16, 16)


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
    saved = conv_paths.run_stack
    conv_paths.run_stack = lambda stack, h, *route: stack(h)
    try:
        with torch.no_grad():
            module(*example)
    finally:
        conv_paths.run_stack = saved
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


