"""The paper's other hash variants in one process (no Ray): LSH signatures (`model.hash.num_lsh`, with and
without `lsh_only_embed`) and single-hash H1 tables, whose authors' redraw rule leaves duplicate
signatures. Built through the registry from `--set` overrides, trained a step, exported and loaded back;
counted exactly; scored exactly where signatures repeat."""

import itertools

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from mhf_dist.config import load_config
from mhf_dist.data.tokenizer import TextTokenizer
from mhf_dist.errors import SignatureError
from mhf_dist.export import export_model, load_exported
from mhf_dist.models import build_model, forward_flops_per_token, param_count
from mhf_dist.models.generation import Sampling, choose_next, generate
from mhf_dist.models.hash_io import vocab_logprobs
from mhf_dist.signatures import build_for_config
from mhf_dist.train.loop import train_local

VARIANTS = {
    "lsh-2:1": ["model.hash.spec=H3B64", "model.hash.num_lsh=2"],
    "lsh-2:1-only-embed": ["model.hash.spec=H3B64", "model.hash.num_lsh=2", "model.hash.lsh_only_embed=true"],
    "lsh-3:0-vocab": ["model.hash.spec=H3B64", "model.hash.num_lsh=3", "model.hash.loss=vocab"],
    "single-hash": ["model.hash.spec=H1B64"],
    "single-hash-vocab": ["model.hash.spec=H1B64", "model.hash.loss=vocab"],
    "single-hash-compact": ["model.hash.spec=H1B64", "model.hash.io=compact", "model.hash.scheme=reference"],
}


def config_of(overrides):
    base = ["model.vocab_size=259", "data.tokenizer=bytes", "train.steps=1", "train.warmup_steps=0"]
    return load_config("tiny", [*base, *overrides])


def table_of(cfg):
    tokenizer = TextTokenizer.bytes()
    return build_for_config(cfg.model.hash, tokenizer.vocabulary(), tokenizer.pad_token)


