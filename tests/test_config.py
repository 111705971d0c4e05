"""Config: defaults, TOML, overrides, and validation that names the field."""

import pytest

from localrl.config import TrainConfig
from localrl.config_io import load_toml, to_toml
from localrl.errors import UserError
from localrl.training.settings import build_config


def test_defaults_are_valid_and_documented():
    cfg = TrainConfig().validate()
    assert cfg.model == "tiny-arith" and cfg.data == "arith" and cfg.quantize == "auto"
    text = to_toml(cfg)
    assert "group_size = 8  # completions sampled per prompt (G)" in text


def test_toml_then_overrides(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[train]\ngroup_size = 4\nlr = 1e-4\nmodel = "x/y"\nload_in_4bit = false\n')
    cfg = build_config(f, {"group_size": "6", "beta": "0"})
    assert (cfg.group_size, cfg.lr, cfg.model, cfg.quantize, cfg.beta) == (6, 1e-4, "x/y", "none", 0.0)  # legacy key


def test_resolved_config_round_trips(tmp_path):
    cfg = build_config(None, {"model": 'we"ird\\path', "steps": 7, "temperature": 0.7})
    f = tmp_path / "r.toml"
    f.write_text(to_toml(cfg))
    assert build_config(f) == cfg


@pytest.mark.parametrize("field, value, message", [
    ("group_size", "1", "config field group_size: must be at least 2"),
    ("max_new_tokens", "0", "config field max_new_tokens: must be at least 1"),
    ("epsilon", "1.5", "config field epsilon"),
    ("device", "tpu", "config field device"),
    ("group_size", "eight", "config field group_size: expected int, got 'eight'"),
    ("quantize", "maybe", "config field quantize: must be auto, nf4 or none"),
    ("env", "gym", "config field env: must be empty or one of secret_keeping, shell, "),
    ("isolation", "chroot", "config field isolation: must be one of auto, bwrap"),
    ("env_tasks", "tasks.jsonl", "config field env_tasks: needs env shell"),
    ("max_turns", "0", "config field max_turns: must be at least 1"),
])
def test_invalid_values_name_the_field(field, value, message):
    with pytest.raises(UserError, match=message):
        build_config(None, {field: value})


def test_an_environment_brings_its_preset_unless_the_user_sets_a_field(tmp_path):
    cfg = build_config(None, {"env": "shell"})
    assert (cfg.model, cfg.beta, cfg.max_new_tokens) == ("tiny-shell", 0.0, 48)
    assert build_config(None, {"env": "shell", "model": "tiny-arith", "beta": "0.1"}).model == "tiny-arith"
    f = tmp_path / "c.toml"
    f.write_text('env = "shell"\nsteps = 3\n')
    assert (build_config(f).steps, build_config(f).model) == (3, "tiny-shell")
    assert build_config(None, {}).model == "tiny-arith"


def test_bad_toml_files(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("grop_size = 3\n")
    with pytest.raises(UserError, match="unknown config field 'grop_size'"):
        load_toml(f)
    f.write_text("group_size = \n")
    with pytest.raises(UserError, match="invalid TOML"):
        load_toml(f)
    with pytest.raises(UserError, match="not found"):
        load_toml(tmp_path / "missing.toml")
