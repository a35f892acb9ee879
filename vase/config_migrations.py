"""How a run directory's config.json, written by an earlier release, reads today.

One table, MIGRATIONS: for each setting whose saved form changed, that was added with a default
other than what earlier runs did, or that was removed, the rule that turns what such a config.json
holds into what those runs trained with. A rule reads the setting's saved value and, where the
setting mattered only in some runs, the whole saved config. A new field whose default reproduces
the old behaviour needs no entry: the dataclass default fills it.
"""
from __future__ import annotations

from typing import Any, Callable

from vase.config_values import comma_list
from vase.errors import Unreproducible

MISSING = object()  # the setting is not in the config.json at all


Migration = Callable[[Any, dict[str, Any]], Any]  # (saved value, saved config) -> value, or MISSING

# Eq. 7's (encoder, decoder) weights as eq. 8 prints them, unweighted: what a run made before the
# encoder weight's default became 10 trained with (docs/regime.md, "Eq. 7's encoder weight: 10").
EQ8_DREAM_WEIGHTS = (1.0, 1.0)
# C_max of every run made before results.json recorded it: the setting's default then, 25 nats.
C_MAX_BEFORE_RECORDED = 25.0


def added(value: Any) -> Migration:
    """A setting added after runs were made: a config.json without it gets `value`."""
    return lambda saved, config: value if saved is MISSING else saved


def removed(path: str, inert: Any, acted: Callable[[dict[str, Any]], bool] = lambda config: True) -> Migration:
    """A setting that was removed: a config.json that holds it at `inert`, the value that is now
    the method's behaviour, trains today as it did; any other value cannot be reproduced, and is
    refused for training (`Unreproducible`). `acted`: whether the setting changed anything in a run
    of this saved config; where it did not, any value reads. A config.json made before the setting
    existed cannot be told from one made after it was removed, and reads as today's."""
    def read(saved: Any, config: dict[str, Any]) -> Any:
        if saved is not MISSING and saved != inert and acted(config):
            raise Unreproducible(f"this run was made with {path}={saved!r}, a setting vase no longer has "
                                 f"(only {inert!r} is reproduced); use the vase release it was made with")
        return MISSING
    return read


def dropped(saved: Any, config: dict[str, Any]) -> Any:
    """A setting of a rule deleted because it changed no verdict in any run we measured (docs/method.md,
    rules beyond eq. 6): its value is dropped, and the run goes on without the rule."""
    return MISSING


# Rules deleted because no run we measured needed them: they changed no verdict, or the runs without
# them kept every figure we judge by; or, classifier_on_dreams, because the run with it failed; or,
# balanced_classifier and model_error, because the default set could not have them on (docs/method.md,
# rules beyond eq. 6).
DELETED_RULES = ("current_first", "foreign_latents", "ranked_fallback", "resettling", "probation",
                 "classifier_on_dreams", "balanced_classifier", "model_error")


def without_deleted_rules(saved: Any, config: dict[str, Any]) -> Any:
    """inference.without less the deleted rules: a run made without one is the run of today's set."""
    return saved if not isinstance(saved, list) else [name for name in saved if name not in DELETED_RULES]


def comma_text(saved: Any, config: dict[str, Any]) -> Any:
    """A list setting saved as comma text ("32,32,32,32"), as every list was before lists were JSON."""
    return comma_list(saved) if isinstance(saved, str) else saved


def holds_pending_batches(config: dict[str, Any]) -> bool:
    """Whether frozen_while_pending judged the run's pending batches: S on, and the rule in its set."""
    inference = config.get("inference", {})
    return inference.get("enabled", True) and "frozen_while_pending" not in inference.get("without", [])


MIGRATIONS: dict[str, Migration] = {
    "model.weight_grad_kernel": added("onednn"),  # oneDNN computed the weight gradients before the kernel
    "objective.fresh_aggregate_weight": added(0.0),  # no fresh-latent penalty
    "objective.capacity_form": added("absolute"),  # the CCI-VAE's |KL - C|
    "dream.sync_at_allocation": added(True),  # the snapshot was re-synced at every allocation
    "dream.encoder_weight": added(EQ8_DREAM_WEIGHTS[0]),
    "train.keep_every": added(0),  # the stage ends' checkpoints were the only ones kept
    "train.flush_denormals": added(False),  # denormals were computed as they are
    # Rules pruned for want of a failure they fix (docs/method.md, rules beyond eq. 6).
    "objective.aggregate_weight": removed("objective.aggregate_weight", 0.0),
    "inference.probation_relies_on_past_usage": removed("inference.probation_relies_on_past_usage", False),
    # Measured and rejected (docs/regime.md, "The optimiser at an arrival").
    "train.reset_optimizer_at_allocation": removed("train.reset_optimizer_at_allocation", False),
    "train.max_grad_norm": removed("train.max_grad_norm", 0.0),
    # Measured and rejected (docs/regime.md, "q_psi on dreams").
    "inference.classifier_on_dreams": removed("inference.classifier_on_dreams", False),
    # Measured and rejected (docs/regime.md, "Returns at the short schedule").
    "objective.capacity_clock": removed("objective.capacity_clock", "run"),
    "objective.return_ramp_steps": removed("objective.return_ramp_steps", 0),
    # Off by default, so deleted (docs/regime.md, "q_psi's prior").
    "inference.balanced_classifier": removed("inference.balanced_classifier", False),
    # Refused a returning environment, so deleted (docs/regime.md, "Eq. 6's error less the images' entropy").
    "inference.error_less_entropy": removed("inference.error_less_entropy", False),
    # Held out by frozen_while_pending (docs/regime.md, "The pending batches at an arrival").
    "inference.pending_batches_train": removed("inference.pending_batches_train", False, acted=holds_pending_batches),
    "inference.relied_kl": dropped,  # foreign_latents
    "inference.foreign_use": dropped,
    "inference.without": without_deleted_rules,
    "data.sequence": comma_text,
    "data.steps_per_env": comma_text,
    "model.channels": comma_text,
}


def migrate(saved: dict[str, Any], trains: bool = True) -> dict[str, Any]:
    """A config.json's content as this release reads it (`saved` itself is left as it is). With
    `trains` false the run is only read (evaluated, inspected), never continued, so a removed
    setting that changed its training reads too."""
    out = {key: dict(value) if isinstance(value, dict) else value for key, value in saved.items()}
    for path, rule in MIGRATIONS.items():
        section, key = path.split(".")
        if isinstance(out.get(section), dict):
            try:
                value = rule(out[section].get(key, MISSING), out)
            except Unreproducible:
                if trains:
                    raise
                value = MISSING
            if value is not MISSING:
                out[section][key] = value
            else:
                out[section].pop(key, None)
    return out
