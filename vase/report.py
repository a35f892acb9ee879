"""Human-readable summaries of runs' results: what `vase train` and `vase eval` print for one run, and
the Table 1 that `vase table` gathers from several, as text or as the markdown of docs/results.md."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path


def _duration(seconds: float) -> str:
    m, s = divmod(int(round(seconds)), 60)
    return f"{m}m{s:02d}s"


def summary_text(results: dict, run_dir: Path) -> str:
    lines = [
        f"VASE run: ablation {results['ablation']} ({results['mode']}), preset {results['preset']}, "
        f"{results['steps']} steps in {_duration(results['wall_time_s'])}",
        f"environments inferred: {results['environments_inferred']} (distinct true environments: "
        f"{results['environments_true']})",
        f"  {'true environment':<18} {'inferred':>8} {'share':>6} {'delay':>7}",
    ]
    for row in results["inferred_vs_true"]:
        lines.append(
            f"  {row['true_env']:<18} {row['inferred_env']:>8} {row['share']:>6.2f} {row['delay_steps']:>7}"
        )
    matrix = results.get("heldout_reconstruction_matrix") or []
    if matrix:
        names = results["sequence"]
        lines.append("held-out reconstruction error (nats/image) of each environment after each stage:")
        lines.append("  " + " " * 18 + "".join(f"{'after ' + str(j + 1):>10}" for j in range(len(matrix))))
        for i, name in enumerate(names):
            lines.append(f"  {name:<18}" + "".join(f"{row[i]:>10.1f}" for row in matrix))
    cross = results.get("cross_domain_errors") or []
    if cross:
        lines.append("held-out reconstruction error (nats/image) of each environment under each slot at the end "
                     "(cross-domain, Fig. 4B; * the slot it trained under):")
        lines.append("  " + " " * 18 + "".join(f"{'slot ' + str(s):>10}" for s in range(len(cross[0]))))
        for env, row in zip(results["inferred_vs_true"], cross):
            cells = [f"{e:.1f}" + ("*" if env["inferred_env"] == s else " ") for s, e in enumerate(row)]
            lines.append(f"  {env['true_env']:<18}" + "".join(f"{c:>10}" for c in cells))
    use = results.get("latent_use") or []
    if use:
        n = len(use[0]["kl_per_latent"])
        used = latent_union(use, "used_in_training")
        heading = "latent use (information above inference.used_kl):"
        lines.append(heading if used is None
                     else f"{heading} {len(used)}/{n} latents used by some slot while it trained")
        readings = used_at_thresholds(use)
        if readings is not None:
            lines.append("  the same count at other thresholds (usage above "
                         + " / ".join(f"{t:g}" for t in readings) + " nat): "
                         + " / ".join(str(c) for c in readings.values()))
        informative = latent_union(use, "informative")
        if informative is not None:
            lines.append(
                f"  {len(informative)}/{n} latents carry information (KL minus atypicality above used_kl) "
                "in some environment's slot at the end"
            )
        for row in use:
            trained = f"used {row['used_in_training']}, " if "used_in_training" in row else ""
            info = f", informative {row['informative']}" if "informative" in row else ""
            lines.append(
                f"  {row['true_env']:<18} slot {row['slot']}: {trained}masked {row['masked']}; "
                f"active on its held-out images now: {len(row['active'])}/{n}{info}"
            )
            if row.get("factor_latents"):
                strongest = "; ".join(
                    f"{name} " + ", ".join(f"z{latent} {r:.2f}" for latent, r in pairs)
                    for name, pairs in row["factor_latents"].items()
                )
                lines.append(f"  {'':<18} strongest latents per factor (|r| of the posterior sample): {strongest}")
        # A slot can meet its capacity target with means shifted alike for every image: KL without
        # information (docs/method.md). With none informative, the representation of that
        # environment has collapsed, whatever the loss curve says; say so where it is read.
        empty = [row["true_env"] for row in use if row.get("informative") == []]
        if empty:
            lines.append(
                f"  warning: no latent carries information for {', '.join(empty)} at the end (posterior "
                "collapse: the slot's KL is shifted means, not information)"
            )
    probes = results.get("probes")
    if probes:
        from vase.metrics.continual import format_table1_row, table1_header

        final = probes["history"][-1]["values"] if probes.get("history") else {}
        if final:
            lines.append("final probes: " + ", ".join(f"{k} {v:.4f}" for k, v in sorted(final.items())))
        lines.append("Table 1 row:")
        lines.append("  " + table1_header())
        lines.append("  " + format_table1_row(probes["table1"], results["ablation"]))
    for boundary in results.get("disentanglement", []):
        for env, scores in boundary["scores"].items():
            lines.append(
                f"disentanglement after stage {boundary['stage'] + 1} on {env}: "
                + ", ".join(f"{k} {v:.3f}" for k, v in scores.items())
            )
    lines.append(f"results: {run_dir / 'results.json'}")
    lines.append(f"TensorBoard: tensorboard --logdir {run_dir / 'tb'}")
    return "\n".join(lines)


def load_results(run_dirs: list[Path]) -> list[dict]:
    """The results.json of each finished run, with a clear error for a folder that is not one."""
    from vase.errors import VaseError

    out = []
    for run_dir in run_dirs:
        path = Path(run_dir) / "results.json"
        try:
            out.append(json.loads(path.read_text()))
        except FileNotFoundError as e:
            raise VaseError(f"{path} not found: is {run_dir} a finished vase run?") from e
        except ValueError as e:
            raise VaseError(f"{path} is not valid JSON ({e})") from e
    return out


READINGS = {"mean": "μ(x)", "sample": "posterior samples under the inferred slot"}


def _reading(result: dict) -> str:
    """What the run's probes read: "mean" (mu of every latent) or "sample" (the paper's reading)."""
    return (result.get("probes") or {}).get("reading", "mean")


def row_label(result: dict) -> str:
    """A Table 1 row's name: the ablation, the rule set where inference runs with another than the
    default (`inference.rules`), and the capacity term where results.json says it was the absolute
    value rather than eq. 8's square (`objective.capacity_form`)."""
    rules = result.get("rules", "vase")
    notes = [f"{rules} rules"] if "S" in result["ablation"] and rules != "vase" else []
    if result.get("mode") != "entangled" and result.get("capacity_form") == "absolute":
        notes.append("absolute capacity term")
    return result["ablation"] + (f" ({', '.join(notes)})" if notes else "")


