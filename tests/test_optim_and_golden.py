"""The schedule, the weight-decay groups, and a golden loss curve that pins the whole training math.

The golden file holds the `tiny` preset's first 20 training losses on the built-in corpus (bytes
tokenizer, so no tokenizer training can drift it). A change to the model, the signatures, the optimizer,
the schedule or the packing moves them: rewrite the file only on purpose, with the reason in the
commit, by running this module as a script (the test itself only ever compares):

    python tests/test_optim_and_golden.py
"""

import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from mhf_dist.config import load_config
from mhf_dist.data.corpus import builtin_documents
from mhf_dist.data.packing import pack_rows
from mhf_dist.data.tokenizer import TextTokenizer
from mhf_dist.models import build_model
from mhf_dist.models.registry import FAMILIES
from mhf_dist.signatures import build_for_config
from mhf_dist.train.loop import train_local
from mhf_dist.train.optim import build_optimizer, lr_factor, param_groups

GOLDEN = Path(__file__).parent / "golden" / "tiny_mhf_builtin_losses.json"


def test_lr_warms_up_linearly_then_decays_by_cosine_to_the_floor():
    cfg = load_config("tiny", ["train.steps=110", "train.warmup_steps=10", "train.min_lr_ratio=0.1"]).train
    assert [lr_factor(step, cfg) for step in (0, 4, 9)] == pytest.approx([0.1, 0.5, 1.0])
    assert lr_factor(10, cfg) == pytest.approx(1.0)  # the cosine starts at the peak
    assert lr_factor(60, cfg) == pytest.approx(0.1 + 0.9 * 0.5)  # halfway: the mean of peak and floor
    assert lr_factor(110, cfg) == pytest.approx(0.1) and lr_factor(500, cfg) == pytest.approx(0.1)
    decay = [lr_factor(step, cfg) for step in range(10, 111)]
    assert all(later <= earlier for earlier, later in itertools.pairwise(decay))
    no_warmup = load_config("tiny", ["train.warmup_steps=0"]).train
    assert lr_factor(0, no_warmup) == pytest.approx(1.0)


def test_weight_decay_reaches_matrices_and_tables_only_each_parameter_once():
    cfg = load_config("tiny", ["train.weight_decay=0.5", "train.lr=0.1"])
    table = build_for_config(cfg.model.hash, [f"t{i}" for i in range(cfg.model.vocab_size)])
    model = build_model(cfg.model, table)
    decay, no_decay = param_groups(model, 0.5)
    assert decay["weight_decay"] == 0.5 and no_decay["weight_decay"] == 0.0
    grouped = [id(p) for p in decay["params"] + no_decay["params"]]
    assert sorted(grouped) == sorted(id(p) for p in model.parameters())  # the tied table once
    names = {id(p): name for name, p in model.named_parameters()}
    assert "encoder.table.weight" in {names[id(p)] for p in decay["params"]}
    undecayed = {names[id(p)] for p in no_decay["params"]}
    assert all(name.endswith(("bias", "norm.weight", "layernorm.weight")) for name in undecayed)
    assert "encoder.proj.bias" in undecayed and "backbone.norm.weight" in undecayed
    # One AdamW step with zero gradients: decayed tensors shrink by lr * wd * lr_factor, the rest stay.
    optimizer, _ = build_optimizer(model, cfg.train)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    shrink = 1 - 0.1 * lr_factor(0, cfg.train) * 0.5
    for name, p in model.named_parameters():
        expected = before[name] * (shrink if name not in undecayed else 1.0)
        assert torch.allclose(p.detach(), expected, atol=1e-7), name


@pytest.mark.parametrize(
    "overrides",
    [[f"model.family={family}"] for family in FAMILIES] + [["model.family=mhf", "model.hash.io=compact"]],
    ids=[*FAMILIES, "mhf-compact"],
)
def test_the_decayed_parameters_are_the_ones_the_hf_trainer_decays(overrides):
    """The authors train with the HF Trainer's AdamW groups; its own rule picks the same parameters."""
    from transformers import Trainer

    cfg = load_config("tiny", overrides)
    table = build_for_config(cfg.model.hash, [f"t{i}" for i in range(cfg.model.vocab_size)])
    with torch.device("meta"):
        model = build_model(cfg.model, table if cfg.model.family == "mhf" else None)
    hf_decayed = set(Trainer.get_decay_parameter_names(None, model))
    expected = {id(p) for name, p in model.named_parameters() if name in hf_decayed}  # as Trainer groups
    decay, no_decay = param_groups(model, 0.1)
    assert {id(p) for p in decay["params"]} == expected
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def golden_losses() -> list[float]:
    cfg = load_config("tiny", ["model.vocab_size=259", "train.steps=20", "data.tokenizer=bytes"])
    tokenizer = TextTokenizer.bytes()
    stream = [t for ids in tokenizer.encode_batch(builtin_documents()[:8]) for t in (*ids, tokenizer.eos_id)]
    rows = torch.from_numpy(pack_rows(np.asarray(stream), cfg.train.seq_len).astype(np.int64))
    batch = cfg.train.batch_size
    batches = ({"tokens": rows[step * batch : (step + 1) * batch]} for step in range(cfg.train.steps))
    table = build_for_config(cfg.model.hash, tokenizer.vocabulary(), tokenizer.pad_token)
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model, table)
    return [h["loss"] for h in train_local(model, batches, cfg.train, log=None)]


def test_the_tiny_presets_first_20_losses_equal_the_golden_curve():
    losses = golden_losses()
    golden = json.loads(GOLDEN.read_text())["losses"]
    assert len(losses) == len(golden) == 20 and all(math.isfinite(loss) for loss in losses)
    assert losses == pytest.approx(golden, rel=1e-5, abs=1e-5)


if __name__ == "__main__":
    GOLDEN.write_text(json.dumps({"losses": golden_losses()}, indent=1) + "\n")
    print(f"rewrote {GOLDEN}; say in the commit why the curve moved")
