"""The `vase` command line: train, run the ablation grid, evaluate, tabulate, benchmark, and manage data."""
from __future__ import annotations

import json
import signal
import sys
import warnings
from pathlib import Path

import click

from vase.config import (
    build_config,
    config_json_with_kept,
    load_run_config,
    option_overrides,
    preset_names,
    resume_overrides,
    schedule_names,
)
from vase.config_sections import CHOICES, PROBE_READINGS
from vase.config_values import comma_list
from vase.errors import VaseError

DEFAULT_SEQUENCE_HELP = "moving_shapes_a,shapes_b,moving_shapes_b (embedded sprites, no download)"


def _fail(e: Exception | str) -> None:
    raise click.ClickException(str(e)) from None


def _show_warnings(ctx: click.Context) -> None:
    """Print library warnings as one clean line each (no file/line noise), for this command only."""
    previous = warnings.showwarning
    warnings.showwarning = lambda message, *args, **kwargs: click.echo(
        "warning: " + " ".join(str(message).split()), err=True
    )
    ctx.call_on_close(lambda: setattr(warnings, "showwarning", previous))


def _device_option(default: str = "auto"):
    return click.option("--device", default=default, show_default=True, metavar="DEVICE",
                        help="Where to compute: auto (CUDA, else MPS, else CPU), cpu, cuda, cuda:N or mps. "
                             "Not part of the run's config: a run resumes on any device.")


def _resolve_device(name: str):
    from vase.device import resolve_device

    try:
        return resolve_device(name)
    except VaseError as e:
        _fail(e)


def _schedule_option():
    return click.option("--schedule", type=click.Choice(schedule_names()), default="short", show_default=True,
                        help="Run lengths set together: steps per environment, capacity ramp, tau, probe interval "
                             "and new-slot settings ('long': the paper's regime, docs/regime.md).")


def _check_sequence(ctx, param, value):
    if value is None:
        return value
    from vase.data.environments import ENVIRONMENT_NAMES

    names = comma_list(value)
    unknown = [n for n in names if n not in ENVIRONMENT_NAMES]
    if not names or unknown:
        raise click.BadParameter(
            f"unknown environment(s) {', '.join(unknown) or '(empty)'}; known: {', '.join(ENVIRONMENT_NAMES)}"
        )
    return ",".join(names)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="vase")
@click.pass_context
def main(ctx):
    """VASE: life-long disentangled representation learning (Achille et al., NeurIPS 2018).

    Train over a sequence of environments, run the ablation grid, evaluate probes,
    gather runs into Table 1, benchmark the step, manage data.
    Run `vase COMMAND --help` for each command's options.
    """
    _show_warnings(ctx)


@main.command()
@click.option("--preset", type=click.Choice(preset_names()), default="cpu", show_default=True,
              help="Network size: 'paper' (64-64-128-128 convs) or 'cpu' (32 channels everywhere).")
@click.option("--sequence", callback=_check_sequence, default=None,
              help=f"Comma-separated environments in training order. Default: {DEFAULT_SEQUENCE_HELP}.")
@click.option("--steps", default=None,
              help="Steps per environment: one number, or one per environment (comma list). Default: 1200.")
@click.option("--ablation", default=None,
              help="Table 1 row: S, D, A, SA, DA, SD, SDA (full VASE, default), SD-[41], or '-' (write --ablation=-).")
@click.option("--entangled", is_flag=True, help="Plain VAE objective (beta = 1) instead of the capacity objective.")
@click.option("--seed", type=int, default=None, help="Training seed (weights, batches, noise).")
@click.option("--data-root", type=click.Path(file_okay=False), default=None,
              help="Data root (default: $VASE_DATA_ROOT or ./datasets).")
@click.option("--download", is_flag=True, help="Download MNIST/Fashion-MNIST with torchvision if missing.")
@click.option("--run-dir", type=click.Path(file_okay=False), default=None,
              help="Output directory (default: runs/<time>-<ablation>-<mode>-seed<seed>).")
@click.option("--resume", "resume_dir", type=click.Path(exists=True, file_okay=False), default=None,
              help="Continue the run in RUN_DIR from its newest good checkpoint, with its own config "
                   "(only --data-root, --download, --no-progress and --set train.keep_every=N may be given "
                   "with it).")
@click.option("--branch", "branch_dir", type=click.Path(exists=True, file_okay=False), default=None,
              help="Start a new run from RUN_DIR's checkpoint of step --at, with RUN_DIR's config and any "
                   "--set or --steps that leave the steps before it alone (docs/usage.md).")
@click.option("--at", "branch_step", type=click.IntRange(min=1), default=None,
              help="With --branch: the step of a checkpoint RUN_DIR keeps (its two newest, a stage end, "
                   "or one every train.keep_every steps).")
