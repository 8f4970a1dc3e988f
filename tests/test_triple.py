"""The triple-latent family: chunked scans against a step-by-step reference, recurrent inference
against the parallel forward, the gated memory's isolation, learning, and parameter matching."""

import itertools

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from mhf_dist.config import TripleConfig, load_config
from mhf_dist.errors import ConfigError
from mhf_dist.models import build_model, forward_flops_per_token, param_count
from mhf_dist.models.counting import qwen3_params
from mhf_dist.models.registry import TRIPLE_STACKS, resolved_config
from mhf_dist.models.scans import LOG_DECAY_FLOOR, MAX_CHUNK, diagonal_scan, pair_scan
from mhf_dist.models.triple_layers import TripleLatentMixer
from mhf_dist.train.loop import train_local

TRIPLE_FAMILIES = [*TRIPLE_STACKS, "transformer_plus_triple"]
F64 = torch.float64


def reference_diagonal(log_decay, inputs, initial):
    """s_t = exp(w_t) s_{t-1} + u_t, one time step after another."""
    state, states = initial, []
    for t in range(inputs.shape[2]):
        state = log_decay[:, :, t].exp() * state + inputs[:, :, t]
        states.append(state)
    return torch.stack(states, dim=2), state


def reference_pair(query, key, value, log_decay, initial):
    """P_t = diag(exp(w_t)) P_{t-1} + k_t v_t^T and o_t = P_t^T q_t, one time step after another."""
    memory, outputs = initial, []
    for t in range(query.shape[2]):
        decay = log_decay[:, :, t].exp()
        rows = [  # row by row, as the recurrence is written
            decay[:, :, row, None] * memory[:, :, row] + key[:, :, t, row, None] * value[:, :, t]
            for row in range(memory.shape[2])
        ]
        memory = torch.stack(rows, dim=2)
        outputs.append((memory * query[:, :, t, :, None]).sum(2))
    return torch.stack(outputs, dim=2), memory


def random_inputs(*shapes, seed):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=generator, dtype=F64, requires_grad=True) for shape in shapes]


def outputs_and_gradients(fn, inputs, seed):
    outputs = fn(*inputs)
    generator = torch.Generator().manual_seed(seed)
    loss = sum((out * torch.randn(out.shape, generator=generator, dtype=F64)).sum() for out in outputs)
    return [out.detach() for out in outputs], torch.autograd.grad(loss, inputs)


def assert_same(fast, slow, tol=1e-5):
    for a, b in zip(fast, slow, strict=True):
        assert a.shape == b.shape and torch.allclose(a, b, atol=tol, rtol=0), (a - b).abs().max()


@pytest.mark.parametrize(("length", "chunk"), [(16, 4), (13, 4), (13, 5), (7, 16), (9, 1), (1, 3)])
def test_diagonal_scan_equals_the_step_by_step_recurrence(length, chunk):
    raw_decay, inputs, initial = random_inputs((2, 3, length, 4), (2, 3, length, 4), (2, 3, 4), seed=length)

    def run(scan):
        return lambda w, u, s0: scan(LOG_DECAY_FLOOR * torch.sigmoid(w), u, s0)  # in the allowed range

    fast = outputs_and_gradients(
        run(lambda w, u, s0: diagonal_scan(w, u, s0, chunk)), [raw_decay, inputs, initial], 1
    )
    slow = outputs_and_gradients(run(reference_diagonal), [raw_decay, inputs, initial], 1)
    assert_same(fast[0], slow[0])
    assert_same(fast[1], slow[1])


@pytest.mark.parametrize(("length", "chunk"), [(16, 4), (13, 4), (13, 6), (7, 16), (9, 1), (1, 2)])
def test_pair_scan_equals_the_step_by_step_recurrence(length, chunk):
    shapes = [(2, 2, length, 5), (2, 2, length, 5), (2, 2, length, 3), (2, 2, length, 5), (2, 2, 5, 3)]
    inputs = random_inputs(*shapes, seed=length + chunk)

    def run(scan):
        return lambda q, k, v, w, p0: scan(q, k, v, LOG_DECAY_FLOOR * torch.sigmoid(w), p0)

    fast = outputs_and_gradients(run(lambda *a: pair_scan(*a, chunk=chunk)), inputs, 2)
    slow = outputs_and_gradients(run(reference_pair), inputs, 2)
    assert_same(fast[0], slow[0])
    assert_same(fast[1], slow[1])


