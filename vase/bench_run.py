"""`vase bench --run RUN_DIR`: a trained run's own step, from its newest checkpoint, with the CPU's
denormals kept and flushed to zero (train.flush_denormals; docs/benchmarks.md).

A fresh network computes few denormals, so the synthetic steps of `vase bench` cannot show what
they cost; a run that has trained for thousands of steps can. Both variants step the same learner
on the same batches, timed in interleaved blocks; nothing on disk changes.
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from vase.bench_device import write_json
from vase.device import configure_denormals

ROUNDS = 5


def optimiser_denormals(learner) -> tuple[int, int]:
    """(nonzero, denormal) values in the state of the learner's optimisers (Adam's moment estimates),
    read with denormals kept: flushed, the CPU reads them as zero."""
    tiny = torch.finfo(torch.float32).tiny
    nonzero = denormal = 0
    for optimiser in (learner.optimizer, learner.classifier_optimizer):
        for state in optimiser.state.values():
            for value in state.values():
                if torch.is_tensor(value) and value.is_floating_point() and value.dim() > 0:
                    nz = value != 0
                    nonzero += int(nz.sum())
                    denormal += int((nz & (value.abs() < tiny)).sum())
    return nonzero, denormal


def time_blocks(variants: dict[str, Callable[[], None]], rounds: int = ROUNDS) -> dict[str, list[float]]:
    """Seconds of each variant's block in each of `rounds` interleaved rounds."""
    out: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(rounds):
        for name, block in variants.items():
            t = time.perf_counter()
            block()
            out[name].append(time.perf_counter() - t)
    return out


def bench_run(run_dir: Path, steps: int, threads: int = 0, json_out: str | None = None,
              echo: Callable[[str], None] = print) -> dict:
    """Time `steps` of the run's own training step from its newest checkpoint, denormals kept and
    flushed, in ROUNDS interleaved blocks; print the figures, write the JSON and return them."""
    from vase.inspection import open_run

    run = open_run(run_dir)
    if threads > 0:
        torch.set_num_threads(threads)
    learner, stream = run.learner, run.stream
    start = learner.step
    generator = torch.Generator().manual_seed(0)
    last = run.cfg.data.total_steps() - 1  # a finished run steps on with its last environment's batches
    batches = [stream.batch(min(start + i, last), generator) for i in range(steps)]

    def block(flush: bool) -> Callable[[], None]:
        def run_block() -> None:
            configure_denormals(flush)
            for x in batches:
                learner.training_step(x)
        return run_block

    configure_denormals(False)
    nonzero, denormal = optimiser_denormals(learner)
    share = denormal / max(nonzero, 1)
    times = time_blocks({"kept": block(False), "flushed": block(True)})
    configure_denormals(run.cfg.train.flush_denormals)
    kept, flushed = (statistics.median(times[k]) / steps for k in ("kept", "flushed"))
    result = {
        "run_dir": str(run_dir), "step": start, "steps_per_block": steps, "rounds": ROUNDS,
        "threads": torch.get_num_threads(), "run_flushes_denormals": run.cfg.train.flush_denormals,
        "optimiser_state_denormal": denormal, "optimiser_state_nonzero": nonzero,
        "median_step_s": {"kept": kept, "flushed": flushed}, "speedup_from_flushing": kept / flushed,
        "blocks_s": times,
    }
    echo(f"{run_dir} at step {start:,}, {torch.get_num_threads()} thread(s), {ROUNDS} interleaved rounds of "
         f"{steps} steps:")
    echo(f"  denormal values in the optimisers' state (Adam's moments): {denormal:,} of {nonzero:,} nonzero "
         f"({100 * share:.1f}%)")
    echo(f"  step with denormals kept: {kept * 1e3:.1f} ms; flushed to zero: {flushed * 1e3:.1f} ms; "
         f"x{kept / flushed:.2f}")
    if json_out:
        write_json(json_out, result)
        echo(f"results: {json_out}")
    return result
