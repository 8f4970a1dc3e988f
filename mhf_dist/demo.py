"""`mhf demo`: the whole flow, small, on the built-in corpus, in this process.

Trains a BPE on the corpus, packs it into rows, builds the signature table, then trains `mhf`, `qwen3`
and `qwen3_matched` on identical batches and compares their exact validation NLL.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import mmh3
import torch

from mhf_dist.config import Config
from mhf_dist.data.corpus import builtin_documents
from mhf_dist.data.packing import pack_documents, shuffled_batches
from mhf_dist.data.tokenizer import TextTokenizer
from mhf_dist.eval.perplexity import evaluate_rows
from mhf_dist.models import build_model, param_count, train_flops_per_token
from mhf_dist.models.counting import matched_layers
from mhf_dist.models.generation import generate
from mhf_dist.signatures import SignatureTable
from mhf_dist.tables import markdown_table
from mhf_dist.train.loop import train_local

DEMO_FAMILIES = ("mhf", "qwen3", "qwen3_matched")
VALIDATION_PERCENT = 10
COLUMNS = ("family", "params", "layers", "train_loss", "val_nll", "val_ppl", "tokens_per_s")


def is_validation(document: str) -> bool:
    """Stable split by document content: the same document always lands in the same split."""
    return mmh3.hash(document.encode(), 0, signed=False) % 100 < VALIDATION_PERCENT


def run_demo(
    cfg: Config,
    workdir: Path,
    families: Sequence[str] = DEMO_FAMILIES,
    log: Callable[[str], None] = print,
) -> list[dict]:
    documents = builtin_documents()
    train_docs = [doc for doc in documents if not is_validation(doc)]
    val_docs = [doc for doc in documents if is_validation(doc)]
    log(f"corpus: built-in Python docs, {len(train_docs)} train / {len(val_docs)} validation documents")

    tokenizer = TextTokenizer.train_bpe(train_docs, cfg.model.vocab_size)
    model_cfg = cfg.model.model_copy(update={"vocab_size": tokenizer.vocab_size})
    train_rows, _ = pack_documents(tokenizer.encode_batch(train_docs), cfg.train.seq_len, tokenizer.eos_id)
    val_rows, _ = pack_documents(tokenizer.encode_batch(val_docs), cfg.train.seq_len, tokenizer.eos_id)
    table = SignatureTable.build(
        tokenizer.vocabulary(), model_cfg.hash.num_hashes, model_cfg.hash.num_buckets, model_cfg.hash.seed
    )
    log(
        f"tokenizer: BPE, {tokenizer.vocab_size} tokens; {len(train_rows)} train / {len(val_rows)} val rows "
        f"of {cfg.train.seq_len + 1}; signatures {table.spec} fingerprint {table.fingerprint[:12]}"
    )

    prompt = tokenizer.encode_batch(["The for statement"])[0]
    results = []
    for family in families:
        family_cfg = model_cfg.model_copy(update={"family": family})
        layers = matched_layers(family_cfg)[0] if family == "qwen3_matched" else model_cfg.backbone.num_layers
        log(f"--- {family}: {param_count(family_cfg):,} parameters, {layers} layers")
        torch.manual_seed(cfg.train.seed)
        model = build_model(family_cfg, table)
        batches = shuffled_batches(train_rows, cfg.train.batch_size, cfg.train.seed)
        history = train_local(
            model, batches, cfg.train, train_flops_per_token(family_cfg, cfg.train.seq_len), log
        )
        evaluation = evaluate_rows(model, val_rows)
        sample = list(generate(model, prompt, max_new_tokens=16))
        results.append(
            {
                "family": family,
                "params": param_count(family_cfg),
                "layers": layers,
                "train_loss": sum(h["loss"] for h in history[-10:]) / len(history[-10:]),
                **evaluation,
                "tokens_per_s": sum(h["tokens_per_s"] for h in history) / len(history),
                "sample": tokenizer.decode(prompt + sample),
            }
        )
        log(
            f"{family}: val NLL {evaluation['val_nll']:.4f} (ppl {evaluation['val_ppl']:.1f}); "
            f"greedy sample: {results[-1]['sample']!r}"
        )

    _write_outputs(workdir, results, tokenizer, table, cfg)
    log("\n" + markdown_table(results, COLUMNS))
    log(
        "val_nll: exact NLL per token over the real vocabulary (mhf renormalised over V_actl); "
        "train_loss: the family's own training loss (mhf: sum of signature-coordinate cross-entropies)"
    )
    log(f"results: {workdir / 'results.json'}")
    return results


def _write_outputs(
    workdir: Path, results: list[dict], tokenizer: TextTokenizer, table: SignatureTable, cfg: Config
) -> None:
    workdir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(workdir / "tokenizer.json")
    table.save(workdir / "signatures.safetensors")
    payload = {"config": cfg.model_dump(mode="json"), "results": results}
    fd, tmp = tempfile.mkstemp(dir=workdir, suffix=".tmp")
    with os.fdopen(fd, "w") as handle:
        json.dump(payload, handle, indent=2)
    os.replace(tmp, workdir / "results.json")
