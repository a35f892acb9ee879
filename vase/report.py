"""The generated results pages: Table 1 and the held-out errors as markdown, docs/results.md and
the README's results block (`vase table --markdown --output --readme`)."""
from __future__ import annotations

import math
import os
import re
from pathlib import Path

READINGS = {"mean": "μ(x)", "sample": "posterior samples under the inferred slot"}


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

# The markers between which `vase table --readme` rewrites a file's results block. The opening one
# may name a study folder, relative to the file: the block then shows that study's runs alone.
RESULTS_BEGIN = "<!-- results:begin -->"
RESULTS_END = "<!-- results:end -->"
_BEGIN = re.compile(r"<!-- results:begin(?: (\S+))? -->")
# How docs/results.md and the README's block are made; both say so, and a test holds them to it.
REGENERATE = "vase table docs/results/*/* --markdown --output docs/results.md --readme README.md"


def _md_row(cells: list) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _groups(rows: list[dict]) -> list[tuple[str, str, list[dict]]]:
    """(mode, sequence, its rows in the paper's row order) for each objective and sequence."""
    from vase.grid import TABLE1_ROWS

    order = {name: i for i, name in enumerate(TABLE1_ROWS)}
    def key(row):  # one table per objective, sequence, length, capacity schedule and reading: each another experiment
        return (row["mode"], row["sequence"], str(row["steps_per_env"][0]), row.get("reading", "mean"),
                row.get("capacity_ramp_steps") or 0, row.get("capacity_max") or 0)

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
    ramps = sorted({row["capacity_ramp_steps"] for row in group if row.get("capacity_ramp_steps")})
    maxima = sorted({row["capacity_max"] for row in group if row.get("capacity_max")})
    parts = ([f"preset {', '.join(presets)}"] if presets else []) + (
        [f"steps per environment {'; '.join(steps)}"] if steps else []) + (
        [f"capacity ramp {'; '.join(map(str, ramps))}"] if ramps else []) + (
        [f"C_max {'; '.join(f'{c:g}' for c in maxima)} nats"] if maxima else []) + (
        ["probes read " + " and ".join(READINGS[r] for r in readings)])
    return ", ".join(parts)


