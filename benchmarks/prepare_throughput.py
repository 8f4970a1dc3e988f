"""Throughput of `mhf prepare` at 1 and 2 CPUs and on a local 2-node cluster vs a one-process baseline.

Corpus: WikiText-2 raw valid + test from ../shared/data, repeated to make a longer run; a byte-level BPE
trained on it; H4B16K signatures. The baseline does the same work in one process on one core:
`encode_batch` (rayon held to one thread) + packing + numpy signature lookup, without writing files.
`mhf prepare` also writes compressed parquet shards and the manifest. Ray start-up is excluded; each
setting gets a fresh Ray instance (the cluster: a head and a worker node of 1 CPU each, `mhf cluster`'s).

    python benchmarks/prepare_throughput.py [--repeat 16] [--cpus 1 2] [--no-cluster]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAYON_NUM_THREADS", "1")  # the baseline is one core; must precede tokenizers' pool

import numpy as np
import ray
from common import write_results

from mhf_dist.config import load_config
from mhf_dist.data.corpus import split_text_file
from mhf_dist.data.packing import pack_rows
from mhf_dist.data.prepare import prepare
from mhf_dist.data.tokenizer import TextTokenizer
from mhf_dist.local_cluster import AUTH_MODE_VARIABLE, free_port, start_local_cluster, stop_local_cluster
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
    streams = []
    for path in files:
        documents, _ = split_text_file(path.read_bytes())
        ids = [[*row, tokenizer.eos_id] for row in tokenizer.encode_batch(documents)]
        streams.append(np.fromiter((token for doc in ids for token in doc), dtype=np.int64))
    stream = np.concatenate(streams)
    table.lookup(pack_rows(stream, seq_len))
    return len(stream), time.perf_counter() - start


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
    parser.add_argument("--cpus", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--no-cluster", dest="cluster", action="store_false", help="skip the 2-node run")
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
        texts, _ = split_text_file((WIKITEXT / "wiki.valid.raw").read_bytes())
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
        base_rate = base_tokens / base_seconds
        settings = [(f"local, {cpus} CPU", cpus, None) for cpus in args.cpus]
        if args.cluster:
            settings.append(("local 2-node cluster", 2, Path(tmp) / "cluster"))
        rows, hashes = [], set()
        for name, cpus, cluster_dir in settings:
            ray.shutdown()
            cluster = None
            if cluster_dir is not None:
                cluster = start_local_cluster(
                    cluster_dir, workers=1, cpus_per_node=1, dashboard_port=free_port()
                )
                os.environ[AUTH_MODE_VARIABLE] = "token"
                ray.init(address=cluster.address, logging_level="ERROR")
            else:
                ensure_ray(cpus)
            try:
                out = Path(tmp) / f"shards-{len(rows)}"
                start = time.perf_counter()
                manifest = prepare(cfg, out, num_cpus=cpus, log=lambda _: None)
                seconds = time.perf_counter() - start
            finally:
                ray.shutdown()
                if cluster_dir is not None:
                    stop_local_cluster(cluster_dir)
            hashes.add(manifest.content_sha256)
            tokens = sum(
                info.target_tokens + info.dropped_tokens + (1 if info.rows else 0)
                for info in manifest.splits.values()
            )
            rate = tokens / seconds
            rows.append(
                {
                    "setting": name,
                    "cpus": cpus,
                    "tokens": tokens,
                    "seconds": round(seconds, 2),
                    "prepare_tok_s": round(rate),
                    "baseline_tok_s": round(base_rate),
                    "per_cpu_ratio": round(rate / cpus / base_rate, 3),
                    "target": PREPARE_TARGET,
                }
            )
    print(markdown_table(rows, list(rows[0])))
    if len(hashes) != 1:
        raise SystemExit("error: the settings wrote different shards; prepare is not deterministic")
    lookup = lookup_rate(table)
    print(f"signature lookup: {lookup / 1e6:,.0f}M tokens/s (target {LOOKUP_TARGET / 1e6:.0f}M)")
    payload = {
        "benchmark": "prepare_throughput",
        "repeat": args.repeat,
        "vocab_size": tokenizer.vocab_size,
        "hash": "H4B16K",
        "seq_len": args.seq_len,
        "baseline_tokens": base_tokens,
        "baseline_seconds": base_seconds,
        "identical_shards": True,
        "content_sha256": hashes.pop(),
        "lookup_tok_s": lookup,
        "lookup_target": LOOKUP_TARGET,
        "results": rows,
    }
    write_results(args.out, payload)


if __name__ == "__main__":
    main()