def table1_rows(results: list[dict]) -> list[dict]:
    """Table 1 from several runs: one row per (mode, ablation and rule set, sequence, preset, steps),
    the four numbers as mean and std over that group's seeds (docs/probes.md), and the latent-use counts per
    seed. Runs of another length or network are another experiment, so they never share a row."""
    from vase.metrics.continual import mean_std_over_seeds

    groups: dict[tuple, list[dict]] = {}
    for r in results:
        key = (r["mode"], row_label(r), ",".join(r["sequence"]), r.get("preset"), str(r.get("steps_per_env")),
               _reading(r))
        groups.setdefault(key, []).append(r)
    rows = []
    for (mode, ablation, sequence, _, _, reading), runs in groups.items():
        mean, std = mean_std_over_seeds([r["probes"]["table1"] for r in runs])
        rows.append({
            "mode": mode, "ablation": ablation, "sequence": sequence,
            "seeds": [r["seed"] for r in runs], "mean": mean, "std": std,
            "environments_inferred": [r["environments_inferred"] for r in runs],
            "environments_true": [r.get("environments_true") for r in runs],
            "latents_used": [_count(latent_union(r.get("latent_use") or [], "used_in_training")) for r in runs],
            "latents_informative": [_count(latent_union(r.get("latent_use") or [], "informative")) for r in runs],
            "preset": [r.get("preset") for r in runs],
            "reading": reading,
            "steps_per_env": [r.get("steps_per_env") for r in runs],
            "heldout": _heldout_over_seeds([heldout_retention(r) for r in runs]),
        })
    return rows


def heldout_retention(result: dict) -> list[dict]:
    """Each environment of the sequence but the last: its held-out reconstruction error (nats per
    image) just after its own stage, at the end under the slot it trained in, and their ratio.

    The ratio is how much of what that slot learnt it kept: the decoder's side of forgetting, which
    the probes (encoder only) do not see. After its stage the error is read under the classifier's
    pick, which is then that slot. The last environment is left out, as Table 1's CHANGE leaves it
    out: its two readings are taken at the same step. [] for results.json without the matrices."""
    matrix = result.get("heldout_reconstruction_matrix") or []
    cross = result.get("cross_domain_errors") or []
    rows = []
    for i, env in enumerate((result.get("inferred_vs_true") or [])[:-1]):
        if i >= len(matrix) or i >= len(cross):
            break
        after, end = matrix[i][i], cross[i][env["inferred_env"]]
        rows.append({"env": env["true_env"], "after_stage": after, "end_own_slot": end,
                     "ratio": end / after if after > 0 else math.nan})
    return rows


