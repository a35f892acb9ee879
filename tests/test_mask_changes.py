"""`vase eval --mask-changes`: eq. 5's changes of each slot's mask, from the logged steps."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from click.testing import CliRunner
from test_cli import fails_in_one_line

from cli import main
from vase.config import build_config
from vase.errors import VaseError
from vase.mask_changes import MaskChange, logged_scalars, mask_changes, not_a_purge, read_logged_masks

# step: (slot trained, true environment, mask of that slot); slot 1 turns z1 on, slot 0 is trained
# in between, then slot 1 turns z1 off and z0 on at once.
LOGGED = {
    50: (0, 0, (1, 1, 1)),
    100: (0, 0, (1, 1, 1)),
    150: (1, 1, (0, 0, 1)),
    200: (1, 1, (0, 1, 1)),
    250: (0, 2, (1, 1, 1)),
    300: (1, 1, (1, 0, 1)),
}


def test_a_change_is_found_between_two_logged_steps_of_the_same_slot():
    found = mask_changes(LOGGED)
    assert found.changes == [MaskChange(1, 150, 200, 1, on=(1,), off=()),
                             MaskChange(1, 200, 300, 1, on=(0,), off=(1,))]
    assert found.last == {0: (250, (0, 1, 2)), 1: (300, (0, 2))}
    assert found.every == 50


def test_no_change_is_read_where_each_slot_keeps_its_mask():
    steady = {step: (slot, env, (1, 1, 1) if slot == 0 else (0, 0, 1)) for step, (slot, env, _) in LOGGED.items()}
    assert mask_changes(steady).changes == []


def a_run(path: Path) -> Path:
    """A run directory whose TensorBoard holds LOGGED as `vase train` logs it."""
    from torch.utils.tensorboard import SummaryWriter

    path.mkdir()
    cfg = build_config("cpu", ["data.sequence=moving_shapes_a,shapes_b,moving_shapes_b"])
    (path / "config.json").write_text(cfg.to_json())
    writer = SummaryWriter(str(path / "tb"))
    for step, (slot, env, mask) in LOGGED.items():
        writer.add_scalar("inference/assigned_env", slot, step)
        writer.add_scalar("inference/true_env", env, step)
        for n, m in enumerate(mask):
            writer.add_scalar(f"mask/z{n:02d}", float(m), step)
    writer.close()
    return path


def test_the_logged_masks_are_read_back_from_tensorboard(tmp_path):
    assert read_logged_masks(a_run(tmp_path / "run")) == LOGGED


def test_the_cli_lists_the_changes_and_refuses_a_run_without_tensorboard(tmp_path):
    run = a_run(tmp_path / "run")
    result = CliRunner().invoke(main, ["eval", str(run), "--mask-changes"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert "logged every 50 steps" in lines[0]
    assert lines[1].split() == ["slot", "1", "(shapes_b's", "batch)", "150", "->", "200", "on", "z1"]
    assert lines[2].split() == ["slot", "1", "(shapes_b's", "batch)", "200", "->", "300", "on", "z0;", "off", "z1"]
    assert lines[-2:] == ["  slot 0 at 250: z0 z1 z2", "  slot 1 at 300: z0 z2"]
    as_json = json.loads(CliRunner().invoke(main, ["eval", str(run), "--mask-changes", "--json"]).output)
    assert as_json["changes"][1]["off"] == [1]
    fails_in_one_line(CliRunner().invoke(main, ["eval", str(run), "--mask-changes", "--replay", "5"]),
                      "--replay and --mask-changes are separate readings")
    (tmp_path / "bare").mkdir()
    with pytest.raises(VaseError, match="tb not found"):
        read_logged_masks(tmp_path / "bare")


def test_steps_logged_after_a_resumed_checkpoint_are_dropped_without_a_warning(tmp_path, caplog):
    from torch.utils.tensorboard import SummaryWriter

    killed = SummaryWriter(str(tmp_path / "tb"))  # logged to step 10, its checkpoint kept at 5
    for step in range(1, 11):
        killed.add_scalar("loss/total", step, step)
    killed.close()
    resumed = SummaryWriter(str(tmp_path / "tb"), purge_step=6)
    for step in (6, 7):
        resumed.add_scalar("loss/total", 100 + step, step)
    resumed.close()
    with caplog.at_level(logging.WARNING):
        read = logged_scalars(tmp_path, lambda tag: True)
    assert read == {"loss/total": {1: 1.0, 2: 2.0, 3: 3.0, 4: 4.0, 5: 5.0, 6: 106.0, 7: 107.0}}
    assert not caplog.records
    assert not_a_purge not in logging.getLogger("tensorboard").filters


def test_only_the_notice_of_dropped_steps_is_held_back():
    def record(message: str) -> logging.LogRecord:
        return logging.LogRecord("tensorboard", logging.WARNING, __file__, 1, message, None, None)

    assert not not_a_purge(record("Detected out of order event.step likely caused by a TensorFlow restart."))
    assert not_a_purge(record("Found more than one graph event per run."))
