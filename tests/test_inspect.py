"""`vase inspect` (issue 34): traversal content on a hand-built decoder, the pictures' shapes and
ranges, Fig. 5A's interpolations and readings, and the files the CLI writes from a tiny run."""
from __future__ import annotations

from itertools import pairwise
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from PIL import Image
from test_cli import tiny_args

from cli import main
from vase import checkpoint
from vase.ambiguity import (
    WEIGHTS,
    context_batch,
    crossing,
    interpolate,
    measure_ambiguity,
    specific_latents,
)
from vase.config import build_config
from vase.inspection import open_run, trained_slots, write_ambiguity
from vase.metrics.plots import traversal_figure
from vase.networks import Posterior
from vase.visualize import (
    MASKED,
    SPARE,
    USED,
    traversal_animation,
    traversal_frames,
    traversal_grid,
)

SIDE, LATENTS, MOVER = 16, 6, 2  # the fake decoder draws 16x16 images; latent 2 moves a square


class SquareDecoder(torch.nn.Module):
    """Logits of a 4x4 square whose column is 6 + 2 * z[MOVER]: only latent MOVER moves it."""

    def forward(self, z: torch.Tensor, env: torch.Tensor) -> torch.Tensor:
        left = (6 + 2 * z[:, MOVER]).round().long()
        columns = torch.arange(SIDE)[None]
        inside = (columns >= left[:, None]) & (columns < left[:, None] + 4)
        rows = torch.zeros(SIDE, dtype=torch.bool)
        rows[6:10] = True
        image = rows[None, :, None] & inside[:, None, :]
        return torch.where(image, 20.0, -20.0)[:, None].float()