@click.option("--until", "until", type=click.IntRange(min=1), default=None, metavar="STEP",
              help="Stop after step STEP with a checkpoint, to go on later with --resume (not part of the "
                   "run's config).")
@click.option("--overwrite", is_flag=True, help="Replace an existing --run-dir.")
@click.option("--set", "overrides", multiple=True, metavar="SECTION.FIELD=VALUE",
              help="Override any config field, e.g. --set mask.lambda_high=2.0 (repeatable).")
@click.option("--no-progress", is_flag=True, help="Hide the progress bar.")
@_device_option()
@_schedule_option()
def train(preset, sequence, steps, ablation, entangled, seed, data_root, download, run_dir, resume_dir,
          branch_dir, branch_step, until, overwrite, overrides, no_progress, device, schedule):
    """Train VASE over a sequence of environments.

    With no options: the full VASE (SDA) on the embedded sprite sequence with the CPU preset.
    """
    import torch

    from vase.branching import plan_branch, write_branch
    from vase.checkpoint import write_atomic
    from vase.device import busy_cpu_note
    from vase.summary import summary_text
    from vase.trainer import Trainer, check_run_dir, prepare_run_dir, run_dir_for

    path = Path(resume_dir) if resume_dir else None
    try:
        if resume_dir:
            _refuse_with_resume(click.get_current_context())
            cfg = load_run_config(path, data_root, download)
            kept_changed = resume_overrides(cfg, list(overrides))
        elif branch_dir:
            _refuse_with_branch(click.get_current_context(), branch_step)
            sets = list(overrides) + option_overrides(sequence, steps)
            branch = plan_branch(Path(branch_dir), branch_step, sets, data_root, download)
            cfg, path = branch.cfg, run_dir_for(branch.cfg, run_dir)
            if path.resolve() == Path(branch_dir).resolve():
                raise VaseError(f"--branch writes a new run: give a --run-dir other than {branch_dir}")
        else:
            if branch_step is not None:
                raise VaseError("--at goes with --branch RUN_DIR")
            sets = list(overrides) + option_overrides(sequence, steps, entangled, seed, data_root, download)
            cfg = build_config(preset, sets, ablation, schedule)
            path = run_dir_for(cfg, run_dir)
        check_run_dir(path, resume=bool(resume_dir), overwrite=overwrite)
        trainer = Trainer(cfg, path, progress=not no_progress, device=_resolve_device(device))
        note = busy_cpu_note(torch.get_num_threads(), trainer.device)
        if note:
            click.echo(note, err=True)
        fill = (lambda target: write_branch(branch, target)) if branch_dir else None
        prepare_run_dir(path, cfg, resume=bool(resume_dir), overwrite=overwrite, fill=fill)
        if resume_dir and kept_changed:
            write_atomic(path / "config.json", config_json_with_kept(path, cfg))
        results = trainer.train(resume=bool(resume_dir or branch_dir), until=until)
        if results is None:
            click.echo(f"paused at step {trainer.learner.step:,} of {cfg.data.total_steps():,}; "
                       f"go on with: vase train --resume {path}")
            return
        text = summary_text(results, path)
        write_atomic(path / "summary.txt", (text + "\n").encode())
    except VaseError as e:
        _fail(e)
    except OSError as e:  # e.g. a full disk or a read-only folder under TensorBoard or the data cache
        _fail(f"{e.filename or 'I/O'}: {e.strerror or e}; the checkpoints already on disk are kept")
    except KeyboardInterrupt:
        started = path is not None and (path / "config.json").is_file()
        click.echo("\ninterrupted" + (f"; resume with: vase train --resume {path}" if started else ""), err=True)
        sys.exit(130)
    click.echo(text)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


# Options that would be silently ignored by --resume (the run keeps its own config).
_NOT_WITH_RESUME = ("preset", "schedule", "sequence", "steps", "ablation", "entangled", "seed", "run_dir", "overwrite",
                    "branch_dir", "branch_step")


# A branch continues another run's state: what made that state cannot be chosen again.
_NOT_WITH_BRANCH = ("preset", "schedule", "ablation", "entangled", "seed")


def _refuse_with_branch(ctx: click.Context, step: int | None) -> None:
    if step is None:
        raise VaseError("--branch RUN_DIR needs --at STEP: the step of a checkpoint RUN_DIR keeps")
    given = [name for name in _NOT_WITH_BRANCH
             if ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT]
    if given:
        flags = ", ".join("--" + n for n in given)
        raise VaseError(f"--branch continues RUN_DIR's state with its config; drop {flags}")


