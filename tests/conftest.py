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


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """A tiny trained run to read: two sprite environments, 4 steps each, a checkpoint every 2 steps
    (so two are kept), probes and saved encoders every 2 steps. Tests read it; `vase inspect` adds
    its pictures."""
    from click.testing import CliRunner
    from test_cli import tiny_args

    from cli import main

    root = tmp_path_factory.mktemp("tiny_run")
    run = root / "run"
    args = tiny_args(run, root / "data", steps=4, probe__every=2, train__checkpoint_every=2)
    args[1:1] = ["--sequence", "moving_shapes_a,shapes_b"]
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return run


@pytest.fixture
def sigint_handled():
    """SIGINT with Python's own handler for the test, given back after it. A shell without job
    control starts a background pytest with SIGINT ignored, and vase leaves an ignored SIGINT
    alone (`vase.trainer.InterruptBetweenSteps`), so the tests that send it need it handled."""
    import signal

    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)
