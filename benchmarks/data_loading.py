"""Rows each training worker decodes per epoch, the time to the first batch after a resume, and the
time a step waits for its data read from an S3 server against the local disk.

Measured for mhf-dist's reader (`mhf_dist.data.reader`: each rank reads its share of each step's rows
by index) against the replay reader it replaced, in the same run: every worker read the whole split in
stream order and kept its slice, and a resume read every batch before the resumed step again. The
replay baseline here reads the shards sequentially with pyarrow, which is cheaper than the Ray Data
iterator the old trainer used, so its ratios understate the old cost.

Data: generated associative-recall rows (no ../shared needed), prepared by `mhf prepare` into shards of
`--rows-per-shard` rows. Workers are simulated in this process one after another (a worker's reading
does not depend on the others), so W = 4 needs no 4 CPUs.

Data wait (issue 29, 8a): the shards of a synthetic corpus prepared at the 100m preset's seq_len (1024),
hash spec (H4B16K) and vocabulary (32,768; a BPE trained on the corpus: the preset's Mistral tokenizer is
a download), read by `RowReader` + `step_batches` (the trainer's read-ahead thread) from the local disk
and from an S3 server (moto on 127.0.0.1, `tests/servers.py`), in the same run. Rank 0 of the preset's
8 GPUs is measured, at its batch: 512 rows a step, 64 of them this rank's. From the bucket the reader
downloads whole shards into its cache (2 shuffle windows) and `step_batches` fetches the coming steps'
shards ahead; a rank downloads about every shard once an epoch, so its bytes per step are the global
batch's (512 rows), whatever the shard size. `data.rows_per_shard` 128 (1.2 MB shards) and a corpus
of more shards than the cache holds make shards turn over as in a full corpus, only more often: a
window lasts 16 steps here, 256 with 2,048-row shards. The step itself is a sleep of `--step-s`, by
default the analytic 100m step on 8 H100/H200 at `mhf plan`'s 40% MFU (a CPU step of that shape takes
minutes, and a GPU step leaves the CPU to the reader as a sleep does). `data_wait_s` is the mean time a
step waited for its batch after the first; its share is data_wait_s / (step_s + data_wait_s).
`requests_per_step` counts the S3 server's requests (its access log) over the steps read.

    python benchmarks/data_loading.py [--rows 32768] [--seq-len 256] [--batch 32] [--wait-steps 120]
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import ray
from common import write_results

from mhf_dist.config import Config, load_config
from mhf_dist.data.prepare import prepare
from mhf_dist.data.reader import RowReader, step_batches, training_plan
from mhf_dist.data.shard_cache import ShardCache
from mhf_dist.data.shards import MANIFEST
from mhf_dist.models.registry import resolved_config, train_flops_per_token
from mhf_dist.plan import Cluster
from mhf_dist.storage import Location
from mhf_dist.tables import markdown_table

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
import servers

RESULTS = Path(__file__).parent / "results" / "data_loading.json"
RESUME_STEPS = (10, 1000)
RESUME_TARGET = 1.2  # time to the first batch, resumed at step 1,000 over step 10
WAIT_PRESET, WAIT_GPUS, WAIT_MFU = "100m", 8, 0.4  # the preset's 8 GPUs; `mhf plan`'s default MFU
WAIT_TARGET = 0.05  # data_wait_s over the step time, with read-ahead


def epoch_read(cfg, world_size: int) -> dict[str, float]:
    """Every rank's reading of one epoch: rows decoded and seconds, the worst rank (read in this thread,
    without the trainer's read-ahead, which would also read the first batch of the next epoch)."""
    decoded, seconds = [], []
    for rank in range(world_size):
        reader = RowReader(cfg.data.path, "train")
        plan = training_plan(reader, cfg)
        start = time.perf_counter()
        for step in range(1, plan.steps_per_epoch + 1):
            reader.read(plan.rank_rows(step, rank, world_size))
        seconds.append(time.perf_counter() - start)
        decoded.append(reader.rows_decoded)
    return {"rows_decoded": max(decoded), "seconds": max(seconds)}


