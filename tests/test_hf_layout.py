"""The reference's checkpoint layout and plain transformers Qwen3, in and out.

The reference checkpoint is written here from random weights under the reference's key names, its
`hash_map` by `authors_loop` (an independent statement of the authors' `initialize_hash_map`: only the
base vocabulary hashed, added tokens and the rows up to a multiple of 128 left all zeros); what it
should compute is worked out by a plain implementation of the reference's formulas (transformers' own
Qwen3Model for the layers, everything else written out below), never through mhf-dist's classes.
"""

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from authors_loop import authors_hash_map
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3Model

from mhf_dist.cli import main
from mhf_dist.config import load_config
from mhf_dist.cpt import expand_model
from mhf_dist.data.tokenizer import TextTokenizer
from mhf_dist.errors import SignatureError
from mhf_dist.export import export_model
from mhf_dist.hf_layout import LayoutError, export_hf, import_hf
from mhf_dist.models import build_model, param_count
from mhf_dist.models.generation import generate
from mhf_dist.signatures import SignatureTable, save_table

H, B, D, K = 3, 32, 32, 8
ROUNDED_VOCAB = 384  # the reference rounds V up to a multiple of 128; the bytes tokenizer has 259 tokens
BASE_VOCAB = 256  # the bytes tokenizer's model vocabulary; <bos>, <eos>, <pad> are added tokens


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


def write_reference_checkpoint(
    directory, num_hashes=H, num_buckets=B, num_lsh=0, lsh_only_embed=False, use_conditional_prob=False
):
    """(weights, hash_map, tokenizer): a random reference model as their training script saves it."""
    tokenizer = TextTokenizer.bytes()
    pad_id = tokenizer.tokenizer.token_to_id("<pad>")
    torch.manual_seed(0)
    backbone = Qwen3Model(qwen3_hf_config(num_hashes * num_buckets))  # embed_tokens: the [H*B, d] table
    weights = {f"model.{name}": tensor.clone() for name, tensor in backbone.state_dict().items()}
    weights["model.embed_tokens.weight"] = torch.randn(num_hashes * num_buckets, D)
    shapes = {
        "model.combiner.scorer.0": (K, D),
        "model.combiner.scorer.2": (1, K),
        "model.combiner.output_proj.0": (D, D),
        **{f"hash_head.cascade_mixer.{j}.0": (K, 2 * D) for j in range(num_hashes - 1)},
        **{f"hash_head.cascade_mixer.{j}.2": (D, K) for j in range(num_hashes - 1)},
    }
    for name, shape in shapes.items():
        weights[f"{name}.weight"] = torch.randn(shape) * shape[1] ** -0.5
        weights[f"{name}.bias"] = torch.randn(shape[0]) * 0.1
    base = tokenizer.vocabulary()[:BASE_VOCAB]  # their range(tokenizer.vocab_size)
    hash_map = authors_hash_map(base, num_hashes, num_buckets, num_lsh, pad_id=pad_id, rows=ROUNDED_VOCAB)
    save_file({**weights, "model.hash_map": hash_map}, str(directory / "model.safetensors"))
    config = qwen3_hf_config(ROUNDED_VOCAB).to_dict()
    extra = {"num_hashes": num_hashes, "num_buckets": num_buckets, "bottle_neck_dim": K}
    config.update(extra, num_lsh=num_lsh, lsh_only_embed=lsh_only_embed, fused_decoding=False)
    config.update(use_conditional_prob=use_conditional_prob, pad_token_id=pad_id)
    (directory / "config.json").write_text(json.dumps(config))
    tokenizer.save(directory / "tokenizer.json")
    return weights, hash_map, tokenizer


@pytest.fixture(scope="module")
def reference_checkpoint(tmp_path_factory):
    """(directory, weights, hash_map, tokenizer) of a random reference model (use_conditional_prob=False)."""
    directory = tmp_path_factory.mktemp("reference")
    return directory, *write_reference_checkpoint(directory)


