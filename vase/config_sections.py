"""The sections of a VASE run's config: one dataclass per section, one field per setting.

Every number the paper leaves unpublished is a named field here, tagged in its comment with where
it comes from ([paper], [appendix], [related], [ours]) as in docs/method.md. `vase.config.Config`
gathers the sections; a setting is written ``section.field`` (``--set model.latents=10``).
"""
from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field
from pathlib import Path

from vase.errors import ConfigError

DATA_ROOT_ENV = "VASE_DATA_ROOT"
DEFAULT_DATA_ROOT = "datasets"


@dataclass
class DataConfig:
    # Environment names, trained in this order (docs/usage.md, data); an environment may return.
    sequence: list[str] = field(default_factory=lambda: ["moving_shapes_a", "shapes_b", "moving_shapes_b"])
    # Training steps per environment: one number for all, or one per environment.
    steps_per_env: list[int] = field(default_factory=lambda: [1200])
    # Where downloaded, imported and cached data lives; VASE_DATA_ROOT overrides the default.
    root: str = ""
    download: bool = False
    # Pre-rendered training images per sprite environment (rendered once, cached under root).
    sprite_train_size: int = 20000
    sprite_test_size: int = 2000
    # Shapes per sprite set; sets A and B are disjoint [ours].
    shapes_per_set: int = 3
    # Factor grid resolution of the sprite renderer; scale/orientation vary only if enabled [ours].
    sprite_vary_scale: bool = False
    sprite_vary_orientation: bool = False
    # Seed of the procedural shapes and of the moving-digit offsets (the data, not the training).
    data_seed: int = 0

    def resolved_root(self) -> Path:
        return Path(self.root or os.environ.get(DATA_ROOT_ENV) or DEFAULT_DATA_ROOT)

    def env_steps(self) -> list[int]:
        """The steps of each environment of the sequence (one number given stands for all)."""
        steps = self.steps_per_env * len(self.sequence) if len(self.steps_per_env) == 1 else self.steps_per_env
        if len(steps) != len(self.sequence):
            raise ConfigError(
                f"data.steps_per_env has {len(steps)} entries but the sequence has {len(self.sequence)} environments"
            )
        return list(steps)

    def total_steps(self) -> int:
        return sum(self.env_steps())

    def stage_ends(self) -> list[int]:
        """The step at which each environment's stage ends."""
        return list(itertools.accumulate(self.env_steps()))


@dataclass
class ModelConfig:
    # Conv channels of the 4 encoder convs (decoder mirrors them). paper: 64,64,128,128 [appendix].
    channels: list[int] = field(default_factory=lambda: [32, 32, 32, 32])
    hidden: int = 256  # fc width [appendix]
    latents: int = 24  # [appendix]
    k_max: int = 8  # environment slots of the decoder one-hot and the classifier [ours]
    image_channels: int = 1
    # channels_last is several times faster for some conv shapes on CPU (docs/method.md, networks, measured by bench).
    channels_last: bool = True
    # Who computes the convs' weight gradients [ours, speed]: "native", our AVX2 kernel
    # (vase/kernels; oneDNN where it cannot be built or a layer has no 16k channels), or "onednn".
    # The same function; on AVX2 machines the same bits too (docs/benchmarks.md, item 9). Elsewhere
    # the sums may differ in the last bits, so the value is part of what reproduces a run (runs
    # from before this field existed used "onednn").
    weight_grad_kernel: str = "native"
    # Slope of every hidden activation below zero [ours, beyond the paper]: 0 is the paper's ReLU; a
    # leaky ReLU (e.g. 0.01) has units that cannot stop firing (docs/regime.md, "Units that stop firing").
    negative_slope: float = 0.0


