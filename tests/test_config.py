"""Configs: every preset loads, overrides parse and apply, and each mistake is a one-line error naming
the fix."""

import json
import re
from pathlib import Path

import pytest
import yaml

from mhf_dist.cli import main
from mhf_dist.config import (
    MAX_SEED,
    available_presets,
    format_hash_spec,
    load_config,
    parse_hash_spec,
    parse_override,
    parse_overrides,
)
from mhf_dist.errors import ConfigError


@pytest.mark.parametrize("preset", available_presets())
def test_every_preset_loads_with_qwen3_backbone_settings(preset):
    cfg = load_config(preset)
    assert cfg.preset == preset
    assert cfg.model.backbone.rope_theta == 1_000_000.0


def test_presets_exist():
    assert {"tiny", "100m", "1b", "3b"} <= set(available_presets())


def test_the_largest_seed_every_seed_argument_names_loads():
    assert load_config("tiny", [f"train.seed={MAX_SEED}"]).train.seed == MAX_SEED == 2**63 - 1


# Every name in the authors' README (HUIYINXUE/MHF) with the B of its checkpoint, e.g. MHF(H3B10K) is
# `hf_qwen3_100m-model_10624_3_0_64_twe`, H4B16K `..._16384_4_0_64_twe`, H1B4K `shf_1b_4096_..`.
PAPER_SPECS = {
    "H3B4K": (3, 4096),
    "H4B4K": (4, 4096),
    "H3B8K": (3, 8192),
    "H4B8K": (4, 8192),
    "H3B10K": (3, 10624),
    "H3B16K": (3, 16384),
    "H4B16K": (4, 16384),
    "H4B32K": (4, 32768),
    "H1B4K": (1, 4096),
    "H1B8K": (1, 8192),
    "H1B16K": (1, 16384),
}


@pytest.mark.parametrize(
    ("spec", "shape"),
    [*PAPER_SPECS.items(), ("H2B64", (2, 64)), ("H3B1K", (3, 1024)), ("H3B10240", (3, 10240))],
)
def test_hash_spec_parses_both_ways_and_the_papers_names_give_its_bucket_counts(spec, shape):
    assert parse_hash_spec(spec) == shape
    assert format_hash_spec(*shape) == spec


def test_exact_bucket_counts_always_parse_and_the_ambiguous_k_name_is_explained():
    assert parse_hash_spec("H3B10624") == (3, 10624) and format_hash_spec(3, 10624) == "H3B10K"
    assert parse_hash_spec("H4B16384") == (4, 16384)
    with pytest.raises(ConfigError, match=r"K is x1024 except the paper's B10K = 10,624 \(H3B10K\)"):
        parse_hash_spec("H3B10k")
    for num_hashes in (1, 2, 3, 4):
        for num_buckets in (2, 64, 1000, 1024, 10240, 10624, 11264, 16384, 16383):
            assert parse_hash_spec(format_hash_spec(num_hashes, num_buckets)) == (num_hashes, num_buckets)


def test_lsh_settings_are_validated_against_the_spec_and_scheme():
    cfg = load_config(
        "tiny", ["model.hash.spec=H4B64", "model.hash.num_lsh=2", "model.hash.lsh_only_embed=true"]
    )
    assert (cfg.model.hash.num_lsh, cfg.model.hash.lsh_only_embed) == (2, True)
    with pytest.raises(ConfigError, match="num_lsh=3 exceeds the 2 hashes of H2B1K; use num_lsh <= 2"):
        load_config("tiny", ["model.hash.num_lsh=3"])
    with pytest.raises(ConfigError, match="needs the reference signature scheme"):
        load_config("tiny", ["model.hash.num_lsh=1", "model.hash.scheme=murmur32"])
    with pytest.raises(ConfigError, match="set num_lsh > 0 as well"):
        load_config("tiny", ["model.hash.lsh_only_embed=true"])


def test_overrides_are_typed_and_nested():
    cfg = load_config("tiny", ["train.steps=7", "model.backbone.num_layers=3", "model.hash.spec=H3B256"])
    assert cfg.train.steps == 7 and cfg.model.backbone.num_layers == 3
    assert (cfg.model.hash.num_hashes, cfg.model.hash.num_buckets) == (3, 256)


