"""One typed config for a VASE run.

Every number the paper leaves unpublished is a named field here, tagged in its comment with where
it comes from ([paper], [appendix], [related], [ours]) as in VASE_SPEC.md. Presets are JSON files
in ``vase/presets``; any field can be overridden as ``section.field=value``. The resolved config is
written into every run directory (``config.json``) and stored in every checkpoint.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, get_type_hints

from vase.errors import ConfigError

CONFIG_VERSION = 1
PRESET_DIR = Path(__file__).parent / "presets"
# Schedules set the lengths of a run together: steps, the capacity ramp, tau, the probe interval and
# the new-slot settings (docs/method.md, "The regime").
SCHEDULE_DIR = Path(__file__).parent / "schedules"
DATA_ROOT_ENV = "VASE_DATA_ROOT"
DEFAULT_DATA_ROOT = "datasets"


@dataclass
class DataConfig:
    # Comma-separated environment names, trained in this order (docs/usage.md, data).
    sequence: str = "moving_shapes_a,shapes_b,moving_shapes_b"
    # Training steps per environment: one int for all, or a comma list with one per environment.
    steps_per_env: str = "1200"
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

    def env_names(self) -> list[str]:
        return [s.strip() for s in self.sequence.split(",") if s.strip()]

    def env_steps(self) -> list[int]:
        names = self.env_names()
        parts = [p.strip() for p in str(self.steps_per_env).split(",") if p.strip()]
        try:
            steps = [int(p) for p in parts]
        except ValueError as e:
            raise ConfigError(f"data.steps_per_env must be integers, got {self.steps_per_env!r}") from e
        if len(steps) == 1:
            steps = steps * len(names)
        if len(steps) != len(names):
            raise ConfigError(
                f"data.steps_per_env has {len(steps)} entries but the sequence has {len(names)} environments"
            )
        return steps


@dataclass
class ModelConfig:
    # Conv channels of the 4 encoder convs (decoder mirrors them). paper: 64,64,128,128 [appendix].
    channels: str = "32,32,32,32"
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

    def channel_list(self) -> list[int]:
        return [int(c) for c in self.channels.split(",")]


@dataclass
class ObjectiveConfig:
    # "disentangled": eq. 3 capacity objective; "entangled": plain VAE, beta = 1 (Table 1).
    mode: str = "disentangled"
    gamma: float = 100.0  # [appendix, quoted elsewhere]; Burgess et al. use 1000 (absolute form)
    # The capacity term: "squared", gamma |KL - C|^2 as eq. 8 and the poster write it, or
    # "absolute", gamma |KL - C| as Burgess et al. (CCI-VAE) [paper; choice: docs/method.md].
    capacity_form: str = "squared"
    capacity_max: float = 25.0  # nats [related]
    # Linear ramp of C(t) over the global step (a pure function of the step) [ours].
    capacity_ramp_steps: int = 3000
    # [ours, beyond the paper] Weight, in units of gamma, of the current environment's summed
    # atypicality (eq. 4) over its unmasked latents. Eq. 3 is blind to how KL splits into
    # information and aggregate-posterior shift (KL = I(x;z) + alpha); the paper assumes
    # E_x q(z|x) ~ p(z) after training (§3.3). 0 is the paper's eq. 3.
    aggregate_weight: float = 0.0
    # [ours, beyond the paper] The same penalty, but only in an environment allocated after the
    # first and only on its fresh latents (unmasked, and used by no other environment). Such a
    # slot, its known latents masked, meets C in fresh latents faster by narrowing or shifting
    # their posteriors alike for every image than by learning a factor: KL without information,
    # which leaves them neither spare nor informative. With weight 1 and the absolute capacity term
    # that costs exactly what it earns there, so C must be met with information (the squared term
    # pays 2 gamma |KL - C| per nat, so weight 1 cancels it only where |KL - C| = 1/2); measured on the digits (most
    # latents spare in 6 seeds of 10, against 4 with 0) and the sprites in docs/method.md.
    # 0 is eq. 3 alone, the release before.
    fresh_aggregate_weight: float = 1.0
    # [ours] A newly allocated environment's own capacity ramp, in steps from 0 to C_max: its
    # target starts from the KL it carries when allocated and climbs at this slope, never above
    # C(t). Without it (0, eq. 3 read literally) a new environment whose known latents are masked
    # must find C(t) nats at once, and on the digits one did so by collapsing the shared encoder
    # (docs/method.md). The first environment follows C(t) itself.
    new_env_ramp_steps: int = 1000


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
    kappa: float = 2.0  # reconstruction threshold multiple [ours, calibrated: docs/method.md]
    # Additive slack of the threshold, kappa * L_s + margin, in nats per image [ours]: once an
    # environment is learnt to ~1 nat (three static sprites), kappa * L alone is batch noise.
    error_margin: float = 25.0
    patience: int = 10  # consecutive "new" verdicts before allocating [ours]
    error_ema: float = 0.95  # running reconstruction error L_s [ours]
    # A latent counts as "used" by an environment when it carries more than this many nats of
    # information: KL minus atypicality, an estimate of I(x; z_n) [ours].
    used_kl: float = 0.1
    # Re-identifying a PAST environment s also needs the batch's latent usage to agree with s's
    # [ours]: a latent s does not use, that another environment relies on (usage above
    # relied_kl nats), must not carry more than foreign_use times that usage on this batch.
    relied_kl: float = 1.0
    foreign_use: float = 0.5
    # While a switch back into a past environment is on probation, the mask test (rule 3) counts
    # as relied on only the latents it used before the switch [ours]: its smoothed alpha of a
    # latent it starts using now is stale, from before it left.
    probation_relies_on_past_usage: bool = False
    classifier_lr: float = 1e-3
    # Steps after an allocation during which no further allocation happens [ours].
    cooldown: int = 200


@dataclass
class DreamConfig:
    # D: dreaming feedback (eq. 7).
    enabled: bool = True
    decoder_term: bool = True  # False gives the SD-[41] variant
    snapshot_every: int = 1000  # tau [paper: a hyperparameter; value ours]
    batch_size: int = 32
    # Weights of eq. 7's two terms [ours; unpublished]. A decoder weight of 10 makes the older
    # slots forget less, but a slot that keeps its data well also accepts new data: on the digits
    # moving MNIST then joined moving Fashion's slot in 3 of 10 seeds (none at 1). Both at 10 merged
    # the sprites (docs/method.md, "A heavier dream decoder term").
    encoder_weight: float = 1.0
    decoder_weight: float = 1.0


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
    # by `vase bench --device`; fp32 is the default everywhere (docs/devices.md).
    precision: str = "fp32"
    # torch.compile the encoder's and decoder's forward passes (measured by `vase bench --device`).
    compile: bool = False
    # Deterministic kernels on accelerators (cuDNN, cuBLAS); the CPU path is deterministic as is.
    deterministic: bool = False
    checkpoint_every: int = 1000
    log_every: int = 50
    image_every: int = 500
    progress: bool = True


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


@dataclass
class Config:
    version: int = CONFIG_VERSION
    preset: str = "cpu"
    schedule: str = "short"
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    mask: MaskConfig = field(default_factory=MaskConfig)
    inference: InferenceConfig = field(default_factory=InferenceConfig)
    dream: DreamConfig = field(default_factory=DreamConfig)
    imagination: ImaginationConfig = field(default_factory=ImaginationConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    probe: ProbeConfig = field(default_factory=ProbeConfig)

    # -- ablation switches (Table 1) -------------------------------------------------------------
    def ablation(self) -> str:
        """The Table 1 row name of this config: '-', 'S', ..., 'SDA' or 'SD-[41]'."""
        code = ("S" if self.inference.enabled else "") + ("D" if self.dream.enabled else "")
        code += "A" if self.mask.enabled else ""
        if self.dream.enabled and not self.dream.decoder_term:
            return code + "-[41]"
        return code or "-"

    def set_ablation(self, code: str) -> None:
        code = code.strip().upper()
        sd41 = code == "SD-[41]"
        letters = "SD" if sd41 else ("" if code == "-" else code)
        if not set(letters) <= set("SDA") or len(set(letters)) != len(letters):
            raise ConfigError(
                f"unknown ablation {code!r}: use '-', a combination of S, D and A (e.g. SDA), or SD-[41]"
            )
        self.inference.enabled = "S" in letters
        self.dream.enabled = "D" in letters
        self.mask.enabled = "A" in letters
        self.dream.decoder_term = not sd41

    def inert_settings(self) -> set[str]:
        """Settings this config's training never reads, so two runs differing only there train alike.

        A new environment's capacity ramp acts only at an allocation (S on) and only on the
        capacity target, which the entangled objective does not have. A grid over runs made before
        the setting existed (loaded with 0) then still accepts the rows it cannot have changed.
        Likewise eq. 7's decoder weight acts only with dreams and their decoder term (not in "-",
        S, A, SA or SD-[41])."""
        inert = set()
        if not self.inference.enabled or self.objective.mode == "entangled":
            # Both act only in an environment allocated after the first, on the capacity objective.
            inert |= {"objective.new_env_ramp_steps", "objective.fresh_aggregate_weight"}
        if not (self.dream.enabled and self.dream.decoder_term):
            inert.add("dream.decoder_weight")
        return inert

    # -- serialisation -----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["ablation"] = self.ablation()
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Config":
        cfg = cls()
        for key, value in d.items():
            if key == "ablation":
                continue
            if key not in _field_types(cls):
                raise ConfigError(f"unknown config key {key!r}")
            sub = getattr(cfg, key)
            if dataclasses.is_dataclass(sub):
                if not isinstance(value, dict):
                    raise ConfigError(f"config section {key!r} must be a mapping")
                for k, v in value.items():
                    _set_field(sub, k, v, f"{key}.{k}")
            else:
                setattr(cfg, key, _coerce(_field_types(cls)[key], value, key))
        return cfg

    def override(self, assignment: str) -> None:
        """Apply one ``section.field=value`` override."""
        if "=" not in assignment:
            raise ConfigError(f"override {assignment!r} must look like section.field=value")
        path, value = assignment.split("=", 1)
        parts = path.strip().split(".")
        if len(parts) != 2 or not dataclasses.is_dataclass(getattr(self, parts[0], None)):
            raise ConfigError(
                f"unknown setting {path!r}; settings are section.field with sections "
                + ", ".join(f.name for f in fields(self) if dataclasses.is_dataclass(getattr(self, f.name)))
            )
        _set_field(getattr(self, parts[0]), parts[1], value, path)

    def validate(self) -> "Config":
        """Refuse impossible settings with one clear message each."""
        errs = []
        if self.mask.lambda_low >= self.mask.lambda_high:
            errs.append(
                f"mask.lambda_low ({self.mask.lambda_low}) must be < mask.lambda_high ({self.mask.lambda_high})"
            )
        if self.train.batch_size <= 0:
            errs.append("train.batch_size must be positive")
        if self.imagination.batch_size <= 0 or self.imagination.weight < 0:
            errs.append("imagination.batch_size must be positive and imagination.weight >= 0")
        if self.dream.batch_size <= 0:
            errs.append("dream.batch_size must be positive")
        if self.model.k_max < 1:
            errs.append("model.k_max must be at least 1")
        if self.objective.gamma < 0:
            errs.append("objective.gamma must be >= 0")
        if self.objective.aggregate_weight < 0:
            errs.append("objective.aggregate_weight must be >= 0")
        if self.objective.fresh_aggregate_weight < 0:
            errs.append("objective.fresh_aggregate_weight must be >= 0")
        if self.objective.capacity_form not in ("squared", "absolute"):
            errs.append(
                f"objective.capacity_form must be 'squared' or 'absolute', got {self.objective.capacity_form!r}"
            )
        if self.inference.rules not in RULE_SETS:
            errs.append(f"inference.rules must be one of {', '.join(RULE_SETS)}, got {self.inference.rules!r}")
        if self.objective.mode not in ("disentangled", "entangled"):
            errs.append("objective.mode must be 'disentangled' or 'entangled'")
        if self.objective.capacity_ramp_steps < 0:
            errs.append("objective.capacity_ramp_steps must be >= 0")
        if self.objective.new_env_ramp_steps < 0:
            errs.append("objective.new_env_ramp_steps must be >= 0")
        if not 0.0 <= self.mask.ema < 1.0 or not 0.0 <= self.inference.error_ema < 1.0:
            errs.append("mask.ema and inference.error_ema must be in [0, 1)")
        if self.inference.kappa <= 0 or self.inference.error_margin < 0:
            errs.append("inference.kappa must be > 0 and inference.error_margin >= 0")
        if self.inference.relied_kl <= 0 or self.inference.foreign_use <= 0:
            errs.append("inference.relied_kl and inference.foreign_use must be > 0")
        if self.inference.patience < 1:
            errs.append("inference.patience must be at least 1")
        if self.dream.snapshot_every < 1:
            errs.append("dream.snapshot_every must be at least 1")
        for name in ("checkpoint_every", "log_every", "image_every"):
            if getattr(self.train, name) < 1:
                errs.append(f"train.{name} must be at least 1")
        if self.probe.every < 1 or self.probe.train_size < 2 or self.probe.test_size < 1:
            errs.append("probe.every, probe.train_size and probe.test_size must be positive")
        if self.probe.reading not in ("mean", "sample"):
            errs.append(f"probe.reading must be 'mean' or 'sample', got {self.probe.reading!r}")
        if not self.data.env_names():
            errs.append("data.sequence is empty")
        try:
            if any(s <= 0 for s in self.data.env_steps()):
                errs.append("data.steps_per_env must be positive")
        except ConfigError as e:
            errs.append(str(e))
        try:
            chans = self.model.channel_list()
            if len(chans) != 4 or any(c <= 0 for c in chans):
                errs.append("model.channels must be 4 positive integers")
        except ValueError:
            errs.append(f"model.channels must be 4 comma-separated integers, got {self.model.channels!r}")
        if self.model.latents < 1:
            errs.append("model.latents must be at least 1")
        if self.train.precision not in ("fp32", "bf16"):
            errs.append(f"train.precision must be 'fp32' or 'bf16', got {self.train.precision!r}")
        if self.model.weight_grad_kernel not in ("native", "onednn"):
            errs.append(f"model.weight_grad_kernel must be 'native' or 'onednn', got {self.model.weight_grad_kernel!r}")
        if errs:
            raise ConfigError("; ".join(errs))
        return self


def _field_types(cls) -> dict[str, Any]:
    return get_type_hints(cls)


def _coerce(typ: Any, value: Any, name: str) -> Any:
    try:
        if typ is bool:
            if isinstance(value, str):
                low = value.strip().lower()
                if low in ("1", "true", "yes", "on"):
                    return True
                if low in ("0", "false", "no", "off"):
                    return False
                raise ValueError(value)
            return bool(value)
        if typ is int:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError(value)
            return int(value)
        if typ is float:
            return float(value)
        if typ is str:
            return str(value)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{name}: cannot read {value!r} as {typ.__name__}") from e
    return value


def _set_field(obj: Any, key: str, value: Any, name: str) -> None:
    types = _field_types(type(obj))
    if key not in types:
        known = ", ".join(sorted(types))
        raise ConfigError(f"unknown setting {name!r}; known fields: {known}")
    setattr(obj, key, _coerce(types[key], value, name))


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.json"))


def load_preset(name: str) -> Config:
    path = PRESET_DIR / f"{name}.json"
    if not path.exists():
        raise ConfigError(f"unknown preset {name!r}; known presets: {', '.join(preset_names())}")
    cfg = Config.from_dict(json.loads(path.read_text()))
    cfg.preset = name
    return cfg


def schedule_names() -> list[str]:
    return sorted(p.stem for p in SCHEDULE_DIR.glob("*.json"))


def schedule_overrides(name: str) -> list[str]:
    """The `section.field=value` settings of a named schedule."""
    path = SCHEDULE_DIR / f"{name}.json"
    if not path.exists():
        raise ConfigError(f"unknown schedule {name!r}; known schedules: {', '.join(schedule_names())}")
    return [f"{section}.{key}={value}" for section, values in json.loads(path.read_text()).items()
            for key, value in values.items()]


def build_config(preset: str = "cpu", overrides: list[str] | None = None, ablation: str | None = None,
                 schedule: str = "short") -> Config:
    """The preset, then the schedule, then the ablation, then the overrides (which win)."""
    cfg = load_preset(preset)
    for o in schedule_overrides(schedule):
        cfg.override(o)
    cfg.schedule = schedule
    if ablation is not None:
        cfg.set_ablation(ablation)
    for o in overrides or []:
        cfg.override(o)
    return cfg.validate()


def option_overrides(sequence: str | None = None, steps: str | None = None, entangled: bool = False,
                     seed: int | None = None, data_root: str | None = None, download: bool = False) -> list[str]:
    """The ``section.field=value`` overrides that `vase train`'s own options stand for (`vase grid`
    builds each of its runs' configs from the same list)."""
    sets = []
    if sequence:
        sets.append(f"data.sequence={sequence}")
    if steps:
        sets.append(f"data.steps_per_env={steps}")
    if entangled:
        sets.append("objective.mode=entangled")
    if seed is not None:
        sets.append(f"train.seed={seed}")
    if data_root:
        sets.append(f"data.root={data_root}")
    if download:
        sets.append("data.download=true")
    return sets


