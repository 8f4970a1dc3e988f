"""`train.trainable`: the authors' vocabulary-expansion split freezes exactly their parameter set.

The expected names are written out here from HUIYINXUE/MHF `vocab_expansion/src/main_ve.py`: freeze
everything, then unfreeze `model.layers[i]` for i in [0, 1, -1, -2], `model.norm`, `model.embed_tokens`,
`lm_head`, and with --enable_hashformer `hash_head` and `model.combiner`. In our MHF the authors'
bucket table (`embed_tokens`) and combiner are `encoder.table` / `encoder.gate` + `encoder.proj`, their
`lm_head` (tied to the table) and `hash_head` (the cascade) our `decoder.mixers`.
"""

import itertools

import pytest
import torch

from mhf_dist.config import load_config
from mhf_dist.errors import ConfigError
from mhf_dist.models import build_model
from mhf_dist.signatures import SignatureTable
from mhf_dist.train.loop import train_local
from mhf_dist.train.trainable import apply_trainable, authors_ve_trainable

LAYERS = 6  # layers 0, 1, 4, 5 train; 2 and 3 are frozen
LAYER_LEAVES = [
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
]
MHF_HASH_IO = [  # the reference hash I/O, H2: one cascade mixer
    "encoder.table.weight",
    "encoder.gate.0.weight",
    "encoder.gate.0.bias",
    "encoder.gate.2.weight",
    "encoder.gate.2.bias",
    "encoder.proj.weight",
    "encoder.proj.bias",
    "decoder.mixers.0.0.weight",
    "decoder.mixers.0.0.bias",
    "decoder.mixers.0.2.weight",
    "decoder.mixers.0.2.bias",
]


def layer_names(stack, layers):
    return {f"{stack}.{i}.{leaf}" for i in layers for leaf in LAYER_LEAVES}


EXPECTED = {  # (trainable, frozen) parameter names
    "mhf": (
        {*layer_names("backbone.layers", (0, 1, 4, 5)), "backbone.norm.weight", *MHF_HASH_IO},
        layer_names("backbone.layers", (2, 3)),
    ),
    "qwen3": (
        {
            *layer_names("model.model.layers", (0, 1, 4, 5)),
            "model.model.norm.weight",
            "model.model.embed_tokens.weight",  # tied: also the head
        },
        layer_names("model.model.layers", (2, 3)),
    ),
    "qwen3-untied": (
        {
            *layer_names("model.model.layers", (0, 1, 4, 5)),
            "model.model.norm.weight",
            "model.model.embed_tokens.weight",
            "model.lm_head.weight",
        },
        layer_names("model.model.layers", (2, 3)),
    ),
}


def tiny(case):
    family = case.split("-")[0]
    overrides = [f"model.family={family}", "model.vocab_size=300", "model.hash.spec=H2B64"]
    overrides += [f"model.backbone.num_layers={LAYERS}", "train.weight_decay=0.1", "train.lr=1e-2"]
    if case.endswith("untied"):
        overrides.append("model.backbone.tie_word_embeddings=false")
    cfg = load_config("tiny", overrides)
    torch.manual_seed(0)
    return cfg, build_model(cfg.model, SignatureTable.build([f"t{i}" for i in range(300)], 2, 64))


@pytest.mark.parametrize("case", list(EXPECTED))
def test_the_authors_split_freezes_exactly_their_parameters(case):
    cfg, model = tiny(case)
    split = apply_trainable(model, authors_ve_trainable(cfg.model))
    trainable = {name for name, param in model.named_parameters() if param.requires_grad}
    frozen = {name for name, param in model.named_parameters() if not param.requires_grad}
    assert (trainable, frozen) == EXPECTED[case]
    assert set(split.frozen) == frozen
    assert split.total_params == sum(p.numel() for p in model.parameters())
    assert split.trainable_params == sum(p.numel() for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("case", ["mhf", "qwen3-untied"])
def test_frozen_parameters_stay_put_through_local_steps_and_trainable_ones_move(case):
    cfg, model = tiny(case)
    before = {name: param.detach().clone() for name, param in model.named_parameters()}
    rows = torch.randint(0, 300, (8, 33), generator=torch.Generator().manual_seed(0))
    batch = (
        {"tokens": rows, "signatures": model.vocab_signatures[rows]} if case == "mhf" else {"tokens": rows}
    )
    train_cfg = cfg.train.model_copy(
        update={"steps": 3, "warmup_steps": 1, "trainable": authors_ve_trainable(cfg.model)}
    )
    train_local(model, itertools.repeat(batch), train_cfg, log=None)  # applies train.trainable
    trainable, frozen = EXPECTED[case]
    after = dict(model.named_parameters())
    assert all(torch.equal(before[name], after[name]) for name in frozen)  # weight decay included
    moved = {name for name in trainable if not torch.equal(before[name], after[name])}
    assert moved == trainable


def test_negative_layer_indices_count_from_the_end_and_globs_cross_dots():
    _, model = tiny("qwen3")
    apply_trainable(model, ["model.model.layers.-1.mlp.*", "*norm.weight"])
    trainable = {name for name, param in model.named_parameters() if param.requires_grad}
    assert {name for name in trainable if "mlp" in name} == {
        f"model.model.layers.5.mlp.{leaf}"
        for leaf in ("gate_proj.weight", "up_proj.weight", "down_proj.weight")
    }
    assert "model.model.norm.weight" in trainable and "model.model.embed_tokens.weight" not in trainable


def test_a_pattern_that_matches_nothing_is_a_one_line_error():
    _, model = tiny("mhf")
    with pytest.raises(ConfigError, match=r"pattern 'backbone\.layer\.0\.\*' matches no parameter") as err:
        apply_trainable(model, ["backbone.norm.*", "backbone.layer.0.*"])
    assert "\n" not in str(err.value)
    assert all(param.requires_grad for param in model.parameters())  # nothing was frozen
    with pytest.raises(ConfigError, match=r"train\.trainable"):
        load_config("tiny", ["train.trainable=backbone.*"])  # a list, not a string


def test_no_patterns_leave_every_parameter_trainable():
    _, model = tiny("mhf")
    for patterns in (None, []):
        split = apply_trainable(model, patterns)
        assert split.frozen == () and all(param.requires_grad for param in model.parameters())


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_deepspeed_zero_stages_keep_frozen_parameters_and_train_the_rest(one_process_group, stage):
    from mhf_dist.train.engine import DeepSpeedStepper

    cfg, model = tiny("qwen3-untied")
    apply_trainable(model, authors_ve_trainable(cfg.model))
    before = {name: param.detach().clone() for name, param in model.named_parameters()}
    stepper = DeepSpeedStepper(model, cfg.train, stage, world_size=1, bf16=False, hidden_size=64)
    rows = torch.randint(0, 300, (8, 33), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        stepper.step({"tokens": rows})
    with stepper.whole_parameters():
        after = {name: param.detach().clone() for name, param in stepper.engine.module.named_parameters()}
    trainable, frozen = EXPECTED["qwen3-untied"]
    assert all(torch.equal(before[name], after[name]) for name in frozen)
    assert {name for name in trainable if not torch.equal(before[name], after[name])} == trainable
