"""MultiHashFormer: hash encoder -> a stack (Qwen3 or triple-latent) -> cascaded hash decoder.

`model.hash.io` picks the encoder/decoder pair: `reference` (the paper's, `reference_io`) or `compact`
(`hash_io`); `model.hash.loss` the objective: the sum of coordinate cross-entropies or the exact
vocabulary likelihood.

Parameters depend on the number of buckets B, not on the vocabulary V: the vocabulary lives only in
the [rows, H] signature buffer, which exact scoring uses to renormalise over the real tokens V_actl: every
row once, duplicate signatures included (they score alike), and an imported checkpoint's reserved rows
past the tokenizer (the authors round V up to a multiple of 128), as the authors' `use_conditional_prob`
does; only the first `vocab_size` rows are ids, so generation never produces a reserved row. The
stack (`model.backbone.kind`) sees vectors in and hidden states out, so the encoder and decoder are
the same code over every backbone. Over a triple-latent stack (except gated_hybrid, whose memory keeps
every token pair) neither the parameters nor the generation state grow with V or with the context.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mhf_dist.config import ModelConfig
from mhf_dist.errors import SignatureError
from mhf_dist.models.base import CausalLM, LMOutput, split_rows
from mhf_dist.models.counting import input_coordinates
from mhf_dist.models.hash_io import (
    CascadedHashDecoder,
    HashEncoder,
    signature_loss,
    target_scores,
    vocab_logprobs,
    vocab_logsumexp,
    vocab_logsumexp_argmax,
    vocab_loss,
)
from mhf_dist.models.reference_io import ReferenceCascadeDecoder, ReferenceHashEncoder
from mhf_dist.models.triple_latent import make_memory, memory_read
from mhf_dist.plugins import BACKBONES


def build_stack(cfg: ModelConfig) -> nn.Module:
    """The stack `model.backbone.kind` names, as its registry entry builds it (Qwen3's decoder layers,
    a triple-latent stack, or one an outside package registered)."""
    return BACKBONES.entry(cfg.backbone.kind).build(cfg)


def build_hash_io(cfg: ModelConfig) -> tuple[nn.Module, nn.Module]:
    """The (encoder, decoder) pair `model.hash.io` names; the reference pair shares one table."""
    num_hashes, num_buckets = cfg.hash.num_hashes, cfg.hash.num_buckets
    d_model = cfg.backbone.hidden_size
    read = input_coordinates(cfg)
    if cfg.hash.io == "reference":
        encoder = ReferenceHashEncoder(num_hashes, num_buckets, d_model, cfg.hash.bottleneck, read)
        tied = cfg.backbone.tie_word_embeddings
        decoder = ReferenceCascadeDecoder(
            encoder.table.weight, num_hashes, num_buckets, cfg.hash.bottleneck, tied
        )
        return encoder, decoder
    d_hash, d_casc, mixer_hidden = cfg.hash_widths()
    encoder = HashEncoder(num_hashes, num_buckets, d_hash, cfg.hash.gate_hidden, d_model, read)
    return encoder, CascadedHashDecoder(d_model, num_hashes, num_buckets, d_casc, mixer_hidden)


class MultiHashFormer(CausalLM):
    """`vocab_signatures` is [rows, H]: ids 0..vocab_size-1, then any reserved rows (normaliser only)."""

    def __init__(self, cfg: ModelConfig, vocab_signatures: torch.Tensor) -> None:
        super().__init__()
        num_hashes, num_buckets = cfg.hash.num_hashes, cfg.hash.num_buckets
        _check_signatures(vocab_signatures, cfg.vocab_size, num_hashes, num_buckets)
        self.vocab_size = cfg.vocab_size
        self.loss_kind = cfg.hash.loss
        self.encoder, self.decoder = build_hash_io(cfg)
        self.backbone = build_stack(cfg)
        self.memory = make_memory(cfg) if BACKBONES.entry(cfg.backbone.kind).parts.memory else None
        # The vocabulary's signatures: saved beside the weights as a SignatureTable, not in the state dict.
        self.register_buffer("vocab_signatures", vocab_signatures.long(), persistent=False)

    def signatures_of(self, ids: torch.Tensor) -> torch.Tensor:
        """[..., H] signatures of token ids; an id outside the vocabulary is a one-line error."""
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size):
            bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
            raise SignatureError(
                f"token id {bad} is outside the signature table (ids 0..{self.vocab_size - 1}); "
                "use the tokenizer this model was trained with"
            )
        return self.vocab_signatures[ids]

    def hidden_states(self, input_sigs: torch.Tensor, state: Any | None = None) -> torch.Tensor:
        """What the decoder reads: the stack's output, plus the gated memory read under gated_hybrid."""
        embeds = self.encoder(input_sigs)
        hidden = self.backbone.run(embeds, state)
        if self.memory is not None:
            hidden = hidden + memory_read(self.memory, embeds, hidden, state)
        return hidden

    def coord_logprobs(self, inputs: torch.Tensor, state: Any | None = None) -> torch.Tensor:
        """log P_j(b | prefix) for every position, coordinate and bucket: [B, T, H, B]."""
        hidden = self.hidden_states(self.signatures_of(inputs), state)
        return torch.stack(self.decoder(hidden), dim=-2)

    def forward(self, tokens: torch.Tensor, signatures: torch.Tensor | None = None) -> LMOutput:
        sigs = self.signatures_of(tokens) if signatures is None else signatures.long()
        input_sigs, target_sigs = split_rows(sigs)
        if self.memory is not None:
            return self._forward_with_memory(input_sigs, target_sigs)
        loss, accuracy = self.objective(self.decoder(self.hidden_states(input_sigs)), target_sigs)
        return LMOutput(loss, _metrics(loss, accuracy))

    def objective(
        self, coord_logps: list[torch.Tensor], target_sigs: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The training loss `model.hash.loss` names, and per-coordinate accuracy."""
        if self.loss_kind == "vocab":
            return vocab_loss(coord_logps, target_sigs, self.vocab_signatures)
        return signature_loss(coord_logps, target_sigs)

    def _forward_with_memory(self, input_sigs: torch.Tensor, target_sigs: torch.Tensor) -> LMOutput:
        # As in gated_hybrid: the recurrent path learns alone; the fused path reads the stack's output
        # detached, so the retrieval path's gradient reaches neither the stack nor the encoder. The
        # decoder is the read-out of both paths and learns from both losses (a V-way head can be used
        # with its weight detached; the cascaded decoder cannot without bypassing ZeRO-3's gathering).
        embeds = self.encoder(input_sigs)
        hidden = self.backbone.run(embeds)
        recurrent_loss, _ = self.objective(self.decoder(hidden), target_sigs)
        fused = hidden.detach() + memory_read(self.memory, embeds, hidden, None)
        fused_loss, accuracy = self.objective(self.decoder(fused), target_sigs)
        metrics = {**_metrics(fused_loss, accuracy), "recurrent_loss": recurrent_loss.item()}
        return LMOutput(recurrent_loss + fused_loss, metrics)

    def token_nll(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        coord_logp = self.coord_logprobs(inputs).flatten(0, 1)  # [N, H, B]
        target = target_scores(coord_logp, self.signatures_of(targets.flatten()))
        return (vocab_logsumexp(coord_logp, self.vocab_signatures) - target).view_as(targets)

    def score_targets(
        self, inputs: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The decoder reads each position alone: decoding only the selected ones keeps memory at
        # N x H x B (and n x V per scoring block), whatever the padded batch.
        hidden = self.hidden_states(self.signatures_of(inputs))[mask]
        coord_logp = torch.stack(self.decoder(hidden), dim=-2)  # [N, H, B]
        chosen = targets[mask]
        normaliser, best = vocab_logsumexp_argmax(coord_logp, self.vocab_signatures, self.vocab_size)
        return target_scores(coord_logp, self.signatures_of(chosen)) - normaliser, best == chosen

    def next_token_logprobs(self, new_ids: torch.Tensor, cache: Any | None) -> tuple[torch.Tensor, Any]:
        coord_logp = self.coord_logprobs(new_ids, cache)[:, -1]
        # normalised over every row, returned for the ids only: a reserved row's mass is never sampled
        return vocab_logprobs(coord_logp, self.vocab_signatures)[:, : self.vocab_size], cache

    def new_cache(self) -> Any:
        """The stack's decoding state: a KV cache (qwen3) or a `RecurrentState` (triple-latent stacks)."""
        return self.backbone.new_state()

    def layer_states(self, tokens: torch.Tensor, layer: int) -> torch.Tensor:
        return self.backbone.layer_states(self.encoder(self.signatures_of(tokens)), layer)


def _metrics(loss: torch.Tensor, accuracy: torch.Tensor) -> dict[str, float]:
    return {"loss": loss.item(), **{f"acc_{j}": acc.item() for j, acc in enumerate(accuracy)}}


def _check_signatures(sigs: torch.Tensor, vocab_size: int, num_hashes: int, num_buckets: int) -> None:
    if sigs.dim() != 2 or sigs.shape[1] != num_hashes:
        raise SignatureError(
            f"signature table has shape {tuple(sigs.shape)} but the model expects [V, {num_hashes}]; "
            "build the table with the model's hash spec"
        )
    if sigs.shape[0] < vocab_size:
        raise SignatureError(
            f"signature table has {sigs.shape[0]} rows but model.vocab_size={vocab_size}; "
            f"set --set model.vocab_size={sigs.shape[0]}"
        )
    if sigs.device.type != "meta" and sigs.numel() and int(sigs.max()) >= num_buckets:
        raise SignatureError(
            f"signature table holds bucket {int(sigs.max())} >= B={num_buckets}; "
            "build the table with the model's hash spec"
        )
