"""`vase table --curves`: probe readings side by side at chosen steps, from a run's history."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from test_cli import fails_in_one_line

from cli import main
from vase.checkpoint import save_checkpoint
from vase.config import build_config
from vase.errors import VaseError
from vase.probe_curves import curves_markdown, parse_steps

SEQUENCE = "moving_shapes_a,shapes_b,moving_shapes_a"
HISTORY = [
    (2, {"object_id/moving_shapes_a": 0.5334, "position_mse/moving_shapes_a": 0.00388, "object_id/shapes_b": 0.25}),
    (4, {"object_id/moving_shapes_a": 0.4, "position_mse/moving_shapes_a": 0.0121, "object_id/shapes_b": 0.875}),
]


def a_run(path: Path, reading: str = "sample", finished: bool = False) -> Path:
    """A run directory with its config and either a checkpoint or results.json holding HISTORY."""
    path.mkdir()
    cfg = build_config("cpu", [f"data.sequence={SEQUENCE}", f"probe.reading={reading}"])
    (path / "config.json").write_text(cfg.to_json())
    if finished:
        history = [{"step": step, "values": values} for step, values in HISTORY]
        (path / "results.json").write_text(json.dumps({"probes": {"history": history}}))
    else:
        save_checkpoint(path, {"probes": {"history": [[s, v] for s, v in HISTORY]}}, {"step": 4, "ablation": "-"})
    return path


@pytest.mark.parametrize("text, steps", [
    ("2000", [2000]),
    ("60000-68000:4000,90000", [60000, 64000, 68000, 90000]),
    ("0-10:4", [0, 4, 8]),
    ("8,2,2", [2, 8]),
])
def test_steps_are_read_as_numbers_and_ranges(text, steps):
    assert parse_steps(text) == steps


@pytest.mark.parametrize("text", ["", "a", "10-2:1", "0-10", "0-10:0", "-5"])
def test_bad_steps_are_refused(text):
    with pytest.raises(VaseError, match="bad steps"):
        parse_steps(text)


def test_each_cell_is_a_runs_identity_and_position_at_that_step(tmp_path):
    training, finished = a_run(tmp_path / "a"), a_run(tmp_path / "b", reading="mean", finished=True)
    text = curves_markdown([training, finished], [2, 3, 4])
    lines = text.splitlines()
    assert "a: moving_shapes_a; shapes_b (the paper's reading)" in lines[0]
    assert "b: moving_shapes_a; shapes_b (μ(x) of every latent)" in lines[0]
    assert lines[2] == "| step | a | b |"
    assert lines[4] == "| 2 | 53.3 / 38.8; 25.0 | 53.3 / 38.8; 25.0 |"
    assert lines[5] == "| 3 |  |  |"  # no probe point there
    assert lines[6] == "| 4 | 40.0 / 121.0; 87.5 | 40.0 / 121.0; 87.5 |"


def test_runs_of_one_name_are_told_apart_by_their_parent_folders(tmp_path):
    (tmp_path / "study").mkdir(), (tmp_path / "branch").mkdir()
    source, branch = a_run(tmp_path / "study" / "s2"), a_run(tmp_path / "branch" / "s2", reading="mean")
    other = a_run(tmp_path / "study" / "s0")
    lines = curves_markdown([source, branch, other], [2]).splitlines()
    assert lines[2] == "| step | study/s2 | branch/s2 | study/s0 |"
    assert "study/s2: moving_shapes_a; shapes_b (the paper's reading)" in lines[0]
    assert "branch/s2: moving_shapes_a; shapes_b (μ(x) of every latent)" in lines[0]
    # no parent folder where none is needed
    assert curves_markdown([other, source], [2]).splitlines()[2] == "| step | s0 | s2 |"


def test_envs_pick_the_readings_and_an_unknown_one_is_refused(tmp_path):
    run = a_run(tmp_path / "a")
    lines = curves_markdown([run], [4], ["shapes_b"]).splitlines()
    assert lines[0] == "Each cell: identity % / position MSE 1e-4 of shapes_b (the paper's reading)."
    assert lines[-1] == "| 4 | 87.5 |"
    with pytest.raises(VaseError, match="no environment mnist: its sequence is moving_shapes_a,shapes_b"):
        curves_markdown([run], [4], ["mnist"])


def test_steps_no_run_probed_at_are_refused_with_the_steps_it_did(tmp_path):
    with pytest.raises(VaseError, match="no run has a probe point at those steps; they probed at 2–4 every 2"):
        curves_markdown([a_run(tmp_path / "a")], [5, 7])


def test_the_cli_prints_the_table_and_refuses_what_does_not_go_with_it(tmp_path):
    run = a_run(tmp_path / "a")
    result = CliRunner().invoke(main, ["table", str(run), "--curves", "2-4:2", "--envs", "moving_shapes_a"])
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[-2:] == ["| 2 | 53.3 / 38.8 |", "| 4 | 40.0 / 121.0 |"]
    fails_in_one_line(CliRunner().invoke(main, ["table", str(run), "--envs", "shapes_b"]), "--envs goes with --curves")
    fails_in_one_line(CliRunner().invoke(main, ["table", str(run), "--curves", "2", "--json"]), "drop --json")
    fails_in_one_line(CliRunner().invoke(main, ["table", str(tmp_path), "--curves", "2"]), "config.json not found")
