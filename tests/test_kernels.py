"""Our weight-gradient kernel (vase.kernels) against a float64 reference, and its fallbacks."""
import json
import os
import re
import subprocess
import sys

import pytest
import torch
from torch.nn.grad import conv2d_weight

from vase import conv_paths, kernels, networks
from vase.config import build_config, load_run_config
from vase.errors import ConfigError

needs_kernel = pytest.mark.skipif(kernels.status() != "on", reason=f"kernel not built: {kernels.status()}")


def _reference(x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    w_shape = (grad.shape[1], x.shape[1], 4, 4)
    return conv2d_weight(x.double(), w_shape, grad.double(), stride=2, padding=1)


@needs_kernel
@pytest.mark.parametrize("n, ci, co, h, w", [
    (3, 16, 5, 16, 16),    # fewer output channels than one register tile (6)
    (5, 32, 13, 18, 10),   # two full tiles and a 1-row tail; non-square, OW not a power of 2
    (37, 16, 7, 8, 8),     # 8x8 inputs: 32 images per chunk, then a partial chunk of 5
    (2, 64, 64, 32, 32),   # the paper network's 64->64 layer
    (4, 48, 6, 20, 12),    # three 16-channel blocks, split unevenly over two threads
])
def test_kernel_matches_a_float64_reference(n, ci, co, h, w, monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1 if ci < 32 else 2)  # one 16-channel block per thread
    torch.manual_seed(0)
    x = torch.randn(n, ci, h, w).contiguous(memory_format=torch.channels_last)
    grad = torch.randn(n, co, h // 2, w // 2)  # NCHW: the kernel makes its own channels_last copy
    ours = kernels.conv_weight_grad(x, grad)
    assert ours is not None and ours.shape == (co, ci, 4, 4)
    assert ours.is_contiguous(memory_format=torch.channels_last)
    ref = _reference(x, grad)
    # float32 sums of n*h*w/4 products of unit normals: compare with oneDNN's float32 error.
    onednn = torch.ops.aten.convolution_backward(grad, x, torch.empty(co, ci, 4, 4), None, [2, 2], [1, 1], [1, 1],
                                                 False, [0, 0], 1, [False, True, False])[1]
    err, onednn_err = (ours.double() - ref).abs().max().item(), (onednn.double() - ref).abs().max().item()
    assert err <= 2 * onednn_err + 1e-6 * ref.abs().max().item()


@needs_kernel
@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX2", reason="oneDNN's AVX2 kernels only")
@pytest.mark.parametrize("ci, co, h", [(32, 32, 32), (64, 64, 32), (128, 128, 8), (16, 13, 16)])
def test_kernel_gives_onednns_bits_on_avx2(ci, co, h, monkeypatch):
    """On AVX2 machines (this project's) oneDNN adds the products pixel after pixel, as we do, so
    switching model.weight_grad_kernel does not change a run (docs/benchmarks.md, item 9). A new
    oneDNN that sums in another order fails this test; the results tables would then no longer be
    reproduced bit for bit by either setting."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1 if ci < 32 else 2)
    torch.manual_seed(2)
    x = torch.randn(9, ci, h, h).contiguous(memory_format=torch.channels_last)
    grad = torch.randn(9, co, h // 2, h // 2).contiguous(memory_format=torch.channels_last)
    w = torch.empty(co, ci, 4, 4).contiguous(memory_format=torch.channels_last)
    _, dw, db = torch.ops.aten.convolution_backward(grad, x, w, [co], [2, 2], [1, 1], [1, 1], False, [0, 0], 1,
                                                    [False, True, True])
    ours, ours_b = kernels.conv_weight_grad(x, grad, bias=True)
    assert torch.equal(ours, dw) and torch.equal(ours_b, db)


@needs_kernel
def test_kernel_uses_the_threads_it_is_given():
    """One thread or two give the same sums (each thread owns its input channels)."""
    torch.manual_seed(1)
    x, grad = torch.randn(6, 64, 16, 16), torch.randn(6, 64, 8, 8)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernels.conv_weight_grad(x, grad)
        torch.set_num_threads(2)
        two = kernels.conv_weight_grad(x, grad)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


@needs_kernel
def test_more_threads_than_channel_blocks_are_left_to_onednn(monkeypatch):
    """16 input channels are one block for one thread: with two threads oneDNN does it."""
    x, grad = torch.randn(2, 16, 16, 16), torch.randn(2, 4, 8, 8)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert kernels.applies(x, grad) and kernels.conv_weight_grad(x, grad) is None
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert kernels.conv_weight_grad(x, grad) is not None


@pytest.mark.skipif(
    not kernels.status().startswith("off (written for AVX2"), reason="only where the CPU level turns it off"
)
def test_the_kernel_tests_also_run_on_avx512_machines_with_pytorch_forced_to_avx2():
    """On an AVX-512 CPU the kernel is off, so the tests above skip and the C code would go
    untested. PyTorch run as AVX2 (ATEN_CPU_CAPABILITY=avx2) turns it on: run them there. That
    setting leaves oneDNN on its AVX-512 kernels, which sum in another order, so oneDNN is capped at
    AVX2 too (ONEDNN_MAX_CPU_ISA): the bit-for-bit comparison is then against the kernels it runs on
    this project's AVX2 machines."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
         "-k", "reference or bits or threads or channel_blocks or routes"],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert re.search(r"\b(1[3-9]|[2-9]\d) passed", done.stdout) and "skipped" not in done.stdout, done.stdout[-1000:]


@pytest.mark.parametrize("x, grad", [
    (torch.randn(2, 8, 16, 16), torch.randn(2, 4, 8, 8)),  # input channels not a multiple of 16
    (torch.randn(2, 16, 15, 16), torch.randn(2, 4, 7, 8)),  # odd height
    (torch.randn(2, 16, 4, 4), torch.randn(2, 4, 2, 2)),  # smaller than any map we measured
    (torch.randn(2, 16, 16, 16, dtype=torch.float64), torch.randn(2, 4, 8, 8, dtype=torch.float64)),
    (torch.randn(2, 16, 16, 16), torch.randn(2, 4, 16, 16)),  # not the output of a stride-2 conv
])
def test_unsupported_shapes_are_left_to_onednn(x, grad):
    assert not kernels.applies(x, grad)
    assert kernels.conv_weight_grad(x, grad) is None


@pytest.fixture
def fresh_library():
    kernels._library.cache_clear()
    yield
    kernels._library.cache_clear()


def test_a_failing_compiler_falls_back_to_onednn(fresh_library, monkeypatch, tmp_path):
    """No kernel is built, nothing is cached, and the model's gradients still come (from oneDNN)."""
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    monkeypatch.setenv(kernels.CACHE_ENV, str(tmp_path))
    status = kernels.status()
    if status.startswith(("off (not Linux", "off (written for AVX2", "off (PyTorch")):
        pytest.skip(status)  # off before any compiler is tried
    assert status.startswith("off (false ")
    assert not list(tmp_path.rglob("*.so"))
    x = torch.randn(2, 16, 16, 16, requires_grad=True)
    conv = torch.nn.Conv2d(16, 4, 4, 2, 1)
    y = conv_paths._ConvReLU.apply(x, conv.weight, conv.bias, False, 0.0, True)
    y.square().sum().backward()
    assert conv.weight.grad is not None and torch.isfinite(conv.weight.grad).all()


def test_builds_unused_for_a_month_are_pruned_and_recent_ones_kept(tmp_path):
    now = 1_000_000_000.0
    day = 86400
    keep = tmp_path / "conv_weight_grad-new.so"
    stale = tmp_path / "conv_weight_grad-old.so"
    recent = tmp_path / "conv_weight_grad-other-compiler.so"
    unrelated = tmp_path / "notes.txt"
    for path, age_days in [(keep, 100), (stale, kernels.STALE_DAYS + 1), (recent, kernels.STALE_DAYS - 1),
                           (unrelated, 365)]:
        path.write_bytes(b"x")
        os.utime(path, (now - age_days * day, now - age_days * day))
    removed = kernels._prune_stale_builds(tmp_path, keep, now=now)
    assert removed == [stale]
    assert keep.exists() and recent.exists() and unrelated.exists() and not stale.exists()


@needs_kernel
@pytest.mark.parametrize("preset, setting", [("paper", "native"), ("paper", "onednn"), ("cpu", "native")])
def test_the_model_routes_its_wide_layers_as_configured(preset, setting, monkeypatch):
    """model.weight_grad_kernel = "native": every conv of the paper network but the one-channel
    ones gets its weight gradient from us; "onednn": none does; the cpu preset's 32-channel layers,
    where the kernel gains nothing, never do."""
    calls = []
    real = kernels.conv_weight_grad

    def counting(x, grad, bias=False):
        out = real(x, grad, bias)
        if out is not None:
            calls.append((tuple(x.shape[1:]), grad.shape[1]))
        return out

    monkeypatch.setattr(kernels, "conv_weight_grad", counting)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)  # as on this project's machine: 4+ channel blocks each
    cfg = build_config(preset, [f"model.weight_grad_kernel={setting}"])
    model = networks.VAE(cfg.model)
    x = torch.rand(2, 1, 64, 64)
    post = model.encoder(x)
    logits = model.decoder(post.mu, torch.zeros(2, dtype=torch.long))
    (post.logvar.sum() + logits.sum()).backward()
    # encoder convs 2-4 (input maps), decoder deconvs 1-3 (swapped: the gradients of their outputs)
    expected = [((64, 32, 32), 64), ((64, 16, 16), 128), ((128, 8, 8), 128),
                ((128, 8, 8), 128), ((64, 16, 16), 128), ((64, 32, 32), 64)]
    wide = preset == "paper" and setting == "native"
    assert sorted(calls) == (sorted(expected) if wide else [])
    assert kernels.route(setting, cfg.model.channels) == setting if preset == "paper" else \
        kernels.route(setting, cfg.model.channels).startswith("onednn (no layer")


def test_the_setting_is_validated_and_old_runs_keep_onednn(tmp_path):
    with pytest.raises(ConfigError, match="weight_grad_kernel"):
        build_config("cpu", ["model.weight_grad_kernel=cuda"]).validate()
    assert build_config("cpu").model.weight_grad_kernel == "native"
    # A run written before the setting existed was trained with oneDNN's gradients; resuming it
    # must keep them, or its sums change in the last bits.
    d = build_config("cpu").to_dict()
    del d["model"]["weight_grad_kernel"]
    (tmp_path / "config.json").write_text(json.dumps(d))
    assert load_run_config(tmp_path).model.weight_grad_kernel == "onednn"
    d["model"]["weight_grad_kernel"] = "native"
    (tmp_path / "config.json").write_text(json.dumps(d))
    assert load_run_config(tmp_path).model.weight_grad_kernel == "native"
