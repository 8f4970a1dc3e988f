"""Configs: every preset loads, overrides apply, and each mistake is a one-line error naming the fix."""

import json

import pytest

from mhf_dist.cli import main
from mhf_dist.config import available_presets, format_hash_spec, load_config, parse_hash_spec
from mhf_dist.errors import ConfigError


@pytest.mark.parametrize("preset", available_presets())
def test_every_preset_loads_with_qwen3_backbone_settings(preset):
    cfg = load_config(preset)
    assert cfg.preset == preset
    assert cfg.model.backbone.rope_theta == 1_000_000.0
    assert cfg.model.backbone.num_heads % cfg.model.backbone.num_kv_heads == 0
    assert cfg.model.hash.num_buckets**cfg.model.hash.num_hashes >= cfg.model.vocab_size


def test_presets_exist():
    assert {"tiny", "100m", "1b", "3b"} <= set(available_presets())


@pytest.mark.parametrize(
    ("spec", "shape"), [("H4B16K", (4, 16384)), ("H2B64", (2, 64)), ("H3B1K", (3, 1024))]
)
def test_hash_spec_parses_both_ways(spec, shape):
    assert parse_hash_spec(spec) == shape
    assert format_hash_spec(*shape) == spec


def test_overrides_are_typed_and_nested():
    cfg = load_config("tiny", ["train.steps=7", "model.backbone.num_layers=3", "model.hash.spec=H3B256"])
    assert cfg.train.steps == 7 and cfg.model.backbone.num_layers == 3
    assert (cfg.model.hash.num_hashes, cfg.model.hash.num_buckets) == (3, 256)


def test_setting_the_hash_spec_directly_keeps_the_preset_widths():
    cfg = load_config("tiny", ["model.hash=H2B64"])
    assert cfg.model.hash.spec == "H2B64" and cfg.model.hash.d_hash == 32


def test_yaml_file_can_start_from_a_preset(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("preset: tiny\ntrain:\n  steps: 3\nmodel:\n  family: qwen3\n")
    cfg = load_config(path)
    assert cfg.train.steps == 3 and cfg.model.family == "qwen3"
    assert cfg.model.backbone.hidden_size == load_config("tiny").model.backbone.hidden_size


def test_flat_keys_match_override_paths():
    """Every flattened key is an override path, and setting each to its own value rebuilds the config."""
    tiny = load_config("tiny")
    flat = tiny.flat()
    assert flat["model.backbone.hidden_size"] == 64
    assert load_config("tiny", [f"{key}={json.dumps(value)}" for key, value in flat.items()]) == tiny
    doubled = load_config("tiny", ["model.backbone.hidden_size=128"])
    assert doubled.flat() == {**flat, "model.backbone.hidden_size": 128}


@pytest.mark.parametrize(
    ("source", "overrides", "message"),
    [
        ("nope", [], "unknown preset 'nope'; choose one of"),
        ("tiny", ["model.backbone.hiden_size=3"], "unknown key 'model.backbone.hiden_size'"),
        ("tiny", ["train.steps"], "write --set section.key=value"),
        ("tiny", ["model.hash.spec=H0B64"], r"use at least one hash \(H>=1\)"),
        ("tiny", ["model.hash.spec=H2B1"], r"use at least two buckets \(B>=2\)"),
        ("tiny", ["model.hash.spec=X9"], "write H<hashes>B<buckets>"),
        ("tiny", ["model.family=gpt"], "Input should be 'mhf', 'qwen3', 'qwen3_matched', 'triple_latent'"),
        ("tiny", ["train.steps=-1"], "train.steps: Input should be greater than 0"),
        ("tiny", ["train.seq_len=1"], "train.seq_len: Input should be greater than or equal to 2"),
        ("tiny", ["model.backbone=3"], "is a section; set one of its keys"),
        ("tiny", ["train.steps.x=1"], "train.steps is a value, not a section"),
        ("tiny", ["model.backbone.num_kv_heads=3"], "not a multiple of num_kv_heads"),
    ],
)
def test_bad_config_is_a_one_line_error(source, overrides, message):
    with pytest.raises(ConfigError, match=message) as info:
        load_config(source, overrides)
    assert "\n" not in str(info.value)


def test_malformed_yaml_names_the_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  family: mhf\n bad: [\n")
    with pytest.raises(ConfigError, match=r"cannot parse .*bad.yaml at line \d+, column \d+"):
        load_config(path)


def test_unknown_key_in_yaml_lists_the_allowed_keys(tmp_path):
    path = tmp_path / "typo.yaml"
    path.write_text("preset: tiny\ntrain:\n  stepz: 3\n")
    with pytest.raises(ConfigError, match=r"unknown key 'train.stepz'; allowed keys there: seed, steps"):
        load_config(path)


def test_cli_reports_config_errors_in_one_line_and_exits_non_zero(capsys):
    assert main(["config", "--config", "tiny", "--set", "model.hash.spec=H4B1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err


def test_cli_prints_the_resolved_config(capsys):
    assert main(["config", "--set", "train.steps=5"]) == 0
    assert "steps: 5" in capsys.readouterr().out
