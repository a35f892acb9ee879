"""Atomic, verified, safe-to-load checkpoints.

Layout in a run directory:
    checkpoints/latest.pt        the newest good checkpoint (tensors and plain containers only)
    checkpoints/latest.json      its metadata: step, sha256 of the .pt, format and config versions
    checkpoints/previous.pt/json the one before, kept as a fallback
    checkpoints/staged.pt/json   a new checkpoint on its way to becoming latest (only mid-save)
    checkpoints/stages/step-N.pt/json  the checkpoints kept for good: the end of each environment's
                                 stage, and every train.keep_every steps; for reading a run as it
                                 stood there (`vase inspect --step`, `vase eval --classifier --step`,
                                 `vase eval --replay`) or branching from it; resume never reads them

Every file is written to a temporary name, fsynced and renamed, so no file is ever half written.
A save then renames staged -> latest (and the old latest -> previous). A kill between two of those
renames can leave a .json next to a .pt it does not describe, so loading never trusts file names:
each .json is paired with whichever .pt has its sha256, and the newest verified pair wins. Whatever
moment a run is killed at, at least one verified pair survives.

Loading uses torch.load(weights_only=True), which refuses pickles that would run code.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import re
import warnings
from pathlib import Path
from typing import Any

import torch

from vase.config import CONFIG_VERSION
from vase.errors import CheckpointError

# 2: the inference state's `last_allocation` became `settling_since` (a mask change re-settles).
CHECKPOINT_FORMAT = 2
CHECKPOINT_DIR = "checkpoints"
STAGES_DIR = "stages"
# Where a verified pair may sit after a save that was killed part-way; also the order of preference
# between pairs of the same step.
SLOTS = ("latest", "staged", "previous")


def write_atomic(path: Path, data: bytes) -> None:
    """Write `data` to a temporary file, fsync it and rename it over `path` (all or nothing)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise CheckpointError(f"could not write {path} ({e.strerror or e})") from e


def _fsync_dir(directory: Path) -> None:
    """Make the renames in `directory` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / CHECKPOINT_DIR


def has_checkpoint(run_dir: Path) -> bool:
    """Whether a save ever got as far as a .json (good or not). A .json is written after its .pt, so
    a run killed before or during its first save has none and can simply start again."""
    directory = checkpoint_dir(run_dir)
    return any((directory / f"{slot}.json").exists() for slot in SLOTS)


def _read_meta(path: Path) -> dict | None:
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def _scan(directory: Path, slots=SLOTS) -> tuple[dict[str, bytes], dict[str, dict | None], list[tuple[dict, str, str]]]:
    """The .pt bytes and .json metadata found in `slots`, and every verified pair (meta, pt slot,
    json slot), newest step first (ties: latest before staged before previous)."""
    blobs = {s: (directory / f"{s}.pt").read_bytes() for s in slots if (directory / f"{s}.pt").is_file()}
    hashes = {s: _sha256(b) for s, b in blobs.items()}
    metas = {s: _read_meta(directory / f"{s}.json") for s in slots if (directory / f"{s}.json").exists()}
    pairs = [
        (meta, pt_slot, meta_slot)
        for meta_slot, meta in metas.items() if meta is not None
        for pt_slot in slots if hashes.get(pt_slot) == meta.get("sha256")
    ]
    pairs.sort(key=lambda p: (-int(p[0].get("step", -1)), SLOTS.index(p[1]), SLOTS.index(p[2])))
    return blobs, metas, pairs


def kept_path(run_dir: Path, step: int) -> Path:
    """Where the checkpoint kept for good at `step` lives (its .json beside it)."""
    return checkpoint_dir(run_dir) / STAGES_DIR / f"step-{step:08d}.pt"


def save_checkpoint(run_dir: Path, state: dict[str, Any], meta: dict[str, Any], keep: bool = False) -> Path:
    """Save `state`; the old latest becomes previous only after the new one is safely on disk. With
    `keep` (a stage end, or train.keep_every), a copy also stays under stages/ for good."""
    directory = checkpoint_dir(run_dir)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    data = buffer.getvalue()
    meta = {**meta, "sha256": _sha256(data), "format": CHECKPOINT_FORMAT, "config_version": CONFIG_VERSION}
    try:
        directory.mkdir(parents=True, exist_ok=True)
        if keep:  # before the promotion: a run killed in between trains to this step again and rewrites it
            kept = kept_path(run_dir, int(meta["step"]))
            kept.parent.mkdir(exist_ok=True)
            write_atomic(kept, data)
            write_atomic(kept.with_suffix(".json"), json.dumps(meta, indent=2).encode())
        write_atomic(directory / "staged.pt", data)
        write_atomic(directory / "staged.json", json.dumps(meta, indent=2).encode())
        _promote(directory)
    except (OSError, CheckpointError) as e:
        reason = (
            str(e)
            if isinstance(e, CheckpointError)
            else f"could not save a checkpoint in {directory} ({e.strerror or e})"
        )
        raise CheckpointError(f"{reason}; the run stopped and the checkpoints already on disk are kept") from e
    return directory / "latest.pt"


def _promote(directory: Path) -> None:
    """staged -> latest, after the newest other verified pair has become previous.

    Normally that pair is the old latest; after a save that was killed part-way it may be split
    over two slots, and a corrupt latest is never pushed over a good previous.
    """
    _, _, pairs = _scan(directory, ("latest", "previous"))
    if pairs:
        _, pt_slot, meta_slot = pairs[0]
        if pt_slot != "previous":
            os.replace(directory / f"{pt_slot}.pt", directory / "previous.pt")
        if meta_slot != "previous":
            os.replace(directory / f"{meta_slot}.json", directory / "previous.json")
    os.replace(directory / "staged.json", directory / "latest.json")
    os.replace(directory / "staged.pt", directory / "latest.pt")
    _fsync_dir(directory)


def _latest_problem(directory: Path, metas: dict[str, dict | None]) -> str:
    """Why the latest.pt/latest.json pair did not verify, in words."""
    pt, meta_path = directory / "latest.pt", directory / "latest.json"
    if not pt.exists() and not meta_path.exists():
        return f"{pt} is missing"
    if not pt.exists():
        return f"{pt} is missing (a checkpoint save was interrupted)"
    if not meta_path.exists():
        return f"{meta_path} is missing (a checkpoint save was interrupted)"
    if metas.get("latest") is None:
        return f"{meta_path} is not readable JSON"
    return f"{pt} is truncated or corrupted (its sha256 does not match {meta_path.name})"


def _one_line(error: Exception) -> str:
    """The informative line of torch's multi-paragraph unpickler error."""
    text = str(error)
    found = re.search(r"(Trying to load unsupported GLOBAL \S+|Unsupported (?:global|operand)[^\n]*)", text)
    if found:
        return found.group(1).rstrip(".")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__


