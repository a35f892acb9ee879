"""The `vase` command line end to end: train, eval, help, data list (issue 2).

Every training run here is tiny (a few dozen steps, 200 sprites per environment, probes on 50+50
images, one torch thread) and writes into tmp_path; the ones that train are marked slow.
"""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from cli import main
from vase import kernels
from vase.config import build_config
from vase.data.environments import ENVIRONMENT_NAMES

# Tiny settings for every CLI run: 20 steps per environment, probes every 10, a checkpoint every 5.
TINY = {
    "data.sprite_train_size": 200,
    "data.sprite_test_size": 100,
    "probe.train_size": 50,
    "probe.test_size": 50,
    "probe.every": 10,
    "train.batch_size": 16,
    "train.threads": 1,
    "train.checkpoint_every": 5,
    "train.log_every": 5,
    "train.image_every": 10,
    "dream.batch_size": 16,
    "dream.snapshot_every": 5,
    "inference.cooldown": 5,
    "inference.patience": 2,
}
STEPS = 20

RESULT_KEYS = {
    "ablation", "mode", "preset", "sequence", "steps_per_env", "seed", "steps", "wall_time_s",
    "environments_inferred", "environments_true", "inferred_vs_true", "inference_events", "pending_batches",
    "final_masks", "heldout_reconstruction_matrix", "cross_domain_errors", "latent_use", "disentanglement", "probes",
    "weight_gradients", "device", "rules", "rules_without", "rule_names", "capacity_form", "snapshot_every",
    "sync_at_allocation", "own_slot_errors_stage_codes", "dream_images", "capacity_max", "capacity_ramp_steps",
    "host", "branch",
}


def tiny_args(run_dir: Path, data_root: Path, steps: int = STEPS, **overrides) -> list[str]:
    """`vase train` arguments for a tiny run; keyword overrides use "section__field" names."""
    settings = TINY | {k.replace("__", "."): v for k, v in overrides.items()}
    args = ["train", "--steps", str(steps), "--run-dir", str(run_dir), "--data-root", str(data_root), "--no-progress"]
    for key, value in settings.items():
        args += ["--set", f"{key}={value}"]
    return args


def invoke(args: list[str]):
    return CliRunner().invoke(main, args, catch_exceptions=False)


def fails_in_one_line(result, *phrases: str) -> str:
    """Assert a clean CLI failure: non-zero exit, no traceback, an `Error:` line naming the problem."""
    assert result.exit_code != 0, result.output
    assert "Traceback" not in result.output
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, result.output
    for phrase in phrases:
        assert phrase in errors[0], (phrase, errors[0])
    return errors[0]


def scalar_and_image_tags(tb_dir: Path) -> tuple[set[str], set[str]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0, "images": 0})
    acc.Reload()
    tags = acc.Tags()
    return set(tags["scalars"]), set(tags["images"])


