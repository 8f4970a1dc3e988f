"""Analytic parameter and FLOP counts, checked against the real modules by the tests.

FLOPs count matrix products only (2 per multiply-add), attention over the full T x T score matrix, as
`torch.utils.flop_counter` does; a training step costs three forward passes (forward + backward).
"""

from __future__ import annotations

from mhf_dist.config import BackboneConfig, ModelConfig


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


def hash_io_params(cfg: ModelConfig) -> int:
    """Hash encoder plus cascaded decoder: depends on B, never on V."""
    num_hashes, num_buckets = cfg.hash.num_hashes, cfg.hash.num_buckets
    d_model = cfg.backbone.hidden_size
    d_hash, d_casc, mixer = cfg.hash_widths()
    gate = cfg.hash.gate_hidden
    encoder = num_buckets * d_hash + num_hashes * d_hash + d_hash * gate + gate + d_hash * d_model
    decoder = d_model * d_casc + d_casc + num_hashes * num_buckets * d_casc + num_buckets * d_casc
    return encoder + decoder + 2 * d_casc * mixer + mixer * d_casc


def hash_io_forward_flops(cfg: ModelConfig) -> int:
    num_hashes, num_buckets = cfg.hash.num_hashes, cfg.hash.num_buckets
    d_model = cfg.backbone.hidden_size
    d_hash, d_casc, mixer = cfg.hash_widths()
    encoder = num_hashes * (d_hash * cfg.hash.gate_hidden + cfg.hash.gate_hidden) + d_hash * d_model
    cascade_steps = num_hashes - 1
    decoder = (
        d_model * d_casc
        + num_hashes * num_buckets * d_casc
        + cascade_steps * (num_buckets * d_casc + 3 * d_casc * mixer)
    )
    return 2 * (encoder + decoder)


def embedding_params(cfg: ModelConfig) -> int:
    """Input embedding plus LM head of a standard model (one table when tied)."""
    table = cfg.vocab_size * cfg.backbone.hidden_size
    return table if cfg.backbone.tie_word_embeddings else 2 * table


def mhf_params(cfg: ModelConfig) -> int:
    return backbone_params(cfg.backbone) + hash_io_params(cfg)


def mhf_forward_flops(cfg: ModelConfig, seq_len: int) -> int:
    return backbone_forward_flops(cfg.backbone, seq_len) + hash_io_forward_flops(cfg)


def qwen3_params(cfg: ModelConfig) -> int:
    return backbone_params(cfg.backbone) + embedding_params(cfg)


def qwen3_forward_flops(cfg: ModelConfig, seq_len: int) -> int:
    return backbone_forward_flops(cfg.backbone, seq_len) + 2 * cfg.vocab_size * cfg.backbone.hidden_size


def with_layers(cfg: ModelConfig, num_layers: int) -> ModelConfig:
    backbone = cfg.backbone.model_copy(update={"num_layers": num_layers})
    return cfg.model_copy(update={"backbone": backbone})


def matched_layers(cfg: ModelConfig) -> tuple[int, int]:
    """Layers for the Qwen3 baseline closest in total parameters to the MHF model of `cfg`.

    Returns (num_layers, residual) with residual = baseline params - MHF params.
    """
    target = mhf_params(cfg)
    fixed = qwen3_params(with_layers(cfg, 1)) - backbone_params(with_layers(cfg, 1).backbone)
    per_layer = backbone_params(with_layers(cfg, 2).backbone) - backbone_params(with_layers(cfg, 1).backbone)
    base = target - fixed - cfg.backbone.hidden_size  # minus the final norm
    candidates = {max(1, base // per_layer), max(1, base // per_layer + 1)}
    best = min(candidates, key=lambda layers: abs(qwen3_params(with_layers(cfg, layers)) - target))
    return best, qwen3_params(with_layers(cfg, best)) - target


def matched_config(cfg: ModelConfig) -> ModelConfig:
    """`cfg` with the Qwen3 baseline's layer count chosen to match the MHF model's parameters."""
    return with_layers(cfg, matched_layers(cfg)[0])