def reference_coordinate_logps(weights, hash_map, ids, num_hashes=H, num_buckets=B, embedded=None):
    """The reference's forward, [batch, T, H, B] log-probabilities of each coordinate's buckets;
    `embedded`: the leading coordinates the combiner reads (their lsh_only_embed: num_lsh)."""
    table = weights["model.embed_tokens.weight"]
    embedded = num_hashes if embedded is None else embedded

    def bottleneck(name, x):
        hidden = F.silu(x @ weights[f"{name}.0.weight"].T + weights[f"{name}.0.bias"])
        return hidden @ weights[f"{name}.2.weight"].T + weights[f"{name}.2.bias"]

    rows = table[hash_map[ids][..., :embedded] + torch.arange(embedded) * num_buckets]  # [batch, T, h, d]
    gate = torch.softmax(bottleneck("model.combiner.scorer", rows), dim=-2)
    pooled = (gate * rows).sum(-2)
    embeds = (
        pooled @ weights["model.combiner.output_proj.0.weight"].T
        + weights["model.combiner.output_proj.0.bias"]
    )
    backbone = Qwen3Model(qwen3_hf_config(num_hashes * num_buckets))
    layers = {name.removeprefix("model."): t for name, t in weights.items() if name.startswith("model.")}
    backbone.load_state_dict({name: t for name, t in layers.items() if not name.startswith("combiner.")})
    state = backbone(inputs_embeds=embeds).last_hidden_state
    logits = []
    for k in range(num_hashes):
        block = table[k * num_buckets : (k + 1) * num_buckets]
        logits.append(state @ block.T)
        if k < num_hashes - 1:
            soft = torch.softmax(logits[-1], -1) @ block
            state = state + bottleneck(f"hash_head.cascade_mixer.{k}", torch.cat([state, soft], -1))
    return torch.log_softmax(torch.stack(logits, dim=-2), dim=-1)


def authors_token_logits(coords, hash_map):
    """Their use_conditional_prob logits: sum over k of log-softmax_k at hash_map[:, k], one per ROW."""
    return sum(coords[..., k, hash_map[:, k]] for k in range(hash_map.shape[1]))


def check_import_scores_as_the_authors(imported, weights, hash_map, num_hashes, num_buckets, embedded=None):
    """The imported model's coordinate log-probabilities, exact NLL and `coordinates` loss against the
    reference's formulas on the checkpoint's raw tensors (exact NLL: their use_conditional_prob)."""
    vocab = imported.tokenizer.vocab_size
    rows = torch.randint(0, vocab, (2, 13), generator=torch.Generator().manual_seed(1))
    inputs, targets = rows[:, :-1], rows[:, 1:]
    with torch.no_grad():
        coords = reference_coordinate_logps(weights, hash_map, inputs, num_hashes, num_buckets, embedded)
        assert torch.allclose(imported.model.coord_logprobs(inputs), coords, atol=1e-5)
        token_logits = authors_token_logits(coords, hash_map)  # every hash_map row, reserved ones too
        expected_nll = F.cross_entropy(token_logits.transpose(1, 2), targets, reduction="none")
        assert torch.allclose(imported.model.token_nll(inputs, targets), expected_nll, atol=1e-5)
        # the coordinates objective: B-way cross-entropy averaged over positions and coordinates, times H
        coord_loss = (
            F.cross_entropy(coords.reshape(-1, num_buckets), hash_map[targets].reshape(-1)) * num_hashes
        )
        if imported.config.hash.loss == "coordinates":
            assert imported.model(rows).loss.item() == pytest.approx(coord_loss.item(), abs=1e-5)
        else:  # use_conditional_prob=True: their training loss is the mean of those NLLs
            assert imported.model(rows).loss.item() == pytest.approx(expected_nll.mean().item(), abs=1e-5)
    return expected_nll, token_logits, targets


