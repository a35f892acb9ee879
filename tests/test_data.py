"""Tests of the data package: the environments of docs/usage.md, data, the sprite cache and the digit files."""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from torchvision.datasets import MNIST

from vase.config import DataConfig
from vase.data import ENVIRONMENT_NAMES, import_raw, load_environment, load_sequence, sprites, verify_digit_files
from vase.errors import DataError

DIGIT_ENVS = ("mnist", "moving_mnist", "fashion", "moving_fashion", "inverse_fashion")
SPRITE_ENVS = ("shapes_a", "moving_shapes_a", "shapes_b", "moving_shapes_b")


def sprite_cfg(root, **kw) -> DataConfig:
    """A tiny sprite config: 96 train / 64 test images keep every render well under a second."""
    return DataConfig(root=str(root), sprite_train_size=96, sprite_test_size=64, **kw)


@pytest.fixture(scope="module")
def digit_envs(digit_root):
    """The five digit environments' test splits (10k images each), loaded once."""
    cfg = DataConfig(root=str(digit_root))
    return {name: load_environment(name, "test", cfg) for name in DIGIT_ENVS}


def check_images(env, n):
    """The contract every consumer relies on: uint8 (N,1,64,64) contiguous; batch float in [0,1]."""
    assert len(env) == n
    assert env.images.dtype == torch.uint8 and env.images.shape == (n, 1, 64, 64)
    assert env.images.is_contiguous()
    x = env.batch(torch.tensor([0, n - 1, 0]))
    assert x.dtype == torch.float32 and x.shape == (3, 1, 64, 64)
    assert 0.0 <= x.min() and x.max() <= 1.0 and x.max() > 0.5
    assert torch.equal(x[0], x[2]) and torch.equal(x[0], env.images[0].float() / 255)
    assert env.factors["class"].dtype == np.int64 and env.factors["class"].shape == (n,)
    for k in ("x", "y"):
        assert env.factors[k].dtype == np.float32 and env.factors[k].shape == (n,)
        assert 0.0 <= env.factors[k].min() and env.factors[k].max() <= 1.0


# --- digits -------------------------------------------------------------------------------------


def test_digit_envs_shapes_families_and_labels(digit_envs):
    families = {"mnist": "mnist", "moving_mnist": "mnist", "fashion": "fashion",
                "moving_fashion": "fashion", "inverse_fashion": "fashion"}
    for name, env in digit_envs.items():
        check_images(env, 10000)
        assert env.name == name and env.family == families[name]
        assert env.moving == name.startswith("moving")
        assert set(np.unique(env.factors["class"])) == set(range(10))
        assert env.factor_names() == (["class", "x", "y"] if env.moving else ["class"])
        assert env.factor_matrix().shape == (10000, 3 if env.moving else 1)


def test_static_digits_are_centred(digit_envs):
    for name in ("mnist", "fashion"):
        env = digit_envs[name]
        assert np.all(env.factors["x"] == 0.5) and np.all(env.factors["y"] == 0.5)
        # nothing outside the centred 28x28 window
        assert env.images.sum() == env.images[:, :, 18:46, 18:46].sum() > 0


def test_moving_digits_sit_at_their_recorded_offset(digit_envs):
    moving, centred = digit_envs["moving_mnist"], digit_envs["mnist"]
    ox = np.rint(moving.factors["x"] * 36).astype(int)
    oy = np.rint(moving.factors["y"] * 36).astype(int)
    assert np.allclose(ox / 36, moving.factors["x"]) and np.allclose(oy / 36, moving.factors["y"])
    assert ox.min() == 0 and ox.max() == 36 and oy.min() == 0 and oy.max() == 36
    assert moving.factors["x"].std() > 0.2 and not np.array_equal(ox, oy)
    for i in range(0, 10000, 37):
        glyph = centred.images[i, 0, 18:46, 18:46]
        assert torch.equal(moving.images[i, 0, oy[i]:oy[i] + 28, ox[i]:ox[i] + 28], glyph)
        assert moving.images[i].sum() == glyph.sum()  # and nothing anywhere else