def test_setting_the_hash_spec_directly_keeps_the_preset_widths():
    cfg = load_config("tiny", ["model.hash=H2B64"])
    assert cfg.model.hash.spec == "H2B64" and cfg.model.hash.d_hash == 32
    assert load_config("tiny", {"model.hash": "H2B64"}) == cfg  # a sweep's `set:` means the same


def test_a_hash_shorthand_in_a_file_over_a_preset_keeps_the_widths_as_set_does(tmp_path):
    path = tmp_path / "short.yaml"
    path.write_text("preset: tiny\nmodel:\n  hash: H2B64\n")
    assert load_config(path).model.hash == load_config("tiny", ["model.hash=H2B64"]).model.hash
    path.write_text("preset: tiny\nmodel:\n  hash: X9\n")  # a bad one: named by the file, as before
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: model.hash"):
        load_config(path)


@pytest.mark.parametrize(
    ("text", "key", "value"),
    [
        ("train.steps=50", "train.steps", 50),
        ("train.lr=1.0e-3", "train.lr", 0.001),
        ("train.compile=true", "train.compile", True),
        ("train.trainable=[backbone.*, decoder]", "train.trainable", ["backbone.*", "decoder"]),
        ("model.hash.d_hash=null", "model.hash.d_hash", None),
        ("data.corpus=hf:wikitext", "data.corpus", "hf:wikitext"),
        ("data.corpus=[unclosed", "data.corpus", "[unclosed"),  # not YAML: the text as it is
        (" train.steps =7", "train.steps", 7),
        ("data.path=a=b", "data.path", "a=b"),  # the first `=` splits
        # YAML 1.2's core schema, not PyYAML's 1.1: no octal, sexagesimal, yes/no or dates
        ("train.steps=010", "train.steps", 10),
        ("train.lr=1e-3", "train.lr", 0.001),
        ("train.steps=1:30", "train.steps", "1:30"),
        ("data.corpus=yes", "data.corpus", "yes"),
        ("data.path=2024-01-01", "data.path", "2024-01-01"),
    ],
)
def test_an_override_is_typed_as_yaml_reads_its_value(text, key, value):
    assert parse_override(text) == (key, value)


@pytest.mark.parametrize(
    ("key", "text", "value"),
    [
        ("train.steps", "010", 10),  # YAML 1.1: octal 8
        ("train.lr", "3e-4", 3e-4),  # YAML 1.1: the text "3e-4"
        ("data.corpus", "yes", "yes"),  # YAML 1.1: True
        ("data.corpus", "1:30", "1:30"),  # YAML 1.1: 90
        ("model.hash.d_hash", "null", None),
        ("data.path", "2024-01-01", "2024-01-01"),  # YAML 1.1: a date
    ],
)
def test_a_value_means_the_same_in_a_config_file_a_set_and_a_sweeps_set(tmp_path, key, text, value):
    from mhf_dist.sweep.spec import load_sweep, trial_configs

    section, *inner, name = key.split(".")
    nested = "".join(f"\n{'  ' * (depth + 1)}{part}:" for depth, part in enumerate(inner))
    (tmp_path / "c.yaml").write_text(f"preset: tiny\n{section}:{nested} {{{name}: {text}}}\n")
    (tmp_path / "s.yaml").write_text(
        f"name: s\nkind: seeds\nconfig: tiny\nseeds: [0]\nset: {{{key}: {text}}}\nstorage: {tmp_path}\n"
    )
    from_file = load_config(str(tmp_path / "c.yaml"))
    from_set = load_config("tiny", [f"{key}={text}"])
    (from_sweep,) = trial_configs(load_sweep(tmp_path / "s.yaml")).values()

    def at(cfg):
        node = cfg
        for part in key.split("."):
            node = getattr(node, part)
        return node

    assert at(from_file) == at(from_set) == at(from_sweep) == value
    assert type(at(from_file)) is type(at(from_set)) is type(at(from_sweep)) is type(value)


