"""Analytic parameter and FLOP counts, checked against the real modules by the tests.

FLOPs count matrix products only (2 per multiply-add), attention over the full T x T score matrix, as
`torch.utils.flop_counter` does; a training step costs three forward passes (forward + backward).
Nothing here decides what a family or stack is made of: the triple-latent formulas take the
`StackParts` a registry entry names, and `mhf` over `model.backbone.kind` asks that kind's entry
(`mhf_dist.plugins.BACKBONES`) for the stack's counts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mhf_dist.config import BackboneConfig, ModelConfig
from mhf_dist.plugins import BACKBONES


def _layer_matmul_params(bb: BackboneConfig) -> int:
    attention = bb.hidden_size * bb.head_dim * (2 * bb.num_heads + 2 * bb.num_kv_heads)
    return attention + 3 * bb.hidden_size * bb.intermediate_size


def backbone_params(bb: BackboneConfig) -> int:
    """Decoder layers (projections, QK-norms, two RMSNorms each) plus the final norm; no embedding."""
    per_layer = _layer_matmul_params(bb) + 2 * bb.head_dim + 2 * bb.hidden_size
    return bb.num_layers * per_layer + bb.hidden_size


def backbone_forward_flops(bb: BackboneConfig, seq_len: int) -> int:
    attention_scores = 2 * seq_len * bb.num_heads * bb.head_dim  # QK^T and AV, per query token
    return 2 * bb.num_layers * (_layer_matmul_params(bb) + attention_scores)


def qwen3_stack_params(cfg: ModelConfig) -> int:
    return backbone_params(cfg.backbone)


def qwen3_stack_forward_flops(cfg: ModelConfig, seq_len: int) -> int:
    """The decoder layers over a whole sequence of `seq_len` tokens."""
    return seq_len * backbone_forward_flops(cfg.backbone, seq_len)


def hash_io_params(cfg: ModelConfig) -> int:
    """Hash encoder plus cascaded decoder: depends on B, never on V."""
    if cfg.hash.io == "reference":
        return reference_io_params(cfg)
    num_hashes, num_buckets = cfg.hash.num_hashes, cfg.hash.num_buckets
    d_model = cfg.backbone.hidden_size
    d_hash, d_casc, mixer = cfg.hash_widths()
    gate = cfg.hash.gate_hidden
    encoder = num_buckets * d_hash + num_hashes * d_hash + d_hash * gate + gate + d_hash * d_model
    decoder = d_model * d_casc + d_casc + num_hashes * num_buckets * d_casc + num_buckets * d_casc
    return encoder + decoder + 2 * d_casc * mixer + mixer * d_casc


def reference_io_params(cfg: ModelConfig) -> int:
    """The [H*B, d] table (twice when untied), the gate and projection, H-1 mixers; all with biases."""
    num_hashes, num_buckets, k = cfg.hash.num_hashes, cfg.hash.num_buckets, cfg.hash.bottleneck
    d_model = cfg.backbone.hidden_size
    table = num_hashes * num_buckets * d_model
    tables = table if cfg.backbone.tie_word_embeddings else 2 * table
    gate = d_model * k + k + k + 1
    projection = d_model * d_model + d_model
    mixer = 2 * d_model * k + k + k * d_model + d_model
    return tables + gate + projection + (num_hashes - 1) * mixer


def input_coordinates(cfg: ModelConfig) -> int:
    """The coordinates the hash encoder reads: all H, or the num_lsh LSH ones under `lsh_only_embed`
    (the parameters stay: the decoder still uses every coordinate's table block)."""
    return cfg.hash.num_lsh if cfg.hash.lsh_only_embed else cfg.hash.num_hashes


def hash_encoder_forward_flops(cfg: ModelConfig) -> int:
    d_model, read = cfg.backbone.hidden_size, input_coordinates(cfg)
    if cfg.hash.io == "reference":
        k = cfg.hash.bottleneck
        return 2 * (read * (d_model * k + k) + d_model * d_model)
    d_hash = cfg.hash_widths()[0]
    gate = read * (d_hash * cfg.hash.gate_hidden + cfg.hash.gate_hidden)
    return 2 * (gate + d_hash * d_model)


def hash_decoder_forward_flops(cfg: ModelConfig) -> int:
    """Per token: every coordinate's B-way logits, and per cascade step the soft bucket and the mixer."""
    num_hashes, num_buckets = cfg.hash.num_hashes, cfg.hash.num_buckets
    cascade_steps = num_hashes - 1
    if cfg.hash.io == "reference":
        d_model, k = cfg.backbone.hidden_size, cfg.hash.bottleneck
        mixer = 3 * d_model * k
        return 2 * (num_hashes * num_buckets * d_model + cascade_steps * (num_buckets * d_model + mixer))
    _, d_casc, mixer = cfg.hash_widths()
    decoder = (
        cfg.backbone.hidden_size * d_casc
        + num_hashes * num_buckets * d_casc
        + cascade_steps * (num_buckets * d_casc + 3 * d_casc * mixer)
    )
    return 2 * decoder


def embedding_params(cfg: ModelConfig) -> int:
    """Input embedding plus LM head of a standard model (one table when tied)."""
    table = cfg.vocab_size * cfg.backbone.hidden_size
    return table if cfg.backbone.tie_word_embeddings else 2 * table


def mhf_params(cfg: ModelConfig) -> int:
    """Hash I/O around the stack `model.backbone.kind` names (its entry counts any memory it has)."""
    return BACKBONES.entry(cfg.backbone.kind).params(cfg) + hash_io_params(cfg)


def mhf_forward_flops(cfg: ModelConfig, seq_len: int) -> int:
    """Per token of the training forward; with a stack's memory the decoder runs twice (recurrent, fused)."""
    stack = BACKBONES.entry(cfg.backbone.kind)
    hash_io = hash_encoder_forward_flops(cfg) + hash_decoder_forward_flops(cfg)
    total = stack.forward_flops(cfg, seq_len)
    if stack.parts.memory:
        total += seq_len * hash_decoder_forward_flops(cfg)
    return total // seq_len + hash_io


def qwen3_params(cfg: ModelConfig) -> int:
    return backbone_params(cfg.backbone) + embedding_params(cfg)


def qwen3_forward_flops(cfg: ModelConfig, seq_len: int) -> int:
    return backbone_forward_flops(cfg.backbone, seq_len) + 2 * cfg.vocab_size * cfg.backbone.hidden_size


def with_layers(cfg: ModelConfig, num_layers: int) -> ModelConfig:
    backbone = cfg.backbone.model_copy(update={"num_layers": num_layers})
    return cfg.model_copy(update={"backbone": backbone})


def matched_layers(cfg: ModelConfig) -> tuple[int, int]:
    """Layers for the Qwen3 baseline: the fewest at which it has at least the MHF model's parameters, so
    the baseline is never the smaller model (the paper's Standard+4L at 100M and +2L at 1B).

    Returns (num_layers, residual) with residual = baseline params - MHF params >= 0.
    """
    target = mhf_params(cfg)
    one_layer = qwen3_params(with_layers(cfg, 1))
    per_layer = qwen3_params(with_layers(cfg, 2)) - one_layer
    layers = max(1, 1 + -(-(target - one_layer) // per_layer))
    return layers, qwen3_params(with_layers(cfg, layers)) - target


def matched_config(cfg: ModelConfig) -> ModelConfig:
    """`cfg` with the Qwen3 baseline's layer count chosen to match the MHF model's parameters."""
    return with_layers(cfg, matched_layers(cfg)[0])


# --- the triple-latent family ----------------------------------------------------------------------
# Counted as `torch.utils.flop_counter` counts the modules: the projections, the MLP, the convolution,
# the head and the matrix products inside the chunked scans (whose cost depends on the chunk size).


def mixer_params(cfg: ModelConfig, slots: int = 0) -> int:
    d_model = cfg.backbone.hidden_size
    heads, state, _ = cfg.triple_widths()
    rows = slots or state
    gates = heads * (state + rows)
    return d_model * heads * (5 * state + rows) + gates + heads * slots * state + heads * state * d_model


def _scan_flops(length: int, chunk: int, heads: int, state: int, rows: int) -> int:
    """Matrix-product FLOPs of `pair_scan` (rows x state memory) over `length`; `diagonal_scan` has none."""
    chunk = min(chunk, length)
    chunks = -(-length // chunk)
    pair = 2 * chunk * chunk * rows + 2 * chunk * chunk * state + 4 * chunk * rows * state
    return heads * chunks * pair


def mixer_forward_flops(cfg: ModelConfig, seq_len: int, slots: int = 0) -> int:
    """FLOPs of one mixer over a whole sequence of `seq_len` tokens."""
    d_model = cfg.backbone.hidden_size
    heads, state, _ = cfg.triple_widths()
    rows = slots or state
    projections = 2 * d_model * heads * (5 * state + rows) + 2 * heads * state * d_model
    slot_addressing = 2 * 2 * heads * state * slots  # query and key through the slot keys
    per_token = projections + slot_addressing
    return seq_len * per_token + _scan_flops(seq_len, cfg.triple.chunk_size, heads, state, rows)


@dataclass(frozen=True)
class StackParts:
    """What a triple-latent stack adds to the plain one (`TripleLatentLM`'s switches); Qwen3 has none."""

    slots: bool = False  # the slot memory (rank-M factored pair memory)
    conv: bool = False  # the causal local convolution path
    memory: bool = False  # the explicit key-value memory, read beside the stack


def triple_stack_params(cfg: ModelConfig, parts: StackParts) -> int:
    """A `TripleStack`: the blocks, the final norm and the conv path; no embedding, head or memory."""
    bb = cfg.backbone
    slots = cfg.triple.num_slots if parts.slots else 0
    block = 2 * bb.hidden_size + mixer_params(cfg, slots) + 3 * bb.hidden_size * bb.intermediate_size
    total = bb.num_layers * block + bb.hidden_size
    if parts.conv:
        total += bb.hidden_size * (1 + cfg.triple.conv_kernel + bb.hidden_size)
    return total


def memory_params(cfg: ModelConfig) -> int:
    """gated_hybrid's key-value memory: q, k, v and out projections and the gate."""
    memory_dim = cfg.triple_widths()[2]
    return 4 * cfg.backbone.hidden_size * memory_dim + 2 * cfg.backbone.hidden_size + 1


def triple_stack_forward_flops(cfg: ModelConfig, seq_len: int, parts: StackParts) -> int:
    """FLOPs of a `TripleStack` over a whole sequence."""
    bb = cfg.backbone
    slots = cfg.triple.num_slots if parts.slots else 0
    d_model = bb.hidden_size
    total = bb.num_layers * mixer_forward_flops(cfg, seq_len, slots)
    total += seq_len * bb.num_layers * 6 * d_model * bb.intermediate_size
    if parts.conv:
        total += seq_len * 2 * d_model * d_model  # the depthwise kernel is element-wise products
    return total


def memory_forward_flops(cfg: ModelConfig, seq_len: int) -> int:
    """FLOPs of the memory over a whole sequence: projections, gate, scores and the top-k read."""
    d_model, memory_dim = cfg.backbone.hidden_size, cfg.triple_widths()[2]
    pairs = seq_len - 1
    total = seq_len * (2 * 4 * d_model * memory_dim + 2 * 2 * d_model) + 2 * seq_len * pairs * memory_dim
    return total + (2 * seq_len * min(cfg.triple.memory_top_k, pairs) * memory_dim if pairs else 0)


def triple_body_params(cfg: ModelConfig, parts: StackParts) -> int:
    """Everything of a triple-latent model with `parts` but its input and output layers."""
    memory = memory_params(cfg) if parts.memory else 0
    return triple_stack_params(cfg, parts) + memory


def triple_body_forward_flops(cfg: ModelConfig, seq_len: int, parts: StackParts) -> int:
    """The stack and its memory over a whole sequence; no input or output layer."""
    memory = memory_forward_flops(cfg, seq_len) if parts.memory else 0
    return triple_stack_forward_flops(cfg, seq_len, parts) + memory


def triple_params(cfg: ModelConfig, parts: StackParts) -> int:
    return embedding_params(cfg) + triple_body_params(cfg, parts)


def triple_forward_flops(cfg: ModelConfig, seq_len: int, parts: StackParts) -> int:
    """Per token; with the memory the head also reads the retrieved vector (a second V-way product)."""
    head = seq_len * 2 * cfg.backbone.hidden_size * cfg.vocab_size
    heads = 2 if parts.memory else 1
    return (triple_body_forward_flops(cfg, seq_len, parts) + heads * head) // seq_len


def transformer_plus_triple_params(cfg: ModelConfig) -> int:
    return qwen3_params(cfg) + cfg.backbone.hidden_size + mixer_params(cfg)


def transformer_plus_triple_forward_flops(cfg: ModelConfig, seq_len: int) -> int:
    return qwen3_forward_flops(cfg, seq_len) + mixer_forward_flops(cfg, seq_len) // seq_len


def with_intermediate(cfg: ModelConfig, intermediate_size: int) -> ModelConfig:
    backbone = cfg.backbone.model_copy(update={"intermediate_size": intermediate_size})
    return cfg.model_copy(update={"backbone": backbone})


def match_target_params(cfg: ModelConfig) -> int:
    """What `model.triple.match_params` matches: the qwen3 baseline or the mhf model (`match_to`)."""
    if cfg.triple.match_to == "mhf":
        return mhf_params(cfg)
    return qwen3_params(cfg)


def param_matched_intermediate(cfg: ModelConfig, params: Callable[[ModelConfig], int]) -> tuple[int, int]:
    """MLP width giving `params` closest to `match_target_params(cfg)`: (intermediate_size, residual)."""
    target = match_target_params(cfg)
    base = params(with_intermediate(cfg, 1))
    slope = params(with_intermediate(cfg, 2)) - base
    estimate = max(1, 1 + (target - base) // slope)
    best = min({estimate, estimate + 1}, key=lambda size: abs(params(with_intermediate(cfg, size)) - target))
    return best, params(with_intermediate(cfg, best)) - target