def written_tensors(directory):
    """Every tensor of a Hugging Face directory: model.safetensors, or the shards its index names (each
    tensor in exactly the shard the index says)."""
    index = directory / "model.safetensors.index.json"
    if not index.exists():
        return load_file(directory / "model.safetensors")
    weight_map = json.loads(index.read_text())["weight_map"]
    tensors = {}
    for shard in sorted(set(weight_map.values())):
        held = load_file(directory / shard)
        assert {name for name, file in weight_map.items() if file == shard} == set(held)
        tensors.update(held)
    return tensors


def sample_rows(vocab, seed):
    return torch.randint(0, vocab, (2, 9), generator=torch.Generator().manual_seed(seed))


def check_export_and_reimport(first, weights, hash_map, tmp_path, name):
    out = tmp_path / f"{name}-hf"
    assert main(["export-hf", str(first.path), "--out", str(out)]) == 0
    assert not (out / "model.safetensors.index.json").exists()  # 5GB shards: a tiny model is one file
    check_reference_export(first, out, weights, hash_map, tmp_path / f"{name}-second")


def check_reference_export(first, out, weights, hash_map, second_dir):
    """`out` holds the checkpoint's tensors and config keys as they were; imported again, it is `first`."""
    written = written_tensors(out)
    assert set(written) == {*weights, "model.hash_map"}  # no lm_head.weight when tied
    assert all(torch.equal(written[key], tensor) for key, tensor in weights.items())
    assert torch.equal(written["model.hash_map"], hash_map)  # every row, the reserved ones too
    config = json.loads((out / "config.json").read_text())
    hash_cfg = first.config.hash
    assert (config["num_hashes"], config["num_buckets"], config["bottle_neck_dim"]) == (
        hash_cfg.num_hashes,
        hash_cfg.num_buckets,
        K,
    )
    assert (config["num_lsh"], config["lsh_only_embed"]) == (hash_cfg.num_lsh, hash_cfg.lsh_only_embed)
    assert config["vocab_size"] == ROUNDED_VOCAB
    second = import_hf(out, second_dir)
    assert second.config == first.config and second.table.fingerprint == first.table.fingerprint
    for (key, a), b in zip(first.model.state_dict().items(), second.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), key
    rows = sample_rows(first.config.vocab_size, 2)
    with torch.no_grad():
        assert torch.equal(
            first.model.token_nll(rows[:, :-1], rows[:, 1:]),
            second.model.token_nll(rows[:, :-1], rows[:, 1:]),
        )


def test_an_imported_reference_checkpoint_scores_as_the_reference_formulas_do(reference_checkpoint, tmp_path):
    directory, weights, hash_map, tokenizer = reference_checkpoint
    imported = import_hf(directory, tmp_path / "imported")
    vocab = tokenizer.vocab_size
    assert imported.config.vocab_size == vocab and imported.table.pad_id == 258
    assert torch.equal(imported.table.as_tensor(), hash_map)  # the whole hash_map, as it is
    assert (len(imported.table), imported.table.reserved_rows) == (vocab, ROUNDED_VOCAB - vocab)
    # their loop hashes the 256 byte tokens only: <bos>, <eos>, <pad> keep the all-zero signature
    assert imported.table.duplicate_signatures == 2
    check_import_scores_as_the_authors(imported, weights, hash_map, H, B)


