"""Evaluation of a run: disentanglement metrics at boundaries, and `vase eval`'s replay.

`vase eval RUN_DIR` reloads the encoder weights the trainer saved at every probe point and recomputes
the probes with the same fixed probe sets, so it reproduces the run's probe numbers exactly; it
also recomputes MIG and DCI at every environment boundary, and, with the last saved encoder, the
latents that carry each factor in every environment (`factor_latents` of the latent-use table).
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import torch

from vase.checkpoint import has_checkpoint, load_weights
from vase.config import Config, load_run_config
from vase.config_sections import PROBE_READINGS
from vase.conv_paths import place
from vase.data.environments import load_sequence
from vase.errors import VaseError
from vase.metrics.disentanglement import dci, mig
from vase.metrics.factor_latents import strongest_latents
from vase.networks import Encoder
from vase.probing import PosteriorSamples, ProbeSuite, SlotReading

# Held-out images per environment for MIG/DCI [ours]: enough for 20-bin histograms, fast on 2 cores.
METRIC_IMAGES = 2000
# Held-out images per environment for the reconstruction-error matrix and the latent-use table.
HELD_OUT = 512
ENCODER_DIR = "encoders"
SLOTS_DIR = "slots"  # the masks and q_psi of every probe point, for the paper's reading


class FrozenEncoder:
    """mu(x) of an encoder rebuilt from saved weights: what probes and metrics see.

    Training and `vase eval` both go through this one class, so they compute bit-identical
    numbers (the trained model runs in channels_last, whose float results differ in the 7th digit).
    """

    def __init__(self, cfg_model, device: torch.device | str = "cpu"):
        self.net = place(Encoder(cfg_model), device)

    def load(self, state: dict) -> "FrozenEncoder":
        self.net.load_state_dict(state)
        return self

    @torch.no_grad()
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).mu

    @torch.no_grad()
    def posterior(self, x: torch.Tensor):
        return self.net(x)


def held_out_images(env) -> torch.Tensor:
    """The first HELD_OUT test images of env, as the trainer and `vase eval` both read them."""
    return env.batch(torch.arange(min(HELD_OUT, len(env))))


def factor_latents(env, encode: FrozenEncoder, x: torch.Tensor) -> dict:
    """The latents that carry each factor of env, on its held-out images x (the latent-use table's
    `factor_latents`, for the trainer and for `vase eval` alike)."""
    post = encode.posterior(x)
    names, factors = env.factor_names(), env.factor_matrix()[: x.shape[0]]
    return strongest_latents(post.mu.cpu().numpy(), factors, names, post.logvar.exp().cpu().numpy())


def encoder_path(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / ENCODER_DIR / f"step-{step:08d}.pt"


def slots_path(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / SLOTS_DIR / f"step-{step:08d}.pt"


def kept_slots(run_dir: Path, cfg: Config, step: int, device: torch.device | str = "cpu") -> SlotReading | None:
    """The slots the run kept at this probe point, or None where it kept none. A run with S and A
    off has one slot and no mask, so it needs none kept."""
    path = slots_path(run_dir, step)
    if path.exists():
        return SlotReading.load(load_weights(path), cfg.model, device)
    if not cfg.inference.enabled and not cfg.mask.enabled:
        return SlotReading.single(cfg.model.latents, device)
    return None


def slots_at(run_dir: Path, cfg: Config, step: int, device: torch.device | str = "cpu") -> SlotReading:
    """`kept_slots`, where a run without them cannot be read the paper's way: a clear error."""
    slots = kept_slots(run_dir, cfg, step, device)
    if slots is not None:
        return slots
    raise VaseError(
        f"{run_dir} kept no slots of step {step} (checkpoints/{SLOTS_DIR}): the paper's reading (probe.reading="
        "sample) needs each probe point's masks and classifier, which runs save from this version of vase on")


