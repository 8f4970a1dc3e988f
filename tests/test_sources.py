"""`data.sources`: a weighted mixture of corpora (`mhf_dist.data.mixture`), deterministic by seed, with
each row's tokens per source in the shards; the same shards from a bucket as from the local disk.

The two sources use disjoint bytes (web: lowercase and spaces, `.jsonl.gz`; code: uppercase and
underscores, parquet with its own text column), so what each row holds from each source is measured in
the rows themselves, not taken from the manifest. Weights 3:1 with web the smaller by its weight: web
runs out first and is used whole, code is cut at the document closest to a third of web's tokens.
"""

import gzip
import json
import random

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mhf_dist.config import load_config
from mhf_dist.data.prepare import prepare
from mhf_dist.data.shards import is_validation
from mhf_dist.errors import ConfigError
from mhf_dist.storage import Location

VAL_PERCENT = 10
SEQ_LEN = 64
EOS = 257  # the byte vocabulary's <eos>
LOWER = [*range(ord("a"), ord("z") + 1), ord(" ")]
UPPER = [*range(ord("A"), ord("Z") + 1), ord("_")]


def documents(alphabet, separator, count, seed):
    rng = random.Random(seed)
    return [
        separator.join(
            "".join(rng.choices(alphabet, k=rng.randint(2, 9))) for _ in range(rng.randint(20, 60))
        )
        for _ in range(count)
    ]


