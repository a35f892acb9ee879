"""train.flush_denormals: the CPU flushes denormal floats to zero, as the run's config says, and
`vase bench --run` times a run's own step both ways (docs/benchmarks.md)."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner
from test_cli import tiny_args

from cli import main
from vase.bench_run import optimiser_denormals, started_anew
from vase.config import build_config, load_run_config
from vase.device import configure_denormals
from vase.inspection import open_run

TINY = torch.finfo(torch.float32).tiny  # the smallest normal float32, 1.18e-38


@pytest.fixture(autouse=True)
def keeps_denormals_after():
    yield
    configure_denormals(False)  # the process's default, for the tests that follow


def squared(value: float) -> float:
    return (torch.tensor([value]) ** 2).item()


def test_flushing_turns_denormal_results_to_zero_and_leaves_normal_ones():
    configure_denormals(False)
    assert 0 < squared(1e-20) < TINY  # 1e-40: a denormal, kept
    configure_denormals(True)
    assert squared(1e-20) == 0.0
    assert squared(1e-18) == pytest.approx(1e-36)  # normal: unchanged


def test_a_new_run_flushes_and_a_run_made_before_the_setting_keeps_denormals(tmp_path):
    cfg = build_config("cpu")
    assert cfg.train.flush_denormals is True
    saved = json.loads(cfg.to_json())
    del saved["train"]["flush_denormals"]
    (tmp_path / "config.json").write_text(json.dumps(saved))
    assert load_run_config(tmp_path).train.flush_denormals is False


def invoke(args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


@pytest.mark.parametrize("flush", [True, False])
def test_a_run_computes_as_its_config_says(tmp_path, flush):
    configure_denormals(not flush)
    result = invoke(tiny_args(tmp_path / "run", tmp_path / "data", steps=2, train__flush_denormals=flush))
    assert result.exit_code == 0, result.output
    assert (squared(1e-20) == 0.0) is flush


def test_optimiser_denormals_counts_the_moments_below_the_smallest_normal_float():
    configure_denormals(False)
    adam = SimpleNamespace(state={"w": {"step": torch.tensor(3.0),
                                        "exp_avg": torch.tensor([1e-40, 1.0, 0.0, -1e-39]),
                                        "exp_avg_sq": torch.tensor([1e-30, 0.0])}})
    classifier = SimpleNamespace(state={"v": {"exp_avg": torch.tensor([2e-41])}})
    learner = SimpleNamespace(optimizer=adam, classifier_optimizer=classifier)
    assert optimiser_denormals(learner) == (5, 3)  # 5 nonzero moments, of which 1e-40, -1e-39 and 2e-41


def test_bench_run_times_a_runs_own_step_both_ways_and_leaves_the_run_alone(tmp_path):
    run = tmp_path / "run"
    assert invoke(tiny_args(run, tmp_path / "data", steps=2)).exit_code == 0
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    out = tmp_path / "bench.json"
    result = invoke(["bench", "--run", run, "--steps", 1, "--threads", 1, "--json-out", out])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["step"] == build_config("cpu", ["data.steps_per_env=2"]).data.total_steps()
    kept, flushed = data["median_step_s"]["kept"], data["median_step_s"]["flushed"]
    assert kept > 0 and flushed > 0 and data["speedup_from_flushing"] == pytest.approx(kept / flushed)
    assert 0 <= data["optimiser_state_denormal"] <= data["optimiser_state_nonzero"] > 0
    assert data["trained_over_anew"] is None  # the run has ended: a new run's step is not its step
    assert "flushed to zero" in result.output and "no comparison with the run started anew" in result.output
    assert squared(1e-20) == 0.0  # the process computes as the run does again
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


def test_a_run_in_its_first_environment_is_timed_against_its_config_started_anew(tmp_path):
    run = tmp_path / "run"
    args = tiny_args(run, tmp_path / "data", steps=4)
    assert invoke([*args, "--until", 2]).exit_code == 0
    evaluator = open_run(run)
    anew = started_anew(evaluator)
    assert evaluator.learner.step == 2 and anew.step == 0 and anew.cfg == evaluator.cfg
    assert not torch.equal(anew.model.encoder.fc.weight, evaluator.learner.model.encoder.fc.weight)
    out = tmp_path / "bench.json"
    result = invoke(["bench", "--run", run, "--steps", 1, "--threads", 1, "--json-out", out])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    times = data["median_step_s"]
    assert data["trained_over_anew"] == pytest.approx(times["flushed"] / times["anew"])  # the run flushes
    assert "started anew (step 0)" in result.output
