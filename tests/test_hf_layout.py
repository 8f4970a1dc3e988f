"""The reference's checkpoint layout and plain transformers Qwen3, in and out.

The reference checkpoint is written here from random weights under the reference's key names; what it
should compute is worked out by a plain implementation of the reference's formulas (transformers'
own Qwen3Model for the layers, everything else written out below), never through mhf-dist's classes.
"""

import json

import mmh3
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3Model

from mhf_dist.cli import main
from mhf_dist.config import load_config
from mhf_dist.cpt import expand_model
from mhf_dist.data.tokenizer import TextTokenizer
from mhf_dist.export import export_model
from mhf_dist.hf_layout import export_hf, import_hf
from mhf_dist.models import build_model, param_count
from mhf_dist.signatures import SignatureTable

H, B, D, K = 3, 32, 32, 8
ROUNDED_VOCAB = 384  # the reference rounds V up to a multiple of 128; the bytes tokenizer has 259 tokens


def reference_signatures(tokens, pad_id, rows):
    """The reference's hash_map rule, written out: 1 + hash128 % (B-1), the last coordinate redrawn."""
    hash_map, used = torch.zeros(rows, H, dtype=torch.long), set()
    for token_id, token in enumerate(tokens):
        if token_id == pad_id:
            continue
        prefix = tuple(1 + mmh3.hash128(token, seed=j) % (B - 1) for j in range(H - 1))
        redraw = 0
        while (*prefix, last := 1 + mmh3.hash128(token, seed=H - 1 + redraw) % (B - 1)) in used:
            redraw += 1
        used.add((*prefix, last))
        hash_map[token_id] = torch.tensor([*prefix, last])
    return hash_map


def qwen3_hf_config(vocab_size, layers=2):
    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=D,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=64,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        tie_word_embeddings=True,
        attn_implementation="eager",
    )


@pytest.fixture(scope="module")
def reference_checkpoint(tmp_path_factory):
    """(directory, weights, hash_map, tokenizer, use_conditional_prob=False) of a random reference model."""
    directory = tmp_path_factory.mktemp("reference")
    tokenizer = TextTokenizer.bytes()
    pad_id = tokenizer.tokenizer.token_to_id("<pad>")
    torch.manual_seed(0)
    backbone = Qwen3Model(qwen3_hf_config(H * B))  # embed_tokens is the [H*B, d] table
    weights = {f"model.{name}": tensor.clone() for name, tensor in backbone.state_dict().items()}
    weights["model.embed_tokens.weight"] = torch.randn(H * B, D)
    shapes = {
        "model.combiner.scorer.0": (K, D),
        "model.combiner.scorer.2": (1, K),
        "model.combiner.output_proj.0": (D, D),
        **{f"hash_head.cascade_mixer.{j}.0": (K, 2 * D) for j in range(H - 1)},
        **{f"hash_head.cascade_mixer.{j}.2": (D, K) for j in range(H - 1)},
    }
    for name, shape in shapes.items():
        weights[f"{name}.weight"] = torch.randn(shape) * shape[1] ** -0.5
        weights[f"{name}.bias"] = torch.randn(shape[0]) * 0.1
    hash_map = reference_signatures(tokenizer.vocabulary(), pad_id, ROUNDED_VOCAB)
    save_file({**weights, "model.hash_map": hash_map}, str(directory / "model.safetensors"))
    config = qwen3_hf_config(ROUNDED_VOCAB).to_dict()
    extra = {"num_hashes": H, "num_buckets": B, "bottle_neck_dim": K, "num_lsh": 0, "lsh_only_embed": False}
    config.update(extra, use_conditional_prob=False, fused_decoding=False, pad_token_id=pad_id)
    (directory / "config.json").write_text(json.dumps(config))
    tokenizer.save(directory / "tokenizer.json")
    return directory, weights, hash_map, tokenizer


