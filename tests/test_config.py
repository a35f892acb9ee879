"""The config: list settings as lists, read once from command-line text, and old run directories."""
import json

import pytest

from vase.config import Config, build_config, load_run_config, option_overrides
from vase.config_checks import setting
from vase.config_migrations import MIGRATIONS, migrate
from vase.config_sections import CHOICES
from vase.errors import ConfigError
from vase.rules import as_configured

LISTS = ("data.sequence", "data.steps_per_env", "model.channels")


def _a_config() -> Config:
    return build_config("paper", ["data.sequence=moving_fashion,mnist", "data.steps_per_env=300,500"], "SD")


def _as_comma_text(saved: dict) -> dict:
    """A config.json as releases before list settings wrote it: every list as comma text."""
    for path in LISTS:
        section, key = path.split(".")
        saved[section][key] = ",".join(str(v) for v in saved[section][key])
    return saved


def test_list_settings_are_lists_and_saved_as_json_lists(tmp_path):
    cfg = _a_config()
    assert cfg.data.sequence == ["moving_fashion", "mnist"]
    assert cfg.data.steps_per_env == [300, 500] and cfg.model.channels == [64, 64, 128, 128]
    saved = json.loads(cfg.to_json())
    assert saved["data"]["sequence"] == ["moving_fashion", "mnist"] and saved["model"]["channels"] == [64, 64, 128, 128]
    (tmp_path / "config.json").write_text(cfg.to_json())
    assert load_run_config(tmp_path) == cfg


def test_a_config_json_with_comma_text_lists_loads_to_the_same_config(tmp_path):
    cfg = _a_config()
    old = _as_comma_text(json.loads(cfg.to_json()))
    assert old["data"]["sequence"] == "moving_fashion,mnist" and old["model"]["channels"] == "64,64,128,128"
    (tmp_path / "config.json").write_text(json.dumps(old))
    assert load_run_config(tmp_path) == cfg
    assert json.loads((tmp_path / "config.json").read_text()) == old  # read, never rewritten


def test_one_step_count_given_as_text_stands_for_every_environment(tmp_path):
    cfg = build_config("cpu", ["data.steps_per_env=40"])
    old = _as_comma_text(json.loads(cfg.to_json()))
    assert old["data"]["steps_per_env"] == "40"
    (tmp_path / "config.json").write_text(json.dumps(old))
    loaded = load_run_config(tmp_path)
    assert loaded == cfg and loaded.data.env_steps() == [40, 40, 40]


def test_migrations_only_fill_or_convert_and_leave_their_input_alone():
    saved = json.loads(build_config("cpu").to_json())
    assert migrate(saved) == saved  # a config.json of this release needs nothing
    del saved["objective"]["capacity_form"]
    saved["model"]["channels"] = "8,8,8,8"
    migrated = migrate(saved)
    assert migrated["objective"]["capacity_form"] == "absolute"
    assert migrated["model"]["channels"] == ["8", "8", "8", "8"]
    assert "capacity_form" not in saved["objective"] and saved["model"]["channels"] == "8,8,8,8"
    assert set(LISTS) <= set(MIGRATIONS)


def test_a_run_made_before_sync_at_allocation_existed_resumes_synced_at_its_allocations(tmp_path):
    """Every allocation re-synced the snapshot before dream.sync_at_allocation existed, so a config.json
    without it reads True, while a new run is synced every tau only."""
    saved = json.loads(build_config("cpu").to_json())
    assert saved["dream"]["sync_at_allocation"] is False
    del saved["dream"]["sync_at_allocation"]
    (tmp_path / "config.json").write_text(json.dumps(saved))
    assert load_run_config(tmp_path).dream.sync_at_allocation is True


def test_a_run_made_at_eq8s_dream_weights_reads_them_back(tmp_path):
    """A config.json without dream.encoder_weight was trained with eq. 7's encoder term at 1, as eq. 8
    prints it, while a new run's default is 10 (docs/regime.md, "Eq. 7's encoder weight: 10")."""
    saved = json.loads(build_config("cpu").to_json())
    assert saved["dream"]["encoder_weight"] == 10.0
    del saved["dream"]["encoder_weight"]
    (tmp_path / "config.json").write_text(json.dumps(saved))
    assert load_run_config(tmp_path).dream.encoder_weight == 1.0


