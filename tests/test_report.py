"""The markdown results of `vase table`, and docs/results.md and the README kept equal to them."""
import json
import math
from pathlib import Path

import pytest
from click.testing import CliRunner

from cli import main
from vase.errors import VaseError
from vase.report import (
    RESULTS_BEGIN,
    RESULTS_END,
    heldout_markdown,
    readme_block,
    readme_text,
    replace_block,
    results_page,
    table1_markdown,
)
from vase.table1 import heldout_retention, load_results, table1_rows, table1_text

ROOT = Path(__file__).resolve().parents[1]
PAPER = ["moving_fashion", "mnist", "moving_mnist"]


def _results(ablation: str, seed: int, sequence=PAPER, id_change=-0.02) -> dict:
    """A results.json with what the markdown reads: slot 0 for the first environment, slot 1 after."""
    return {
        "mode": "disentangled", "ablation": ablation, "sequence": list(sequence), "seed": seed,
        "pending_batches_train": False, "sync_at_allocation": False, "rule_names": [], "preset": "cpu",
        "steps_per_env": [200] * len(sequence), "dream_weights": [10.0, 1.0],
        "environments_inferred": 2, "environments_true": len(set(sequence)),
        "inferred_vs_true": [{"true_env": name, "inferred_env": min(i, 1)} for i, name in enumerate(sequence)],
        # [j][i]: environment i after stage j, under the classifier's pick.
        "heldout_reconstruction_matrix": [[100.0, 900.0, 800.0], [150.0, 200.0, 700.0], [160.0, 210.0, 300.0]],
        # [i][s]: environment i under slot s at the end.
        "cross_domain_errors": [[300.0, 500.0], [400.0, 250.0], [600.0, 280.0]],
        "probes": {"table1": {"object_id_max": 0.4, "object_id_change": id_change,
                              "position_min": 0.004, "position_change": -0.001}},
        "latent_use": [{"used_in_training": [0, 1], "informative": [0]}],
    }


def test_heldout_retention_reads_each_environment_under_its_own_slot():
    """After its stage: the matrix's diagonal; at the end: the cross-domain error under the slot it
    trained in; the last environment is left out, as Table 1's CHANGE leaves it out."""
    rows = heldout_retention(_results("SDA", 0))
    assert [(r["env"], r["after_stage"], r["end_own_slot"]) for r in rows] == [
        ("moving_fashion", 100.0, 300.0), ("mnist", 200.0, 250.0)]
    assert rows[0]["ratio"] == 3.0 and rows[1]["ratio"] == 1.25
    assert heldout_retention({"inferred_vs_true": []}) == []  # a results.json from before the matrices
    # Without the stage codes' reading, its columns are not measurable; with it, read per environment.
    assert all(math.isnan(r["end_stage_codes"]) and math.isnan(r["decoder_ratio"]) for r in rows)
    staged = heldout_retention({**_results("SDA", 0), "own_slot_errors_stage_codes": [150.0, None, 290.0]})
    assert staged[0]["end_stage_codes"] == 150.0 and staged[0]["decoder_ratio"] == 1.5
    assert math.isnan(staged[1]["end_stage_codes"])


def test_the_heldout_table_shows_the_stage_codes_where_a_run_has_them():
    with_codes = {**_results("SDA", 0), "own_slot_errors_stage_codes": [150.0, 210.0, 290.0]}
    text = heldout_markdown(table1_rows([with_codes, _results("-", 0)]))
    assert "| SDA | moving_fashion | 100.0 | 300.0 | 3.00 | 150.0 | 1.50 |" in text
    assert "| - | moving_fashion | 100.0 | 300.0 | 3.00 | n/a | n/a |" in text


def test_markdown_puts_the_papers_changes_beside_the_paper_sequence_only():
    rows = table1_rows([_results("-", 0), _results("SDA", 0, id_change=-0.01), _results("SDA", 1, id_change=-0.03),
                        _results("SDA", 0, sequence=["shapes_a", "shapes_b", "moving_shapes_b"])])
    text = table1_markdown(rows)
    lines = text.splitlines()
    sda = next(line for line in lines if line.startswith("| SDA | 0, 1 |"))
    assert "-2.0 (±1.0)" in sda and sda.endswith("| 2 / 2 of 3 | 2 / 2 | -5.4 / +3.0 |")
    # The paper's row order: "-" before SDA.
    assert lines.index(next(line for line in lines if line.startswith("| - |"))) < lines.index(sda)
    sprites = text.split("shapes_a → shapes_b → moving_shapes_b")[1]
    assert "paper" not in sprites and "| SDA | 0 |" in sprites


def test_a_snapshot_synced_only_at_allocations_is_a_row_of_its_own():
    """tau (eq. 7) at least the run's length: the snapshot is re-synced only when a slot is allocated,
    or never without dream.sync_at_allocation."""
    runs = [dict(_results("SDA", 0), snapshot_every=100), dict(_results("SDA", 1), snapshot_every=599),
            dict(_results("SDA", 0), snapshot_every=600, sync_at_allocation=True),
            dict(_results("-", 0), snapshot_every=600), dict(_results("SDA", 2), snapshot_every=600)]  # 3 x 200 steps
    labels = sorted((row["ablation"], tuple(row["seeds"])) for row in table1_rows(runs))
    assert labels == [("-", (0,)), ("SDA", (0, 1)), ("SDA (snapshot never re-synced)", (2,)),
                      ("SDA (snapshot synced at allocations only)", (0,))]