def test_the_strongest_decay_stays_accurate_in_float32_at_the_largest_chunk():
    length, generator = 64, torch.Generator().manual_seed(0)
    log_decay = torch.full((1, 2, length, 4), LOG_DECAY_FLOOR)  # exp(-cum) reaches e^64 in a chunk
    q, k, v = (torch.randn(1, 2, length, 4, generator=generator) for _ in range(3))
    fast, fast_last = pair_scan(q, k, v, log_decay, torch.zeros(1, 2, 4, 4), chunk=MAX_CHUNK)
    slow, slow_last = reference_pair(
        *(x.double() for x in (q, k, v, log_decay)), torch.zeros(1, 2, 4, 4).double()
    )
    assert torch.allclose(fast.double(), slow, rtol=1e-4, atol=1e-5)
    assert torch.allclose(fast_last.double(), slow_last, rtol=1e-4, atol=1e-5)
    states, _ = diagonal_scan(log_decay, k, torch.zeros(1, 2, 4), chunk=MAX_CHUNK)
    expected, _ = reference_diagonal(log_decay.double(), k.double(), torch.zeros(1, 2, 4).double())
    assert torch.allclose(states.double(), expected, rtol=1e-4, atol=1e-5)
    decays = log_decay.clone().requires_grad_()  # and the gradients stay finite
    out, last = pair_scan(q, k, v, decays, torch.zeros(1, 2, 4, 4), chunk=MAX_CHUNK)
    (
        out.sum() + last.sum() + diagonal_scan(decays, k, torch.zeros(1, 2, 4), chunk=MAX_CHUNK)[0].sum()
    ).backward()
    assert torch.isfinite(decays.grad).all()


def test_the_config_allows_exactly_the_chunk_sizes_the_scans_support():
    assert TripleConfig.model_fields["chunk_size"].metadata[-1].le == MAX_CHUNK
    with pytest.raises(ConfigError, match="chunk_size"):
        load_config("tiny", [f"model.triple.chunk_size={MAX_CHUNK + 1}"])


@pytest.mark.parametrize("slots", [0, 3])
def test_mixer_steps_equal_its_chunked_forward_from_a_random_state(slots):
    torch.manual_seed(0)
    mixer = TripleLatentMixer(d_model=8, heads=2, state_dim=4, chunk_size=4, slots=slots).to(F64)
    x = torch.randn(2, 11, 8, dtype=F64)
    start = tuple(torch.randn_like(part) for part in mixer.empty_state(2, x))
    parallel, (s_last, p_last) = mixer(x, start)
    state, stepped = start, []
    for t in range(x.shape[1]):
        out, state = mixer.step(x[:, t : t + 1], state)
        stepped.append(out)
    assert_same([torch.cat(stepped, dim=1), *state], [parallel, s_last, p_last], tol=1e-10)


def family_cfg(family, *overrides):
    return load_config(
        "tiny", ["model.vocab_size=50", f"model.family={family}", "model.triple.chunk_size=4", *overrides]
    )