def _refuse_with_resume(ctx: click.Context) -> None:
    given = [name for name in _NOT_WITH_RESUME
             if ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT]
    if given:
        flags = ", ".join("--" + _FLAG_NAMES.get(n, n.replace("_", "-")) for n in given)
        raise VaseError(f"--resume continues a run with its own config.json; drop {flags}")


_FLAG_NAMES = {"overrides": "set", "branch_dir": "branch", "branch_step": "at"}


@main.command(name="eval")
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON instead of a table.")
@click.option("--atypicality", "steps", default=None, metavar="STEPS",
              help="Instead: alpha (eq. 4) of each environment's held-out batches under the encoders saved at "
                   "these steps, e.g. 11000,24000 (docs/regime.md).")
@click.option("--batches", default=40, show_default=True, type=click.IntRange(min=2),
              help="With --atypicality: batches per environment and step.")
@click.option("--own-slot", "own_slot", default=None, metavar="STEPS",
              help="Instead: each environment's held-out error under its own slot with the newest "
                   "checkpoint's decoders (or those of --step), decoded from the codes of the encoders saved "
                   "at these steps, e.g. 12000,24000: how much of what a slot lost is the encoder's drift "
                   "(docs/regime.md).")
@click.option("--by-latent", is_flag=True,
              help="With --own-slot: split the encoder's drift over the latents: the error from the older codes "
                   "with one latent at a time given today's code (docs/regime.md).")
@click.option("--readouts", type=int, default=None, metavar="STEP",
              help="Instead: object identity from mu(x) of the encoder saved at STEP, read by the probe's linear "
                   "classifier on 2,000 and on 20,000 training images, by k nearest neighbours and by an MLP, and "
                   "from the encoder's last hidden layer by the linear classifier: whether the code, the linear "
                   "probe or the encoder's features limit the ID columns; where objects move, position by the "
                   "probe's regressor on mu and on that layer (docs/regime.md).")
@click.option("--envs", "read_envs", callback=_check_sequence, default=None, metavar="ENVS",
              help="With --readouts: read only these environments of the run's sequence, e.g. moving_fashion "
                   "(each takes minutes of a CPU).")
@click.option("--cut-dark", "dark_at", type=int, default=None, metavar="STEP",
              help="With --readouts: read with the fc layer's inputs cut from the last conv's channels that "
                   "fired on none of the environment's held-out images under the encoder saved at this earlier "
                   "STEP: whether units that woke since then carry what was lost (docs/regime.md).")
@click.option("--classifier", is_flag=True,
              help="Instead: at the newest checkpoint, q_psi's mean q(s|x) on each environment's held-out "
                   "images and on dreams of each slot, the slot it names for each batch, and eq. 6's tests of "
                   "each batch against every slot (docs/regime.md).")
@click.option("--also", callback=_check_sequence, default=None, metavar="ENVS",
              help="With --classifier: also read these environments, which need not be in the run's sequence, "
                   "e.g. fashion,mnist: what q_psi keys on (`vase data list` names them).")
@click.option("--step", type=int, default=None,
              help="With --classifier or --own-slot: read the checkpoint of this step instead, one a run "
                   "keeps (its two newest, one at each stage end, and one every train.keep_every steps).")
@click.option("--replay", type=click.IntRange(min=0), default=None, metavar="STEP",
              help="Instead: step the run on from its kept checkpoint of STEP, in memory, and print each "
                   "batch's verdict, q_psi's pick, eq. 6's tests, KL against C(t), its most atypical "
                   "latents and the latents eq. 5 turned on or off in its slot: the batches a run's events "
                   "do not list (docs/regime.md).")
@click.option("--count", type=click.IntRange(min=1), default=20, show_default=True,
              help="With --replay: how many steps.")
@click.option("--latents", default=None, metavar="LIST",
              help="With --replay: show alpha of these latents, e.g. 1,8,16 (default: each batch's 3 most "
                   "atypical).")
@click.option("--turn-on", "turned_on", default=None, metavar="SLOT:LATENT",
              help="With --replay: first set this latent on in this slot, as eq. 5 turns one on, e.g. 1:15: "
                   "what a flip costs each environment (docs/regime.md).")
@click.option("--capacity-form", "capacity_form", type=click.Choice(CHOICES["objective.capacity_form"]),
              default=None, help="With --replay: step on under this form of eq. 8's capacity term "
                                 "(default: the run's).")
@click.option("--mask-changes", "mask_changes", is_flag=True,
              help="Instead: every change of a slot's mask (eq. 5) between two of its logged steps, and each "
                   "slot's last mask, from the run's TensorBoard: a flip in a settled slot (docs/regime.md).")
