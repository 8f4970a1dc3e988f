"""The open registry: a family or backbone kind registered from outside the package is a valid
`model.family` / `model.backbone.kind`, builds, counts and trains like a built-in one, in this process
and (through an `mhf_dist.families` entry point) in a fresh one such as a Ray worker."""

import math
import os
import subprocess
import sys
import textwrap
from importlib.metadata import EntryPoint

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from mhf_dist import plugins
from mhf_dist.config import load_config
from mhf_dist.errors import ConfigError
from mhf_dist.models import build_model, forward_flops_per_token, param_count
from mhf_dist.models.counting import StackParts
from mhf_dist.models.registry import (
    BACKBONES,
    FAMILIES,
    Backbone,
    register_backbone,
    register_family,
    triple_backbone,
    triple_family,
)
from mhf_dist.signatures import build_for_config
from mhf_dist.train.loop import train_local

# Slots and the conv path together: a stack no built-in family has.
SLOT_HYBRID = StackParts(slots=True, conv=True)


@pytest.fixture
def clean_registries(monkeypatch):
    """Whatever a test registers is gone after it."""
    for registry in (FAMILIES, BACKBONES):
        monkeypatch.setattr(registry, "_entries", dict(registry._entries))


@pytest.fixture
def slot_hybrid(clean_registries):
    register_family("slot_hybrid", triple_family(SLOT_HYBRID))
    register_backbone("slot_hybrid", triple_backbone(SLOT_HYBRID))
    return "slot_hybrid"


def test_a_family_registered_outside_the_package_validates_builds_counts_and_trains(slot_hybrid):
    cfg = load_config("tiny", [f"model.family={slot_hybrid}", "train.steps=2"])
    torch.manual_seed(0)
    model = build_model(cfg.model)
    assert model.stack.conv is not None and model.stack.blocks[0].mixer.slot_keys is not None
    assert param_count(cfg.model) == sum(p.numel() for p in model.parameters())
    rows = torch.randint(0, cfg.model.vocab_size, (3, 17), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        model(rows)
    assert counter.get_total_flops() == forward_flops_per_token(cfg.model, 16) * 3 * 16

    batch = torch.randint(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.train.seq_len + 1))
    losses = [h["loss"] for h in train_local(model, iter([{"tokens": batch}] * 2), cfg.train, log=None)]
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses)
    assert losses[1] < losses[0]  # the same batch again, after one update


def test_a_backbone_kind_registered_outside_the_package_runs_under_hash_io(slot_hybrid):
    cfg = load_config("tiny", [f"model.backbone.kind={slot_hybrid}"])
    table = build_for_config(cfg.model.hash, [f"t{i}" for i in range(cfg.model.vocab_size)])
    model = build_model(cfg.model, table)
    assert model.backbone.conv is not None and model.backbone.blocks[0].mixer.slot_keys is not None
    assert param_count(cfg.model) == sum(p.numel() for p in model.parameters())


def test_an_unregistered_name_is_refused_in_one_line_listing_the_registered_ones(slot_hybrid):
    with pytest.raises(ConfigError) as family:
        load_config("tiny", ["model.family=nope"])
    message = str(family.value)
    assert "\n" not in message and "unknown model family 'nope'" in message
    assert "gated_hybrid" in message and slot_hybrid in message and "register_family" in message
    with pytest.raises(ConfigError, match=r"unknown backbone kind 'nope'.*register_backbone"):
        load_config("tiny", ["model.backbone.kind=nope"])


def test_registering_a_taken_name_is_refused_and_keeps_the_first_entry(slot_hybrid):
    qwen3 = FAMILIES["qwen3"]
    with pytest.raises(ConfigError, match="model family 'qwen3' is already registered"):
        register_family("qwen3", triple_family(SLOT_HYBRID))
    with pytest.raises(ConfigError, match="model family 'slot_hybrid' is already registered"):
        register_family(slot_hybrid, triple_family(StackParts()))
    with pytest.raises(ConfigError, match="backbone kind 'qwen3' is already registered"):
        register_backbone("qwen3", Backbone(lambda cfg: torch.nn.Identity(), lambda cfg: 0, lambda cfg, t: 0))
    assert FAMILIES["qwen3"] is qwen3


def test_an_entry_point_that_does_not_import_is_a_one_line_error(clean_registries, monkeypatch):
    broken = EntryPoint("broken", "no_such_module_of_families", plugins.ENTRY_POINT_GROUP)
    monkeypatch.setattr(plugins, "entry_points", lambda group: [broken] if group == broken.group else [])
    with pytest.raises(ConfigError, match=r"entry point 'broken' of mhf_dist.families .* does not import"):
        load_config("tiny", ["model.family=mine"])


def test_an_installed_packages_families_exist_in_a_fresh_process_through_its_entry_point(tmp_path):
    """A fresh interpreter (as a Ray worker is) validates, builds and counts a family that only an
    installed package's `mhf_dist.families` entry point names; importing the config loads no models."""
    info = tmp_path / "mine_families-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: mine-families\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[mhf_dist.families]\nmine = mine_families\n")
    (tmp_path / "mine_families.py").write_text(
        textwrap.dedent("""
        from mhf_dist.models.counting import StackParts
        from mhf_dist.models.registry import register_family, triple_family

        register_family("mine", triple_family(StackParts(slots=True, conv=True)))
        """)
    )
    script = textwrap.dedent("""
        import sys
        from mhf_dist.config import load_config
        assert "mhf_dist.models" not in sys.modules
        cfg = load_config("tiny", ["model.family=mine"])
        from mhf_dist.models import FAMILIES, build_model, param_count
        model = build_model(cfg.model)
        print(list(FAMILIES)[-1], param_count(cfg.model) == sum(p.numel() for p in model.parameters()))
    """)
    done = subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["mine", "True"]


def test_the_built_in_names_the_config_knows_are_the_families_and_kinds_the_models_register():
    import mhf_dist.models.registry  # noqa: F401  (registers the built-ins)

    assert list(FAMILIES._entries)[: len(plugins.BUILTIN_FAMILIES)] == list(plugins.BUILTIN_FAMILIES)
    assert list(BACKBONES._entries)[: len(plugins.BUILTIN_BACKBONES)] == list(plugins.BUILTIN_BACKBONES)


def test_a_family_the_driver_registered_trains_on_ray_workers_that_never_ran_the_drivers_code(
    slot_hybrid, ray_session, tmp_path
):
    from mhf_dist.data.prepare import prepare
    from mhf_dist.export import load_exported
    from mhf_dist.train.checkpoints import MODEL_DIR, read_history
    from mhf_dist.train.ray_trainer import TrainOptions, train

    settings = [
        "data.tokenizer=bytes",
        "model.vocab_size=259",
        "train.seq_len=16",
        "train.batch_size=2",
        "train.steps=2",
        "train.eval_rows=2",
        f"data.path={tmp_path / 'data'}",
        f"topology.storage={tmp_path}",
        "topology.workers=1",
    ]
    prepare(load_config("tiny", settings), tmp_path / "data", log=lambda _: None)
    cfg = load_config("tiny", [*settings, f"model.family={slot_hybrid}"])
    result = train(cfg, TrainOptions(name="outside"))
    assert [h["step"] for h in read_history(result.checkpoint)] == [1, 2]
    exported = load_exported(result.checkpoint / MODEL_DIR)
    assert (
        exported.model.stack.conv is not None and exported.model.stack.blocks[0].mixer.slot_keys is not None
    )
