"""The training reader: which rows make each step's batch, each rank's share, reading only those rows."""

import numpy as np
import pytest

from mhf_dist.config import load_config
from mhf_dist.data.prepare import prepare
from mhf_dist.data.reader import BatchPlan, RowReader, step_batches, training_plan
from mhf_dist.errors import DataError

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
