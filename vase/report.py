"""Human-readable summaries of a run's results (what `vase train` and `vase eval` print)."""
from __future__ import annotations

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
    use = results.get("latent_use") or []
    if use:
        n = len(use[0]["kl_per_latent"])
        if all("used_in_training" in row for row in use):  # results.json of older runs lack it
            used = sorted({z for row in use for z in row["used_in_training"]})
            lines.append(f"latent use (KL above inference.used_kl): {len(used)}/{n} latents used by some slot while it trained")
        else:
            lines.append("latent use (KL above inference.used_kl):")
        if all("informative" in row for row in use):
            informative = sorted({z for row in use for z in row["informative"]})
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
