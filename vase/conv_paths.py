"""How the networks' convolutions are computed on each device: the CPU fast paths, applied by
`place` (the one call the learner makes) or `use_implementation`.

How the convolutions are computed is an implementation choice of each Encoder/Decoder
(`implementation` attribute, see `use_implementation`); all of them compute the same function of the
same parameters (tests/test_bench.py checks this), and `vase bench` measures them side by side:

- "fast" (the default when model.channels_last is on): activations in channels_last, each conv
  layer and its ReLU are one autograd node (`_ConvReLU`) that picks the faster memory format per
  operation, the decoder's last transposed conv (to C=1 channels) is a matmul plus an
  overlap-add instead of oneDNN's slow 1-output-channel deconvolution, the weight gradient of
  the encoder's first conv (from C=1 channels) is a matmul over strided image patches, and the
  other weight gradients come from our kernel (`vase.kernels`, model.weight_grad_kernel). See
  docs/benchmarks.md.
- "channels_last": the previous implementation (everything channels_last, plain nn.Sequential).
- "nchw": plain nn.Sequential on contiguous NCHW tensors (model.channels_last off).
"""
from __future__ import annotations

import ctypes
import os
import sys

import torch
from torch import nn
from torch.nn import functional as F

from vase import kernels
from vase.config import ModelConfig

IMPLEMENTATIONS = ("fast", "channels_last", "nchw")
_CL = torch.channels_last
_aten = torch.ops.aten
# Every conv of the model: kernel 4, stride 2, padding 1.
_STRIDE, _PADDING, _DILATION = [2, 2], [1, 1], [1, 1]
# How transposed convs (with more than one output channel) compute their weight gradient:
# "swapped": as the weight gradient of the regular conv that maps the output gradient back to the
# input, in channels_last, with no layout copies; "nchw": oneDNN's transposed primitive on NCHW
# copies (channels_last is up to 2x slower there). `vase bench` times both.
TRANSPOSED_WEIGHT_GRAD = "swapped"


