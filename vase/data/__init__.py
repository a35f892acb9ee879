"""Data: the environments of docs/usage.md, data and the tools that put digit files into a data root.

- ``environments``: the ``Environment`` container and ``load_environment`` / ``load_sequence``.
- ``digits``: MNIST / Fashion-MNIST glyphs pasted on a 64x64 canvas (centred or moving).
- ``sprites``: Infinite dSprites shape sets A and B, rendered once and cached under the data root.
- ``importing``: ``vase data import DIR`` and MD5 verification of the raw digit files.
"""
from vase.data.environments import ENVIRONMENT_NAMES, Environment, load_environment, load_sequence
from vase.data.importing import import_raw, verify_digit_files

__all__ = [
    "ENVIRONMENT_NAMES",
    "Environment",
    "import_raw",
    "load_environment",
    "load_sequence",
    "verify_digit_files",
]
