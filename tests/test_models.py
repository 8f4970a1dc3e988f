"""MultiHashFormer and the Qwen3 baselines: hash I/O, exact scoring, generation, gradients, counts."""

import itertools
import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from mhf_dist.config import load_config
from mhf_dist.errors import SignatureError, TrainingError
from mhf_dist.models import FAMILIES, build_model, forward_flops_per_token, hash_io, param_count
from mhf_dist.models.counting import matched_layers, with_layers
from mhf_dist.models.generation import Sampling, generate, generate_batch
from mhf_dist.signatures import SignatureTable
from mhf_dist.train.loop import train_local


def model_of(cfg, table, family="mhf", seed=0):
    torch.manual_seed(seed)
    return build_model(cfg.model.model_copy(update={"family": family}), table)


def random_rows(vocab_size, batch=2, length=17, seed=0):
    return torch.randint(0, vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_encoder_gives_distinct_vectors_for_distinct_signatures_including_permutations():
    torch.manual_seed(0)
    encoder = hash_io.HashEncoder(num_hashes=2, num_buckets=8, d_hash=16, gate_hidden=8, d_model=32)
    signatures = torch.tensor(list(itertools.product(range(8), repeat=2)))
    vectors = encoder(signatures)
    distances = torch.cdist(vectors, vectors) + torch.eye(len(signatures)) * 1e9
    assert distances.min() > 1e-6
    ab, ba = encoder(torch.tensor([[1, 5], [5, 1]]))
    assert not torch.allclose(ab, ba)


@pytest.mark.parametrize("block", [hash_io.POSITION_BLOCK, 3])
def test_exact_logprobs_sum_to_one_over_the_real_vocabulary(small_cfg, small_table, monkeypatch, block):
    monkeypatch.setattr(hash_io, "POSITION_BLOCK", block)  # also check blocks that split the positions
    model = model_of(small_cfg, small_table).eval()
    rows = random_rows(small_cfg.model.vocab_size)
    with torch.no_grad():
        every_position = hash_io.vocab_logprobs(
            model.coord_logprobs(rows).flatten(0, 1), model.vocab_signatures
        )
        assert torch.allclose(every_position.logsumexp(-1), torch.zeros(rows.numel()), atol=1e-5)
        logprobs, _ = model.next_token_logprobs(rows[:, :-1], None)
        assert logprobs.shape == (2, small_cfg.model.vocab_size)
        nll = model.token_nll(rows[:, :-1], rows[:, 1:])
        assert torch.allclose(nll[:, -1], -logprobs.gather(1, rows[:, -1:]).squeeze(1), atol=1e-4)


def test_exact_nll_is_at_most_the_signature_loss(small_cfg, small_table):
    model = model_of(small_cfg, small_table).eval()
    rows = random_rows(small_cfg.model.vocab_size, batch=4)
    with torch.no_grad():
        signature_loss = model(rows).loss
        exact = model.token_nll(rows[:, :-1], rows[:, 1:]).mean()
    assert exact <= signature_loss


def test_precomputed_signatures_give_the_same_loss_as_lookup(small_cfg, small_table):
    model = model_of(small_cfg, small_table).eval()
    rows = random_rows(small_cfg.model.vocab_size)
    with torch.no_grad():
        looked_up = model(rows).loss
        precomputed = model(rows, signatures=small_table.lookup(rows)).loss
    assert torch.equal(looked_up, precomputed)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_with_kv_cache_equals_greedy_without(small_cfg, small_table, family):
    model = model_of(small_cfg, small_table, family).eval()
    prompt = random_rows(small_cfg.model.vocab_size, batch=1, length=5)[0].tolist()
    cached = list(generate(model, prompt, max_new_tokens=20, use_cache=True))
    uncached = list(generate(model, prompt, max_new_tokens=20, use_cache=False))
    assert cached == uncached and len(cached) == 20


def test_seeded_sampling_is_reproducible_and_filters_apply(small_cfg, small_table):
    model = model_of(small_cfg, small_table).eval()
    sampling = Sampling(temperature=1.0, top_k=20, top_p=0.9, seed=3)
    first = list(generate(model, [1, 2, 3], 15, sampling))
    assert first == list(generate(model, [1, 2, 3], 15, sampling))
    assert first != list(generate(model, [1, 2, 3], 15, Sampling(temperature=1.0, seed=4)))
    with torch.no_grad():
        logprobs, _ = model.next_token_logprobs(torch.tensor([[1, 2, 3]]), None)
    top1 = int(logprobs.argmax())
    assert set(generate(model, [1, 2, 3], 1, Sampling(temperature=1.0, top_k=1, seed=0))) == {top1}
    # a temperature so small that the scores would overflow: greedy in effect, not nan
    assert list(generate(model, [1, 2, 3], 1, Sampling(temperature=1e-40, seed=0))) == [top1]


RAGGED_PROMPTS = [[7, 41, 3, 99, 250], [12], [5, 5, 180, 64, 2, 77, 31, 9], [201, 8, 140]]


def greedy_alone(model, prompt, max_new_tokens):
    """Greedy ids of one prompt, each from a fresh full pass over the whole sequence (no cache, no batch)."""
    sequence = list(prompt)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logprobs, _ = model.next_token_logprobs(torch.tensor([sequence]), None)
            sequence.append(int(logprobs.argmax()))
    return sequence[len(prompt) :]


@pytest.mark.parametrize("use_cache", [True, False])
@pytest.mark.parametrize("family", ["mhf", "qwen3", "triple_latent"])
def test_batched_greedy_of_ragged_prompts_equals_each_prompt_alone(small_cfg, small_table, family, use_cache):
    model = model_of(small_cfg, small_table, family).eval()
    expected = [greedy_alone(model, prompt, 6) for prompt in RAGGED_PROMPTS]
    assert generate_batch(model, RAGGED_PROMPTS, 6, use_cache=use_cache) == expected


def test_a_batch_row_stops_at_its_stop_id_or_stop_test_while_the_others_continue(small_cfg, small_table):
    model = model_of(small_cfg, small_table, "triple_latent").eval()
    alone = [greedy_alone(model, prompt, 8) for prompt in RAGGED_PROMPTS]
    stop_id = alone[0][2]
    assert all(stop_id not in ids for ids in alone[1:])  # only row 0 meets the stop id

    def second_row_has_four(row, ids):
        return row == 1 and len(ids) == 4

    outputs = generate_batch(model, RAGGED_PROMPTS, 8, stop_ids=[stop_id], should_stop=second_row_has_four)
    assert outputs == [alone[0][:3], alone[1][:4], alone[2], alone[3]]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_parameter_gets_a_gradient(small_cfg, small_table, family):
    model = model_of(small_cfg, small_table, family)
    model(random_rows(small_cfg.model.vocab_size)).loss.backward()
    missing = [name for name, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert missing == []


_tables: dict[tuple, SignatureTable] = {}


def table_for(cfg):
    key = (cfg.model.vocab_size, cfg.model.hash.num_hashes, cfg.model.hash.num_buckets)
    if key not in _tables:
        _tables[key] = SignatureTable.build([f"t{i}" for i in range(key[0])], key[1], key[2])
    return _tables[key]


@pytest.mark.parametrize("preset", ["tiny", "100m", "1b", "3b"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_analytic_parameter_count_equals_the_modules(preset, family):
    cfg = load_config(preset, [f"model.family={family}"])
    with torch.device("meta"):
        model = build_model(cfg.model, table_for(cfg))
    assert param_count(cfg.model) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    "overrides",
    [
        ["model.hash.io=compact"],
        ["model.hash.io=reference", "model.backbone.tie_word_embeddings=false"],
        ["model.hash.io=reference", "model.hash.loss=vocab", "model.hash.spec=H3B64"],
    ],
    ids=["compact", "reference-untied", "reference-vocab-H3"],
)
def test_every_hash_io_variant_is_counted_exactly_in_parameters_and_flops(small_cfg, overrides):
    cfg = load_config(
        "tiny", [f"model.vocab_size={small_cfg.model.vocab_size}", "model.hash.spec=H2B64", *overrides]
    )
    table = SignatureTable.build(
        [f"tok{i}" for i in range(cfg.model.vocab_size)],
        cfg.model.hash.num_hashes,
        cfg.model.hash.num_buckets,
        scheme=cfg.model.hash.signature_scheme,
    )
    model = model_of(cfg, table)
    assert param_count(cfg.model) == sum(p.numel() for p in model.parameters())
    for module in model.modules():
        if hasattr(module, "set_attn_implementation"):
            module.set_attn_implementation("eager")  # sdpa kernels on CPU are invisible to the counter
    rows = random_rows(cfg.model.vocab_size, batch=2, length=17)
    with FlopCounterMode(display=False) as counter:
        model(rows).loss.backward()
    assert counter.get_total_flops() == 3 * forward_flops_per_token(cfg.model, 16) * rows[:, 1:].numel()


def test_the_vocab_objective_is_the_exact_nll_that_evaluation_scores(small_cfg, small_table):
    cfg = small_cfg.model.model_copy(
        update={"hash": small_cfg.model.hash.model_copy(update={"loss": "vocab"})}
    )
    model = build_model(cfg, small_table)
    rows = random_rows(cfg.vocab_size, batch=3)
    out = model(rows)
    exact = model.token_nll(rows[:, :-1], rows[:, 1:]).mean()
    assert out.loss.item() == pytest.approx(exact.item(), rel=1e-5)
    out.loss.backward()
    assert model.encoder.table.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("preset", ["100m", "500m", "1b", "3b"])
def test_baseline_preset_sizes_match_their_names(preset):
    target = {"100m": 100e6, "500m": 500e6, "1b": 1e9, "3b": 3e9}[preset]
    assert abs(param_count(load_config(preset, ["model.family=qwen3"]).model) / target - 1) <= 0.15


@pytest.mark.parametrize("family", list(FAMILIES))
def test_analytic_forward_flops_equal_torch_flop_counter(small_cfg, small_table, family):
    model = model_of(small_cfg, small_table, family)
    for module in model.modules():
        if hasattr(module, "set_attn_implementation"):
            module.set_attn_implementation("eager")  # sdpa kernels on CPU are invisible to the counter
    rows = random_rows(small_cfg.model.vocab_size, batch=2, length=17)
    with FlopCounterMode(display=False) as counter:
        model(rows)
    model_cfg = small_cfg.model.model_copy(update={"family": family})
    assert counter.get_total_flops() == forward_flops_per_token(model_cfg, 16) * rows[:, 1:].numel()


def built_params(model_cfg, table=None):
    """Parameters of the model the registry builds (on the meta device), not the analytic count."""
    with torch.device("meta"):
        model = build_model(model_cfg, table)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(("preset", "extra_layers"), [("tiny", None), ("100m", 4), ("1b", 2)])
def test_matched_baseline_has_the_fewest_layers_with_at_least_mhfs_parameters(preset, extra_layers):
    cfg = load_config(preset)
    layers, residual = matched_layers(cfg.model)
    mhf = built_params(cfg.model, table_for(cfg))

    def qwen3(num_layers):
        return built_params(with_layers(cfg.model, num_layers).model_copy(update={"family": "qwen3"}))

    assert residual == qwen3(layers) - mhf >= 0
    assert layers == 1 or qwen3(layers - 1) < mhf
    if extra_layers is not None:  # the paper's Standard+4L (100M) and Standard+2L (1B)
        assert layers == cfg.model.backbone.num_layers + extra_layers


def test_tiny_mhf_memorises_a_short_repeated_text():
    text = "the quick brown fox jumps over the lazy dog. " * 12
    vocab = sorted(set(text))
    ids = torch.tensor([vocab.index(char) for char in text])
    rows = torch.stack([ids[i * 45 : i * 45 + 65] for i in range(4)])
    cfg = load_config("tiny", [f"model.vocab_size={len(vocab)}", "train.steps=200", "train.warmup_steps=5"])
    model = model_of(cfg, SignatureTable.build(vocab, 2, 1024))
    history = train_local(model, itertools.repeat({"tokens": rows}), cfg.train, log=None)
    assert history[0]["loss"] > 5 and history[-1]["loss"] < 0.1


def test_same_seed_same_curve_and_another_seed_another(small_cfg, small_table):
    rows = random_rows(small_cfg.model.vocab_size, batch=4, length=33)
    train_cfg = small_cfg.train.model_copy(update={"steps": 5})

    def curve(seed):
        model = model_of(small_cfg, small_table, seed=seed)
        return [
            h["loss"] for h in train_local(model, itertools.repeat({"tokens": rows}), train_cfg, log=None)
        ]

    assert curve(0) == curve(0)
    assert curve(0) != curve(1)


def test_non_finite_loss_stops_training_naming_the_step(small_cfg, small_table):
    model = model_of(small_cfg, small_table)
    with torch.no_grad():
        model.encoder.proj.weight.fill_(math.nan)
    rows = random_rows(small_cfg.model.vocab_size)
    with pytest.raises(TrainingError, match="loss is nan at step 1"):
        train_local(model, itertools.repeat({"tokens": rows}), small_cfg.train, log=None)


def test_token_ids_outside_the_vocabulary_are_a_one_line_error(small_cfg, small_table):
    model = model_of(small_cfg, small_table)
    with pytest.raises(SignatureError, match=r"token id 300 is outside the signature table \(ids 0..299\)"):
        model(torch.tensor([[1, 2, 300]]))


def test_mhf_refuses_a_table_that_does_not_fit_the_config(small_cfg):
    with pytest.raises(SignatureError, match=r"model\.vocab_size=300"):
        build_model(small_cfg.model, SignatureTable.build(["a", "b"], 2, 64))
    with pytest.raises(SignatureError, match=r"rebuild the table or change model\.hash"):
        build_model(small_cfg.model, SignatureTable.build([f"t{i}" for i in range(300)], 3, 64))
