"""What makes a config impossible to train: every such setting, each with one clear message."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from vase.config_sections import CHOICES, RULE_SETS
from vase.errors import ConfigError

if TYPE_CHECKING:
    from vase.config import Config


def setting(cfg: Config, key: str):
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


# The settings that must lie in a range: whether they do, and the message when not.
BOUNDS: tuple[tuple[Callable[[Config], bool], str], ...] = (
    (lambda c: c.train.batch_size > 0, "train.batch_size must be positive"),
    (lambda c: c.imagination.batch_size > 0 and c.imagination.weight >= 0,
     "imagination.batch_size must be positive and imagination.weight >= 0"),
    (lambda c: c.dream.batch_size > 0, "dream.batch_size must be positive"),
    (lambda c: c.model.k_max >= 1, "model.k_max must be at least 1"),
    (lambda c: c.objective.gamma >= 0, "objective.gamma must be >= 0"),
    (lambda c: c.objective.fresh_aggregate_weight >= 0, "objective.fresh_aggregate_weight must be >= 0"),
    (lambda c: c.objective.capacity_ramp_steps >= 0, "objective.capacity_ramp_steps must be >= 0"),
    (lambda c: c.objective.new_env_ramp_steps >= 0, "objective.new_env_ramp_steps must be >= 0"),
    (lambda c: 0.0 <= c.mask.ema < 1.0 and 0.0 <= c.inference.error_ema < 1.0,
     "mask.ema and inference.error_ema must be in [0, 1)"),
    (lambda c: c.inference.kappa > 0 and c.inference.error_margin >= 0,
     "inference.kappa must be > 0 and inference.error_margin >= 0"),
    (lambda c: c.inference.patience >= 1, "inference.patience must be at least 1"),
    (lambda c: c.dream.snapshot_every >= 1, "dream.snapshot_every must be at least 1"),
    (lambda c: c.train.checkpoint_minutes >= 0, "train.checkpoint_minutes must be >= 0 (0: checkpoint by steps only)"),
    (lambda c: c.train.keep_every >= 0, "train.keep_every must be >= 0 (0: keep the stage ends only)"),
    *((lambda c, name=name: getattr(c.train, name) >= 1, f"train.{name} must be at least 1")
      for name in ("checkpoint_every", "log_every", "image_every")),
    (lambda c: c.probe.every >= 1 and c.probe.train_size >= 2 and c.probe.test_size >= 1,
     "probe.every, probe.train_size and probe.test_size must be positive"),
)


def problems(cfg: Config) -> list[str]:
    """One message per impossible setting of `cfg`; [] when it can be trained."""
    errs = []
    if cfg.mask.lambda_low >= cfg.mask.lambda_high:
        errs.append(
            f"mask.lambda_low ({cfg.mask.lambda_low}) must be < mask.lambda_high ({cfg.mask.lambda_high})"
        )
    errs += [message for holds, message in BOUNDS if not holds(cfg)]
    errs += [f"{key} must be one of {', '.join(map(repr, names))}, got {value!r}"
             for key, names in CHOICES.items() if (value := setting(cfg, key)) not in names]
    if cfg.inference.rules in RULE_SETS and cfg.inference.without:
        from vase.rules import RULE_SETS as SETS  # torch, only where rules are named

        absent = [name for name in cfg.inference.without if name not in SETS[cfg.inference.rules]]
        if absent:
            errs.append(f"inference.without names rules that the '{cfg.inference.rules}' set does not have: "
                        f"{', '.join(absent)} (it has {', '.join(SETS[cfg.inference.rules])})")
    if not cfg.data.sequence:
        errs.append("data.sequence is empty")
    try:
        if any(s <= 0 for s in cfg.data.env_steps()):
            errs.append("data.steps_per_env must be positive")
    except ConfigError as e:
        errs.append(str(e))
    if len(cfg.model.channels) != 4 or any(c <= 0 for c in cfg.model.channels):
        errs.append(f"model.channels must be 4 positive integers, got {cfg.model.channels}")
    if not 0.0 <= cfg.model.negative_slope < 1.0:
        errs.append(f"model.negative_slope must be in [0, 1), got {cfg.model.negative_slope}")
    if cfg.model.latents < 1:
        errs.append("model.latents must be at least 1")
    return errs