def saved_encoders(run_dir: Path) -> dict[int, Path]:
    """The encoders a run saved at its probe points, by step, in step order."""
    paths = (Path(run_dir) / "checkpoints" / ENCODER_DIR).glob("step-*.pt")
    return dict(sorted((int(path.stem.split("-")[1]), path) for path in paths))


def encoders_at(run_dir: Path, steps: list[int], every: int) -> dict[int, Path]:
    """The saved encoders of these steps, or a clear error naming the ones the run did not keep."""
    kept = saved_encoders(run_dir)
    missing = [step for step in steps if step not in kept]
    if missing:
        where = f"kept: {min(kept)}..{max(kept)}, every {every}" if kept else "it has none"
        raise VaseError(f"{run_dir} has no saved encoder of step {', '.join(map(str, missing))} ({where})")
    return {step: kept[step] for step in steps}


def own_slot_errors_by_encoder(run_dir: Path, steps: list[int], device: torch.device | str = "cpu",
                               checkpoint_step: int | None = None) -> list[dict]:
    """Each environment's held-out error under the slot it trained in, with the decoders and masks of
    the run's checkpoint of `checkpoint_step` (default: the newest), decoded from the codes of the
    encoder saved at each step: how much of what a slot lost is the shared encoder's drift since
    that step (docs/regime.md, "The slot or the shared encoder"). One row per step and environment
    the checkpoint has seen."""
    return own_slot_rows(*open_with_encoders(run_dir, steps, device, checkpoint_step), device)


def open_with_encoders(run_dir: Path, steps: list[int], device: torch.device | str = "cpu",
                       checkpoint_step: int | None = None):
    """The run as it stood at its checkpoint of `checkpoint_step` (default: the newest;
    `vase.inspection.open_run`) and its saved encoders of `steps` ({step: file}), for the
    own-slot readings."""
    from vase.inspection import open_run

    cfg = load_run_config(run_dir, trains=False)
    paths = encoders_at(run_dir, steps, cfg.probe.every)  # before the data loads: a missing step fails at once
    return open_run(run_dir, checkpoint_step, device=device), paths


def own_slot_rows(run, paths: dict[int, Path], device: torch.device | str = "cpu") -> list[dict]:
    """`own_slot_errors_by_encoder` for an open run (`vase.inspection.open_run`) and the saved
    encoders `paths` ({step: file})."""
    stages = list(zip(run.inferred_environments(), run.held_out))
    # Today's codes do not depend on the step read: decoded once per environment.
    now = [run.learner.reconstruction_error(x, stage["inferred_env"]) for stage, x in stages]
    encode = FrozenEncoder(run.cfg.model, device)
    rows = []
    for step, path in paths.items():
        encode.load(load_weights(path))
        for (stage, x), today in zip(stages, now):
            slot = stage["inferred_env"]
            rows.append({"step": step, "environment": stage["true_env"], "slot": slot,
                         "error": run.learner.reconstruction_error(x, slot, encode(x)),
                         "now": today, "checkpoint_step": run.learner.step})
    return rows


def own_slot_text(rows: list[dict]) -> str:
    """`own_slot_errors_by_encoder` as a table: a line per step, a column per environment."""
    names = list(dict.fromkeys(f"{r['environment']} (slot {r['slot']})" for r in rows))
    width = max([len(n) for n in names] + [10]) + 2
    lines = [f"held-out error (nats/image) under each environment's own slot with the decoders of step "
             f"{rows[0]['checkpoint_step']}, decoded from the codes of the encoder of each step:",
             f"  {'encoder':>9}" + "".join(f"{n:>{width}}" for n in names)]
    for step in dict.fromkeys(r["step"] for r in rows):
        lines.append(f"  {step:>9}" + "".join(f"{r['error']:>{width}.1f}" for r in rows if r["step"] == step))
    first = [r for r in rows if r["step"] == rows[0]["step"]]
    lines.append(f"  {'now':>9}" + "".join(f"{r['now']:>{width}.1f}" for r in first))
    return "\n".join(lines)