# -- the conv layers ------------------------------------------------------------------------------------
def _deconv_one_channel(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """conv_transpose2d(x, weight, bias, stride 2, padding 1) for a 4x4 kernel and ONE output channel.

    oneDNN runs this shape at a few GFLOP/s (the decoder's last layer), so: one matmul of the
    channels_last input (B*H*W, C) with the kernel (C, 16) gives each input pixel's 4x4 output
    patch, and four strided adds overlap the patches (output row 2i+ky-1 gets patch row ky of
    input row i; with ky = 2*dy + py it lands in padded row 2*(i+dy) + py).
    """
    B, C, H, W = x.shape
    patches = torch.mm(x.permute(0, 2, 3, 1).reshape(-1, C), weight.reshape(C, 16))
    patches = patches.view(B, H, W, 2, 2, 2, 2)  # (dy, py, dx, px)
    out = x.new_zeros(B, H + 1, 2, W + 1, 2)
    for dy in (0, 1):
        for dx in (0, 1):
            out[:, dy:dy + H, :, dx:dx + W, :] += patches[:, :, :, dy, :, dx, :].transpose(2, 3)
    out = out.view(B, 1, 2 * H + 2, 2 * W + 2)[:, :, 1:-1, 1:-1]
    if bias is not None:
        out = out + bias.view(1, 1, 1, 1)
    return out.contiguous()


def _image_patches(x: torch.Tensor) -> torch.Tensor:
    """The 4x4 patch of a ONE-channel image under every output pixel of a stride-2, padding-1 conv,
    as rows (B * H/2 * W/2, 16): patch (ky, kx) of output (oy, ox) is padded pixel (2*oy + ky, 2*ox + kx)."""
    B, _, H, W = x.shape
    padded = F.pad(x.reshape(B, H, W), (1, 1, 1, 1))
    Hp, Wp = H + 2, W + 2
    return padded.as_strided((B, H // 2, W // 2, 4, 4), (Hp * Wp, 2 * Wp, 2, Wp, 1)).reshape(-1, 16)


def _conv_one_channel_weight_grad(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Weight gradient of conv2d(x, w, stride 2, padding 1) for a 4x4 kernel and ONE input channel
    (the encoder's first layer, on the images; also the swapped form of the decoder's last layer).

    oneDNN computes this at ~6 % of the matmul peak; here the 4x4 input patch of every output pixel
    is a strided view of the padded image (patch (ky, kx) of output (oy, ox) is padded pixel
    (2*oy + ky, 2*ox + kx)), and the gradient is one matmul with the channels_last output gradient.
    """
    C = grad.shape[1]
    g = grad.permute(0, 2, 3, 1).reshape(-1, C)  # a view when grad is channels_last
    return g.t().mm(_image_patches(x)).view(C, 1, 4, 4)


class _ConvReLU(torch.autograd.Function):
    """One conv layer of a `_conv_stack` (4x4, stride 2, padding 1, groups 1, plain or transposed) and its
    optional ReLU as a single autograd node, with the memory format chosen per operation (measured by `vase bench`):

    - forward and input gradient in channels_last (faster for every layer shape here);
    - weight gradient of transposed convs as that of the swapped plain conv, in channels_last
      (`_weight_grad`; oneDNN's transposed primitive is up to 2x slower in channels_last and needs NCHW
      copies otherwise);
    - weight gradient of the one-input-channel first conv as a matmul over image patches;
    - the ReLU (`slope` 0; a leaky ReLU above 0, model.negative_slope; None: no activation) is applied
      in place and its backward reads the saved output in the same memory format as the incoming
      gradient (a mixed-format threshold_backward is ~10x slower). The output's sign is the input's
      for every slope >= 0, so the saved output gives the leaky ReLU's gradient too.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, transposed: bool, slope: float | None, native: bool):  # noqa: D401
        x = x.contiguous(memory_format=_CL)
        if transposed and weight.shape[1] == 1:
            y = _deconv_one_channel(x, weight, bias)
        else:
            y = _aten.convolution(x, weight, bias, _STRIDE, _PADDING, _DILATION, transposed, [0, 0], 1)
        if slope == 0:
            y = y.relu_()
        elif slope is not None:
            y = _aten.leaky_relu_(y, slope)
        ctx.transposed, ctx.slope, ctx.has_bias, ctx.native = transposed, slope, bias is not None, native
        ctx.save_for_backward(x, weight, None if slope is None else y)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        x, weight, y = ctx.saved_tensors
        transposed = ctx.transposed
        grad = grad.contiguous(memory_format=_CL)
        if ctx.slope == 0:
            grad = _aten.threshold_backward(grad, y, 0)
        elif ctx.slope is not None:
            grad = _aten.leaky_relu_backward(grad, y, ctx.slope, True)
        out_channels = weight.shape[1] if transposed else weight.shape[0]
        grad_x = grad_w = grad_b = None
        args = (_STRIDE, _PADDING, _DILATION, transposed, [0, 0], 1)
        if ctx.needs_input_grad[0]:
            grad_x = _aten.convolution_backward(grad, x, weight, [out_channels], *args, [True, False, False])[0]
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            grad_w, grad_b = _weight_grad(grad, x, weight, transposed, ctx.native, ctx.needs_input_grad[1],
                                          ctx.has_bias and ctx.needs_input_grad[2])
        return grad_x, grad_w, grad_b, None, None, None


def _weight_grad(grad, x, weight, transposed: bool, native: bool, want_w: bool, want_b: bool):
    """Weight and bias gradients of a 4x4 stride-2 conv layer, plain or transposed.

    - `native` (model.weight_grad_kernel = "native"), layers of at least `kernels.MIN_CHANNELS`
      channels in and out (the paper preset's; narrower ones gain nothing), 16k input channels (16k
      output channels if transposed, read swapped as below) and inputs of at least 8x8: our kernel
      (`vase.kernels.conv_weight_grad`), where it is built. oneDNN runs the paper network's 64->64
      layers at about 2/3 of the matmul peak here, the kernel at about 0.85 (docs/benchmarks.md).
    - One input channel (the first encoder conv): a patch matmul (`_conv_one_channel_weight_grad`).
    - Transposed, TRANSPOSED_WEIGHT_GRAD = "swapped": a transposed conv y = convT(x, W) has, for
      every W, the same weight gradient as the plain conv that maps y's space back to x's with the
      same W (input = grad of y, output grad = x): dW[i, o, ky, kx] = sum x[b, i, v, u] *
      grad[b, o, 2v + ky - 1, 2u + kx - 1] in both readings. The plain form runs in channels_last
      without copying either tensor to NCHW; with one output channel (the last decoder layer) the
      swapped conv has one input channel, so it is the patch matmul again.
    - Otherwise oneDNN's own weight gradient (on NCHW copies for transposed convs, "nchw" route).
    """
    args = (_STRIDE, _PADDING, _DILATION)
    swapped = transposed and TRANSPOSED_WEIGHT_GRAD == "swapped"
    wide = kernels.pays(weight.shape[0], weight.shape[1])
    if want_w and native and wide and (swapped or not transposed):
        # The plain conv whose weight gradient this is: for a transposed conv, the swapped one. The
        # bias gradient is summed as the oneDNN routes below sum it, pixel after pixel for plain
        # convs, so on AVX2 machines both settings of model.weight_grad_kernel give the same bits.
        if swapped:
            grad_w = kernels.conv_weight_grad(grad, x)
            grad_b = grad.sum((0, 2, 3)) if grad_w is not None and want_b else None
        else:
            grad_w, grad_b = kernels.conv_weight_grad(x, grad, bias=True) or (None, None)
        if grad_w is not None:
            if not weight.is_contiguous(memory_format=_CL):
                grad_w = grad_w.contiguous()
            return grad_w, grad_b if want_b else None
    if (not transposed and weight.shape[1] == 1) or swapped:
        grad_b = grad.sum((0, 2, 3)) if want_b else None
        if swapped and weight.shape[1] > 1:
            grad_w = _aten.convolution_backward(x, grad, weight, None, *args, False, [0, 0], 1, [False, want_w, False])[
                1
            ]
        else:
            grad_w = _conv_one_channel_weight_grad(x, grad) if swapped else _conv_one_channel_weight_grad(grad, x)
            grad_w = grad_w.contiguous(memory_format=_CL) if weight.is_contiguous(memory_format=_CL) else grad_w
        return grad_w, grad_b
    if transposed:
        grad, x, weight = grad.contiguous(), x.contiguous(), weight.contiguous()
    out_channels = weight.shape[1] if transposed else weight.shape[0]
    _, grad_w, grad_b = _aten.convolution_backward(grad, x, weight, [out_channels], *args, transposed, [0, 0], 1,
                                                   [False, want_w, want_b])
    return grad_w, grad_b


def _slope(module: nn.Module | None) -> float | None:
    """The negative slope of the activation `module` (0 for a ReLU), or None if it is none."""
    if isinstance(module, nn.ReLU):
        return 0.0
    if isinstance(module, nn.LeakyReLU):
        return module.negative_slope
    return None


def _layers(stack: nn.Sequential) -> list[tuple[nn.Module, float | None]]:
    """(conv, the negative slope of the activation after it or None) for each conv of a `_conv_stack`."""
    mods = list(stack) + [None]
    return [(m, _slope(mods[i + 1])) for i, m in enumerate(mods[:-1]) if isinstance(m, (nn.Conv2d, nn.ConvTranspose2d))]


def run_stack(stack: nn.Sequential, h: torch.Tensor, implementation: str, weight_grad_kernel: str) -> torch.Tensor:
    """Apply a conv stack with the given implementation (all compute the same function).

    `weight_grad_kernel` (model.weight_grad_kernel) matters to the "fast" implementation only.
    """
    if implementation == "fast":
        native = weight_grad_kernel == "native"
        for conv, slope in _layers(stack):
            h = _ConvReLU.apply(h, conv.weight, conv.bias, isinstance(conv, nn.ConvTranspose2d), slope, native)
        return h
    if implementation == "channels_last":
        return stack(h.contiguous(memory_format=_CL))
    if implementation == "nchw":
        h = h.contiguous()
        for m in stack:
            if isinstance(m, nn.ConvTranspose2d):
                h = F.conv_transpose2d(h, m.weight.contiguous(), m.bias, 2, 1)
            elif isinstance(m, nn.Conv2d):
                h = F.conv2d(h, m.weight.contiguous(), m.bias, 2, 1)
            else:
                h = m(h)
        return h
    raise ValueError(f"unknown conv implementation {implementation!r}; known: {', '.join(IMPLEMENTATIONS)}")


def use_implementation(module: nn.Module, implementation: str) -> nn.Module:
    """Set how every Encoder/Decoder inside `module` computes its convs (for benchmarks and tests)."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"unknown conv implementation {implementation!r}; known: {', '.join(IMPLEMENTATIONS)}")
    for m in module.modules():
        if hasattr(m, "implementation"):  # an Encoder or a Decoder
            m.implementation = implementation
    return module


def default_implementation(cfg: ModelConfig) -> str:
    return "fast" if cfg.channels_last else "nchw"


def place(module: nn.Module, device: torch.device | str) -> nn.Module:
    """Move a model to `device` with the conv implementation that suits it.

    The CPU keeps the implementation its config chose (the "fast" paths are CPU work-arounds for
    oneDNN, docs/benchmarks.md). Elsewhere the convs are plain PyTorch layers on NCHW tensors, which
    cuDNN (or MPS) runs as they are.
    """
    device = torch.device(device)
    if device.type == "cpu":
        return module.to(device)
    module = module.to(device=device, memory_format=torch.contiguous_format)
    return use_implementation(module, "nchw")


# glibc's malloc gives freed blocks above a (dynamic) threshold back to the kernel, so the tens of
# MB of activations of every training step were page-faulted in again on the next step (~27k minor
# faults and ~50-70 ms of system time per step of the paper preset, ~14k for the cpu preset).
# Keeping freed memory in the heap for reuse removes that; `vase bench` measures the effect on speed
# and on the peak memory of a default run. VASE_KEEP_FREED_MEMORY=0 leaves glibc's defaults alone.
_MMAP_THRESHOLD, _TRIM_THRESHOLD = -3, -1  # mallopt parameter numbers (malloc.h)
KEEP_FREED_MEMORY = {_MMAP_THRESHOLD: 64 * 1024 * 1024, _TRIM_THRESHOLD: 1024 * 1024 * 1024}
KEEP_FREED_MEMORY_ENV = "VASE_KEEP_FREED_MEMORY"
_allocator_tuned = False


def set_malloc_thresholds(settings: dict[int, int]) -> bool:
    """Apply mallopt settings (glibc only); False where they cannot be applied."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return all(libc.mallopt(k, v) == 1 for k, v in settings.items())
    except (OSError, AttributeError):
        return False


def keep_freed_memory() -> None:
    """Once per process (called when a VAE is built): keep freed activation memory for reuse."""
    global _allocator_tuned
    if _allocator_tuned:
        return
    _allocator_tuned = True
    if os.environ.get(KEEP_FREED_MEMORY_ENV, "1").strip().lower() not in ("0", "false", "no", "off"):
        set_malloc_thresholds(KEEP_FREED_MEMORY)

