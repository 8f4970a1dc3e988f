"""The training reader: which rows make each step's batch, each rank's share, reading only those rows."""

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
from concurrent.futures import wait
from pathlib import Path

import numpy as np
import pytest

from mhf_dist.config import load_config
from mhf_dist.data.prepare import prepare
from mhf_dist.data.reader import BatchPlan, RowReader, ShardPrefetch, step_batches, training_plan
from mhf_dist.data.shards import MANIFEST
from mhf_dist.errors import DataError
from mhf_dist.storage import Location

# Uneven shards (the last is short) and windows of 3 of the 7 shards: every level of the order is used.
SHARD_ROWS = [20, 20, 20, 20, 20, 20, 16]  # 136 rows = 17 batches of 8


def plan(shuffle=True, seed=0, batch=8):
    return BatchPlan(np.array(SHARD_ROWS), batch, seed, shuffle=shuffle, window=3)


def epoch_rows(p, epoch):
    steps = range(epoch * p.steps_per_epoch + 1, (epoch + 1) * p.steps_per_epoch + 1)
    return np.concatenate([p.global_rows(step) for step in steps])


def test_every_row_is_read_exactly_once_per_epoch_and_each_epoch_has_its_own_order():
    p = plan()
    first, second = epoch_rows(p, 0), epoch_rows(p, 1)
    assert sorted(first.tolist()) == sorted(second.tolist()) == list(range(136))
    assert not np.array_equal(first, second)
    assert not np.array_equal(first, np.arange(136))  # shuffled, and differently under another seed
    assert not np.array_equal(first, epoch_rows(plan(seed=1), 0))
    assert np.array_equal(epoch_rows(plan(shuffle=False), 3), np.arange(136))  # the prepared order
    one_shard = BatchPlan(np.array([136]), 8, 0)  # the rows themselves, not only the shard order
    assert not np.array_equal(epoch_rows(one_shard, 0), epoch_rows(one_shard, 1))