def has_ground_truth(env) -> bool:
    """Sprites know every factor (docs/usage.md, data), so MIG and DCI are meaningful on them."""
    return env.family.startswith("shapes")


@torch.no_grad()
def disentanglement_scores(envs: list, encode, stage: int, seed: int) -> dict:
    """MIG and DCI of each sprite environment trained so far (up to index `stage`)."""
    scores = {}
    for i, env in enumerate(envs[: stage + 1]):
        if not has_ground_truth(env):
            continue
        n = min(METRIC_IMAGES, len(env))
        codes = np.concatenate(
            [encode(env.batch(torch.arange(a, min(a + 512, n)))).cpu().numpy() for a in range(0, n, 512)]
        )
        factors = env.factor_matrix()[:n]
        rng = np.random.default_rng(seed + i)
        s = {"mig": mig(factors, codes, rng)["mig"]}
        s.update(
            {
                k: v
                for k, v in dci(factors, codes, rng).items()
                if k in ("disentanglement", "completeness", "informativeness")
            }
        )
        scores[env.name] = {k: float(v) for k, v in s.items()}
    return {"stage": stage, "scores": scores}


def evaluate_run(run_dir: Path, progress: bool = False, device: torch.device | str = "cpu",
                 reading: str | None = None) -> dict:
    """Recompute probes and metrics of a finished (or partial) run from its saved encoders, the
    probes under `reading` (`probe.reading`: mean or sample; by default the run's own)."""
    cfg: Config = load_run_config(run_dir, trains=False)
    reading = reading or cfg.probe.reading
    if reading not in PROBE_READINGS:
        raise VaseError(f"reading {reading!r}: give one of {', '.join(PROBE_READINGS)}")
    results_path = Path(run_dir) / "results.json"
    stored = json.loads(results_path.read_text()) if results_path.exists() else {}
    files = saved_encoders(run_dir)
    if not files:
        raise VaseError(f"{run_dir} has no saved encoders (checkpoints/{ENCODER_DIR}); was it trained with probes on?")
    envs = [env.to(device) for env in load_sequence(cfg.data, "test", progress=progress)]
    ends = cfg.data.stage_ends()
    suite = ProbeSuite(envs, dataclasses.replace(cfg.probe, reading=reading))
    encode = FrozenEncoder(cfg.model, device)
    metrics = []
    for step, path in files.items():
        encode.load(load_weights(path))
        if reading == "sample":
            suite.evaluate(PosteriorSamples(encode, slots_at(run_dir, cfg, step, device), cfg.probe.seed + step), step)
        else:
            suite.evaluate(encode, step)
        if step in ends:
            stage = ends.index(step)
            suite.mark_boundary(stage, step)
            metrics.append(disentanglement_scores(envs, encode, stage, cfg.probe.seed))
    out = dict(stored) if stored else {
        "ablation": cfg.ablation(), "mode": cfg.objective.mode, "preset": cfg.preset,
        "sequence": cfg.data.sequence, "steps": max(files), "wall_time_s": float("nan"),
        "environments_inferred": float("nan"), "environments_true": len(set(cfg.data.sequence)),
        "inferred_vs_true": [],
    }
    out["probes"] = suite.results()
    out["disentanglement"] = metrics
    if out.get("latent_use"):  # one row per environment of the sequence, in order
        for row, env in zip(out["latent_use"], envs):
            row["factor_latents"] = factor_latents(env, encode, held_out_images(env))
    if has_checkpoint(run_dir):
        # The stage codes under the slots of the newest checkpoint (the run's end, once finished).
        from vase.inspection import open_run

        run = open_run(run_dir, device=device)
        run.codes_from_saved_encoders(run_dir)
        out["own_slot_errors_stage_codes"] = run.stage_code_errors(
            [row["inferred_env"] for row in run.inferred_environments()])
    return out