def test_padded_vocab_rows_stay_in_the_normaliser_as_the_authors_use_conditional_prob_loss(tmp_path):
    """Their training loss with use_conditional_prob: cross-entropy over all config.vocab_size = 384
    hash_map rows (the 125 rows past the tokenizer included); the import reproduces it, and generation
    still emits only ids the tokenizer has."""
    (tmp_path / "ckpt").mkdir()
    weights, hash_map, tokenizer = write_reference_checkpoint(tmp_path / "ckpt", use_conditional_prob=True)
    imported = import_hf(tmp_path / "ckpt", tmp_path / "imported")
    assert imported.config.hash.loss == "vocab" and imported.table.num_rows == ROUNDED_VOCAB
    nll, token_logits, targets = check_import_scores_as_the_authors(imported, weights, hash_map, H, B)
    vocab = tokenizer.vocab_size
    real_only = F.cross_entropy(token_logits[..., :vocab].transpose(1, 2), targets, reduction="none")
    assert (nll - real_only).min() >= 0 and (nll - real_only).max() > 1e-2  # what dropping them gave
    with torch.no_grad():
        logprobs, _ = imported.model.next_token_logprobs(torch.tensor([[1, 2, 3]]), None)
        assert logprobs.shape == (1, vocab)  # ids only; the reserved rows share <bos>'s (256) signature
        with_reserved = torch.cat([logprobs[0], logprobs[0, 256].expand(ROUNDED_VOCAB - vocab)])
        assert with_reserved.logsumexp(-1).item() == pytest.approx(0.0, abs=1e-5)
        # Bucket 0 of every coordinate made the most likely: the all-zero signature wins, shared by
        # <bos> <eos> <pad> and the 125 reserved rows (128 rows, equal scores, each counted once), so
        # the ids keep 3/128 of the mass and greedy takes the lowest id among them, 256, never a row
        # past the tokenizer.
        scores = torch.full((1, 1, H, B), -30.0)
        scores[..., 0] = 0.0
        imported.model.coord_logprobs = lambda ids, cache=None: scores.expand(
            ids.shape[0], ids.shape[1], H, B
        )
        logprobs, _ = imported.model.next_token_logprobs(torch.tensor([[1, 2]]), None)
        assert logprobs.exp().sum().item() == pytest.approx(3 / 128, rel=1e-4)
        assert list(generate(imported.model, [1, 2], 4, use_cache=False)) == [256] * 4
    del imported.model.coord_logprobs
    check_export_and_reimport(imported, weights, hash_map, tmp_path, "padded")


@pytest.mark.parametrize(
    ("num_hashes", "num_lsh", "lsh_only_embed"),
    [(3, 2, False), (3, 2, True), (2, 2, True), (1, 0, False)],
    ids=["lsh-2:1", "lsh-2:1-only-embed", "lsh-2:0-only-embed", "single-hash"],
)
def test_lsh_and_single_hash_checkpoints_import_score_as_the_authors_and_export_back(
    tmp_path, num_hashes, num_lsh, lsh_only_embed
):
    """The paper's LSH:MMH3 ablations and its single-hash H1 models, built here by the authors' loop:
    the import keeps their hash_map, equals mhf-dist's own table for the same vocabulary, scores as
    their forward does (the encoder reading only the LSH coordinates under lsh_only_embed), and the
    export writes the same checkpoint back."""
    (tmp_path / "ckpt").mkdir()
    weights, hash_map, tokenizer = write_reference_checkpoint(
        tmp_path / "ckpt", num_hashes, B, num_lsh, lsh_only_embed
    )
    imported = import_hf(tmp_path / "ckpt", tmp_path / "imported")
    hash_cfg = imported.config.hash
    assert (hash_cfg.num_hashes, hash_cfg.num_lsh, hash_cfg.lsh_only_embed) == (
        num_hashes,
        num_lsh,
        lsh_only_embed,
    )
    assert torch.equal(imported.table.as_tensor(), hash_map) and imported.table.num_lsh == num_lsh
    ours = SignatureTable.build(tokenizer.vocabulary()[:BASE_VOCAB], num_hashes, B, num_lsh=num_lsh)
    assert torch.equal(ours.as_tensor(), hash_map[:BASE_VOCAB])
    if num_hashes == 1:  # one coordinate: only consecutive tokens are kept apart
        assert imported.table.duplicate_signatures > BASE_VOCAB - B
    embedded = num_lsh if lsh_only_embed else None
    check_import_scores_as_the_authors(imported, weights, hash_map, num_hashes, B, embedded)
    check_export_and_reimport(imported, weights, hash_map, tmp_path, "variant")