def load_checkpoint(run_dir: Path, step: int | None = None) -> tuple[dict, dict]:
    """Load the newest checkpoint that verifies; say so (a warning) when that is not latest.pt.

    With `step`, load the verified checkpoint of that step instead, with no warning: the older one
    was asked for. A run keeps two, latest and previous, and those kept for good (`stages/`): one at
    each stage end, and one every train.keep_every steps.

    A checkpoint whose checksum fails is skipped; one that verifies but was written by an
    incompatible version, or that the safe loader refuses, stops the resume with an error instead of
    silently falling back to an older one.
    """
    directory = checkpoint_dir(run_dir)
    if not has_checkpoint(run_dir):
        raise CheckpointError(f"no checkpoint in {directory}: is {run_dir} a vase run directory?")
    blobs, metas, pairs = _scan(directory)
    if not pairs:
        raise CheckpointError(
            f"no usable checkpoint in {directory}: {_latest_problem(directory, metas)}, and no other "
            "checkpoint file verifies against its sha256"
        )
    if step is not None:
        kept = sorted({int(p[0].get("step", -1)) for p in pairs} | set(kept_steps(run_dir)))
        pairs = [p for p in pairs if int(p[0].get("step", -1)) == step]
        if not pairs:
            found = _kept(run_dir, step)
            if found is None:
                raise CheckpointError(
                    f"no checkpoint of step {step} in {directory}: a run keeps its two newest checkpoints "
                    f"and those kept for good (stage ends, train.keep_every), here of step {', '.join(map(str, kept))}"
                )
            meta, blob, path = found
            return _unpickle(blob, meta, path), meta
    meta, pt_slot, meta_slot = pairs[0]
    path = directory / f"{pt_slot}.pt"
    state = _unpickle(blobs[pt_slot], meta, path)
    if step is None and (pt_slot, meta_slot) != ("latest", "latest"):
        if ("latest", "latest") in {(p, m) for _, p, m in pairs}:
            problem = f"a checkpoint save was interrupted after {path} was fully written"
        else:
            problem = _latest_problem(directory, metas)
        which = "the previous checkpoint" if pt_slot == "previous" else f"the newer checkpoint {path.name}"
        warnings.warn(f"{problem}; resuming from {which} (step {meta.get('step')})", stacklevel=2)
    return state, meta


def kept_steps(run_dir: Path) -> list[int]:
    """The steps of the checkpoints a run kept for good (stage ends, train.keep_every)."""
    paths = (checkpoint_dir(run_dir) / STAGES_DIR).glob("step-*.pt")
    return sorted(int(path.stem.split("-")[1]) for path in paths)


def _kept(run_dir: Path, step: int) -> tuple[dict, bytes, Path] | None:
    """The checkpoint kept for good at `step` as (meta, bytes, path), if there is one and it verifies."""
    path = kept_path(run_dir, step)
    meta = _read_meta(path.with_suffix(".json"))
    if meta is None or not path.is_file():
        return None
    blob = path.read_bytes()
    if _sha256(blob) != meta.get("sha256"):
        raise CheckpointError(f"{path} is truncated or corrupted (its sha256 does not match {path.stem}.json)")
    return meta, blob, path


def _unpickle(blob: bytes, meta: dict, path: Path) -> dict:
    """A verified checkpoint's state, if this version of vase can read it and it holds only tensors
    and plain containers."""
    if meta.get("format") != CHECKPOINT_FORMAT or meta.get("config_version") != CONFIG_VERSION:
        raise CheckpointError(
            f"{path} was written by an incompatible version (checkpoint format {meta.get('format')}, config "
            f"version {meta.get('config_version')}; this vase reads format {CHECKPOINT_FORMAT}, config version "
            f"{CONFIG_VERSION}), so it cannot be resumed; start a new run"
        )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's pickle-protocol notices are noise here
            return torch.load(io.BytesIO(blob), weights_only=True, map_location="cpu")
    except Exception as e:  # the unpickler refuses anything but tensors and plain containers
        raise CheckpointError(
            f"refusing to load {path}: it holds objects other than tensors and plain containers, which "
            f"could run code ({_one_line(e)}); it was not written by vase, so do not trust this run directory"
        ) from e


def save_weights(path: Path, state: dict[str, Any]) -> None:
    """Atomically save a plain state dict (the encoder at a probe point, for `vase eval`)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    write_atomic(Path(path), buffer.getvalue())


def load_weights(path: Path) -> dict[str, Any]:
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except Exception as e:
        raise CheckpointError(f"{path} cannot be loaded safely: {_one_line(e)}") from e
