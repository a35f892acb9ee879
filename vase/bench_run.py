"""`vase bench --run RUN_DIR`: a trained run's own step, from its newest checkpoint, with the CPU's
denormals kept and flushed to zero (train.flush_denormals; docs/benchmarks.md).

A fresh network computes few denormals, so the synthetic steps of `vase bench` cannot show what
they cost; a run that has trained for thousands of steps can. Both variants step the same learner
on the same batches, timed in interleaved blocks; nothing on disk changes.
"""
from __future__ import annotations

import itertools
from pathlib import Path
from typing import Callable

import torch

from vase.bench_device import ROUNDS, time_variants, write_json
from vase.device import configure_denormals


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

    cycle = itertools.cycle(batches)

    def step(flush: bool) -> Callable[[], None]:
        def one() -> None:
            configure_denormals(flush)
            learner.training_step(next(cycle))
        return one

    configure_denormals(False)
    nonzero, denormal = optimiser_denormals(learner)
    share = denormal / max(nonzero, 1)
    # Interleaved rounds of `steps` steps each, medians per step (as `vase bench --device` times).
    times = time_variants({"kept": step(False), "flushed": step(True)}, torch.device("cpu"), steps)
    configure_denormals(run.cfg.train.flush_denormals)
    kept, flushed = times["kept"], times["flushed"]
    result = {
        "run_dir": str(run_dir), "step": start, "steps_per_block": steps, "rounds": ROUNDS,
        "threads": torch.get_num_threads(), "run_flushes_denormals": run.cfg.train.flush_denormals,
        "optimiser_state_denormal": denormal, "optimiser_state_nonzero": nonzero,
        "median_step_s": {"kept": kept, "flushed": flushed}, "speedup_from_flushing": kept / flushed,
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