@click.option("--spikes", is_flag=True,
              help="Instead: the logged steps whose loss is 2.5 times the median of the stage's steps before "
                   "them, each with the kept checkpoint to --replay it from, and the masked latents whose alpha "
                   "sits near a flip, from the run's TensorBoard (docs/regime.md).")
@click.option("--alive-units", "alive", default=None, metavar="STEPS",
              help="Instead: how many units of each encoder layer fire (ReLU output > 0) on each environment's "
                   "held-out images, under the encoders saved at these steps, e.g. 2000,10000, or 'all': a unit "
                   "that never fires gets no gradient and does not come back (docs/regime.md).")
@click.option("--reading", type=click.Choice(PROBE_READINGS), default=None,
              help="The code the probes read: mean, mu(x) of every latent; or sample, the paper's reading, "
                   "the masked posterior under the slot q_psi picks (docs/probes.md). Default: the run's own.")
@click.option("--no-progress", is_flag=True, help="Hide the progress bar of --replay.")
@_device_option()
def evaluate(run_dir, as_json, steps, batches, own_slot, by_latent, readouts, read_envs, dark_at, classifier, also,
             step, replay, count, latents, turned_on, capacity_form, mask_changes, spikes, alive, reading,
             no_progress, device):
    """Recompute probes and metrics from a run's checkpoints and print them."""
    from vase.evaluation import evaluate_run, own_slot_errors_by_encoder, own_slot_text
    from vase.summary import summary_text

    try:
        given = [name for name, on in (("--atypicality", steps is not None), ("--own-slot", own_slot is not None),
                                       ("--readouts", readouts is not None), ("--classifier", classifier),
                                       ("--replay", replay is not None), ("--mask-changes", mask_changes),
                                       ("--spikes", spikes), ("--alive-units", alive is not None)) if on]
        if len(given) > 1:
            raise VaseError(f"{' and '.join(given)} are separate readings: give one at a time")
        count_given = click.get_current_context().get_parameter_source("count") != click.core.ParameterSource.DEFAULT
        if replay is None and (latents is not None or count_given or turned_on or capacity_form):
            raise VaseError("--count, --latents, --turn-on and --capacity-form go with --replay STEP")
        if replay is not None:
            return _replay(Path(run_dir), replay, count, latents, turned_on, capacity_form, as_json,
                           _resolve_device(device), progress=not no_progress)
        if by_latent and own_slot is None:
            raise VaseError("--by-latent goes with --own-slot STEPS: it splits that reading over the latents")
        if step is not None and not (classifier or own_slot is not None):
            raise VaseError("--step goes with --classifier or --own-slot: the other readings take the newest "
                            "checkpoint")
        if also is not None and not classifier:
            raise VaseError("--also goes with --classifier: it adds environments to q_psi's reading")
        if read_envs is not None and readouts is None:
            raise VaseError("--envs goes with --readouts STEP: it chooses the environments read out")
        if dark_at is not None and readouts is None:
            raise VaseError("--cut-dark goes with --readouts STEP: it cuts channels from that reading")
        if mask_changes:
            return _mask_changes(Path(run_dir), as_json)
        if spikes:
            return _spikes(Path(run_dir), as_json)
        if alive is not None:
            from vase.unit_activity import alive_units_by_encoder, alive_units_text

            chosen = None if alive == "all" else _integers("--alive-units", alive)
            rows = alive_units_by_encoder(Path(run_dir), chosen, _resolve_device(device))
            return click.echo(json.dumps(rows, indent=2) if as_json else alive_units_text(rows))
        if readouts is not None:
            return _readouts(Path(run_dir), readouts, read_envs, dark_at, as_json, _resolve_device(device))
        if classifier:
            return _slot_picks(Path(run_dir), step, tuple(comma_list(also or "")), as_json, _resolve_device(device))
        if steps is not None:
            return _typicality(Path(run_dir), steps, batches, as_json, _resolve_device(device))
        if own_slot is not None and by_latent:
            from vase.latent_drift import latent_drift_text, own_slot_drift_by_latent

            rows = own_slot_drift_by_latent(Path(run_dir), _integers("--own-slot", own_slot), _resolve_device(device),
                                            step)
            return click.echo(json.dumps(rows, indent=2) if as_json else latent_drift_text(rows))
        if own_slot is not None:
            rows = own_slot_errors_by_encoder(Path(run_dir), _integers("--own-slot", own_slot), _resolve_device(device),
                                              step)
            return click.echo(json.dumps(rows, indent=2) if as_json else own_slot_text(rows))
        results = evaluate_run(Path(run_dir), device=_resolve_device(device), reading=reading)
    except VaseError as e:
        _fail(e)
    click.echo(json.dumps(results, indent=2) if as_json else summary_text(results, Path(run_dir)))


