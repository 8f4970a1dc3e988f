import os
import signal
import socket

import pytest
import servers

from mhf_dist.config import Config, load_config
from mhf_dist.data.tokenizer import TextTokenizer
from mhf_dist.ray_utils import local_instance_environment
from mhf_dist.signatures import SignatureTable

servers.install_s3_environment()  # before any Ray instance starts: its workers inherit the endpoint
# Ray Train's controller looks at its workers every 2 s: a finished tiny fit waits out that poll several
# times over (about 5 s of each fit's 20). Every Ray instance the tests start, in-process or by a command,
# inherits the shorter interval; what the tests check does not depend on it.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")

# A test run started in the background (`bash .ci/run &`, nohup) ignores SIGINT, as POSIX shells start
# background jobs, and every process the tests start would inherit that and rightly keep ignoring it (the
# console scripts respect an ignored signal). The tests send SIGINT as a terminal's Ctrl-C does.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

SMALL_VOCAB = 300


@pytest.fixture(scope="session")
def small_cfg() -> Config:
    """The tiny preset at a 300-token vocabulary with H2B64 (frequent collisions, fast scoring)."""
    return load_config("tiny", [f"model.vocab_size={SMALL_VOCAB}", "model.hash.spec=H2B64"])


@pytest.fixture(scope="session")
def small_tokenizer() -> TextTokenizer:
    """A word-level tokenizer of SMALL_VOCAB words: the vocabulary `small_table` is hashed from."""
    return TextTokenizer.recall(SMALL_VOCAB)


@pytest.fixture(scope="session")
def small_table(small_cfg, small_tokenizer) -> SignatureTable:
    return SignatureTable.build(small_tokenizer.vocabulary(), 2, 64)


@pytest.fixture(scope="session")
def tiny_text_task():
    """(character vocabulary, 4 rows of 33 ids) of a repeated sentence: a task a tiny model learns fast."""
    import torch

    text = "the quick brown fox jumps over the lazy dog. " * 8
    vocab = sorted(set(text))
    ids = torch.tensor([vocab.index(char) for char in text])
    return vocab, torch.stack([ids[i * 40 : i * 40 + 33] for i in range(4)])


@pytest.fixture(scope="session")
def one_process_group():
    """A gloo group of one process, as a single Ray Train worker has, for the rest of the session
    (DeepSpeed caches its groups: a group destroyed after one test would break the next)."""
    import torch

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    rendezvous = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1"}
    os.environ.update({**rendezvous, "LOCAL_RANK": "0"})  # DeepSpeed reads LOCAL_RANK at every initialize
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    for key in rendezvous:  # read once; Ray's workers, which Ray Train sets up, must not inherit them
        del os.environ[key]
    yield
    torch.distributed.destroy_process_group()


# More logical CPUs than the 2 cores: prepare's tasks and a sweep's trials need slots beside 2 workers.
# address="local": a new instance even where `ray start` left a cluster for ray.init() to join.
RAY_INIT = {
    "address": "local",
    "num_cpus": 4,
    "include_dashboard": False,
    "logging_level": "ERROR",
    "log_to_driver": False,
}
RAY_TEST_FAILED = pytest.StashKey[bool]()


@pytest.fixture(scope="session")
def ray_session(tmp_path_factory):
    """One local Ray instance for the whole test session (start-up costs seconds)."""
    import os

    import ray

    # Anything torch JIT-builds lands here, not in ~/.cache (the Ray tests check that nothing is built).
    os.environ["TORCH_EXTENSIONS_DIR"] = str(tmp_path_factory.mktemp("torch_extensions"))
    # Workers import torch and DeepSpeed before they report ready; on a busy machine that can take longer
    # than Ray Train's 60 s default, which fails the fit instead of waiting.
    os.environ.setdefault("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "300")
    local_instance_environment()  # as `mhf` sets up the instances it starts
    ray.init(**RAY_INIT)
    yield ray
    ray.shutdown()


# The slowest files, slowest first (minutes of a one-process run): `make test`'s `-n 2 --dist loadfile`
# hands files out in collection order, so with these first the last files are short and neither process
# waits long for the other at the end.
SLOWEST_FILES = ["test_report_scaling.py", "test_object_storage.py", "test_ray_train.py",
                 "test_tracking_server.py", "test_demo.py", "test_jobs.py", "test_models.py", "test_eval.py",
                 "test_sweep.py", "test_interrupts.py", "test_contract.py"]  # fmt: skip


def pytest_collection_modifyitems(items):
    rank = {name: at for at, name in enumerate(SLOWEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file keeps its order


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed and "ray_session" in item.fixturenames:
        item.config.stash[RAY_TEST_FAILED] = True
    return report


@pytest.fixture(autouse=True)
def fresh_ray_after_a_failed_ray_test(request):
    """A failed (or timed-out) Ray test can leave actors holding the instance's CPUs, and every later fit
    would wait for them forever: the next test that uses Ray gets a new instance."""
    if "ray_session" in request.fixturenames and request.config.stash.get(RAY_TEST_FAILED, False):
        import ray

        ray.shutdown()
        ray.init(**RAY_INIT)
        request.config.stash[RAY_TEST_FAILED] = False
    yield


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """The S3-protocol server on 127.0.0.1 for the whole session; `make_bucket(name)` -> "s3://name"."""
    server = servers.S3Server(tmp_path_factory.mktemp("moto") / "moto.log")
    yield server
    server.stop()


@pytest.fixture
def bucket(s3_server, request):
    """A new, empty bucket for one test: its s3:// URI."""
    name = "t-" + "".join(c if c.isalnum() else "-" for c in request.node.name.lower())[:40].strip("-")
    return s3_server.make_bucket(f"{name}-{os.urandom(3).hex()}")


@pytest.fixture(scope="session")
def postgres_url():
    """PostgreSQL on 127.0.0.1: `MHF_TEST_POSTGRES_URL` (`.ci/run` starts one), else one started here."""
    if os.environ.get("MHF_TEST_POSTGRES_URL"):
        yield os.environ["MHF_TEST_POSTGRES_URL"]
        return
    if not servers.postgres_available():
        pytest.skip("PostgreSQL is not installed (initdb not on PATH) and MHF_TEST_POSTGRES_URL is unset")
    server = servers.Postgres()
    yield server.url
    server.stop()
