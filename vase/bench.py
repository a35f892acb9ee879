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
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import torch

from vase import conv_paths, kernels
from vase.bench_flops import ModelCosts, Peaks
from vase.bench_memory import measure_memory
from vase.bench_steps import PlainProcess, RemoteVariant, Spec, Variant
from vase.config import build_config
from vase.errors import ConfigError

# The targets (docs/benchmarks.md explains each).
TARGETS = {
    "paper_plain_fraction_of_matmul_peak": 0.70,  # plain step of the paper preset, >= this
    "cpu_speedup_vs_reference": 1.3,  # cpu preset plain step vs the straightforward NCHW one, >=
    "vase_cost_over_flop_ratio": 1.1,  # (SDA time / plain time) / (SDA FLOPs / plain FLOPs), <=
    "outside_model_fraction": 0.10,  # of a trainer-like loop iteration, <
    "eight_vs_one_env": 1.10,  # step time with 8 past environments / with 1, <=
    "peak_memory_bytes": 3 * 1024**3,  # default training run, <
}
LOAD_NOTE = (
    "Absolute numbers depend on what else this machine runs (see the load average); every ratio "
    "compares variants timed interleaved in this run (medians)."
)



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
                lines.append(f"  the same run with {conv_paths.KEEP_FREED_MEMORY_ENV}=0 (glibc defaults): "
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