def _integers(option: str, text: str, what: str = "steps", example: str = "11000,24000") -> list[int]:
    try:
        return [int(value) for value in comma_list(text)]
    except ValueError:
        raise VaseError(f"{option} {text!r}: give {what} as integers separated by commas, e.g. {example}") \
            from None


def _mask_changes(run_dir: Path, as_json: bool) -> None:
    from dataclasses import asdict

    from vase.mask_changes import mask_changes, mask_changes_text, read_logged_masks

    found = mask_changes(read_logged_masks(run_dir))
    if as_json:
        return click.echo(json.dumps(asdict(found), indent=2))
    click.echo(mask_changes_text(found, load_run_config(run_dir, trains=False).data.sequence))


def _spikes(run_dir: Path, as_json: bool) -> None:
    from dataclasses import asdict

    from vase.checkpoint import kept_steps
    from vase.loss_spikes import read_spikes, spikes_text

    cfg = load_run_config(run_dir, trains=False)
    spikes, risky, every = read_spikes(run_dir, kept_steps(run_dir), cfg.mask.lambda_high)
    if as_json:
        return click.echo(json.dumps({"spikes": [asdict(s) for s in spikes], "at_risk": [asdict(r) for r in risky],
                                      "every": every}, indent=2))
    click.echo(spikes_text(run_dir, spikes, risky, every, cfg.data.sequence))


def _slot_picks(run_dir: Path, step: int | None, also: tuple[str, ...], as_json: bool, device) -> None:
    from vase.inspection import open_run
    from vase.slot_picks import held_out_sources, slot_picks, slot_picks_text, slot_tests, slot_tests_text

    if not load_run_config(run_dir, trains=False).inference.enabled:
        raise VaseError(f"{run_dir} was trained with S off: one slot, and no q_psi to read")
    evaluator = open_run(run_dir, step, device=device)
    sources = held_out_sources(evaluator, also)
    picks, tests = slot_picks(evaluator, sources), slot_tests(evaluator, sources)
    learner = evaluator.learner
    if as_json:
        return click.echo(json.dumps({"step": learner.step, "current": learner.inference.current,
                                      "picks": [row.as_dict() for row in picks],
                                      "tests": [row.as_dict() for row in tests]}, indent=2))
    click.echo(slot_picks_text(picks, learner.step, learner.inference.current) + "\n\n" + slot_tests_text(tests))


def _replay(run_dir: Path, step: int, count: int, latents: str | None, turned_on: str | None,
            capacity_form: str | None, as_json: bool, device, progress: bool) -> None:
    from vase.replay import replay, replay_text

    shown = _integers("--latents", latents, "latents", "1,8,16") if latents is not None else None
    flip = None
    if turned_on is not None:
        parts = turned_on.split(":")
        if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
            raise VaseError(f"--turn-on {turned_on}: give SLOT:LATENT, e.g. 1:15")
        flip = (int(parts[0]), int(parts[1]))
    result = replay(run_dir, step, count, shown, device=device, turned_on=flip, capacity_form=capacity_form,
                    progress=progress)
    click.echo(json.dumps(result.as_dict(), indent=2) if as_json else replay_text(result))


def _readouts(run_dir: Path, step: int, envs: str | None, dark_at: int | None, as_json: bool, device) -> None:
    from vase.readouts import readouts_text, run_readouts

    cfg = load_run_config(run_dir, trains=False)
    rows = run_readouts(run_dir, cfg, step, device, echo=lambda line: click.echo(line, err=True),
                        envs=comma_list(envs) if envs else None, dark_at=dark_at)
    click.echo(json.dumps([row.as_dict() for row in rows], indent=2) if as_json else readouts_text(rows))


def _typicality(run_dir: Path, steps: str, batches: int, as_json: bool, device) -> None:
    from vase.typicality import run_typicality, typicality_text

    wanted = _integers("--atypicality", steps)
    cfg = load_run_config(run_dir, trains=False)
    rows = run_typicality(run_dir, cfg, wanted, batches, device=device)
    click.echo(json.dumps([row.as_dict() for row in rows], indent=2) if as_json
               else typicality_text(rows, (cfg.mask.lambda_low, cfg.mask.lambda_high)))


