"""`mhf prepare`: corpus -> tokenize -> pack -> signatures -> parquet shards + manifest, on Ray Data.

The driver plans, Ray Data executes (`execute.run_units`), and every file has a name fixed by the plan:
1. Sources (`mixture.sources`): files, or a `ray.data.Dataset`, which is first staged once into numbered
   parquet files in the work area (`staging.py`) and is a file source from then on.
2. Parts (`plan.plan_parts`): each source's files cut by a fixed rule of their sizes (consecutive small
   files up to `PART_BYTES`, a large parquet file by ranges of row groups). Ray Data tasks, one a CPU,
   tokenize each part into `progress/parts/NNNNN.arrow`, then write its record (`tokenize.py`).
3. Shards (`plan.select`, `plan.shard_jobs`): from the parts' counts the driver knows which documents a
   keyed source gives and where every shard's rows start in each split's token stream; Ray Data tasks
   pack, sign and write each shard from the record batches its job names (`shard.py`).
4. Publishing (`output.py`): the manifest (`manifest.py`) last; a local output renamed into place.
Ray's object store holds the units and their small records, never the tokenized corpus (staging a
Dataset streams its blocks through it, as Ray Data does, bounded by Ray Data). A shard's rows depend
only on the token stream, so the same inputs give byte-identical shards on any cluster. On a multi-node
cluster the output must be storage every node can reach (a bucket, or a shared path).

**Resuming** (`records.py`): `progress/key.json` records the inputs and the settings that decide the
shards; each unit writes its record after its file. A rerun with the same key skips every part and shard
whose record and file check out (a shard by its sha256) and does the rest; with another key it starts
over (a complete staged snapshot is kept: it is checked by its own record).
"""

from mhf_dist.data.prepare.manifest import recorded_data
from mhf_dist.data.prepare.output import WRITTEN_HERE
from mhf_dist.data.prepare.pipeline import prepare, prepare_if_missing
from mhf_dist.data.prepare.plan import plan_parts
from mhf_dist.data.prepare.vocabulary import signature_table

__all__ = [
    "WRITTEN_HERE",
    "plan_parts",
    "prepare",
    "prepare_if_missing",
    "recorded_data",
    "signature_table",
]
