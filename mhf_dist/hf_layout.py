"""Hugging Face checkpoint layouts in and out: `mhf import-hf` and `mhf export-hf`.

Two layouts are understood:
- the reference's (HUIYINXUE/MHF, a transformers Qwen3 fork; the released `klein9692/...` models):
  `config.json` with model_type qwen3 plus `num_hashes`, `num_buckets`, `bottle_neck_dim`, `num_lsh`,
  `lsh_only_embed`, `use_conditional_prob`; weights `model.embed_tokens.weight` [H*B, d],
  `model.combiner.*`, the signature buffer `model.hash_map` [V, H], `model.layers.*`, `model.norm.weight`,
  `hash_head.cascade_mixer.*` (and `lm_head.weight` only when untied);
- plain transformers Qwen3 (`Qwen3ForCausalLM.save_pretrained`), for the qwen3 families.

The vocabulary (model.vocab_size, the ids) is the tokenizer's; the signature table is the checkpoint's
`hash_map`, every row, LSH coordinates (`num_lsh`, `lsh_only_embed`) included. Rows past the tokenizer's
last id (the reference rounds V up to a multiple of 128 and leaves them all zeros) are kept as the
table's reserved rows: no id and no generated token is one, but exact scoring's normaliser counts them,
so an imported model's exact NLL is the authors' `use_conditional_prob` loss; export writes them back.
The imported model's document format is its tokenizer's default (`bos` for the released models).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from pydantic import ValidationError
from safetensors import safe_open
from safetensors.torch import save_file

from mhf_dist.config import ModelConfig, format_hash_spec
from mhf_dist.data.shards import TOKENIZER_FILE
from mhf_dist.data.tokenizer import TextTokenizer
from mhf_dist.errors import MhfError
from mhf_dist.export import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    ExportedModel,
    export_model,
    load_exported,
    unique_tensors,
)
from mhf_dist.files import read_json
from mhf_dist.models import build_model
from mhf_dist.signatures import NO_PAD, SignatureTable, build_for_config, smallest_uint_dtype

INDEX_FILE = "model.safetensors.index.json"
HASH_MAP = "model.hash_map"
# Our parameter names -> the reference's, by prefix; the decoder's `table` is the tied encoder table.
REFERENCE_NAMES = (
    ("encoder.table.weight", "model.embed_tokens.weight"),
    ("encoder.gate.", "model.combiner.scorer."),
    ("encoder.proj.", "model.combiner.output_proj.0."),
    ("decoder.mixers.", "hash_head.cascade_mixer."),
    ("decoder.lm_head", "lm_head.weight"),
    ("backbone.", "model."),
)
TIED_DUPLICATES = ("decoder.table",)


class LayoutError(MhfError):
    """A checkpoint directory that is not in a layout mhf-dist imports, or does not fit its config."""


# --- import ------------------------------------------------------------------------------------------
def import_hf(source: str | Path, out: str | Path) -> ExportedModel:
    """A reference MHF or plain Qwen3 checkpoint directory -> an exported mhf-dist model at `out`."""
    source = Path(source)
    hf_config = _read_hf_config(source)
    tokenizer_file = source / TOKENIZER_FILE
    if not tokenizer_file.is_file():
        raise LayoutError(
            f"{str(source)!r} has no {TOKENIZER_FILE}; copy the model's tokenizer.json beside it"
        )
    tokenizer = TextTokenizer.load(tokenizer_file)
    weights = _read_weights(source)
    if "num_hashes" in hf_config:
        model_cfg, table, state = _from_reference(hf_config, weights, tokenizer)
    else:
        model_cfg, table, state = _from_qwen3(hf_config, weights, tokenizer)
    model = build_model(model_cfg, table)
    _load_strict(model, state, source)
    # Documents as the checkpoint was trained on them: its tokenizer's default special tokens (the
    # released reference models' Mistral tokenizer: `<s>` first, no `</s>`; a Qwen3 tokenizer: EOS).
    document_format = tokenizer.resolve_format("auto")
    export_model(model, model_cfg, table, tokenizer_file, out, document_format=document_format)
    return load_exported(out)


def _read_hf_config(source: Path) -> dict:
    path = source / CONFIG_FILE
    if not source.is_dir() or not path.is_file():
        raise LayoutError(
            f"{str(source)!r} is not a Hugging Face checkpoint directory (no {CONFIG_FILE}); pass the "
            "directory save_pretrained wrote"
        )
    config = read_json(path, LayoutError, "fix or re-download the checkpoint")
    if not isinstance(config, dict) or config.get("model_type") != "qwen3":
        found = config.get("model_type") if isinstance(config, dict) else type(config).__name__
        raise LayoutError(
            f"{path} has model_type {found!r}; mhf-dist imports qwen3 checkpoints "
            "(the reference MHF models and plain Qwen3)"
        )
    return config


def _read_weights(source: Path) -> dict[str, torch.Tensor]:
    """Every tensor of model.safetensors, or of the shards a model.safetensors.index.json names."""
    index = source / INDEX_FILE
    if index.is_file():
        weight_map = read_json(index, LayoutError, "fix or re-download the checkpoint").get("weight_map", {})
        files = sorted(set(weight_map.values()))
    elif (source / WEIGHTS_FILE).is_file():
        files = [WEIGHTS_FILE]
    else:
        raise LayoutError(f"{str(source)!r} has no {WEIGHTS_FILE} (nor {INDEX_FILE}); only safetensors load")
    weights = {}
    for name in files:
        try:
            with safe_open(str(source / name), framework="pt") as handle:
                weights.update({key: handle.get_tensor(key) for key in handle.keys()})  # noqa: SIM118
        except Exception as err:  # safetensors raises several types for a damaged file
            raise LayoutError(f"cannot read {source / name}: {err}; re-download the checkpoint") from None
    return weights


def _backbone_section(hf: dict) -> dict:
    if hf.get("hidden_act", "silu") != "silu" or hf.get("attention_bias", False):
        raise LayoutError("only Qwen3 with SiLU MLPs and no attention bias imports; this config differs")
    rope = hf.get("rope_parameters") or {}
    return {
        "hidden_size": hf["hidden_size"],
        "num_layers": hf["num_hidden_layers"],
        "num_heads": hf["num_attention_heads"],
        "num_kv_heads": hf["num_key_value_heads"],
        "head_dim": hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
        "intermediate_size": hf["intermediate_size"],
        "rope_theta": rope.get("rope_theta", hf.get("rope_theta", 1_000_000.0)),
        "rms_norm_eps": hf.get("rms_norm_eps", 1e-6),
        "max_position_embeddings": hf.get("max_position_embeddings", 32768),
        "tie_word_embeddings": hf.get("tie_word_embeddings", True),
    }


def _from_reference(
    hf: dict, weights: dict[str, torch.Tensor], tokenizer: TextTokenizer
) -> tuple[ModelConfig, SignatureTable, dict[str, torch.Tensor]]:
    num_hashes, num_buckets = hf["num_hashes"], hf["num_buckets"]
    num_lsh, lsh_only_embed = hf.get("num_lsh", 0) or 0, bool(hf.get("lsh_only_embed", False))
    try:
        model_cfg = ModelConfig.model_validate(
            {
                "family": "mhf",
                "vocab_size": tokenizer.vocab_size,
                "backbone": _backbone_section(hf),
                "hash": {
                    "spec": format_hash_spec(num_hashes, num_buckets),
                    "io": "reference",
                    "scheme": "reference",
                    "loss": "vocab" if hf.get("use_conditional_prob", False) else "coordinates",
                    "num_lsh": num_lsh,
                    "lsh_only_embed": lsh_only_embed,
                    "bottleneck": hf["bottle_neck_dim"],
                },
            }
        )
    except ValidationError as err:
        problem = err.errors()[0]
        where = ".".join(str(part) for part in problem["loc"]) or "config"
        raise LayoutError(
            f"config.json does not describe a model mhf-dist builds ({where}: "
            f"{problem['msg'].removeprefix('Value error, ')}); fix or re-download the checkpoint"
        ) from None
    table = _imported_table(weights.pop(HASH_MAP, None), tokenizer, num_hashes, num_buckets, hf, num_lsh)
    expected = (num_hashes * num_buckets, model_cfg.backbone.hidden_size)
    embed = weights.get("model.embed_tokens.weight")
    if embed is None or tuple(embed.shape) != expected:
        shape = None if embed is None else tuple(embed.shape)
        raise LayoutError(
            f"model.embed_tokens.weight has shape {shape} but num_hashes x num_buckets, hidden_size in "
            f"config.json say {expected}; the weights and config.json are from different models"
        )
    if model_cfg.backbone.tie_word_embeddings:
        weights.pop("lm_head.weight", None)  # save_pretrained may write the tied copy
    return model_cfg, table, _renamed(weights, _to_ours)


def _imported_table(
    hash_map: torch.Tensor | None,
    tokenizer: TextTokenizer,
    num_hashes: int,
    num_buckets: int,
    hf: dict,
    num_lsh: int,
) -> SignatureTable:
    """The checkpoint's `hash_map` as it is, every row: the tokenizer's ids, then the rows the authors
    add by rounding V up to a multiple of 128, kept as reserved rows (their exact-V normaliser counts
    them). Their added tokens' all-zero rows (the authors hash only the base vocabulary) stay too."""
    vocab = tokenizer.vocab_size
    if (
        hash_map is None
        or hash_map.dim() != 2
        or hash_map.shape[1] != num_hashes
        or hash_map.shape[0] < vocab
    ):
        shape = None if hash_map is None else tuple(hash_map.shape)
        raise LayoutError(
            f"model.hash_map has shape {shape}; expected [>= {vocab} (the tokenizer's tokens), "
            f"{num_hashes}]; the tokenizer, the weights and config.json must be from the same model"
        )
    rows = hash_map.numpy()
    if rows.min() < 0 or rows.max() >= num_buckets:
        raise LayoutError(
            f"model.hash_map holds buckets outside 0..{num_buckets - 1}; the checkpoint is damaged"
        )
    pad_id = hf.get("pad_token_id")
    pad_id = pad_id if isinstance(pad_id, int) and pad_id < vocab and not rows[pad_id].any() else NO_PAD
    return SignatureTable(
        tokenizer.vocabulary(),
        rows.astype(smallest_uint_dtype(num_buckets - 1)),
        np.zeros(len(rows), np.uint32),  # the redraw count is not stored in the reference layout
        num_hashes,
        num_buckets,
        seed=0,
        scheme="reference",
        pad_id=pad_id,
        num_lsh=num_lsh,
    )