@main.command(name="table")
@click.argument("run_dirs", nargs=-1, required=True, type=click.Path(exists=True, file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the rows as JSON instead of a table.")
@click.option("--markdown", is_flag=True, help="Print markdown tables: Table 1 beside the paper's, and the "
              "held-out errors of each environment under its own slot.")
@click.option("--output", type=click.Path(dir_okay=False), default=None,
              help="Write the markdown results page (docs/results.md) to this file.")
@click.option("--readme", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Rewrite this file's results block, between <!-- results:begin --> and <!-- results:end -->.")
@click.option("--in-progress", "in_progress", is_flag=True,
              help="Also read runs still training, each at its newest checkpoint: MAX over the environments "
                   "begun, CHANGE over the stages ended; their rows are named 'in progress' (docs/usage.md).")
@click.option("--curves", default=None, metavar="STEPS",
              help="Instead: the runs' probe readings side by side at these steps, e.g. 60000-180000:4000, "
                   "as markdown, from results.json or the newest checkpoint (docs/usage.md).")
@click.option("--envs", default=None, metavar="ENVS",
              help="With --curves: the environments each cell reads, e.g. moving_fashion,mnist "
                   "(default: the run's sequence).")
@_device_option()
def table(run_dirs, as_json, markdown, output, readme, in_progress, curves, envs, device):
    """Table 1 from finished runs: one row per ablation and mode, mean (±std) over their seeds.

    Give the run directories of a grid, e.g. `vase table runs/*`. Runs of different sequences
    form separate rows. docs/results.md and the README's results table are made with
    `vase table docs/results/*/* --markdown --output docs/results.md --readme README.md`.
    """
    from vase.report import markdown_tables, results_page, rewrite_readme
    from vase.table1 import load_results, table1_rows, table1_text

    dirs = sorted(Path(d) for d in run_dirs)
    if curves is not None or envs is not None:
        _curves(dirs, curves, envs, [name for name, on in (("--json", as_json), ("--markdown", markdown),
                ("--output", output), ("--readme", readme), ("--in-progress", in_progress)) if on])
        return
    try:
        if in_progress and (output or readme):
            raise VaseError("--output and --readme write the committed results from finished runs; "
                            "print a table of runs in progress without them")
        rows = table1_rows(load_results(dirs, in_progress, _resolve_device(device) if in_progress else "cpu"))
        if output:
            Path(output).write_text(results_page(rows, dirs, Path(output)))
            click.echo(f"wrote {output}")
        if readme:
            rewrite_readme(Path(readme), dirs)
            click.echo(f"rewrote the results block of {readme}")
    except VaseError as e:
        _fail(e)
    if as_json:
        click.echo(json.dumps(rows, indent=2))
    elif markdown and not (output or readme):
        click.echo(markdown_tables(rows))
    elif not (output or readme):
        click.echo(table1_text(rows))


def _curves(dirs: list[Path], curves: str | None, envs: str | None, others: list[str]) -> None:
    from vase.probe_curves import curves_markdown, parse_steps

    try:
        if curves is None:
            raise VaseError("--envs goes with --curves STEPS: it picks the environments the curves read")
        if others:
            raise VaseError(f"--curves prints its own markdown table; drop {', '.join(others)}")
        click.echo(curves_markdown(dirs, parse_steps(curves), comma_list(envs) if envs else None))
    except VaseError as e:
        _fail(e)


@main.command(name="inspect")
@click.argument("run_dir", type=click.Path(file_okay=False))
@click.argument("pictures", nargs=-1)
@click.option("--step", type=int, default=None, help="Checkpoint step to read (default: the newest kept).")
@click.option("--used-only", is_flag=True, help="Traversals: only the latents each slot uses.")
@click.option("--image", type=click.IntRange(min=0), default=0, show_default=True,
              help="Traversals: index of the held-out seed image of each environment.")
@click.option("--source", default=None,
              help="Cross-domain and traversals: this environment's images only (default: one per "
                   "environment; traversals: one per slot).")
@click.option("--envs", default=None, metavar="A,B",
              help="Ambiguity: the two environments to interpolate (default: the first two of the sequence).")
@click.option("--data-root", type=click.Path(file_okay=False), default=None,
              help="Data root, if the run's data has moved.")
@_device_option()
def inspect(run_dir, pictures, step, used_only, image, source, envs, data_root, device):
    """Write the paper's pictures of a run as PNG (and GIF) files into RUN_DIR/inspect.

    PICTURES: any of traversals, cross_domain, latent_use, atypicality, probes,
    own_slot, ambiguity (default: all). See docs/inspect.md.
    """
    from vase.inspection import InspectOptions, inspect_run

    pair = tuple(comma_list(envs)) if envs else None
    try:
        if pair is not None and len(pair) != 2:
            raise VaseError(f"--envs takes two environments, A,B; got {envs!r}")
        options = InspectOptions(step, used_only, image, source, pair, data_root, str(_resolve_device(device)))
        paths = inspect_run(Path(run_dir), pictures, options, echo=click.echo)
    except VaseError as e:
        _fail(e)
    for path in paths:
        click.echo(str(path))


@main.command()
@click.option("--rows", default="all", show_default=True,
              help="Table 1 rows, comma-separated (-, S, D, A, SA, DA, SD, SDA, SD-[41]), or 'all'.")
@click.option("--modes", default="disentangled,entangled", show_default=True,
              help="Objectives: disentangled (capacity, eq. 3), entangled (beta = 1), or both.")
@click.option("--seeds", default="0-4", show_default=True, help="Training seeds, e.g. 0-4 or 0,2,7.")
@click.option("--preset", type=click.Choice(preset_names()), default="cpu", show_default=True,
              help="Network size, as for `vase train`.")
@click.option("--sequence", callback=_check_sequence, default=None,
              help="Comma-separated environments. Default: the paper's moving_fashion,mnist,moving_mnist.")
@click.option("--steps", default=None, help="Steps per environment, as for `vase train`. Default: 1200.")
@click.option("--set", "overrides", multiple=True, metavar="SECTION.FIELD=VALUE",
              help="Override a config field in every run (repeatable).")
@click.option("--root", type=click.Path(file_okay=False), default="runs/grid", show_default=True,
              help="One run directory per cell, <row>-<mode>-s<seed>, plus logs/ and table1.txt/json.")
@click.option("--threads", type=click.IntRange(min=1), default=1, show_default=True,
              help="Torch threads per run (saved in each run's config as train.threads).")
@click.option("--workers", type=click.IntRange(min=1), default=None,
              help="Runs at a time on this machine. Default: CPU cores / --threads.")
@click.option("--ray", "use_ray", is_flag=True, help="Run every cell as a Ray task (pip install -e \".[grid]\").")
@click.option("--ray-address", default=None,
              help="Ray cluster to join ('auto', or host:port). Default: a Ray instance on this machine.")
@click.option("--data-root", type=click.Path(file_okay=False), default=None,
              help="Data root (default: $VASE_DATA_ROOT or ./datasets).")
@click.option("--download", is_flag=True, help="Download MNIST/Fashion-MNIST with torchvision if missing.")
@click.option("--dry-run", is_flag=True,
              help="List the runs, their state and their `vase train` commands; train nothing.")
@click.option("--no-progress", is_flag=True, help="Hide the progress bar.")
@_device_option()
@_schedule_option()
@click.option("--gpus", type=click.IntRange(min=0), default=0, show_default=True,
              help="GPUs of this machine to spread the runs over (each run sees one, via CUDA_VISIBLE_DEVICES).")
@click.option("--runs-per-gpu", type=click.IntRange(min=1), default=1, show_default=True,
              help="Runs sharing one GPU at a time (with --gpus; with --ray each run asks for 1/N of a GPU).")
@click.option("--share-first-stage", is_flag=True,
              help="Train each seed's SDA cell to its first stage's end, then branch the other rows from there "
                   "with their switches: before the first allocation they train alike (docs/usage.md). D and DA, "
                   "which dream from the start, and a cell whose source allocated or held batches pending by "
                   "then train from step 0; cells that wait on no first stage start beside them.")
def grid(rows, modes, seeds, preset, sequence, steps, overrides, root, threads, workers, use_ray, ray_address,
         data_root, download, dry_run, no_progress, device, schedule, gpus, runs_per_gpu, share_first_stage):
    """Run the ablation grid (rows x modes x seeds of `vase train`) and print Table 1.

    Runs go in parallel on this machine, or on a Ray cluster with --ray. Run the same command
    again to resume: finished runs are kept and interrupted ones continue from their checkpoints.
    """
    from vase.device import mps_running
    from vase.grid import PAPER_SEQUENCE, GridSpec, dry_run_lines, parse_modes, parse_rows, parse_seeds, run_grid
    from vase.grid_backends import backend_for

    try:
        spec = GridSpec(parse_rows(rows), parse_modes(modes), parse_seeds(seeds), Path(root), preset,
                        sequence or PAPER_SEQUENCE, steps, tuple(overrides), threads, data_root, download,
                        "cuda" if gpus or (runs_per_gpu > 1 and (use_ray or ray_address)) else device, schedule,
                        share_first_stage)
        for run in spec.runs():  # every cell's config is valid before anything starts
            spec.config(run)
        backend = backend_for(threads, workers, use_ray, ray_address, gpus, runs_per_gpu, device)
        if dry_run:
            for line in dry_run_lines(spec):
                click.echo(line)
            return
        if gpus and runs_per_gpu > 1 and not mps_running():
            click.echo(f"note: {runs_per_gpu} runs will share each GPU without NVIDIA MPS, time-sliced one process "
                       "at a time; `nvidia-cuda-mps-control -d` lets their kernels run side by side (docs/devices.md)")
        previous = signal.signal(signal.SIGTERM, _interrupt)  # a scheduler's SIGTERM stops the runs as Ctrl-C does
        # The grid stops its runs with SIGINT. A shell without job control starts `vase grid &`
        # with SIGINT ignored, and the runs would inherit that and train on until killed.
        previous_int = signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            report = run_grid(spec, backend, echo=click.echo, progress=not no_progress)
        finally:
            signal.signal(signal.SIGTERM, previous)
            signal.signal(signal.SIGINT, previous_int)
    except VaseError as e:
        _fail(e)
    except KeyboardInterrupt:
        click.echo("\ninterrupted; run the same command again to resume the grid", err=True)
        sys.exit(130)
    if report.table:
        click.echo(report.table)
        click.echo(f"Table 1 written to {Path(root) / 'table1.txt'} and table1.json")
    if report.failed:
        for name, why in report.failed:
            click.echo(f"failed: {name}: {why}", err=True)
        _fail(f"{len(report.failed)} of {len(report.planned)} runs failed; their logs are in {Path(root) / 'logs'}; "
              "run the same command again to retry them")


@main.group()
def data():
    """Import, download or list the data environments."""


@data.command(name="import")
@click.argument("source", type=click.Path(exists=True, file_okay=False))
@click.option("--data-root", type=click.Path(file_okay=False), default=None,
              help="Destination data root (default: $VASE_DATA_ROOT or ./datasets).")
def data_import(source, data_root):
    """Copy already-downloaded MNIST/FashionMNIST raw files from SOURCE into the data root (MD5-checked).

    SOURCE is a folder holding MNIST/raw and/or FashionMNIST/raw with the original .gz files.
    """
    from vase.config import DataConfig
    from vase.data.importing import import_raw

    root = DataConfig(root=data_root or "").resolved_root()
    try:
        copied = import_raw(Path(source), root)
    except VaseError as e:
        _fail(e)
    click.echo(f"imported {len(copied)} files into {root}")


@data.command(name="list")
def data_list():
    """List the known environment names."""
    from vase.data.environments import ENVIRONMENT_NAMES

    for name in ENVIRONMENT_NAMES:
        click.echo(name)


@main.command()
@click.option("--preset", "presets", multiple=True, type=click.Choice(preset_names()),
              help="Preset(s) to measure (default: all).")
@click.option("--steps", type=click.IntRange(min=1), default=20, show_default=True,
              help="Timed steps per variant (spread over up to 5 interleaved rounds).")
@click.option("--json-out", type=click.Path(dir_okay=False), default=None,
              help="Write the results to this JSON file (default: runs/bench/bench-<time>.json).")
@click.option("--skip-memory", is_flag=True, help="Skip the peak-memory run of the default training.")
@click.option("--memory-steps", type=click.IntRange(min=1), default=100, show_default=True,
              help="Steps per environment of the default training run whose peak memory is measured.")
@click.option("--threads", type=click.IntRange(min=0), default=0, show_default=True,
              help="Torch threads for the timings (0 = library default, as `vase train` uses).")
@_device_option("cpu")
@click.option("--share", type=click.IntRange(min=1), default=8, show_default=True,
              help="With a CUDA --device: runs training at once on the GPU for the sharing figure (1: skip).")
@click.option("--compile/--no-compile", "compile_", default=True, show_default=True,
              help="With an accelerator --device: also time train.compile (compiling takes a minute or two).")
@click.option("--run", "run_dir", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="Instead: time this run's own training step from its newest checkpoint, with the CPU's "
                   "denormals kept and flushed to zero (train.flush_denormals), interleaved.")
def bench(presets, steps, json_out, skip_memory, memory_steps, threads, device, share, compile_, run_dir):
    """Measure step throughput, FLOP/s against this machine's peak, overhead and memory.

    Every variant (plain and VASE steps, 1 vs 8 past environments, the code before the speed work,
    a straightforward NCHW reference) is timed interleaved in one run, so ratios hold even when the
    machine is busy; absolute numbers do not. Prints a table and writes the JSON. With --run, a
    trained run's own step instead. See docs/benchmarks.md.
    """
    from vase.bench import run_bench

    if run_dir is not None:
        from vase.bench_run import bench_run

        try:
            bench_run(run_dir, steps, threads, json_out, echo=click.echo)
        except VaseError as e:
            _fail(e)
        return
    dev = _resolve_device(device)
    if dev.type != "cpu":
        from vase.bench_device import run_device_bench

        run_device_bench(dev, list(presets) or preset_names(), max(steps, 20), json_out, share, 20.0, compile_,
                         echo=click.echo)
        return
    try:
        run_bench(list(presets) or preset_names(), steps, json_out, skip_memory,
                  threads=threads, memory_steps=memory_steps)
    except VaseError as e:
        _fail(e)


if __name__ == "__main__":
    main()
