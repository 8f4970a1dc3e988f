"""Throughput of `mhf prepare` (Ray Data, local, N CPUs) vs a single-process baseline, same run.

Corpus: WikiText-2 raw valid + test from ../shared/data, repeated to make a longer run; a byte-level BPE
trained on it; H4B16K signatures. The baseline does the same work in one process on one core:
`encode_batch` (rayon held to one thread) + packing + numpy signature lookup, without writing files.
`mhf prepare` also writes compressed parquet shards and the manifest. Ray start-up is excluded.

    python benchmarks/prepare_throughput.py [--repeat 16] [--cpus 2]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAYON_NUM_THREADS", "1")  # the baseline is one core; must precede tokenizers' pool

import numpy as np
from common import write_results

from mhf_dist.config import load_config
from mhf_dist.data.corpus import split_text_file
from mhf_dist.data.packing import pack_rows
from mhf_dist.data.prepare import prepare
from mhf_dist.data.tokenizer import TextTokenizer
from mhf_dist.ray_utils import ensure_ray
from mhf_dist.signatures import SignatureTable
from mhf_dist.tables import markdown_table

WIKITEXT = Path(__file__).resolve().parents[2] / "shared" / "data" / "wikitext-2-raw"
RESULTS = Path(__file__).parent / "results" / "prepare_throughput.json"
PREPARE_TARGET = 0.7  # prepare tokens/s per CPU over the baseline's
LOOKUP_TARGET = 50e6  # tokens/s


def baseline(
    files: list[Path], tokenizer: TextTokenizer, table: SignatureTable, seq_len: int
) -> tuple[int, float]:
    start = time.perf_counter()
    packer, tokens = Packer(seq_len), 0
    for path in files:
        documents = [doc["text"] for doc in split_text_file({"bytes": path.read_bytes()})]
        ids = [[*row, tokenizer.eos_id] for row in tokenizer.encode_batch(documents)]
        stream = np.fromiter((token for doc in ids for token in doc), dtype=np.int64)
        tokens += len(stream)
        table.lookup(packer.add(stream))
    return tokens, time.perf_counter() - start


def lookup_rate(table: SignatureTable, tokens: int = 50_000_000) -> float:
    """Steady-state rate: best of three calls (the first also pays page faults of the output)."""
    ids = np.random.default_rng(0).integers(0, len(table), tokens)
    seconds = []
    for _ in range(3):
        start = time.perf_counter()
        table.lookup(ids)
        seconds.append(time.perf_counter() - start)
    return tokens / min(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=16, help="copies of valid+test in the corpus")
    parser.add_argument("--cpus", type=int, default=2)
    parser.add_argument("--vocab-size", type=int, default=16384)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if not WIKITEXT.is_dir():
        raise SystemExit(f"error: {WIKITEXT} is absent; this benchmark needs ../shared/data")

    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus"
        corpus.mkdir()
        for copy in range(args.repeat):
            for split in ("valid", "test"):
                (corpus / f"{copy:02d}-{split}.raw").write_bytes(
                    (WIKITEXT / f"wiki.{split}.raw").read_bytes()
                )
        files = sorted(corpus.iterdir())
        texts = [
            doc["text"] for doc in split_text_file({"bytes": (WIKITEXT / "wiki.valid.raw").read_bytes()})
        ]
        tokenizer = TextTokenizer.train_bpe(texts, args.vocab_size)
        tokenizer.save(Path(tmp) / "tokenizer.json")
        cfg = load_config(
            "tiny",
            [
                f"data.corpus={corpus}",
                f"data.tokenizer={Path(tmp) / 'tokenizer.json'}",
                f"model.vocab_size={tokenizer.vocab_size}",
                "model.hash.spec=H4B16K",
                f"train.seq_len={args.seq_len}",
                "data.val_percent=1",
            ],
        )
        table = SignatureTable.build(tokenizer.vocabulary(), 4, 16384)

        base_tokens, base_seconds = baseline(files, tokenizer, table, args.seq_len)
        ensure_ray(args.cpus)
        start = time.perf_counter()
        manifest = prepare(cfg, Path(tmp) / "shards", num_cpus=args.cpus, log=lambda _: None)
        prep_seconds = time.perf_counter() - start
    prep_tokens = sum(
        info["target_tokens"] + info["dropped_tokens"] + (1 if info["rows"] else 0)
        for info in manifest["splits"].values()
    )
    base_rate, prep_rate = base_tokens / base_seconds, prep_tokens / prep_seconds
    row = {
        "corpus_tokens": base_tokens,
        "baseline_tok_s": base_rate,
        "prepare_tok_s": prep_rate,
        "cpus": args.cpus,
        "prepare_per_cpu_ratio": prep_rate / args.cpus / base_rate,
        "target": PREPARE_TARGET,
        "lookup_tok_s": lookup_rate(table),
        "lookup_target": LOOKUP_TARGET,
    }
    print(markdown_table([row], list(row)))
    payload = {
        "benchmark": "prepare_throughput",
        "repeat": args.repeat,
        "vocab_size": tokenizer.vocab_size,
        "hash": "H4B16K",
        "seq_len": args.seq_len,
        "prepare_tokens": prep_tokens,
        "baseline_seconds": base_seconds,
        "prepare_seconds": prep_seconds,
        "result": row,
    }
    write_results(args.out, payload)


if __name__ == "__main__":
    main()