# Settings added after runs were made whose default is not what those runs did: a config.json
# without the field gets the value its run trained with. (A new field whose default reproduces the
# old behaviour needs no entry: the dataclass default fills it.)
MIGRATIONS = {
    "model.weight_grad_kernel": "onednn",  # oneDNN computed the weight gradients before the kernel
    "objective.new_env_ramp_steps": 0,  # every environment met C(t) at once
    "objective.fresh_aggregate_weight": 0.0,  # no fresh-latent penalty
    "objective.capacity_form": "absolute",  # the CCI-VAE's |KL - C|
}


def load_run_config(run_dir: Path) -> Config:
    """The resolved config a run was started with (its config.json)."""
    path = Path(run_dir) / "config.json"
    try:
        d = json.loads(path.read_text())
    except FileNotFoundError as e:
        raise ConfigError(f"{path} not found: is {run_dir} a vase run directory?") from e
    except ValueError as e:
        raise ConfigError(f"{path} is not valid JSON ({e})") from e
    if d.get("version") != CONFIG_VERSION:
        raise ConfigError(
            f"{run_dir} was written with config version {d.get('version')}; this vase reads version "
            f"{CONFIG_VERSION}, so the run cannot be resumed or evaluated by this code"
        )
    for path, value in MIGRATIONS.items():
        section, key = path.split(".")
        if isinstance(d.get(section), dict):
            d[section].setdefault(key, value)
    return Config.from_dict(d).validate()
