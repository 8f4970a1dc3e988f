"""Qwen3 in two roles: the baselines (transformers' `Qwen3ForCausalLM` on the same backbone config as
the MHF model) and `Qwen3Stack`, the decoder layers alone as a stack under hash I/O."""

from __future__ import annotations

import torch
from transformers import DynamicCache, Qwen3Config, Qwen3ForCausalLM, Qwen3Model

from mhf_dist.config import BackboneConfig, ModelConfig
from mhf_dist.models.base import HeadLM


def qwen3_config(backbone: BackboneConfig, vocab_size: int) -> Qwen3Config:
    """Our backbone section as a transformers `Qwen3Config`."""
    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=backbone.hidden_size,
        num_hidden_layers=backbone.num_layers,
        num_attention_heads=backbone.num_heads,
        num_key_value_heads=backbone.num_kv_heads,
        head_dim=backbone.head_dim,
        intermediate_size=backbone.intermediate_size,
        rope_parameters={"rope_type": "default", "rope_theta": backbone.rope_theta},
        rms_norm_eps=backbone.rms_norm_eps,
        max_position_embeddings=backbone.max_position_embeddings,
        tie_word_embeddings=backbone.tie_word_embeddings,
        attention_bias=False,
        use_cache=False,
        attn_implementation="sdpa",
    )


class Qwen3LM(HeadLM):
    """A standard V x d embedding and V-way LM head around the Qwen3 stack."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.vocab_size = cfg.vocab_size
        self.model = Qwen3ForCausalLM(qwen3_config(cfg.backbone, cfg.vocab_size))

    def final_states(self, inputs: torch.Tensor, cache: DynamicCache | None = None) -> torch.Tensor:
        return self.model.model(input_ids=inputs, cache=cache, use_cache=cache is not None).last_hidden_state

    def output_layer(self, states: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(states)

    def new_cache(self) -> DynamicCache:
        return DynamicCache(config=self.model.config)

    def layer_states(self, tokens: torch.Tensor, layer: int) -> torch.Tensor:
        return self.model.model(input_ids=tokens, output_hidden_states=True).hidden_states[layer]


class Qwen3Stack(Qwen3Model):
    """Qwen3's decoder layers and final norm, fed vectors (`inputs_embeds`): its token table is removed.

    A stack offers `run(embeds, state)` -> final hidden states, `new_state()` for incremental decoding
    (here transformers' KV cache) and `layer_states(embeds, layer)`; `TripleStack` offers the same.
    """

    main_input_name = "inputs_embeds"  # its input is vectors; transformers hooks no token table then

    def __init__(self, backbone: BackboneConfig) -> None:
        super().__init__(qwen3_config(backbone, vocab_size=1))
        del self.embed_tokens

    def run(self, embeds: torch.Tensor, state: DynamicCache | None = None) -> torch.Tensor:
        return self(inputs_embeds=embeds, cache=state, use_cache=state is not None).last_hidden_state

    def new_state(self) -> DynamicCache:
        return DynamicCache(config=self.config)

    def layer_states(self, embeds: torch.Tensor, layer: int) -> torch.Tensor:
        return self(inputs_embeds=embeds, output_hidden_states=True).hidden_states[layer]