def _from_qwen3(
    hf: dict, weights: dict[str, torch.Tensor], tokenizer: TextTokenizer
) -> tuple[ModelConfig, SignatureTable, dict[str, torch.Tensor]]:
    model_cfg = ModelConfig.model_validate(
        {"family": "qwen3", "vocab_size": tokenizer.vocab_size, "backbone": _backbone_section(hf)}
    )
    vocab = tokenizer.vocab_size
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in weights:
            if weights[name].shape[0] < vocab:
                raise LayoutError(
                    f"{name} has {weights[name].shape[0]} rows but the tokenizer {vocab} tokens; "
                    "the tokenizer and the weights are from different models"
                )
            weights[name] = weights[name][:vocab]
    if model_cfg.backbone.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    # Every exported model carries a table; for the qwen3 families it records the vocabulary only.
    table = build_for_config(model_cfg.hash, tokenizer.vocabulary(), tokenizer.pad_token)
    return model_cfg, table, _renamed(weights, lambda name: f"model.{name}")


def _load_strict(model: torch.nn.Module, state: dict[str, torch.Tensor], source: Path) -> None:
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


# --- export ------------------------------------------------------------------------------------------
def export_hf(model_dir: str | Path, out: str | Path) -> Path:
    """An exported mhf-dist model -> the reference layout (mhf) or a plain transformers Qwen3 directory."""
    exported = load_exported(model_dir)
    out = Path(out)
    if out.exists():
        raise LayoutError(f"output {str(out)!r} already exists; remove it or pick another --out")
    family, cfg = exported.config.family, exported.config
    if family == "mhf":
        if cfg.hash.io != "reference" or cfg.backbone.kind != "qwen3":
            raise LayoutError(
                f"the reference layout holds the reference hash I/O over Qwen3; this model has io="
                f"{cfg.hash.io} over {cfg.backbone.kind} (export-hf writes mhf models with "
                "model.hash.io=reference and model.backbone.kind=qwen3)"
            )
        write = _write_reference
    elif family in ("qwen3", "qwen3_matched"):
        write = _write_qwen3
    else:
        raise LayoutError(
            f"family {family} has no Hugging Face layout; export-hf writes mhf and qwen3 models"
        )
    _write_atomically(out, lambda staging: write(exported, staging))
    return out


