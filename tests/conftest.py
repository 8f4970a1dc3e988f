import pytest

from mhf_dist.config import Config, load_config
from mhf_dist.signatures import SignatureTable

SMALL_VOCAB = 300


@pytest.fixture(scope="session")
def small_cfg() -> Config:
    """The tiny preset at a 300-token vocabulary with H2B64 (frequent collisions, fast scoring)."""
    return load_config("tiny", [f"model.vocab_size={SMALL_VOCAB}", "model.hash.spec=H2B64"])


@pytest.fixture(scope="session")
def small_table(small_cfg) -> SignatureTable:
    return SignatureTable.build([f"tok{i}" for i in range(SMALL_VOCAB)], 2, 64)


@pytest.fixture(scope="session")
def tiny_text_task():
    """(character vocabulary, 4 rows of 33 ids) of a repeated sentence: a task a tiny model learns fast."""
    import torch

    text = "the quick brown fox jumps over the lazy dog. " * 8
    vocab = sorted(set(text))
    ids = torch.tensor([vocab.index(char) for char in text])
    return vocab, torch.stack([ids[i * 40 : i * 40 + 33] for i in range(4)])


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray instance for the whole test session (start-up costs seconds)."""
    import ray

    # More logical CPUs than the 2 cores: Ray Data's read tasks need slots beside the training workers.
    # address="local": a new instance even where `ray start` left a cluster for ray.init() to join.
    ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    yield ray
    ray.shutdown()
