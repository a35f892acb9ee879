"""Where a run computes: `--device auto|cpu|cuda|cuda:N|mps`, resolved once and passed down.

The device is a property of the machine, not of the experiment: it is not part of the config,
so a run trained on a GPU resumes on a CPU and the other way round (`results.json` records it).
"""
from __future__ import annotations

import contextlib
import functools
import os
import platform
from pathlib import Path

import torch

from vase.errors import VaseError

DEVICE_CHOICES = "auto, cpu, cuda, cuda:N or mps"


class DeviceError(VaseError):
    """A device that this machine does not have."""


def _mps_available() -> bool:
    mps = getattr(torch.backends, "mps", None)
    return bool(mps and mps.is_available())


def resolve_device(name: str | torch.device | None = "auto") -> torch.device:
    """The torch.device for a `--device` value, or one clear DeviceError.

    "auto" takes CUDA if available, else MPS, else the CPU.
    """
    if isinstance(name, torch.device):
        return name
    text = (name or "auto").strip().lower()
    if text == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        return torch.device("mps" if _mps_available() else "cpu")
    try:
        device = torch.device(text)
    except RuntimeError:
        raise DeviceError(f"unknown device {name!r}; use {DEVICE_CHOICES}") from None
    if device.type == "cpu":
        return device
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch has no CUDA support" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise DeviceError(f"--device {text}: {why} on this machine; use --device cpu (or auto)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise DeviceError(
                f"--device {text}: this machine has {torch.cuda.device_count()} CUDA device(s), numbered from 0"
            )
        return device
    if device.type == "mps":
        if not _mps_available():
            raise DeviceError(f"--device {text}: MPS (Apple GPU) is not available on this machine; use --device cpu")
        return device
    raise DeviceError(f"unsupported device {name!r}; use {DEVICE_CHOICES}")


def configure_denormals(flush: bool) -> None:
    """train.flush_denormals: the CPU's float arithmetic flushes denormals to zero, or keeps them.
    Process-wide: the run's training, probes and evaluation all compute alike."""
    torch.set_flush_denormal(flush)


def configure_determinism(device: torch.device, deterministic: bool) -> None:
    """train.deterministic: deterministic kernels on accelerators (the CPU path is deterministic as is).

    cuBLAS needs its workspace setting before its first call to be reproducible; cuDNN's autotuner
    picks kernels by timing, so it is off too.
    """
    if device.type == "cpu" or not deterministic:
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True


def describe(device: torch.device) -> str:
    """What results.json records: the device and, on CUDA, the GPU's name."""
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return str(device)


def read_cpuinfo() -> str:
    """/proc/cpuinfo's text, or "" where there is none (not Linux)."""
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def cpuinfo_field(name: str, cpuinfo: str) -> str:
    """The first non-empty value of the field `name` in /proc/cpuinfo's text, or ""."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == name and value.strip():
            return value.strip()
    return ""


def cpu_model(cpuinfo: str | None = None) -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else what `platform` knows, else "unknown"."""
    text = read_cpuinfo() if cpuinfo is None else cpuinfo
    return cpuinfo_field("model name", text) or platform.processor() or "unknown"


def host() -> dict:
    """What results.json records of the machine. On the CPU a seed reproduces bit for bit on one
    machine only: PyTorch picks its CPU kernels by the vector instructions it finds
    (`cpu_capability`), and other kernels round float sums otherwise (docs/devices.md)."""
    return {"cpu": cpu_model(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "threads": torch.get_num_threads(), "torch": torch.__version__}


def busy_cpu_note(threads: int, device: torch.device, load: float | None = None,
                  cores: int | None = None) -> str | None:
    """A line for a CPU run of several threads on a machine whose load average already fills its
    cores, else None. PyTorch's threads wait for each other at every layer, so while other work holds
    a core, all of them wait: beside a grid that filled 2 cores a run of two threads trained 204
    steps in 100 s and one of one thread 482 (docs/usage.md, "The grid")."""
    if device.type != "cpu" or threads <= 1:
        return None
    if load is None:
        try:
            load = os.getloadavg()[0]
        except (AttributeError, OSError):  # not on this platform
            return None
    # The machine's cores, not this process's affinity (as the grid counts its workers): the load
    # average counts the whole machine's runnable work.
    cores = os.cpu_count() if cores is None else cores
    if not cores or load < cores:
        return None
    return (f"note: this machine's load average is {load:.1f} on {cores} cores; beside other work a run "
            f"of {threads} threads waits for the busiest core, and one thread trains faster: "
            "--set train.threads=1 (docs/usage.md)")


def wide_float(device: torch.device) -> torch.dtype:
    """The widest float dtype of a device: float64, or float32 on MPS, which has no float64."""
    return torch.float32 if device.type == "mps" else torch.float64


def precision_context(device: torch.device, precision: str):
    """train.precision: a factory of the context the forward passes run in.

    "bf16" runs them under autocast (matmuls and convs in bfloat16, losses in float32); "fp32" is
    plain float32, with no context at all, so the CPU path stays bit for bit what it was.
    """
    if precision == "fp32":
        return contextlib.nullcontext
    return functools.partial(torch.autocast, device_type=device.type, dtype=torch.bfloat16)


MPS_DEFAULT_PIPE = "/tmp/nvidia-mps"


def mps_running(environ=os.environ) -> bool:
    """Whether NVIDIA's Multi-Process Service answers here (its control pipe exists). Runs sharing a
    GPU without it are time-sliced one process at a time; with it their kernels run side by side
    (docs/devices.md)."""
    pipe = environ.get("CUDA_MPS_PIPE_DIRECTORY", MPS_DEFAULT_PIPE)
    return os.path.exists(os.path.join(pipe, "control"))
