"""Atomic, verified, safe-to-load checkpoints.

Layout in a run directory:
    checkpoints/latest.pt        the newest good checkpoint (tensors and plain containers only)
    checkpoints/latest.json      its metadata: step, sha256 of the .pt, config and code versions
    checkpoints/previous.pt/json the one before, kept as a fallback

Writes go to a temporary file that is fsynced and then renamed over the target, so a kill at any
moment leaves either the old or the new file, never half of one. Loading uses
torch.load(weights_only=True), which refuses pickles that would run code.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch

from vase.config import CONFIG_VERSION
from vase.errors import CheckpointError

CHECKPOINT_FORMAT = 1
SLOTS = ("latest", "previous")


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise CheckpointError(
            f"could not write checkpoint {path} ({e.strerror or e}); the previous checkpoint is kept"
        ) from e


def save_checkpoint(run_dir: Path, state: dict[str, Any], meta: dict[str, Any]) -> Path:
    """Save `state`; the old latest becomes previous only after the new one is safely on disk."""
    directory = Path(run_dir) / "checkpoints"
    directory.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    data = buffer.getvalue()
    meta = {
        **meta,
        "sha256": hashlib.sha256(data).hexdigest(),
        "format": CHECKPOINT_FORMAT,
        "config_version": CONFIG_VERSION,
    }
    staged = directory / "staged.pt"
    _write_atomic(staged, data)
    _write_atomic(directory / "staged.json", json.dumps(meta, indent=2).encode())
    latest, latest_meta = directory / "latest.pt", directory / "latest.json"
    if latest.exists() and latest_meta.exists():
        os.replace(latest, directory / "previous.pt")
        os.replace(latest_meta, directory / "previous.json")
    os.replace(directory / "staged.json", latest_meta)
    os.replace(staged, latest)
    return latest


def _load_slot(directory: Path, slot: str) -> tuple[dict, dict]:
    path, meta_path = directory / f"{slot}.pt", directory / f"{slot}.json"
    if not path.exists() or not meta_path.exists():
        raise CheckpointError(f"{path} or its metadata is missing")
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{meta_path} is not readable JSON ({e})") from e
    data = path.read_bytes()
    if hashlib.sha256(data).hexdigest() != meta.get("sha256"):
        raise CheckpointError(f"{path} is truncated or corrupted (checksum mismatch)")
    if meta.get("format") != CHECKPOINT_FORMAT or meta.get("config_version") != CONFIG_VERSION:
        raise CheckpointError(
            f"{path} was written by an incompatible version (format {meta.get('format')}, config "
            f"version {meta.get('config_version')}; this code reads format {CHECKPOINT_FORMAT}, "
            f"config version {CONFIG_VERSION})"
        )
    try:
        state = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except Exception as e:  # the unpickler refuses anything but tensors and plain containers
        raise CheckpointError(f"{path} was refused by the safe loader: {e}") from e
    return state, meta


def load_checkpoint(run_dir: Path) -> tuple[dict, dict]:
    """Load the newest checkpoint that verifies; fall back to the previous one with a warning."""
    directory = Path(run_dir) / "checkpoints"
    if not directory.is_dir():
        raise CheckpointError(f"no checkpoints in {run_dir}: is this a run directory?")
    problems = []
    for slot in SLOTS:
        try:
            state, meta = _load_slot(directory, slot)
        except CheckpointError as e:
            problems.append(str(e))
            continue
        if problems:
            warnings.warn(f"{problems[0]}; resuming from the previous checkpoint (step {meta.get('step')})", stacklevel=2)
        return state, meta
    if any("incompatible" in p or "refused" in p for p in problems):
        raise CheckpointError(problems[0])
    raise CheckpointError("no usable checkpoint in " + str(directory) + ": " + "; ".join(problems))


def save_weights(path: Path, state: dict[str, Any]) -> None:
    """Atomically save a plain state dict (the encoder at a probe point, for `vase eval`)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    _write_atomic(Path(path), buffer.getvalue())


def load_weights(path: Path) -> dict[str, Any]:
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except Exception as e:
        raise CheckpointError(f"{path} cannot be loaded safely: {e}") from e