def reference_coordinate_logps(weights, hash_map, ids):
    """The reference's forward, [batch, T, H, B] log-probabilities of each coordinate's buckets."""
    table = weights["model.embed_tokens.weight"]

    def bottleneck(name, x):
        hidden = F.silu(x @ weights[f"{name}.0.weight"].T + weights[f"{name}.0.bias"])
        return hidden @ weights[f"{name}.2.weight"].T + weights[f"{name}.2.bias"]

    rows = table[hash_map[ids] + torch.arange(H) * B]  # [batch, T, H, d]
    gate = torch.softmax(bottleneck("model.combiner.scorer", rows), dim=-2)
    pooled = (gate * rows).sum(-2)
    embeds = (
        pooled @ weights["model.combiner.output_proj.0.weight"].T
        + weights["model.combiner.output_proj.0.bias"]
    )
    backbone = Qwen3Model(qwen3_hf_config(H * B))
    layers = {name.removeprefix("model."): t for name, t in weights.items() if name.startswith("model.")}
    backbone.load_state_dict({name: t for name, t in layers.items() if not name.startswith("combiner.")})
    state = backbone(inputs_embeds=embeds).last_hidden_state
    logits = []
    for k in range(H):
        block = table[k * B : (k + 1) * B]
        logits.append(state @ block.T)
        if k < H - 1:
            soft = torch.softmax(logits[-1], -1) @ block
            state = state + bottleneck(f"hash_head.cascade_mixer.{k}", torch.cat([state, soft], -1))
    return torch.log_softmax(torch.stack(logits, dim=-2), dim=-1)


def test_an_imported_reference_checkpoint_scores_as_the_reference_formulas_do(reference_checkpoint, tmp_path):
    directory, weights, hash_map, tokenizer = reference_checkpoint
    imported = import_hf(directory, tmp_path / "imported")
    vocab = tokenizer.vocab_size
    assert imported.config.vocab_size == vocab and imported.table.pad_id == 258
    assert torch.equal(imported.table.as_tensor(), hash_map[:vocab])
    rows = torch.randint(0, vocab, (2, 13), generator=torch.Generator().manual_seed(1))
    inputs, targets = rows[:, :-1], rows[:, 1:]
    with torch.no_grad():
        coords = reference_coordinate_logps(weights, hash_map, inputs)
        # use_conditional_prob: the V-way logits are the summed coordinate log-probabilities of each token
        token_logits = sum(coords[..., k, hash_map[:vocab, k]] for k in range(H))
        expected_nll = F.cross_entropy(token_logits.transpose(1, 2), targets, reduction="none")
        assert torch.allclose(imported.model.token_nll(inputs, targets), expected_nll, atol=1e-4)
        # the coordinates objective: B-way cross-entropy averaged over positions and coordinates, times H
        coord_loss = F.cross_entropy(coords.reshape(-1, B), hash_map[targets].reshape(-1)) * H
        assert imported.model(rows).loss == pytest.approx(coord_loss.item(), abs=1e-4)