@pytest.fixture(scope="module")
def sprite_data(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("sprite_data")


@pytest.fixture(scope="module")
def sprite_run(tmp_path_factory, sprite_data):
    """One tiny full-VASE run on the default sprite sequence: (run_dir, CliRunner result)."""
    run = tmp_path_factory.mktemp("runs") / "sprites"
    result = invoke(tiny_args(run, sprite_data))
    return run, result


# -- help and data list (fast) ----------------------------------------------------------------------
def test_help_lists_every_command():
    result = invoke(["--help"])
    assert result.exit_code == 0
    for command in ("train", "grid", "eval", "table", "bench", "data"):
        assert command in result.output


def test_train_help_shows_the_options():
    result = invoke(["train", "--help"])
    assert result.exit_code == 0
    for option in ("--sequence", "--steps", "--ablation", "--resume", "--overwrite", "--set", "--data-root"):
        assert option in result.output


def test_console_script_is_installed():
    exe = shutil.which("vase")
    assert exe, "the `vase` console script is not on PATH (pip install -e .)"
    out = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "train" in out.stdout


def test_data_list_prints_every_environment():
    result = invoke(["data", "list"])
    assert result.exit_code == 0
    assert result.output.split() == list(ENVIRONMENT_NAMES)


# -- a real training run (slow) ----------------------------------------------------------------------
@pytest.mark.slow
def test_train_prints_the_summary_and_writes_the_run(sprite_run, sprite_data):
    run, result = sprite_run
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "environments inferred: " in out
    lines = out.splitlines()
    table = lines.index("Table 1 row:")
    assert lines[table + 2].strip().startswith("SDA")
    assert f"TensorBoard: tensorboard --logdir {run / 'tb'}" in out
    assert (run / "summary.txt").read_text().strip() == out.strip()

    config = json.loads((run / "config.json").read_text())
    assert config["ablation"] == "SDA" and config["version"] == 1
    assert config["data"]["steps_per_env"] == [STEPS] and config["data"]["root"] == str(sprite_data)
    assert config["train"]["batch_size"] == TINY["train.batch_size"]
    assert config["probe"]["every"] == TINY["probe.every"]

    results = json.loads((run / "results.json").read_text())
    assert RESULT_KEYS <= set(results)
    assert results["steps"] == 3 * STEPS
    assert (results["capacity_max"], results["capacity_ramp_steps"]) == (
        config["objective"]["capacity_max"], config["objective"]["capacity_ramp_steps"])
    assert results["weight_gradients"] == kernels.route("native", [32] * 4)  # the cpu preset: too narrow for it
    assert results["sequence"] == ["moving_shapes_a", "shapes_b", "moving_shapes_b"]
    assert results["host"]["torch"] == torch.__version__ and results["host"]["threads"] >= 1
    assert len(results["heldout_reconstruction_matrix"]) == 3
    # Fig. 4B as numbers: every environment under every slot. The end column of the matrix above is
    # read under the classifier's pick, so it must be one of that environment's per-slot errors.
    cross = results["cross_domain_errors"]
    assert len(cross) == 3 and all(len(row) == results["environments_inferred"] for row in cross)
    for row, picked in zip(cross, results["heldout_reconstruction_matrix"][-1]):
        assert min(abs(e - picked) for e in row) < 1e-9
    assert "under each slot at the end (cross-domain, Fig. 4B" in out
    probes = results["probes"]
    assert [h["step"] for h in probes["history"]] == list(range(10, 3 * STEPS + 1, 10))
    assert probes["boundaries"] == [STEPS, 2 * STEPS, 3 * STEPS]
    assert {"object_id_max", "object_id_change", "position_min", "position_change"} <= set(probes["table1"])


@pytest.mark.slow
def test_tensorboard_holds_scalars_and_images(sprite_run):
    run, result = sprite_run
    assert result.exit_code == 0, result.output
    scalars, images = scalar_and_image_tags(run / "tb")
    for tag in ("loss/total", "loss/reconstruction", "loss/kl", "loss/mdl", "capacity/C",
                "kl/z00", "atypicality/z00", "mask/z00"):
        assert tag in scalars, tag
    assert {"probe/object_id/moving_shapes_a", "probe/position_mse/moving_shapes_b"} <= scalars
    for env in ("moving_shapes_a", "shapes_b", "moving_shapes_b"):
        assert f"reconstruction/{env}" in images
        assert f"traversal/{env}" in images
    assert {
        "figures/latent_use",
        "figures/cross_domain",
        "figures/atypicality_profile",
        "figures/probe_curves",
    } <= images


@pytest.mark.slow
def test_eval_reproduces_the_training_probes_exactly(sprite_run):
    run, result = sprite_run
    assert result.exit_code == 0, result.output
    trained = json.loads((run / "results.json").read_text())["probes"]
    evaluated = invoke(["eval", str(run), "--json"])
    assert evaluated.exit_code == 0, evaluated.output
    recomputed = json.loads(evaluated.stdout)["probes"]
    assert recomputed["history"] == trained["history"]
    assert recomputed["table1"] == trained["table1"]
    table = invoke(["eval", str(run)])
    assert table.exit_code == 0 and "Table 1 row:" in table.stdout


@pytest.mark.slow
def test_eval_reads_a_run_the_papers_way_as_the_run_itself_would_have(sprite_run, sprite_data, tmp_path):
    """The probe reading leaves training untouched, so `vase eval --reading sample` of a run that read
    mu must give exactly what the same run trained with probe.reading=sample recorded."""
    run, result = sprite_run
    assert result.exit_code == 0, result.output
    sampled_run = tmp_path / "sampled"
    trained = invoke(tiny_args(sampled_run, sprite_data, probe__reading="sample"))
    assert trained.exit_code == 0, trained.output
    recorded = json.loads((sampled_run / "results.json").read_text())["probes"]
    evaluated = invoke(["eval", str(run), "--reading", "sample", "--json"])
    assert evaluated.exit_code == 0, evaluated.output
    recomputed = json.loads(evaluated.stdout)["probes"]
    assert recomputed["reading"] == recorded["reading"] == "sample"
    text = invoke(["eval", str(run), "--reading", "sample"]).stdout
    assert "the probes read posterior samples under the inferred slot (probe.reading=sample" in text
    assert recomputed["history"] == recorded["history"]
    assert recomputed["table1"] == recorded["table1"]
    mean = json.loads((run / "results.json").read_text())["probes"]["history"]
    assert recomputed["history"] != mean  # the two readings are not the same numbers
    back = invoke(["eval", str(sampled_run), "--reading", "mean", "--json"])
    assert json.loads(back.stdout)["probes"]["history"] == mean
    old = tmp_path / "old-run"  # as written before runs kept their slots
    shutil.copytree(run, old)
    shutil.rmtree(old / "checkpoints" / "slots")
    fails_in_one_line(CliRunner().invoke(main, ["eval", str(old), "--reading", "sample"]), "kept no slots of step 10")


@pytest.mark.slow
def test_eval_atypicality_reads_every_environment_under_each_saved_encoder(sprite_run):
    run, result = sprite_run
    assert result.exit_code == 0, result.output
    out = invoke(["eval", str(run), "--atypicality", "10,40", "--batches", "3", "--json"])
    assert out.exit_code == 0, out.output
    rows = json.loads(out.stdout)
    sequence = json.loads((run / "config.json").read_text())["data"]["sequence"]
    assert [(r["step"], r["environment"]) for r in rows] == [(s, e) for s in (10, 40) for e in sequence]
    for r in rows:
        q = r["top_alpha_quantiles"]
        assert 0 <= q["p10"] <= q["p50"] <= q["p90"]
        # A latent's mean over 3 batches is at most the mean of their tops, which is at most p90 of 3.
        assert len(r["mean_alpha"]) == 24 and max(r["mean_alpha"]) <= q["p90"] + 1e-6
        # The run kept its slots at every probe point: each batch has q_psi's pick among them.
        assert len(r["picks"]) == 3 and set(r["picks"]) <= set(range(len(r["information_by_slot"])))
    text = invoke(["eval", str(run), "--atypicality", "40"])
    assert text.exit_code == 0 and "lambda_high" in text.stdout
    missing = CliRunner().invoke(main, ["eval", str(run), "--atypicality", "15"])
    fails_in_one_line(missing, "no saved encoder of step 15")


@pytest.mark.slow
def test_eval_readouts_read_each_environments_identity_five_ways(sprite_run):
    run, result = sprite_run
    assert result.exit_code == 0, result.output
    out = invoke(["eval", str(run), "--readouts", "20", "--json"])
    assert out.exit_code == 0, out.output
    rows = json.loads(out.stdout)
    assert [r["environment"] for r in rows] == ["moving_shapes_a", "shapes_b", "moving_shapes_b"]
    for r in rows:  # 200 training sprites each (TINY): all of them, and the probe's 50 for the first read-out
        assert (r["step"], r["probe_images"], r["more_images"]) == (20, 50, 200)
        assert all(0.0 <= r[key] <= 1.0 for key in ("linear", "linear_more", "neighbours", "mlp", "hidden_linear"))
        assert len(r["nats"]) == 24 and min(r["nats"]) >= 0.0 and sum(r["nats"]) > 0.0
    for r in rows:  # position where the sprites move, within what a constant predictor scores (1/12)
        moving = r["environment"].startswith("moving")
        assert all((0.0 < r[key] < 0.1) if moving else r[key] is None for key in ("position_mu", "position_hidden"))
    text = invoke(["eval", str(run), "--readouts", "20"]).stdout
    assert "encoder saved at step 20" in text and "moving_shapes_b" in text
    fails_in_one_line(CliRunner().invoke(main, ["eval", str(run), "--readouts", "25"]), "no saved encoder of step 25")
    only = json.loads(invoke(["eval", str(run), "--readouts", "20", "--envs", "shapes_b", "--json"]).stdout)
    assert [r["environment"] for r in only] == ["shapes_b"] and only[0] == rows[1]  # the same probe sets
    fails_in_one_line(CliRunner().invoke(main, ["eval", str(run), "--readouts", "20", "--envs", "mnist"]),
                      "mnist not in the run's sequence")
    fails_in_one_line(CliRunner().invoke(main, ["eval", str(run), "--envs", "shapes_b"]), "--envs goes with --readouts")
    # cutting the channels dark under the same encoder cuts nothing that fires: the same read-outs
    same = json.loads(invoke(["eval", str(run), "--readouts", "20", "--envs", "shapes_b", "--cut-dark", "20",
                              "--json"]).stdout)[0]
    assert same.pop("dark_at") == 20 and 0 <= same.pop("cut_channels") <= 32
    assert same == {k: v for k, v in rows[1].items() if k not in ("dark_at", "cut_channels")}
    text = invoke(["eval", str(run), "--readouts", "20", "--envs", "shapes_b", "--cut-dark", "10"]).stdout
    assert "channels dark at step 10" in text and "shapes_b" in text
    fails_in_one_line(CliRunner().invoke(main, ["eval", str(run), "--readouts", "20", "--cut-dark", "25"]),
                      "no saved encoder of step 25")
    fails_in_one_line(CliRunner().invoke(main, ["eval", str(run), "--readouts", "20", "--classifier"]),
                      "separate readings")


@pytest.mark.slow
def test_eval_classifier_reads_q_psi_on_each_environment_and_on_each_slots_dreams(sprite_run):
    run, result = sprite_run
    assert result.exit_code == 0, result.output
    results = json.loads((run / "results.json").read_text())
    out = invoke(["eval", str(run), "--classifier", "--json"])
    assert out.exit_code == 0, out.output
    reading = json.loads(out.stdout)
    rows, slots = reading["picks"], results["environments_inferred"]
    assert reading["step"] == sum(results["steps_per_env"])
    assert [r["source"] for r in rows] == [*results["sequence"], *(f"dreams of slot {s}" for s in range(slots))]
    for r in rows:
        assert len(r["mean_q"]) == slots and 0 < sum(r["mean_q"]) <= 1 + 1e-3
        assert set(map(int, r["named"])) <= set(range(slots)) and sum(r["named"].values()) >= 1
    # Eq. 6's tests against every slot, batch for batch as q_psi's picks count them.
    assert [t["environment"] for t in reading["tests"]] == results["sequence"]
    for picks, tests in zip(rows, reading["tests"]):
        assert len(tests["passed"]) == slots and sum(tests["taken"].values()) == sum(picks["named"].values())
        assert sorted(tests["named"]) == sorted(int(s) for s, k in picks["named"].items() for _ in range(k))
    text = invoke(["eval", str(run), "--classifier"])
    assert text.exit_code == 0 and "dreams of slot 0" in text.stdout and "batches named" in text.stdout
    # An environment outside the sequence is read after the run's own, in both readings, and the
    # run's own rows are unchanged by it.
    # Names the sequence holds, or given twice, are read once.
    also = invoke(["eval", str(run), "--classifier", "--also", f"shapes_a,{results['sequence'][0]},shapes_a",
                   "--json"])
    assert also.exit_code == 0, also.output
    with_also = json.loads(also.stdout)
    sources = [r["source"] for r in with_also["picks"]]
    assert sources == [*results["sequence"], "shapes_a", *(f"dreams of slot {s}" for s in range(slots))]
    assert [t["environment"] for t in with_also["tests"]] == [*results["sequence"], "shapes_a"]
    assert [r for r in with_also["picks"] if r["source"] != "shapes_a"] == rows
    assert sum(with_also["picks"][len(results["sequence"])]["named"].values()) >= 1
    assert "eq. 6 takes" in text.stdout
    # The first stage's end is kept: read as it stood then, one slot.
    first = invoke(["eval", str(run), "--classifier", "--step", str(results["steps_per_env"][0]), "--json"])
    assert first.exit_code == 0, first.output
    assert json.loads(first.stdout)["step"] == results["steps_per_env"][0]
    refused = CliRunner().invoke(main, ["eval", str(run), "--classifier", "--own-slot", "10"])
    assert refused.exit_code != 0 and "give one at a time" in refused.output
    alone = CliRunner().invoke(main, ["eval", str(run), "--step", "10"])
    assert alone.exit_code != 0 and "--step goes with --classifier or --own-slot" in alone.output


def test_eval_also_names_known_environments_and_goes_with_classifier_only(tmp_path):
    (tmp_path / "config.json").write_text(build_config("cpu").to_json())
    unknown = CliRunner().invoke(main, ["eval", str(tmp_path), "--classifier", "--also", "fashion,svhn"])
    fails_in_one_line(unknown, "--also", "svhn", "known: ")
    alone = CliRunner().invoke(main, ["eval", str(tmp_path), "--also", "fashion"])
    fails_in_one_line(alone, "--also goes with --classifier")


def test_eval_classifier_refuses_a_run_trained_with_s_off_from_its_config_alone(tmp_path):
    # The config says there is no q_psi, so the refusal must come before any checkpoint is opened:
    # this run directory has none, and opening one would fail with another message.
    (tmp_path / "config.json").write_text(build_config("cpu", ablation="-").to_json())
    fails_in_one_line(CliRunner().invoke(main, ["eval", str(tmp_path), "--classifier"]), "trained with S off")


@pytest.mark.slow
def test_eval_recomputes_the_factor_latents_of_a_run_that_lacks_them(sprite_run, tmp_path):
    run, result = sprite_run
    assert result.exit_code == 0, result.output
    trained = [row["factor_latents"] for row in json.loads((run / "results.json").read_text())["latent_use"]]
    assert trained[0].keys() >= {"x", "y"}  # moving shapes A: its position factors, never the class
    old = tmp_path / "old-run"  # as written before the field existed
    shutil.copytree(run, old)
    results = json.loads((old / "results.json").read_text())
    for row in results["latent_use"]:
        del row["factor_latents"]
    (old / "results.json").write_text(json.dumps(results))
    evaluated = invoke(["eval", str(old), "--json"])
    assert evaluated.exit_code == 0, evaluated.output
    assert [row["factor_latents"] for row in json.loads(evaluated.stdout)["latent_use"]] == trained


@pytest.mark.slow
def test_eval_own_slot_decodes_each_saved_encoders_codes_with_the_last_decoders(sprite_run):
    run, result = sprite_run
    assert result.exit_code == 0, result.output
    results = json.loads((run / "results.json").read_text())
    out = invoke(["eval", str(run), "--own-slot", "20,60", "--json"])
    assert out.exit_code == 0, out.output
    rows = json.loads(out.stdout)
    stages = results["inferred_vs_true"]
    assert [(r["step"], r["environment"], r["slot"]) for r in rows] == [
        (s, e["true_env"], e["inferred_env"]) for s in (20, 60) for e in stages]
    # The encoder of the last step gives today's codes (up to channels_last's last digits), and the
    # end of the first stage gives the run's own reading of its stage codes.
    for r, own in zip(rows[3:], results["cross_domain_errors"]):
        assert r["error"] == pytest.approx(r["now"], rel=1e-5) and r["now"] == pytest.approx(own[r["slot"]], rel=1e-5)
    assert rows[0]["error"] == results["own_slot_errors_stage_codes"][0]
    # With the decoders kept at the first stage's end and that step's encoder: only the first
    # environment has been seen, and its error is the one recorded after its stage.
    first = results["steps_per_env"][0]
    then = invoke(["eval", str(run), "--own-slot", str(first), "--step", str(first), "--json"])
    assert then.exit_code == 0, then.output
    [row] = json.loads(then.stdout)
    assert (row["checkpoint_step"], row["environment"], row["slot"]) == (first, stages[0]["true_env"], 0)
    assert row["error"] == pytest.approx(row["now"], rel=1e-5)
    assert row["error"] == pytest.approx(results["heldout_reconstruction_matrix"][0][0], rel=1e-5)
    text = invoke(["eval", str(run), "--own-slot", "10"])
    assert text.exit_code == 0 and "moving_shapes_a (slot 0)" in text.stdout
    for args, message in ((["--own-slot", "15"], "no saved encoder of step 15"),
                          (["--own-slot", "ten"], "give steps as integers"),
                          (["--own-slot", "10", "--atypicality", "10"], "give one at a time")):
        fails_in_one_line(CliRunner().invoke(main, ["eval", str(run), *args]), message)


@pytest.mark.slow
def test_eval_own_slot_by_latent_splits_the_encoders_drift_over_the_latents(sprite_run):
    run, result = sprite_run
    assert result.exit_code == 0, result.output
    whole = json.loads(invoke(["eval", str(run), "--own-slot", "20,60", "--json"]).stdout)
    out = invoke(["eval", str(run), "--own-slot", "20,60", "--by-latent", "--json"])
    assert out.exit_code == 0, out.output
    rows = json.loads(out.stdout)
    assert [(r["step"], r["environment"], r["slot"]) for r in rows] == [
        (r["step"], r["environment"], r["slot"]) for r in whole]
    for r, w in zip(rows, whole):
        # The same two readings as --own-slot, from the older codes and from today's.
        assert r["error_then"] == pytest.approx(w["error"], rel=1e-6)
        assert r["error_now"] == pytest.approx(w["now"], rel=1e-5)
        assert [lat["latent"] for lat in r["latents"]] == list(range(24))
        for lat in r["latents"]:
            if lat["masked"]:  # the slot decodes a masked latent at the prior mean, whatever its code
                assert lat["nats"] == 0.0
            if r["step"] == 60:  # the last step's encoder gives today's codes: nothing moves
                assert abs(lat["nats"]) < 1e-3 and lat["rms_shift"] < 1e-4
                assert lat["correlation"] > 0.999 or lat["kl_now"] < 0.01
    # Somewhere over the run some latent's code moved and cost something.
    assert any(lat["nats"] > 0.1 for r in rows if r["step"] == 20 for lat in r["latents"])
    text = invoke(["eval", str(run), "--own-slot", "20", "--by-latent"])
    assert text.exit_code == 0 and "encoder 20, moving_shapes_a (slot 0)" in text.stdout and "+nats" in text.stdout
    refused = CliRunner().invoke(main, ["eval", str(run), "--by-latent"])
    assert refused.exit_code != 0 and "--by-latent goes with --own-slot" in refused.output


@pytest.mark.slow
def test_eval_rebuilds_the_stage_codes_reading_of_a_run_that_lacks_it(sprite_run, tmp_path):
    run, result = sprite_run
    assert result.exit_code == 0, result.output
    trained = json.loads((run / "results.json").read_text())["own_slot_errors_stage_codes"]
    assert len(trained) == 3 and all(e > 0 for e in trained)
    old = tmp_path / "old-run"  # as written before the reading existed
    shutil.copytree(run, old)
    results = json.loads((old / "results.json").read_text())
    del results["own_slot_errors_stage_codes"]
    (old / "results.json").write_text(json.dumps(results))
    evaluated = invoke(["eval", str(old), "--json"])
    assert evaluated.exit_code == 0, evaluated.output
    assert json.loads(evaluated.stdout)["own_slot_errors_stage_codes"] == trained


@pytest.mark.slow
def test_train_on_the_digit_sequence(digit_root, tmp_path):
    run = tmp_path / "digits"
    args = tiny_args(run, digit_root, steps=10, probe__every=10)
    args[1:1] = ["--sequence", "moving_fashion,mnist,moving_mnist"]
    result = invoke(args)
    assert result.exit_code == 0, result.output
    results = json.loads((run / "results.json").read_text())
    assert results["sequence"] == ["moving_fashion", "mnist", "moving_mnist"]
    assert results["steps"] == 30
    final = results["probes"]["history"][-1]["values"]
    assert {"object_id/moving_fashion", "object_id/mnist", "position_mse/moving_mnist"} <= set(final)
    assert "Table 1 row:" in result.stdout


def _fake_run(folder: Path, seed: int, ablation: str, table1: dict, used: list[list[int]]) -> Path:
    folder.mkdir()
    results = {"mode": "disentangled", "ablation": ablation, "sequence": ["moving_fashion", "mnist"], "seed": seed,
               "environments_inferred": 2, "probes": {"table1": table1},
               "latent_use": [{"used_in_training": u, "informative": u[:1]} for u in used]}
    (folder / "results.json").write_text(json.dumps(results))
    return folder


def test_table_averages_table1_over_seeds(tmp_path):
    """Two seeds of SDA: mean and population std in the paper's units; a NaN change is skipped."""
    a = _fake_run(tmp_path / "a", 0, "SDA", {"object_id_max": 0.40, "object_id_change": 0.01,
                                             "position_min": 0.004, "position_change": None}, [[0, 1], [1, 2]])
    b = _fake_run(tmp_path / "b", 1, "SDA", {"object_id_max": 0.50, "object_id_change": -0.03,
                                             "position_min": 0.006, "position_change": 0.001}, [[0], [5]])
    c = _fake_run(tmp_path / "c", 0, "-", {"object_id_max": 0.60, "object_id_change": -0.10,
                                           "position_min": 0.002, "position_change": 0.002}, [[0, 1, 2]])
    result = CliRunner().invoke(main, ["table", str(a), str(b), str(c)])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    sda = next(line for line in lines if line.strip().startswith("SDA"))
    assert "45.0 (±5.0) | -1.0 (±2.0) | 50.0 (±10.0) | +10.0 (±0.0) | 0,1 | 2/2 | 3/2 / 2/2" in sda
    plain = next(line for line in lines if line.strip().startswith("-"))
    assert "60.0 | -10.0 | 20.0 | +20.0 | 0 | 2 | 3 / 1" in plain
    rows = json.loads(CliRunner().invoke(main, ["table", "--json", str(a), str(b)]).output)
    assert rows[0]["seeds"] == [0, 1] and abs(rows[0]["mean"]["object_id_max"] - 0.45) < 1e-12


def test_table_refuses_a_folder_that_is_not_a_run(tmp_path):
    result = CliRunner().invoke(main, ["table", str(tmp_path)])
    assert result.exit_code != 0
    assert "results.json not found" in result.output


def test_table_names_runs_in_progress_and_keeps_them_from_the_committed_tables(tmp_path):
    """A run read before its end is a row of its own, with the step each seed reached; the committed
    results page and README block are never written from one."""
    from vase.table1 import table1_rows, table1_text

    table1 = {"object_id_max": 0.5, "object_id_change": -0.1, "position_min": 0.004, "position_change": 0.001}
    base = {"mode": "disentangled", "ablation": "SDA", "sequence": ["moving_fashion", "mnist"],
            "environments_inferred": 2, "probes": {"table1": table1}}
    runs = [base | {"seed": 0}, base | {"seed": 1, "in_progress": {"step": 7000, "steps": 24000}},
            base | {"seed": 2, "in_progress": {"step": 24000, "steps": 24000}}]  # read at its last step: finished
    rows = table1_rows(runs)
    assert [row["seeds"] for row in rows] == [[0, 2], [1]]
    assert rows[1]["ablation"] == rows[0]["ablation"][:-1] + ", in progress)"
    assert "  in progress: seed 1 at step 7,000 of 24,000 (MAX over the environments begun" in table1_text(rows)
    from vase.report import table1_markdown

    for row in rows:  # as results.json gives them
        row.update(preset=[None] * len(row["seeds"]), steps_per_env=[[12000, 12000]] * len(row["seeds"]))
    markdown = table1_markdown(rows)
    assert (f"In progress (MAX over the environments begun, CHANGE over the stages ended): {rows[1]['ablation']}: "
            "seed 1 at step 7,000 of 24,000.") in markdown
    assert markdown.count("In progress") == 1
    folder = _fake_run(tmp_path / "a", 0, "SDA", table1, [[0]])
    fails_in_one_line(CliRunner().invoke(main, ["table", "--in-progress", "--output", str(tmp_path / "r.md"),
                                                str(folder)]), "--output and --readme", "finished runs")


@pytest.mark.slow
def test_table_reads_a_run_in_progress_at_its_checkpoint(sprite_run, tmp_path):
    """Read at its last checkpoint, a run gives its own results.json's Table 1; read at the first
    stage's end, Table 1 covers the first environment alone (the others' MAX would be zero-shot)."""
    from vase.in_progress import is_in_progress, results_so_far
    from vase.table1 import row_label

    run, result = sprite_run
    assert result.exit_code == 0, result.output
    finished = json.loads((run / "results.json").read_text())
    copy = tmp_path / "in-progress"
    shutil.copytree(run, copy)
    (copy / "results.json").unlink()
    fails_in_one_line(CliRunner().invoke(main, ["table", str(copy)]), "results.json not found", "--in-progress")

    end = results_so_far(copy)
    assert end["probes"]["table1"] == finished["probes"]["table1"]
    assert end["inferred_vs_true"] == finished["inferred_vs_true"]
    assert end["environments_true"] == finished["environments_true"] == 3
    assert not is_in_progress(end) and row_label(end) == row_label(finished)
    printed = invoke(["table", "--in-progress", str(copy)])
    assert printed.exit_code == 0 and "in progress" not in printed.output

    first = results_so_far(copy, step=STEPS)
    assert first["in_progress"] == {"step": STEPS, "steps": 3 * STEPS} and is_in_progress(first)
    history = [h for h in finished["probes"]["history"] if h["step"] <= STEPS]
    assert first["probes"]["history"] == history
    table1 = first["probes"]["table1"]
    assert [c["env_index"] for c in table1["curves"]] == [0, 0]
    assert table1["object_id_max"] == max(h["values"]["object_id/moving_shapes_a"] for h in history)
    assert table1["position_min"] == min(h["values"]["position_mse/moving_shapes_a"] for h in history)
    assert table1["object_id_change"] is None and table1["position_change"] is None  # no reading after its end
    assert first["environments_true"] == 1 and len(first["inferred_vs_true"]) == 1
    assert row_label(first).endswith("in progress)")
