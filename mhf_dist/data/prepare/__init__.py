"""`mhf prepare`: corpus -> tokenize -> pack -> signatures -> parquet shards + manifest, on Ray Data.

The driver plans, Ray Data executes (`execute.run_units`), and every file has a name fixed by the plan:
1. Sources (`mixture.sources`): files, or a `ray.data.Dataset`, first staged once into numbered parquet
   files in the work area (`staging.py`) and a file source from then on.
2. Parts (`plan.plan_parts`): each source's files cut by a fixed rule of their sizes; Ray Data tasks
   tokenize each part into `progress/parts/NNNNN.arrow`, then write its record (`tokenize.py`).
3. Shards (`plan.select`, `plan.shard_jobs`): from the parts' counts the driver knows which documents a
   keyed source gives and where every shard's rows start in each split's token stream; Ray Data tasks
   pack, sign and write each shard from the record batches its job names (`shard.py`).
4. Publishing (`output.py`): the manifest (`manifest.py`) last.
Ray's object store holds the units and their small records, never the tokenized corpus. A shard's rows
depend only on the token stream, so the same inputs give byte-identical shards on any cluster. On a
multi-node cluster the output must be storage every node can reach (a bucket, or a shared path).

**Resuming** (`records.py`): `progress/key.json` records what decides the shards; each unit writes its
record after its file. A rerun with the same key skips every part and shard whose record and file check
out and does the rest; with another key it starts over (keeping complete staged snapshots).
"""

from mhf_dist.data.prepare.manifest import recorded_data
from mhf_dist.data.prepare.output import WRITTEN_HERE
from mhf_dist.data.prepare.pipeline import prepare, prepare_if_missing
from mhf_dist.data.prepare.plan import plan_parts
from mhf_dist.data.prepare.vocabulary import signature_table

__all__ = ["WRITTEN_HERE", "plan_parts", "prepare", "prepare_if_missing", "recorded_data", "signature_table"]
