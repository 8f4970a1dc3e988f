"""`data.replay`: a replayed share of a second corpus in the training split (`mhf_dist.data.mixture`).

The two corpora use disjoint bytes (data.corpus: lowercase and spaces, the replay: uppercase and
underscores), so the share of replayed tokens is measured in the prepared shards themselves, not taken
from the manifest. Tolerance: documents are taken whole, in key order, and the cut is the one closest
to the asked share, so the realised share misses it by at most half the longest replayed document's
tokens over the training tokens (here under 0.5%); measured in the shards, where boundary tokens are
not told apart, the test allows 1.5%.
"""

import json
import random

import numpy as np
import pytest

from mhf_dist.config import load_config
from mhf_dist.data.prepare import prepare
from mhf_dist.data.reader import RowReader
from mhf_dist.data.shards import is_validation
from mhf_dist.errors import ConfigError

VAL_PERCENT = 10


def documents(alphabet, count, seed):
    rng = random.Random(seed)
    return [
        " ".join("".join(rng.choices(alphabet, k=rng.randint(2, 9))) for _ in range(rng.randint(20, 60)))
        for _ in range(count)
    ]


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    directory = tmp_path_factory.mktemp("replay")
    main = documents("abcdefghijklmnopqrstuvwxyz", 150, 0)
    replay = [doc.replace(" ", "_") for doc in documents("ABCDEFGHIJKLMNOPQRSTUVWXYZ", 400, 1)]
    (directory / "new.txt").write_text("\n\n".join(main))
    (directory / "parent.jsonl").write_text("".join(json.dumps({"text": doc}) + "\n" for doc in replay))
    return directory, main, replay


def prepared(ray_session, corpora, name, *overrides):
    directory = corpora[0]
    cfg = load_config(
        "tiny",
        [
            f"data.corpus={directory / 'new.txt'}",
            "data.tokenizer=bytes",
            "model.vocab_size=259",
            "model.hash.spec=H2B64",
            "train.seq_len=64",
            "data.rows_per_shard=64",
            f"data.val_percent={VAL_PERCENT}",
            f"data.path={directory / name}",
            *overrides,
        ],
    )
    manifest = prepare(cfg, cfg.data.path, num_cpus=2, log=lambda line: None)
    return cfg, manifest


def byte_counts(path, split):
    ids = RowReader(path, split, signatures=False).read_range(0, None)["tokens"][:, 1:].ravel()
    upper = np.isin(ids, [*range(ord("A"), ord("Z") + 1), ord("_")]).sum()
    lower = np.isin(ids, [*range(ord("a"), ord("z") + 1), ord(" ")]).sum()
    return int(upper), int(lower)


def test_the_training_split_holds_the_asked_share_of_replayed_tokens_deterministically(ray_session, corpora):
    replay = f"data.replay.corpus={corpora[0] / 'parent.jsonl'}"
    cfg, manifest = prepared(ray_session, corpora, "a", replay, "data.replay.fraction=0.25")
    upper, lower = byte_counts(cfg.data.path, "train")
    assert upper / (upper + lower) == pytest.approx(0.25, abs=0.015)  # measured in the shards
    mixture = manifest.splits["train"].mixture
    assert mixture.realised_fraction == pytest.approx(0.25, abs=0.015)
    main_record, replay_record = mixture.sources
    half_document = max(len(doc) + 1 for doc in corpora[2]) / 2
    assert abs(mixture.realised_fraction - 0.25) <= half_document / (
        main_record.tokens + replay_record.tokens
    )
    assert (
        replay_record.tokens + main_record.tokens
        == sum(getattr(manifest.splits["train"], key) for key in ("target_tokens", "dropped_tokens")) + 1
    )  # the stream's first token is no target
    corpus, replayed = manifest.sources  # the same counts, as the mixture's two sources
    assert (corpus.name, replayed.name, replayed.tokens) == ("corpus", "replay", replay_record.tokens)
    assert replayed.share == pytest.approx(mixture.realised_fraction) and replayed.validation_documents == 0
    # Validation is data.corpus alone; the replay never uses what the split rule holds out.
    assert byte_counts(cfg.data.path, "validation")[0] == 0
    candidates = [doc for doc in corpora[2] if not is_validation(doc, VAL_PERCENT)]
    assert replay_record.candidate_documents == len(candidates) < len(corpora[2])

    _, manifest_again = prepared(ray_session, corpora, "b", replay, "data.replay.fraction=0.25")
    assert manifest_again.content_sha256 == manifest.content_sha256
    _, manifest_other = prepared(
        ray_session, corpora, "c", replay, "data.replay.fraction=0.25", "data.replay.seed=1"
    )
    assert manifest_other.content_sha256 != manifest.content_sha256  # other documents chosen
    assert manifest_other.splits["train"].mixture.realised_fraction == pytest.approx(0.25, abs=0.015)


def test_a_replay_corpus_needs_a_fraction_and_a_fraction_needs_a_corpus():
    # A corpus named without a fraction would replay nothing: refused rather than silently ignored.
    with pytest.raises(ConfigError, match=r"replayed only with a fraction > 0; set data\.replay\.fraction"):
        load_config("tiny", ["data.replay.corpus=parent.jsonl"])
    with pytest.raises(ConfigError, match=r"fraction=0\.3 needs data\.replay\.corpus"):
        load_config("tiny", ["data.replay.fraction=0.3"])
