"""The triple-latent family: token ids -> (local conv path) -> triple-latent blocks -> logits.

    triple_latent            embedding, blocks of [triple-latent mixer, SwiGLU MLP], tied head
    triple_slot              the same with the slot memory (rank-M factored pair memory)
    triple_hybrid            a causal local convolution path before the blocks
    gated_hybrid             triple_latent plus the explicit key-value memory, fused into the logits
    transformer_plus_triple  a Qwen3 transformer with one triple-latent mixer added at its output

Training runs the chunked parallel scans; generation carries a `RecurrentState` (per-layer s and P,
the conv window, the memory's keys and values, a KV cache for the transformer) and feeds one token
at a time through each mixer's `step`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, Qwen3ForCausalLM
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP

from mhf_dist.config import ModelConfig
from mhf_dist.models.base import LMOutput, LogitsLM, split_rows
from mhf_dist.models.kv_memory import KeyValueMemory, MemoryCache
from mhf_dist.models.qwen3 import qwen3_config
from mhf_dist.models.triple_layers import CausalConvPath, MixerState, TripleLatentMixer


@dataclass
class RecurrentState:
    """Everything generation carries between calls; filled on the first call."""

    layers: list[MixerState] | None = None
    conv: torch.Tensor | None = None
    memory: MemoryCache | None = None
    kv: DynamicCache | None = None


def make_mixer(cfg: ModelConfig, slots: int = 0) -> TripleLatentMixer:
    heads, state_dim, _ = cfg.triple_widths()
    return TripleLatentMixer(cfg.backbone.hidden_size, heads, state_dim, cfg.triple.chunk_size, slots)


class OutputHead(nn.Linear):
    """The LM head (its weight may be the embedding's); the memory reads through it with the weight
    detached. A module rather than a bare tensor so that ZeRO-3 gathers the weight before each use."""

    def forward(self, x: torch.Tensor, detach_weight: bool = False) -> torch.Tensor:
        return F.linear(x, self.weight.detach() if detach_weight else self.weight)


class TripleBlock(nn.Module):
    """Pre-norm residual block: x + mixer(norm x), then + MLP(norm x) (Qwen3's SwiGLU MLP)."""

    def __init__(self, cfg: ModelConfig, slots: int) -> None:
        super().__init__()
        bb = cfg.backbone
        self.mixer_norm = nn.RMSNorm(bb.hidden_size, eps=bb.rms_norm_eps)
        self.mixer = make_mixer(cfg, slots)
        self.mlp_norm = nn.RMSNorm(bb.hidden_size, eps=bb.rms_norm_eps)
        self.mlp = Qwen3MLP(qwen3_config(bb, vocab_size=1))

    def forward(self, x: torch.Tensor, state: MixerState | None) -> tuple[torch.Tensor, MixerState]:
        mixed, state = self.mixer.advance(self.mixer_norm(x), state)
        x = x + mixed
        return x + self.mlp(self.mlp_norm(x)), state


class TripleLatentLM(LogitsLM):
    """triple_latent, triple_slot, triple_hybrid and gated_hybrid, chosen by the three switches."""

    def __init__(
        self, cfg: ModelConfig, slots: bool = False, conv: bool = False, memory: bool = False
    ) -> None:
        super().__init__()
        bb = cfg.backbone
        self.vocab_size = cfg.vocab_size
        self.embed = nn.Embedding(cfg.vocab_size, bb.hidden_size)
        nn.init.normal_(self.embed.weight, std=0.02)  # as transformers initialises Qwen3's table
        self.conv = CausalConvPath(bb.hidden_size, cfg.triple.conv_kernel, bb.rms_norm_eps) if conv else None
        self.blocks = nn.ModuleList(
            TripleBlock(cfg, cfg.triple.num_slots if slots else 0) for _ in range(bb.num_layers)
        )
        self.norm = nn.RMSNorm(bb.hidden_size, eps=bb.rms_norm_eps)
        self.head = OutputHead(bb.hidden_size, cfg.vocab_size, bias=False)
        if bb.tie_word_embeddings:
            self.head.weight = self.embed.weight
        _, _, memory_dim = cfg.triple_widths()
        self.memory = KeyValueMemory(bb.hidden_size, memory_dim, cfg.triple.memory_top_k) if memory else None

    def new_cache(self) -> RecurrentState:
        return RecurrentState()

    def run(
        self, inputs: torch.Tensor, state: RecurrentState | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """(embeddings, final hidden, hidden states per layer as in transformers) of `inputs` [B, T].

        With a `state`, reads after it and updates it in place.
        """
        embeds = self.embed(inputs)
        x = embeds
        if self.conv is not None:
            x, conv_window = self.conv(x, state.conv if state is not None else None)
        layer_states = state.layers if state is not None and state.layers is not None else None
        hidden = [x]
        new_states = []
        for index, block in enumerate(self.blocks):
            x, mixer_state = block(x, layer_states[index] if layer_states else None)
            new_states.append(mixer_state)
            hidden.append(x)
        hidden[-1] = self.norm(x)
        if state is not None:
            state.layers = new_states
            if self.conv is not None:
                state.conv = conv_window
        return embeds, hidden[-1], hidden

    def _memory_logits(
        self, embeds: torch.Tensor, hidden: torch.Tensor, state: RecurrentState | None
    ) -> torch.Tensor:
        # Isolation: the memory reads detached embeddings, hidden states and head weight and writes
        # only into its own cache and the logits, never into the recurrent state; training adds its loss
        # on logits whose recurrent part is detached (see `forward`), so no gradient of the retrieval
        # path reaches the recurrent stack, the embedding or the head.
        assert self.memory is not None
        memory_logits, cache = self.memory(
            embeds.detach(), hidden.detach(), self.head, state.memory if state else None
        )
        if state is not None:
            state.memory = cache
        return memory_logits

    def logits(self, inputs: torch.Tensor, cache: RecurrentState | None = None) -> torch.Tensor:
        embeds, hidden, _ = self.run(inputs, cache)
        logits = self.head(hidden)
        if self.memory is not None:
            logits = logits + self._memory_logits(embeds, hidden, cache)
        return logits

    def forward(self, tokens: torch.Tensor, signatures: torch.Tensor | None = None) -> LMOutput:
        if self.memory is None:
            return super().forward(tokens)
        # Two losses: the recurrent logits learn alone (exactly the gradients of the stack without the
        # memory); the fused logits, with the recurrent part detached, train only the memory and gate.
        inputs, targets = split_rows(tokens)
        embeds, hidden, _ = self.run(inputs)
        recurrent = self.head(hidden)
        fused = recurrent.detach() + self._memory_logits(embeds, hidden, None)
        recurrent_loss = F.cross_entropy(recurrent.flatten(0, 1).float(), targets.flatten())
        fused_loss = F.cross_entropy(fused.flatten(0, 1).float(), targets.flatten())
        with torch.no_grad():
            accuracy = (fused.argmax(-1) == targets).float().mean()
        metrics = {
            "loss": fused_loss.item(),
            "recurrent_loss": recurrent_loss.item(),
            "token_acc": accuracy.item(),
        }
        return LMOutput(recurrent_loss + fused_loss, metrics)

    def layer_states(self, tokens: torch.Tensor, layer: int) -> torch.Tensor:
        return self.run(tokens)[2][layer]


class TransformerPlusTriple(LogitsLM):
    """Qwen3 transformer + one triple-latent mixer on its final hidden states, added as a residual head."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.vocab_size = cfg.vocab_size
        self.transformer = Qwen3ForCausalLM(qwen3_config(cfg.backbone, cfg.vocab_size))
        self.head_norm = nn.RMSNorm(cfg.backbone.hidden_size, eps=cfg.backbone.rms_norm_eps)
        self.head_mixer = make_mixer(cfg)

    def new_cache(self) -> RecurrentState:
        return RecurrentState(kv=DynamicCache(config=self.transformer.config))

    def logits(self, inputs: torch.Tensor, cache: RecurrentState | None = None) -> torch.Tensor:
        kv = cache.kv if cache is not None else None
        hidden = self.transformer.model(
            input_ids=inputs, cache=kv, use_cache=kv is not None
        ).last_hidden_state
        state = cache.layers[0] if cache is not None and cache.layers else None
        mixed, state = self.head_mixer.advance(self.head_norm(hidden), state)
        if cache is not None:
            cache.layers = [state]
        return self.transformer.lm_head(hidden + mixed)

    def layer_states(self, tokens: torch.Tensor, layer: int) -> torch.Tensor:
        return self.transformer.model(input_ids=tokens, output_hidden_states=True).hidden_states[layer]
