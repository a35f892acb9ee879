"""`vase inspect`: the paper's pictures as files, from any kept checkpoint of a run.

The run is rebuilt as its `Trainer` (config, data, learner) and given the checkpoint's state; its
`Evaluator` serves the pictures, so every one is drawn by the code that logs it to TensorBoard.
Nothing in the run directory but RUN_DIR/inspect is written.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torchvision.utils import make_grid

from vase import figures
from vase.ambiguity import ambiguity_strip, measure_ambiguity
from vase.checkpoint import has_checkpoint, load_checkpoint
from vase.config import load_run_config
from vase.errors import ConfigError, VaseError
from vase.evaluation import own_slot_rows, saved_encoders
from vase.metrics.plots import ambiguity_figure, own_slot_figure, traversal_figure
from vase.visualize import latent_colours, traversal_animation, traversal_frames

INSPECT_DIR = "inspect"
PICTURES = ("traversals", "cross_domain", "latent_use", "atypicality", "probes", "own_slot", "ambiguity")
# The GIF's sweep: -2..2 (docs/inspect.md) and back, 100 ms a frame.
GIF_VALUES = torch.linspace(-2.0, 2.0, 9)
GIF_MS = 100


@dataclass
class InspectOptions:
    step: int | None = None  # a kept checkpoint's step (default: the newest)
    used_only: bool = False  # traversals: only the latents the slot uses
    image: int = 0  # traversals: which held-out image of the environment seeds them
    source: str | None = None  # cross-domain and traversals: one environment's images (default: every environment's)
    envs: tuple[str, str] | None = None  # ambiguity: A and B (default: the first two of the sequence)
    data_root: str | None = None
    device: str = "cpu"  # where the model runs (the pictures are made on the host)


def parse_pictures(names: tuple[str, ...] | list[str]) -> list[str]:
    unknown = [n for n in names if n not in PICTURES]
    if unknown:
        raise ConfigError(f"unknown picture {', '.join(map(repr, unknown))}; choose from {', '.join(PICTURES)}")
    return [p for p in PICTURES if p in names] if names else list(PICTURES)


def open_run(run_dir: Path, step: int | None = None, data_root: str | None = None, device: str = "cpu"):
    """The run's Evaluator (config, data, learner, record) in the state of its checkpoint of `step`
    (default: the newest); on disk, nothing changes (no resume: later encoders and events stay)."""
    from vase.trainer import Trainer

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise VaseError(f"run directory {run_dir} does not exist")
    cfg = load_run_config(run_dir, data_root, trains=False)
    if not has_checkpoint(run_dir):
        raise VaseError(f"{run_dir} has no checkpoint yet: a run writes its first at a boundary or after "
                        f"train.checkpoint_every ({cfg.train.checkpoint_every}) steps")
    state, _ = load_checkpoint(run_dir, step)  # before the data loads: a bad step fails at once
    trainer = Trainer(cfg, run_dir, progress=False, device=device, callbacks=[])
    trainer.load_state_dict(state)
    return trainer.evaluator


def inspect_run(run_dir: Path, names: tuple[str, ...], options: InspectOptions, echo=print) -> list[Path]:
    """Write the pictures `names` (none: all of them) into RUN_DIR/inspect and return their paths.

    Asked for by name, ambiguity on a run it cannot read is an error; among all the pictures it is
    skipped with a note, so the others are still written.
    """
    pictures = parse_pictures(names)
    run = open_run(run_dir, options.step, options.data_root, options.device)
    source = _env_index(run, options.source) if options.source else None
    out = Path(run_dir) / INSPECT_DIR
    out.mkdir(exist_ok=True)
    tag = f"step{run.learner.step}"
    written: list[Path] = []
    for picture in pictures:
        if picture == "traversals":
            written += write_traversals(run, out, tag, options.used_only, options.image, echo, source)
        elif picture == "cross_domain":
            name = "cross_domain" + (f"_{options.source}" if options.source else "")
            written.append(save_png(figures.cross_domain(run, source), out / f"{name}_{tag}.png"))
        elif picture == "own_slot":
            rgb = own_slot_picture(run, run_dir, options.device)
            if rgb is None:
                echo(f"own_slot: no saved encoder up to step {run.learner.step}")
                continue
            written.append(save_png(rgb, out / f"own_slot_{tag}.png"))
        elif picture == "ambiguity":
            try:
                written += write_ambiguity(run, out, tag, options.envs, echo)
            except VaseError as e:
                if names:
                    raise
                echo(f"ambiguity: skipped ({e})")
        else:
            draw = {"latent_use": figures.latent_use, "atypicality": figures.atypicality_profile,
                    "probes": figures.probe_curves}[picture]
            rgb = draw(run)
            if rgb is None:
                echo(f"{picture}: nothing recorded yet at step {run.learner.step}")
                continue
            written.append(save_png(rgb, out / f"{picture}_{tag}.png"))
    return written


def own_slot_picture(run, run_dir: Path, device: str) -> np.ndarray | None:
    """`own_slot_figure` from every encoder the run saved up to the checkpoint read."""
    paths = {step: path for step, path in saved_encoders(run_dir).items() if step <= run.learner.step}
    if not paths:
        return None
    after = [row[i] for i, row in enumerate(run.record.recon_matrix)]
    return own_slot_figure(own_slot_rows(run, paths, device), run.stream.ends, after)


def save_png(rgb: np.ndarray | torch.Tensor, path: Path) -> Path:
    """An (H, W, 3) uint8 array or a (3, H, W) tensor in [0, 1] as a PNG."""
    Image.fromarray(_uint8(rgb)).save(path, optimize=True)
    return path


def _uint8(rgb: np.ndarray | torch.Tensor) -> np.ndarray:
    if torch.is_tensor(rgb):
        return rgb.clamp(0, 1).mul(255).round().to(torch.uint8).permute(1, 2, 0).numpy()
    return np.asarray(rgb, dtype=np.uint8)


def _env_index(run, name: str) -> int:
    names = [env.name for env in run.envs]
    if name not in names:
        raise ConfigError(f"environment {name!r} is not in this run's sequence ({', '.join(names)})")
    return names.index(name)


def trained_slots(run) -> list[int]:
    """The slot each environment reached so far trained under (the majority of its steps)."""
    return [row["inferred_env"] for row in run.inferred_environments()]


# -- traversals (Fig. 2 top, Fig. 3A) --------------------------------------------------------------------------
def write_traversals(run, out: Path, tag: str, used_only: bool, image: int, echo,
                     source: int | None = None) -> list[Path]:
    """Per inferred environment (slot), from a held-out image of the first environment trained under
    it (or, given `source`, of that environment under the slot it trained under, so an environment
    that shares a slot can be seen too): a PNG of every latent swept over -2..2 (or only the latents
    the slot uses), ordered by the information the slot's latents carried while it trained, and a
    GIF of all rows at once."""
    learner, used_kl = run.learner, run.cfg.inference.used_kl
    trained = trained_slots(run)
    if source is not None and source >= len(trained):
        raise ConfigError(f"--source {run.envs[source].name}: the run has not reached that environment yet")
    seeds = [source] if source is not None else [trained.index(slot) for slot in dict.fromkeys(trained)]
    colours = torch.stack([latent_colours(learner, s, used_kl) for s in range(max(1, learner.inference.n_envs))], 1)
    written = []
    for env in seeds:
        slot = trained[env]
        name = run.envs[env].name
        if not 0 <= image < len(run.held_out[env]):
            raise ConfigError(
                f"--image {image} is out of range: {name} has {len(run.held_out[env])} held-out images"
            )
        seed = run.held_out[env][image]
        usage = learner.slots[slot].usage
        latents = torch.argsort(usage, descending=True, stable=True)
        if used_only:
            latents = latents[(usage[latents] > used_kl) & learner.mask(slot)[latents].bool()]
            if len(latents) == 0:
                echo(f"traversals: slot {slot} ({name}) uses no latent above {used_kl:g} nat; skipped")
                continue
        frames, _ = traversal_frames(learner, seed, slot, latents)
        # Grey padding: frames stay apart on white backgrounds (inverse Fashion) as on black ones.
        mosaic = make_grid(frames.reshape(-1, *frames.shape[2:]).expand(-1, 3, -1, -1), nrow=frames.shape[1],
                           pad_value=0.5)
        labels = [f"z{n} {usage[n]:.1f}" for n in latents.tolist()]
        slot_labels = [f"{s}*" if s == slot else str(s) for s in range(colours.shape[1])]
        title = (f"slot {slot} ({name}, held-out #{image}), step {learner.step}\nlatents by information (nats) "
                 "in training; slots: green uses, red masks")
        rgb = traversal_figure(mosaic.permute(1, 2, 0).numpy(), frames.shape[-1], [float(v) for v in
                               torch.linspace(-2.0, 2.0, frames.shape[1])], labels, colours[latents].numpy(),
                               slot_labels, title)
        stem = f"traversal_slot{slot}_{name}_{tag}"
        written.append(save_png(rgb, out / f"{stem}.png"))
        moving, _ = traversal_frames(learner, seed, slot, latents, GIF_VALUES)
        pictures = traversal_animation(moving, colours[latents, slot])
        written.append(save_gif(pictures + pictures[-2:0:-1], out / f"{stem}.gif"))
    return written


def save_gif(pictures: list[torch.Tensor], path: Path) -> Path:
    """(3, H, W) pictures in [0, 1] as a looping GIF."""
    images = [Image.fromarray(_uint8(p)) for p in pictures]
    images[0].save(path, save_all=True, append_images=images[1:], duration=GIF_MS, loop=0, optimize=True)
    return path


# -- ambiguity (Fig. 5A) -----------------------------------------------------------------------------------------
def write_ambiguity(run, out: Path, tag: str, envs: tuple[str, str] | None, echo) -> list[Path]:
    names = [env.name for env in run.envs]
    distinct = list(dict.fromkeys(names))
    if len(distinct) < 2:
        raise VaseError(f"ambiguity needs a run over two environments; this one saw only {distinct[0]}")
    env_a, env_b = envs or (distinct[0], distinct[1])
    a, b = _env_index(run, env_a), _env_index(run, env_b)
    trained = trained_slots(run)
    if max(a, b) >= len(trained):
        raise VaseError(f"at step {run.learner.step} the run has not trained on {names[max(a, b)]} yet")
    slots = (trained[a], trained[b])
    if slots[0] == slots[1]:
        raise VaseError(f"{env_a} and {env_b} both trained under slot {slots[0]}: with one slot for both, "
                        "q(s|x) has nothing to decide between")
    result = measure_ambiguity(run.learner, run.held_out[a], run.held_out[b], slots, (env_a, env_b),
                               run.cfg.inference.used_kl)
    strip = ambiguity_strip(run.learner, run.held_out[a][0], run.held_out[b][0], slots)
    stem = out / f"ambiguity_{env_a}_{env_b}_{tag}"
    grid, latents, text = (stem.with_name(stem.name + suffix) for suffix in (".csv", "_latents.csv", ".txt"))
    result.write_csv(grid, latents)
    lines = result.summary()
    text.write_text("\n".join(lines) + "\n")
    for line in lines:
        echo(line)
    png = save_png(ambiguity_figure(result, strip.numpy()), stem.with_name(stem.name + ".png"))
    return [png, grid, latents, text]