def test_vocabulary_expansion_of_an_imported_model_adds_no_parameters_and_follows_the_scheme(
    reference_checkpoint, tmp_path
):
    directory, weights, hash_map, tokenizer = reference_checkpoint
    imported = import_hf(directory, tmp_path / "imported")
    new_tokens = ["Ġhello", "Ġworld", "日本語"]
    expansion = expand_model(imported, new_tokens)
    # the expanded model's tensors against the checkpoint's (its hash_map is a buffer, not a parameter)
    checkpoint_params = sum(tensor.numel() for tensor in weights.values())
    assert sum(param.numel() for param in expansion.model.parameters()) == checkpoint_params
    assert param_count(expansion.config) == checkpoint_params and expansion.params_added == 0
    rows = expansion.table.as_tensor()
    vocab = tokenizer.vocab_size
    assert torch.equal(rows[:vocab], hash_map[:vocab])
    # the authors' loop continued after the base vocabulary (their added tokens are never hashed); the
    # new tokens take the first reserved rows' places and the other reserved rows stay
    base = tokenizer.vocabulary()[:BASE_VOCAB]
    every = authors_hash_map([*base, *new_tokens], H, B)  # <pad> (id 258) is an added token: not hashed
    assert torch.equal(rows[vocab : vocab + 3], every[BASE_VOCAB:])
    assert expansion.table.num_rows == ROUNDED_VOCAB and torch.equal(rows[vocab + 3 :], hash_map[vocab + 3 :])


@pytest.fixture(scope="module")
def qwen3_export(tmp_path_factory):
    """(exported directory, model, config) of a random tiny qwen3 over the bytes tokenizer."""
    directory = tmp_path_factory.mktemp("qwen3")
    cfg = load_config("tiny", ["model.family=qwen3", "model.vocab_size=259"]).model
    tokenizer = TextTokenizer.bytes()
    tokenizer.save(directory / "tokenizer.json")
    table = SignatureTable.build(tokenizer.vocabulary(), 2, 64)
    torch.manual_seed(0)
    model = build_model(cfg, table).eval()
    return export_model(model, cfg, table, directory / "tokenizer.json", directory / "ours"), model, cfg


