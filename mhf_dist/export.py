"""Exported model directories: what eval, generate, cpt and lm-eval load.

An exported directory holds `config.json` (`ExportRecord`: the model config, the signature fingerprint,
the document format), `model.safetensors`, `signatures.safetensors` (the vocabulary's SignatureTable) and
`tokenizer.json`. It is written through `Location.staged_directory`, so a directory that exists is
complete (in a bucket, `config.json` is uploaded last). A remote model is loaded from a local copy
(`storage.local_copy`); loading never unpickles: safetensors only.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from mhf_dist.config import ModelConfig
from mhf_dist.data.shards import SIGNATURES_FILE, TOKENIZER_FILE
from mhf_dist.data.tokenizer import DOCUMENT_FORMATS, LEGACY_FORMAT, TextTokenizer, check_document_format
from mhf_dist.errors import DataError, MhfError, SignatureError, first_problem
from mhf_dist.models.base import CausalLM
from mhf_dist.readers import as_record, read_json
from mhf_dist.signatures import SignatureTable, load_table, save_table
from mhf_dist.storage import Location, local_copy

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
FORMAT = "mhf-model"


class ExportError(MhfError):
    """An exported model directory is missing, incomplete or inconsistent."""


class ExportRecord(BaseModel):
    """An exported model's config.json; fields after `signature_fingerprint` default for older exports."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    format: Literal["mhf-model"]
    model: dict[str, Any]  # the ModelConfig, as JSON (validated when the model is built)
    signature_fingerprint: str
    tokenizer_sha256: str | None = None  # its rules too: merges, normalizer, pre-tokenizer
    lineage: list[dict[str, Any]] = Field(default_factory=list)  # vocabularies it grew from (`mhf cpt`)
    document_format: Literal["bos", "eos"] = LEGACY_FORMAT


@dataclass
class ExportedModel:
    model: CausalLM
    config: ModelConfig
    table: SignatureTable
    tokenizer: TextTokenizer
    path: Path | Location  # where it was loaded from: a local directory, or a bucket's
    lineage: list[dict]  # the vocabularies this model grew from, oldest first: fingerprint, vocab_size
    document_format: str = LEGACY_FORMAT  # bos: `<s> text` documents; eos: `text EOS`


def export_model(
    model: CausalLM,
    config: ModelConfig,
    table: SignatureTable,
    tokenizer_file: str | Path,
    directory: str | Path | Location,
    lineage: list[dict] | None = None,
    document_format: str = LEGACY_FORMAT,
) -> Path | Location:
    """Write `model` (whole parameters: gather ZeRO-3 shards first) as an exported directory, local or in
    a bucket, with the vocabularies it grew from (`lineage`, `mhf cpt`) and its `document_format`."""
    if document_format not in DOCUMENT_FORMATS:
        raise ExportError(f"document format {document_format!r}; use one of {', '.join(DOCUMENT_FORMATS)}")
    from safetensors.torch import save_file

    where = Location.of(directory)
    check_new_output(where, ExportError, "another directory")
    tokenizer = TextTokenizer.load(tokenizer_file)
    difference = table.vocabulary_difference(tokenizer.vocabulary())
    if difference is not None:
        raise ExportError(
            f"tokenizer {str(tokenizer_file)!r} is not the signature table's vocabulary ({difference})"
        )
    record = ExportRecord(
        format=FORMAT,
        model=config.model_dump(mode="json"),
        signature_fingerprint=table.fingerprint,
        tokenizer_sha256=tokenizer.sha256,
        lineage=lineage or [],
        document_format=document_format,
    )
    with where.staged_directory(CONFIG_FILE) as staging:
        (staging / CONFIG_FILE).write_text(record.model_dump_json(indent=2))
        # Standalone copies: DeepSpeed's ZeRO-1/2 parameters are views into one flat buffer, which
        # safetensors refuses to save; `load_model` restores the tied names on load.
        weights = {
            name: t.detach().to("cpu", copy=True).contiguous() for name, t in unique_tensors(model).items()
        }
        save_file(weights, str(staging / WEIGHTS_FILE))
        save_table(table, staging / SIGNATURES_FILE)
        shutil.copyfile(tokenizer_file, staging / TOKENIZER_FILE)
    return where.as_given()


def check_new_output(where: Location, error: type[MhfError], fix: str) -> None:
    """`where` does not exist yet and can be written (checked before any work, not at the upload after it)."""
    where.check_writable(error, f"pick {fix}")
    if where.exists():
        raise error(f"output {str(where)!r} already exists; remove it or pick {fix}")


