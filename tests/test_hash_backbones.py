"""MultiHashFormer over every backbone (`model.backbone.kind`): the same hash encoder and decoder around
a Qwen3 or a triple-latent stack learn, score exactly over V_actl, decode step by step as they score in
parallel, and are counted exactly."""

import functools
import itertools

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from mhf_dist.cli import main
from mhf_dist.config import load_config
from mhf_dist.errors import ConfigError
from mhf_dist.models import build_model, forward_flops_per_token, hash_io, param_count
from mhf_dist.models.counting import mhf_params
from mhf_dist.models.generation import generate
from mhf_dist.models.registry import resolved_config
from mhf_dist.models.triple_latent import TripleStack
from mhf_dist.signatures import SignatureTable
from mhf_dist.train.loop import train_local

KINDS = ["qwen3", "triple_latent", "triple_slot", "triple_hybrid", "gated_hybrid"]
VOCAB = 300
TABLE = SignatureTable.build([f"tok{i}" for i in range(VOCAB)], 2, 64)


def kind_cfg(kind, *overrides):
    return load_config(
        "tiny",
        [
            f"model.vocab_size={VOCAB}",
            "model.hash.spec=H2B64",
            f"model.backbone.kind={kind}",
            "model.triple.chunk_size=4",  # several chunks in a 16-token row
            *overrides,
        ],
    )


def model_of(kind, *overrides, table=TABLE):
    torch.manual_seed(0)
    return build_model(kind_cfg(kind, *overrides).model, table)


def exact_logprobs(model, rows):
    """log p over the real vocabulary after every prefix of `rows`, [B, T, V]."""
    coords = model.coord_logprobs(rows).flatten(0, 1)
    return hash_io.vocab_logprobs(coords, model.vocab_signatures).view(*rows.shape, -1)


def random_rows(batch=2, length=17, seed=0):
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", KINDS)
def test_each_backbone_learns_a_tiny_task_through_hash_io(kind, tiny_text_task):
    vocab, rows = tiny_text_task
    overrides = [f"model.vocab_size={len(vocab)}", "train.steps=60", "train.warmup_steps=5"]
    model = model_of(kind, *overrides, table=SignatureTable.build(vocab, 2, 64))
    assert isinstance(model.backbone, TripleStack) == (kind != "qwen3")
    train_cfg = kind_cfg(kind, *overrides).train
    history = train_local(model, itertools.repeat({"tokens": rows}), train_cfg, log=None)
    assert history[-1]["loss"] < 0.5 * history[0]["loss"]


@pytest.mark.parametrize("kind", KINDS)
def test_exact_logprobs_sum_to_one_over_the_real_vocabulary(kind):
    model = model_of(kind).eval()
    rows = random_rows()
    with torch.no_grad():
        every_position = exact_logprobs(model, rows)
        assert torch.allclose(every_position.logsumexp(-1), torch.zeros(rows.shape), atol=1e-5)
        nll = model.token_nll(rows[:, :-1], rows[:, 1:])
        picked = every_position[:, :-1].gather(-1, rows[:, 1:, None]).squeeze(-1)
        assert torch.allclose(nll, -picked, atol=1e-4)
        assert model.token_nll(rows[:, :-1], rows[:, 1:]).mean() <= model(rows).loss


@pytest.mark.parametrize("kind", KINDS)
def test_step_by_step_decoding_equals_the_parallel_forward(kind):
    model = model_of(kind).to(torch.float64).eval()
    tokens = random_rows(length=14, seed=1)
    prompt = 5  # the prompt through the parallel scans, then one token at a time through the state
    with torch.no_grad():
        parallel = exact_logprobs(model, tokens)[:, prompt - 1 :]
        state = model.new_cache()
        stepped = [model.next_token_logprobs(tokens[:, :prompt], state)[0]]
        stepped += [model.next_token_logprobs(tokens[:, t : t + 1], state)[0] for t in range(prompt, 14)]
    assert torch.allclose(torch.stack(stepped, dim=1), parallel, atol=1e-5)

    generated = list(generate(model, tokens[0, :prompt].tolist(), max_new_tokens=12))
    assert generated == list(generate(model, tokens[0, :prompt].tolist(), 12, use_cache=False))
    sequence = torch.tensor([tokens[0, :prompt].tolist() + generated])
    with torch.no_grad():
        greedy = exact_logprobs(model, sequence[:, :-1]).argmax(-1)[0]
    assert greedy[prompt - 1 :].tolist() == generated