@dataclass
class ObjectiveConfig:
    # "disentangled": eq. 3 capacity objective; "entangled": plain VAE, beta = 1 (Table 1).
    mode: str = "disentangled"
    gamma: float = 100.0  # [appendix, quoted elsewhere]; Burgess et al. use 1000 (absolute form)
    # The capacity term: "squared", gamma |KL - C|^2 as eq. 8 and the poster write it, or
    # "absolute", gamma |KL - C| as Burgess et al. (CCI-VAE) [paper; choice: docs/regime.md].
    capacity_form: str = "squared"
    capacity_max: float = 25.0  # nats [related]
    # Linear ramp of C(t) over the global step (a pure function of the step) [ours].
    capacity_ramp_steps: int = 3000
    # [ours, beyond the paper] Weight, in units of gamma, of the summed atypicality (eq. 4) of a new
    # environment's fresh latents (unmasked, and used by no other environment). A new
    # slot, its known latents masked, meets C in fresh latents faster by narrowing or shifting
    # their posteriors alike for every image than by learning a factor: KL without information,
    # which leaves them neither spare nor informative. With weight 1 and the absolute capacity term
    # that costs exactly what it earns there, so C must be met with information (the squared term
    # pays 2 gamma |KL - C| per nat, so weight 1 cancels it only where |KL - C| = 1/2); measured on the digits (most
    # latents spare in 6 seeds of 10, against 4 with 0) and the sprites in docs/method.md.
    # 0 is eq. 3 alone.
    fresh_aggregate_weight: float = 1.0
    # [ours, beyond the paper] Steps over which a new environment's capacity target climbs from the
    # KL it carries when allocated to C(t), at C(t)'s own slope: min(C(t), KL_s + C_max (t - t_s) / R).
    # A new slot whose known latents are masked must otherwise find C(t) nats in fresh latents at
    # once, and at the extended schedule that pull on the shared encoder cost moving Fashion's
    # identity 19 points in 2,000 steps (docs/method.md, own capacity ramp). 0 is eq. 3's C(t).
    new_env_ramp_steps: int = 0


@dataclass
class MaskConfig:
    # A: atypicality mask (eq. 4-5) with hysteresis lambda1 < lambda2 [ours, calibrated].
    enabled: bool = True
    lambda_low: float = 0.3
    lambda_high: float = 1.0
    # EMA of alpha over recent batches before thresholding (0 = no smoothing) [ours].
    ema: float = 0.9


# Named rule sets of environment inference (docs/method.md, "Rules beyond eq. 6"): "paper" is eq. 3
# and eq. 6 as written, with the spec's debouncing (patience) and eq. 5's hysteresis; "vase" adds
# the named rules. Their lists of rules are `vase.rules.RULE_SETS`.
RULE_SETS = ("vase", "paper")


@dataclass
class InferenceConfig:
    # S: environment inference (eq. 6).
    enabled: bool = True
    rules: str = "vase"  # a name from RULE_SETS
    # Rules of that set left out, by name (`vase.rules.RULES`): one run per rule dropped is how the
    # long regime tests whether a rule is still needed (docs/method.md, "Rules beyond eq. 6").
    without: list[str] = field(default_factory=list)
    kappa: float = 2.0  # reconstruction threshold multiple [ours, calibrated: docs/method.md]
    # Additive slack of the threshold, kappa * L_s + margin, in nats per image [ours]: once an
    # environment is learnt to ~1 nat (three static sprites), kappa * L alone is batch noise.
    error_margin: float = 25.0
    patience: int = 10  # consecutive "new" verdicts before allocating [ours]
    error_ema: float = 0.95  # running reconstruction error L_s [ours]
    # A latent counts as "used" by an environment when it carries more than this many nats of
    # information: KL minus atypicality, an estimate of I(x; z_n) [ours].
    used_kl: float = 0.1
    classifier_lr: float = 1e-3
    # A study instrument [ours]: on every judged batch, also decide it as the set would without each
    # rule that acts on the verdict alone (`vase.rules.VERDICT_RULES`), and count the batches where
    # that decision differs (results.json, "rule_activity"). A rule that never changes a verdict
    # leaves the run as it would be without it (docs/method.md, rules beyond eq. 6). Off: the
    # extra decodes cost a few per cent.
    counterfactuals: bool = False
    # Steps after an allocation during which no further allocation happens [ours].
    cooldown: int = 200


@dataclass
class DreamConfig:
    # D: dreaming feedback (eq. 7).
    enabled: bool = True
    decoder_term: bool = True  # False gives the SD-[41] variant
    snapshot_every: int = 1000  # tau [paper: a hyperparameter; value ours]
    # [ours] Also re-sync the snapshot when a new environment is allocated. Off (the default), the
    # snapshot is re-synced every tau steps only, as in §3.5: the sync at an allocation kept what the
    # new environment's first batches did to an old slot (docs/regime.md, "The snapshot at an arrival").
    sync_at_allocation: bool = False
    batch_size: int = 32
    # Weights of eq. 7's two terms [ours; eq. 8 prints none]. The encoder term, 10: at 1 the shared
    # encoder's move at an arrival erased what the older environments' codes carried (SDA forgot
    # more object identity than "-"), and a returning environment's codes drifted out of its slot
    # (re-identified in 3 of 7 recurring runs, against 7 of 7 at 10). Its cost: a new environment
    # that reuses an old slot's factors passes that slot's tests more often (docs/regime.md, "Eq.
    # 7's encoder weight: 10"). The decoder term stays 1: at 10 with the encoder's at 10, moving
    # MNIST joined moving Fashion's slot in 2 seeds of 2.
    encoder_weight: float = 10.0
    decoder_weight: float = 1.0
    # The dream images x': "mean", sigmoid(decoder_theta'(z, s')), as the spec writes it; or "sample",
    # x' drawn from those Bernoulli pixels, as eq. 7's x' ~ q_theta'(x|z, s') reads (docs/regime.md,
    # "The slot or the shared encoder").
    images: str = "mean"


