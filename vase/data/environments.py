"""The environments of docs/usage.md, data, by name, and the container every consumer uses.

An environment is a fixed array of 64x64 single-channel uint8 images plus ground-truth factors.
Images stay uint8 in memory (4 KiB each) and are converted to float in [0, 1] per batch.

Seeding: everything random about the data (moving-digit offsets, sprite shapes and factors) is a
pure function of ``cfg.data_seed``, the environment name and the split, never of the training
seed, so every run with the same data settings sees exactly the same images.
"""
from __future__ import annotations

import dataclasses
import zlib
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from vase.config import DataConfig
from vase.data import digits, sprites
from vase.errors import DataError

SPLITS = ("train", "test")
# Column order of factor_matrix (class first); only the factors that vary are included.
FACTOR_ORDER = ("class", "x", "y", "scale", "orientation")


@dataclass
class Environment:
    """One environment s: images (N, 1, 64, 64) uint8 and per-image factors (see FACTOR_ORDER)."""

    name: str
    family: str  # object family for object-ID probes: "mnist", "fashion", "shapes_a", "shapes_b"
    moving: bool
    images: torch.Tensor
    factors: dict[str, np.ndarray]

    def __len__(self) -> int:
        return self.images.shape[0]

    def to(self, device: torch.device | str) -> "Environment":
        """The same environment with its uint8 images on `device`, where batches are then drawn
        and converted: one upload per run, no host copy per step."""
        return dataclasses.replace(self, images=self.images.to(device))

    def batch(self, idx: torch.Tensor) -> torch.Tensor:
        """float32 (B, 1, 64, 64) in [0, 1]: one gather and one conversion, no per-sample loop."""
        return self.images[idx].float().div_(255.0)

    def factor_names(self) -> list[str]:
        """Names of factor_matrix's columns: "class", then each other factor that takes >1 value."""
        return [
            k for k in FACTOR_ORDER
            if k in self.factors and (k == "class" or np.ptp(self.factors[k]) > 0)
        ]

    def factor_matrix(self) -> np.ndarray:
        """(N, F) float32 of the varying factors, columns as in factor_names() (for MIG/DCI)."""
        return np.stack([self.factors[k].astype(np.float32) for k in self.factor_names()], axis=1)


class _Spec(NamedTuple):
    """How to build a named environment."""

    family: str
    moving: bool
    source: str  # "MNIST" / "FashionMNIST" for digits, "sprites" for sprites
    inverse: bool = False
    shape_set: int = 0


_SPECS = {
    "mnist": _Spec("mnist", False, "MNIST"),
    "moving_mnist": _Spec("mnist", True, "MNIST"),
    "fashion": _Spec("fashion", False, "FashionMNIST"),
    "moving_fashion": _Spec("fashion", True, "FashionMNIST"),
    "inverse_fashion": _Spec("fashion", False, "FashionMNIST", inverse=True),
    "shapes_a": _Spec("shapes_a", False, "sprites", shape_set=0),
    "moving_shapes_a": _Spec("shapes_a", True, "sprites", shape_set=0),
    "shapes_b": _Spec("shapes_b", False, "sprites", shape_set=1),
    "moving_shapes_b": _Spec("shapes_b", True, "sprites", shape_set=1),
}
ENVIRONMENT_NAMES: tuple[str, ...] = tuple(_SPECS)


def load_environment(name: str, split: str, cfg: DataConfig, progress: bool = True) -> Environment:
    """Build (or load from cache) environment ``name`` for ``split`` ("train" or "test")."""
    spec = _spec(name)
    _check_split(split)
    if spec.source == "sprites":
        images, factors = sprites.load_sprites(_sprite_recipe(name, split, spec, cfg), cfg.resolved_root(), progress)
    else:
        images, factors = _digit_arrays(name, split, spec, cfg)
    return Environment(name, spec.family, spec.moving, torch.from_numpy(np.ascontiguousarray(images)), factors)


def load_sequence(cfg: DataConfig, split: str, progress: bool = True) -> list[Environment]:
    """The environments of ``cfg.sequence`` in order; every name is checked before any loading."""
    names = cfg.sequence
    for name in names:
        _spec(name)
    _check_split(split)
    return [load_environment(name, split, cfg, progress) for name in names]


def _spec(name: str) -> _Spec:
    if name not in _SPECS:
        raise DataError(f"unknown environment {name!r}; known environments: {', '.join(ENVIRONMENT_NAMES)}")
    return _SPECS[name]


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise DataError(f"unknown split {split!r}; use 'train' or 'test'")


def _digit_arrays(name: str, split: str, spec: _Spec, cfg: DataConfig) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Images and factors of a digit/fashion environment (docs/usage.md, data)."""
    glyphs, labels = digits.load_glyphs(spec.source, split, cfg.resolved_root(), cfg.download)
    if spec.moving:
        offsets = digits.random_offsets(len(glyphs), np.random.default_rng(_seed_words(cfg, name, split)))
    else:
        offsets = digits.centred_offsets(len(glyphs))
    images, factors = digits.digit_images(glyphs, offsets, spec.inverse)
    return images, {"class": labels, **factors}


def _sprite_recipe(name: str, split: str, spec: _Spec, cfg: DataConfig) -> sprites.SpriteRecipe:
    """Everything that determines a sprite environment, including its seeds."""
    size = cfg.sprite_train_size if split == "train" else cfg.sprite_test_size
    if size < 1 or cfg.shapes_per_set < 1:
        raise DataError(
            f"data.sprite_{split}_size ({size}) and data.shapes_per_set ({cfg.shapes_per_set}) must be >= 1"
        )
    return sprites.SpriteRecipe(
        name=name,
        split=split,
        shape_set=spec.shape_set,
        moving=spec.moving,
        size=size,
        shapes_per_set=cfg.shapes_per_set,
        vary_scale=cfg.sprite_vary_scale,
        vary_orientation=cfg.sprite_vary_orientation,
        data_seed=cfg.data_seed,
        # Shapes depend on data_seed only, so sets A/B are the same shapes in every env and split.
        shape_seed=int(np.random.SeedSequence(_seed_words(cfg, "shapes")).generate_state(1)[0]),
        factor_seed=tuple(_seed_words(cfg, name, split)),
    )


def _seed_words(cfg: DataConfig, *tags: str) -> list[int]:
    """Seed entropy from data_seed and string tags; crc32 because Python's hash() is salted per process."""
    if cfg.data_seed < 0:
        raise DataError(f"data.data_seed must be >= 0, got {cfg.data_seed}")
    return [cfg.data_seed] + [zlib.crc32(t.encode()) for t in tags]
