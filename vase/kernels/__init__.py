"""Hand-written CPU kernels, compiled with the system C compiler on first use [ours].

One kernel so far: the weight gradient of the model's 4x4 stride-2 convs (`conv_weight_grad.c`
says why and how), used where model.weight_grad_kernel = "native" (the default). Everything here is
optional: where the kernel cannot be built or loaded (no C compiler, a CPU that is not an AVX2 one,
PyTorch not on OpenMP, a second OpenMP runtime), `conv_weight_grad` returns None and the caller
uses oneDNN. `status()` says which, and why.

The shared library is cached under $VASE_CACHE_DIR (default: ~/.cache/vase), named by a hash of
the source, the flags and the compiler, and written atomically, so parallel grid workers share one.
Loading a build marks it as used (its modification time); builds nobody has loaded for
STALE_DAYS, left behind by older sources or compilers, are deleted when a new one is compiled.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import torch

SOURCE = Path(__file__).with_name("conv_weight_grad.c")
FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-fPIC", "-shared")
CACHE_ENV = "VASE_CACHE_DIR"
# The smallest input maps we measured the kernel on (8x8, batch 64: 3.2 ms against oneDNN's 4.3).
MIN_INPUT_SIZE = 8
# The narrowest layers the model routes to it (`conv_paths`), where it pays: layers of 64
# channels and up gain 12-25 % each and the paper preset's step x1.06-1.08; the cpu preset's
# 32-channel layers gain nothing (3.7 ms both) and its step x1.01-1.02, under the 5 % a speed path
# must buy to stay (docs/benchmarks.md, item 9).
MIN_CHANNELS = 64
# Builds unused for this long are removed when another is compiled (each is about 20 KB, but a
# cache shared by many checkouts and compilers would otherwise only grow).
STALE_DAYS = 30


class _Library(NamedTuple):
    lib: ctypes.CDLL | None
    status: str


def _cache_dir() -> Path:
    root = os.environ.get(CACHE_ENV) or os.path.join(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache", "vase")
    return Path(root) / "kernels"


def _openmp_runtimes() -> set[str]:
    """The OpenMP runtime files mapped into this process (Linux)."""
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return set()
    return {line.split()[-1] for line in maps if any(k in line for k in ("libgomp", "libiomp", "libomp"))}


def _prune_stale_builds(cache: Path, keep: Path, now: float | None = None) -> list[Path]:
    """Delete the builds in `cache` other than `keep` that nobody has loaded for STALE_DAYS."""
    cutoff = (time.time() if now is None else now) - STALE_DAYS * 86400
    removed = []
    for old in cache.glob("conv_weight_grad-*.so"):
        try:
            if old != keep and old.stat().st_mtime < cutoff:
                old.unlink()
                removed.append(old)
        except OSError:  # another process removed or replaced it first
            pass
    return removed


def _compile(compiler: str, target: Path) -> str | None:
    """Compile SOURCE into `target` (atomically); an error message, or None."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
    except OSError as e:
        return f"cannot write the cache {target.parent}: {e}"
    try:
        done = subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", tmp], capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            return f"{compiler} failed: {done.stderr.strip()[-300:]}"
        os.replace(tmp, target)
        _prune_stale_builds(target.parent, target)
        return None
    except (OSError, subprocess.SubprocessError) as e:
        return f"{compiler} could not run: {e}"
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def _library() -> _Library:
    if not sys.platform.startswith("linux"):
        return _Library(None, "off (not Linux)")
    capability = torch.backends.cpu.get_cpu_capability()
    if capability != "AVX2":
        # Written for AVX2 (8-float registers). On an AVX-512 machine, with PyTorch forced to AVX2,
        # it made the paper step x0.96-1.00 as fast as oneDNN's AVX-512 gradients (docs/benchmarks.md).
        return _Library(None, f"off (written for AVX2 CPUs; PyTorch reports {capability})")
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return _Library(None, "off (PyTorch does not use OpenMP here)")
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        return _Library(None, "off (no C compiler)")
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return _Library(None, f"off ({compiler} could not run: {e})")
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode() + version.encode()).hexdigest()[:16]
    target = _cache_dir() / f"conv_weight_grad-{key}.so"
    if not target.exists():
        error = _compile(compiler, target)
        if error:
            return _Library(None, f"off ({error})")
    before = _openmp_runtimes()
    try:
        os.utime(target)  # in use: keeps it from being pruned as stale
    except OSError:
        pass
    try:
        lib = ctypes.CDLL(str(target))
    except OSError as e:
        return _Library(None, f"off (could not load it: {e})")
    # Our OpenMP threads must be PyTorch's: a second pool would compete with PyTorch's workers,
    # which spin for a while after each op (a pthread pool of our own took 18.1 ms per call right
    # after a torch op, against 13.4 ms; docs/benchmarks.md).
    added = _openmp_runtimes() - before
    if added:
        return _Library(None, f"off (it loaded a second OpenMP runtime: {', '.join(sorted(added))})")
    lib.conv_weight_grad.restype = ctypes.c_int
    lib.conv_weight_grad.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 6
    return _Library(lib, "on")


