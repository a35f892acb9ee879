"""What `vase train` and `vase eval` print for one run: its summary, read from its results."""
from __future__ import annotations

from pathlib import Path

from vase.dream_coverage import COVERAGE_TERMS


def _duration(seconds: float) -> str:
    m, s = divmod(int(round(seconds)), 60)
    return f"{m}m{s:02d}s"


def _slots_note(results: dict) -> str:
    from vase.table1 import in_own_slots

    right = in_own_slots(results)
    if right is None:
        return ""
    return "; each stage in its own environment's slot" if right else "; not every stage in its own environment's slot"


def summary_text(results: dict, run_dir: Path) -> str:
    lines = [
        f"VASE run: ablation {results['ablation']} ({results['mode']}), preset {results['preset']}, "
        f"{results['steps']} steps in {_duration(results['wall_time_s'])}",
        f"environments inferred: {results['environments_inferred']} (distinct true environments: "
        f"{results['environments_true']}{_slots_note(results)})",
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
    staged = results.get("own_slot_errors_stage_codes") or []
    if cross and staged:
        lines.append("the same under its own slot, decoded from the codes the encoder gave it at the end of its "
                     "stage (what the slot lost; the rest is the encoder's drift):")
        for env, row, error in zip(results["inferred_vs_true"], cross, staged):
            if error is not None:
                lines.append(f"  {env['true_env']:<18}{error:>10.1f} against {row[env['inferred_env']]:.1f} "
                             "from today's codes")
    activity = results.get("rule_activity")
    if activity:
        lines.append("batches whose verdict each rule decided (the set without it decides otherwise, "
                     "inference.counterfactuals): " + ", ".join(
                         f"{name} {count['changed']}" + activity_span(count) for name, count in activity.items()))
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
    lines.extend(coverage_lines(results.get("dream_coverage") or []))
    probes = results.get("probes")
    if probes:
        from vase.metrics.continual import format_table1_row, table1_header
        from vase.report import READINGS
        from vase.table1 import probe_reading, row_label

        final = probes["history"][-1]["values"] if probes.get("history") else {}
        if final:
            lines.append("final probes: " + ", ".join(f"{k} {v:.4f}" for k, v in sorted(final.items())))
        reading = probe_reading(results)
        lines.append(f"the probes read {READINGS[reading]} (probe.reading={reading}, docs/probes.md)")
        lines.append("Table 1 row:")
        lines.append("  " + table1_header())
        lines.append("  " + format_table1_row(probes["table1"], row_label(results)))
    for boundary in results.get("disentanglement", []):
        for env, scores in boundary["scores"].items():
            lines.append(
                f"disentanglement after stage {boundary['stage'] + 1} on {env}: "
                + ", ".join(f"{k} {v:.3f}" for k, v in scores.items())
            )
    lines.append(f"results: {run_dir / 'results.json'}")
    lines.append(f"TensorBoard: tensorboard --logdir {run_dir / 'tb'}")
    return "\n".join(lines)


def coverage_lines(rows: list[dict]) -> list[str]:
    """Eq. 7's coverage (`vase.dream_coverage`) per past environment: the drift per probe interval
    on its real held-out images against the drift on dreams of its slot, averaged over the intervals
    after its stage. Real far above dreams: the dreams do not stand for the data eq. 7 protects."""
    if not rows:
        return []
    lines = ["eq. 7's coverage, mean drift per probe interval after each stage, on real held-out images "
             "against dreams of its slot (decoder: Bernoulli KL, nats; encoder: W2, real / "
             "their reconstructions / dreams):"]
    for name in dict.fromkeys(row["true_env"] for row in rows):
        mine = [row for row in rows if row["true_env"] == name]
        # a row read before encoder_recon was measured lacks it: print it where every row has it
        mean = {term: sum(row[term] for row in mine) / len(mine) for term in COVERAGE_TERMS
                if all(term in row for row in mine)}
        recon = f" / {mean['encoder_recon']:.3f}" if "encoder_recon" in mean else ""
        lines.append(
            f"  {name:<18} decoder {mean['decoder_real']:.2f} vs {mean['decoder_dream']:.2f}, "
            f"encoder {mean['encoder_real']:.3f}{recon} / {mean['encoder_dream']:.3f} ({len(mine)} intervals)")
    return lines


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


def activity_span(count: dict) -> str:
    """Where a rule's counterfactual count lies, and the most of its batches in a row (a run of
    `inference.patience` would have allocated a slot in the run without the rule)."""
    if not count["changed"]:
        return ""
    text = f"steps {count['first_step']}-{count['last_step']}"
    # None: made before the runs in a row were kept, or resumed from such a count and not counted since
    if count.get("counted_from") is not None:
        text += f", at most {count['longest']} in a row"
        if count["longest"]:
            text += f" ending at step {count['longest_last_step']}"
        if count["counted_from"] > count["first_step"]:
            text += f" since step {count['counted_from']}"
    return f" ({text})"