def replay_epoch(files: list[str]) -> dict[str, float]:
    """The replay reader's epoch on any one worker: the whole split, decoded in order."""
    start, rows = time.perf_counter(), 0
    for file in files:
        for batch in pq.ParquetFile(file).iter_batches(batch_size=1024):
            rows += batch.num_rows
    return {"rows_decoded": rows, "seconds": time.perf_counter() - start}


def first_batch_after_resume(cfg, step: int) -> float:
    """Seconds from opening the data to holding the batch of step + 1, as a resumed worker does."""
    start = time.perf_counter()
    reader = RowReader(cfg.data.path, "train")
    batches = step_batches(reader, training_plan(reader, cfg), step, 0, 2)
    next(batches)
    seconds = time.perf_counter() - start
    batches.close()
    return seconds


def replay_first_batch(files: list[str], step: int, batch: int) -> float:
    """The replay reader's resume: read step x batch rows to skip them, then the next batch."""
    start, wanted = time.perf_counter(), (step + 1) * batch
    for file in files:
        for part in pq.ParquetFile(file).iter_batches(batch_size=batch):
            wanted -= part.num_rows
            if wanted <= 0:
                return time.perf_counter() - start
    raise SystemExit(f"error: the split has fewer than {(step + 1) * batch} rows; pass more --rows")


def best_of(runs: int, measure) -> float:
    return min(measure() for _ in range(runs))


