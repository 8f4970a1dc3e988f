"""Real servers for tests, bound to 127.0.0.1 and stopped after: an S3-protocol server (moto in server
mode, as Ray's own storage tests use) and PostgreSQL (a throw-away cluster in a temporary directory,
run as a non-root user).

The S3 endpoint and dummy credentials are put in the environment when this module is imported (by
conftest), before any Ray instance starts, so every Ray worker inherits them; the server itself starts
on first use. `.ci/run` may start PostgreSQL itself and pass `MHF_TEST_POSTGRES_URL`.
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path


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
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{S3_ENDPOINT}/moto-api/", timeout=1)
                break
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto_server did not start; see {log}") from None
                time.sleep(0.2)

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