def _write_atomically(out: Path, write: Callable[[Path], None]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
    try:
        write(staging)
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _write_qwen3(exported: ExportedModel, staging: Path) -> None:
    exported.model.model.save_pretrained(staging)
    exported.tokenizer.save(staging / TOKENIZER_FILE)


def _write_reference(exported: ExportedModel, staging: Path) -> None:
    cfg, table = exported.config, exported.table
    bb = cfg.backbone
    hf_config = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": table.num_rows,  # an imported checkpoint's reserved rows go back as they came
        "hidden_size": bb.hidden_size,
        "num_hidden_layers": bb.num_layers,
        "num_attention_heads": bb.num_heads,
        "num_key_value_heads": bb.num_kv_heads,
        "head_dim": bb.head_dim,
        "intermediate_size": bb.intermediate_size,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "rope_theta": bb.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": bb.rope_theta},
        "rms_norm_eps": bb.rms_norm_eps,
        "max_position_embeddings": bb.max_position_embeddings,
        "tie_word_embeddings": bb.tie_word_embeddings,
        "initializer_range": 0.02,
        "use_sliding_window": False,
        "layer_types": ["full_attention"] * bb.num_layers,
        "eos_token_id": exported.tokenizer.eos_id,
        "pad_token_id": table.pad_id if table.pad_id != NO_PAD else exported.tokenizer.eos_id,
        "num_hashes": cfg.hash.num_hashes,
        "num_buckets": cfg.hash.num_buckets,
        "bottle_neck_dim": cfg.hash.bottleneck,
        "num_lsh": cfg.hash.num_lsh,
        "lsh_only_embed": cfg.hash.lsh_only_embed,
        "use_conditional_prob": cfg.hash.loss == "vocab",
        "fused_decoding": False,
    }
    weights = _renamed(exported.model.state_dict(), _to_reference)
    weights[HASH_MAP] = table.as_tensor()
    (staging / CONFIG_FILE).write_text(json.dumps(hf_config, indent=2))
    save_file({name: tensor.contiguous() for name, tensor in weights.items()}, str(staging / WEIGHTS_FILE))
    exported.tokenizer.save(staging / TOKENIZER_FILE)


def _to_reference(name: str) -> str | None:
    if name.endswith(TIED_DUPLICATES):
        return None
    for ours, theirs in REFERENCE_NAMES:
        if name.startswith(ours):
            return theirs + name[len(ours) :]
    raise LayoutError(f"parameter {name} has no place in the reference layout")


def _to_ours(name: str) -> str | None:
    for ours, theirs in REFERENCE_NAMES:
        if name.startswith(theirs):
            return ours + name[len(theirs) :]
    return name  # unknown names surface as `unexpected` in _load_strict


def _renamed(
    weights: dict[str, torch.Tensor], rename: Callable[[str], str | None]
) -> dict[str, torch.Tensor]:
    renamed = {}
    for name, tensor in weights.items():
        new = rename(name)
        if new is not None:
            tensor = tensor.detach().to("cpu")
            renamed[new] = tensor.float() if tensor.is_floating_point() else tensor
    return renamed