def test_a_snapshot_also_synced_at_allocations_is_a_row_of_its_own():
    """dream.sync_at_allocation on, or a results.json without it (made when every allocation re-synced
    the snapshot): a row of its own; the setting names no row without D and S."""
    unrecorded = {k: v for k, v in _results("SDA", 1).items() if k != "sync_at_allocation"}
    runs = [_results("SDA", 0), _results("SDA", 1), dict(_results("SDA", 0), sync_at_allocation=True), unrecorded,
            dict(_results("D", 0), sync_at_allocation=True), _results("-", 0)]
    labels = sorted((row["ablation"], tuple(row["seeds"])) for row in table1_rows(runs))
    assert labels == [("-", (0,)), ("D", (0,)), ("SDA", (0, 1)), ("SDA (snapshot also synced at allocations)", (0, 1))]


def test_runs_of_another_capacity_ramp_are_another_table():
    """Same rows, sequence and length, another C(t) ramp: two experiments, each table naming its ramp."""
    runs = [dict(_results("SDA", 0), capacity_ramp_steps=7200), dict(_results("SDA", 1), capacity_ramp_steps=7200),
            dict(_results("SDA", 0), capacity_ramp_steps=30000)]
    rows = table1_rows(runs)
    assert sorted((row["capacity_ramp_steps"], tuple(row["seeds"])) for row in rows) == [(7200, (0, 1)), (30000, (0,))]
    text = table1_markdown(rows)
    assert "capacity ramp 7200" in text and "capacity ramp 30000" in text
    assert "capacity ramp" not in table1_markdown(table1_rows([_results("SDA", 0)]))


def test_runs_of_another_capacity_max_are_another_table():
    """Same ramp, another C_max: two experiments, each table naming its C_max; a results.json that
    does not name C_max predates the field and ran at the default 25 nats, so it joins that table."""
    runs = [dict(_results("SDA", 0), capacity_ramp_steps=7200, capacity_max=25.0),
            dict(_results("SDA", 1), capacity_ramp_steps=7200, capacity_max=25.0),
            dict(_results("SDA", 0), capacity_ramp_steps=7200, capacity_max=50.0),
            dict(_results("SDA", 2), capacity_ramp_steps=7200)]
    rows = table1_rows(runs)
    assert sorted((row["capacity_max"], tuple(row["seeds"])) for row in rows) == [
        (25.0, (0, 1, 2)), (50.0, (0,))]
    text = table1_markdown(rows)
    assert "C_max 25 nats" in text and "C_max 50 nats" in text
    assert text.count("C_max") == 2 and text.count("capacity ramp 7200") == 2


def test_results_page_links_the_runs_and_the_readme_block_is_replaced(tmp_path):
    runs = []
    for seed in (0, 1):
        run = tmp_path / "docs" / "results" / "study" / f"s{seed}"
        run.mkdir(parents=True)
        (run / "results.json").write_text(json.dumps(_results("SDA", seed)))
        runs.append(run)
    rows = table1_rows(load_results(runs))
    page = results_page(rows, runs, tmp_path / "docs" / "results.md")
    assert "[results/study](results/study/) (2 runs)" in page
    assert "| SDA | moving_fashion | 100.0 (±0.0) | 300.0 (±0.0) | 3.00 (±0.00) |" in page
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n{RESULTS_BEGIN}\nold\n{RESULTS_END}\nafter\n")
    result = CliRunner().invoke(main, ["table", *map(str, runs), "--markdown", "--readme", str(readme)])
    assert result.exit_code == 0, result.output
    text = readme.read_text()
    assert "old" not in text and text.endswith(f"{RESULTS_END}\nafter\n")
    assert "[docs/results/study](docs/results/study/) (2 runs)" in text and "| SDA | 0, 1 |" in text


def test_a_readme_block_that_names_a_study_shows_that_study_alone(tmp_path):
    runs = []
    for study, ablation in (("old", "-"), ("long", "SDA")):
        run = tmp_path / "docs" / "results" / study / "s0"
        run.mkdir(parents=True)
        (run / "results.json").write_text(json.dumps(_results(ablation, 0)))
        runs.append(run)
    readme = tmp_path / "README.md"
    text = readme_text(f"# x\n<!-- results:begin docs/results/long -->\nold\n{RESULTS_END}\n", runs, readme)
    assert text.startswith("# x\n<!-- results:begin docs/results/long -->\n")  # the marker stays
    assert "| SDA | 0 |" in text and "| - |" not in text and "docs/results/old" not in text
    assert "| - |" in readme_text(f"{RESULTS_BEGIN}\n{RESULTS_END}\n", runs, readme)  # no study: every run
    with pytest.raises(VaseError, match="shows the study docs/results/gone, and no run given is in it"):
        readme_text(f"<!-- results:begin docs/results/gone -->\n{RESULTS_END}\n", runs, readme)


