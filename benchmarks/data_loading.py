"""Rows each training worker decodes per epoch, and the time to the first batch after a resume.

Measured for mhf-dist's reader (`mhf_dist.data.reader`: each rank reads its share of each step's rows
by index) against the replay reader it replaced, in the same run: every worker read the whole split in
stream order and kept its slice, and a resume read every batch before the resumed step again. The
replay baseline here reads the shards sequentially with pyarrow, which is cheaper than the Ray Data
iterator the old trainer used, so its ratios understate the old cost.

Data: generated associative-recall rows (no ../shared needed), prepared by `mhf prepare` into shards of
`--rows-per-shard` rows. Workers are simulated in this process one after another (a worker's reading
does not depend on the others), so W = 4 needs no 4 CPUs.

    python benchmarks/data_loading.py [--rows 32768] [--seq-len 256] [--batch 32]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq
from common import write_results

from mhf_dist.config import load_config
from mhf_dist.data.prepare import prepare
from mhf_dist.data.reader import RowReader, step_batches, training_plan
from mhf_dist.tables import markdown_table

RESULTS = Path(__file__).parent / "results" / "data_loading.json"
RESUME_STEPS = (10, 1000)
RESUME_TARGET = 1.2  # time to the first batch, resumed at step 1,000 over step 10


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32768, help="training rows")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32, help="the global batch")
    parser.add_argument("--rows-per-shard", type=int, default=1024)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.rows // args.batch <= max(RESUME_STEPS):
        raise SystemExit(
            f"error: --rows {args.rows} gives fewer than {max(RESUME_STEPS) + 1} steps per epoch"
        )

    with tempfile.TemporaryDirectory() as tmp:
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
        files = RowReader(path, "train").files
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
        },
    )


if __name__ == "__main__":
    main()
