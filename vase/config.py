"""One typed config for a VASE run: the sections together, and how a run's config is made.

A config is a preset (network size, ``vase/presets``), then a schedule (run lengths,
``vase/schedules``), then an ablation (the Table 1 row), then ``section.field=value`` overrides,
which win. The settings themselves, each with where its value comes from, are the sections of
`vase.config_sections`. The resolved config is written into every run directory (config.json),
which `load_run_config` reads back, however old (`vase.config_migrations`).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_type_hints

from vase.config_checks import problems, setting
from vase.config_migrations import migrate
from vase.config_sections import (
    DataConfig,
    DreamConfig,
    ImaginationConfig,
    InferenceConfig,
    MaskConfig,
    ModelConfig,
    ObjectiveConfig,
    ProbeConfig,
    TrainConfig,
)
from vase.config_values import assign, coerce, set_field
from vase.errors import ConfigError

CONFIG_VERSION = 1
PRESET_DIR = Path(__file__).parent / "presets"
# Schedules set the lengths of a run together: steps, the capacity ramp, tau, the probe interval and
# the new-slot settings (docs/regime.md, "The regime").
SCHEDULE_DIR = Path(__file__).parent / "schedules"
# Settings that say which checkpoints a run keeps, not what it trains: a resume may change them
# (`vase train --resume RUN --set train.keep_every=2000`), so that a run already under way keeps
# checkpoints to replay or branch from (docs/usage.md, "What a run writes").
KEPT_NOT_TRAINED = frozenset({"train.keep_every"})


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

        The fresh-latent penalty acts only in an environment allocated after the first (S on) and
        only on the capacity objective, not the entangled one. A grid over runs made before such a
        setting existed then still accepts the rows it cannot have changed.
        Likewise eq. 7's decoder weight acts only with dreams and their decoder term (not in "-",
        S, A, SA or SD-[41]), and the snapshot's sync at an allocation only with D and S."""
        inert = set()
        if not self.inference.enabled or self.objective.mode == "entangled":  # one environment, or no C(t)
            inert.add("objective.fresh_aggregate_weight")
        if not (self.dream.enabled and self.dream.decoder_term):
            inert.add("dream.decoder_weight")
        if not (self.dream.enabled and self.inference.enabled):  # no snapshot, or no allocation
            inert.add("dream.sync_at_allocation")
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
        cfg.update(d)
        return cfg

    def update(self, d: dict[str, Any]) -> None:
        """Set the settings of a JSON mapping, ``{"section": {"field": value}}`` and top-level fields."""
        types = get_type_hints(type(self))
        for key, value in d.items():
            if key == "ablation":  # to_dict writes it for readers; the switches of the sections hold it
                continue
            if key not in types:
                raise ConfigError(f"unknown config key {key!r}")
            section = getattr(self, key)
            if not dataclasses.is_dataclass(section):
                setattr(self, key, coerce(types[key], value, key))
            elif not isinstance(value, dict):
                raise ConfigError(f"config section {key!r} must be a mapping")
            else:
                for k, v in value.items():
                    set_field(section, k, v, f"{key}.{k}")

    def override(self, assignment: str) -> None:
        """Apply one ``section.field=value`` from the command line (a list as comma text)."""
        assign(self, assignment)

    def validate(self) -> "Config":
        """Refuse impossible settings with one clear message each."""
        errs = problems(self)
        if errs:
            raise ConfigError("; ".join(errs))
        return self


def _read_json(directory: Path, name: str, what: str) -> dict[str, Any]:
    path = directory / f"{name}.json"
    if not path.exists():
        known = ", ".join(sorted(p.stem for p in directory.glob("*.json")))
        raise ConfigError(f"unknown {what} {name!r}; known {what}s: {known}")
    return json.loads(path.read_text())


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.json"))


def load_preset(name: str) -> Config:
    cfg = Config.from_dict(_read_json(PRESET_DIR, name, "preset"))
    cfg.preset = name
    return cfg


def schedule_names() -> list[str]:
    return sorted(p.stem for p in SCHEDULE_DIR.glob("*.json"))


def schedule_settings(name: str) -> dict[str, Any]:
    """The settings of a named schedule, ``{"section": {"field": value}}``."""
    return _read_json(SCHEDULE_DIR, name, "schedule")


def build_config(preset: str = "cpu", overrides: list[str] | None = None, ablation: str | None = None,
                 schedule: str = "short") -> Config:
    """The preset, then the schedule, then the ablation, then the overrides (which win)."""
    cfg = load_preset(preset)
    cfg.update(schedule_settings(schedule))
    cfg.schedule = schedule
    if ablation is not None:
        cfg.set_ablation(ablation)
    for o in overrides or []:
        cfg.override(o)
    return cfg.validate()


def option_overrides(sequence: str | None = None, steps: str | None = None, entangled: bool = False,
                     seed: int | None = None, data_root: str | None = None, download: bool = False) -> list[str]:
    """The ``section.field=value`` overrides that `vase train`'s own options stand for (`vase grid`
    builds each of its runs' configs from the same list). Lists are comma text, as typed."""
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


def resume_overrides(cfg: Config, overrides: list[str]) -> bool:
    """Apply to a resumed run's config the overrides a resume may make (KEPT_NOT_TRAINED), and say
    whether they changed it; refuse any other setting, naming the ones it may."""
    kept = sorted(KEPT_NOT_TRAINED)
    before = [setting(cfg, name) for name in kept]
    for assignment in overrides:
        name = assignment.split("=", 1)[0].strip()
        if name not in KEPT_NOT_TRAINED:
            raise ConfigError(f"--resume continues a run with its own config.json; of its settings only "
                              f"{', '.join(kept)} may be set again, not {name}")
        cfg.override(assignment)
    cfg.validate()
    return [setting(cfg, name) for name in kept] != before


def config_json_with_kept(run_dir: Path, cfg: Config) -> bytes:
    """The run's config.json with cfg's KEPT_NOT_TRAINED settings, the rest as saved (a resume's
    data root, say, is where the data is now, not part of the run)."""
    saved = json.loads((Path(run_dir) / "config.json").read_text())
    for name in KEPT_NOT_TRAINED:
        section, key = name.split(".")
        saved[section][key] = setting(cfg, name)
    return json.dumps(saved, indent=2, sort_keys=True).encode()


def load_run_config(run_dir: Path, data_root: str | None = None, download: bool = False,
                    trains: bool = True) -> Config:
    """The resolved config a run was started with (its config.json), read as this release reads it.

    `data_root` and `download` say where the run's data lives now, or may come from: that does not
    change the run, so a run may be resumed or inspected on another machine. `trains` false: the
    run will only be read (its saved weights evaluated or drawn), so a setting vase no longer has
    does not stop it (`vase.config_migrations.migrate`)."""
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
    cfg = Config.from_dict(migrate(d, trains)).validate()
    cfg.data.root = data_root or cfg.data.root
    cfg.data.download = download or cfg.data.download
    return cfg
