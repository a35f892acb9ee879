"""How much object identity a run's code holds, read out several ways (`vase eval RUN --readouts STEP`).

Table 1's object-ID probe is linear and fits 2,000 images (docs/probes.md). A low accuracy can be
the code's (it carries little identity) or the read-out's (the identity is there, but not linear,
or the probe has too few images). Here the same linear classifier fits 2,000 and then up to 20,000
images of the environment's training split, and two nonlinear ones fit those 20,000: k nearest
neighbours and a small MLP. All are scored on the probe's own held-out images, read as μ(x) of the
encoder saved at the step. Where every read-out stays low, the code is the limit
(docs/regime.md, "The regime"); the nats each latent carries on those images (KL to the prior,
eq. 3's term) show where the code's capacity went instead.

A fifth read-out fits the same linear classifier to the encoder's last hidden layer (the fc layer's
ReLU outputs, from which μ and log σ² are one linear map) on the 20,000 images. Where it is well
above the code's, the encoder's features hold identity that the capacity-bounded code leaves out;
where it is as low, the features themselves lack it (docs/regime.md, "Units that stop firing").

Where the objects move, Table 1's position regressor fits the same 20,000 images twice, from μ and
from the last hidden layer: whether a lost position lies in the code alone or in the shared
features beneath it (docs/regime.md, "MNIST's arrival at the extended schedule").

With `dark_at` (`--cut-dark STEP`), every read-out is taken with the fc layer's inputs cut from the
last conv's channels that fired on none of the environment's held-out images under the encoder saved
at that earlier step: whether units that woke since then carry what the code and features lost.
Under a leaky ReLU (model.negative_slope > 0) such a channel passed its negative outputs on even
while it did not fire; the cut removes those too.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from sklearn.neighbors import KNeighborsClassifier
from sklearn.neural_network import MLPClassifier
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from vase.checkpoint import load_weights
from vase.config import Config
from vase.data.environments import load_environment
from vase.errors import VaseError
from vase.evaluation import FrozenEncoder, encoders_at, held_out_images
from vase.metrics.probes import object_id_accuracy, position_mse
from vase.objective import kl_per_latent
from vase.probing import ENCODE_CHUNK, draw_probe_sets, positions
from vase.unit_activity import firing, without_channels

MORE_IMAGES = 20_000  # [ours] ten times the probe's training set: what more data alone buys
NEIGHBOURS = 15  # [ours]
MLP_LAYERS = (256, 256)  # [ours] wide enough for 10 classes from 24 latents
MLP_EPOCHS = 300  # [ours] an upper bound: early stopping on a tenth of the images ends it sooner
NATS_SHOWN = 0.1  # the text lists the latents above this


@dataclass
class Readout:
    """One environment's identity under one saved encoder, read five ways (accuracies in [0, 1])."""

    step: int
    environment: str
    probe_images: int  # the linear probe's training images, as Table 1's probe fits
    more_images: int  # the training images of the other three read-outs
    linear: float
    linear_more: float
    neighbours: float
    mlp: float
    hidden_linear: float  # the linear classifier on the encoder's last hidden layer, more images
    nats: list[float]  # mean KL of each latent on the held-out images
    position_mu: float | None = None  # held-out MSE of Table 1's position regressor on μ, more images
    position_hidden: float | None = None  # the same on the last hidden layer; None where nothing moves
    dark_at: int | None = None  # with --cut-dark: the step whose dark last-conv channels were cut
    cut_channels: int | None = None  # how many channels that was

    def as_dict(self) -> dict:
        return asdict(self)


def readout_accuracies(codes: np.ndarray, labels: np.ndarray, test_codes: np.ndarray, test_labels: np.ndarray,
                       probe_images: int, seed: int) -> dict[str, float]:
    """Held-out accuracy of the probe's linear classifier on the first `probe_images` codes and on
    all of them, and of k nearest neighbours and an MLP on all of them (standardised codes)."""
    def score(model) -> float:
        model.fit(codes, labels)
        return float(np.mean(model.predict(test_codes) == test_labels))

    mlp = MLPClassifier(MLP_LAYERS, max_iter=MLP_EPOCHS, early_stopping=True, random_state=seed)
    return {
        "linear": object_id_accuracy(codes[:probe_images], labels[:probe_images], test_codes, test_labels, seed),
        "linear_more": object_id_accuracy(codes, labels, test_codes, test_labels, seed),
        "neighbours": score(make_pipeline(StandardScaler(), KNeighborsClassifier(NEIGHBOURS))),
        "mlp": score(make_pipeline(StandardScaler(), mlp)),
    }


def position_readouts(codes: np.ndarray, hidden: np.ndarray, xy: np.ndarray, test_codes: np.ndarray,
                      test_hidden: np.ndarray, test_xy: np.ndarray) -> dict[str, float]:
    """Held-out MSE of Table 1's position regressor fitted to μ and to the last hidden layer."""
    return {"position_mu": position_mse(codes, xy, test_codes, test_xy),
            "position_hidden": position_mse(hidden, xy, test_hidden, test_xy)}


def codes_and_nats(env, indices: np.ndarray, encode: FrozenEncoder) -> tuple[np.ndarray, np.ndarray, list[float]]:
    """μ(x) of env's items at `indices` (as `encode_indices` gives it), the encoder's last hidden
    layer on them, and the mean KL to the prior of each latent (nats) on them, from one pass."""
    mus, hidden, total = [], [], 0.0
    for start in range(0, len(indices), ENCODE_CHUNK):
        post = encode.posterior(env.batch(torch.as_tensor(indices[start:start + ENCODE_CHUNK], dtype=torch.long)))
        mus.append(post.mu.double().cpu().numpy())
        hidden.append(post.hidden.double().cpu().numpy())
        total = total + kl_per_latent(post.mu.double(), post.logvar.double()).sum(0)
    return np.concatenate(mus), np.concatenate(hidden), (total / len(indices)).tolist()


