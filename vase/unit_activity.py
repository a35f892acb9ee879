"""`vase eval RUN --alive-units STEPS`: how many units of each of the encoder's hidden layers fire on
an environment's held-out images, under the encoders a run saved (docs/regime.md, "Units that stop
firing").

A unit whose ReLU output is zero on every image gets no gradient to its own weights: only a change in
the layers below it can make it fire again, so the count is the width the encoder learns with. A conv
unit is a channel (it fires if its output is positive at any position of any image); an fc unit is
one of the hidden layer's outputs. Under a leaky ReLU (model.negative_slope > 0) a unit still gets
gradient where it does not fire, so there the count says how many units are active, not which can learn.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from vase.checkpoint import load_weights
from vase.errors import VaseError
from vase.networks import Encoder


def firing(encoder: Encoder, x: torch.Tensor) -> list[torch.Tensor]:
    """Per hidden layer of the encoder, the convs' in order and then the fc layer's: a boolean per
    unit, whether its output is positive somewhere on the images x."""
    fired = []
    with torch.no_grad():
        h = x
        for layer in encoder.convs:
            h = layer(h)
            if isinstance(layer, (nn.ReLU, nn.LeakyReLU)):
                fired.append(h.amax(dim=(0, 2, 3)) > 0)
        hidden = encoder.act(encoder.fc(h.flatten(1)))
        fired.append(hidden.amax(0) > 0)
    return fired


def alive_units(encoder: Encoder, x: torch.Tensor) -> list[int]:
    """Per hidden layer (as `firing`), the number of units that fire on the images x."""
    return [int(units.sum()) for units in firing(encoder, x)]


def without_channels(state: dict, channels: torch.Tensor) -> dict:
    """Encoder weights `state` with the fc layer's inputs from the last conv's `channels` (a boolean
    per channel) cut: the fc layer then reads those channels as if they never fired. The conv output
    is flattened channel by channel, so each channel owns a block of consecutive fc inputs."""
    weight = state["fc.weight"]
    per_channel, rest = divmod(weight.shape[1], channels.numel())
    if rest:
        raise ValueError(f"fc reads {weight.shape[1]} inputs, not a whole number per channel of {channels.numel()}")
    cut = weight.clone()
    cut[:, channels.to(weight.device).repeat_interleave(per_channel)] = 0.0
    return {**state, "fc.weight": cut}


def layer_widths(encoder: Encoder) -> list[int]:
    """The number of units of each hidden layer `alive_units` counts."""
    convs = [layer.out_channels for layer in encoder.convs if isinstance(layer, nn.Conv2d)]
    return convs + [encoder.fc.out_features]


def alive_units_by_encoder(run_dir: Path, steps: list[int] | None, device: torch.device | str = "cpu") -> list[dict]:
    """A row per saved encoder of `steps` (None: every one the run saved) and test environment of the
    run's sequence: the alive units of each layer on its held-out images."""
    from vase.evaluation import encoders_at, saved_encoders
    from vase.inspection import open_run

    run = open_run(run_dir, device=device)
    paths = saved_encoders(run_dir) if steps is None else encoders_at(run_dir, steps, run.cfg.probe.every)
    if not paths:
        raise VaseError(f"{run_dir} has saved no encoder yet: a run saves one at each probe point")
    encoder = Encoder(run.cfg.model).to(device)
    rows = []
    for step, path in paths.items():
        encoder.load_state_dict(load_weights(path))
        read = set()
        for env, x in zip(run.test_envs, run.held_out):
            if env.name in read:  # an environment the sequence repeats: read once
                continue
            read.add(env.name)
            rows.append({"step": step, "environment": env.name, "alive": alive_units(encoder, x),
                         "of": layer_widths(encoder)})
    return rows


def alive_units_text(rows: list[dict]) -> str:
    """The rows as one table per environment: a line per step, a column per layer."""
    widths = rows[0]["of"]
    names = [f"conv{i + 1}" for i in range(len(widths) - 1)] + ["fc"]
    lines = ["units of each encoder layer that fire (output > 0) on any held-out image, of "
             + ", ".join(f"{n} {w}" for n, w in zip(names, widths)) + ":"]
    for env in dict.fromkeys(r["environment"] for r in rows):
        lines += ["", f"  {env}", f"  {'step':>9}" + "".join(f"{n:>7}" for n in names)]
        lines += [f"  {r['step']:>9}" + "".join(f"{a:>7}" for a in r["alive"]) for r in rows if r["environment"] == env]
    return "\n".join(lines)