def test_reference_export_then_import_is_exact_and_the_layout_is_the_references(
    reference_checkpoint, tmp_path
):
    directory, weights, hash_map, tokenizer = reference_checkpoint
    first = import_hf(directory, tmp_path / "first")
    assert main(["export-hf", str(first.path), "--out", str(tmp_path / "hf")]) == 0
    written = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert set(written) == {*weights, "model.hash_map"}  # no lm_head.weight when tied
    assert all(torch.equal(written[name], tensor) for name, tensor in weights.items())
    assert torch.equal(written["model.hash_map"], hash_map[: tokenizer.vocab_size])
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["num_hashes"], config["num_buckets"], config["bottle_neck_dim"], config["num_lsh"]) == (
        H,
        B,
        K,
        0,
    )
    second = import_hf(tmp_path / "hf", tmp_path / "second")
    assert second.config == first.config and second.table.fingerprint == first.table.fingerprint
    for (name, a), b in zip(
        first.model.state_dict().items(), second.model.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name


def test_vocabulary_expansion_of_an_imported_model_adds_no_parameters_and_follows_the_scheme(
    reference_checkpoint, tmp_path
):
    directory, _, hash_map, tokenizer = reference_checkpoint
    imported = import_hf(directory, tmp_path / "imported")
    new_tokens = ["Ġhello", "Ġworld", "日本語"]
    expansion = expand_model(imported, new_tokens)
    assert expansion.params_added == 0 and param_count(expansion.config) == param_count(imported.config)
    rows = expansion.table.as_tensor()
    vocab = tokenizer.vocab_size
    assert torch.equal(rows[:vocab], hash_map[:vocab])
    every = reference_signatures([*tokenizer.vocabulary(), *new_tokens], imported.table.pad_id, vocab + 3)
    assert torch.equal(rows[vocab:], every[vocab:])


def test_qwen3_exports_as_a_plain_transformers_directory_and_imports_back(tmp_path):
    cfg = load_config("tiny", ["model.family=qwen3", "model.vocab_size=259"]).model
    tokenizer = TextTokenizer.bytes()
    tokenizer.save(tmp_path / "tokenizer.json")
    table = SignatureTable.build(tokenizer.vocabulary(), 2, 64)
    torch.manual_seed(0)
    model = build_model(cfg, table).eval()
    export_model(model, cfg, table, tmp_path / "tokenizer.json", tmp_path / "ours")
    export_hf(tmp_path / "ours", tmp_path / "hf")
    plain = Qwen3ForCausalLM.from_pretrained(tmp_path / "hf").eval()
    rows = torch.randint(0, 259, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(plain(input_ids=rows).logits, model.logits(rows), atol=1e-5)
        back = import_hf(tmp_path / "hf", tmp_path / "back")
        assert torch.equal(back.model.logits(rows), model.logits(rows))


def test_bad_checkpoints_are_one_line_errors_and_leave_nothing(reference_checkpoint, tmp_path, capsys):
    directory = reference_checkpoint[0]
    config = json.loads((directory / "config.json").read_text())

    def variant(name, **changes):
        path = tmp_path / name
        path.mkdir()
        for file in ("model.safetensors", "tokenizer.json"):
            (path / file).write_bytes((directory / file).read_bytes())
        (path / "config.json").write_text(json.dumps({**config, **changes}))
        return path

    cases = [
        (tmp_path, "is not a Hugging Face checkpoint directory (no config.json)"),
        (variant("lsh", num_lsh=2), "mhf-dist imports MurmurHash3 signatures only (num_lsh=0)"),
        (variant("shape", num_buckets=64), "model.embed_tokens.weight has shape (96, 32) but"),
        (variant("llama", model_type="llama"), "has model_type 'llama'"),
    ]
    damaged = variant("damaged")
    (damaged / "config.json").write_text('{"model_type": "qwen3",')
    cases.append((damaged, "config.json' is damaged (invalid JSON at line 1); fix or re-download"))
    (variant("truncated") / "model.safetensors").write_bytes(b"\x10\x00")
    cases.append((tmp_path / "truncated", "cannot read " + str(tmp_path / "truncated" / "model.safetensors")))
    for source, message in cases:
        assert main(["import-hf", str(source), "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
        assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*"))


def test_shards_for_an_imported_model_carry_its_own_table(reference_checkpoint, tmp_path):
    """`mhf prepare --set data.signatures=DIR` (what `mhf train --init-from` and `mhf cpt` need)."""
    from mhf_dist.data.prepare import signature_table
    from mhf_dist.errors import DataError

    directory, _, _, tokenizer = reference_checkpoint
    imported = import_hf(directory, tmp_path / "imported")
    model = imported.config.model_dump(mode="json")
    cfg = load_config("tiny", [f"data.signatures={imported.path}"]).model_copy(
        update={"model": imported.config}
    )
    assert signature_table(cfg, tokenizer).fingerprint == imported.table.fingerprint
    with pytest.raises(DataError, match="is the table of another vocabulary"):
        signature_table(cfg, TextTokenizer.recall(64))
    other_seed = load_config("tiny", [f"data.signatures={imported.path}"]).model_copy(
        update={"model": imported.config.model_validate({**model, "hash": {**model["hash"], "seed": 1}})}
    )
    with pytest.raises(DataError, match=r"seed 0 \(reference\) but model.hash says H3B32 seed 1"):
        signature_table(other_seed, tokenizer)
