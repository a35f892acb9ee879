"""Procedural sprites from Infinite dSprites, rendered once and cached (docs/usage.md, data).

Sprites need no download: the shapes are generated from ``data_seed``. Set A is the first
``shapes_per_set`` generated shapes and set B the next ``shapes_per_set``, so the sets are disjoint.
Rendering costs ~150 µs per image, so each environment is rendered once and cached as an ``.npz``
under ``root/sprites/`` whose name carries a hash of every setting that affects the pixels.

Factor grids [ours]: x, y uniform over linspace(0, 1, 32) for moving sets (0.5 when static);
scale uniform over linspace(0.5, 1, 6) and orientation over 40 angles in [0, 2π) when enabled.

Base scale [ours]: idsprites maps position 0..1 to 0.25..0.75 of the canvas, and at scale 1.0 on a
64-pixel canvas most shapes are cut off at the extreme positions (185 of 200 random shapes touched
the border). At ``BASE_SCALE = 0.7`` none of 300 shapes touched the border at the four corner
positions under any of the 40 orientations, so every drawn scale is ``BASE_SCALE`` times the
scale factor, and the recorded "scale" factor is the drawn scale.
"""
from __future__ import annotations

import hashlib
import json
import warnings
import zipfile
import zlib
from dataclasses import asdict, dataclass
from importlib.metadata import version
from pathlib import Path

import numpy as np

from vase.data.importing import atomic_write
from vase.progress_bar import progress_bar

IMG_SIZE = 64
BASE_SCALE = 0.7
POSITION_GRID = np.linspace(0.0, 1.0, 32)
SCALE_GRID = np.linspace(0.5, 1.0, 6)
ORIENTATION_GRID = np.linspace(0.0, 2 * np.pi * 39 / 40, 40)
SPRITE_FACTORS = ("class", "x", "y", "scale", "orientation")
CACHE_VERSION = 1  # bump when the rendering code changes the pixels
_WHITE = np.array([1.0, 1.0, 1.0])

_warned_unwritable = False


@dataclass(frozen=True)
class SpriteRecipe:
    """Every setting that determines a sprite environment's pixels and factors (the cache key)."""

    name: str
    split: str
    shape_set: int  # 0 = set A, 1 = set B
    moving: bool
    size: int
    shapes_per_set: int
    vary_scale: bool
    vary_orientation: bool
    data_seed: int
    shape_seed: int  # seeds idsprites' global-RNG shape generator
    factor_seed: tuple[int, ...]  # entropy of the factor sampler (differs per split and name)

    def cache_path(self, root: Path) -> Path:
        """``root/sprites/<name>_<split>_<hash>.npz``."""
        return Path(root) / "sprites" / f"{self.name}_{self.split}_{self.digest()}.npz"

    def digest(self) -> str:
        """Short hash of the recipe plus the renderer constants that also change the pixels."""
        settings = asdict(self) | {
            "img_size": IMG_SIZE,
            "base_scale": BASE_SCALE,
            "cache_version": CACHE_VERSION,
            "idsprites": version("idsprites"),
        }
        return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def load_sprites(recipe: SpriteRecipe, root: Path, progress: bool = True) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """uint8 images (N, 1, 64, 64) and factors of one sprite environment, from cache or rendered."""
    path = recipe.cache_path(root)
    cached = _read_cache(path, recipe.size)
    if cached is not None:
        return cached
    images, factors = render(recipe, progress)
    _write_cache(path, images, factors)
    return images, factors


