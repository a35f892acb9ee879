"""Getting the digit and fashion files into a data root, and checking them (docs/usage.md, data).

A data root holds ``MNIST/raw/*.gz`` and ``FashionMNIST/raw/*.gz`` exactly as torchvision lays
them out, so a root filled by ``vase data import DIR`` and one filled by torchvision's own download
are interchangeable. Every file is checked against the MD5 that torchvision publishes in each
class's ``resources`` attribute, so there is one source of truth for the checksums.
"""
from __future__ import annotations

import gzip
import hashlib
import os
import shutil
import struct
import tempfile
from pathlib import Path

from torchvision.datasets import MNIST, FashionMNIST

from vase.errors import DataError

# torchvision class per dataset folder name; the folder name is the class name (torchvision's rule).
DIGIT_DATASETS = {"MNIST": MNIST, "FashionMNIST": FashionMNIST}

OFFLINE_HINT = (
    "run `vase data import DIR` (DIR holding MNIST/raw and FashionMNIST/raw), "
    "or point VASE_DATA_ROOT at a data root that has the files"
)
FIX_HINT = OFFLINE_HINT + ", or allow downloading with --download (data.download=true)"


def expected_files(dataset: str) -> dict[str, str]:
    """File name -> MD5 of every raw ``.gz`` file torchvision expects for ``dataset``."""
    if dataset not in DIGIT_DATASETS:
        raise DataError(f"unknown digit dataset {dataset!r}; known: {', '.join(DIGIT_DATASETS)}")
    return dict(DIGIT_DATASETS[dataset].resources)


def raw_dir(root: Path, dataset: str) -> Path:
    """Where torchvision looks for ``dataset``'s raw files under ``root``."""
    return Path(root) / dataset / "raw"


def md5sum(path: Path, chunk: int = 1 << 20) -> str:
    """Hex MD5 of a file, read in chunks so large files do not need to fit in memory twice."""
    digest = hashlib.md5()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(chunk), b""):
            digest.update(block)
    return digest.hexdigest()


def verify_digit_files(root: Path, dataset: str) -> None:
    """Raise DataError unless every raw file of ``dataset`` is present under ``root`` with its MD5."""
    folder = raw_dir(root, dataset)
    for name, md5 in expected_files(dataset).items():
        path = folder / name
        if not path.is_file():
            raise DataError(f"{dataset} file missing: {path}; {FIX_HINT}")
        if md5sum(path) != md5:
            raise DataError(
                f"{dataset} file corrupt (MD5 mismatch): {path}; delete it, then {FIX_HINT}"
            )


def import_raw(source: Path, root: Path) -> list[Path]:
    """Copy the MNIST / FashionMNIST raw ``.gz`` files found under ``source`` into ``root``.

    Each source file is MD5-checked before it is copied (atomically), so a bad source never
    leaves a bad file in the root. Returns the destination paths of the files copied.
    """
    source, root = Path(source), Path(root)
    if not source.is_dir():
        raise DataError(f"import source {source} is not a directory; pass the folder holding MNIST/raw")
    found = _find_raw_files(source)
    if not found:
        raise DataError(
            f"no MNIST/raw or FashionMNIST/raw .gz files found under {source}; "
            f"expected e.g. {source / 'MNIST' / 'raw' / 'train-images-idx3-ubyte.gz'}"
        )
    copied = []
    for dataset, src in found:
        md5 = expected_files(dataset)[src.name]
        if md5sum(src) != md5:
            raise DataError(f"{dataset} source file corrupt (MD5 mismatch): {src}; get a fresh copy")
        dest = raw_dir(root, dataset) / src.name
        if dest.resolve() != src.resolve():
            _atomic_copy(dest, lambda src=src: open(src, "rb"))
        copied.append(dest)
    return copied


def _find_raw_files(source: Path) -> list[tuple[str, Path]]:
    """(dataset, path) of every expected ``<dataset>/raw/<file>.gz`` under ``source``; first wins."""
    seen: dict[tuple[str, str], Path] = {}
    for path in sorted(source.rglob("*.gz")):
        dataset = path.parent.parent.name
        if path.parent.name == "raw" and dataset in DIGIT_DATASETS and path.name in expected_files(dataset):
            seen.setdefault((dataset, path.name), path)
    return [(dataset, path) for (dataset, _), path in seen.items()]


def _atomic_copy(dest: Path, open_source) -> None:
    """Stream ``open_source()`` into ``dest`` atomically; a failure becomes a DataError."""

    def copy(out) -> None:
        with open_source() as src:
            shutil.copyfileobj(src, out)

    try:
        atomic_write(dest, copy)
    except OSError as e:
        raise DataError(
            f"cannot write {dest}: {e.strerror or e}; use a writable data root (data.root or VASE_DATA_ROOT)"
        ) from e


def atomic_write(dest: Path, write) -> None:
    """Call ``write(fileobj)`` on a temp file next to ``dest``, then rename it over ``dest``.

    Readers (and a second process) never see half a file: os.replace is atomic on one filesystem.
    Raises OSError when the folder cannot be created or written.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as out:
            write(out)
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def ensure_extracted(root: Path, dataset: str) -> None:
    """Unpack each verified ``.gz`` next to itself, as torchvision reads only the unpacked files.

    An unpacked file is trusted only if its size matches the size recorded in the gzip trailer;
    otherwise (e.g. an interrupted earlier unpack by another tool) it is unpacked again.
    """
    folder = raw_dir(root, dataset)
    for name in expected_files(dataset):
        gz, out = folder / name, folder / Path(name).stem
        if out.is_file() and out.stat().st_size == _gzip_size(gz):
            continue
        _atomic_copy(out, lambda gz=gz: gzip.open(gz, "rb"))


def _gzip_size(path: Path) -> int:
    """Uncompressed size (mod 2**32) from the last four bytes of a gzip file (RFC 1952 ISIZE)."""
    with open(path, "rb") as f:
        f.seek(-4, os.SEEK_END)
        return struct.unpack("<I", f.read(4))[0]
