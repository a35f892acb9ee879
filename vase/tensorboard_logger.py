"""TensorBoard logging of a run, as a callback: scalars, inference decisions, reconstructions,
traversals, masks and the run's figures, all written under RUN_DIR/tb.

The logger only writes: it reads the step's output and what the run's `Evaluator` measured, and
the loop never calls a writer itself. Every event of loop iteration t is logged at step t + 1
(`StepEnd.done`), so a resume can purge what a killed run logged after its checkpoint.
"""
from __future__ import annotations

import shutil

from torch.utils.tensorboard import SummaryWriter

from vase.callbacks import Callback, StepEnd
from vase.dream_coverage import COVERAGE_TERMS
from vase.figures import run_figures
from vase.visualize import mask_image, reconstruction_grid, traversal_grid

PANEL = 8  # images per environment in the reconstruction and traversal panels
TB_DIR = "tb"


def describe_decision(d) -> str:
    """An allocation or switch in one line: why it was taken and which tests failed where."""
    return (
        f"step {d.step}: {d.verdict} -> environment {d.env} (predicted {d.predicted}; "
        f"failed on: {', '.join(d.reasons) or '-'}; error {d.error:.1f} vs threshold {d.threshold:.1f}; "
        f"mask or usage disagreed on latents {d.disagreeing or '-'})"
    )


class TensorBoardLogger(Callback):
    def __init__(self):
        self.writer: SummaryWriter | None = None

    def on_resume(self, trainer, step: int) -> None:
        # A run killed before its first checkpoint starts again from nothing; later ones are cut
        # with purge_step when the writer opens.
        if step == 0:
            shutil.rmtree(trainer.run_dir / TB_DIR, ignore_errors=True)

    def on_train_start(self, trainer, start: int) -> None:
        # The checkpoint at `start` holds the events up to `start`; purge_step drops those a killed
        # run logged after it.
        self.writer = SummaryWriter(str(trainer.run_dir / TB_DIR), purge_step=start + 1 if start else None)

    def on_step(self, trainer, step: StepEnd) -> None:
        d = step.out.decision
        if d.is_event:
            self.writer.add_text("inference/events", describe_decision(d), step.done)
        if step.logged:
            self._scalars(trainer, step)
        if step.every(trainer.cfg.train.image_every):
            self._reconstructions(trainer, step.done, step.true_env)
        for name, value in trainer.evaluator.probed_at(step.done).items():
            self.writer.add_scalar(f"probe/{name}", value, step.done)
        for row in trainer.evaluator.covered_at(step.done):
            for term in COVERAGE_TERMS:
                self.writer.add_scalar(f"dream_coverage/{row['true_env']}/{term}", row[term], step.done)

    def on_boundary(self, trainer, step: StepEnd) -> None:
        run, learner, t = trainer.evaluator, trainer.learner, step.done
        for env, values in run.record.disentanglement[-1]["scores"].items():
            for name, value in values.items():
                self.writer.add_scalar(f"disentanglement/{env}/{name}", value, t)
        self._reconstructions(trainer, t, step.true_env)
        for i in range(step.true_env + 1):
            slot = learner.infer_slot(run.held_out[i][:PANEL])
            grid = traversal_grid(learner, run.held_out[i][0], slot, trainer.cfg.inference.used_kl)
            self.writer.add_image(f"traversal/{run.envs[i].name}", grid, t)
        self.writer.add_image("mask/environments", mask_image(learner.slots.stack("mask"), learner.inference.n_envs), t)
        for name, fig in run_figures(run).items():
            self.writer.add_image(f"figures/{name}", fig, t, dataformats="HWC")

    def on_checkpoint(self, trainer) -> None:
        # Events up to this step reach the disk with the checkpoint; later ones are purged on resume.
        self.writer.flush()

    def on_train_end(self, trainer) -> None:
        self.writer.close()

    def _scalars(self, trainer, step: StepEnd) -> None:
        w, t, out = self.writer, step.done, step.out
        for name, value in out.losses.items():
            w.add_scalar(f"loss/{name}", value, t)
        w.add_scalar("capacity/C", out.extra["capacity"], t)
        w.add_scalar("inference/assigned_env", out.decision.env, t)
        w.add_scalar("inference/true_env", step.true_env, t)
        w.add_scalar("inference/n_envs", trainer.learner.inference.n_envs, t)
        for n, (k, a, m) in enumerate(zip(*step.per_latent)):
            w.add_scalar(f"kl/z{n:02d}", k, t)
            w.add_scalar(f"atypicality/z{n:02d}", a, t)
            w.add_scalar(f"mask/z{n:02d}", m, t)

    def _reconstructions(self, trainer, step: int, true_env: int) -> None:
        run, learner = trainer.evaluator, trainer.learner
        for i in range(true_env + 1):
            x = run.held_out[i][:PANEL]
            slot = learner.infer_slot(x)
            self.writer.add_image(f"reconstruction/{run.envs[i].name}",
                                  reconstruction_grid(x, learner.reconstruct_mean(x, slot)), step)
