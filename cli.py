"""The `vase` command line: train, evaluate, benchmark, and manage data."""
from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import click

from vase.config import build_config, load_run_config, preset_names
from vase.errors import VaseError

DEFAULT_SEQUENCE_HELP = "moving_shapes_a,shapes_b,moving_shapes_b (embedded sprites, no download)"


def _fail(e: Exception) -> None:
    raise click.ClickException(str(e)) from None


def _show_warnings() -> None:
    """Print library warnings as one clean line each (no file/line noise)."""
    warnings.showwarning = lambda message, *args, **kwargs: click.echo(f"warning: {message}", err=True)


def _check_sequence(ctx, param, value):
    if value is None:
        return value
    from vase.data.environments import ENVIRONMENT_NAMES

    names = [v.strip() for v in value.split(",") if v.strip()]
    unknown = [n for n in names if n not in ENVIRONMENT_NAMES]
    if not names or unknown:
        raise click.BadParameter(
            f"unknown environment(s) {', '.join(unknown) or '(empty)'}; known: {', '.join(ENVIRONMENT_NAMES)}"
        )
    return ",".join(names)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="vase")
def main():
    """VASE: life-long disentangled representation learning (Achille et al., NeurIPS 2018).

    Train over a sequence of environments, evaluate probes, benchmark the step, manage data.
    Run `vase COMMAND --help` for each command's options.
    """
    _show_warnings()


@main.command()
@click.option("--preset", type=click.Choice(preset_names()), default="cpu", show_default=True,
              help="Network size: 'paper' (64-64-128-128 convs) or 'cpu' (32 channels everywhere).")
@click.option("--sequence", callback=_check_sequence, default=None,
              help=f"Comma-separated environments in training order. Default: {DEFAULT_SEQUENCE_HELP}.")
@click.option("--steps", default=None, help="Steps per environment: one number, or one per environment (comma list).")
@click.option("--ablation", default=None,
              help="Table 1 row: '-', S, D, A, SA, DA, SD, SDA (full VASE, default) or SD-[41].")
@click.option("--entangled", is_flag=True, help="Plain VAE objective (beta = 1) instead of the capacity objective.")
@click.option("--seed", type=int, default=None, help="Training seed (weights, batches, noise).")
@click.option("--data-root", type=click.Path(file_okay=False), default=None,
              help="Data root (default: $VASE_DATA_ROOT or ./datasets).")
@click.option("--download", is_flag=True, help="Download MNIST/Fashion-MNIST with torchvision if missing.")
@click.option("--run-dir", type=click.Path(file_okay=False), default=None,
              help="Output directory (default: runs/<time>-<ablation>-<mode>-seed<seed>).")
@click.option("--resume", "resume_dir", type=click.Path(exists=True, file_okay=False), default=None,
              help="Continue the run in RUN_DIR from its latest good checkpoint, with its own config.")
@click.option("--overwrite", is_flag=True, help="Replace an existing --run-dir.")
@click.option("--set", "overrides", multiple=True, metavar="SECTION.FIELD=VALUE",
              help="Override any config field, e.g. --set mask.lambda_high=2.0 (repeatable).")
@click.option("--no-progress", is_flag=True, help="Hide the progress bar.")
def train(preset, sequence, steps, ablation, entangled, seed, data_root, download, run_dir, resume_dir,
          overwrite, overrides, no_progress):
    """Train VASE over a sequence of environments.

    With no options: the full VASE (SDA) on the embedded sprite sequence with the CPU preset.
    """
    from vase.trainer import Trainer, prepare_run_dir, run_dir_for
    from vase.report import summary_text

    try:
        if resume_dir:
            cfg = load_run_config(Path(resume_dir))
            path = Path(resume_dir)
        else:
            sets = list(overrides)
            if sequence:
                sets.append(f"data.sequence={sequence}")
            if steps:
                sets.append(f"data.steps_per_env={steps}")
            if entangled:
                sets.append("objective.mode=entangled")
            if seed is not None:
                sets.append(f"train.seed={seed}")
            if data_root:
                sets.append(f"data.root={data_root}")
            if download:
                sets.append("data.download=true")
            cfg = build_config(preset, sets, ablation)
            path = run_dir_for(cfg, run_dir)
        prepare_run_dir(path, resume=bool(resume_dir), overwrite=overwrite)
        trainer = Trainer(cfg, path, progress=not no_progress)
        results = trainer.train(resume=bool(resume_dir))
    except VaseError as e:
        _fail(e)
    except KeyboardInterrupt:
        click.echo(f"\ninterrupted; resume with: vase train --resume {path}", err=True)
        sys.exit(130)
    text = summary_text(results, path)
    (path / "summary.txt").write_text(text + "\n")
    click.echo(text)


@main.command(name="eval")
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON instead of a table.")
def evaluate(run_dir, as_json):
    """Recompute probes and metrics from a run's checkpoints and print them."""
    from vase.evaluation import evaluate_run
    from vase.report import summary_text

    try:
        results = evaluate_run(Path(run_dir))
    except VaseError as e:
        _fail(e)
    click.echo(json.dumps(results, indent=2) if as_json else summary_text(results, Path(run_dir)))


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
@click.option("--steps", type=int, default=20, show_default=True, help="Timed steps per measurement.")
@click.option("--json-out", type=click.Path(dir_okay=False), default=None, help="Also write the results to this JSON file.")
@click.option("--skip-memory", is_flag=True, help="Skip the peak-memory run of the default training.")
def bench(presets, steps, json_out, skip_memory):
    """Measure step throughput, FLOP/s against this machine's peak, overhead and memory."""
    from vase.bench import run_bench

    try:
        run_bench(list(presets) or preset_names(), steps, json_out, skip_memory)
    except VaseError as e:
        _fail(e)


if __name__ == "__main__":
    main()
