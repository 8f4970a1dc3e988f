"""The second phase's unit of work: one shard's rows packed from the record batches of the tokenized
parts its job names, their signatures looked up, the parquet file written to the work area and its
record beside it. `WriteShards` is what each Ray Data task calls; its signature table reaches the task
from Ray's object store without a copy (numpy arrays)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import pyarrow.compute as pc
import pyarrow.ipc as ipc

from mhf_dist.data.packing import Packing, pack_rows
from mhf_dist.data.prepare.execute import Done, UnitWork
from mhf_dist.data.prepare.records import PROGRESS, SHARDS, ShardJob, ShardRecord, read_record, write_record
from mhf_dist.data.prepare.tokenize import part_file
from mhf_dist.data.shards import SPLITS, ShardEntry, file_sha256, write_shard
from mhf_dist.signatures import SignatureTable
from mhf_dist.storage import Location, storage_errors


@dataclass
class WriteShards(UnitWork[ShardJob, ShardEntry]):
    """A shard job in, the shard's manifest entry out: a keyed source's training documents below its
    threshold in `limits`; with more than one source (`sources`), each row's tokens per source too."""

    table: SignatureTable
    seq_len: int
    packing: Packing
    limits: list[int | None]
    sources: int
    work: Location

    unit, output, outputs = ShardJob, ShardEntry, "shards"

    def run(self, job: ShardJob) -> Done[ShardEntry]:
        """The shard's entry (from an earlier run when its record and file check out)."""
        record_file = self.work / PROGRESS / SHARDS / f"{job.name}.json"
        done = read_record(record_file, ShardRecord)
        shard = self.work / job.name
        if (  # the whole file is read only once the cheaper checks pass
            done is not None
            and done.fingerprint == self.table.fingerprint
            and shard.is_file()
            and file_sha256(shard) == done.entry.sha256
        ):
            return Done(done.entry, done.entry.rows * self.seq_len, resumed=True)
        code = SPLITS.index(job.split)
        streams, labels = [], []
        for part, pieces in itertools.groupby(job.pieces, key=lambda piece: piece.part):
            path = part_file(self.work, part)
            with storage_errors(path), path.fs.open_input_file(path.path) as handle:
                reader = ipc.open_file(handle)
                for piece in pieces:
                    batch = reader.get_batch(piece.batch)
                    chosen = pc.equal(batch.column("split"), code)
                    limit = self.limits[piece.source]
                    if job.split == "train" and limit is not None:
                        chosen = pc.and_(chosen, pc.less(batch.column("key"), limit))
                    ids = batch.filter(chosen).column("ids").flatten().to_numpy()[piece.first : piece.end]
                    streams.append(ids)
                    labels.append(np.full(len(ids), piece.source, np.int8))
        rows = pack_rows(np.concatenate(streams), self.seq_len, self.packing)
        per_source = None
        if self.sources > 1:  # [rows, sources]: each row's tokens from each source
            label_rows = pack_rows(np.concatenate(labels), self.seq_len, self.packing)
            per_source = np.stack([(label_rows == source).sum(axis=1) for source in range(self.sources)], 1)
        entry = write_shard(rows, self.table, self.work, job.name, per_source)
        write_record(record_file, ShardRecord(entry=entry, fingerprint=self.table.fingerprint))
        return Done(entry, entry.rows * self.seq_len, resumed=False)
