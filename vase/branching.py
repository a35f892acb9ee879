"""A new run that starts from another run's kept checkpoint with other settings (`vase train --branch`).

A question about one moment of a run, such as how another inference rule would judge the batches
of an environment that arrives at step N, needs the run's state at N, not its first N steps again.
A branch copies that state (a checkpoint the source keeps: its two newest, and those kept for good
at each stage end and every train.keep_every steps), with the history the run's outputs rest on up
to N (TensorBoard, the encoders and slots of the probe points, the checkpoints kept for good), into
a new run directory whose config is the source's
with the overrides applied, and trains from N on. With no override, the branch is the source run
from N on, bit for bit (tested).

What happened before N cannot change, so an override may not touch what shaped it: the networks,
the data and its sequence (the probes are built over every environment of it), the probes, the seed
and the batch size, or the length of a stage that ended by N. Everything else (the inference,
masks, dreams, objective, and the length of the stages after N) may differ.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from vase import rules
from vase.checkpoint import (
    STAGES_DIR,
    checkpoint_dir,
    kept_path,
    kept_steps,
    load_checkpoint,
    save_checkpoint,
    write_atomic,
)
from vase.config import Config, load_run_config
from vase.errors import VaseError
from vase.evaluation import ENCODER_DIR, SLOTS_DIR
from vase.progress_file import PROGRESS_FILE
from vase.tensorboard_logger import TB_DIR

BRANCH_FILE = "branch.json"
# Sections and fields that shaped the state at the branch point (data.steps_per_env is checked
# stage by stage; data.root and data.download say only where the data lives).
FIXED_SECTIONS = ("model", "probe")
FIXED_FIELDS = (("train", "seed"), ("train", "batch_size"))
LOCATION_FIELDS = ("root", "download", "steps_per_env")


@dataclass
class Branch:
    """What a branch starts from: the source run, its step, its state there, and the new config."""

    source: Path
    step: int
    overrides: list[str]
    cfg: Config
    state: dict


def plan_branch(source: Path, step: int, overrides: list[str], data_root: str | None = None,
                download: bool = False) -> Branch:
    """The source run's checkpoint of `step` and its config with `overrides`, refused where they
    would rewrite what happened before `step`; nothing is written."""
    state, _ = load_checkpoint(source, step)
    before = load_run_config(source, data_root, download)
    cfg = load_run_config(source, data_root, download)
    for o in overrides:
        cfg.override(o)
    cfg.validate()
    was, now = before.to_dict(), cfg.to_dict()
    changed = [f"{section}.{name}" for section in FIXED_SECTIONS for name in was[section]
               if was[section][name] != now[section][name]]
    changed += [f"{section}.{name}" for section, name in FIXED_FIELDS if was[section][name] != now[section][name]]
    changed += [f"data.{name}" for name in was["data"]
                if name not in LOCATION_FIELDS and was["data"][name] != now["data"][name]]
    if changed:
        raise VaseError(f"a branch continues the state of step {step}, which {', '.join(changed)} shaped; "
                        "these cannot change at a branch")
    _check_stages_before(before, cfg, step)
    if before.inference.enabled and not cfg.inference.enabled:
        check_rules_keep_one_slot(before)
        check_trained_as_one_slot(before, state, step)
    return Branch(Path(source), step, list(overrides), cfg, state)


def _check_stages_before(before: Config, after: Config, step: int) -> None:
    """The stages that ended by `step` kept their lengths, and `step` falls inside the branch's
    sequence (the environments are the source's: `branch_config`)."""
    ended = [(name, end) for name, end in zip(before.data.sequence, before.data.stage_ends()) if end <= step]
    if after.data.stage_ends()[:len(ended)] != [end for _, end in ended]:
        raise VaseError(f"the branch must keep the stages trained by step {step} as they were "
                        f"({', '.join(f'{name} to step {end}' for name, end in ended)}); "
                        "change the steps of the later ones only")
    if after.data.stage_ends()[-1] <= step:
        raise VaseError(f"the branch's sequence ends at step {after.data.stage_ends()[-1]}, with nothing to "
                        f"train after step {step}")


def check_rules_keep_one_slot(before: Config) -> None:
    """The source's rules leave the latents of its one slot unmasked (`others_latents_only` masks
    only latents other slots use, so with one slot it masks none), as a run without S or A does."""
    if before.mask.enabled and "others_latents_only" not in rules.chosen(before):
        raise VaseError(f"the source's rules ({before.inference.rules}) may mask latents of its one slot, "
                        "which a run without S never does; branch from a run whose rules include "
                        "others_latents_only")


def check_trained_as_one_slot(before: Config, state: dict, step: int) -> None:
    """A branch that turns a switch off continues a run without it only if the source trained as one
    did up to `step` (docs/usage.md, rows that share a first stage): no second slot (after the first
    allocation S, D and A change the model) and no batch held out while pending."""
    inferred = state["learner"]["inference"]["n_envs"]
    if inferred > 1:
        raise VaseError(f"the source had inferred {inferred} environments by step {step}, and from its first "
                        "allocation on S, D and A change the model; branch from a step before it")
    held_out = state["record"]["pending"]
    if held_out and "frozen_while_pending" in rules.chosen(before):
        raise VaseError(f"the source held {held_out} pending batches out of training by step {step}, "
                        "which a run without S trains on; branch from a run that held none")


def link_or_copy(path: Path, dst: Path) -> None:
    """A second name for a file the source wrote once, or a copy where the filesystem has no hard links.
    A run never writes into such a file: every write renames a new one over the name
    (`write_atomic`), so the source and the branch cannot change each other's."""
    try:
        os.link(path, dst)
    except OSError:
        shutil.copy2(path, dst)


def write_branch(branch: Branch, target: Path) -> None:
    """Into the new run directory `target`: the source's checkpoint of the branch's step, and what
    the run's outputs rest on up to it: TensorBoard (cut at the step when the branch starts to
    train), the probe points' encoders and slots, the checkpoints kept for good (hard links where the
    filesystem has them: with train.keep_every a run keeps GiBs), the progress file; then branch.json."""
    source, step = branch.source, branch.step
    src, dst = checkpoint_dir(source), checkpoint_dir(target)
    for folder in (ENCODER_DIR, SLOTS_DIR):
        for path in sorted((src / folder).glob("step-*.pt")):
            if int(path.stem.split("-")[1]) <= step:
                (dst / folder).mkdir(parents=True, exist_ok=True)
                link_or_copy(path, dst / folder / path.name)
    for kept in kept_steps(source):
        if kept < step:
            (dst / STAGES_DIR).mkdir(parents=True, exist_ok=True)
            for path in (kept_path(source, kept), kept_path(source, kept).with_suffix(".json")):
                link_or_copy(path, dst / STAGES_DIR / path.name)
    if (source / TB_DIR).is_dir():
        shutil.copytree(source / TB_DIR, target / TB_DIR)
    save_checkpoint(target, branch.state, {"step": step, "ablation": branch.cfg.ablation()},
                    keep=step in branch.cfg.data.stage_ends() or branch.cfg.train.keeps(step))
    # how far the run has come, for `vase grid`'s bar and dry run before the branch starts to train
    write_atomic(target / PROGRESS_FILE, json.dumps({"step": step, "total": branch.cfg.data.total_steps()}).encode())
    write_atomic(target / BRANCH_FILE, json.dumps(
        {"source": str(source), "step": step, "overrides": branch.overrides}, indent=2).encode())


def branch_origin(run_dir: Path) -> dict | None:
    """Where a branched run started, for its results.json: the source run's folder name (not its
    path, which names a machine), the step and the overrides; None for a run trained from step 0."""
    path = Path(run_dir) / BRANCH_FILE
    if not path.is_file():
        return None
    origin = json.loads(path.read_text())
    return {"source": Path(origin["source"]).name, "step": origin["step"], "overrides": origin["overrides"]}
