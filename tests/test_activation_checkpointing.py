"""train.activation_checkpointing: layers recompute in the backward; the loss and gradients do not change."""

import copy

import pytest
import torch

from mhf_dist.config import load_config
from mhf_dist.models import build_model
from mhf_dist.models.checkpointing import checkpoint_layers
from mhf_dist.signatures import build_for_config


def saved_bytes(model, tokens):
    """Loss, gradients, and the bytes autograd keeps for the backward (outside recomputed regions)."""
    kept = []

    def pack(tensor):
        kept.append(tensor.numel() * tensor.element_size())
        return tensor

    model.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(tokens).loss
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return loss.item(), grads, sum(kept)


@pytest.mark.parametrize(
    "overrides",
    [
        ["model.family=qwen3"],
        ["model.family=mhf"],
        ["model.family=mhf", "model.hash.io=compact"],
        ["model.family=mhf", "model.backbone.kind=triple_hybrid"],
        ["model.family=transformer_plus_triple"],
        ["model.family=triple_slot"],
    ],
    ids=lambda overrides: "+".join(item.split("=")[1] for item in overrides),
)
def test_recomputed_layers_give_the_same_loss_and_gradients_and_keep_fewer_bytes(overrides):
    cfg = load_config("tiny", ["model.vocab_size=300", "model.hash.spec=H2B64", *overrides]).model
    table = build_for_config(cfg.hash, [f"tok{i}" for i in range(300)])
    torch.manual_seed(0)
    plain = build_model(cfg, table).train()
    recomputed = copy.deepcopy(plain)
    assert checkpoint_layers(recomputed) >= cfg.backbone.num_layers
    tokens = torch.randint(0, 300, (2, 65), generator=torch.Generator().manual_seed(1))
    loss, grads, plain_bytes = saved_bytes(plain, tokens)
    loss_ckpt, grads_ckpt, ckpt_bytes = saved_bytes(recomputed, tokens)
    assert loss_ckpt == pytest.approx(loss, abs=1e-6)
    assert grads.keys() == grads_ckpt.keys() and grads
    for name, grad in grads.items():
        assert torch.allclose(grads_ckpt[name], grad, atol=1e-6), name
    assert ckpt_bytes < 0.6 * plain_bytes
    with torch.no_grad():  # evaluation and generation run the layers as before
        assert recomputed.eval()(tokens).loss.item() == pytest.approx(
            plain.eval()(tokens).loss.item(), abs=1e-6
        )
