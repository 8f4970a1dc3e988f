"""`mhf prepare`: Ray Data against the plain-task pipeline it replaced, object-store use on a corpus
larger than the store, reading the corpus from an S3-protocol server, and staging a ray.data.Dataset.

Four measurements, each under its own key of `benchmarks/results/prepare_throughput.json` (a run of
some keeps the others' last results):

- `throughput`: WikiText-2 raw valid + test from ../shared/data, repeated; a byte-level BPE trained on
  it; H4B16K signatures. This tree's prepare (Ray Data tasks) against the plain-task prepare of
  `--baseline-ref` (exported with `git archive`), side by side at 1 and 2 CPUs: each run in a fresh
  process with a fresh Ray instance (start-up excluded, `timed_prepare.py`), the two alternated, the
  faster of `--rounds` each; both must write byte-identical shards. Beside them one process on one core
  doing the same work (`encode_batch` with rayon held to one thread + packing + numpy signature lookup,
  no files written), and this tree on a local 2-node cluster.
- `bounded_store`: the same text repeated until its tokenized size (4 bytes a token, the byte
  vocabulary: a token a byte) is at least 4x the object store Ray is given
  (`ray.init(object_store_memory=80 MiB)`; Ray's minimum is 75 MiB). Prepared to completion; the peak
  bytes held in the object store, polled every 20 ms from the raylets' own store stats (the reply
  `ray memory --stats-only` prints, read in bytes: `object_store_bytes_used` plus what fell back to
  disk), over the tokenized corpus bytes is `peak_store_over_corpus` (target <= 0.25); what was spilled
  is reported beside it, and the peak the same poll sees while one 8 MiB object is held (it measures).
  The shards must be byte-identical to a run with Ray's default store.
- `s3`: prepare tokens/s with the corpus (a quarter of the bounded-store text) read from an S3-protocol
  server (moto on 127.0.0.1, tests/servers.py) against the same files on the local disk, on the same Ray
  instance, alternating, the faster of two runs each; as a ratio to the local baseline.
- `staging`: the throughput corpus as parquet files, prepared from the files and from
  `ray.data.read_parquet` of them handed over as a Dataset source (staged into the work area first),
  alternating, the faster of two each; staging alone timed per GB of text. Both must give the same shards.

    python benchmarks/prepare_throughput.py [--only throughput bounded_store s3 staging] [--repeat 16]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

os.environ.setdefault("RAYON_NUM_THREADS", "1")  # the baseline is one core; must precede tokenizers' pool

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import ray
from common import write_results
from timed_prepare import stream_tokens

from mhf_dist.config import Config, load_config
from mhf_dist.data.corpus import split_text_file
from mhf_dist.data.mixture import DatasetSpec, Source
from mhf_dist.data.packing import pack_rows
from mhf_dist.data.prepare import prepare
from mhf_dist.data.prepare.staging import stage
from mhf_dist.data.shards import Manifest
from mhf_dist.data.tokenizer import TextTokenizer
from mhf_dist.local_cluster import AUTH_MODE_VARIABLE, free_port, start_local_cluster, stop_local_cluster
from mhf_dist.ray_utils import ensure_ray
from mhf_dist.signatures import SignatureTable
from mhf_dist.storage import Location
from mhf_dist.tables import markdown_table

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import servers

ROOT = Path(__file__).resolve().parents[1]
WIKITEXT = ROOT.parent / "shared" / "data" / "wikitext-2-raw"
RESULTS = Path(__file__).parent / "results" / "prepare_throughput.json"
BASELINE_REF = "712aef2"  # the last commit whose prepare ran plain Ray tasks
RAY_DATA_TARGET = 0.9  # this tree's tokens/s over the plain-task prepare's
PREPARE_TARGET = 0.7  # prepare tokens/s per CPU over the one-process baseline's
LOOKUP_TARGET = 50e6  # tokens/s
SMALL_STORE = 80 << 20  # bytes; Ray refuses less than 75 MiB
STORE_TARGET = 0.25  # peak object-store bytes over tokenized corpus bytes
CALIBRATION_BYTES = 8 << 20
SECTIONS = ("throughput", "bounded_store", "s3", "staging")


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


def write_corpus(directory: Path, repeat: int) -> list[Path]:
    """WikiText-2 valid + test, `repeat` times, one file each."""
    directory.mkdir(parents=True, exist_ok=True)
    for copy in range(repeat):
        for split in ("valid", "test"):
            (directory / f"{copy:03d}-{split}.raw").write_bytes((WIKITEXT / f"wiki.{split}.raw").read_bytes())
    return sorted(directory.iterdir())


def timed_prepare(cfg: Config, out: Path | str, cpus: int) -> tuple[Manifest, float]:
    start = time.perf_counter()
    manifest = prepare(cfg, out, num_cpus=cpus, log=lambda _: None)
    return manifest, time.perf_counter() - start


def throughput(tmp: Path, args: argparse.Namespace) -> dict[str, Any]:
    files = write_corpus(tmp / "throughput", args.repeat)
    texts, _ = split_text_file((WIKITEXT / "wiki.valid.raw").read_bytes())
    tokenizer = TextTokenizer.train_bpe(texts, args.vocab_size)
    tokenizer.save(tmp / "tokenizer.json")
    overrides = [
        f"data.corpus={tmp / 'throughput'}",
        f"data.tokenizer={tmp / 'tokenizer.json'}",
        f"model.vocab_size={tokenizer.vocab_size}",
        "model.hash.spec=H4B16K",
        f"train.seq_len={args.seq_len}",
        "data.val_percent=1",
    ]
    table = SignatureTable.build(tokenizer.vocabulary(), 4, 16384)
    base_tokens, base_seconds = baseline(files, tokenizer, table, args.seq_len)
    base_rate = base_tokens / base_seconds
    trees = {
        "Ray Data (this tree)": ROOT,
        f"plain tasks ({args.baseline_ref})": export_tree(args.baseline_ref, tmp),
    }
    best: dict[tuple[str, int], dict[str, Any]] = {}
    runs = 0
    for cpus in args.cpus:
        for _ in range(args.rounds):
            for name, tree in trees.items():
                runs += 1
                run = timed_in(tree, overrides, tmp / f"out-{runs}", cpus)
                if (name, cpus) not in best or run["seconds"] < best[name, cpus]["seconds"]:
                    best[name, cpus] = run
    hashes = {run["content_sha256"] for run in best.values()}
    rows = []
    for (name, cpus), run in best.items():
        rows.append(_row(name, cpus, run, base_rate, best[list(trees)[1], cpus]))
    if args.cluster:  # a head and a worker node of 1 CPU each; the prepare joins it (RAY_ADDRESS)
        cluster = start_local_cluster(tmp / "cluster", workers=1, cpus_per_node=1, dashboard_port=free_port())
        try:
            joining = {"RAY_ADDRESS": cluster.address, AUTH_MODE_VARIABLE: "token"}
            run = timed_in(ROOT, overrides, tmp / "cluster-out", 2, joining)
        finally:
            stop_local_cluster(tmp / "cluster")
        hashes.add(run["content_sha256"])
        rows.append(_row("Ray Data, local 2-node cluster", 2, run, base_rate, None))
    print(markdown_table(rows, list(rows[0])))
    if len(hashes) != 1:
        raise SystemExit("error: the settings wrote different shards; prepare is not deterministic")
    lookup = lookup_rate(table)
    print(f"signature lookup: {lookup / 1e6:,.0f}M tokens/s (target {LOOKUP_TARGET / 1e6:.0f}M)")
    return {
        "repeat": args.repeat,
        "rounds": args.rounds,
        "baseline_ref": args.baseline_ref,
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


def _row(
    name: str, cpus: int, run: dict[str, Any], base_rate: float, plain: dict[str, Any] | None
) -> dict[str, Any]:
    rate = run["tokens"] / run["seconds"]
    return {
        "prepare": name,
        "cpus": cpus,
        "tokens": run["tokens"],
        "seconds": round(run["seconds"], 2),
        "prepare_tok_s": round(rate),
        "vs_plain_tasks": round(plain["seconds"] / run["seconds"], 3) if plain else None,
        "target_vs_plain": RAY_DATA_TARGET,
        "per_cpu_vs_one_process": round(rate / cpus / base_rate, 3),
        "one_process_tok_s": round(base_rate),
    }


def export_tree(ref: str, tmp: Path) -> Path:
    """The mhf_dist package of commit `ref`, exported beside the run (no checkout, no install)."""
    tree = tmp / f"tree-{ref}"
    tree.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", ref, "mhf_dist"], check=True, capture_output=True
    )
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    return tree


def timed_in(
    tree: Path, overrides: list[str], out: Path, cpus: int, variables: dict[str, str] | None = None
) -> dict[str, Any]:
    """`timed_prepare.py` with `tree`'s mhf_dist first on the path: a fresh process and Ray instance
    (or the cluster `variables` name: Ray reads RAY_AUTH_MODE as it is imported)."""
    spec = json.dumps({"overrides": overrides, "out": str(out), "cpus": cpus})
    environment = {**os.environ, "PYTHONPATH": str(tree), **(variables or {})}
    script = Path(__file__).parent / "timed_prepare.py"
    done = subprocess.run(
        [sys.executable, str(script), spec], env=environment, capture_output=True, text=True, check=False
    )
    if done.returncode:
        raise SystemExit(f"error: timed prepare in {tree} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


@contextmanager
def ray_instance(cpus: int, store: int | None = None) -> Iterator[None]:
    """A fresh local Ray instance with `cpus` (and `store` bytes of object store)."""
    ray.shutdown()
    if store is not None:
        ray.init(num_cpus=cpus, object_store_memory=store, include_dashboard=False, logging_level="ERROR")
    else:
        ensure_ray(cpus)
    try:
        yield
    finally:
        ray.shutdown()


class StorePeak(threading.Thread):
    """Polls the object store's stats (every node's, summed by the raylet) until stopped: the peak
    bytes held (in memory or fallen back to disk) and the bytes spilled."""

    def __init__(self, interval: float = 0.02) -> None:
        super().__init__(daemon=True)
        from ray._private import internal_api

        self._internal_api = internal_api
        self._state = internal_api.get_state_from_address(ray.get_runtime_context().gcs_address)
        self.interval, self.peak, self.spilled, self.samples = interval, 0, 0, 0
        self.capacity = self._stats().object_store_bytes_avail
        self._done = threading.Event()

    def _stats(self) -> Any:
        return self._internal_api.get_memory_info_reply(self._state, timeout_seconds=10).store_stats

    def run(self) -> None:
        while not self._done.is_set():
            stats = self._stats()
            self.peak = max(self.peak, stats.object_store_bytes_used + stats.object_store_bytes_fallback)
            self.spilled = max(self.spilled, stats.spilled_bytes_total)
            self.samples += 1
            self._done.wait(self.interval)

    def stop(self) -> None:
        self._done.set()
        self.join()


def byte_cfg(corpus: str, seq_len: int) -> Config:
    settings = [
        "data.tokenizer=bytes",
        "model.vocab_size=259",
        f"train.seq_len={seq_len}",
        "data.val_percent=1",
    ]
    return load_config("tiny", [f"data.corpus={corpus}", *settings])


def calibrate() -> int:
    """The peak the poll sees while one object of CALIBRATION_BYTES is held: shows that it measures."""
    poll = StorePeak()
    poll.start()
    held = ray.put(np.zeros(CALIBRATION_BYTES, np.uint8))
    deadline = time.monotonic() + 10
    while poll.peak < CALIBRATION_BYTES and time.monotonic() < deadline:
        time.sleep(poll.interval)
    poll.stop()
    del held
    return poll.peak


def bounded_store(tmp: Path, args: argparse.Namespace) -> dict[str, Any]:
    files = write_corpus(tmp / "large", args.store_repeat)
    text_bytes = sum(path.stat().st_size for path in files)
    cfg = byte_cfg(str(tmp / "large"), args.seq_len)
    with ray_instance(args.store_cpus, store=SMALL_STORE):
        poll = StorePeak()
        poll.start()
        small, seconds = timed_prepare(cfg, tmp / "small-store", args.store_cpus)
        poll.stop()
        seen = calibrate()  # after: what it holds would count in the run's peak
    with ray_instance(args.store_cpus):
        large, large_seconds = timed_prepare(cfg, tmp / "large-store", args.store_cpus)
    tokens = stream_tokens(small)
    corpus_bytes = 4 * tokens
    identical = small.content_sha256 == large.content_sha256 and all(
        (tmp / "small-store" / shard.file).read_bytes() == (tmp / "large-store" / shard.file).read_bytes()
        for info in small.splits.values()
        for shard in info.shards
    )
    result = {
        "text_bytes": text_bytes,
        "tokens": tokens,
        "tokenized_corpus_bytes": corpus_bytes,
        "object_store_bytes": poll.capacity,
        "corpus_over_store": round(corpus_bytes / poll.capacity, 2),
        "peak_store_bytes": poll.peak,
        "spilled_bytes": poll.spilled,
        "polls": poll.samples,
        "calibration_put_bytes": CALIBRATION_BYTES,
        "calibration_seen_bytes": seen,
        "peak_store_over_corpus": poll.peak / corpus_bytes,
        "target": STORE_TARGET,
        "small_store_seconds": round(seconds, 2),
        "small_store_tok_s": round(tokens / seconds),
        "default_store_seconds": round(large_seconds, 2),
        "identical_shards": identical,
        "content_sha256": small.content_sha256,
    }
    print(markdown_table([result], list(result)))
    if not identical:
        raise SystemExit("error: the small-store run wrote other shards than the default-store run")
    return result


def s3(tmp: Path, args: argparse.Namespace) -> dict[str, Any]:
    files = write_corpus(tmp / "s3-local", max(1, args.store_repeat // 4))
    server = servers.S3Server(tmp / "moto.log")
    try:
        bucket = server.make_bucket("prepare-benchmark")
        for path in files:
            (Location.of(bucket) / "corpus" / path.name).write_bytes(path.read_bytes())
        corpora = {"local disk": str(tmp / "s3-local"), "S3 (moto on 127.0.0.1)": f"{bucket}/corpus"}
        best: dict[str, float] = {}
        hashes, tokens = set(), 0
        with ray_instance(args.store_cpus):
            for attempt, name in enumerate([*corpora, *corpora]):  # alternating; the faster of two each
                cfg = byte_cfg(corpora[name], args.seq_len)
                manifest, seconds = timed_prepare(cfg, tmp / f"s3-{attempt}", args.store_cpus)
                hashes.add(manifest.content_sha256)
                tokens = stream_tokens(manifest)
                best[name] = min(best.get(name, seconds), seconds)
    finally:
        server.stop()
    local = tokens / best["local disk"]
    rows = [
        {"corpus read from": name, "tokens": tokens, "seconds": round(seconds, 2),
         "prepare_tok_s": round(tokens / seconds), "vs_local": round(tokens / seconds / local, 3)}
        for name, seconds in best.items()
    ]  # fmt: skip
    print(markdown_table(rows, list(rows[0])))
    if len(hashes) != 1:
        raise SystemExit("error: the corpus read from S3 gave other shards than read from the local disk")
    return {
        "cpus": args.store_cpus,
        "text_bytes": sum(path.stat().st_size for path in files),
        "results": rows,
    }


def staging(tmp: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The throughput corpus as parquet files: prepared from them, and from ray.data.read_parquet of
    them given as a Dataset source; then staging alone, timed."""
    corpus = tmp / "parquet"
    corpus.mkdir(parents=True)
    for path in write_corpus(tmp / "text", args.repeat):
        documents, _ = split_text_file(path.read_bytes())
        pq.write_table(pa.table({"text": documents}), corpus / f"{path.stem}.parquet")
    text_bytes = sum(len(path.read_bytes()) for path in (tmp / "text").iterdir())
    best: dict[str, tuple[float, Manifest]] = {}
    with ray_instance(args.store_cpus):
        for attempt, name in enumerate(["files", "Dataset source", "files", "Dataset source"]):
            from_files = name == "files"
            cfg = byte_cfg(str(corpus) if from_files else "builtin", args.seq_len)  # builtin: the default
            datasets = None if from_files else {"corpus": ray.data.read_parquet(str(corpus))}
            start = time.perf_counter()
            manifest = prepare(cfg, tmp / f"out-{attempt}", num_cpus=args.store_cpus, log=lambda _: None,
                               datasets=datasets)  # fmt: skip
            seconds = time.perf_counter() - start
            if name not in best or seconds < best[name][0]:
                best[name] = (seconds, manifest)
        staged = []
        for attempt in range(2):
            dataset = ray.data.read_parquet(str(corpus))
            source = Source("corpus", "benchmark", "text", 1.0, dataset=DatasetSpec(None, given=dataset))
            start = time.perf_counter()
            snapshot = stage(source, dataset, Location.of(tmp / f"stage-{attempt}"), lambda _: None, False)
            staged.append(time.perf_counter() - start)
    if len({manifest.content_sha256 for _, manifest in best.values()}) != 1:
        raise SystemExit(
            "error: the Dataset source gave other shards than the same documents read from files"
        )
    files_seconds, manifest = best["files"]
    tokens = stream_tokens(manifest)
    gigabytes = text_bytes / 1e9
    rows = [
        {"corpus read as": name, "seconds": round(seconds, 2), "prepare_tok_s": round(tokens / seconds),
         "vs_files": round(files_seconds / seconds, 3)}
        for name, (seconds, _) in best.items()
    ]  # fmt: skip
    print(markdown_table(rows, list(rows[0])))
    result = {
        "cpus": args.store_cpus,
        "text_bytes": text_bytes,
        "documents": snapshot.documents,
        "staged_files": len(snapshot.files),
        "staging_seconds": round(min(staged), 2),
        "staging_seconds_per_gb": round(min(staged) / gigabytes, 1),
        "files_prepare_seconds_per_gb": round(files_seconds / gigabytes, 1),
        "identical_shards": True,
        "results": rows,
    }
    print(
        f"staging: {result['staging_seconds_per_gb']} s per GB of text "
        f"(prepare from the files: {result['files_prepare_seconds_per_gb']} s per GB)"
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--repeat", type=int, default=16, help="throughput: copies of valid+test")
    parser.add_argument("--cpus", type=int, nargs="+", default=[1, 2], help="throughput: CPU settings")
    parser.add_argument("--rounds", type=int, default=2, help="throughput: runs of each, the faster kept")
    parser.add_argument("--baseline-ref", default=BASELINE_REF, help="throughput: the plain-task commit")
    parser.add_argument(
        "--no-cluster", dest="cluster", action="store_false", help="throughput: no 2-node run"
    )
    parser.add_argument("--vocab-size", type=int, default=16384)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument(
        "--store-repeat", type=int, default=40, help="bounded_store: copies (4.1x the store from 36)"
    )
    parser.add_argument("--store-cpus", type=int, default=2, help="bounded_store and s3: CPUs")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if not WIKITEXT.is_dir():
        raise SystemExit(f"error: {WIKITEXT} is absent; this benchmark needs ../shared/data")
    servers.install_s3_environment()  # before any Ray instance: its workers inherit the endpoint
    measure: dict[str, Callable[[Path, argparse.Namespace], dict[str, Any]]] = {
        "throughput": throughput,
        "bounded_store": bounded_store,
        "s3": s3,
        "staging": staging,
    }
    payload = json.loads(args.out.read_text()) if args.out.is_file() else {}
    payload = {key: payload[key] for key in SECTIONS if key in payload}  # the last results of the others
    with tempfile.TemporaryDirectory() as tmp:
        for section in args.only:  # each section's results written as soon as it ends
            start = time.perf_counter()
            payload[section] = measure[section](Path(tmp) / section, args)
            print(f"{section}: {time.perf_counter() - start:.0f} s")
            if "bounded_store" in payload:
                payload["peak_store_over_corpus"] = payload["bounded_store"]["peak_store_over_corpus"]
            write_results(args.out, {"benchmark": "prepare_throughput", **payload})


if __name__ == "__main__":
    main()