def test_inverse_fashion_is_255_minus_fashion(digit_envs):
    inverse, fashion = digit_envs["inverse_fashion"], digit_envs["fashion"]
    assert torch.equal(inverse.images, 255 - fashion.images)
    assert np.array_equal(inverse.factors["class"], fashion.factors["class"])


def test_moving_digits_are_deterministic_per_data_seed(digit_root, digit_envs):
    again = load_environment("moving_fashion", "test", DataConfig(root=str(digit_root)))
    assert torch.equal(again.images, digit_envs["moving_fashion"].images)
    other = load_environment("moving_fashion", "test", DataConfig(root=str(digit_root), data_seed=1))
    assert not np.array_equal(other.factors["x"], digit_envs["moving_fashion"].factors["x"])
    # Different environments draw different offsets from the same data_seed.
    assert not np.array_equal(digit_envs["moving_mnist"].factors["x"], digit_envs["moving_fashion"].factors["x"])


def test_data_root_env_var_is_honoured(digit_root, monkeypatch):
    monkeypatch.setenv("VASE_DATA_ROOT", str(digit_root))
    assert len(load_environment("mnist", "test", DataConfig())) == 10000


# --- digit files: import and verification -------------------------------------------------------


def test_import_raw_then_verify(digit_root):
    for dataset in ("MNIST", "FashionMNIST"):
        verify_digit_files(digit_root, dataset)  # raises on any missing or corrupt file
        assert len(list((digit_root / dataset / "raw").glob("*.gz"))) == 4


def test_import_raw_returns_copied_files(digit_root, tmp_path):
    copied = import_raw(digit_root, tmp_path / "root")
    assert len(copied) == 8 and all(p.is_file() and p.parent.parent.parent == tmp_path / "root" for p in copied)


