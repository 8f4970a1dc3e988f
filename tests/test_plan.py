"""`mhf plan`: model states from DeepSpeed's estimators, activation counts against what autograd keeps."""

import pytest
import torch
from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs, model_to_params
from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

from mhf_dist.cli import main
from mhf_dist.config import load_config
from mhf_dist.models import build_model, param_count
from mhf_dist.models.checkpointing import checkpoint_layers
from mhf_dist.plan import (
    GIB,
    Cluster,
    activation_bytes,
    io_activation_bytes,
    largest_layer_params,
    layer_activation_elements,
    plan,
    recommend,
)
from mhf_dist.signatures import SignatureTable


def _built(model_cfg):
    table = None
    if model_cfg.family == "mhf":
        tokens = [str(i) for i in range(model_cfg.vocab_size)]
        table = SignatureTable.build(tokens, model_cfg.hash.num_hashes, model_cfg.hash.num_buckets)
    torch.manual_seed(0)
    return build_model(model_cfg, table)


@pytest.mark.parametrize("family", ["mhf", "qwen3"])
def test_model_states_agree_with_deepspeeds_estimators_called_directly(family):
    cfg = load_config("tiny", [f"model.family={family}"])
    cluster = Cluster(gpus_per_node=4, nodes=2, gpu_mem_gb=16)
    result = plan(cfg, family, 5000, cluster, seq_len=256, micro_batch=None, tokens=1e9, mfu=0.4)
    model_cfg = cfg.model.model_copy(update={"vocab_size": 5000})
    params, largest = model_to_params(_built(model_cfg))
    assert result.params == params == param_count(model_cfg)
    assert result.largest_layer_params == largest == largest_layer_params(model_cfg)
    zero2 = estimate_zero2_model_states_mem_needs(params, 4, 2, cpu_offload=False)[1]
    zero3 = estimate_zero3_model_states_mem_needs(params, largest, 4, 2, False, False)[1]
    assert result.state_gb[2] == pytest.approx(zero2 / GIB, rel=1e-12)
    assert result.state_gb[3] == pytest.approx(zero3 / GIB, rel=1e-12)
    assert result.state_gb[0] == pytest.approx(20 * params / GIB)
    assert result.state_gb[0] > result.state_gb[1] > result.state_gb[2]


def _kept_by_autograd(model, tokens):
    """Bytes of the distinct non-parameter storages autograd saves for the backward pass."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() and storage.data_ptr() not in params:
            kept[storage.data_ptr()] = max(kept.get(storage.data_ptr(), 0), storage.nbytes())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(tokens)
    return sum(kept.values())


@pytest.mark.parametrize(
    "overrides",
    [
        ["model.family=qwen3"],
        ["model.family=qwen3", "model.vocab_size=4000", "model.backbone.num_layers=3"],
        ["model.family=mhf"],
        ["model.family=mhf", "model.hash.spec=H4B512", "model.backbone.intermediate_size=256"],
    ],
    ids=["qwen3", "qwen3-V4000-3-layers", "mhf", "mhf-H4B512"],
)
def test_activation_counts_match_what_autograd_keeps(overrides):
    """fp32 on CPU: every kept tensor is 4 bytes an element, so the count itself is what is checked."""
    model_cfg = load_config("tiny", overrides).model
    batch, seq_len = 2, 64
    tokens = torch.randint(0, model_cfg.vocab_size, (batch, seq_len + 1))
    measured = _kept_by_autograd(_built(model_cfg), tokens) / (batch * seq_len)
    layers = model_cfg.backbone.num_layers * layer_activation_elements(model_cfg.backbone) * 4
    predicted = layers + io_activation_bytes(model_cfg, dtype_bytes=4)[0]
    assert predicted == pytest.approx(measured, rel=0.02)


@pytest.mark.parametrize("family", ["qwen3", "mhf"])
def test_checkpointed_activations_are_what_autograd_keeps_outside_the_recomputed_layers(family):
    """Kept: each layer's input and the output side (all of it for qwen3; mhf recomputes its cascade, so
    the plan's output side is an upper bound there)."""
    model_cfg = load_config("tiny", [f"model.family={family}"]).model
    batch, seq_len = 2, 64
    tokens = torch.randint(0, model_cfg.vocab_size, (batch, seq_len + 1))
    model = _built(model_cfg)
    checkpoint_layers(model)
    measured = _kept_by_autograd(model, tokens) / (batch * seq_len)
    kept = model_cfg.backbone.num_layers * model_cfg.backbone.hidden_size * 4
    output_side = io_activation_bytes(model_cfg, dtype_bytes=4)[0]
    # The plan: what autograd keeps, one layer live again while it is recomputed, the output's backward.
    planned = activation_bytes(model_cfg, seq_len, batch, dtype_bytes=4, checkpointing=True) / (
        batch * seq_len
    )
    recompute = layer_activation_elements(model_cfg.backbone) * 4
    kept_by_plan = planned - recompute - io_activation_bytes(model_cfg, dtype_bytes=4)[1]
    assert kept_by_plan == pytest.approx(kept + output_side, rel=1e-9)
    if family == "qwen3":
        assert kept_by_plan == pytest.approx(measured, rel=0.02)
    else:
        assert kept < measured < kept_by_plan
    big = load_config("1b").model  # where the layers dominate: 20 x 2048 wide
    full = activation_bytes(big, 2048, 1)
    assert activation_bytes(big, 2048, 1, checkpointing=True) < 0.5 * full


def test_recommendation_prefers_big_micro_batches_below_zero3():
    states = {0: 20 * GIB, 1: 8 * GIB, 2: 6 * GIB, 3: 3 * GIB}
    assert recommend(states, GIB, usable=100 * GIB, micro_batch=None) == (0, 64)
    assert recommend(states, GIB, usable=30 * GIB, micro_batch=None) == (1, 16)
    assert recommend(states, GIB, usable=30 * GIB, micro_batch=4) == (0, 4)
    assert recommend(states, 7 * GIB, usable=10 * GIB, micro_batch=None) == (3, 1)
    assert recommend(states, 8 * GIB, usable=10 * GIB, micro_batch=None) == (None, 1)


def test_mhf_plan_prints_mhf_and_qwen3_at_both_vocabularies(capsys):
    assert main(["plan", "--preset", "tiny", "--gpus", "2", "--gpu-mem-gb", "1", "--tokens", "1e9"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| mhf") or line.startswith("| qwen3")]
    assert len(rows) == 4 and "151,936" in out and "32,000" in out
    assert main(["plan", "--preset", "tiny", "--gpus", "2", "--gpu-mem-gb", "1", "--mfu", "2"]) == 2
    assert "error: --mfu is a fraction of peak" in capsys.readouterr().err
    triple = ["--set", "model.backbone.kind=triple_hybrid"]
    assert main(["plan", "--preset", "tiny", "--gpus", "2", "--gpu-mem-gb", "1", *triple]) == 2
    assert "model.backbone.kind=triple_hybrid has no activation model" in capsys.readouterr().err