def test_a_window_mixes_rows_of_its_shards_only():
    p = plan()
    first_window = epoch_rows(p, 0)[:60]  # the first 3 shards of the epoch's shard order: 60 rows
    shards = set((first_window // 20).tolist())
    assert len(shards) == 3 and sum(SHARD_ROWS[s] for s in shards) == 60


def test_rank_shares_are_disjoint_cover_the_batch_and_do_not_depend_on_the_worker_count():
    p = plan()
    for step in (1, 17, 18, 40):
        whole = p.global_rows(step)
        for workers in (1, 2, 4, 8):
            shares = [p.rank_rows(step, rank, workers) for rank in range(workers)]
            assert all(len(share) == 8 // workers for share in shares)
            assert np.array_equal(np.concatenate(shares), whole)


def test_the_last_rows_of_an_epoch_that_fill_no_batch_wait_for_the_next():
    p = BatchPlan(np.array([10, 10]), 8, 0, window=2)  # 20 rows: 2 batches, 4 rows left per epoch
    assert p.steps_per_epoch == 2 and p.epoch_of(2) == 0 and p.epoch_of(3) == 1
    assert len(set(np.concatenate([p.global_rows(1), p.global_rows(2)]).tolist())) == 16
    with pytest.raises(DataError, match="fewer than one batch of 32; use more data or a smaller"):
        BatchPlan(np.array([10, 10]), 32, 0)


@pytest.fixture(scope="module")
def recall_shards(tmp_path_factory):
    path = tmp_path_factory.mktemp("reader") / "data"
    overrides = ["data.corpus=recall", "model.vocab_size=40", "train.seq_len=32", "data.recall.examples=136"]
    cfg = load_config(
        "tiny", [*overrides, "data.rows_per_shard=20", "train.batch_size=8", f"data.path={path}"]
    )
    prepare(cfg, path, log=lambda _: None)
    return cfg


def test_the_reader_decodes_exactly_the_rows_asked_for_in_the_order_asked(recall_shards):
    reader = RowReader(recall_shards.data.path, "train")
    everything = reader.read_range()
    assert reader.rows_decoded == 136 and everything["tokens"].shape == (136, 33)
    wanted = np.array([135, 3, 21, 20, 99, 3])
    fresh = RowReader(recall_shards.data.path, "train", signatures=False)
    got = fresh.read(wanted)
    assert np.array_equal(got["tokens"], everything["tokens"][wanted]) and "signatures" not in got
    assert fresh.rows_decoded == 5  # row 3 twice is read once
    signed = reader.read(wanted)["signatures"]
    assert np.array_equal(signed, everything["signatures"][wanted]) and signed.shape == (6, 33, 2)


def test_a_resumed_reader_starts_at_its_step_and_reads_nothing_before_it(recall_shards):
    reader = RowReader(recall_shards.data.path, "train")
    p = training_plan(reader, recall_shards)
    uninterrupted = step_batches(reader, p, 0, rank=1, world_size=2)
    first_40 = [next(uninterrupted)["tokens"] for _ in range(40)]  # more than two epochs
    uninterrupted.close()
    resumed_reader = RowReader(recall_shards.data.path, "train")
    resumed = step_batches(resumed_reader, p, 30, rank=1, world_size=2)
    for expected in first_40[30:]:
        assert np.array_equal(next(resumed)["tokens"], expected)
    resumed.close()
    # 10 steps of 4 rows, plus at most the one step read ahead: none of the 30 steps before the resume.
    assert resumed_reader.rows_decoded <= 11 * 4
    all_rows = reader.read_range()["tokens"]
    assert np.array_equal(first_40[0], all_rows[p.rank_rows(1, 1, 2)])


@pytest.fixture
def bucket_shards(recall_shards, bucket):
    """The recall shards uploaded to a fresh bucket: its location."""
    remote = Location.of(bucket) / "data"
    remote.upload(Path(recall_shards.data.path), last=MANIFEST)
    return remote


@pytest.fixture
def downloads(tmp_path, monkeypatch):
    """The directory the shard cache downloads into (TMPDIR, for this test)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def files_held(directory: Path) -> int:
    """Files on disk below `directory`, or deleted from it but still open in this process (/proc)."""
    held = set()
    on_disk = [Path(parent, name) for parent, _, names in os.walk(directory) for name in names]
    for path in [*on_disk, *Path("/proc/self/fd").iterdir()]:
        with contextlib.suppress(OSError):  # deleted or closed meanwhile
            if os.path.realpath(path).startswith(f"{os.path.realpath(directory)}/"):
                info = path.stat()
                held.add((info.st_dev, info.st_ino))
    return len(held)


def requests_to(bucket: Location, s3_server) -> int:
    """Requests the S3 server has answered for `bucket` so far (its access log has a line a request)."""
    name = bucket.path.split("/")[0]
    with open(s3_server.log.name) as log:
        return sum(f"/{name}/" in line for line in log)


def test_rows_read_from_a_bucket_through_the_cache_are_the_local_rows(
    recall_shards, bucket_shards, downloads
):
    local = RowReader(recall_shards.data.path, "train")
    remote = RowReader(bucket_shards, "train", cache_shards=4)  # fewer than the 7 shards: some dropped
    p = BatchPlan(local.shard_rows, 8, 0, window=2)
    expected, got = step_batches(local, p, 0, 1, 2), step_batches(remote, p, 0, 1, 2)
    for _ in range(40):  # more than two epochs
        want, have = next(expected), next(got)
        assert want.keys() == have.keys() and all(np.array_equal(want[k], have[k]) for k in want)
    got.close()
    wanted = np.array([135, 3, 21, 20, 99, 3])
    assert np.array_equal(remote.read(wanted)["signatures"], local.read(wanted)["signatures"])
    assert len(remote.cache.fetched) > 7  # shards were dropped and fetched again
    assert files_held(downloads) > 0
    remote.close()
    assert files_held(downloads) == 0


def test_the_cache_holds_at_most_its_bound_of_shards_on_disk_while_the_plan_walks_over_more(
    bucket_shards, downloads
):
    reader = RowReader(bucket_shards, "train", cache_shards=4)
    p = BatchPlan(reader.shard_rows, 8, 0, window=2)
    ahead = ShardPrefetch(reader, p, rank=0, world_size=2)
    on_disk = []
    for step in range(1, 41):
        wait(ahead.reading(step))  # measured between downloads: /proc's open files change under them
        reader.read(p.rank_rows(step, 0, 2))
        on_disk.append(files_held(downloads))
    assert sorted(set(reader.cache.fetched)) == list(range(7)) and max(on_disk) == 4
    reader.close()


def test_a_killed_reader_leaves_no_shard_on_disk(bucket_shards, tmp_path):
    """A copy's name is deleted once it is open: a worker killed (SIGKILL, as Ray kills actors) frees it."""
    script = (
        "import os, signal; from mhf_dist.data.reader import RowReader; "
        f"reader = RowReader({bucket_shards.uri!r}, 'train'); reader.read_range(); "
        "print(len(reader.cache.fetched), flush=True); "
        "os.kill(os.getpid(), signal.SIGKILL)"
    )
    environment = {**os.environ, "TMPDIR": str(tmp_path)}
    killed = subprocess.run(
        [sys.executable, "-c", script], env=environment, capture_output=True, text=True, timeout=120
    )
    assert killed.returncode == -signal.SIGKILL and killed.stdout.split() == ["7"]  # all 7 on disk
    assert list(tmp_path.iterdir()) == []


def test_shards_are_fetched_ahead_so_reading_the_next_step_makes_no_request(bucket_shards, s3_server):
    reader = RowReader(bucket_shards, "train", cache_shards=4)
    p = BatchPlan(reader.shard_rows, 8, 0, window=2)  # 5 steps a window: 8 window boundaries in 40 steps
    ahead = ShardPrefetch(reader, p, rank=0, world_size=1)
    for step in range(1, 41):
        wait(ahead.reading(step))
        before, fetched = requests_to(bucket_shards, s3_server), len(reader.cache.fetched)
        reader.read(p.rank_rows(step, 0, 1))
        reader.read(p.rank_rows(step + 1, 0, 1))  # fetched ahead, across a window boundary too
        assert requests_to(bucket_shards, s3_server) == before and len(reader.cache.fetched) == fetched
    reader.close()


def test_a_reader_resumed_from_a_bucket_fetches_nothing_for_the_steps_before_its_resume_point(
    recall_shards, bucket_shards
):
    reader = RowReader(bucket_shards, "train", cache_shards=3)
    p = BatchPlan(reader.shard_rows, 8, 0, shuffle=False)  # stream order: step 11 reads rows 80..87
    resumed = step_batches(reader, p, 10, 0, 1)
    expected = RowReader(recall_shards.data.path, "train").read_range(80, 88)["tokens"]
    assert np.array_equal(next(resumed)["tokens"], expected)
    resumed.close()
    # Steps 11..17 (the end of the epoch) read shards 4..6 (rows 80..135); steps 1..10 read shards 0..3.
    assert 4 in reader.cache.fetched and set(reader.cache.fetched) <= {4, 5, 6}
    reader.close()


def test_a_shard_missing_from_the_bucket_is_a_one_line_error_naming_it(bucket_shards):
    (bucket_shards / "train-00002.parquet").remove()
    reader = RowReader(bucket_shards, "train")
    batches = step_batches(reader, BatchPlan(reader.shard_rows, 8, 0, window=2), 0, 0, 1)
    with pytest.raises(DataError, match=r"^shard s3://.*/data/train-00002\.parquet is missing; re-run"):
        for _ in range(17):
            next(batches)
    reader.close()


def test_data_in_a_bucket_that_does_not_exist_names_the_bucket(s3_server):
    from mhf_dist.storage import StorageError

    with pytest.raises(StorageError, match=r"^the bucket of 's3://no-such-bucket-here/data' does not exist"):
        RowReader("s3://no-such-bucket-here/data", "train")