@pytest.mark.parametrize("path, inert, other", [
    ("objective.aggregate_weight", 0.0, 0.5),
    ("inference.probation_relies_on_past_usage", False, True),
    ("train.reset_optimizer_at_allocation", False, True),
    ("train.max_grad_norm", 0.0, 10000.0),
    ("inference.classifier_on_dreams", False, True),
    ("inference.balanced_classifier", False, True),
    ("inference.error_less_entropy", False, True),
    ("objective.capacity_clock", "run", "environment"),
    ("objective.return_ramp_steps", 0, 200),
])
def test_a_run_made_with_a_removed_setting_resumes_only_where_it_changed_nothing(tmp_path, path, inert, other):
    from vase.errors import ConfigError

    section, key = path.split(".")
    saved = json.loads(build_config("cpu").to_json())
    saved[section][key] = inert
    (tmp_path / "config.json").write_text(json.dumps(saved))
    assert load_run_config(tmp_path) == build_config("cpu")
    saved[section][key] = other
    (tmp_path / "config.json").write_text(json.dumps(saved))
    with pytest.raises(ConfigError, match=f"{path}={other!r}, a setting vase no longer has"):
        load_run_config(tmp_path)
    assert load_run_config(tmp_path, trains=False) == build_config("cpu")  # read only: eval, inspect


@pytest.mark.parametrize("ablation, without, refused", [
    ("SDA", [], True), ("SA", [], True), ("DA", [], False), ("-", [], False), ("SDA", ["frozen_while_pending"], False),
])
def test_a_run_whose_pending_batches_trained_is_refused_where_the_rule_now_holds_them(ablation, without, refused):
    """inference.pending_batches_train, removed: frozen_while_pending holds a pending batch out of
    training. A run that trained them cannot be reproduced where S was on and the rule in its set;
    without S there is no pending batch, and without the rule the batch trained then as it does now."""
    cfg = build_config("cpu", ["inference.without=" + ",".join(without)] if without else [])
    saved = json.loads(cfg.to_json())
    saved["ablation"], saved["inference"]["enabled"] = ablation, "S" in ablation
    saved["inference"]["pending_batches_train"] = True
    if refused:
        with pytest.raises(ConfigError, match="inference.pending_batches_train=True, a setting vase no longer has"):
            migrate(saved)
    else:
        assert "pending_batches_train" not in migrate(saved)["inference"]
    saved["inference"]["pending_batches_train"] = False
    assert "pending_batches_train" not in migrate(saved)["inference"]


def test_a_run_made_with_the_own_capacity_ramp_reads_as_it_trained(tmp_path):
    """objective.new_env_ramp_steps: a config.json that holds it (runs made while the rule was on by
    default, at 1000 or 7200 steps) trains with it; one made without the setting trained with C(t)
    alone and reads as 0; a run that left the rule out keeps it out."""
    saved = json.loads(build_config("cpu").to_json())
    saved["objective"]["new_env_ramp_steps"] = 1000
    (tmp_path / "config.json").write_text(json.dumps(saved))
    cfg = load_run_config(tmp_path)
    assert cfg.objective.new_env_ramp_steps == 1000 and as_configured(cfg).objective.new_env_ramp_steps == 1000
    saved["inference"]["without"] = ["own_capacity_ramp"]
    (tmp_path / "config.json").write_text(json.dumps(saved))
    assert as_configured(load_run_config(tmp_path)).objective.new_env_ramp_steps == 0  # eq. 3's C(t)
    del saved["objective"]["new_env_ramp_steps"]
    saved["inference"]["without"] = []
    (tmp_path / "config.json").write_text(json.dumps(saved))
    assert load_run_config(tmp_path).objective.new_env_ramp_steps == 0


@pytest.mark.parametrize("assignment, field, value", [
    ("data.sequence=moving_fashion, mnist ,moving_mnist", "sequence", ["moving_fashion", "mnist", "moving_mnist"]),
    ("data.sequence=shapes_a", "sequence", ["shapes_a"]),
    ("data.steps_per_env=10,20,30", "steps_per_env", [10, 20, 30]),
    ("data.steps_per_env=7", "steps_per_env", [7]),
])
def test_set_reads_a_list_from_comma_text(assignment, field, value):
    assert getattr(build_config("cpu", [assignment]).data, field) == value


def test_the_train_options_give_the_same_lists():
    sets = option_overrides("moving_fashion,mnist", "5,6")
    assert sets == ["data.sequence=moving_fashion,mnist", "data.steps_per_env=5,6"]
    cfg = build_config("cpu", sets)
    assert cfg.data.sequence == ["moving_fashion", "mnist"] and cfg.data.env_steps() == [5, 6]
    assert build_config("cpu", ["model.channels=8,8,16,16"]).model.channels == [8, 8, 16, 16]


