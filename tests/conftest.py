"""Shared pytest fixtures."""
from pathlib import Path

import pytest

# The read-only folder next to the repo that holds the MD5-verified raw digit files (docs/usage.md, data).
SHARED_DIR = Path(__file__).resolve().parents[2] / "shared"


@pytest.fixture(scope="session")
def digit_root(tmp_path_factory):
    """A temporary data root filled from shared/data by ``import_raw`` (never writes into shared/)."""
    from vase.data.importing import import_raw

    source = SHARED_DIR / "data"
    if not source.is_dir():
        pytest.skip(f"{source} is absent: no digit files to test with")
    root = tmp_path_factory.mktemp("digit_root")
    import_raw(source, root)
    return root