@pytest.mark.parametrize("family", TRIPLE_FAMILIES)
def test_recurrent_generation_equals_the_parallel_forward_position_by_position(family):
    cfg = family_cfg(family)
    torch.manual_seed(0)
    model = build_model(cfg.model).to(F64).eval()
    tokens = torch.randint(0, 50, (2, 14), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        parallel = torch.log_softmax(model.logits(tokens), dim=-1)
        cache = model.new_cache()
        prompt = 5  # a prompt through the scans, then one token at a time through `step`
        stepped = [model.next_token_logprobs(tokens[:, :prompt], cache)[0]]
        stepped += [model.next_token_logprobs(tokens[:, t : t + 1], cache)[0] for t in range(prompt, 14)]
    assert_same([torch.stack(stepped, dim=1)], [parallel[:, prompt - 1 :].float()], tol=1e-5)


@pytest.mark.parametrize("family", TRIPLE_FAMILIES)
def test_every_variant_learns_a_tiny_task(family, tiny_text_task):
    vocab, rows = tiny_text_task
    cfg = family_cfg(family, f"model.vocab_size={len(vocab)}", "train.steps=60", "train.warmup_steps=5")
    torch.manual_seed(0)
    history = train_local(build_model(cfg.model), itertools.repeat({"tokens": rows}), cfg.train, log=None)
    assert history[-1]["loss"] < 0.5 * history[0]["loss"]


def test_gated_memory_leaves_the_recurrent_path_untouched():
    torch.manual_seed(0)
    gated = build_model(family_cfg("gated_hybrid").model)
    plain = build_model(family_cfg("triple_latent").model)
    missing, unexpected = plain.load_state_dict(gated.state_dict(), strict=False)
    assert missing == [] and unexpected and all(name.startswith("memory.") for name in unexpected)
    rows = torch.randint(0, 50, (2, 17), generator=torch.Generator().manual_seed(2))
    gated_out, plain_out = gated(rows), plain(rows)
    (gated_out.loss).backward()
    plain_out.loss.backward()
    assert gated_out.metrics["recurrent_loss"] == pytest.approx(plain_out.metrics["loss"], abs=1e-6)
    shared = dict(plain.named_parameters())
    for name, parameter in gated.named_parameters():
        if name.startswith("memory."):
            assert parameter.grad is not None and parameter.grad.abs().sum() > 0, name
        else:
            assert torch.allclose(parameter.grad, shared[name].grad, atol=1e-7), name


def test_retrieval_finds_the_value_paired_with_the_query_key():
    """With hand-set projections (key = query = token identity) the memory returns the stored value."""
    torch.manual_seed(0)
    model = build_model(family_cfg("gated_hybrid", "model.triple.memory_dim=64").model)
    memory = model.memory
    with torch.no_grad():
        for proj in (memory.q_proj, memory.k_proj, memory.v_proj, memory.out_proj):
            proj.weight.copy_(torch.eye(64) * 30)
        model.embed.weight.copy_(torch.nn.functional.normalize(torch.randn(50, 64), dim=-1))
    sequence = torch.tensor([[3, 17, 5, 29, 8, 41, 0, 0, 5]])  # pairs (3,17) (5,29) (8,41); query 5
    embeds = model.embed(sequence)
    queries = memory.q_proj(embeds)
    keys, values = memory.k_proj(embeds)[:, :-1], memory.v_proj(embeds)[:, 1:]
    retrieved = memory._retrieve(queries, keys, values, seen=0)
    scores = memory.out_proj(retrieved[0, -1]) @ model.embed.weight.T
    assert int(scores.argmax()) == 29


@pytest.mark.parametrize("family", TRIPLE_FAMILIES)
def test_parameter_matching_lands_within_one_mlp_unit_of_the_baseline(family):
    cfg = family_cfg(family, "model.triple.match_params=true").model
    step = 3 * cfg.backbone.hidden_size * cfg.backbone.num_layers  # parameters of one MLP unit
    assert abs(param_count(cfg) - qwen3_params(cfg)) <= step // 2 + 1
    with torch.device("meta"):
        model = build_model(cfg)
    assert param_count(cfg) == sum(p.numel() for p in model.parameters())
    assert resolved_config(cfg).backbone.intermediate_size != cfg.backbone.intermediate_size


@pytest.mark.parametrize("family", TRIPLE_FAMILIES)
def test_analytic_flops_equal_the_flop_counter_across_several_chunks(family):
    cfg = family_cfg(family, "model.triple.match_params=true")  # chunk 4: four chunks of 16 steps
    torch.manual_seed(0)
    model = build_model(cfg.model)
    for module in model.modules():
        if hasattr(module, "set_attn_implementation"):
            module.set_attn_implementation("eager")
    rows = torch.randint(0, 50, (3, 17), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        model(rows)
    assert counter.get_total_flops() == forward_flops_per_token(cfg.model, 16) * 3 * 16


@pytest.mark.parametrize("family", TRIPLE_FAMILIES)
def test_untied_heads_are_counted(family):
    cfg = family_cfg(family, "model.backbone.tie_word_embeddings=false").model
    model = build_model(cfg)
    assert param_count(cfg) == sum(p.numel() for p in model.parameters())
    assert param_count(cfg) - param_count(family_cfg(family).model) == 50 * 64