def test_replace_block_refuses_a_file_without_the_markers():
    with pytest.raises(VaseError, match="results:begin"):
        replace_block("no markers here", "table")
    with pytest.raises(VaseError):
        replace_block(f"{RESULTS_END}\n{RESULTS_BEGIN}\n", "table")


def test_docs_results_and_the_readme_block_are_what_the_committed_runs_give():
    """docs/results.md and the README's results block are generated: regenerate them with
    `vase table docs/results/*/* --markdown --output docs/results.md --readme README.md`."""
    runs = sorted(path for path in (ROOT / "docs" / "results").glob("*/*") if path.is_dir())
    assert runs, "no committed runs under docs/results/<study>/<run>/"
    rows = table1_rows(load_results(runs))
    assert (ROOT / "docs" / "results.md").read_text() == results_page(rows, runs, ROOT / "docs" / "results.md")
    readme = (ROOT / "README.md").read_text()
    assert readme == readme_text(readme, runs, ROOT / "README.md")


def test_committed_runs_are_small_and_have_no_checkpoints():
    """docs/results holds results.json files only, so a study's folder can be swapped whole."""
    for path in (ROOT / "docs" / "results").rglob("*"):
        if path.is_file():
            assert path.name == "results.json", path
            assert path.stat().st_size < 200_000, path


def test_the_readme_block_shows_the_papers_sequence_when_there_are_runs_of_it(tmp_path):
    rows = table1_rows([_results("SDA", 0), _results("SDA", 0, sequence=["shapes_a", "shapes_b", "moving_shapes_b"])])
    block = readme_block(rows, [tmp_path / "a"], tmp_path / "README.md")
    assert "moving_fashion → mnist → moving_mnist" in block and "shapes_b" not in block
    sprites_only = readme_block(rows[1:], [tmp_path / "a"], tmp_path / "README.md")
    assert "shapes_a → shapes_b → moving_shapes_b" in sprites_only


def _stages(names, slots) -> list[dict]:
    return [{"true_env": name, "inferred_env": slot} for name, slot in zip(names, slots)]


@pytest.mark.parametrize("names, slots, right", [
    (["a", "b", "a"], [0, 1, 0], True),  # a return re-identified
    (["a", "b", "a"], [0, 0, 1], False),  # b merged into a's slot, a's return given a new one: 2 of 2
    (["a", "b", "a"], [0, 1, 2], False),  # the return not re-identified
    (["a", "b", "c"], [0, 1, 2], True),
    (["a", "b", "c"], [0, 1, 1], False),  # c merged into b's slot
    (["a", "b", "c"], [2, 0, 1], True),  # slot numbers themselves do not matter
])
def test_stages_are_in_their_own_slots_when_names_and_slots_pair_one_to_one(names, slots, right):
    from vase.table1 import in_own_slots

    assert in_own_slots({"inferred_vs_true": _stages(names, slots)}) is right
    assert in_own_slots({}) is None  # a results.json without the record


def test_a_right_count_with_the_stages_in_wrong_slots_is_marked():
    recurring = ["moving_fashion", "moving_mnist", "moving_fashion"]
    wrong = {**_results("SDA", 0, sequence=recurring), "inferred_vs_true": _stages(recurring, [0, 0, 1])}
    right = {**_results("SDA", 1, sequence=recurring), "inferred_vs_true": _stages(recurring, [0, 1, 0])}
    text = table1_markdown(table1_rows([wrong, right]))
    assert "| 2* / 2 of 2 |" in text and "\\* the count of environments is right, but not every stage" in text
    # A count that is wrong already says so: no mark, and no note where nothing is marked.
    merged = {**_results("SDA", 0), "environments_inferred": 2,
              "inferred_vs_true": _stages(PAPER, [0, 1, 0])}
    text = table1_markdown(table1_rows([merged]))
    assert "| 2 of 3 |" in text and "*" not in text.split("environments inferred (of true)")[1]
    assert "2*/2" in table1_text(table1_rows([wrong, right]))
    assert "count of environments is right" in table1_text(table1_rows([wrong, right]))
    assert "*" not in table1_text(table1_rows([merged]))


def test_the_summary_says_whether_each_stage_trained_in_its_own_slot():
    from vase.summary import summary_text

    recurring = ["moving_fashion", "moving_mnist", "moving_fashion"]
    results = {"ablation": "SDA", "mode": "disentangled", "preset": "cpu", "steps": 1, "wall_time_s": 1.0,
               "environments_inferred": 2, "environments_true": 2,
               "inferred_vs_true": [{**row, "share": 1.0, "delay_steps": 0} for row in _stages(recurring, [0, 0, 1])]}
    line = summary_text(results, Path("run")).splitlines()[1]
    assert line == ("environments inferred: 2 (distinct true environments: 2; not every stage in its own "
                    "environment's slot)")
    results["inferred_vs_true"][1]["inferred_env"], results["inferred_vs_true"][2]["inferred_env"] = 1, 0
    assert summary_text(results, Path("run")).splitlines()[1].endswith("; each stage in its own environment's slot)")