WEB = documents("abcdefghijklmnopqrstuvwxyz", " ", 200, 0)
CODE = documents("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "_", 150, 1)


def write_corpora(root: Location) -> None:
    (root / "web.jsonl.gz").write_bytes(
        gzip.compress("".join(json.dumps({"text": d}) + "\n" for d in WEB).encode())
    )
    sink = pa.BufferOutputStream()
    pq.write_table(pa.table({"content": CODE}), sink, compression="zstd", row_group_size=40)
    (root / "code.parquet").write_bytes(sink.getvalue().to_pybytes())


def mixture_cfg(root: str, out: str, *extra: str):
    sources = [
        {"name": "web", "corpus": f"{root}/web.jsonl.gz", "weight": 3},
        {"name": "code", "corpus": f"{root}/code.parquet", "weight": 1, "text_field": "content"},
    ]
    return load_config(
        "tiny",
        [
            f"data.sources={json.dumps(sources)}",
            "data.tokenizer=bytes",
            "model.vocab_size=259",
            "model.hash.spec=H2B64",
            f"train.seq_len={SEQ_LEN}",
            "data.rows_per_shard=64",
            f"data.val_percent={VAL_PERCENT}",
            f"data.path={out}",
            *extra,
        ],
    )


@pytest.fixture(scope="module")
def local_mixture(ray_session, tmp_path_factory):
    root = tmp_path_factory.mktemp("sources")
    write_corpora(Location.of(root))
    cfg = mixture_cfg(str(root), str(root / "out"))
    lines = []
    manifest = prepare(cfg, cfg.data.path, num_cpus=2, log=lines.append)
    return root, cfg, manifest, lines


def rows(directory, split):
    """Every row's token ids and source_tokens, in order."""
    table = pa.concat_tables(pq.read_table(path) for path in sorted(directory.glob(f"{split}-*.parquet")))
    return np.array(table["input_ids"].to_pylist()), np.array(table["source_tokens"].to_pylist())


def train_documents(docs):
    return [doc for doc in docs if not is_validation(doc, VAL_PERCENT)]


def test_the_training_tokens_follow_the_weights_and_the_source_that_runs_out_first_sets_the_total(
    local_mixture,
):
    _, _, manifest, lines = local_mixture
    web, code = manifest.sources
    assert (web.name, code.name, web.weight, code.weight) == ("web", "code", 0.75, 0.25)
    assert web.documents == len(train_documents(WEB))  # ran out first: used whole
    assert 0 < code.documents < len(train_documents(CODE))
    longest_code = max(len(doc) + 1 for doc in CODE)  # bytes and the EOS
    assert abs(code.tokens - web.tokens / 3) <= longest_code / 2  # the cut closest to its share
    assert (web.share, code.share) == pytest.approx((0.75, 0.25), abs=0.01)
    assert web.share + code.share == pytest.approx(1.0)
    train = manifest.splits["train"]
    assert web.tokens + code.tokens == train.target_tokens + train.dropped_tokens + 1  # all in the stream
    assert web.documents + code.documents == train.documents
    assert (web.validation_documents, code.validation_documents) == (
        sum(is_validation(doc, VAL_PERCENT) for doc in WEB),
        sum(is_validation(doc, VAL_PERCENT) for doc in CODE),
    )
    assert any(line.startswith("mixture of the training tokens (seed 0; no upsampling: web ran out first")
               for line in lines)  # fmt: skip


@pytest.mark.parametrize("split", ["train", "validation"])
def test_each_rows_source_tokens_are_what_the_row_holds_from_each_source(local_mixture, split):
    ids, per_source = rows(local_mixture[0] / "out", split)
    assert per_source.shape == (len(ids), 2) and per_source.dtype.kind == "i"
    assert (per_source.sum(axis=1) == SEQ_LEN + 1).all()
    lower, upper, eos = (np.isin(ids, LOWER).sum(1), np.isin(ids, UPPER).sum(1), (ids == EOS).sum(1))
    assert (lower <= per_source[:, 0]).all() and (per_source[:, 0] <= lower + eos).all()
    assert (upper <= per_source[:, 1]).all() and (per_source[:, 1] <= upper + eos).all()
    assert (per_source[:, 0] > 0).any() and (per_source[:, 1] > 0).any()  # both sources in each split
    if split == "train":  # measured in the rows themselves
        assert upper.sum() / (upper.sum() + lower.sum()) == pytest.approx(0.25, abs=0.015)


def test_a_bucket_gives_the_same_shards_for_the_same_seed_and_others_for_another(local_mixture, bucket):
    root, _, manifest, _ = local_mixture
    write_corpora(Location.of(f"{bucket}/corpora"))
    remote_cfg = mixture_cfg(f"{bucket}/corpora", f"{bucket}/out")
    remote = prepare(remote_cfg, remote_cfg.data.path, log=lambda _: None)
    assert remote.content_sha256 == manifest.content_sha256
    for split, info in manifest.splits.items():
        for shard, stored in zip(
            info.shards, remote.splits[split].shards, strict=True
        ):  # (its version folder)
            assert (
                Location.of(f"{bucket}/out/{stored.file}").read_bytes()
                == (root / "out" / shard.file).read_bytes()
            )
    corpora = [f"{bucket}/corpora/web.jsonl.gz", f"{bucket}/corpora/code.parquet"]
    assert [source.corpus for source in remote.sources] == corpora
    other_cfg = mixture_cfg(str(root), str(root / "seed-1"), "data.mixture_seed=1")
    other = prepare(other_cfg, other_cfg.data.path, log=lambda _: None)
    assert other.content_sha256 != manifest.content_sha256  # other code documents chosen
    assert other.sources[0].tokens == manifest.sources[0].tokens  # web is whole under any seed
    assert other.sources[1].share == pytest.approx(0.25, abs=0.01)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["data.corpus=x.txt"], r"corpus='x\.txt' and sources name the text twice; drop data\.corpus"),
        (
            ["data.replay.corpus=y.txt", "data.replay.fraction=0.2"],
            "add the replayed corpus as one more source",
        ),
    ],
)
def test_sources_with_a_corpus_or_a_replay_are_refused(overrides, message):
    sources = json.dumps(
        [{"name": "a", "corpus": "a.txt", "weight": 1}, {"name": "b", "corpus": "b.txt", "weight": 2}]
    )
    with pytest.raises(ConfigError, match=message):
        load_config("tiny", [f"data.sources={sources}", *overrides])


def test_sources_need_distinct_names_and_positive_weights():
    twice = json.dumps(
        [{"name": "a", "corpus": "a.txt", "weight": 1}, {"name": "a", "corpus": "b.txt", "weight": 1}]
    )
    with pytest.raises(ConfigError, match=r"sources have repeated names \(a, a\)"):
        load_config("tiny", [f"data.sources={twice}"])
    with pytest.raises(ConfigError, match="weight"):
        load_config("tiny", ["data.sources=" + json.dumps([{"name": "a", "corpus": "a.txt", "weight": 0}])])
