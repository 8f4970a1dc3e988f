"""MLflow conventions in one place.

Tracking URI: `MLFLOW_TRACKING_URI` when set (on a cluster, the tracking server: `http://HOST:5000`,
cluster/README.md), else an embedded SQLite file `<storage>/mlflow.db` with artifacts in
`<storage>/mlartifacts`. SQLite cannot live in a bucket: for storage in one (`s3://...`) the embedded file
is `runs/mlflow.db` of the working directory. Either file is one machine's: a run whose workers span
several machines needs a server (`train.ray_trainer.check_tracking_reaches_workers` says so).

One run per training job, created by the driver before training starts (so an unreachable server fails
fast); rank 0 logs the metrics of each step exactly once, in a batch at every log step, so steps re-run
after a worker failure are not logged twice.

A command's own requests (`connect`) retry a bounded number of times, so an unreachable server is one
line naming MLFLOW_TRACKING_URI within about 25 s; rank 0's logging during training keeps MLflow's own
longer retries, so a tracking server restarted mid-run does not fail the run.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mhf_dist.errors import MhfError
from mhf_dist.storage import Location, redact, redact_text

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient

EXPERIMENT = "mhf"
MAX_PARAM_LENGTH = 500  # MLflow's limit for a param value
URI_VARIABLE = "MLFLOW_TRACKING_URI"
LOCAL_STORE_DIR = "runs"  # the embedded store's directory (in the working directory) for bucket storage
# A command's requests: 2 attempts of at most 10 s each (MLflow's defaults retry for minutes). A user's own
# values win.
BOUNDED_RETRIES = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
_UNREACHABLE = {
    "Connection refused": "connection refused",
    "timed out": "no answer in time",
    "Failed to resolve": "unknown host",
    "Name or service not known": "unknown host",
    "error responses": "the server answers with errors (see its log)",
    "Max retries exceeded": "no connection",
}


class TrackingError(MhfError):
    """The tracking server cannot be reached or refused a request."""


def tracking_uri(storage: str | Path | Location) -> str:
    """`MLFLOW_TRACKING_URI`, else the embedded SQLite store for `storage` (see the module's docstring)."""
    uri = os.environ.get(URI_VARIABLE)
    if uri:
        return uri
    where = Location.of(storage)
    directory = (Path(LOCAL_STORE_DIR) if where.remote else where.local).resolve()
    directory.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{directory / 'mlflow.db'}"


def browse_hint(uri: str) -> str:
    """How to open the runs of `uri` in MLflow's UI."""
    if uri.startswith("sqlite:"):
        return f"mlflow ui --backend-store-uri {uri}"
    return f"the tracking server's UI at {redact(uri)}"


def connect(uri: str) -> MlflowClient:
    """A client for a command's own requests: bounded retries (see the module's docstring)."""
    from mlflow.tracking import MlflowClient

    for name, value in BOUNDED_RETRIES.items():
        os.environ.setdefault(name, value)
    return MlflowClient(tracking_uri=uri)


@contextmanager
def tracking_errors(uri: str) -> Iterator[None]:
    """A failed MLflow request (MlflowException, requests' or SQLAlchemy's errors) becomes one line."""
    try:
        yield
    except MhfError:
        raise
    except Exception as err:
        raise TrackingError(describe_failure(uri, err)) from None


def describe_failure(uri: str, err: BaseException) -> str:
    """One line for a failed request: where, what went wrong, what to do."""
    text = redact_text(str(err)).strip()
    reason = next((why for key, why in _UNREACHABLE.items() if key in text), None)
    if reason is None:
        reason = text.splitlines()[0][:160] if text else type(err).__name__
    if os.environ.get(URI_VARIABLE) == uri:
        where = f"{redact(uri)!r} ({URI_VARIABLE})"
        fix = f"start the server (cluster/README.md), fix {URI_VARIABLE}, or unset it for the embedded store"
    else:
        where, fix = repr(redact(uri)), f"check the embedded store's directory or set {URI_VARIABLE}"
    return f"cannot use MLflow tracking at {where}: {reason}; {fix}"


def start_run(uri: str, experiment: str, run_name: str, params: dict[str, Any], tags: dict[str, Any]) -> str:
    """Create the run (and the experiment if new); returns its id. Fails in one line if unreachable."""
    with tracking_errors(uri):
        client = connect(uri)
        found = client.get_experiment_by_name(experiment)
        if found is not None:
            experiment_id = found.experiment_id
        else:
            artifacts = None
            if uri.startswith("sqlite:///"):
                artifacts = (Path(uri.removeprefix("sqlite:///")).parent / "mlartifacts").as_uri()
            experiment_id = client.create_experiment(experiment, artifact_location=artifacts)
        shown = {key: redact_text(str(value)) for key, value in tags.items()}
        run = client.create_run(experiment_id, run_name=run_name, tags=shown)
        log_params(uri, run.info.run_id, params)
    return run.info.run_id


def log_params(uri: str, run_id: str, params: dict[str, Any]) -> None:
    from mlflow.entities import Param

    # A URI's user info and query options (where credentials could be) never reach MLflow.
    items = [Param(key, redact_text(str(value))[:MAX_PARAM_LENGTH]) for key, value in params.items()]
    with tracking_errors(uri):
        client = connect(uri)
        for start in range(0, len(items), 100):
            client.log_batch(run_id, params=items[start : start + 100])


def log_steps(uri: str, run_id: str, history: Iterable[dict[str, float]]) -> None:
    """Log each step's numeric metrics at that step (rank 0 during training: MLflow's own retries)."""
    from mlflow.tracking import MlflowClient

    _log_batches(MlflowClient(tracking_uri=uri), run_id, history)


def log_metrics(uri: str, run_id: str, metrics: dict[str, float]) -> None:
    """Summary metrics (e.g. an evaluation) at step 0, from a command: bounded retries, one-line errors."""
    with tracking_errors(uri):
        _log_batches(connect(uri), run_id, [{"step": 0, **metrics}])


def _log_batches(client: MlflowClient, run_id: str, history: Iterable[dict[str, float]]) -> None:
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    metrics = [
        Metric(key, float(value), now, int(entry["step"]))
        for entry in history
        for key, value in entry.items()
        if key != "step" and isinstance(value, int | float)
    ]
    for start in range(0, len(metrics), 1000):
        client.log_batch(run_id, metrics=metrics[start : start + 1000])


def log_artifact(uri: str, run_id: str, path: str | Path) -> None:
    with tracking_errors(uri):
        connect(uri).log_artifact(run_id, str(path))


def log_files(uri: str, run_id: str, files: dict[str, bytes]) -> None:
    """Files given by name and content as the run's artifacts, in one upload."""
    with tempfile.TemporaryDirectory(prefix="mhf-artifacts-") as tmp:
        for name, data in files.items():
            (Path(tmp) / name).write_bytes(data)
        with tracking_errors(uri):
            connect(uri).log_artifacts(run_id, tmp)


def reopen_run(uri: str, run_id: str) -> None:
    """Mark a run RUNNING again: a continued training run, or a resumed sweep."""
    with tracking_errors(uri):
        connect(uri).update_run(run_id, status="RUNNING")


def set_tags(uri: str, run_id: str, tags: dict[str, Any]) -> None:
    with tracking_errors(uri):
        client = connect(uri)
        for key, value in tags.items():
            client.set_tag(run_id, key, redact_text(str(value)))


def end_run(uri: str, run_id: str, status: str) -> None:
    with tracking_errors(uri):
        connect(uri).set_terminated(run_id, status=status)