def _heldout_over_seeds(per_run: list[list[dict]]) -> list[dict]:
    """heldout_retention of several seeds of one sequence: mean and std of each number per stage."""
    from vase.metrics.continual import nanmean, nanstd

    out = []
    for stage in zip(*per_run):
        row = {"env": stage[0]["env"]}
        for key in ("after_stage", "end_own_slot", "ratio"):
            values = [r[key] for r in stage]
            row[key] = {"mean": nanmean(values), "std": nanstd(values)}
        out.append(row)
    return out


def latent_union(use: list[dict], field: str) -> list[int] | None:
    """The latents listed under `field` in any slot's latent-use row; None when some row lacks the
    field (results.json of runs from older versions) or there are no rows."""
    if not use or not all(field in row for row in use):
        return None
    return sorted({z for row in use for z in row[field]})


# Thresholds (nats of information) at which the summary also counts the latents used. Eq. 5's
# "spare" latent is one with q(z_n|x) = p(z_n); the paper does not say how it counts its 8 of 24,
# and a latent carrying 0.2 nat is a different thing from one carrying 3, so one reading hides how
# much of the count is weak use.
USAGE_READINGS = (0.1, 0.25, 0.5, 1.0)


def used_at_thresholds(use: list[dict]) -> dict[float, int] | None:
    """How many latents some slot used while it trained (its running usage, `usage_per_latent`),
    counted above each of USAGE_READINGS; None for results.json of runs from older versions."""
    if not use or not all("usage_per_latent" in row for row in use):
        return None
    peak = [max(col) for col in zip(*(row["usage_per_latent"] for row in use))]
    return {t: sum(u > t for u in peak) for t in USAGE_READINGS}


def _count(latents: list[int] | None) -> int | None:
    return None if latents is None else len(latents)


def table1_text(rows: list[dict]) -> str:
    from vase.metrics.continual import format_table1_row, table1_header

    lines = []
    for mode, sequence in sorted({(row["mode"], row["sequence"]) for row in rows}):
        lines.append(f"{mode}, {sequence}:")
        lines.append("  " + table1_header() + " | seeds | envs inferred | latents used / informative")
        for row in (r for r in rows if (r["mode"], r["sequence"]) == (mode, sequence)):
            single = len(row["seeds"]) == 1
            cells = format_table1_row(row["mean"], row["ablation"], None if single else row["std"])
            used = "/".join("?" if n is None else str(n) for n in row["latents_used"])
            info = "/".join("?" if n is None else str(n) for n in row["latents_informative"])
            envs = "/".join(str(n) for n in row["environments_inferred"])
            lines.append(f"  {cells} | {','.join(map(str, row['seeds']))} | {envs} | {used} / {info}")
            if len(set(row["seeds"])) < len(row["seeds"]):
                lines.append(f"  note: {row['ablation']} has repeated seeds; are two runs the same experiment?")
    lines.append("mean (±std) over seeds; per-seed values are separated by '/'")
    return "\n".join(lines)


# The paper's Table 1 CHANGE columns (moving Fashion -> MNIST -> moving MNIST, mean over its seeds):
# object-ID accuracy (%) and position MSE (1e-4) per (mode, row). It reports no disentangled SD-[41].
PAPER_CHANGES = {
    ("disentangled", "-"): (-15.2, 24.8), ("disentangled", "S"): (-13.9, 22.5),
    ("disentangled", "D"): (-14.4, 21.4), ("disentangled", "A"): (-24.5, 67.6),
    ("disentangled", "SA"): (-28.1, 78.9), ("disentangled", "DA"): (-25.2, 72.2),
    ("disentangled", "SD"): (-12.9, 20.0), ("disentangled", "SDA"): (-5.4, 3.0),
    ("entangled", "-"): (-12.1, 10.5), ("entangled", "S"): (-12.2, 10.9),
    ("entangled", "D"): (-12.4, 11.7), ("entangled", "A"): (-19.7, 47.1),
    ("entangled", "SA"): (-18.3, 41.8), ("entangled", "DA"): (-19.4, 40.2),
    ("entangled", "SD"): (-11.7, 11.6), ("entangled", "SD-[41]"): (-11.6, 10.2),
    ("entangled", "SDA"): (-6.5, 3.9),
}