def run_readouts(run_dir: Path, cfg: Config, step: int, device: torch.device | str = "cpu",
                 echo=print, envs: list[str] | None = None, dark_at: int | None = None) -> list[Readout]:
    """The read-outs of every environment of the run's sequence with a class factor (of `envs` alone,
    if given), under the encoder saved at `step`; the test images are the probe's held-out set of
    that environment. With `dark_at`, under that encoder less the last conv's channels that were
    dark on the environment's held-out images under the encoder saved at `dark_at`."""
    foreign = [name for name in envs or [] if name not in cfg.data.sequence]
    if foreign:
        raise VaseError(f"{', '.join(foreign)} not in the run's sequence ({','.join(cfg.data.sequence)}): "
                        "--envs chooses among its environments")
    paths = encoders_at(run_dir, [step] if dark_at is None else [step, dark_at], cfg.probe.every)
    state = load_weights(paths[step])
    encode = FrozenEncoder(cfg.model, device).load(state)
    earlier = None if dark_at is None else FrozenEncoder(cfg.model, device).load(load_weights(paths[dark_at]))
    rows, seen = [], set()
    for i, name in enumerate(cfg.data.sequence):
        if name in seen or (envs and name not in envs):  # a returning environment: the same data and encoder
            continue
        seen.add(name)
        test = load_environment(name, "test", cfg.data, progress=False)
        if "class" not in test.factors:
            continue
        echo(f"reading {name} ...")
        cut = {}
        if earlier is not None:
            dark = ~firing(earlier.net, held_out_images(test).to(device))[-2]
            encode.load(without_channels(state, dark))
            cut = {"dark_at": dark_at, "cut_channels": int(dark.sum())}
        train = load_environment(name, "train", cfg.data, progress=False)
        _, held_out = draw_probe_sets(len(test), cfg.probe.train_size, cfg.probe.test_size, cfg.probe.seed + i)
        chosen = np.random.default_rng(cfg.probe.seed + i).permutation(len(train))[:MORE_IMAGES]
        probe_images = min(cfg.probe.train_size, len(chosen))
        test_codes, test_hidden, nats = codes_and_nats(test, held_out, encode)
        codes, hidden, _ = codes_and_nats(train, chosen, encode)
        labels, test_labels = np.asarray(train.factors["class"])[chosen], np.asarray(test.factors["class"])[held_out]
        accuracies = readout_accuracies(codes, labels, test_codes, test_labels, probe_images, cfg.probe.seed + i)
        hidden_linear = object_id_accuracy(hidden, labels, test_hidden, test_labels, cfg.probe.seed + i)
        moving = {} if not test.moving else position_readouts(
            codes, hidden, positions(train, chosen), test_codes, test_hidden, positions(test, held_out))
        rows.append(Readout(step, name, probe_images, len(chosen), **accuracies, hidden_linear=hidden_linear,
                            nats=nats, **moving, **cut))
    return rows


def readouts_text(rows: list[Readout]) -> str:
    if not rows:
        return "no environment of the sequence has a class factor: nothing to read out"
    lines = [f"object identity from mu(x) of the encoder saved at step {rows[0].step}, scored on each probe's "
             "held-out images (accuracy, %; training images in brackets):",
             *([] if rows[0].dark_at is None else
               [f"with the fc layer's inputs cut from the last conv's channels dark at step {rows[0].dark_at} "
                "on each environment's held-out images (" + ", ".join(f"{r.environment} {r.cut_channels}"
                                                                      for r in rows) + " channels)"]),
             "  environment      | linear (as the probe) | linear (more) | kNN (more) | MLP (more) "
             "| hidden layer, linear (more)"]
    for r in rows:
        cells = [f"{100 * r.linear:.1f} ({r.probe_images:,})", f"{100 * r.linear_more:.1f} ({r.more_images:,})",
                 f"{100 * r.neighbours:.1f}", f"{100 * r.mlp:.1f}", f"{100 * r.hidden_linear:.1f}"]
        lines.append(f"  {r.environment:<16} | {cells[0]:<21} | {cells[1]:<13} | {cells[2]:<10} | {cells[3]:<10} "
                     f"| {cells[4]}")
    lines.append("nats per latent on the same images (KL to the prior; those above "
                 f"{NATS_SHOWN} nat, most first):")
    for r in rows:
        shown = sorted((n for n in range(len(r.nats)) if r.nats[n] > NATS_SHOWN), key=lambda n: -r.nats[n])
        lines.append(f"  {r.environment:<16} | total {sum(r.nats):.1f}: "
                     + ", ".join(f"z{n} {r.nats[n]:.1f}" for n in shown))
    moving = [r for r in rows if r.position_mu is not None]
    if moving:
        lines.append("position MSE (1e-4) of the probe's regressor on the same training images, from mu and from the "
                     "hidden layer:")
    for r in moving:
        lines.append(f"  {r.environment:<16} | mu {1e4 * r.position_mu:.1f} "
                     f"| hidden layer {1e4 * r.position_hidden:.1f}")
    lines.append("where every read-out of mu stays low, the code, not the linear probe, limits Table 1's ID columns; "
                 "where the hidden layer's is low too, the encoder's features do")
    return "\n".join(lines)