def synthetic_corpus(path: Path, words: int, seed: int = 0) -> None:
    """Documents of 400 words drawn Zipf-like (s = 1.05) from 60,000 random lowercase words: text whose
    learned BPE has a full 32,768-token vocabulary and whose rows compress as text's do."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    lexicon = np.array(["".join(rng.choice(letters, size=n)) for n in rng.integers(2, 10, size=60_000)])
    weights = np.arange(1, len(lexicon) + 1) ** -1.05
    drawn = lexicon[rng.choice(len(lexicon), size=words, p=weights / weights.sum())]
    with open(path, "w", encoding="utf-8") as out:
        for start in range(0, words, 400):
            out.write(" ".join(drawn[start : start + 400]) + "\n\n")


def preset_step_s(cfg: Config, gpus: int, mfu: float) -> float:
    """One optimizer step of `cfg` (its global batch) on `gpus` H100/H200s at `mfu`, from the FLOPs
    `mhf plan` counts."""
    flops = (
        cfg.train.batch_size
        * cfg.train.seq_len
        * train_flops_per_token(resolved_config(cfg.model), cfg.train.seq_len)
    )
    return flops / (mfu * Cluster.peak_tflops * 1e12 * gpus)


def step_waits(path: str | Location, cfg: Config, steps: int, step_s: float, read_ahead: bool) -> np.ndarray:
    """Seconds each of steps + 1 steps of rank 0 of WAIT_GPUS waited for its batch (the first has
    nothing to overlap with); each step sleeps `step_s`."""
    reader = RowReader(path, "train", cache_shards=2 * cfg.data.shuffle_window)
    plan = training_plan(reader, cfg)
    if read_ahead:
        batches = step_batches(reader, plan, 0, 0, WAIT_GPUS)
    else:
        batches = (reader.read(plan.rank_rows(step, 0, WAIT_GPUS)) for step in itertools.count(1))
    waits = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        next(batches)
        waits.append(time.perf_counter() - start)
        time.sleep(step_s)
    batches.close()
    reader.close()
    return np.array(waits)


def requests_to(server: servers.S3Server, bucket: str) -> int:
    """Requests the S3 server has answered for `bucket` so far (a line each in its access log)."""
    with open(server.log.name) as log:
        return sum(f"/{bucket}/" in line for line in log)


def data_wait(args: argparse.Namespace, tmp: Path) -> dict:
    """The data wait per step reading from the S3 server and from the local disk, with and without
    read-ahead, in one run."""
    preset = load_config(WAIT_PRESET)
    step_s = args.step_s or preset_step_s(preset, WAIT_GPUS, WAIT_MFU)
    local = tmp / "wait-data"
    synthetic_corpus(tmp / "corpus.txt", args.wait_words)
    settings = [f"data.corpus={tmp / 'corpus.txt'}", "data.tokenizer=bpe", "data.val_percent=1",
                f"data.rows_per_shard={args.wait_rows_per_shard}", f"data.path={local}"]  # fmt: skip
    cfg = load_config(WAIT_PRESET, settings)
    prepare(cfg, local, log=lambda _: None)
    ray.shutdown()  # prepare's Ray instance: not beside the readers
    reader = RowReader(local, "train")
    if len(reader.shards) <= 2 * cfg.data.shuffle_window:
        raise SystemExit(
            f"error: --wait-words {args.wait_words} gives {len(reader.shards)} shards, no more than the "
            f"reader's cache holds ({2 * cfg.data.shuffle_window}); pass more words"
        )
    servers.install_s3_environment()
    server = servers.S3Server(tmp / "moto.log")
    try:
        bucket = "data-loading"
        remote = Location.of(server.make_bucket(bucket)) / "data"
        remote.upload(local, last=MANIFEST)
        load = os.getloadavg()[0]
        waits, requests = {}, {}
        for storage, where in (("local", local), ("s3", remote.uri)):
            for ahead in (True, False):
                before = requests_to(server, bucket)
                waits[storage, ahead] = step_waits(where, cfg, args.wait_steps, step_s, ahead)
                requests[storage, ahead] = (requests_to(server, bucket) - before) / (args.wait_steps + 1)
        shard_s = best_of(5, lambda: shard_download_s(remote, reader))
    finally:
        server.stop()
    mean = {key: float(measured[1:].mean()) for key, measured in waits.items()}

    def share(wait: float) -> float:
        return round(wait / (step_s + wait), 4)

    rows = []
    for (storage, ahead), measured in waits.items():
        wait = mean[storage, ahead]
        rows.append(
            {
                "storage": storage,
                "read_ahead": ahead,
                "data_wait_s": round(wait, 5),
                "share_of_step": share(wait),
                "over_local": round(wait / mean["local", ahead], 2),
                "p95_s": round(float(np.percentile(measured[1:], 95)), 5),
                "max_s": round(float(measured[1:].max()), 5),
                "first_batch_s": round(float(measured[0]), 4),
                "requests_per_step": round(requests[storage, ahead], 2),
            }
        )
    shard_bytes = reader.files[0].size()
    return {
        "preset": WAIT_PRESET,
        "seq_len": cfg.train.seq_len,
        "hash": cfg.model.hash.spec,
        "vocab_size": cfg.model.vocab_size,
        "global_batch": cfg.train.batch_size,
        "rows_per_step": cfg.train.batch_size // WAIT_GPUS,
        "rank": f"0 of {WAIT_GPUS}",
        "rows_per_shard": args.wait_rows_per_shard,
        "shards": len(reader.shards),
        "shuffle_window": cfg.data.shuffle_window,
        "cache_shards": 2 * cfg.data.shuffle_window,
        "steps": args.wait_steps,
        "step_s": round(step_s, 4),
        "step": "--step-s" if args.step_s else f"analytic: {WAIT_GPUS} GPUs at {WAIT_MFU:.0%} MFU, slept",
        "goal": WAIT_TARGET,
        "s3_share_with_read_ahead": share(mean["s3", True]),
        "load_average": [round(load, 1), round(os.getloadavg()[0], 1)],  # 1-minute, before and after
        "shard_bytes": int(shard_bytes),
        "row_bytes": int(shard_bytes // reader.shards[0].rows),
        "s3_shard_download_s": round(shard_s, 4),
        "results": rows,
    }


def shard_download_s(remote: Location, reader: RowReader) -> float:
    """Seconds to download and check the first shard, as the reader's cache does."""
    cache = ShardCache(remote, reader.shards, capacity=1)
    start = time.perf_counter()
    cache.local(0)
    seconds = time.perf_counter() - start
    cache.close()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32768, help="training rows")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32, help="the global batch")
    parser.add_argument("--rows-per-shard", type=int, default=1024)
    parser.add_argument("--wait-steps", type=int, default=120, help="data wait: steps measured per reader")
    parser.add_argument("--wait-words", type=int, default=24_000_000, help="data wait: words of the corpus")
    parser.add_argument("--wait-rows-per-shard", type=int, default=128)
    parser.add_argument("--step-s", type=float, help="data wait: the step time (default: the analytic one)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.rows // args.batch <= max(RESUME_STEPS):
        raise SystemExit(
            f"error: --rows {args.rows} gives fewer than {max(RESUME_STEPS) + 1} steps per epoch"
        )

    with tempfile.TemporaryDirectory() as tmp:
        waiting = data_wait(args, Path(tmp))
        path = Path(tmp) / "data"
        cfg = load_config(
            "tiny",
            [
                "data.corpus=recall",
                f"data.recall.examples={args.rows}",
                "model.vocab_size=4096",
                "model.hash.spec=H2B4K",
                f"train.seq_len={args.seq_len}",
                f"train.batch_size={args.batch}",
                f"data.rows_per_shard={args.rows_per_shard}",
                f"data.path={path}",
            ],
        )
        prepare(cfg, path, log=lambda _: None)
        files = [shard.path for shard in RowReader(path, "train").files]  # local: plain paths
        replay = replay_epoch(files)
        epoch_rows = []
        for workers in (1, 2, 4):
            measured = epoch_read(cfg, workers)
            epoch_rows.append(
                {
                    "workers": workers,
                    "rows_decoded_per_worker": measured["rows_decoded"],
                    "share_of_split": round(measured["rows_decoded"] / args.rows, 4),
                    "goal_share": round(1 / workers, 4),
                    "replay_rows_per_worker": replay["rows_decoded"],
                    "epoch_s_per_worker": round(measured["seconds"], 3),
                    "replay_epoch_s": round(replay["seconds"], 3),
                }
            )
        resume = {
            step: {
                "reader_s": best_of(5, lambda step=step: first_batch_after_resume(cfg, step)),
                "replay_s": best_of(5, lambda step=step: replay_first_batch(files, step, args.batch)),
            }
            for step in RESUME_STEPS
        }
    early, late = RESUME_STEPS
    resume_row = {
        "resume_at": f"step {late} / step {early}",
        "reader_ratio": round(resume[late]["reader_s"] / resume[early]["reader_s"], 3),
        "replay_ratio": round(resume[late]["replay_s"] / resume[early]["replay_s"], 3),
        "goal": RESUME_TARGET,
        **{f"reader_s_at_{step}": round(resume[step]["reader_s"], 4) for step in RESUME_STEPS},
        **{f"replay_s_at_{step}": round(resume[step]["replay_s"], 4) for step in RESUME_STEPS},
    }
    print(markdown_table(epoch_rows, list(epoch_rows[0])))
    print()
    print(markdown_table([resume_row], list(resume_row)))
    print()
    print(f"data wait per step, step {waiting['step_s']} s ({waiting['step']}):")
    print(markdown_table(waiting["results"], list(waiting["results"][0])))
    write_results(
        args.out,
        {
            "benchmark": "data_loading",
            "rows": args.rows,
            "seq_len": args.seq_len,
            "batch": args.batch,
            "rows_per_shard": args.rows_per_shard,
            "epoch": epoch_rows,
            "resume": resume_row,
            "data_wait": waiting,
        },
    )


if __name__ == "__main__":
    main()
