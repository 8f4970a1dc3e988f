"""Real servers for tests, bound to 127.0.0.1 and stopped after: an S3-protocol server (moto in server
mode, as Ray's own storage tests use), PostgreSQL (a throw-away cluster in a temporary directory,
run as a non-root user) and an MLflow tracking server on them (cluster/README.md's set-up).

The S3 endpoint and dummy credentials are put in the environment when this module is imported (by
conftest), before any Ray instance starts, so every Ray worker inherits them; the server itself starts
on first use. `.ci/run` may start PostgreSQL itself and pass `MHF_TEST_POSTGRES_URL`.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


S3_PORT = free_port()
S3_ENDPOINT = f"http://127.0.0.1:{S3_PORT}"
S3_ENVIRONMENT = {
    "AWS_ENDPOINT_URL": S3_ENDPOINT,
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing-secret-never-shown",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}


def install_s3_environment() -> None:
    os.environ.update(S3_ENVIRONMENT)


def wait_until_answering(url: str, process: subprocess.Popen, log: Path, seconds: float) -> None:
    """Return once `url` answers; a server that exits or stays silent for `seconds` is an error."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            urllib.request.urlopen(url, timeout=1)
            return
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{url} did not answer; see {log}:\n{log.read_text()[-3000:]}") from None
            time.sleep(0.2)


class S3Server:
    """moto_server on 127.0.0.1:S3_PORT."""

    def __init__(self, log: Path) -> None:
        moto = shutil.which("moto_server", path=str(Path(sys.executable).parent)) or shutil.which(
            "moto_server"
        )
        if moto is None:
            raise RuntimeError("moto_server not found; pip install 'moto[server]'")
        self.log = open(log, "w")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            [moto, "-H", "127.0.0.1", "-p", str(S3_PORT)], stdout=self.log, stderr=subprocess.STDOUT
        )
        wait_until_answering(f"{S3_ENDPOINT}/moto-api/", self.process, log, 30)

    def make_bucket(self, name: str) -> str:
        import pyarrow.fs as pafs

        pafs.S3FileSystem(endpoint_override=S3_ENDPOINT, allow_bucket_creation=True).create_dir(name)
        return f"s3://{name}"

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=10)
        self.log.close()


class Postgres:
    """A PostgreSQL cluster in a temporary directory on 127.0.0.1, owned by a non-root user (the server
    refuses to run as root)."""

    def __init__(self) -> None:
        self.directory = Path(tempfile.mkdtemp(prefix="mhf-postgres-"))
        self.port = free_port()
        user = "postgres" if os.geteuid() == 0 else None
        self._as_user = ["runuser", "-u", user, "--"] if user else []
        if user:
            pw = pwd.getpwnam(user)
            os.chown(self.directory, pw.pw_uid, pw.pw_gid)
        data = self.directory / "data"
        self._run(["initdb", "-D", str(data), "-U", "mhf", "--auth=trust", "-E", "UTF8"])
        self._run(
            [
                "pg_ctl", "-D", str(data), "-l", str(self.directory / "server.log"), "-w", "-o",
                f"-h 127.0.0.1 -p {self.port} -k {self.directory}", "start",
            ]
        )  # fmt: skip
        self.data = data
        self.url = f"postgresql://mhf@127.0.0.1:{self.port}/postgres"

    def create_database(self, name: str) -> str:
        self._run(["createdb", "-h", "127.0.0.1", "-p", str(self.port), "-U", "mhf", name])
        return f"postgresql://mhf@127.0.0.1:{self.port}/{name}"

    def _run(self, command: list[str]) -> None:
        subprocess.run([*self._as_user, *command], check=True, capture_output=True, cwd=self.directory)

    def stop(self) -> None:
        subprocess.run(
            [*self._as_user, "pg_ctl", "-D", str(self.data), "-m", "fast", "stop"], capture_output=True
        )
        shutil.rmtree(self.directory, ignore_errors=True)


def postgres_available() -> bool:
    return bool(os.environ.get("MHF_TEST_POSTGRES_URL")) or shutil.which("initdb") is not None


class MlflowServer:
    """`mlflow server` on 127.0.0.1 as cluster/ runs it: runs in `backend` (a SQLAlchemy URI), artifacts
    proxied into `artifacts` (a bucket URI); `url` for MLFLOW_TRACKING_URI."""

    def __init__(self, backend: str, artifacts: str, log: Path) -> None:
        self.port = free_port()
        self.command = [
            sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(self.port),
            "--backend-store-uri", backend, "--artifacts-destination", artifacts, "--serve-artifacts",
            "--workers", "1",  # one process to import: a busy machine starts it sooner
        ]  # fmt: skip
        self.log = log
        self.url = f"http://127.0.0.1:{self.port}"
        self.start()

    def start(self) -> None:
        """Serve on the same port (again, after `stop`)."""
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        with open(self.log, "a") as output:  # its own process group: stop() ends its workers too
            self.process = subprocess.Popen(
                self.command, env=env, stdout=output, stderr=subprocess.STDOUT, start_new_session=True
            )
        wait_until_answering(f"{self.url}/health", self.process, self.log, 180)

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=30)


def new_database(postgres_url: str) -> str:
    """A fresh database on the PostgreSQL at `postgres_url`: its SQLAlchemy URI, with the psycopg2 driver
    named (SQLAlchemy 2.1 reads `postgresql://` as psycopg 3)."""
    import psycopg2

    name = f"mlflow_{os.urandom(4).hex()}"
    connection = psycopg2.connect(postgres_url)
    connection.autocommit = True  # CREATE DATABASE cannot run in a transaction
    with connection.cursor() as cursor:
        cursor.execute(f"CREATE DATABASE {name}")
    connection.close()
    return urlsplit(postgres_url)._replace(scheme="postgresql+psycopg2", path=f"/{name}").geturl()