@pytest.mark.parametrize("assignment, message", [
    ("model.channels=8,x,8,8", "model.channels must be a comma-separated list of integers, got '8,x,8,8'"),
    ("model.channels=8,8", r"model.channels must be 4 positive integers, got \[8, 8\]"),
    ("model.channels=8,8,0,8", "model.channels must be 4 positive integers"),
    ("data.steps_per_env=1.5", "data.steps_per_env must be a comma-separated list of integers, got '1.5'"),
    ("data.steps_per_env=10,20", "data.steps_per_env has 2 entries but the sequence has 3 environments"),
    ("data.steps_per_env=", "data.steps_per_env has 0 entries"),
    ("data.sequence= , ", "data.sequence is empty"),
])
def test_bad_list_values_are_refused_clearly(assignment, message):
    with pytest.raises(ConfigError, match=message):
        build_config("cpu", [assignment])


@pytest.mark.parametrize("slope", ["-0.1", "1.0"])
def test_the_negative_slope_must_leave_a_nonlinearity(slope):
    with pytest.raises(ConfigError, match=r"model.negative_slope must be in \[0, 1\)"):
        build_config("cpu", [f"model.negative_slope={slope}"]).validate()
    assert build_config("cpu", ["model.negative_slope=0.01"]).model.negative_slope == 0.01


def test_a_json_list_setting_must_be_a_list():
    with pytest.raises(ConfigError, match="model.channels must be a list of integers, got '8,8,8,8'"):
        Config.from_dict({"model": {"channels": "8,8,8,8"}})
    with pytest.raises(ConfigError, match=r"data.steps_per_env must be a list of integers, got \['many'\]"):
        Config.from_dict({"data": {"steps_per_env": ["many"]}})


def test_a_run_made_with_a_deleted_rule_loads_without_its_settings(tmp_path):
    saved = json.loads(build_config("cpu").to_json())
    saved["inference"].update(relied_kl=1.0, foreign_use=0.5)  # foreign_latents, deleted
    (tmp_path / "config.json").write_text(json.dumps(saved))
    assert load_run_config(tmp_path) == build_config("cpu")
    saved["inference"]["without"] = ["ranked_fallback", "settling", "current_first", "resettling", "probation",
                                     "own_capacity_ramp"]
    (tmp_path / "config.json").write_text(json.dumps(saved))
    assert load_run_config(tmp_path).inference.without == ["settling", "own_capacity_ramp"]


@pytest.mark.parametrize("key", sorted(CHOICES))
def test_a_setting_of_named_choices_takes_those_names_and_refuses_others(key):
    for name in CHOICES[key]:
        assert setting(build_config("cpu", [f"{key}={name}"]), key) == name
    names = ", ".join(repr(name) for name in CHOICES[key])
    with pytest.raises(ConfigError) as refused:
        build_config("cpu", [f"{key}=nonesuch"])
    assert f"{key} must be one of {names}, got 'nonesuch'" in str(refused.value)


@pytest.mark.parametrize("assignment, message", [
    ("train.batch_size=0", "train.batch_size must be positive"),
    ("imagination.weight=-1", "imagination.batch_size must be positive and imagination.weight >= 0"),
    ("dream.batch_size=0", "dream.batch_size must be positive"),
    ("model.k_max=0", "model.k_max must be at least 1"),
    ("objective.gamma=-0.5", "objective.gamma must be >= 0"),
    ("objective.fresh_aggregate_weight=-1", "objective.fresh_aggregate_weight must be >= 0"),
    ("objective.capacity_ramp_steps=-1", "objective.capacity_ramp_steps must be >= 0"),
    ("mask.ema=1", r"mask.ema and inference.error_ema must be in \[0, 1\)"),
    ("inference.error_ema=-0.1", r"mask.ema and inference.error_ema must be in \[0, 1\)"),
    ("inference.kappa=0", "inference.kappa must be > 0 and inference.error_margin >= 0"),
    ("inference.patience=0", "inference.patience must be at least 1"),
    ("dream.snapshot_every=0", "dream.snapshot_every must be at least 1"),
    ("train.checkpoint_minutes=-1", r"train.checkpoint_minutes must be >= 0 \(0: checkpoint by steps only\)"),
    ("train.keep_every=-1", r"train.keep_every must be >= 0 \(0: keep the stage ends only\)"),
    ("train.checkpoint_every=0", "train.checkpoint_every must be at least 1"),
    ("train.log_every=0", "train.log_every must be at least 1"),
    ("train.image_every=0", "train.image_every must be at least 1"),
    ("probe.train_size=1", "probe.every, probe.train_size and probe.test_size must be positive"),
])
def test_a_setting_out_of_its_range_is_refused_with_its_message(assignment, message):
    with pytest.raises(ConfigError, match=message):
        build_config("cpu", [assignment])
    key, _, _ = assignment.partition("=")
    build_config("cpu", [f"{key}={setting(build_config('cpu'), key)}"])  # the default holds
