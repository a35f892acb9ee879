"""Table 1 from several finished runs: their results.json grouped into rows, mean and std over seeds.

`vase table` and `vase grid` print it as text (`table1_text`); `vase.report` writes it as markdown.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from vase.config_migrations import C_MAX_BEFORE_RECORDED, EQ8_DREAM_WEIGHTS
from vase.config_sections import DreamConfig, ObjectiveConfig
from vase.in_progress import is_in_progress
from vase.rules import RULES
from vase.summary import latent_union


def load_results(run_dirs: list[Path], in_progress: bool = False, device="cpu") -> list[dict]:
    """The results.json of each finished run, with a clear error for a folder that is not one; with
    `in_progress`, a run still training is read at its newest checkpoint (`vase.in_progress`)."""
    from vase.checkpoint import has_checkpoint
    from vase.errors import VaseError
    from vase.in_progress import results_so_far

    out = []
    for run_dir in run_dirs:
        path = Path(run_dir) / "results.json"
        if in_progress and not path.exists() and has_checkpoint(Path(run_dir)):
            out.append(results_so_far(Path(run_dir), device=device))
            continue
        try:
            out.append(json.loads(path.read_text()))
        except FileNotFoundError as e:
            hint = "" if in_progress or not has_checkpoint(Path(run_dir)) else \
                " It has checkpoints: --in-progress reads a run still training at its newest."
            raise VaseError(f"{path} not found: is {run_dir} a finished vase run?{hint}") from e
        except ValueError as e:
            raise VaseError(f"{path} is not valid JSON ({e})") from e
    return out


def probe_reading(result: dict) -> str:
    """What the run's probes read: "mean" (mu of every latent) or "sample" (the paper's reading)."""
    return (result.get("probes") or {}).get("reading", "mean")


OWN_RAMP = "own_capacity_ramp"


def own_ramp_used(result: dict) -> bool:
    """Whether the rule own_capacity_ramp set a new environment's capacity target in the run: S on,
    the capacity objective, the rule in the run's set and a ramp (`objective.new_env_ramp_steps`, 0
    in the short and long schedules). results.json records the ramp; one written before it did and
    before it recorded `rule_names` comes from a vase whose set held the rule with a ramp on by
    default, and one with `rule_names` but no ramp from a vase that did not have the rule."""
    if "S" not in result["ablation"] or result.get("mode") == "entangled":
        return False
    if "new_env_ramp_steps" in result:
        return result["new_env_ramp_steps"] > 0 and OWN_RAMP in result.get("rule_names", [])
    if "rule_names" in result:
        return False
    return result.get("rules", "vase") == "vase" and OWN_RAMP not in result.get("rules_without", [])


# Deleted rules that acted only through a setting an older results.json records as on or off: rule
# -> (that field, the note a row with S takes where it was on). In a run's set with the setting off
# they changed nothing, so the row is not named "with" them.
NAMED_BY_SETTING = {"balanced_classifier": ("balanced_classifier", "balanced classifier"),
                    "model_error": ("error_less_entropy", "eq. 6 error less the images' entropy")}


DEFAULT_DREAM_WEIGHTS = (DreamConfig.encoder_weight, DreamConfig.decoder_weight)


def recorded_capacity_max(result: dict) -> float:
    """The run's C_max. A results.json written before it recorded C_max reads as 25 nats:
    the setting's default since it was added, and every committed study of that time ran at it (their
    commands are in docs/regime.md; the one other C_max, the study at 50, records it)."""
    return result.get("capacity_max", C_MAX_BEFORE_RECORDED)


def recorded_gamma(result: dict) -> float:
    """The run's eq. 3 weight γ. A results.json written before it recorded γ reads as the default:
    every committed run of that time ran at it but one, which was made again with γ recorded
    (docs/regime.md, "Returns at the short schedule")."""
    return result.get("gamma", ObjectiveConfig.gamma)


def rules_used(result: dict) -> list[str]:
    """The rules of a run's set, less those it left out: results.json's `rule_names` (none for an
    older results.json, written while the set was the rules vase still has)."""
    return result.get("rule_names", [])


def row_label(result: dict) -> str:
    """A Table 1 row's name: the ablation, the rule set where inference runs with another than the
    default (`inference.rules`), the capacity term where results.json says it was the absolute
    value rather than eq. 8's square (`objective.capacity_form`), a γ other than the default
    (`objective.gamma`), C(t) on each environment's own clock (the setting
    `objective.capacity_clock`, since deleted), a returning environment's target ramped from its
    KL (`objective.return_ramp_steps`, since deleted), a snapshot that tau never
    re-syncs within the run (`dream.snapshot_every`), a snapshot also re-synced at allocations
    (`dream.sync_at_allocation`; a results.json without it is such a run), own_capacity_ramp where
    its ramp acted (`own_ramp_used`), a rule vase no longer has that the run used (`rules_used`; a
    run left without it is named as today's set), eq. 7's
    weights where they are not the defaults (`dream.encoder_weight`, `dream.decoder_weight`), dreams drawn
    from the snapshot's Bernoulli pixels (`dream.images`), q_psi trained with the rule
    `balanced_classifier` or eq. 6's error read less the images' entropy (the rule `model_error`),
    both since deleted (`NAMED_BY_SETTING`), and pending
    batches that trained although frozen_while_pending was in the set (results.json's
    `pending_batches_train`; a results.json without it is such a run)."""
    rules = result.get("rules", "vase")
    notes = [f"{rules} rules"] if "S" in result["ablation"] and rules != "vase" else []
    # own_capacity_ramp is named where its ramp acted (0 steps in the short and long schedules).
    notes += [f"without {name}" for name in result.get("rules_without", []) if name != OWN_RAMP]
    notes += [f"with {OWN_RAMP}"] if own_ramp_used(result) else []
    notes += [f"with {name}" for name in rules_used(result) if name not in RULES and name not in NAMED_BY_SETTING]
    capacity = result.get("mode") != "entangled"  # eq. 3's capacity term, not the plain VAE
    returns = capacity and "S" in result["ablation"]  # and environments that can return
    if capacity and result.get("capacity_form") == "absolute":
        notes.append("absolute capacity term")
    if capacity and recorded_gamma(result) != ObjectiveConfig.gamma:
        notes.append(f"γ {recorded_gamma(result):g}")
    if returns and result.get("capacity_clock", "run") == "environment":  # a setting since deleted
        notes.append("C(t) on each environment's clock")
    if returns and result.get("return_ramp_steps"):  # a setting since deleted
        notes.append(f"return ramp {result['return_ramp_steps']}")
    if "D" in result["ablation"]:
        at_allocations = "S" in result["ablation"] and result.get("sync_at_allocation", True)
        if result.get("snapshot_every", 0) >= sum(result.get("steps_per_env") or [0]) > 0:  # tau longer than the run
            notes.append("snapshot synced at allocations only" if at_allocations else "snapshot never re-synced")
        elif at_allocations:
            notes.append("snapshot also synced at allocations")
    encoder_weight, decoder_weight = result.get("dream_weights", EQ8_DREAM_WEIGHTS)
    if "D" in result["ablation"] and (encoder_weight, decoder_weight) != DEFAULT_DREAM_WEIGHTS:
        notes.append(f"eq. 7 weights {encoder_weight:g} / {decoder_weight:g}")
    if "D" in result["ablation"] and result.get("dream_images", "mean") == "sample":
        notes.append("sampled dreams")
    if "S" in result["ablation"]:
        notes += [label for key, label in NAMED_BY_SETTING.values() if result.get(key, False)]
    in_set = "frozen_while_pending" not in result.get("rules_without", [])
    if "S" in result["ablation"] and in_set and result.get("pending_batches_train", True):
        notes.append("pending batches trained")
    if is_in_progress(result):  # never averaged with finished seeds
        notes.append("in progress")
    return result["ablation"] + (f" ({', '.join(notes)})" if notes else "")


WRONG_SLOTS_NOTE = "* the count of environments is right, but not every stage trained in its own environment's slot"


def environment_counts(row: dict) -> list[str]:
    """Each seed's count of inferred environments, marked * where the stages are not in their own slots."""
    return ["?" if n is None else f"{n}*" if ok is False and n == true else str(n)
            for n, ok, true in zip(row["environments_inferred"], row["environments_in_own_slots"],
                                   row["environments_true"])]


def in_own_slots(result: dict) -> bool | None:
    """Whether each stage trained in a slot of its own environment: stages of one environment in one
    slot, stages of different ones in different slots (None for a results.json without the record).
    A count of environments can match the truth with them in the wrong slots, e.g. a new environment
    merged into an old one's slot and a returning one given a new slot (docs/regime.md)."""
    stages = [(row["true_env"], row["inferred_env"]) for row in result.get("inferred_vs_true") or []]
    if not stages:
        return None
    return all((a == b) == (s == t) for i, (a, s) in enumerate(stages) for b, t in stages[i + 1:])


def table1_rows(results: list[dict]) -> list[dict]:
    """Table 1 from several runs: one row per (mode, ablation and rule set, sequence, preset, steps,
    capacity ramp and C_max), the four numbers as mean and std over that group's seeds
    (docs/probes.md), and the latent-use counts per seed. Runs of another length, capacity schedule or
    network are another experiment, so they never share a row (a results.json that does not name its
    ramp is one of its own; for C_max see `recorded_capacity_max`)."""
    from vase.metrics.continual import mean_std_over_seeds

    groups: dict[tuple, list[dict]] = {}
    for r in results:
        key = (r["mode"], row_label(r), ",".join(r["sequence"]), r.get("preset"), str(r.get("steps_per_env")),
               probe_reading(r), r.get("capacity_ramp_steps"), recorded_capacity_max(r))
        groups.setdefault(key, []).append(r)
    rows = []
    for (mode, ablation, sequence, _, _, reading, ramp, capacity_max), runs in groups.items():
        mean, std = mean_std_over_seeds([r["probes"]["table1"] for r in runs])
        rows.append({
            "mode": mode, "ablation": ablation, "sequence": sequence,
            "seeds": [r["seed"] for r in runs], "mean": mean, "std": std,
            "environments_inferred": [r["environments_inferred"] for r in runs],
            "environments_in_own_slots": [in_own_slots(r) for r in runs],
            "environments_true": [r.get("environments_true") for r in runs],
            "latents_used": [_count(latent_union(r.get("latent_use") or [], "used_in_training")) for r in runs],
            "latents_informative": [_count(latent_union(r.get("latent_use") or [], "informative")) for r in runs],
            "preset": [r.get("preset") for r in runs],
            "reading": reading,
            "capacity_ramp_steps": ramp,
            "capacity_max": capacity_max,
            "steps_per_env": [r.get("steps_per_env") for r in runs],
            "in_progress": [r.get("in_progress") if is_in_progress(r) else None for r in runs],
            "heldout": _heldout_over_seeds([heldout_retention(r) for r in runs]),
        })
    return rows


def heldout_retention(result: dict) -> list[dict]:
    """Each environment of the sequence but the last: its held-out reconstruction error (nats per
    image) just after its own stage, at the end under the slot it trained in, and their ratio; and
    the end error from the codes of the end of its stage (`Evaluator.stage_code_errors`), with its
    ratio to the error after the stage.

    The first ratio is how much of what that slot learnt it kept. The second is the part of it that
    the decoder and mask lost: the rest is the shared encoder's drift on the environment's real
    images. After its stage the error is read under the classifier's pick, which is then that slot.
    The last environment is left out, as Table 1's CHANGE leaves it out: its readings are taken at
    the same step. [] for results.json without the matrices; NaN where the stage codes are missing."""
    matrix = result.get("heldout_reconstruction_matrix") or []
    cross = result.get("cross_domain_errors") or []
    staged = result.get("own_slot_errors_stage_codes") or []
    rows = []
    for i, env in enumerate((result.get("inferred_vs_true") or [])[:-1]):
        if i >= len(matrix) or i >= len(cross):
            break
        after, end = matrix[i][i], cross[i][env["inferred_env"]]
        decoder = staged[i] if i < len(staged) and staged[i] is not None else math.nan
        rows.append({"env": env["true_env"], "after_stage": after, "end_own_slot": end,
                     "ratio": end / after if after > 0 else math.nan,
                     "end_stage_codes": decoder, "decoder_ratio": decoder / after if after > 0 else math.nan})
    return rows


def _heldout_over_seeds(per_run: list[list[dict]]) -> list[dict]:
    """heldout_retention of several seeds of one sequence: mean and std of each number per stage."""
    from vase.metrics.continual import nanmean, nanstd

    out = []
    for stage in zip(*per_run):
        row = {"env": stage[0]["env"]}
        for key in ("after_stage", "end_own_slot", "ratio", "end_stage_codes", "decoder_ratio"):
            values = [r[key] for r in stage]
            row[key] = {"mean": nanmean(values), "std": nanstd(values)}
        out.append(row)
    return out


def _count(latents: list[int] | None) -> int | None:
    return None if latents is None else len(latents)


IN_PROGRESS_COVERS = "MAX over the environments begun, CHANGE over the stages ended"


def in_progress_note(row: dict) -> str | None:
    """The step each seed of a row in progress had reached; None for a row of finished runs."""
    reached = [f"seed {seed} at step {state['step']:,} of {state['steps']:,}"
               for seed, state in zip(row["seeds"], row.get("in_progress") or []) if state]
    return "; ".join(reached) or None


def table1_text(rows: list[dict]) -> str:
    from vase.metrics.continual import format_table1_row, table1_header

    lines, starred = [], False
    for mode, sequence in sorted({(row["mode"], row["sequence"]) for row in rows}):
        lines.append(f"{mode}, {sequence}:")
        lines.append("  " + table1_header() + " | seeds | envs inferred | latents used / informative")
        for row in (r for r in rows if (r["mode"], r["sequence"]) == (mode, sequence)):
            single = len(row["seeds"]) == 1
            cells = format_table1_row(row["mean"], row["ablation"], None if single else row["std"])
            used = "/".join("?" if n is None else str(n) for n in row["latents_used"])
            info = "/".join("?" if n is None else str(n) for n in row["latents_informative"])
            counts = environment_counts(row)
            starred = starred or any(c.endswith("*") for c in counts)
            envs = "/".join(counts)
            lines.append(f"  {cells} | {','.join(map(str, row['seeds']))} | {envs} | {used} / {info}")
            progress = in_progress_note(row)
            if progress:
                lines.append(f"  in progress: {progress} ({IN_PROGRESS_COVERS})")
            if len(set(row["seeds"])) < len(row["seeds"]):
                lines.append(f"  note: {row['ablation']} has repeated seeds; are two runs the same experiment?")
    legend = "mean (±std) over seeds; per-seed values are separated by '/'"
    lines.append(legend + ("; " + WRONG_SLOTS_NOTE if starred else ""))
    return "\n".join(lines)
