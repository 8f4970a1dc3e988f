"""The triple-latent family: token ids -> (local conv path) -> triple-latent blocks -> logits.

The blocks between embedding and head form a `TripleStack`, which MultiHashFormer can also run
between its hash encoder and decoder (`model.backbone.kind`).

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
from mhf_dist.models.base import HeadLM, LMOutput, split_rows
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


def make_memory(cfg: ModelConfig) -> KeyValueMemory:
    """gated_hybrid's key-value memory at the model's width."""
    return KeyValueMemory(cfg.backbone.hidden_size, cfg.triple_widths()[2], cfg.triple.memory_top_k)


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


class TripleStack(nn.Module):
    """Vectors in, hidden states out: (the local conv path) -> triple-latent blocks -> final norm.

    The stack of `TripleLatentLM` and of MultiHashFormer over a triple-latent backbone; like
    `Qwen3Stack` it offers `run`, `new_state` and `layer_states`. Its state is a `RecurrentState`.
    """

    def __init__(self, cfg: ModelConfig, slots: bool = False, conv: bool = False) -> None:
        super().__init__()
        bb = cfg.backbone
        self.conv = CausalConvPath(bb.hidden_size, cfg.triple.conv_kernel, bb.rms_norm_eps) if conv else None
        self.blocks = nn.ModuleList(
            TripleBlock(cfg, cfg.triple.num_slots if slots else 0) for _ in range(bb.num_layers)
        )
        self.norm = nn.RMSNorm(bb.hidden_size, eps=bb.rms_norm_eps)

    def new_state(self) -> RecurrentState:
        return RecurrentState()

    def hidden_states(self, embeds: torch.Tensor, state: RecurrentState | None = None) -> list[torch.Tensor]:
        """Hidden states per layer as in transformers (0: the input, last: the normed output).

        With a `state`, reads after it and updates it in place.
        """
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
        return hidden

    def run(self, embeds: torch.Tensor, state: RecurrentState | None = None) -> torch.Tensor:
        return self.hidden_states(embeds, state)[-1]

    def layer_states(self, embeds: torch.Tensor, layer: int) -> torch.Tensor:
        return self.hidden_states(embeds)[layer]


def memory_read(
    memory: KeyValueMemory, embeds: torch.Tensor, hidden: torch.Tensor, state: RecurrentState | None
) -> torch.Tensor:
    """The gated retrieved vector [B, T, d] of gated_hybrid's memory, whatever the model's I/O.

    Isolation: the memory reads detached embeddings and hidden states and writes only into its own
    cache and its output, never into the recurrent state.
    """
    vector, cache = memory(embeds.detach(), hidden.detach(), state.memory if state else None)
    if state is not None:
        state.memory = cache
    return vector


class TripleLatentLM(HeadLM):
    """triple_latent, triple_slot, triple_hybrid and gated_hybrid, chosen by the three switches."""

    def __init__(
        self, cfg: ModelConfig, slots: bool = False, conv: bool = False, memory: bool = False
    ) -> None:
        super().__init__()
        bb = cfg.backbone
        self.vocab_size = cfg.vocab_size
        self.embed = nn.Embedding(cfg.vocab_size, bb.hidden_size)
        nn.init.normal_(self.embed.weight, std=0.02)  # as transformers initialises Qwen3's table
        self.stack = TripleStack(cfg, slots, conv)
        self.head = OutputHead(bb.hidden_size, cfg.vocab_size, bias=False)
        if bb.tie_word_embeddings:
            self.head.weight = self.embed.weight
        self.memory = make_memory(cfg) if memory else None

    def new_cache(self) -> RecurrentState:
        return self.stack.new_state()

    def final_states(self, inputs: torch.Tensor, cache: RecurrentState | None = None) -> torch.Tensor:
        """The stack's output [B, T, d]; with the memory, it and the retrieved vector, [B, T, 2, d]."""
        embeds = self.embed(inputs)
        hidden = self.stack.run(embeds, cache)
        if self.memory is None:
            return hidden
        return torch.stack([hidden, memory_read(self.memory, embeds, hidden, cache)], dim=-2)

    def output_layer(self, states: torch.Tensor) -> torch.Tensor:
        if self.memory is None:
            return self.head(states)
        hidden, read = states.unbind(-2)
        return self.head(hidden) + self._memory_logits(read)

    def _memory_logits(self, read: torch.Tensor) -> torch.Tensor:
        # The head reads the retrieved vector with its weight detached; training adds the memory's loss
        # on logits whose recurrent part is detached (see `forward`), so no gradient of the retrieval
        # path reaches the recurrent stack, the embedding or the head.
        return self.head(read, detach_weight=True)

    def forward(self, tokens: torch.Tensor, signatures: torch.Tensor | None = None) -> LMOutput:
        if self.memory is None:
            return super().forward(tokens)
        # Two losses: the recurrent logits learn alone (exactly the gradients of the stack without the
        # memory); the fused logits, with the recurrent part detached, train only the memory and gate.
        inputs, targets = split_rows(tokens)
        hidden, read = self.final_states(inputs).unbind(-2)
        recurrent = self.head(hidden)
        fused = recurrent.detach() + self._memory_logits(read)
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
        return self.stack.layer_states(self.embed(tokens), layer)


class TransformerPlusTriple(HeadLM):
    """Qwen3 transformer + one triple-latent mixer on its final hidden states, added as a residual head."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.vocab_size = cfg.vocab_size
        self.transformer = Qwen3ForCausalLM(qwen3_config(cfg.backbone, cfg.vocab_size))
        self.head_norm = nn.RMSNorm(cfg.backbone.hidden_size, eps=cfg.backbone.rms_norm_eps)
        self.head_mixer = make_mixer(cfg)

    def new_cache(self) -> RecurrentState:
        return RecurrentState(kv=DynamicCache(config=self.transformer.config))

    def final_states(self, inputs: torch.Tensor, cache: RecurrentState | None = None) -> torch.Tensor:
        kv = cache.kv if cache is not None else None
        hidden = self.transformer.model(
            input_ids=inputs, cache=kv, use_cache=kv is not None
        ).last_hidden_state
        state = cache.layers[0] if cache is not None and cache.layers else None
        mixed, state = self.head_mixer.advance(self.head_norm(hidden), state)
        if cache is not None:
            cache.layers = [state]
        return hidden + mixed

    def output_layer(self, states: torch.Tensor) -> torch.Tensor:
        return self.transformer.lm_head(states)

    def layer_states(self, tokens: torch.Tensor, layer: int) -> torch.Tensor:
        return self.transformer.model(input_ids=tokens, output_hidden_states=True).hidden_states[layer]