class ZeroEncoder(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> Posterior:
        zeros = torch.zeros(x.shape[0], LATENTS)
        return Posterior(zeros, zeros, zeros)


def fake_learner(mask=None, usage=None):
    mask = torch.ones(LATENTS) if mask is None else mask
    usage = torch.zeros(1, LATENTS) if usage is None else usage
    return SimpleNamespace(
        model=SimpleNamespace(encoder=ZeroEncoder(), decoder=SquareDecoder()),
        mask=lambda env: mask,
        slots=[SimpleNamespace(usage=u) for u in usage],
        cfg=build_config("cpu"),
    )


def column_of_square(frame: torch.Tensor) -> float:
    """The mean column of the lit pixels of a (C, H, W) frame."""
    lit = frame[0] > 0.5
    return float(lit.nonzero()[:, 1].float().mean())


# -- traversal content -----------------------------------------------------------------------------------------
def test_the_swept_latent_moves_the_square_and_the_others_do_not():
    seed = torch.zeros(1, SIDE, SIDE)
    frames, latents = traversal_frames(fake_learner(), seed, 0, torch.tensor([0, MOVER, 5]))
    assert frames.shape == (3, 7, 1, SIDE, SIDE) and latents.tolist() == [0, MOVER, 5]
    columns = [column_of_square(f) for f in frames[1]]
    assert all(b > a for a, b in pairwise(columns))  # -2..2 moves it right, step by step
    assert columns[-1] - columns[0] >= 6
    for row in (0, 2):
        assert all(torch.equal(f, frames[row][0]) for f in frames[row])  # not this latent's square


def test_the_animation_moves_only_the_swept_latents_tile():
    seed = torch.zeros(1, SIDE, SIDE)
    frames, _ = traversal_frames(fake_learner(), seed, 0, torch.tensor([MOVER, 0]), torch.linspace(-2, 2, 5))
    colours = torch.tensor([USED, SPARE])
    pictures = traversal_animation(frames, colours, band=2)
    assert len(pictures) == 5 and all(p.shape == pictures[0].shape for p in pictures)
    # Two tiles side by side (2 columns), each 2 + SIDE tall, padded by 2.
    def tile(p, i):
        return p[:, 2 + 2:2 + 2 + SIDE, 2 + i * (SIDE + 2):2 + i * (SIDE + 2) + SIDE]

    moving = [column_of_square(tile(p, 0)) for p in pictures]
    assert all(b > a for a, b in pairwise(moving))
    assert all(torch.equal(tile(p, 1), tile(pictures[0], 1)) for p in pictures)
    assert torch.allclose(pictures[0][:, 2, 2], torch.tensor(USED))  # the band of the used latent


def test_traversal_grid_is_an_image_with_a_coloured_band_per_latent():
    mask = torch.ones(LATENTS)
    mask[4] = 0
    usage = torch.zeros(1, LATENTS)
    usage[0, MOVER] = 3.0
    grid = traversal_grid(fake_learner(mask, usage), torch.zeros(1, SIDE, SIDE), 0, used_kl=0.1)
    assert grid.shape == (3, 2 + LATENTS * (SIDE + 2), 2 + 8 * (SIDE + 2))  # band + 7 values per row
    assert grid.min() >= 0 and grid.max() <= 1
    bands = {tuple(round(v, 3) for v in grid[:, 2 + r * (SIDE + 2) + 1, 3].tolist()) for r in range(LATENTS)}
    assert bands == {USED, MASKED, SPARE}


def test_traversal_figure_is_an_rgb_image():
    frames, _ = traversal_frames(fake_learner(), torch.zeros(1, SIDE, SIDE), 0, torch.tensor([MOVER, 1]))
    from torchvision.utils import make_grid

    mosaic = make_grid(frames.reshape(-1, 1, SIDE, SIDE).expand(-1, 3, -1, -1), nrow=7).permute(1, 2, 0).numpy()
    rgb = traversal_figure(mosaic, SIDE, list(np.linspace(-2, 2, 7)), ["z2 3.0", "z1 0.0"],
                           np.array([[USED, MASKED], [SPARE, SPARE]]), ["0*", "1"], "title")
    assert rgb.dtype == np.uint8 and rgb.ndim == 3 and rgb.shape[2] == 3
    assert rgb.min() < 50 and rgb.max() > 200


# -- ambiguity (Fig. 5A) ----------------------------------------------------------------------------------------
def test_interpolation_endpoints_equal_the_real_samples_exactly():
    generator = torch.Generator().manual_seed(0)
    a, b = torch.rand(4, 1, 8, 8, generator=generator), torch.rand(4, 1, 8, 8, generator=generator)
    x = interpolate(a, b)
    assert x.shape == (len(WEIGHTS), 4, 1, 8, 8)
    assert torch.equal(x[0], a) and torch.equal(x[-1], b)
    assert torch.allclose(x[5], (a + b) / 2)
    assert x.min() >= 0 and x.max() <= 1


def test_crossing_reads_the_weight_where_a_falling_curve_passes_a_level():
    w = [0.0, 0.25, 0.5, 0.75, 1.0]
    assert crossing(w, [1.0, 1.0, 0.6, 0.0, 0.0], 0.5) == pytest.approx(0.5 + 0.25 * 0.1 / 0.6)
    assert crossing(w, [0.4, 0.3, 0.2, 0.1, 0.0], 0.5) is None  # never at the level
    assert crossing(w, [1.0, 0.9, 0.9, 0.8, 0.7], 0.5) is None  # never below it


def test_context_batch_mixes_real_samples_in_the_asked_share():
    amb, ra, rb = torch.zeros(8, 1, 2, 2), torch.ones(8, 1, 2, 2), torch.full((8, 1, 2, 2), 2.0)
    batch = context_batch(amb, ra, rb, 0.25)
    assert batch.shape[0] == 16
    assert (batch[8:] == 1).all(dim=(1, 2, 3)).sum() == 2 and (batch[8:] == 2).all(dim=(1, 2, 3)).sum() == 6


def test_specific_latents_are_used_by_one_slot_only():
    usage = torch.tensor([[2.0, 0.0, 1.0, 0.0], [0.0, 3.0, 1.0, 0.05]])
    assert specific_latents(usage, 0, 1, 0.1) == ([0], [1])


class BrightnessClassifier(torch.nn.Module):
    """q(s|x) from the mean pixel (the fake encoder's hidden): bright images are slot 0, dark slot 1."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logit = 40 * (hidden[:, 0] - 0.5)
        return torch.stack([logit, -logit], dim=1)


class MeanEncoder(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> Posterior:
        mean = x.flatten(1).mean(1, keepdim=True)
        mu = mean.expand(-1, LATENTS)
        return Posterior(mu, torch.zeros_like(mu), mean)


def test_ambiguity_switches_sharply_and_context_moves_the_batch_decision():
    learner = SimpleNamespace(
        model=SimpleNamespace(encoder=MeanEncoder()), classifier=BrightnessClassifier(),
        slots=SimpleNamespace(stack=lambda name: torch.tensor([[1.0] + [0.0] * 5, [0.0, 1.0] + [0.0] * 4])),
        inference=SimpleNamespace(predict=lambda probs: int(probs[:2].argmax())),
    )
    bright, dark = torch.ones(32, 1, 4, 4), torch.zeros(32, 1, 4, 4)
    result = measure_ambiguity(learner, bright, dark, (0, 1), ("bright", "dark"), used_kl=0.1)
    assert result.example_q_a[0] > 0.99 and result.example_q_a[-1] < 0.01
    assert result.sharpness is not None and 0 < result.sharpness < 0.2  # categorical: a narrow switch
    switches = result.switch  # contexts 0, 25, 50, 75, 100 % real A
    assert switches[1] < switches[2] < switches[3]  # more real samples of A: a later switch
    assert switches[-1] is None  # half the batch real A and the rest at most ambiguous: never B
    assert result.switch[2] == pytest.approx(0.5, abs=0.05)
    assert all(0 <= q <= 1 for row in result.batch_q_a for q in row)
    assert result.predicted[-1][0] == 0 and result.predicted[0][-1] == 1
    assert (result.latents_a, result.latents_b) == ([0], [1])
    assert len(result.mu) == len(WEIGHTS) and result.mu[0][0] == pytest.approx(1.0)


# -- the CLI on tiny runs ------------------------------------------------------------------------------------------
def invoke(args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def test_inspect_writes_every_picture_and_prints_the_paths(tiny_run):
    result = invoke(["inspect", tiny_run])
    assert result.exit_code == 0, result.output
    paths = [Path(line) for line in result.output.splitlines() if line.startswith(str(tiny_run))]
    names = {p.name for p in paths}
    for stem in ("cross_domain_step8.png", "latent_use_step8.png", "atypicality_step8.png", "probes_step8.png",
                 "own_slot_step8.png"):
        assert stem in names
    assert any(n.startswith("traversal_slot0_moving_shapes_a") and n.endswith(".png") for n in names)
    assert any(n.endswith(".gif") for n in names)
    for path in paths:
        assert path.parent == tiny_run / "inspect" and path.stat().st_size > 0
    gif = Image.open(next(p for p in paths if p.suffix == ".gif"))
    assert gif.n_frames == 16  # -2..2 in 9 positions and back


def test_inspect_reads_an_older_kept_checkpoint(tiny_run):
    result = invoke(["inspect", tiny_run, "latent_use", "--step", 6])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == str(tiny_run / "inspect" / "latent_use_step6.png")


def test_each_stage_end_is_kept_and_inspect_reads_it(tiny_run):
    # Stages end at steps 4 and 8; checkpoints every 2 steps leave latest 8 and previous 6.
    assert checkpoint.kept_steps(tiny_run) == [4, 8]
    first_stage = open_run(tiny_run, step=4)
    assert first_stage.learner.step == 4 and first_stage.learner.inference.n_envs == 1
    result = invoke(["inspect", tiny_run, "latent_use", "--step", 4])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == str(tiny_run / "inspect" / "latent_use_step4.png")


def test_inspect_one_source_environment_cross_domain(tiny_run):
    result = invoke(["inspect", tiny_run, "cross_domain", "--source", "shapes_b"])
    assert result.exit_code == 0, result.output
    image = Image.open(result.output.strip())
    assert image.mode == "RGB" and image.size[1] > image.size[0] / 3  # six rows of images


def test_inspect_traversals_of_one_source_environment_under_its_slot(tiny_run):
    result = invoke(["inspect", tiny_run, "traversals", "--source", "shapes_b"])
    assert result.exit_code == 0, result.output
    slot = trained_slots(open_run(tiny_run))[1]
    names = [Path(line).name for line in result.output.splitlines()]
    assert names == [f"traversal_slot{slot}_shapes_b_step8.png", f"traversal_slot{slot}_shapes_b_step8.gif"]


@pytest.mark.parametrize("args, message", [
    (["latent_use", "--step", 3], "no checkpoint of step 3"),
    (["nonsense"], "unknown picture 'nonsense'"),
    (["cross_domain", "--source", "mnist"], "'mnist' is not in this run's sequence"),
    (["traversals", "--source", "mnist"], "'mnist' is not in this run's sequence"),
    (["ambiguity", "--envs", "moving_shapes_a"], "--envs takes two environments"),
])
def test_inspect_refuses_bad_requests_in_one_line(tiny_run, args, message):
    result = invoke(["inspect", tiny_run, *args])
    assert result.exit_code != 0
    assert message in result.output and "Traceback" not in result.output


def test_inspect_refuses_a_folder_that_is_not_a_run(tmp_path):
    result = invoke(["inspect", tmp_path / "missing"])
    assert result.exit_code != 0 and "does not exist" in result.output
    result = invoke(["inspect", tmp_path])
    assert result.exit_code != 0 and "config.json not found" in result.output


def test_inspect_refuses_a_run_without_a_checkpoint(tiny_run, tmp_path):
    run = tmp_path / "fresh"
    run.mkdir()
    (run / "config.json").write_text((tiny_run / "config.json").read_text())
    result = invoke(["inspect", run])
    assert result.exit_code != 0 and "has no checkpoint yet" in result.output


def test_ambiguity_needs_two_slots(tiny_run):
    run = open_run(tiny_run)
    result = invoke(["inspect", tiny_run, "ambiguity"])
    if len(set(trained_slots(run))) == 1:  # 4 steps rarely allocate a second slot
        assert result.exit_code != 0 and "both trained under slot 0" in result.output
    # Given a second slot for shapes_b, the readings, figure and CSV are written.
    run.learner.inference.n_envs = 2
    run.record.assigned = [0] * 4 + [1] * 4
    out = tiny_run / "inspect"
    paths = write_ambiguity(run, out, "test", None, echo=lambda line: None)
    assert [p.suffix for p in paths] == [".png", ".csv", ".csv", ".txt"]
    rows = paths[1].read_text().splitlines()
    assert rows[0].startswith("share_real_from_a,weight_b,batch_q_a") and len(rows) == 1 + 5 * len(WEIGHTS)
    q = [float(r.split(",")[2]) for r in rows[1:]]
    assert all(0 <= v <= 1 for v in q)
    assert "falls from 0.9 to 0.1" in paths[3].read_text()


def test_ambiguity_needs_two_environments(tmp_path):
    run = tmp_path / "one"
    args = tiny_args(run, tmp_path / "data", steps=2, probe__every=2, train__checkpoint_every=2)
    args[1:1] = ["--sequence", "shapes_a"]
    assert invoke(args).exit_code == 0
    result = invoke(["inspect", run, "ambiguity"])
    assert result.exit_code != 0 and "needs a run over two environments" in result.output
    assert invoke(["inspect", run, "ambiguity", "latent_use"]).exit_code != 0
    everything = invoke(["inspect", run])
    assert everything.exit_code == 0 and "ambiguity: skipped" in everything.output


def test_open_run_leaves_the_run_directory_as_it_was(tiny_run):
    before = sorted(p.relative_to(tiny_run) for p in tiny_run.rglob("*") if "inspect" not in p.parts)
    open_run(tiny_run, step=6)
    after = sorted(p.relative_to(tiny_run) for p in tiny_run.rglob("*") if "inspect" not in p.parts)
    assert before == after



def test_the_help_names_every_picture():
    from vase.inspection import PICTURES

    text = " ".join(invoke(["inspect", "--help"]).output.split())
    assert all(name in text for name in PICTURES)