def test_an_explicit_number_tag_follows_yaml_1_2_too(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("preset: tiny\ntrain:\n  lr: !!float 3\n  steps: !!int 0x10\n")
    assert (load_config(str(path)).train.lr, load_config(str(path)).train.steps) == (3.0, 16)
    for value in ("!!float 1:30", "!!int 010_0"):  # YAML 1.1 (PyYAML): 90 and 64
        path.write_text(f"preset: tiny\ntrain:\n  lr: {value}\n")
        with pytest.raises(
            ConfigError, match=rf"^cannot parse .*c.yaml at line 3, column 7: '{value.split()[1]}' is no YAML"
        ):
            load_config(str(path))


def test_a_value_of_another_type_is_refused_not_converted():
    for setting, problem in (
        ("train.steps=true", "train.steps: Input should be a valid integer (got True)"),
        ("train.lr=false", "train.lr: Input should be a valid number (got False)"),
        ("train.steps=1.0", "train.steps: Input should be a valid integer (got 1.0)"),
        ('train.steps="50"', "train.steps: Input should be a valid integer (got '50')"),
        (
            "data.text_field=7",
            "data.text_field: Input should be a valid string (got 7, a number: quote it in YAML "
            "to keep it text)",
        ),
        (
            "data.path=010",
            "data.path: Input should be a valid string (got 10, a number: quote it in YAML to keep it text)",
        ),
        (
            "data.path=",
            "data.path: Input should be a valid string (got null, as YAML reads an empty value; give one)",
        ),
    ):
        with pytest.raises(ConfigError) as info:
            load_config("tiny", [setting])
        assert str(info.value) == problem


def test_an_override_keeps_unquoted_text_as_written():
    """YAML would cut `runs/exp #2` at its comment (and read `#x` as nothing), `&a x` at its anchor."""
    for text in ("runs/exp #2", "#x", "&a x", "a b"):
        assert load_config("tiny", [f"data.path={text}"]).data.path == text
    assert load_config("tiny", ["data.path='#x'"]).data.path == "#x"  # a quoted one as YAML reads it
    assert load_config("tiny", ["train.steps=010"]).train.steps == 10


def test_overrides_as_texts_or_a_mapping_give_one_mapping_where_the_later_value_wins():
    settings = parse_overrides(["train.steps=1", "train.lr=0.1", "train.steps=2"])
    assert list(settings.items()) == [("train.lr", 0.1), ("train.steps", 2)]
    assert parse_overrides({"train.steps": 2}) == {"train.steps": 2}
    assert load_config("tiny", ["train.steps=1", "train.steps=2"]).train.steps == 2


def test_a_section_given_a_mapping_merges_into_it():
    tiny = load_config("tiny")
    cfg = load_config("tiny", {"model.backbone": {"num_layers": 3}, "model.hash": {"spec": "H2B64"}})
    assert cfg.model.backbone == tiny.model.backbone.model_copy(update={"num_layers": 3})
    assert cfg.model.hash == tiny.model.hash.model_copy(update={"spec": "H2B64"})
    nested = load_config("tiny", {"model": {"hash": "H2B64", "backbone": {"num_layers": 3}}})
    assert nested.model == cfg.model  # a shorthand deeper in a mapping keeps the widths too


def test_config_files_naming_each_other_a_list_or_no_file_as_preset_is_a_one_line_error(
    tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    Path("a.yaml").write_text("preset: b.yaml\n")
    Path("b.yaml").write_text("preset: a.yaml\n")
    with pytest.raises(
        ConfigError, match=r"^config files name each other as `preset:` \(.*a.yaml -> .*b.yaml -> .*a.yaml\)"
    ):
        load_config("a.yaml")
    Path("a.yaml").write_text("preset: [tiny]\n")
    with pytest.raises(
        ConfigError, match=r"a.yaml: `preset: \['tiny'\]` names no preset; give one name or YAML file$"
    ):
        load_config("a.yaml")
    Path("upper.YML").write_text("preset: tiny\ntrain: {steps: 3}\n")  # a file by its suffix in any case
    assert load_config("upper.YML").train.steps == 3
    Path("a.yaml").write_text("preset: missing.yaml\n")
    with pytest.raises(
        ConfigError, match=r"a.yaml: `preset: missing.yaml` names no file \('.*missing.yaml': a"
    ):
        load_config("a.yaml")


def test_keys_under_a_hash_shorthand_of_a_yaml_file_are_set_within_it(tmp_path):
    path = tmp_path / "short.yaml"
    path.write_text("preset: tiny\nmodel:\n  hash: H2B64\n")
    cfg = load_config(path, ["model.hash.num_lsh=1"])
    assert (cfg.model.hash.spec, cfg.model.hash.num_lsh) == ("H2B64", 1)


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
    assert load_config("tiny", flat) == tiny  # the mapping itself, as a sweep's trials pass it
    doubled = load_config("tiny", ["model.backbone.hidden_size=128"])
    assert doubled.flat() == {**flat, "model.backbone.hidden_size": 128}


@pytest.mark.parametrize(
    ("source", "overrides", "message"),
    [
        ("nope", [], "unknown preset 'nope'; choose one of"),
        (
            "tiny",
            ["model.backbone.hiden_size=3"],
            "unknown key 'model.backbone.hiden_size'; keys under model.backbone: kind, hidden_size",
        ),
        ("tiny", ["model.hiden.x=3"], "unknown key 'model.hiden.x'; keys under model: family, vocab_size"),
        ("tiny", {"modle.family": "mhf"}, "unknown key 'modle.family'; keys under the top level: preset"),
        ("tiny", ["preset=100m"], r"^preset=100m cannot be set; choose the preset with --config 100m \(or a"),
        ("tiny", ["train.steps"], r"^'train.steps' is not KEY=VALUE; write e.g. --set train.steps=50"),
        ("tiny", ["=3"], "is not KEY=VALUE"),
        ("tiny", ["model.hash.spec=H0B64"], r"has H=0; use 1 to 256 hashes \(got"),
        ("tiny", ["model.hash.spec=H100000000B2K"], r"has H=100000000; use 1 to 256 hashes \(got"),
        ("tiny", ["model.hash.spec=H2B4194305K"], r"has B=4294968320; use 2 to 2\*\*32 buckets \(got"),
        ("tiny", ["model.hash.spec=H" + "9" * 5000 + "B64"], r"bad hash spec 'H9999.*; write H<hashes>B"),
        ("tiny", ["preset=nope"], r"^preset=nope cannot be set; choose the preset with --config \(or a"),
        (
            "tiny",
            ['data.sources=[{"name": "a", "corpus": "builtin", "weight": 1, "colour": 2}]'],
            r"^unknown key 'data.sources.0.colour'; keys under data.sources.0: name, corpus, dataset, args",
        ),
        (
            "tiny",
            ['data.sources=[{"corpus": "builtin", "weight": 1}]'],
            r"^missing key 'data.sources.0.name'; give entry 0 of data.sources a `name`$",
        ),
        (
            "tiny",
            ["model.hash.seed=4294967295"],
            r"^model.hash: seed=4294967295: its 2 hashes are seeded seed",
        ),
        ("tiny", ["model.hash.spec=H2B1"], r"has B=1; use 2 to 2\*\*32 buckets \(got"),
        ("tiny", ["model.hash.spec=X9"], "write H<hashes>B<buckets>"),
        ("tiny", ["model.hash=X9"], r"^model.hash: bad hash spec 'X9'; write H<hashes>B<buckets>"),
        ("tiny", ["model.family=gpt"], "model.family: unknown model family 'gpt'; registered: mhf, qwen3"),
        ("tiny", ["train.steps=-1"], "train.steps: Input should be greater than 0"),
        # an empty location is not the current directory (a run written into it, a corpus read from it)
        ("tiny", ["topology.storage=''"], r"^topology.storage: empty; give a value \('.' is the current"),
        ("tiny", ["data.path=''"], r"^data.path: empty; give a value"),
        (
            "tiny",
            ["data.path=' s3://b/x'"],
            r"^data.path: ' s3://b/x' begins or ends with white space; remove",
        ),
        ("tiny", ["data.corpus=' '"], r"^data.corpus: ' ' begins or ends with white space; remove it"),
        ("tiny", ["data.corpus='hf:'"], r"^data.corpus: 'hf:' names no dataset; write hf:NAME"),
        (
            "tiny",
            ["data.path=file:"],
            r"^data.path: Input should be a valid string \(got a mapping: quote it in YAML",
        ),
        ("tiny", ["data.signatures=''"], r"^data.signatures: empty; give a value"),
        ("tiny", ["data.replay.corpus=''"], r"^data.replay.corpus: empty; give a value"),
        ("tiny", ["data.tokenizer=' bytes'"], r"^data.tokenizer: ' bytes' begins or ends with white space"),
        (
            "tiny",
            [f"train.steps={'9' * 400}"],
            r"^train.steps: a 400-digit number; use a 64-bit integer \(got",
        ),
        (
            "tiny",
            [f"train.seed={2**63}"],
            r"^train.seed: Input should be less than or equal to 9223372036854775807 ",
        ),
        (
            "tiny",
            ["model.backbone.num_layers=100000"],
            "num_layers: Input should be less than or equal to 1024",
        ),
        ("tiny", ["model.backbone.hidden_size=10**14"], "hidden_size: Input should be a valid integer"),
        ("tiny", ["model.backbone.hidden_size=100000"], "hidden_size: Input should be less than or equal to"),
        ("tiny", ["train.seq_len=1"], "train.seq_len: Input should be greater than or equal to 2"),
        ("tiny", ["model.backbone=3"], "model.backbone is a section; set one of its keys"),
        (
            "tiny",
            ["model.hash=7"],
            r"model.hash is a section; set one of its keys, e.g. --set model.hash.spec=",
        ),
        ("tiny", ["train.steps.x=1"], "train.steps is a value, not a section"),
        ("tiny", ["model.backbone.num_kv_heads=3"], "not a multiple of num_kv_heads"),
        (
            "tiny",
            ["data.replay.corpus=builtin"],
            "replayed only with a fraction > 0; set data.replay.fraction",
        ),
        ("tiny", ["data.replay.fraction=0.2"], "needs data.replay.corpus"),
        ("tiny", ["data.replay.seed=-1"], "data.replay.seed: Input should be greater than or equal to 0"),
        ("tiny", ["data.packing=stride"], "data.packing: Input should be 'overlap' or 'blocks'"),
    ],
)
def test_bad_config_is_a_one_line_error(source, overrides, message):
    with pytest.raises(ConfigError, match=message) as info:
        load_config(source, overrides)
    assert "\n" not in str(info.value)


def test_malformed_yaml_names_the_line_and_too_deep_a_nesting_is_one_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  family: mhf\n bad: [\n")
    with pytest.raises(ConfigError, match=r"cannot parse .*bad.yaml at line \d+, column \d+"):
        load_config(path)
    path.write_text("preset: tiny\ntrain: {steps: " + "[" * 5000 + "]" * 5000 + "}\n")  # Python's recursion
    with pytest.raises(
        ConfigError, match=r"bad.yaml: nested deeper than a config can be; fix the YAML syntax$"
    ):
        load_config(path)


def test_unknown_key_in_yaml_lists_the_allowed_keys(tmp_path):
    path = tmp_path / "typo.yaml"
    path.write_text("preset: tiny\ntrain:\n  stepz: 3\n")
    with pytest.raises(
        ConfigError, match=r"^\S+typo.yaml: unknown key 'train.stepz'; keys under train: seed"
    ):
        load_config(path)
    path.write_text("preset: tiny\ntrain.steps: 3\n")  # a --set key written in a file: a top-level key
    with pytest.raises(
        ConfigError, match=r"typo.yaml: unknown key 'train.steps'; keys under the top level: preset, model"
    ):
        load_config(path)


@pytest.mark.parametrize(
    ("files", "overrides", "line"),
    [
        ({"a": "train: {steps: -3}"}, [], "a.yaml: train.steps: Input should be greater than 0 (got -3)"),
        (
            {"a": "train: {steps: -3}"},
            ["train.steps=-4"],
            "train.steps: Input should be greater than 0 (got -4)",
        ),
        (
            {"a": "train: {steps: -3}"},
            ["train.lr=0.1"],
            "a.yaml: train.steps: Input should be greater than 0",
        ),
        ({"a": "train: {steps: -3}"}, ["train={steps: -4}"], "train.steps: Input should be greater than 0"),
        # an override of a whole section gives the keys it holds, no others
        ({"a": "train: {steps: -3}"}, ["train={lr: 0.1}"], "a.yaml: train.steps: Input should be greater"),
        (
            {"a": "model: {hash: {spec: H2B64, sede: 3}}"},
            ["model.hash=H2B64"],  # the shorthand gives model.hash.spec
            "a.yaml: unknown key 'model.hash.sede'",
        ),
        # a rule over a section that an override inside it may break; one across sections names its keys
        ({"a": "model: {hash: {num_lsh: 2, scheme: murmur32}}"}, [], "a.yaml: model.hash: num_lsh=2 needs"),
        ({"a": "model: {hash: {num_lsh: 2}}"}, ["model.hash.scheme=murmur32"], "model.hash: num_lsh=2 needs"),
        ({"a": "train: {seq_len: 100000}"}, [], "train.seq_len=100000 is above"),
        # in a `preset:` chain, the file that sets the key
        (
            {"a": "preset: b.yaml\ntrain: {lr: 0.1}", "b": "train: {steps: -3}"},
            [],
            "b.yaml: train.steps: Input",
        ),
        (
            {"a": "preset: b.yaml\ntrain: {steps: -3}", "b": "train: {steps: -2}"},
            [],
            "a.yaml: train.steps: Input",
        ),
    ],
)
def test_a_files_own_mistake_names_the_file_that_makes_it_and_an_overrides_names_none(
    files, overrides, line, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)  # a `preset:` path is from the working directory
    for name, text in files.items():
        preset = "" if text.startswith("preset:") else "preset: tiny\n"
        (tmp_path / f"{name}.yaml").write_text(preset + text + "\n")
    with pytest.raises(ConfigError) as refused:
        load_config("a.yaml", overrides)
    assert str(refused.value).startswith(line), refused.value


def test_a_source_with_a_folder_in_its_path_is_a_file_not_the_preset_of_its_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny").write_text("preset: tiny\ntrain: {steps: 7}\n")  # no suffix, and a preset's name
    assert load_config("./tiny").train.steps == 7 and load_config("tiny").train.steps != 7
    with pytest.raises(ConfigError, match=r"^config file '.*/1b' does not exist; check the path$"):
        load_config("./1b")


def test_a_file_without_a_preset_or_a_section_says_to_start_from_a_preset(tmp_path):
    """`--set model=...` cannot fill a section: the advice for a missing one names the presets."""
    path = tmp_path / "partial.yaml"
    path.write_text("train: {steps: 5}\n")
    with pytest.raises(
        ConfigError,
        match=r"partial.yaml: missing section 'model'; start the file with `preset: NAME` \(one of .*tiny",
    ):
        load_config(path)


def test_cli_reports_config_errors_in_one_line_and_exits_non_zero(capsys):
    assert main(["config", "--config", "tiny", "--set", "model.hash.spec=H4B1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err


def test_cli_prints_the_resolved_config_as_yaml_that_reads_back_as_it(capsys, tmp_path):
    assert main(["config", "--set", "train.steps=5"]) == 0
    assert "steps: 5" in capsys.readouterr().out
    # text that YAML 1.2 (and PyYAML's 1.1) would read as another type is written quoted
    texts = ["1e3", "0o17", "010", "yes", "1:30", "2024-01-01", "null", "~", ".inf", "true", "0x1F", "-.5"]
    for text in texts:
        assert main(["config", "--set", f"data.text_field={json.dumps(text)}"]) == 0
        printed = tmp_path / "printed.yaml"
        printed.write_text(capsys.readouterr().out)
        assert load_config(printed).data.text_field == text
        assert yaml.safe_load(printed.read_text())["data"]["text_field"] == text  # PyYAML's 1.1 too
