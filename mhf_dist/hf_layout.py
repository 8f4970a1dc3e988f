"""Hugging Face checkpoint layouts in and out: `mhf import-hf` and `mhf export-hf`.

Two layouts are understood:
- the reference's (HUIYINXUE/MHF, a transformers Qwen3 fork; the released `klein9692/...` models):
  `config.json` with model_type qwen3 plus `num_hashes`, `num_buckets`, `bottle_neck_dim`, `num_lsh`,
  `lsh_only_embed`, `use_conditional_prob`; weights `model.embed_tokens.weight` [H*B, d],
  `model.combiner.*`, the signature buffer `model.hash_map` [V, H], `model.layers.*`, `model.norm.weight`,
  `hash_head.cascade_mixer.*` (and `lm_head.weight` only when untied);
- plain transformers Qwen3 (what `Qwen3ForCausalLM.save_pretrained` writes), for the qwen3 families.
Both are read and written as transformers and the Hub do it: `config.json` through `Qwen3Config` (the
reference's extra keys ride along as attributes), weights as `model.safetensors` or, past
`max_shard_size` (5GB by default), shards named by `model.safetensors.index.json`. Either end may be a
bucket; a remote output is uploaded with its `config.json` last (`Location.staged_directory`).

The vocabulary (model.vocab_size, the ids) is the tokenizer's; the signature table is the checkpoint's
`hash_map`, every row (see `_imported_table`), LSH coordinates included.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from huggingface_hub import save_torch_state_dict
from huggingface_hub.errors import StrictDataclassError
from pydantic import ValidationError
from safetensors.torch import load_file
from transformers import Qwen3Config

from mhf_dist.config import ModelConfig, format_hash_spec
from mhf_dist.data.shards import TOKENIZER_FILE
from mhf_dist.data.tokenizer import TextTokenizer
from mhf_dist.errors import MhfError, first_line, first_problem
from mhf_dist.export import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    ExportedModel,
    check_new_output,
    export_model,
    load_exported,
    unique_tensors,
)
from mhf_dist.models import build_model
from mhf_dist.models.qwen3 import qwen3_config
from mhf_dist.readers import json_kind, read_json
from mhf_dist.signatures import NO_PAD, ReferenceScheme, SignatureTable, build_for_config
from mhf_dist.sizes import byte_size
from mhf_dist.storage import Location, local_copy

INDEX_FILE = "model.safetensors.index.json"
HASH_MAP = "model.hash_map"
# Our parameter names -> the reference's, by prefix (the decoder's `table` is the encoder's, written once).
REFERENCE_NAMES = (
    ("encoder.table.weight", "model.embed_tokens.weight"),
    ("encoder.gate.", "model.combiner.scorer."),
    ("encoder.proj.", "model.combiner.output_proj.0."),
    ("decoder.mixers.", "hash_head.cascade_mixer."),
    ("decoder.lm_head", "lm_head.weight"),
    ("backbone.", "model."),
)
REFERENCE_SIZES = ("num_hashes", "num_buckets", "bottle_neck_dim")  # the reference's config keys of sizes


class LayoutError(MhfError):
    """A checkpoint directory that is not in a layout mhf-dist imports, or does not fit its config."""


def import_hf(source: str | Path | Location, out: str | Path | Location) -> ExportedModel:
    """A reference MHF or plain Qwen3 checkpoint directory -> an exported mhf-dist model at `out`."""
    source, out = Location.of(source), Location.of(out)
    check_new_output(out, LayoutError, "another --out")
    hf_config = _read_hf_config(source)
    if not (source / TOKENIZER_FILE).is_file():
        raise LayoutError(
            f"{str(source)!r} has no {TOKENIZER_FILE}; copy the model's tokenizer.json beside it"
        )
    tokenizer_file = local_copy(source / TOKENIZER_FILE)
    tokenizer = TextTokenizer.load(tokenizer_file)
    weights = _read_weights(source)
    if hf_config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)  # save_pretrained may write the tied copy
    convert = _from_reference if hasattr(hf_config, "num_hashes") else _from_qwen3
    model_cfg, table, state = convert(hf_config, weights, tokenizer)
    model = build_model(model_cfg, table)
    _load_strict(model, state, source)
    # Documents as the checkpoint was trained on them: its tokenizer's default special tokens (the
    # released reference models' Mistral tokenizer: `<s>` first, no `</s>`; a Qwen3 tokenizer: EOS).
    document_format = tokenizer.resolve_format("auto")
    written = export_model(model, model_cfg, table, tokenizer_file, out, document_format=document_format)
    return ExportedModel(model.eval(), model_cfg, table, tokenizer, written, [], document_format)


def _read_hf_config(source: Location) -> Qwen3Config:
    path = source / CONFIG_FILE
    if not path.is_file():
        source.check_bucket()
        raise LayoutError(
            f"{str(source)!r} is not a Hugging Face checkpoint directory (no {CONFIG_FILE}); pass the "
            "directory save_pretrained wrote"
        )
    config = read_json(path, LayoutError, "fix or re-download the checkpoint")
    if not isinstance(config, dict) or config.get("model_type") != "qwen3":
        if not isinstance(config, dict):
            found = json_kind(config)
        else:
            found = f"model_type {config['model_type']!r}" if "model_type" in config else "no model_type"
        raise LayoutError(
            f"{path} holds {found}; mhf-dist imports qwen3 checkpoints "
            "(the reference MHF models and plain Qwen3)"
        )
    try:
        return Qwen3Config.from_dict(config)
    except (StrictDataclassError, ValueError, TypeError) as err:
        raise LayoutError(
            f"{path} is not a valid Qwen3 config ({first_line(err)}); fix or re-download it"
        ) from None


def _read_weights(source: Location) -> dict[str, torch.Tensor]:
    """Every tensor of model.safetensors, or of the shards a model.safetensors.index.json names."""
    weights = {}
    for path in _weight_files(source):
        try:
            weights.update(load_file(local_copy(path)))
        except Exception as err:  # safetensors raises several types for a damaged file
            raise LayoutError(f"cannot read {path}: {err}; re-download the checkpoint") from None
    return weights


def _weight_files(source: Location) -> list[Location]:
    present = {name for name, _ in source.files()}  # one listing, not a request per shard
    index = source / INDEX_FILE
    if INDEX_FILE not in present and WEIGHTS_FILE in present:
        return [source / WEIGHTS_FILE]
    if INDEX_FILE not in present:
        raise LayoutError(f"{str(source)!r} has no {WEIGHTS_FILE} (nor {INDEX_FILE}); only safetensors load")
    weight_map = read_json(index, LayoutError, "fix or re-download the checkpoint")
    weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(name, str) and Path(name).name == name for name in weight_map.values()
    ):
        raise LayoutError(
            f"{index} has no weight_map of tensor names to shard files beside it; re-download the checkpoint"
        )
    shards = sorted(set(weight_map.values()))
    missing = [name for name in shards if name not in present]
    if missing:
        raise LayoutError(
            f"{index} names {len(missing)} shard(s) that are not in {str(source)!r} "
            f"({', '.join(missing[:3])}); download every shard of the checkpoint"
        )
    return [source / name for name in shards]


def _backbone_section(hf: Qwen3Config) -> dict:
    rope_type = (hf.rope_parameters or {}).get("rope_type", "default")
    if hf.hidden_act != "silu" or hf.attention_bias or hf.use_sliding_window or rope_type != "default":
        raise LayoutError(
            "only Qwen3 with SiLU MLPs, no attention bias, no sliding window and default RoPE imports; "
            "this config differs"
        )
    return {
        "hidden_size": hf.hidden_size,
        "num_layers": hf.num_hidden_layers,
        "num_heads": hf.num_attention_heads,
        "num_kv_heads": hf.num_key_value_heads,
        "head_dim": hf.head_dim or hf.hidden_size // hf.num_attention_heads,
        "intermediate_size": hf.intermediate_size,
        "rope_theta": hf.rope_parameters["rope_theta"],
        "rms_norm_eps": hf.rms_norm_eps,
        "max_position_embeddings": hf.max_position_embeddings,
        "tie_word_embeddings": hf.tie_word_embeddings,
    }


def _model_config(family: str, vocab_size: int, backbone: dict, **sections: dict) -> ModelConfig:
    """Our model config of these sections; a value it refuses is a LayoutError naming it."""
    try:
        return ModelConfig.model_validate(
            {"family": family, "vocab_size": vocab_size, "backbone": backbone, **sections}
        )
    except ValidationError as err:
        where, message = first_problem(err)
        raise LayoutError(
            f"config.json does not describe a model mhf-dist builds ({where or 'config'}: {message}); fix or "
            "re-download the checkpoint"
        ) from None


def _from_reference(
    hf: Qwen3Config, weights: dict[str, torch.Tensor], tokenizer: TextTokenizer
) -> tuple[ModelConfig, SignatureTable, dict[str, torch.Tensor]]:
    missing = [key for key in REFERENCE_SIZES if getattr(hf, key, None) is None]
    if missing:
        raise LayoutError(
            f"config.json has num_hashes but no {', '.join(missing)}; the reference layout needs "
            f"{', '.join(REFERENCE_SIZES)} (fix or re-download the checkpoint)"
        )
    num_hashes, num_buckets = hf.num_hashes, hf.num_buckets
    num_lsh = getattr(hf, "num_lsh", 0) or 0
    model_cfg = _model_config(
        "mhf",
        tokenizer.vocab_size,
        _backbone_section(hf),
        hash={
            "spec": format_hash_spec(num_hashes, num_buckets),
            "io": "reference",
            "scheme": "reference",
            "loss": "vocab" if getattr(hf, "use_conditional_prob", False) else "coordinates",
            "num_lsh": num_lsh,
            "lsh_only_embed": bool(getattr(hf, "lsh_only_embed", False)),
            "bottleneck": hf.bottle_neck_dim,
        },
    )
    table = _imported_table(weights.pop(HASH_MAP, None), tokenizer, hf, num_lsh)
    expected = (num_hashes * num_buckets, model_cfg.backbone.hidden_size)
    embed = weights.get("model.embed_tokens.weight")
    if embed is None or tuple(embed.shape) != expected:
        shape = None if embed is None else tuple(embed.shape)
        raise LayoutError(
            f"model.embed_tokens.weight has shape {shape} but num_hashes x num_buckets, hidden_size in "
            f"config.json say {expected}; the weights and config.json are from different models"
        )
    return model_cfg, table, _renamed(weights, _to_ours)


def _imported_table(
    hash_map: torch.Tensor | None, tokenizer: TextTokenizer, hf: Qwen3Config, num_lsh: int
) -> SignatureTable:
    """The checkpoint's `hash_map`, every row: the tokenizer's ids, then the all-zero rows the authors add
    by rounding V up to a multiple of 128, kept as reserved rows: exact scoring's normaliser counts them
    (so exact NLL is the authors' `use_conditional_prob` loss), and export writes them back."""
    vocab, num_hashes, num_buckets = tokenizer.vocab_size, hf.num_hashes, hf.num_buckets
    shape = None if hash_map is None else tuple(hash_map.shape)
    if shape is None or len(shape) != 2 or shape[1] != num_hashes or shape[0] < vocab:
        raise LayoutError(
            f"model.hash_map has shape {shape}; expected [>= {vocab} (the tokenizer's tokens), "
            f"{num_hashes}]; the tokenizer, the weights and config.json must be from the same model"
        )
    rows = hash_map.numpy()
    if rows.min() < 0 or rows.max() >= num_buckets:
        raise LayoutError(
            f"model.hash_map holds buckets outside 0..{num_buckets - 1}; the checkpoint is damaged"
        )
    pad_id = hf.pad_token_id
    pad_id = pad_id if isinstance(pad_id, int) and pad_id < vocab and not rows[pad_id].any() else NO_PAD
    scheme = ReferenceScheme(num_hashes, num_buckets, seed=0, num_lsh=num_lsh)
    redraws = np.zeros(len(rows), np.uint32)  # not stored in the reference layout
    return SignatureTable(tokenizer.vocabulary(), rows.astype(scheme.dtype), redraws, scheme, pad_id)


def _from_qwen3(
    hf: Qwen3Config, weights: dict[str, torch.Tensor], tokenizer: TextTokenizer
) -> tuple[ModelConfig, SignatureTable, dict[str, torch.Tensor]]:
    model_cfg = _model_config("qwen3", tokenizer.vocab_size, _backbone_section(hf))
    vocab = tokenizer.vocab_size
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in weights:
            if weights[name].shape[0] < vocab:
                raise LayoutError(
                    f"{name} has {weights[name].shape[0]} rows but the tokenizer {vocab} tokens; "
                    "the tokenizer and the weights are from different models"
                )
            weights[name] = weights[name][:vocab]
    # Every exported model carries a table; for the qwen3 families it records the vocabulary only.
    table = build_for_config(model_cfg.hash, tokenizer.vocabulary(), tokenizer.pad_token)
    return model_cfg, table, _renamed(weights, lambda name: f"model.{name}")


def _load_strict(model: torch.nn.Module, state: dict[str, torch.Tensor], source: Location) -> None:
    """Load `state` into `model`; each tied tensor (the decoder's table, Qwen3's lm_head) once."""
    expected = unique_tensors(model)
    wanted = set(expected)
    missing, unexpected = sorted(wanted - set(state)), sorted(set(state) - wanted)
    if missing or unexpected:
        raise LayoutError(
            f"{str(source)!r}: weights do not fit config.json (missing {missing[:3]}, unexpected "
            f"{unexpected[:3]}); the weights and config.json are from different models"
        )
    for name in wanted:
        if tuple(state[name].shape) != tuple(expected[name].shape):
            raise LayoutError(
                f"{str(source)!r}: {name} has shape {tuple(state[name].shape)} but config.json implies "
                f"{tuple(expected[name].shape)}; the weights and config.json are from different models"
            )
    model.load_state_dict(state, strict=False)


def export_hf(
    model_dir: str | Path | Location, out: str | Path | Location, max_shard_size: int | str = "5GB"
) -> Path | Location:
    """An exported mhf-dist model -> the reference layout (mhf) or a plain transformers Qwen3 directory,
    in safetensors shards of at most `max_shard_size` (bytes or "500MB"; a larger tensor is its own)."""
    largest = byte_size(max_shard_size, LayoutError)
    out = Location.of(out)
    check_new_output(out, LayoutError, "another --out")
    exported = load_exported(model_dir)
    config, weights = _hf_checkpoint(exported)
    with out.staged_directory(CONFIG_FILE) as staging:
        config.save_pretrained(staging)
        save_torch_state_dict(weights, staging, max_shard_size=largest)
        exported.tokenizer.save(staging / TOKENIZER_FILE)
    return out.as_given()


def _hf_checkpoint(exported: ExportedModel) -> tuple[Qwen3Config, dict[str, torch.Tensor]]:
    """(config, weights) as a Hugging Face checkpoint: transformers' own Qwen3ForCausalLM names (a tied
    lm_head written once, as its embedding) for the qwen3 families, the reference layout for mhf."""
    cfg, table, eos_id = exported.config, exported.table, exported.tokenizer.eos_id
    if cfg.family not in ("mhf", "qwen3", "qwen3_matched"):
        raise LayoutError(
            f"family {cfg.family} has no Hugging Face layout; export-hf writes mhf and qwen3 models"
        )
    reference = cfg.family == "mhf"
    if reference and (cfg.hash.io != "reference" or cfg.backbone.kind != "qwen3"):
        raise LayoutError(
            f"the reference layout holds the reference hash I/O over Qwen3; this model has io="
            f"{cfg.hash.io} over {cfg.backbone.kind} (export-hf writes mhf models with "
            "model.hash.io=reference and model.backbone.kind=qwen3)"
        )
    # The reference's V is its table's: an imported checkpoint's reserved rows go back as they came.
    config = qwen3_config(cfg.backbone, table.num_rows if reference else cfg.vocab_size)
    config.update(
        {
            "architectures": ["Qwen3ForCausalLM"],
            "dtype": "float32",  # the weights as written (an exported model loads in fp32)
            "use_cache": True,  # qwen3_config turns the KV cache off for training; generation wants it
            "eos_token_id": eos_id,
            "pad_token_id": table.pad_id if table.pad_id != NO_PAD else eos_id,
        }
    )
    if not reference:
        return config, unique_tensors(exported.model.model)
    config.update(
        {
            "num_hashes": cfg.hash.num_hashes,
            "num_buckets": cfg.hash.num_buckets,
            "bottle_neck_dim": cfg.hash.bottleneck,
            "num_lsh": cfg.hash.num_lsh,
            "lsh_only_embed": cfg.hash.lsh_only_embed,
            "use_conditional_prob": cfg.hash.loss == "vocab",
            "fused_decoding": False,
        }
    )
    weights = _renamed(unique_tensors(exported.model), _to_reference)
    weights[HASH_MAP] = table.as_tensor()
    return config, weights


def _to_reference(name: str) -> str:
    for ours, theirs in REFERENCE_NAMES:
        if name.startswith(ours):
            return theirs + name[len(ours) :]
    raise LayoutError(f"parameter {name} has no place in the reference layout")


def _to_ours(name: str) -> str:
    for ours, theirs in REFERENCE_NAMES:
        if name.startswith(theirs):
            return ours + name[len(theirs) :]
    return name  # unknown names surface as `unexpected` in _load_strict


def _renamed(weights: dict[str, torch.Tensor], rename: Callable[[str], str]) -> dict[str, torch.Tensor]:
    on_cpu = {rename(name): tensor.detach().to("cpu") for name, tensor in weights.items()}
    return {name: tensor.float() if tensor.is_floating_point() else tensor for name, tensor in on_cpu.items()}