def render(recipe: SpriteRecipe, progress: bool = True) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Draw ``recipe.size`` sprites with idsprites (one Python call per image: idsprites is scalar)."""
    from idsprites import Factors

    renderer = _renderer()
    shapes = shape_set(renderer, recipe.shape_seed, recipe.shapes_per_set, recipe.shape_set)
    factors = sample_factors(recipe)
    images = np.empty((recipe.size, 1, IMG_SIZE, IMG_SIZE), dtype=np.uint8)
    offset = recipe.shape_set * recipe.shapes_per_set  # global shape id, for idsprites' bookkeeping
    for i in progress_bar(recipe.size, f"rendering {recipe.name}/{recipe.split}", unit="image",
                          disable=not progress, iterable=range(recipe.size)):
        k = int(factors["class"][i])
        img = renderer.draw(
            Factors(
                shape=shapes[k], color=_WHITE, shape_id=offset + k,
                scale=float(factors["scale"][i]), orientation=float(factors["orientation"][i]),
                position_x=float(factors["x"][i]), position_y=float(factors["y"][i]),
            )
        )
        # idsprites returns k/255 levels, so rounding back to uint8 is lossless.
        images[i] = np.rint(img * 255.0)
    return images, factors


def _renderer():
    from idsprites import InfiniteDSprites

    return InfiniteDSprites(img_size=IMG_SIZE, background_color="black", orientation_marker=False, grayscale=True)


def shape_set(renderer, shape_seed: int, shapes_per_set: int, which: int) -> list[np.ndarray]:
    """Shapes of set ``which`` (0 = A, 1 = B): a slice of one seeded stream, so A and B are disjoint.

    idsprites draws shapes from the global ``np.random``; its state is saved and restored so that
    generating shapes never perturbs anyone else's random stream.
    """
    state = np.random.get_state()
    try:
        np.random.seed(shape_seed)
        shapes = [renderer.generate_shape() for _ in range((which + 1) * shapes_per_set)]
    finally:
        np.random.set_state(state)
    return shapes[which * shapes_per_set:]


def sample_factors(recipe: SpriteRecipe) -> dict[str, np.ndarray]:
    """Per-image factors; constant factors hold their fixed value (0.5 position, base scale, 0 angle)."""
    rng = np.random.default_rng(np.random.SeedSequence(list(recipe.factor_seed)))
    n = recipe.size

    def grid_or(grid: np.ndarray, vary: bool, fixed: float) -> np.ndarray:
        return (rng.choice(grid, size=n) if vary else np.full(n, fixed)).astype(np.float32)

    return {
        "class": rng.integers(0, recipe.shapes_per_set, size=n, dtype=np.int64),
        "x": grid_or(POSITION_GRID, recipe.moving, 0.5),
        "y": grid_or(POSITION_GRID, recipe.moving, 0.5),
        "scale": grid_or(BASE_SCALE * SCALE_GRID, recipe.vary_scale, BASE_SCALE),
        "orientation": grid_or(ORIENTATION_GRID, recipe.vary_orientation, 0.0),
    }


def _read_cache(path: Path, size: int):
    """The cached (images, factors), or None when absent; a corrupt file is reported and ignored."""
    if not path.is_file():
        return None
    try:
        with np.load(path) as z:
            images = z["images"]
            factors = {k: z[k] for k in SPRITE_FACTORS}
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile, zlib.error) as e:
        warnings.warn(f"sprite cache {path} is unreadable ({type(e).__name__}); rendering it again", stacklevel=3)
        return None
    if images.shape != (size, 1, IMG_SIZE, IMG_SIZE) or images.dtype != np.uint8 or any(
        v.shape != (size,) for v in factors.values()
    ):
        warnings.warn(f"sprite cache {path} has the wrong shape or type; rendering it again", stacklevel=3)
        return None
    return images, factors


def _write_cache(path: Path, images: np.ndarray, factors: dict[str, np.ndarray]) -> None:
    """Write the cache atomically; an unwritable root only costs a re-render next time (warned once)."""
    global _warned_unwritable
    try:
        atomic_write(path, lambda f: np.savez_compressed(f, images=images, **factors))
    except OSError as e:
        if not _warned_unwritable:
            _warned_unwritable = True
            warnings.warn(
                f"cannot cache sprites under {path.parent} ({e.strerror or e}); continuing without a cache. "
                "Set data.root or VASE_DATA_ROOT to a writable folder to keep the renders.",
                stacklevel=3,
            )