# The markers between which `vase table --readme` rewrites a file's results block.
RESULTS_BEGIN = "<!-- results:begin -->"
RESULTS_END = "<!-- results:end -->"
# How docs/results.md and the README's block are made; both say so, and a test holds them to it.
REGENERATE = "vase table docs/results/*/* --markdown --output docs/results.md --readme README.md"


def _md_row(cells: list) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _groups(rows: list[dict]) -> list[tuple[str, str, list[dict]]]:
    """(mode, sequence, its rows in the paper's row order) for each objective and sequence."""
    from vase.grid import TABLE1_ROWS

    order = {name: i for i, name in enumerate(TABLE1_ROWS)}
    def key(row):  # one table per objective, sequence, length and probe reading: each another experiment
        return row["mode"], row["sequence"], str(row["steps_per_env"][0]), row.get("reading", "mean")

    keys = sorted({key(row) for row in rows})
    return [(k[0], k[1], sorted((r for r in rows if key(r) == k),
                                key=lambda r: order.get(r["ablation"].split(" ")[0], len(order))))
            for k in keys]


def _heading(mode: str, sequence: str) -> str:
    return f"**{mode}, {sequence.replace(',', ' → ')}**"


def _per_seed(values: list) -> str:
    return " / ".join("?" if v is None else str(v) for v in values)


def _settings(group: list[dict]) -> str:
    presets = sorted({p for row in group for p in row["preset"] if p})
    steps = sorted({str(s[0]) if len(set(s)) == 1 else ",".join(map(str, s))
                    for row in group for s in row["steps_per_env"] if s})
    readings = sorted({row.get("reading", "mean") for row in group})
    parts = ([f"preset {', '.join(presets)}"] if presets else []) + (
        [f"steps per environment {'; '.join(steps)}"] if steps else []) + (
        ["probes read " + " and ".join(READINGS[r] for r in readings)])
    return ", ".join(parts)


def table1_markdown(rows: list[dict]) -> str:
    """Table 1 as markdown, one table per objective and sequence: the four numbers as mean (±std)
    over seeds, environments inferred and latents used per seed, and the paper's CHANGE columns
    beside them on the paper's sequence."""
    from vase.grid import PAPER_SEQUENCE
    from vase.metrics.continual import format_table1_row, table1_header

    out = []
    for mode, sequence, group in _groups(rows):
        paper = sequence == PAPER_SEQUENCE
        out.append(f"{_heading(mode, sequence)} ({_settings(group)})")
        out.append("")
        header = [c.strip() for c in table1_header().split(" | ")]
        header = ["row", "seeds"] + header[1:] + ["environments inferred (of true)", "latents used"]
        out.append(_md_row(header + (["paper: ID CHANGE (%) / POS CHANGE (1e-4)"] if paper else [])))
        out.append(_md_row(["---"] * (len(header) + paper)))
        for row in group:
            single = len(row["seeds"]) == 1
            cells = [c.strip() for c in format_table1_row(row["mean"], row["ablation"],
                                                          None if single else row["std"]).split(" | ")]
            true = {t for t in row["environments_true"] if t is not None}
            inferred = _per_seed(row["environments_inferred"]) + (f" of {true.pop()}" if len(true) == 1 else "")
            line = [cells[0], ", ".join(map(str, row["seeds"]))] + cells[1:] + [inferred,
                                                                                _per_seed(row["latents_used"])]
            if paper:
                change = PAPER_CHANGES.get((mode, row["ablation"]))
                line.append("n/a" if change is None else f"{change[0]:+.1f} / {change[1]:+.1f}")
            out.append(_md_row(line))
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def heldout_markdown(rows: list[dict]) -> str:
    """Per objective and sequence, each environment's held-out error after its stage and at the end
    under its own slot (heldout_retention), mean (±std) over seeds."""
    def cell(stat: dict, spec: str, single: bool) -> str:
        if math.isnan(stat["mean"]):
            return "n/a"
        return f"{stat['mean']:{spec}}" + ("" if single else f" (±{stat['std']:{spec}})")

    out = []
    for mode, sequence, group in _groups(rows):
        lines = [_md_row(["row", "environment", "after its stage (nats)", "at the end, own slot (nats)",
                          "end ÷ after"]), _md_row(["---"] * 5)]
        for row in group:
            single = len(row["seeds"]) == 1
            for env in row["heldout"]:
                lines.append(_md_row([row["ablation"], env["env"], cell(env["after_stage"], ".1f", single),
                                      cell(env["end_own_slot"], ".1f", single), cell(env["ratio"], ".2f", single)]))
        if len(lines) > 2:
            out += [_heading(mode, sequence), ""] + lines + [""]
    return "\n".join(out).rstrip() + "\n" if out else ""


