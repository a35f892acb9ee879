"""How a run directory's config.json, written by an earlier release, reads today.

One table, MIGRATIONS: for each setting whose saved form changed, that was added with a default
other than what earlier runs did, or that was removed, the rule that turns what such a config.json
holds into what those runs trained with. A new field whose default reproduces the old behaviour
needs no entry: the dataclass default fills it.
"""
from __future__ import annotations

from typing import Any, Callable

from vase.config_values import comma_list
from vase.errors import ConfigError

MISSING = object()  # the setting is not in the config.json at all


def added(value: Any) -> Callable[[Any], Any]:
    """A setting added after runs were made: a config.json without it gets `value`."""
    return lambda saved: value if saved is MISSING else saved


def removed(path: str, inert: Any) -> Callable[[Any], Any]:
    """A setting that was removed: a config.json that holds it at `inert`, the value at which it
    changed nothing, trains today as it did; any other value cannot be reproduced, and is refused."""
    def read(saved: Any) -> Any:
        if saved is not MISSING and saved != inert:
            raise ConfigError(f"this run was made with {path}={saved!r}, a setting vase no longer has "
                              f"(only {inert!r} is reproduced); use the vase release it was made with")
        return MISSING
    return read


def dropped(saved: Any) -> Any:
    """A setting of a rule deleted because it changed no verdict in any run we measured (docs/method.md,
    rules beyond eq. 6): its value is dropped, and the run goes on without the rule."""
    return MISSING


# Rules deleted because no run we measured needed them: they changed no verdict, or the runs without
# them were the runs with them (docs/method.md, rules beyond eq. 6).
DELETED_RULES = ("current_first", "foreign_latents", "ranked_fallback", "resettling")


def without_deleted_rules(saved: Any) -> Any:
    """inference.without less the deleted rules: a run made without one is the run of today's set."""
    return saved if not isinstance(saved, list) else [name for name in saved if name not in DELETED_RULES]


def comma_text(saved: Any) -> Any:
    """A list setting saved as comma text ("32,32,32,32"), as every list was before lists were JSON."""
    return comma_list(saved) if isinstance(saved, str) else saved


MIGRATIONS: dict[str, Callable[[Any], Any]] = {
    "model.weight_grad_kernel": added("onednn"),  # oneDNN computed the weight gradients before the kernel
    "objective.new_env_ramp_steps": added(0),  # every environment met C(t) at once
    "objective.fresh_aggregate_weight": added(0.0),  # no fresh-latent penalty
    "objective.capacity_form": added("absolute"),  # the CCI-VAE's |KL - C|
    # Rules pruned for want of a failure they fix (docs/method.md, rules beyond eq. 6).
    "objective.aggregate_weight": removed("objective.aggregate_weight", 0.0),
    "inference.probation_relies_on_past_usage": removed("inference.probation_relies_on_past_usage", False),
    # Measured and rejected (docs/method.md, "The optimiser at an arrival").
    "train.reset_optimizer_at_allocation": removed("train.reset_optimizer_at_allocation", False),
    "inference.relied_kl": dropped,  # foreign_latents
    "inference.foreign_use": dropped,
    "inference.without": without_deleted_rules,
    "data.sequence": comma_text,
    "data.steps_per_env": comma_text,
    "model.channels": comma_text,
}


def migrate(saved: dict[str, Any]) -> dict[str, Any]:
    """A config.json's content as this release reads it (`saved` itself is left as it is)."""
    out = {key: dict(value) if isinstance(value, dict) else value for key, value in saved.items()}
    for path, rule in MIGRATIONS.items():
        section, key = path.split(".")
        if isinstance(out.get(section), dict):
            value = rule(out[section].get(key, MISSING))
            if value is not MISSING:
                out[section][key] = value
            else:
                out[section].pop(key, None)
    return out