@pytest.mark.parametrize("max_shard_size", ["5GB", "40KB"], ids=["one-file", "sharded"])
def test_qwen3_exports_as_a_transformers_directory_that_auto_loads_and_imports_back(
    qwen3_export, tmp_path, max_shard_size
):
    """transformers' AutoModelForCausalLM loads the export, one file or shards and their index, and
    computes our model's logits; import-hf reads it back to the same weights and logits."""
    ours, model, cfg = qwen3_export
    export_hf(ours, tmp_path / "hf", max_shard_size)
    shards = sorted(path.name for path in (tmp_path / "hf").glob("*.safetensors"))
    if max_shard_size == "5GB":
        assert shards == ["model.safetensors"]
    else:  # 40KB: the 49KB MLP matrices one to a shard, the smaller tensors packed up to 40KB
        assert len(shards) > 4 and (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    written = written_tensors(tmp_path / "hf")
    assert "lm_head.weight" not in written  # tied: stored once, as the embedding
    assert sum(tensor.numel() for tensor in written.values()) == param_count(cfg)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(plain).__name__ == "Qwen3ForCausalLM"
    rows = sample_rows(259, 0)
    with torch.no_grad():
        assert torch.allclose(plain(input_ids=rows).logits, model.logits(rows), atol=1e-5)
        back = import_hf(tmp_path / "hf", tmp_path / "back")
        for (key, a), b in zip(model.state_dict().items(), back.model.state_dict().values(), strict=True):
            assert torch.equal(a, b), key
        assert torch.equal(back.model.logits(rows), model.logits(rows))


def test_a_sharded_reference_export_imports_back_to_the_same_model(reference_checkpoint, tmp_path, capsys):
    """max_shard_size in bytes splits the reference layout too; import-hf reads the shards back, and a
    shard the index names but the directory lacks is a one-line error."""
    directory, weights, hash_map, _ = reference_checkpoint
    imported = import_hf(directory, tmp_path / "imported")
    out = tmp_path / "hf"
    export_hf(imported.path, out, max_shard_size=30_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2
    for shard in shards:  # each shard within the limit, unless it is one tensor larger than it
        held = load_file(out / shard)
        assert len(held) == 1 or sum(t.numel() * t.element_size() for t in held.values()) <= 30_000
    check_reference_export(imported, out, weights, hash_map, tmp_path / "second")
    (out / shards[1]).unlink()
    assert main(["import-hf", str(out), "--out", str(tmp_path / "third")]) == 2
    err = capsys.readouterr().err
    assert f"names 1 shard(s) that are not in {str(out)!r} ({shards[1]})" in err and err.count("\n") == 1
    assert not (tmp_path / "third").exists()


def test_an_out_that_cannot_be_created_and_a_bad_shard_size_are_one_line_errors(
    reference_checkpoint, qwen3_export, tmp_path, capsys
):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for command in (["import-hf", str(reference_checkpoint[0])], ["export-hf", str(qwen3_export[0])]):
        assert main([*command, "--out", str(blocker / "out")]) == 2
        err = capsys.readouterr().err
        assert f"cannot be created: {str(blocker)!r} is a file" in err and err.count("\n") == 1
    for size in ("5XB", "1.5", "lots"):
        with pytest.raises(LayoutError, match=r"is not a size; give bytes or a number with KB, MB or GB"):
            export_hf(qwen3_export[0], tmp_path / "hf", size)
    for size, bytes_ in (("-5MB", -5_000_000), ("-5", -5), (0, 0), ("0MB", 0)):
        with pytest.raises(
            LayoutError, match=rf"{size!r} is {bytes_} bytes; give a size above 0, e\.g\. 500MB$"
        ):
            export_hf(qwen3_export[0], tmp_path / "hf", size)
    assert not (tmp_path / "hf").exists()


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
        (variant("lsh", num_lsh=4), "num_lsh=4 exceeds the 3 hashes of H3B32; use num_lsh <= 3"),
        (variant("lsh-embed", lsh_only_embed=True), "lsh_only_embed=true embeds the LSH coordinates only"),
        (variant("shape", num_buckets=64), "model.embed_tokens.weight has shape (96, 32) but"),
        (variant("llama", model_type="llama"), "holds model_type 'llama'"),
        (variant("typed", hidden_size="wide"), "is not a valid Qwen3 config (Validation error for field"),
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
    with pytest.raises(
        DataError,
        match=r"seed 0 \(reference scheme, num_lsh 0\) but model.hash says H3B32 seed 1 \(reference",
    ):
        signature_table(other_seed, tokenizer)
    # A model whose table is not the one its config.json records is refused, as loading it would be.
    swapped = tmp_path / "swapped"
    shutil.copytree(imported.path, swapped)
    save_table(SignatureTable.build(imported.table.tokens, 3, 32, seed=1), swapped / "signatures.safetensors")
    with pytest.raises(SignatureError, match=r"differs from the one the model was trained with"):
        signature_table(
            cfg.model_copy(update={"data": cfg.data.model_copy(update={"signatures": str(swapped)})}),
            tokenizer,
        )


def local_tree(root):
    return {str(path.relative_to(root)): path.is_dir() or path.read_bytes() for path in root.rglob("*")}


def test_export_hf_and_import_hf_never_replace_a_folder_or_a_file_at_out(
    reference_checkpoint, qwen3_export, tmp_path
):
    (tmp_path / "thesis").mkdir()
    (tmp_path / "thesis" / "chapter.txt").write_text("three years of work")
    (tmp_path / "notes.txt").write_text("a plain file")
    before = local_tree(tmp_path)
    for taken in ("thesis", "notes.txt"):
        for write in (
            lambda out: export_hf(qwen3_export[0], out),
            lambda out: import_hf(reference_checkpoint[0], out),
        ):
            with pytest.raises(LayoutError, match=rf"output '.*{taken}' already exists; remove it or pick"):
                write(tmp_path / taken)
    assert local_tree(tmp_path) == before