def table1_markdown(rows: list[dict]) -> str:
    """Table 1 as markdown, one table per objective and sequence: the four numbers as mean (±std)
    over seeds, environments inferred and latents used per seed, and the paper's CHANGE columns
    beside them on the paper's sequence."""
    from vase.grid import PAPER_SEQUENCE
    from vase.metrics.continual import format_table1_row, table1_header
    from vase.table1 import IN_PROGRESS_COVERS, WRONG_SLOTS_NOTE, environment_counts, in_progress_note

    out = []
    for mode, sequence, group in _groups(rows):
        paper = sequence == PAPER_SEQUENCE
        out.append(f"{_heading(mode, sequence)} ({_settings(group)})")
        out.append("")
        header = [c.strip() for c in table1_header().split(" | ")]
        header = ["row", "seeds"] + header[1:] + ["environments inferred (of true)", "latents used"]
        out.append(_md_row(header + (["paper: ID CHANGE (%) / POS CHANGE (1e-4)"] if paper else [])))
        out.append(_md_row(["---"] * (len(header) + paper)))
        marked = False
        for row in group:
            single = len(row["seeds"]) == 1
            cells = [c.strip() for c in format_table1_row(row["mean"], row["ablation"],
                                                          None if single else row["std"]).split(" | ")]
            true = {t for t in row["environments_true"] if t is not None}
            counts = environment_counts(row)
            marked = marked or any(c.endswith("*") for c in counts)
            inferred = " / ".join(counts) + (f" of {true.pop()}" if len(true) == 1 else "")
            line = [cells[0], ", ".join(map(str, row["seeds"]))] + cells[1:] + [inferred,
                                                                                _per_seed(row["latents_used"])]
            if paper:
                change = PAPER_CHANGES.get((mode, row["ablation"]))
                line.append("n/a" if change is None else f"{change[0]:+.1f} / {change[1]:+.1f}")
            out.append(_md_row(line))
        if marked:
            out += ["", "\\" + WRONG_SLOTS_NOTE]
        notes = [f"{row['ablation']}: {note}" for row in group if (note := in_progress_note(row))]
        if notes:
            out += ["", f"In progress ({IN_PROGRESS_COVERS}): " + "; ".join(notes) + "."]
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def heldout_markdown(rows: list[dict]) -> str:
    """Per objective and sequence, each environment's held-out error after its stage and at the end
    under its own slot, from today's codes and from its stage's (heldout_retention), mean (±std)
    over seeds."""
    def cell(stat: dict, spec: str, single: bool) -> str:
        if math.isnan(stat["mean"]):
            return "n/a"
        return f"{stat['mean']:{spec}}" + ("" if single else f" (±{stat['std']:{spec}})")

    out = []
    for mode, sequence, group in _groups(rows):
        lines = [_md_row(["row", "environment", "after its stage (nats)", "at the end, own slot (nats)",
                          "end ÷ after", "at the end from its stage's codes (nats)", "÷ after"]),
                 _md_row(["---"] * 7)]
        for row in group:
            single = len(row["seeds"]) == 1
            for env in row["heldout"]:
                lines.append(_md_row([row["ablation"], env["env"]] + [
                    cell(env[key], spec, single) for key, spec in (
                        ("after_stage", ".1f"), ("end_own_slot", ".1f"), ("ratio", ".2f"),
                        ("end_stage_codes", ".1f"), ("decoder_ratio", ".2f"))]))
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
            "Whether each environment can still be read back through its own slot: its held-out error "
            "in nats per image just after its own stage and at the end of the sequence under the slot it "
            "trained in, and their ratio (1 = nothing forgotten). The last two columns decode, at the end, "
            "the codes the encoder gave the same images at the end of their stage: what the slot's "
            "decoder and mask lost. The rest of the first ratio is the shared encoder's drift on the "
            "environment's real images ([regime.md](regime.md#the-slot-or-the-shared-encoder)); n/a where a "
            "run's results.json lacks that reading. The last environment of a sequence is left out, as in Table 1's "
            "CHANGE.",
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


def markdown_tables(rows: list[dict]) -> str:
    """What `vase table --markdown` prints: Table 1 and the held-out errors."""
    return table1_markdown(rows) + "\n" + heldout_markdown(rows)


def readme_text(text: str, run_dirs: list[Path], readme: Path) -> str:
    """The file `readme`'s `text` with its results block made from these runs (`readme_block`), or
    from those under the study folder its opening marker names."""
    from vase.errors import VaseError
    from vase.table1 import load_results, table1_rows

    found = _BEGIN.search(text)
    if found and found.group(1):
        study = (readme.parent / found.group(1)).resolve()
        run_dirs = [d for d in run_dirs if study in Path(d).resolve().parents]
        if not run_dirs:
            raise VaseError(f"{readme}'s results block shows the study {found.group(1)}, and no run given is in it")
    return replace_block(text, readme_block(table1_rows(load_results(run_dirs)), run_dirs, readme))


def rewrite_readme(readme: Path, run_dirs: list[Path]) -> None:
    """Replace the results block of the file `readme` (`readme_text`)."""
    readme.write_text(readme_text(readme.read_text(), run_dirs, readme))


def replace_block(text: str, block: str) -> str:
    """`text` with what lies between its opening marker (RESULTS_BEGIN, or one naming a study) and
    RESULTS_END replaced by `block`."""
    from vase.errors import VaseError

    begins = list(_BEGIN.finditer(text))
    if len(begins) != 1 or text.count(RESULTS_END) != 1 or begins[0].start() > text.index(RESULTS_END):
        raise VaseError(f"the file needs one {RESULTS_BEGIN} line followed by one {RESULTS_END} line")
    head, tail = text[:begins[0].end()], text[begins[0].end():].split(RESULTS_END, 1)[1]
    return f"{head}\n\n{block.strip()}\n\n{RESULTS_END}{tail}"
