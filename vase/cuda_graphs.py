"""CUDA graphs of the networks' passes in a training step (`train.cuda_graphs`, docs/devices.md).

The paper preset's step is bound by kernel launches on a GPU, not by arithmetic: the SDA step
launches ~450 kernels for ~2 ms of GPU work. The encoder's and the decoder's forward and backward
passes, and the snapshot's passes that dream (eq. 7), are the largest runs of launches with no
decision of eq. 6 inside them, so each is captured once per input shape and replayed as one launch.

A replay writes its outputs, and the activations its backward reads, into buffers of the graph.
Two rules keep that sound:
- a network's graph is replayed at most once per training step (`new_step`): a second pass in the
  same step (eq. 6 decoding a second candidate environment) runs eagerly, so the pass whose output
  the loss uses always finds its own activations;
- only training passes with gradient at a captured shape replay; evaluation passes, the no-grad
  passes and other shapes run eagerly.
"""
from __future__ import annotations

import warnings
from typing import Callable

import torch
from torch import nn


def capture_key(args: tuple[torch.Tensor, ...]) -> tuple:
    """What a capture is valid for: each input's shape, dtype and whether it requires grad."""
    return tuple((tuple(a.shape), a.dtype, a.requires_grad) for a in args)


class GraphedPasses:
    """A network's training pass: a CUDA graph replay where the rules above allow, else its eager
    forward. The module itself is left as it was (its forward, deep copies of it)."""

    def __init__(self, module: nn.Module, warmup: int = 3):
        self.module = module
        self.warmup = warmup
        self.graphs: dict[tuple, Callable] = {}
        self.replayed = False  # in this step

    def new_step(self) -> None:
        self.replayed = False

    def _capture(self, args: tuple[torch.Tensor, ...]) -> Callable:
        """Capture forward and backward at these inputs' shapes (warm-up passes on a side stream;
        they compute gradients with torch.autograd.grad, so no parameter's .grad changes)."""
        samples = tuple(a.detach().clone().requires_grad_(a.requires_grad) for a in args)
        try:
            with warnings.catch_warnings():  # the warm-up's backward runs on a side stream, by design
                warnings.filterwarnings("ignore", message="The AccumulateGrad node's stream")
                torch.cuda.make_graphed_callables(self.module, samples, num_warmup_iters=self.warmup)
            return self.module.forward  # the replay, which make_graphed_callables installs as forward
        finally:
            vars(self.module).pop("forward", None)  # the module keeps its own forward

    def __call__(self, *args: torch.Tensor):
        if self.replayed or not (torch.is_grad_enabled() and self.module.training):
            return self.module(*args)
        key = capture_key(args)
        if key not in self.graphs:
            self.graphs[key] = self._capture(args)
        self.replayed = True
        return self.graphs[key](*args)


class GraphedNoGrad:
    """A function of tensors without gradient (the snapshot's dream passes), captured per input
    shape and replayed. Its outputs are the graph's buffers, overwritten by the next replay: a
    training step uses its dreams before it dreams again."""

    def __init__(self, fn: Callable, warmup: int = 3):
        self.fn, self.warmup = fn, warmup
        self.graphs: dict[tuple, tuple] = {}

    def _capture(self, args: tuple[torch.Tensor, ...]) -> tuple:
        inputs = tuple(a.clone() for a in args)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.no_grad():  # warm-up: cuDNN's choices happen outside the capture
            for _ in range(self.warmup):
                self.fn(*inputs)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph), torch.no_grad():
            outputs = self.fn(*inputs)
        return graph, inputs, outputs

    def __call__(self, *args: torch.Tensor):
        key = capture_key(args)
        if key not in self.graphs:
            self.graphs[key] = self._capture(args)
        graph, inputs, outputs = self.graphs[key]
        for buffer, a in zip(inputs, args):
            buffer.copy_(a)
        graph.replay()
        return outputs


def usable(device: torch.device, precision: str, compiled: bool) -> bool:
    """CUDA graphs apply on CUDA, in fp32 eager (autocast's cache and torch.compile's own graphs do
    not mix with them)."""
    return device.type == "cuda" and precision == "fp32" and not compiled