def unique_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict with each tied tensor once, under its first name (Qwen3's lm_head is its
    embedding; the reference decoder's table is the encoder's)."""
    first: dict[tuple[int, tuple[int, ...]], tuple[str, torch.Tensor]] = {}
    for name, tensor in model.state_dict().items():
        first.setdefault((tensor.data_ptr(), tuple(tensor.shape)), (name, tensor))
    return dict(first.values())


def read_export_config(directory: str | Path | Location) -> ExportRecord:
    """The exported model's config.json (local or in a bucket); a bad one is a one-line error."""
    where = Location.of(directory)
    path = where / CONFIG_FILE
    if not path.is_file():
        where.check_bucket()
        if not where.exists():
            raise ExportError(f"{str(where)!r} does not exist; pass an exported model's directory")
        unfinished = ", which an export writes last" if where.remote and where.is_dir() else ""
        raise ExportError(
            f"{str(where)!r} is not an exported model (no {CONFIG_FILE}{unfinished}); pass the `model` "
            "directory of a checkpoint or of `mhf train` output"
        )
    description = read_json(path, ExportError, "re-export the model")
    if not isinstance(description, dict) or description.get("format") != FORMAT:
        raise ExportError(f"{str(path)!r} is not an mhf-dist model config; pass an exported model directory")
    return as_record(description, ExportRecord, path, ExportError, "re-export the model")


def check_documents_fit(
    model_dir: str | Path | Location, data_format: str, data_label: str, error: type[MhfError] = DataError
) -> None:
    """Data for the exported model in `model_dir` frames documents as its training data did (a directory
    without config.json holds no exported model and is not judged)."""
    where = Location.of(model_dir)
    if not (where / CONFIG_FILE).is_file():
        return
    trained_on = read_export_config(where).document_format
    check_document_format(data_format, trained_on, data_label, f"model {str(where)!r}", error)


def exported_table(
    directory: str | Path | Location, description: ExportRecord, shown: Location | None = None
) -> SignatureTable:
    """An exported model's signature table, the one its config.json (`description`) records. `shown`: the
    directory as the user gave it, when `directory` is its local copy."""
    table = load_table(Location.of(directory) / SIGNATURES_FILE)
    if table.fingerprint != description.signature_fingerprint:
        raise SignatureError(
            f"{str(shown or directory)!r}: the signature table's fingerprint {table.fingerprint[:12]} "
            f"differs from the one the model was trained with ({description.signature_fingerprint[:12]}); "
            "restore the exported directory's signatures.safetensors"
        )
    return table


def load_exported(directory: str | Path | Location) -> ExportedModel:
    """Build the model from config.json and load its weights; the signature table must match."""
    from safetensors.torch import load_model

    from mhf_dist.models import build_model

    where = Location.of(directory)
    description = read_export_config(where)
    local = local_copy(where, marker=CONFIG_FILE)
    try:
        config = ModelConfig.model_validate(description.model)
    except ValidationError as err:
        key, message = first_problem(err)
        raise ExportError(
            f"{str(where)!r}: config.json's model.{key or 'config'} is not one mhf-dist builds ({message}); "
            "re-export the model"
        ) from None
    table = exported_table(local, description, where)
    model = build_model(config, table)
    if not (local / WEIGHTS_FILE).is_file():
        raise ExportError(f"{str(where)!r} has no {WEIGHTS_FILE}; re-export the model")
    try:
        load_model(model, str(local / WEIGHTS_FILE), strict=True)
    except Exception as err:  # safetensors raises several types for a truncated or foreign file
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]  # torch: a heading, then
        reason = next((line for line in lines if not line.endswith(":")), type(err).__name__)  # each key
        raise ExportError(
            f"{str(where / WEIGHTS_FILE)!r} is damaged or not of the model {CONFIG_FILE} describes "
            f"({reason[:200]}); restore the exported directory as it was written"
        ) from None
    model.eval()
    tokenizer = TextTokenizer.load(local / TOKENIZER_FILE)
    why = table.vocabulary_difference(tokenizer.vocabulary())
    recorded = description.tokenizer_sha256  # None: an export older than the record
    if why is None and recorded is not None and recorded != tokenizer.sha256:
        why = (
            f"its sha256 {tokenizer.sha256[:12]}, config.json records {str(recorded)[:12]}: its merges, "
            "normalizer or pre-tokenizer were edited"
        )
    if why is not None:
        raise ExportError(
            f"{str(where / TOKENIZER_FILE)!r} is not the tokenizer the model was exported with ({why}); "
            "restore the exported tokenizer.json"
        )
    lineage, document_format = description.lineage, description.document_format
    return ExportedModel(model, config, table, tokenizer, where.as_given(), lineage, document_format)