def rows_of(batch=4, length=17, seed=0):
    return torch.randint(0, 259, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", list(VARIANTS))
def test_a_variant_builds_trains_a_step_exports_and_loads_back_equal(name, tmp_path):
    cfg = config_of(VARIANTS[name])
    table = table_of(cfg)
    table.check_follows(cfg.model.hash, "the table")
    assert table.num_lsh == cfg.model.hash.num_lsh
    if cfg.model.hash.num_hashes == 1:
        assert table.duplicate_signatures > 0  # 259 tokens, 63 buckets: the authors' rule repeats them
    torch.manual_seed(0)
    model = build_model(cfg.model, table)
    before = {key: p.detach().clone() for key, p in model.named_parameters()}
    history = train_local(model, itertools.repeat({"tokens": rows_of()}), cfg.train, log=None)
    assert len(history) == 1 and torch.isfinite(torch.tensor(history[0]["loss"]))
    changed = [key for key, p in model.named_parameters() if not torch.equal(p.detach(), before[key])]
    assert "encoder.table.weight" in changed or "encoder.bucket_embed.weight" in changed
    TextTokenizer.bytes().save(tmp_path / "tokenizer.json")
    export_model(model, cfg.model, table, tmp_path / "tokenizer.json", tmp_path / "model")
    loaded = load_exported(tmp_path / "model")
    assert loaded.config == cfg.model and loaded.table.fingerprint == table.fingerprint
    assert (loaded.table.num_lsh, loaded.table.duplicate_signatures) == (
        table.num_lsh,
        table.duplicate_signatures,
    )
    model.eval()
    rows = rows_of(batch=2, seed=1)
    with torch.no_grad():
        assert torch.equal(loaded.model(rows).loss, model(rows).loss)
        assert torch.equal(
            loaded.model.token_nll(rows[:, :-1], rows[:, 1:]), model.token_nll(rows[:, :-1], rows[:, 1:])
        )
        assert list(generate(loaded.model, [1, 2], 5)) == list(generate(model, [1, 2], 5))


@pytest.mark.parametrize("io", ["reference", "compact"])
@pytest.mark.parametrize("only_embed", [False, True])
def test_lsh_only_embed_reads_only_the_lsh_coordinates_and_the_decoder_still_predicts_all(io, only_embed):
    overrides = ["model.hash.spec=H3B64", "model.hash.num_lsh=1", f"model.hash.io={io}"]
    cfg = config_of([*overrides, "model.hash.scheme=reference", f"model.hash.lsh_only_embed={only_embed}"])
    torch.manual_seed(0)
    model = build_model(cfg.model, table_of(cfg)).eval()
    sigs = model.signatures_of(rows_of(batch=1, length=9))
    other = sigs.clone()
    other[..., 1:] = (other[..., 1:] % 63) + 1  # the two MurmurHash3 coordinates changed, the LSH one kept
    with torch.no_grad():
        same = torch.equal(model.hidden_states(sigs), model.hidden_states(other))
        coords = model.coord_logprobs(rows_of(batch=1, length=9))
    assert same == only_embed
    assert coords.shape[-2:] == (3, 64)  # every coordinate is still predicted


@pytest.mark.parametrize(
    "overrides",
    [
        ["model.hash.spec=H3B64", "model.hash.num_lsh=2", "model.hash.lsh_only_embed=true"],
        ["model.hash.spec=H3B64", "model.hash.num_lsh=1", "model.hash.lsh_only_embed=true",
         "model.hash.io=compact", "model.hash.scheme=reference"],
        ["model.hash.spec=H1B64"],
        ["model.hash.spec=H1B64", "model.backbone.tie_word_embeddings=false", "model.hash.loss=vocab"],
    ],
    ids=["reference-lsh-only-embed", "compact-lsh-only-embed", "single-hash", "single-hash-untied-vocab"],
)  # fmt: skip
def test_variants_are_counted_exactly_in_parameters_and_flops(overrides):
    cfg = config_of(overrides)
    torch.manual_seed(0)
    model = build_model(cfg.model, table_of(cfg))
    assert param_count(cfg.model) == sum(p.numel() for p in model.parameters())
    for module in model.modules():
        if hasattr(module, "set_attn_implementation"):
            module.set_attn_implementation("eager")  # sdpa kernels on CPU are invisible to the counter
    rows = rows_of(batch=2)
    with FlopCounterMode(display=False) as counter:
        model(rows).loss.backward()
    assert counter.get_total_flops() == 3 * forward_flops_per_token(cfg.model, 16) * rows[:, 1:].numel()


def test_duplicate_signatures_score_alike_each_row_counts_once_and_greedy_takes_the_lower_id():
    """H1B64 over 259 tokens: many tokens share their one bucket. Exact scoring gives them equal
    log-probabilities; the normaliser sums every row once, duplicates included (so the ids' mass is 1,
    as the authors' use_conditional_prob over hash_map rows); the vocab objective is the mean exact NLL;
    and where a shared signature is the best, greedy decoding takes the lowest of its ids (torch.argmax
    returns the first maximal index)."""
    cfg = config_of(["model.hash.spec=H1B64", "model.hash.loss=vocab"])
    table = table_of(cfg)
    torch.manual_seed(0)
    model = build_model(cfg.model, table).eval()
    column = table.rows[:, 0].tolist()
    first, second = next((i, j) for i, j in itertools.combinations(range(259), 2) if column[i] == column[j])
    rows = rows_of(batch=2)
    with torch.no_grad():
        logprobs, _ = model.next_token_logprobs(rows[:, :-1], None)
        assert torch.equal(logprobs[:, first], logprobs[:, second])
        assert torch.allclose(logprobs.logsumexp(-1), torch.zeros(2), atol=1e-5)
        sharing = [t for t in range(259) if column[t] == column[first]]
        bucket_logp = model.coord_logprobs(rows[:, :-1])[:, -1, 0, column[first]]
        # the ids of a bucket share its mass by count: p(id) = p_bucket / sum_b count_b p_b
        counts = torch.bincount(torch.tensor(column), minlength=64).float()
        normaliser = (model.coord_logprobs(rows[:, :-1])[:, -1, 0].exp() * counts).sum(-1).log()
        assert torch.allclose(logprobs[:, first], bucket_logp - normaliser, atol=1e-5)
        assert len(sharing) >= 2
        targets = torch.full((1, 1), first), torch.full((1, 1), second)
        inputs = rows[:1, :5]
        nll = [model.token_nll(inputs, torch.cat([inputs[:, 1:], t], 1))[0, -1] for t in targets]
        assert torch.equal(nll[0], nll[1])
        assert model(rows).loss.item() == pytest.approx(
            model.token_nll(rows[:, :-1], rows[:, 1:]).mean().item()
        )
        # the best signature shared: greedy picks the lowest id that has it
        scores = torch.full((1, 1, 1, 64), -20.0)
        scores[..., column[second]] = 0.0
        model.coord_logprobs = lambda ids, cache=None: scores.expand(ids.shape[0], ids.shape[1], 1, 64)
        assert list(generate(model, [1, 2], 3, use_cache=False)) == [sharing[0]] * 3
        tied = vocab_logprobs(scores[0, 0].unsqueeze(0), model.vocab_signatures)
        assert int(choose_next(tied, Sampling(), None)) == sharing[0]


def test_prepare_warns_about_duplicate_signatures_and_records_them_in_the_manifest(tmp_path):
    from mhf_dist.data.prepare import prepare  # the recall corpus prepares without Ray

    overrides = ["data.corpus=recall", "model.vocab_size=40", "train.seq_len=32", "data.recall.examples=8"]
    lines = []
    cfg = load_config("tiny", [*overrides, "model.hash.spec=H1B16", "data.recall.num_queries=2"])
    manifest = prepare(cfg, tmp_path / "data", log=lines.append)
    tokenizer = TextTokenizer.recall(40)
    table = build_for_config(cfg.model.hash, tokenizer.vocabulary(), tokenizer.pad_token)
    assert table.duplicate_signatures > 0 and manifest.signatures.fingerprint == table.fingerprint
    assert manifest.signatures.duplicate_signatures == table.duplicate_signatures
    assert sum(f"warning: {table.duplicate_signatures} token(s) share" in line for line in lines) == 1


def test_a_table_without_the_configs_lsh_coordinates_is_refused():
    cfg = config_of(["model.hash.spec=H3B64", "model.hash.num_lsh=2"])
    plain = build_for_config(
        config_of(["model.hash.spec=H3B64"]).model.hash, TextTokenizer.bytes().vocabulary()
    )
    with pytest.raises(
        SignatureError,
        match=r"num_lsh 0\) but model.hash says H3B64 seed 0 \(reference scheme, num_lsh 2\); rebuild",
    ):
        build_model(cfg.model, plain)
