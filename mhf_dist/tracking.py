"""MLflow conventions in one place.

Tracking URI: `MLFLOW_TRACKING_URI` when set, else an embedded SQLite file `<workdir>/mlflow.db` with
artifacts in `<workdir>/mlartifacts`. One run per training job, created by the driver before training
starts (so an unreachable server fails fast); rank 0 logs the metrics of each step exactly once, in a
batch at every checkpoint, so steps re-run after a worker failure are not logged twice.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from mhf_dist.errors import MhfError

EXPERIMENT = "mhf"
MAX_PARAM_LENGTH = 500  # MLflow's limit for a param value


class TrackingError(MhfError):
    """The tracking server cannot be reached or refused a request."""


def tracking_uri(workdir: str | Path) -> str:
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    workdir = Path(workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{workdir / 'mlflow.db'}"


def _client(uri: str) -> Any:
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def start_run(uri: str, experiment: str, run_name: str, params: dict[str, Any], tags: dict[str, Any]) -> str:
    """Create the run (and the experiment if new); returns its id. Fails in one line if unreachable."""
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    client = _client(uri)
    try:
        found = client.get_experiment_by_name(experiment)
        if found is not None:
            experiment_id = found.experiment_id
        else:
            artifacts = None
            if uri.startswith("sqlite:///"):
                artifacts = (Path(uri.removeprefix("sqlite:///")).parent / "mlartifacts").as_uri()
            experiment_id = client.create_experiment(experiment, artifact_location=artifacts)
        run = client.create_run(experiment_id, run_name=run_name, tags={k: str(v) for k, v in tags.items()})
    except Exception as err:  # MLflow raises MlflowException, requests errors, sqlalchemy errors
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise TrackingError(
            f"cannot use MLflow tracking at {uri!r} ({first_line[:160]}); "
            "start the server or unset MLFLOW_TRACKING_URI"
        ) from None
    log_params(uri, run.info.run_id, params)
    return run.info.run_id


def log_params(uri: str, run_id: str, params: dict[str, Any]) -> None:
    from mlflow.entities import Param

    items = [Param(key, str(value)[:MAX_PARAM_LENGTH]) for key, value in params.items()]
    client = _client(uri)
    for start in range(0, len(items), 100):
        client.log_batch(run_id, params=items[start : start + 100])


def log_steps(uri: str, run_id: str, history: Iterable[dict[str, float]]) -> None:
    """Log each step's numeric metrics at that step."""
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    metrics = [
        Metric(key, float(value), now, int(entry["step"]))
        for entry in history
        for key, value in entry.items()
        if key != "step" and isinstance(value, int | float)
    ]
    client = _client(uri)
    for start in range(0, len(metrics), 1000):
        client.log_batch(run_id, metrics=metrics[start : start + 1000])


def log_metrics(uri: str, run_id: str, metrics: dict[str, float]) -> None:
    """Summary metrics (e.g. an evaluation) at step 0."""
    log_steps(uri, run_id, [{"step": 0, **metrics}])


def log_artifact(uri: str, run_id: str, path: str | Path) -> None:
    _client(uri).log_artifact(run_id, str(path))


def reopen_run(uri: str, run_id: str) -> None:
    """Mark a run RUNNING again: a continued training run, or a resumed sweep."""
    _client(uri).update_run(run_id, status="RUNNING")


def set_tags(uri: str, run_id: str, tags: dict[str, Any]) -> None:
    client = _client(uri)
    for key, value in tags.items():
        client.set_tag(run_id, key, str(value))


def end_run(uri: str, run_id: str, status: str) -> None:
    _client(uri).set_terminated(run_id, status=status)
