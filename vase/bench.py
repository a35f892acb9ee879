"""`vase bench`: how fast is a training step on this machine, and why (docs/benchmarks.md).

One run measures, for each preset:

1. training throughput of the plain CCI-VAE step ("-") and of the full VASE step (SDA) with past
   environments (dreaming on), and their ratio;
2. analytic FLOPs of each step (from the layer shapes of the passes the step actually ran) and the
   achieved FLOP/s as a fraction of this machine's peak, measured in the same run by a dense matmul
   and a dense conv microbenchmark;
3. the share of a trainer-like loop iteration spent outside the networks (data gather, inference
   bookkeeping, logging conversions);
4. the VASE step with 1 versus 8 past environments, and both steps in bf16 autocast with the loss
   it gives against float32;
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
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import torch

from vase import conv_paths, kernels
from vase.bench_child import PlainProcess, RemoteVariant
from vase.bench_device import agreement
from vase.bench_flops import Peaks
from vase.bench_memory import measure_memory
from vase.bench_report import LOAD_NOTE, TARGETS, check_targets, format_report, summarise_preset
from vase.bench_steps import Variant
from vase.bench_variants import BF16, Spec, default_specs
from vase.device import cpu_model, cpuinfo_field, read_cpuinfo
from vase.errors import ConfigError


def machine_info() -> dict:
    cpuinfo = read_cpuinfo()
    cpu = cpu_model(cpuinfo)
    flags = set(cpuinfo_field("flags", cpuinfo).split())
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
    conv_paths.keep_freed_memory()
    results: dict = {"machine": machine_info(), "steps": steps, "note": LOAD_NOTE, "targets_definition": TARGETS}
    peaks = Peaks()
    peaks.sample()
    results["presets"] = {}
    for preset in presets:
        log(f"preset {preset}:")
        chosen = (specs or {}).get(preset) or default_specs(preset)
        measured = measure(chosen, steps, threads, peaks, log)
        results["presets"][preset] = summarise_preset(preset, measured, peaks)
        bf16 = [s for s in chosen if s.ablation == "SDA" and BF16 in s.overrides]
        if bf16:
            # What bf16 does to the numbers, beside what it does to the time (docs/benchmarks.md).
            base = tuple(o for o in bf16[0].overrides if o != BF16)
            results["presets"][preset]["bf16_loss_difference"] = agreement(preset, torch.device("cpu"), (BF16,), base)
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