@dataclass
class ImaginationConfig:
    # Imagination-driven exploration (the paper's Fig. 5B; its appendix A.4 is unpublished, so the
    # design is ours: docs/method.md, "Imagination"). Off in every Table 1 row.
    enabled: bool = False
    batch_size: int = 16  # imagined images per step, drawn from the current batch's codes
    weight: float = 1.0  # of the encoder's consistency on them, in nats like eq. 7's encoder term


@dataclass
class TrainConfig:
    batch_size: int = 64
    lr: float = 5e-4  # Adam [related: Burgess et al.]
    seed: int = 0
    threads: int = 0  # torch threads; 0 = library default
    # Arithmetic of the forward passes: "fp32", or "bf16" autocast (losses stay float32). Measured
    # by `vase bench` (CPU) and `vase bench --device`: x1.4 on a CPU with AMX, slower on the H200;
    # fp32 is the default everywhere, so a run's numbers do not depend on its CPU (docs/benchmarks.md).
    precision: str = "fp32"
    # torch.compile the encoder's and decoder's forward passes (measured by `vase bench --device`).
    compile: bool = False
    # Deterministic kernels on accelerators (cuDNN, cuBLAS); the CPU path is deterministic as is.
    deterministic: bool = False
    # Flush denormal floats to zero on the CPU (torch.set_flush_denormal). As a run trains, more of
    # Adam's moment estimates fall under 1.2e-38, and x86 CPUs compute slowly on such values: the
    # extended study's SDA step slowed from 3.3 to 2.2 steps/s over 10,000 steps, and flushing
    # makes it x1.45 faster from there (`vase bench --run`, docs/benchmarks.md). A flushed moment
    # moves its weight by under 1e-30 a step: the study's encoders came out bit-identical to 10,000.
    flush_denormals: bool = True
    # On CUDA in fp32: replay the encoder's and decoder's training passes and the snapshot's dream
    # passes as CUDA graphs (vase.cuda_graphs; measured by `vase bench --device`, docs/devices.md).
    # No effect elsewhere.
    cuda_graphs: bool = True
    checkpoint_every: int = 1000
    # Also checkpoint once this many minutes have passed since the last checkpoint, so that a run
    # killed without warning (SIGKILL: an out-of-memory kill, a lost node) loses at most that much
    # work; 0: by steps only. A checkpoint changes nothing that is trained (docs/reliability.md).
    checkpoint_minutes: float = 10.0
    # Also keep the checkpoint of every this-many steps for good, beside the stage ends'
    # (checkpoints/stages/), so that a run can be replayed (`vase eval --replay`), inspected or
    # branched from any of them, as a rare event such as a flip of eq. 5 asks; 0: stage ends only.
    keep_every: int = 0
    log_every: int = 50
    image_every: int = 500
    progress: bool = True

    def keeps(self, step: int) -> bool:
        """Whether train.keep_every keeps the checkpoint of `step` for good (a stage end's always is)."""
        return self.keep_every > 0 and step % self.keep_every == 0


PROBE_READINGS = ("mean", "sample")  # ProbeConfig.reading


@dataclass
class ProbeConfig:
    enabled: bool = True
    every: int = 1000  # P: probe interval in steps [ours]
    train_size: int = 2000
    test_size: int = 1000
    seed: int = 1234
    # What the probes read (docs/probes.md): "mean", mu(x) of every latent [ours]; or "sample", the
    # paper's reading: z drawn from the masked posterior (eq. 2) under the slot the classifier
    # picks, masked latents as prior noise.
    reading: str = "mean"
    # With D on: eq. 7's distances on a past environment's real data against those on its dreams,
    # over each probe interval (vase.dream_coverage, docs/regime.md). Training is unchanged.
    dream_coverage: bool = True


# The settings that name one of a few choices, and those choices (checked by vase.config_checks).
CHOICES = {
    "objective.mode": ("disentangled", "entangled"),
    "objective.capacity_form": ("squared", "absolute"),
    "inference.rules": RULE_SETS,
    "dream.images": ("mean", "sample"),
    "probe.reading": PROBE_READINGS,
    "train.precision": ("fp32", "bf16"),
    "model.weight_grad_kernel": ("native", "onednn"),
}
