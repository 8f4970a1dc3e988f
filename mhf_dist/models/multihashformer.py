"""MultiHashFormer: hash encoder -> Qwen3 backbone -> cascaded hash decoder.

Parameters depend on the number of buckets B, not on the vocabulary V: the vocabulary lives only in
the [V, H] signature buffer, which exact scoring uses to renormalise over the real tokens V_actl.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache, Qwen3Model

from mhf_dist.config import ModelConfig
from mhf_dist.errors import SignatureError
from mhf_dist.models.base import CausalLM, LMOutput, split_rows
from mhf_dist.models.hash_io import (
    CascadedHashDecoder,
    HashEncoder,
    signature_loss,
    target_scores,
    vocab_logprobs,
    vocab_logsumexp,
)
from mhf_dist.models.qwen3 import qwen3_config


class MultiHashFormer(CausalLM):
    def __init__(self, cfg: ModelConfig, vocab_signatures: torch.Tensor) -> None:
        super().__init__()
        num_hashes, num_buckets = cfg.hash.num_hashes, cfg.hash.num_buckets
        _check_signatures(vocab_signatures, cfg.vocab_size, num_hashes, num_buckets)
        d_model = cfg.backbone.hidden_size
        d_hash, d_casc, mixer_hidden = cfg.hash_widths()
        self.vocab_size = cfg.vocab_size

        self.encoder = HashEncoder(num_hashes, num_buckets, d_hash, cfg.hash.gate_hidden, d_model)
        self.backbone = Qwen3Model(qwen3_config(cfg.backbone, vocab_size=1))
        del self.backbone.embed_tokens  # inputs arrive as `inputs_embeds` from the hash encoder
        self.decoder = CascadedHashDecoder(d_model, num_hashes, num_buckets, d_casc, mixer_hidden)
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

    def hidden_states(self, input_sigs: torch.Tensor, cache: DynamicCache | None = None) -> torch.Tensor:
        embeds = self.encoder(input_sigs)
        return self.backbone(inputs_embeds=embeds, cache=cache, use_cache=cache is not None).last_hidden_state

    def coord_logprobs(self, inputs: torch.Tensor, cache: DynamicCache | None = None) -> torch.Tensor:
        """log P_j(b | prefix) for every position, coordinate and bucket: [B, T, H, B]."""
        hidden = self.hidden_states(self.signatures_of(inputs), cache)
        return torch.stack(self.decoder(hidden), dim=-2)

    def forward(self, tokens: torch.Tensor, signatures: torch.Tensor | None = None) -> LMOutput:
        sigs = self.signatures_of(tokens) if signatures is None else signatures.long()
        input_sigs, target_sigs = split_rows(sigs)
        coord_logps = self.decoder(self.hidden_states(input_sigs))
        loss, accuracy = signature_loss(coord_logps, target_sigs)
        metrics = {"loss": loss.item(), **{f"acc_{j}": acc.item() for j, acc in enumerate(accuracy)}}
        return LMOutput(loss, metrics)

    def token_nll(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        coord_logp = self.coord_logprobs(inputs).flatten(0, 1)  # [N, H, B]
        target = target_scores(coord_logp, self.signatures_of(targets.flatten()))
        return (vocab_logsumexp(coord_logp, self.vocab_signatures) - target).view_as(targets)

    def next_token_logprobs(self, new_ids: torch.Tensor, cache: Any | None) -> tuple[torch.Tensor, Any]:
        coord_logp = self.coord_logprobs(new_ids, cache)[:, -1]
        return vocab_logprobs(coord_logp, self.vocab_signatures), cache

    def new_cache(self) -> DynamicCache:
        return DynamicCache(config=self.backbone.config)

    def layer_states(self, tokens: torch.Tensor, layer: int) -> torch.Tensor:
        embeds = self.encoder(self.signatures_of(tokens))
        return self.backbone(inputs_embeds=embeds, output_hidden_states=True).hidden_states[layer]


def _check_signatures(sigs: torch.Tensor, vocab_size: int, num_hashes: int, num_buckets: int) -> None:
    if sigs.dim() != 2 or sigs.shape[1] != num_hashes:
        raise SignatureError(
            f"signature table has shape {tuple(sigs.shape)} but the model expects [V, {num_hashes}]; "
            "build the table with the model's hash spec"
        )
    if sigs.shape[0] != vocab_size:
        raise SignatureError(
            f"signature table has {sigs.shape[0]} tokens but model.vocab_size={vocab_size}; "
            f"set --set model.vocab_size={sigs.shape[0]}"
        )
    if sigs.device.type != "meta" and sigs.numel() and int(sigs.max()) >= num_buckets:
        raise SignatureError(
            f"signature table holds bucket {int(sigs.max())} >= B={num_buckets}; "
            "build the table with the model's hash spec"
        )