def status() -> str:
    """'on', or 'off (why)'. Builds the kernel if it is not built yet."""
    return _library().status


def pays(c_in: int, c_out: int) -> bool:
    """Whether a layer of these widths is routed to the kernel (`MIN_CHANNELS`)."""
    return min(c_in, c_out) >= MIN_CHANNELS


def route(setting: str, channels: list[int]) -> str:
    """What computes the weight gradients under model.weight_grad_kernel = `setting` here, for a
    network of these conv widths (model.channels)."""
    if setting != "native":
        return "onednn"
    if not any(pays(a, b) for a, b in zip(channels, channels[1:])):
        return f"onednn (no layer of {MIN_CHANNELS}+ channels for the native kernel)"
    state = status()
    return "native" if state == "on" else f"onednn (native kernel {state})"


def applies(x: torch.Tensor, grad: torch.Tensor) -> bool:
    """Whether `conv_weight_grad` handles these shapes (the kernel may still be off)."""
    if x.dim() != 4 or grad.dim() != 4 or x.dtype != torch.float32 or grad.dtype != torch.float32:
        return False
    if x.device.type != "cpu" or grad.device.type != "cpu":
        return False
    n, ci, h, w = x.shape
    return (ci % 16 == 0 and h % 2 == 0 and w % 2 == 0 and min(h, w) >= MIN_INPUT_SIZE
            and tuple(grad.shape) == (n, grad.shape[1], h // 2, w // 2) and n > 0 and grad.shape[1] > 0)


def conv_weight_grad(x: torch.Tensor, grad: torch.Tensor, bias: bool = False):
    """dL/dW of conv2d(x, W, stride=2, padding=1) with a 4x4 kernel, given grad = dL/d(output).

    Returns a (Co, Ci, 4, 4) tensor in channels_last memory, or None where the kernel is off,
    does not handle the shapes (see `applies`), or has fewer 16-channel blocks of Ci than PyTorch
    has threads. With `bias`, returns (dW, dL/db), dL/db summed pixel after pixel as oneDNN sums it.
    """
    if not applies(x, grad):
        return None
    lib = _library().lib
    if lib is None:
        return None
    n, ci, h, w = x.shape
    threads = torch.get_num_threads()
    if threads > ci // 16:
        # The kernel's threads split the input channels 16 at a time; with more threads than
        # that, oneDNN (which splits further) would leave fewer cores idle.
        return None
    x = x.contiguous(memory_format=torch.channels_last)
    grad = grad.contiguous(memory_format=torch.channels_last)
    co = grad.shape[1]
    out = torch.empty(co, 4, 4, ci)
    db = torch.empty(co) if bias else None
    if lib.conv_weight_grad(x.data_ptr(), grad.data_ptr(), out.data_ptr(), None if db is None else db.data_ptr(),
                            n, h, w, ci, co, threads):
        return None
    return (out.permute(0, 3, 1, 2), db) if bias else out.permute(0, 3, 1, 2)
