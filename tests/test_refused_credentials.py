"""Refused credentials, for real: moto's server with its IAM authentication enforced. A user with a key
pair and an allow-all policy owns a bucket; every command that touches the bucket, given a wrong secret or
an unknown key id, ends with one line naming the variables to fix, exit 2, and nothing written."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import servers

from mhf_dist.cli import main

REFUSED = re.compile(
    r"error: the object store refused the credentials for 's3://owned(/[\w./-]*)?'; check AWS_ACCESS_KEY_ID "
    r"and AWS_SECRET_ACCESS_KEY \(or the instance role\)"
)


@pytest.fixture(scope="module")
def enforcing_store(tmp_path_factory):
    """moto on 127.0.0.1 that authenticates every request after the first three (the IAM user, its key,
    its policy); the owner's key pair."""
    import boto3

    port = servers.free_port()
    log = tmp_path_factory.mktemp("moto-iam") / "moto.log"
    moto = Path(sys.executable).parent / "moto_server"
    with open(log, "w") as output:
        process = subprocess.Popen(
            [moto, "-H", "127.0.0.1", "-p", str(port)],
            env={**servers.os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "3"},
            stdout=output,
            stderr=subprocess.STDOUT,
        )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        servers.wait_until_answering(f"{endpoint}/moto-api/", process, log, 30)
        session = {"endpoint_url": endpoint, "region_name": "us-east-1"}
        iam = boto3.client("iam", aws_access_key_id="bootstrap", aws_secret_access_key="bootstrap", **session)
        iam.create_user(UserName="owner")
        key = iam.create_access_key(UserName="owner")["AccessKey"]
        allow_all = {
            "Version": "2012-10-17",
            "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}],
        }
        iam.put_user_policy(UserName="owner", PolicyName="all", PolicyDocument=json.dumps(allow_all))
        owner = {"aws_access_key_id": key["AccessKeyId"], "aws_secret_access_key": key["SecretAccessKey"]}
        boto3.client("s3", **owner, **session).create_bucket(Bucket="owned")
        yield endpoint, key["AccessKeyId"], key["SecretAccessKey"]
    finally:
        process.terminate()
        process.wait(timeout=10)


@pytest.fixture(scope="module")
def local_model(tmp_path_factory):
    """A tiny exported model on the local disk (for commands that write it to the bucket), beside an
    MLflow store."""
    import torch
    from mlflow.tracking import MlflowClient

    from mhf_dist.config import load_config
    from mhf_dist.data.tokenizer import TextTokenizer
    from mhf_dist.export import export_model
    from mhf_dist.models import build_model
    from mhf_dist.signatures import SignatureTable

    directory = tmp_path_factory.mktemp("model")
    tokenizer = TextTokenizer.bytes()
    tokenizer.save(directory / "tokenizer.json")
    cfg = load_config("tiny", ["model.vocab_size=259", "model.hash.spec=H2B64"]).model
    table = SignatureTable.build(tokenizer.vocabulary(), 2, 64)
    torch.manual_seed(0)
    export_model(build_model(cfg, table), cfg, table, directory / "tokenizer.json", directory / "model")
    MlflowClient(f"sqlite:///{directory / 'mlflow.db'}").search_experiments()  # an MLflow store for compare
    return directory / "model"


COMMANDS = {
    "prepare": ["prepare", "--out", "s3://owned/data"],
    "verify-data": ["verify-data", "s3://owned/data"],
    "train": ["train", "--storage", "s3://owned/runs", "--set", "data.path=s3://owned/data"],
    "eval": ["eval", "--model", "s3://owned/model", "--task", "bpb", "--data", "{text}"],
    "generate": ["generate", "--model", "s3://owned/model", "--prompt", "Hello"],
    "export-hf": ["export-hf", "s3://owned/model", "--out", "{tmp}/hf"],
    "export-hf to a bucket": ["export-hf", "{model}", "--out", "s3://owned/hf"],
    "cpt": [
        "cpt",
        "--from",
        "s3://owned/model",
        "--data",
        "{text}",
        "--add-tokens",
        "{text}",
        "--storage",
        "s3://owned/runs",
    ],
    "compare": ["compare", "--experiment", "mhf", "--out", "s3://owned/report"],
    "sweep": ["sweep", "--config", "{sweep}"],
}


@pytest.mark.parametrize("wrong", ["secret", "key id"])
@pytest.mark.parametrize("command", list(COMMANDS))
def test_wrong_keys_are_one_line_for_every_command_that_touches_a_bucket(
    enforcing_store, local_model, command, wrong, tmp_path, monkeypatch, capsys
):
    endpoint, key_id, secret = enforcing_store
    # compare's (empty) MLflow store: it is read only after the report's bucket is checked
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{local_model.parent / 'mlflow.db'}")
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAUNKNOWNKEY000000" if wrong == "key id" else key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret" if wrong == "secret" else secret)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "text.txt").write_text("Some text to read.\n")
    (tmp_path / "s.yaml").write_text(
        "name: s\nkind: seeds\nset: {data.path: s3://owned/data}\nstorage: s3://owned/sweeps\n"
    )
    paths = {
        "text": tmp_path / "text.txt",
        "tmp": tmp_path,
        "model": local_model,
        "sweep": tmp_path / "s.yaml",
    }
    argv = [arg.format(**paths) for arg in COMMANDS[command]]
    assert main(argv) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert REFUSED.fullmatch(line), line
    assert sorted(path.name for path in tmp_path.iterdir()) == ["s.yaml", "text.txt"]
    import boto3

    owner = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id=key_id,
                         aws_secret_access_key=secret)  # fmt: skip
    assert owner.list_objects_v2(Bucket="owned")["KeyCount"] == 0  # nor in the bucket


@pytest.mark.parametrize(
    ("wrong", "act", "code"),
    [
        ("secret", "read", "ACCESS_DENIED"),
        ("secret", "write", "SIGNATURE_DOES_NOT_MATCH"),
        ("key id", "write", "INVALID_ACCESS_KEY_ID"),
    ],
)
def test_each_refusal_code_the_store_sends_is_named_as_refused_credentials(
    enforcing_store, wrong, act, code, monkeypatch
):
    """The refusal is known by the S3 error code pyarrow's text carries: each code from the real server,
    so a pyarrow that writes it otherwise fails here."""
    from mhf_dist.storage import Location, _s3, describe_failure

    endpoint, key_id, secret = enforcing_store
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAUNKNOWNKEY000000" if wrong == "key id" else key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret" if wrong == "secret" else secret)
    _s3.cache_clear()
    where = Location.of("s3://owned/x")
    with pytest.raises(OSError) as raised:
        if act == "read":
            where.fs.open_input_stream(where.path).read()
        else:
            where.fs.open_output_stream(where.path).close()
    assert f"AWS Error {code} during " in str(raised.value), raised.value
    assert REFUSED.fullmatch(f"error: {describe_failure(where.uri, raised.value)}")