def test_import_raw_without_files_fails_clearly(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no MNIST/raw or FashionMNIST/raw"):
        import_raw(tmp_path / "empty", tmp_path / "root")


def test_import_raw_refuses_a_corrupt_source(digit_root, tmp_path):
    src = tmp_path / "src" / "MNIST" / "raw"
    src.mkdir(parents=True)
    (src / "train-labels-idx1-ubyte.gz").write_bytes(b"not the real file")
    with pytest.raises(DataError, match="train-labels-idx1-ubyte.gz"):
        import_raw(tmp_path / "src", tmp_path / "root")
    assert not (tmp_path / "root" / "MNIST" / "raw" / "train-labels-idx1-ubyte.gz").exists()


def test_missing_root_says_how_to_fix(tmp_path):
    with pytest.raises(DataError, match="vase data import") as err:
        load_environment("mnist", "test", DataConfig(root=str(tmp_path / "nowhere")))
    assert "missing" in str(err.value) and "--download" in str(err.value)
    assert "\n" not in str(err.value)


def test_corrupt_file_is_named(digit_root, tmp_path):
    shutil.copytree(digit_root / "MNIST" / "raw", tmp_path / "MNIST" / "raw")
    bad = tmp_path / "MNIST" / "raw" / "t10k-images-idx3-ubyte.gz"
    bad.write_bytes(bad.read_bytes()[:1000])
    with pytest.raises(DataError, match="corrupt.*t10k-images-idx3-ubyte.gz"):
        load_environment("mnist", "test", DataConfig(root=str(tmp_path)))


def test_damaged_unpacked_file_is_unpacked_again(digit_root, tmp_path):
    shutil.copytree(digit_root / "MNIST" / "raw", tmp_path / "MNIST" / "raw")
    cfg = DataConfig(root=str(tmp_path))
    first = load_environment("mnist", "test", cfg)
    unpacked = tmp_path / "MNIST" / "raw" / "t10k-images-idx3-ubyte"
    unpacked.write_bytes(unpacked.read_bytes()[:5000])  # e.g. an interrupted unpack by another tool
    assert torch.equal(load_environment("mnist", "test", cfg).images, first.images)


def test_failed_download_becomes_a_data_error(tmp_path, monkeypatch):
    monkeypatch.setattr(MNIST, "mirrors", ["http://127.0.0.1:9/"])  # nothing listens on port 9
    with pytest.raises(DataError, match="could not download MNIST.*vase data import"):
        load_environment("mnist", "test", DataConfig(root=str(tmp_path), download=True))


def test_download_is_skipped_when_verified_files_exist(digit_root, monkeypatch):
    monkeypatch.setattr(MNIST, "mirrors", ["http://127.0.0.1:9/"])  # any network use would fail
    assert len(load_environment("mnist", "test", DataConfig(root=str(digit_root), download=True))) == 10000


# --- names --------------------------------------------------------------------------------------


def test_unknown_name_lists_known_names(tmp_path):
    with pytest.raises(DataError, match="unknown environment 'moving_shapes_c'") as err:
        load_environment("moving_shapes_c", "train", sprite_cfg(tmp_path))
    assert all(name in str(err.value) for name in ENVIRONMENT_NAMES)


def test_sequence_validates_every_name_before_loading(tmp_path, monkeypatch):
    monkeypatch.setattr(sprites, "render", lambda *a, **k: pytest.fail("rendered before validating"))
    with pytest.raises(DataError, match="unknown environment 'bogus'"):
        load_sequence(sprite_cfg(tmp_path, sequence=["moving_shapes_a", "bogus"]), "train")


def test_sequence_loads_in_order(tmp_path):
    envs = load_sequence(sprite_cfg(tmp_path, sequence=["moving_shapes_a", "shapes_b"]), "test", progress=False)
    assert [e.name for e in envs] == ["moving_shapes_a", "shapes_b"]
    assert [e.family for e in envs] == ["shapes_a", "shapes_b"]


# --- sprites ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sprite_envs(tmp_path_factory):
    cfg = sprite_cfg(tmp_path_factory.mktemp("sprites"))
    return {name: load_environment(name, "train", cfg, progress=False) for name in SPRITE_ENVS}


def test_sprite_envs_shapes_and_factors(sprite_envs):
    for name, env in sprite_envs.items():
        check_images(env, 96)
        assert env.family == name.removeprefix("moving_") and env.moving == name.startswith("moving")
        assert set(np.unique(env.factors["class"])) == {0, 1, 2}
        assert np.all(env.factors["scale"] == np.float32(sprites.BASE_SCALE))
        assert np.all(env.factors["orientation"] == 0)
        border = torch.cat([env.images[..., 0, :], env.images[..., -1, :], env.images[..., 0], env.images[..., -1]], -1)
        assert border.max() == 0  # BASE_SCALE keeps every shape inside the canvas


def test_sprite_positions(sprite_envs):
    static, moving = sprite_envs["shapes_a"], sprite_envs["moving_shapes_a"]
    assert np.all(static.factors["x"] == 0.5) and np.all(static.factors["y"] == 0.5)
    assert static.factor_names() == ["class"]
    for k in ("x", "y"):
        assert np.isin(moving.factors[k], sprites.POSITION_GRID.astype(np.float32)).all()
        assert len(np.unique(moving.factors[k])) > 10
    assert moving.factor_names() == ["class", "x", "y"]
    # A static sprite is the same picture for every image of its class.
    for c in range(3):
        imgs = static.images[torch.from_numpy(static.factors["class"] == c)]
        assert (imgs == imgs[0]).all()


def test_sprite_sets_a_and_b_are_disjoint(sprite_envs):
    a, b = sprite_envs["shapes_a"], sprite_envs["shapes_b"]
    b_centred = [b.images[int(np.flatnonzero(b.factors["class"] == c)[0])] for c in range(3)]
    for c in range(3):
        a_img = a.images[int(np.flatnonzero(a.factors["class"] == c)[0])]
        assert all((a_img.int() - img.int()).abs().sum() > 50 * 255 for img in b_centred)


def test_sprites_are_deterministic_and_seeded(tmp_path, sprite_envs):
    again = load_environment("moving_shapes_b", "train", sprite_cfg(tmp_path / "fresh"), progress=False)
    assert torch.equal(again.images, sprite_envs["moving_shapes_b"].images)
    other_seed = load_environment("moving_shapes_b", "train", sprite_cfg(tmp_path, data_seed=1), progress=False)
    assert not torch.equal(other_seed.images, again.images)
    test_split = load_environment("moving_shapes_b", "test", sprite_cfg(tmp_path), progress=False)
    assert not np.array_equal(test_split.factors["x"], again.factors["x"][:64])


def test_sprite_rendering_leaves_global_numpy_rng_alone(tmp_path):
    np.random.seed(123)
    expected = np.random.rand(3)
    np.random.seed(123)
    load_environment("shapes_a", "test", sprite_cfg(tmp_path), progress=False)
    assert np.array_equal(np.random.rand(3), expected)


def test_sprite_scale_and_orientation_can_vary(tmp_path):
    cfg = sprite_cfg(tmp_path, sprite_vary_scale=True, sprite_vary_orientation=True)
    env = load_environment("moving_shapes_a", "test", cfg, progress=False)
    assert env.factor_names() == ["class", "x", "y", "scale", "orientation"]
    assert np.isin(env.factors["scale"], (sprites.BASE_SCALE * sprites.SCALE_GRID).astype(np.float32)).all()
    assert len(np.unique(env.factors["orientation"])) > 10 and env.factors["orientation"].max() < 2 * np.pi
    assert env.factor_matrix().shape == (64, 5) and env.factor_matrix().dtype == np.float32


# --- sprite cache -------------------------------------------------------------------------------


def cache_files(root):
    return sorted((root / "sprites").glob("*.npz"))


def test_sprite_cache_round_trip(tmp_path, monkeypatch):
    cfg = sprite_cfg(tmp_path)
    first = load_environment("moving_shapes_a", "test", cfg, progress=False)
    [path] = cache_files(tmp_path)
    assert path.name.startswith("moving_shapes_a_test_")
    monkeypatch.setattr(sprites, "render", lambda *a, **k: pytest.fail("re-rendered despite a cache"))
    second = load_environment("moving_shapes_a", "test", cfg, progress=False)
    assert torch.equal(first.images, second.images)
    assert all(np.array_equal(first.factors[k], second.factors[k]) for k in first.factors)
    # A setting that changes the pixels gets its own cache file.
    monkeypatch.undo()
    load_environment("moving_shapes_a", "test", sprite_cfg(tmp_path, sprite_vary_scale=True), progress=False)
    assert len(cache_files(tmp_path)) == 2


@pytest.mark.parametrize("damage", ["truncate", "wrong_shape"])
def test_corrupt_sprite_cache_is_rendered_again(tmp_path, damage):
    cfg = sprite_cfg(tmp_path)
    first = load_environment("shapes_b", "test", cfg, progress=False)
    [path] = cache_files(tmp_path)
    if damage == "truncate":
        path.write_bytes(path.read_bytes()[:200])
    else:
        with path.open("wb") as f:
            np.savez(f, images=np.zeros((3, 1, 64, 64), np.uint8))
    with pytest.warns(UserWarning, match="sprite cache"):
        again = load_environment("shapes_b", "test", cfg, progress=False)
    assert torch.equal(again.images, first.images)
    with np.load(path) as z:  # and the cache was repaired
        assert z["images"].shape == (64, 1, 64, 64)


def test_unwritable_root_still_works(tmp_path, monkeypatch):
    monkeypatch.setattr(sprites, "_warned_unwritable", False)
    blocker = tmp_path / "file"
    blocker.write_text("a file where the data root's folder should be")
    cfg = sprite_cfg(blocker / "root")
    with pytest.warns(UserWarning, match="cannot cache sprites"):
        env = load_environment("shapes_a", "test", cfg, progress=False)
    assert len(env) == 64
