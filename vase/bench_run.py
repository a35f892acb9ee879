"""`vase bench --run RUN_DIR`: a trained run's own step, from its newest checkpoint, with the CPU's
denormals kept and flushed to zero (train.flush_denormals), and, in the first environment, the step
of the same config started anew (docs/benchmarks.md).

A fresh network computes few denormals, so the synthetic steps of `vase bench` cannot show what
they cost; a run that has trained for thousands of steps can. The run started anew tells whether
the trained state costs more per step at all: if a run slows as it trains and this ratio stays
near 1, the step is not why. The variants step on the same batches, timed in interleaved blocks;
nothing on disk changes.
"""
from __future__ import annotations

import itertools
import tempfile
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


def started_anew(run):
    """The learner of the run's config as a new run starts it (step 0, fresh weights), or None past
    the first environment, where a new run's step (no past environment, no dreams) is not the run's."""
    from vase.trainer import Trainer

    if run.learner.step >= run.cfg.data.env_steps()[0]:
        return None
    with tempfile.TemporaryDirectory() as nowhere:  # the Trainer writes nothing until it trains
        return Trainer(run.cfg, Path(nowhere), progress=False, device="cpu", callbacks=[]).evaluator.learner


def bench_run(run_dir: Path, steps: int, threads: int = 0, json_out: str | None = None,
              echo: Callable[[str], None] = print) -> dict:
    """Time `steps` of the run's own training step from its newest checkpoint, denormals kept and
    flushed (and, in the first environment, the step of its config started anew), in ROUNDS
    interleaved blocks; print the figures, write the JSON and return them."""
    from vase.inspection import open_run

    run = open_run(run_dir)
    anew_learner = started_anew(run)
    if threads > 0:
        torch.set_num_threads(threads)
    learner, stream = run.learner, run.stream
    start = learner.step
    generator = torch.Generator().manual_seed(0)
    last = run.cfg.data.total_steps() - 1  # a finished run steps on with its last environment's batches
    batches = [stream.batch(min(start + i, last), generator) for i in range(steps)]

    cycle = itertools.cycle(batches)

    def step(flush: bool, stepped=learner) -> Callable[[], None]:
        def one() -> None:
            configure_denormals(flush)
            stepped.training_step(next(cycle))
        return one

    configure_denormals(False)
    nonzero, denormal = optimiser_denormals(learner)
    share = denormal / max(nonzero, 1)
    # Interleaved rounds of `steps` steps each, medians per step (as `vase bench --device` times).
    own = run.cfg.train.flush_denormals
    variants = {"kept": step(False), "flushed": step(True)}
    if anew_learner is not None:
        variants["anew"] = step(own, anew_learner)
    times = time_variants(variants, torch.device("cpu"), steps)
    configure_denormals(own)
    kept, flushed = times["kept"], times["flushed"]
    trained = flushed if own else kept
    anew = times.get("anew")
    result = {
        "run_dir": str(run_dir), "step": start, "steps_per_block": steps, "rounds": ROUNDS,
        "threads": torch.get_num_threads(), "run_flushes_denormals": run.cfg.train.flush_denormals,
        "optimiser_state_denormal": denormal, "optimiser_state_nonzero": nonzero,
        "median_step_s": times, "speedup_from_flushing": kept / flushed,
        "trained_over_anew": trained / anew if anew else None,
    }
    echo(f"{run_dir} at step {start:,}, {torch.get_num_threads()} thread(s), {ROUNDS} interleaved rounds of "
         f"{steps} steps:")
    echo(f"  denormal values in the optimisers' state (Adam's moments): {denormal:,} of {nonzero:,} nonzero "
         f"({100 * share:.1f}%)")
    echo(f"  step with denormals kept: {kept * 1e3:.1f} ms; flushed to zero: {flushed * 1e3:.1f} ms; "
         f"x{kept / flushed:.2f}")
    if anew:
        how = "flushed" if own else "kept"
        echo(f"  the same config started anew (step 0), {how} as the run: {anew * 1e3:.1f} ms; "
             f"the trained step costs x{trained / anew:.2f} of it")
    else:
        echo("  (past its first environment: no comparison with the run started anew)")
    if json_out:
        write_json(json_out, result)
        echo(f"results: {json_out}")
    return result
