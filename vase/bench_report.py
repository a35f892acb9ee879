"""`vase bench`: what the timings come to: each variant's figures (FLOP/s, fractions of the
machine's peak), the ratios between variants, the targets of docs/benchmarks.md, and the printed
report."""
from __future__ import annotations

import statistics

from vase import conv_paths, kernels
from vase.bench_device import AGREEMENT_STEPS
from vase.bench_flops import ModelCosts, Peaks
from vase.bench_variants import Spec
from vase.config import build_config

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


def _median(rows: list[dict], key: str = "step") -> float:
    return statistics.median(r[key] for r in rows)


def _quartiles(rows: list[dict], key: str = "step") -> list[float]:
    vals = sorted(r[key] for r in rows)
    if len(vals) < 2:
        return [vals[0], vals[0]]
    q = statistics.quantiles(vals, n=4)
    return [q[0], q[2]]


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
    ("speedup_plain_from_bf16", "plain", "plain_bf16"),
    ("speedup_vase_from_bf16", "vase", "vase_bf16"),
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
    # Which code the plain step's weight gradients come from: where it is oneDNN's, the "oneDNN
    # weight gradients" variant is the same code, and their ratio only shows the timing noise.
    out["weight_gradients"] = kernels.route("native", build_config(preset).model.channels)
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
                          ("speedup_from_native_wgrad", "  of which our weight-gradient kernel (vase.kernels)"),
                          ("speedup_plain_from_bf16", "plain step in bf16 autocast (train.precision)"),
                          ("speedup_vase_from_bf16", "VASE step in bf16 autocast")):
            if key == "speedup_from_native_wgrad" and key in r and res.get("weight_gradients", "native") != "native":
                lines.append(f"  {text}: not used on this preset, {res['weight_gradients']} (x{r[key]:.2f}: the noise)")
            elif key in r:
                lines.append(f"  {text}: x{r[key]:.2f}")
        if "bf16_loss_difference" in res:
            lines.append(f"  bf16: the total loss after {AGREEMENT_STEPS} SDA steps differs from float32 by "
                         f"{100 * res['bf16_loss_difference']:.3f}%")
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
