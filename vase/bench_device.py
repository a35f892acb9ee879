"""`vase bench --device cuda` (or mps): the training step on an accelerator, and GPU sharing.

Every figure is a ratio taken side by side in one run (docs/devices.md):
- per preset, the plain step ("-") and the VASE step (SDA, 2 past environments), each with CUDA
  graphs (the default) and eager, the SDA step in bf16 autocast and torch.compile, and a
  straightforward PyTorch step of the same networks, timed in
  interleaved rounds; each round runs a block of steps between two synchronisations, so the
  figure is the step's throughput, not the launch latency of one step;
- whether CUDA graphs, bf16 and compile give the same results: the loss after the same steps from
  the same weights and batches, against fp32 eager;
- sharing: N processes training the paper preset's SDA step on one GPU, against one alone.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from vase.bench_reference import ReferenceStep
from vase.bench_steps import SYNTHETIC_IMAGES, SyntheticEnvironment, prepare_environments
from vase.config import build_config
from vase.device import describe, mps_running
from vase.learner import Learner
from vase.stream import Stream

ROUNDS = 5
WARMUP = 10
AGREEMENT_STEPS = 30
EAGER = ("train.cuda_graphs=false",)


def _learner(preset: str, ablation: str, device: torch.device, overrides: tuple[str, ...] = ()):
    cfg = build_config(preset, list(overrides), ablation)
    learner = Learner(cfg, device)
    if ablation != "-":
        prepare_environments(learner, 3)
    return learner


def _stepper(learner, device: torch.device, seed: int = 1) -> Callable[[], object]:
    """A closure training one step of `learner` (a Learner or a ReferenceStep) on synthetic images
    held on the device."""
    cfg = learner.cfg
    env = SyntheticEnvironment(SYNTHETIC_IMAGES, cfg.model.image_channels)
    env.images = env.images.to(device)
    stream = Stream([env], [10**9], cfg.train.batch_size)
    generator = torch.Generator(device=device).manual_seed(seed)
    counter = iter(range(10**12))
    return lambda: learner.training_step(stream.batch(next(counter), generator))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def _variants(preset: str, device: torch.device, compile_: bool) -> dict[str, Callable[[], object]]:
    out = {
        "reference": _reference(preset, device),
        "plain": _stepper(_learner(preset, "-", device), device),
        "plain_eager": _stepper(_learner(preset, "-", device, EAGER), device),
        "sda": _stepper(_learner(preset, "SDA", device), device),
        "sda_eager": _stepper(_learner(preset, "SDA", device, EAGER), device),
        "sda_bf16": _stepper(_learner(preset, "SDA", device, ("train.precision=bf16",)), device),
    }
    if compile_:
        out["sda_compile"] = _stepper(_learner(preset, "SDA", device, ("train.compile=true",)), device)
        try:  # compiling happens on the first steps; a failure there is reported, not fatal
            out["sda_compile"]()
        except Exception as e:  # noqa: BLE001 - any compiler error: report it and time the rest
            print(f"  train.compile failed on the {preset} preset: {str(e).splitlines()[0][:200]}")
            del out["sda_compile"]
    return out


def _reference(preset: str, device: torch.device) -> Callable[[], object]:
    """The straightforward PyTorch step of the same networks, on the same synthetic stream."""
    ref = ReferenceStep(build_config(preset, [], "-"), device)
    return _stepper(ref, device)


def time_variants(variants: dict[str, Callable[[], object]], device: torch.device, block: int) -> dict[str, float]:
    """Median seconds per step of each variant over ROUNDS interleaved blocks of `block` steps."""
    for step in variants.values():
        for _ in range(WARMUP):
            step()
    _sync(device)
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(ROUNDS):
        for name, step in variants.items():
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(block):
                step()
            _sync(device)
            times[name].append((time.perf_counter() - t0) / block)
    return {k: statistics.median(v) for k, v in times.items()}


def agreement(preset: str, device: torch.device, overrides: tuple[str, ...], base: tuple[str, ...] = ()) -> float:
    """Relative difference of the total loss after AGREEMENT_STEPS SDA steps with `overrides` against
    fp32 eager, from the same weights and batches (both with the settings `base`)."""
    losses = []
    for extra in (EAGER + base, base + overrides):
        step = _stepper(_learner(preset, "SDA", device, extra), device)
        for _ in range(AGREEMENT_STEPS):
            out = step()
        losses.append(out.losses["total"])
    return abs(losses[1] - losses[0]) / abs(losses[0])


def _share_worker(preset: str, device: str, seconds: float, barrier, results) -> None:
    dev = torch.device(device)
    torch.set_num_threads(1)
    step = _stepper(_learner(preset, "SDA", dev), dev)
    for _ in range(WARMUP):
        step()
    _sync(dev)
    barrier.wait()
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        for _ in range(20):
            step()
        n += 20
    _sync(dev)
    results.put(n / (time.perf_counter() - t0))


def sharing(preset: str, device: torch.device, runs: int, seconds: float) -> dict:
    """Steps per second of each of `runs` processes training at once on the device, and in total."""
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(runs), ctx.Queue()
    procs = [ctx.Process(target=_share_worker, args=(preset, str(device), seconds, barrier, results))
             for _ in range(runs)]
    for p in procs:
        p.start()
    rates = [results.get() for _ in procs]
    for p in procs:
        p.join()
    return {
        "runs": runs,
        "per_run_steps_per_s": [round(r, 1) for r in rates],
        "total_steps_per_s": round(sum(rates), 1),
    }


def run_device_bench(device: torch.device, presets: list[str], block: int, json_out: str | None,
                     share_runs: int, share_seconds: float, compile_: bool, echo=print) -> dict:
    torch.backends.cudnn.benchmark = device.type == "cuda"
    report: dict = {"device": describe(device), "torch": torch.__version__, "presets": {}}
    echo(f"vase bench on {describe(device)} (torch {torch.__version__}); blocks of {block} steps, "
         f"{ROUNDS} interleaved rounds, median")
    for preset in presets:
        seconds = time_variants(_variants(preset, device, compile_), device, block)
        batch = build_config(preset).train.batch_size
        rows = {k: {"ms_per_step": round(1e3 * s, 3), "steps_per_s": round(1 / s, 1), "img_per_s": round(batch / s),
                    "vs_reference": round(seconds["reference"] / s, 2)} for k, s in seconds.items()}
        checks = {"sda": agreement(preset, device, ()),
                  "sda_bf16": agreement(preset, device, ("train.precision=bf16",))}
        if "sda_compile" in seconds:
            checks["sda_compile"] = agreement(preset, device, ("train.compile=true",))
        report["presets"][preset] = {"steps": rows, "loss_relative_difference_vs_fp32": checks}
        echo(f"\n{preset} preset (batch {batch}):")
        echo(f"  {'variant':<12} {'ms/step':>9} {'steps/s':>9} {'img/s':>9} {'x reference':>12}")
        for k, r in rows.items():
            echo(f"  {k:<12} {r['ms_per_step']:>9.2f} {r['steps_per_s']:>9.1f} {r['img_per_s']:>9} "
                 f"{r['vs_reference']:>12.2f}")
        for k, v in checks.items():
            echo(f"  {k}: total loss after {AGREEMENT_STEPS} steps differs from fp32 eager by {100 * v:.4f} %")
    if share_runs > 1 and device.type == "cuda":
        alone = sharing("paper", device, 1, share_seconds)
        shared = sharing("paper", device, share_runs, share_seconds)
        efficiency = shared["total_steps_per_s"] / (share_runs * alone["total_steps_per_s"])
        report["sharing"] = {"alone": alone, "shared": shared, "mps": mps_running(),
                             "total_vs_alone": round(shared["total_steps_per_s"] / alone["total_steps_per_s"], 2),
                             "per_run_vs_alone": round(efficiency, 3)}
        echo(f"\nsharing one GPU (paper preset, SDA): alone {alone['total_steps_per_s']} steps/s; "
             f"{share_runs} runs {shared['total_steps_per_s']} steps/s in total "
             f"(x{report['sharing']['total_vs_alone']} of one alone; each run at {100 * efficiency:.0f} % of alone; "
             f"MPS {'on' if report['sharing']['mps'] else 'off'})")
    if json_out:
        write_json(json_out, report)
        echo(f"\nwritten to {json_out}")
    return report


def write_json(path: str, data: dict) -> None:
    """A benchmark's results as JSON at `path`, its folder made if need be."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=2))