def _sources(run_dirs: list[Path], base: Path) -> str:
    """The folders the runs came from, as links relative to the page that lists them."""
    counts: dict[Path, int] = {}
    for run_dir in run_dirs:
        folder = Path(run_dir).resolve().parent
        counts[folder] = counts.get(folder, 0) + 1
    links = [f"[{rel}]({rel}/) ({n} run{'s' if n > 1 else ''})"
             for folder, n in sorted(counts.items())
             for rel in [Path(os.path.relpath(folder, base.resolve())).as_posix()]]
    return ", ".join(links)


def results_page(rows: list[dict], run_dirs: list[Path], page: Path) -> str:
    """docs/results.md: Table 1 and the held-out errors of the given runs, with where they came from."""
    parts = [
        "# Results",
        "",
        f"<!-- Generated by `{REGENERATE}` from the runs' results.json; edit those or vase/report.py, "
        "not this page. -->",
        "",
        f"Runs: {_sources(run_dirs, page.parent)}. To show other runs, put their `results.json` under "
        f"`docs/results/<study>/<run>/` and run `{REGENERATE}`.",
        "",
        "## Table 1",
        "",
        "Mean (±std) over the seeds listed, in the paper's units: object-ID accuracy in %, position MSE "
        "in 1e-4 (the protocol and the sign of CHANGE are in [probes.md](probes.md)). A negative ID "
        "CHANGE and a positive POS CHANGE mean forgetting. Latents used: latents some slot used while "
        "it trained (information above `inference.used_kl`), per seed.",
        "",
        table1_markdown(rows).rstrip(),
        "",
    ]
    heldout = heldout_markdown(rows)
    if heldout:
        parts += [
            "## Held-out reconstruction under each environment's own slot",
            "",
            "What the decoder kept, which the probes (read from the encoder) do not show: each "
            "environment's held-out error in nats per image just after its own stage and at the end of "
            "the sequence under the slot it trained in, and their ratio (1 = nothing forgotten). The "
            "last environment of a sequence is left out, as in Table 1's CHANGE.",
            "",
            heldout.rstrip(),
            "",
        ]
    return "\n".join(parts)


def readme_block(rows: list[dict], run_dirs: list[Path], readme: Path) -> str:
    """The README's results block: one Table 1, the paper's sequence where there are runs of it
    (every sequence otherwise), with the command that makes it. docs/results.md has the rest."""
    from vase.grid import PAPER_SEQUENCE

    paper = [row for row in rows if row["sequence"] == PAPER_SEQUENCE]
    return "\n".join([
        f"Made by `{REGENERATE}` from {_sources(run_dirs, readme.parent)}; "
        "[docs/results.md](docs/results.md) has every study and the held-out errors.",
        "",
        table1_markdown(paper or rows).rstrip(),
    ])


def replace_block(text: str, block: str) -> str:
    """`text` with what lies between RESULTS_BEGIN and RESULTS_END replaced by `block`."""
    from vase.errors import VaseError

    if text.count(RESULTS_BEGIN) != 1 or text.count(RESULTS_END) != 1 or (
            text.index(RESULTS_BEGIN) > text.index(RESULTS_END)):
        raise VaseError(f"the file needs one {RESULTS_BEGIN} line followed by one {RESULTS_END} line")
    head, rest = text.split(RESULTS_BEGIN, 1)
    tail = rest.split(RESULTS_END, 1)[1]
    return f"{head}{RESULTS_BEGIN}\n\n{block.strip()}\n\n{RESULTS_END}{tail}"