@pytest.mark.parametrize("kind", KINDS)
def test_parameters_and_flops_are_counted_exactly_and_every_parameter_learns(kind):
    model = model_of(kind)
    assert param_count(kind_cfg(kind).model) == sum(p.numel() for p in model.parameters())
    for module in model.modules():
        if hasattr(module, "set_attn_implementation"):
            module.set_attn_implementation("eager")  # sdpa kernels on CPU are invisible to the counter
    rows = random_rows(batch=3)
    with FlopCounterMode(display=False) as counter:
        out = model(rows)
    assert counter.get_total_flops() == forward_flops_per_token(kind_cfg(kind).model, 16) * 3 * 16
    out.loss.backward()
    missing = [name for name, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    # The gate's output bias shifts every coordinate's score equally; the softmax over coordinates
    # cancels it, so its gradient is zero by construction (the reference carries it all the same).
    assert set(missing) <= {"encoder.gate.2.bias"}
    assert model.encoder.gate[2].bias.grad.abs().max() < 1e-6
    big = load_config("1b", [f"model.backbone.kind={kind}"]).model
    with torch.device("meta"):
        built = build_model(big, one_b_table())
    assert param_count(big) == sum(p.numel() for p in built.parameters())


@functools.cache
def one_b_table():
    big = load_config("1b").model
    vocab = [str(i) for i in range(big.vocab_size)]
    return SignatureTable.build(vocab, big.hash.num_hashes, big.hash.num_buckets)


def test_a_recurrent_stack_decodes_in_a_state_that_does_not_grow_with_the_context():
    model = model_of("triple_hybrid").eval()
    state = model.new_cache()

    def state_elements():
        tensors = [state.conv, *itertools.chain.from_iterable(state.layers)]
        return sum(t.numel() for t in tensors)

    with torch.no_grad():
        model.next_token_logprobs(random_rows(batch=1, length=8), state)
        after_prompt = state_elements()
        for token in random_rows(batch=1, length=40, seed=3)[0]:
            model.next_token_logprobs(token.view(1, 1), state)
    assert state_elements() == after_prompt


def test_the_memory_under_hash_io_leaves_the_stack_and_encoder_untouched():
    """The bucket table is the decoder's too (tied, as in the reference), and the decoder learns from
    both paths: only the table may differ; the stack and the gate and projection may not."""
    gated, plain = model_of("gated_hybrid"), model_of("triple_latent")
    missing, unexpected = plain.load_state_dict(gated.state_dict(), strict=False)
    assert missing == [] and unexpected and all(name.startswith("memory.") for name in unexpected)
    rows = random_rows()
    gated_out, plain_out = gated(rows), plain(rows)
    gated_out.loss.backward()
    plain_out.loss.backward()
    assert gated_out.metrics["recurrent_loss"] == pytest.approx(plain_out.metrics["loss"], abs=1e-6)
    shared = dict(plain.named_parameters())
    for name, parameter in gated.named_parameters():
        if name.startswith(("encoder.gate", "encoder.proj", "backbone.")):
            assert torch.allclose(parameter.grad, shared[name].grad, atol=1e-7), name
        elif name.startswith("memory."):
            assert parameter.grad.abs().sum() > 0, name


def test_a_standard_triple_hybrid_can_be_matched_in_parameters_to_mhf_over_it():
    overrides = ["model.family=triple_hybrid", "model.triple.match_params=true", "model.triple.match_to=mhf"]
    cfg = kind_cfg("triple_hybrid", *overrides).model
    target = mhf_params(cfg.model_copy(update={"family": "mhf"}))
    one_mlp_unit = 3 * cfg.backbone.hidden_size * cfg.backbone.num_layers
    assert abs(param_count(cfg) - target) <= one_mlp_unit // 2 + 1
    assert resolved_config(cfg).backbone.intermediate_size != cfg.backbone.intermediate_size
    assert param_count(cfg) == sum(p.numel() for p in build_model(cfg).parameters())


def test_a_parameter_match_out_of_reach_is_an_error_and_mhf_count_says_so(capsys):
    """At V=8,192 and width 64 the standard model's embedding alone outweighs the whole mhf model."""
    overrides = ["model.vocab_size=8192", "model.triple.match_params=true", "model.triple.match_to=mhf"]
    cfg = kind_cfg("triple_hybrid", "model.family=triple_hybrid", *overrides).model
    with pytest.raises(ConfigError, match=r"MLP width of 1 .* model\.triple\.match_params=false"):
        param_count(cfg)
    sets = [f"--set={override}" for override in ["model.backbone.kind=triple_hybrid", *overrides]]
    assert main(["count", *sets]) == 0
    out = capsys.readouterr().out
    assert "| mhf over triple_hybrid" in out and "\ntriple_hybrid: model.triple.match_params:" in out


def test_a_stack_kind_belongs_to_mhf_or_to_its_own_family():
    kind_cfg("triple_hybrid", "model.family=triple_hybrid")  # the standard twin of mhf over triple_hybrid
    with pytest.raises(ConfigError, match=r"model\.backbone\.kind=triple_hybrid .* set model\.family=mhf"):
        kind_cfg("triple_hybrid", "model.family=qwen3")
