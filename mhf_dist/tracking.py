"""MLflow conventions in one place.

Tracking URI: `MLFLOW_TRACKING_URI` when set (on a cluster, the tracking server: `http://HOST:5000`,
cluster/README.md), else an embedded SQLite file `<storage>/mlflow.db` with artifacts in
`<storage>/mlartifacts`; for storage in a bucket, where SQLite cannot live, `runs/mlflow.db` of the
working directory. Either file is one machine's: workers on several machines need a server.

One run per training job, created by the driver before training starts (so an unreachable server fails
fast); rank 0 logs each step's metrics once, in a batch at every log step, so steps re-run after a
worker failure are not logged twice.

A command's own requests (`connect`) retry a bounded number of times, so an unreachable server is one
line within about 25 s; rank 0's logging keeps MLflow's own longer retries, so a tracking server
restarted mid-run does not fail the run.
"""

from __future__ import annotations

import io
import json
import os
import socket
import sqlite3
import tempfile
import threading
import time
from collections.abc import Collection, Iterable, Iterator
from contextlib import closing, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from mhf_dist.errors import MhfError, chain, first_line
from mhf_dist.storage import Location, is_uri, redact, redact_text, redact_values

if TYPE_CHECKING:
    from mlflow.entities import Run
    from mlflow.tracking import MlflowClient

MLFLOW_TABLES = {"alembic_version", "experiments", "runs"}  # what MLflow's SQLite schema has at least
CUT_NOTE = "\n\n(cut at MLflow's limit for a description: the whole table is the artifact compare.md)"
URI_VARIABLE = "MLFLOW_TRACKING_URI"
STORE_FIX = f"give the --storage a run wrote to, or set {URI_VARIABLE}"  # for a missing or foreign store
LOCAL_UI = "http://127.0.0.1:5000"  # where `mlflow ui` serves by default
RUNS_VIEW = "workflowType=machine_learning"  # MLflow 3's Model-training view of an experiment
DATASET_DIGEST_LENGTH = 12  # of the manifest's content sha256, as `mhf prepare` prints it (MLflow: <= 36)
LOCAL_STORE_DIR = "runs"  # the embedded store's directory (in the working directory) for bucket storage
# A command's requests: 2 attempts of at most 10 s each (MLflow's defaults retry for minutes). A user's own
# values win.
BOUNDED_RETRIES = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}


class TrackingError(MhfError):
    """The tracking server cannot be reached or refused a request."""


def tracking_uri(storage: str | Path | Location) -> str:
    """`MLFLOW_TRACKING_URI` (a relative SQLite path made absolute: Ray's workers run in folders of their
    own), else the embedded SQLite store for `storage` (its folder made by the first client)."""
    given = os.environ.get(URI_VARIABLE)
    if given:
        store = sqlite_file(given)
        return given if store is None or "?" in given else f"sqlite:///{store}"
    where = Location.of(storage)
    return f"sqlite:///{(Path(LOCAL_STORE_DIR) if where.remote else where.local).resolve() / 'mlflow.db'}"


def reading_uri(storage: str | Path | Location) -> str:
    """`tracking_uri` for a command that only reads runs: a missing embedded store is an error."""
    uri = tracking_uri(storage)
    require_store(uri)
    return uri


def sqlite_file(uri: str) -> Path | None:
    """The file of a SQLite store's URI (a relative one from the working directory, as MLflow reads it)."""
    return Path(uri.removeprefix("sqlite:///")).absolute() if uri.startswith("sqlite:///") else None


def check_writable_store(uri: str) -> None:
    """Before a run starts: a SQLite store it can create, or an MLflow store, not another program's
    database (MLflow would add its tables to it)."""
    if (store := sqlite_file(uri)) is None:
        return
    given = _from_environment(uri)
    fix = f"fix {URI_VARIABLE}" if given else f"choose another --storage or set {URI_VARIABLE}"
    Location.of(store).check_writable(TrackingError, fix)  # first: a name too long cannot even be looked at
    if store.exists():
        require_store(uri, f"fix {URI_VARIABLE}" if given else f"move it away or set {URI_VARIABLE}")


def _from_environment(uri: str) -> bool:
    given = os.environ.get(URI_VARIABLE)
    return bool(given) and (given == uri or sqlite_file(given) == sqlite_file(uri))


def require_store(uri: str, fix: str | None = None) -> None:
    """Refuse to read an embedded SQLite store that does not exist or has no MLflow tables (an empty file,
    another program's database): MLflow would create them. It is opened read-only to look. `fix`: a
    writer's advice, where a reader's is to find the store a run wrote."""
    if (store := sqlite_file(uri)) is None:
        return
    given = _from_environment(uri)
    where = f"{str(store)!r} ({URI_VARIABLE})" if given else repr(str(store))
    reading = f"fix {URI_VARIABLE} to the store a run wrote to, or unset it to read --storage's"
    fix = fix or (reading if given else STORE_FIX)
    if not store.is_file():
        raise TrackingError(f"no MLflow store at {where}; {fix}")
    try:
        with closing(sqlite3.connect(f"{store.as_uri()}?mode=ro", uri=True)) as db:
            tables = {name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    except sqlite3.DatabaseError as err:  # not an SQLite file at all
        tables, why = set(), str(err)
    else:
        why = "it has no MLflow tables"
    if MLFLOW_TABLES - tables:
        raise TrackingError(f"{where} is not an MLflow store ({why}); {fix}")


def find_run(uri: str, run_id: str) -> Run | None:
    """The run `run_id` of the store at `uri`, or None when it has none of that id (or it is deleted)."""
    from mlflow.exceptions import MlflowException

    with tracking_errors(uri):
        require_store(uri)
        try:
            run = connect(uri).get_run(run_id)
        except MlflowException as err:
            if err.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
                return None  # INVALID_PARAMETER_VALUE: not an id's form
            raise
    return None if run.info.lifecycle_stage == "deleted" else run


def check_run(uri: str, run_id: str) -> None:
    """Refuse a run id the store does not hold, before the work whose results would be logged to it."""
    if find_run(uri, run_id) is None:
        raise TrackingError(
            f"no MLflow run {run_id!r} at {redact(uri)!r}; give --run-id the id `mhf train` printed "
            f'("MLflow run ID at ..."), with the --storage or {URI_VARIABLE} that run wrote to'
        )


def browse_hint(uri: str, experiment: str) -> str:
    """How to open `experiment`'s runs table in MLflow's UI (after `mlflow ui` for an embedded store), in
    the Model-training view: MLflow 3 opens an experiment on its GenAI traces otherwise."""
    try:
        with tracking_errors(uri):
            found = connect(uri).get_experiment_by_name(experiment)
    except TrackingError:  # the command's work is done: a hint without the experiment's id beats an error
        found = None
    page = f"#/experiments/{found.experiment_id}/runs?{RUNS_VIEW}" if found else f"#/experiments?{RUNS_VIEW}"
    if uri.startswith("sqlite:"):
        return f"mlflow ui --backend-store-uri {uri}  then open {LOCAL_UI}/{page}"
    if uri.startswith(("http://", "https://")):
        return f"{redact(uri).rstrip('/')}/{page}"
    return f"the tracking server's UI at {redact(uri)} (experiment {experiment!r})"


def connect(uri: str) -> MlflowClient:
    """A client for a command's own requests, with bounded retries: set in the environment, where MLflow
    reads them at each request, for the length of each of its calls only (see `_bounded_requests`)."""
    from mlflow.tracking import MlflowClient

    if (store := sqlite_file(uri)) is not None:  # MLflow makes the folder itself only since mlflow#19205
        store.parent.mkdir(parents=True, exist_ok=True)
    return cast("MlflowClient", _BoundedClient(MlflowClient(tracking_uri=uri)))


_bounded = threading.Lock()
_bounded_calls = 0  # calls of `connect` clients under way, in any thread
_bounded_set: list[str] = []  # the variables they set (a user's own values win)


@contextmanager
def _bounded_requests() -> Iterator[None]:
    """BOUNDED_RETRIES in the (process-wide) environment while any `connect` client's call runs: another
    thread's request that overlaps one gets the bounds too, which costs it retries, never a value it set."""
    global _bounded_calls, _bounded_set
    with _bounded:
        if _bounded_calls == 0:
            _bounded_set = [variable for variable in BOUNDED_RETRIES if variable not in os.environ]
            os.environ.update({variable: BOUNDED_RETRIES[variable] for variable in _bounded_set})
        _bounded_calls += 1
    try:
        yield
    finally:
        with _bounded:
            _bounded_calls -= 1
            if _bounded_calls == 0:
                for variable in _bounded_set:
                    os.environ.pop(variable, None)


class _BoundedClient:
    def __init__(self, client: MlflowClient) -> None:
        self._client = client

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._client, name)
        # A method runs under a fresh `_bounded_requests()` at each call (a contextmanager decorates).
        return _bounded_requests()(attribute) if callable(attribute) else attribute


@contextmanager
def tracking_errors(uri: str) -> Iterator[None]:
    """A failed MLflow request (MlflowException, requests' or SQLAlchemy's errors) becomes one line."""
    try:
        yield
    except MhfError:
        raise
    except Exception as err:
        raise TrackingError(describe_failure(uri, err)) from None


def _unreachable(err: BaseException) -> str | None:
    """Why a request got no answer, by the type of an error in its chain (MLflow raises an
    MlflowException from requests' error, raised from urllib3's, raised from the socket's)."""
    import requests
    import urllib3

    causes = chain(err)
    reasons = [
        (ConnectionRefusedError, "connection refused"),
        (socket.gaierror, "unknown host"),
        ((TimeoutError, urllib3.exceptions.TimeoutError, requests.Timeout), "no answer in time"),
        (requests.exceptions.RetryError, "the server answers with errors (see its log)"),
        (requests.ConnectionError, "no connection"),
    ]
    return next((why for kind, why in reasons if any(isinstance(each, kind) for each in causes)), None)


def describe_failure(uri: str, err: BaseException) -> str:
    """One line for a failed request: where, what went wrong, what to do."""
    reason = _unreachable(err) or redact_text(first_line(err))[:160]
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
        else:  # an embedded store's artifacts beside it
            store = sqlite_file(uri)
            artifacts = (store.parent / "mlartifacts").as_uri() if store else None
            experiment_id = client.create_experiment(experiment, artifact_location=artifacts)
        shown = {key: redact_text(str(value)) for key, value in tags.items()}
        run = client.create_run(experiment_id, run_name=run_name, tags=shown)
        log_params(uri, run.info.run_id, params)
    return run.info.run_id


def log_dataset(uri: str, run_id: str, data_path: str, content_sha256: str) -> None:
    """The prepared shards as the run's dataset input (the runs table's Dataset column). The entity is
    built directly: MLflow's source resolvers know neither every scheme `Location` reads nor shards."""
    from mlflow.entities import Dataset, DatasetInput, InputTag
    from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

    remote = is_uri(data_path)
    where = redact(data_path) if remote else str(Path(data_path).resolve())
    dataset = Dataset(
        name=where.rstrip("/").rsplit("/", 1)[-1],
        digest=content_sha256[:DATASET_DIGEST_LENGTH],
        source_type=where.split("://", 1)[0] if remote else "local",
        source=json.dumps({"uri": where}),
    )
    entry = DatasetInput(dataset, tags=[InputTag(MLFLOW_DATASET_CONTEXT, "training")])
    with tracking_errors(uri):
        connect(uri).log_inputs(run_id, datasets=[entry])


def log_params(uri: str, run_id: str, params: dict[str, Any]) -> None:
    from mlflow.entities import Param
    from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH  # 6,000 characters in MLflow 3

    # Credentials never reach MLflow: a URI's user info and query options, a Dataset source's secret args.
    items = [Param(key, str(redact_values(value))[:MAX_PARAM_VAL_LENGTH]) for key, value in params.items()]
    with tracking_errors(uri):
        connect(uri).log_batch(run_id, params=items)  # MLflow sends 100 a request


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
    client.log_batch(run_id, metrics=metrics)  # MLflow sends 1000 a request


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


def show_report(uri: str, run_id: str, description: str, images: dict[str, bytes]) -> None:
    """`description` (Markdown) as the run's description, and each PNG as an image under its key."""
    from mlflow.utils.mlflow_tags import MLFLOW_RUN_NOTE
    from mlflow.utils.validation import MAX_TAG_VAL_LENGTH  # a run's description is a tag
    from PIL import Image

    with tracking_errors(uri):
        client = connect(uri)
        note = redact_text(description)
        if len(note) > MAX_TAG_VAL_LENGTH:  # the whole report is the run's compare.md
            note = note[: MAX_TAG_VAL_LENGTH - len(CUT_NOTE)] + CUT_NOTE
        client.set_tag(run_id, MLFLOW_RUN_NOTE, note)
        for key, data in images.items():
            client.log_image(run_id, Image.open(io.BytesIO(data)), key=key, step=0)


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


def every_run(client: MlflowClient, experiment_id: str, query: str) -> list[Run]:
    """Every run of the experiment that `query` (MLflow's filter) matches, page after page."""
    page = client.search_runs([experiment_id], query)
    runs = list(page)
    while page.token:
        page = client.search_runs([experiment_id], query, page_token=page.token)
        runs += page
    return runs


def end_stopped_children(
    uri: str, parent_run_id: str, stopped_at: float, stopped: Collection[str] = ()
) -> None:
    """Mark KILLED the sweep trials an interrupt at `stopped_at` (epoch seconds) stopped: those still
    RUNNING (Tune skipped their clean-up) or FAILED since then (they saw the stop as a failed fit), and
    the runs named in `stopped` (trials ASHA stopped, whichever of the two they did)."""
    from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID

    with tracking_errors(uri):
        client = connect(uri)
        experiment = client.get_run(parent_run_id).info.experiment_id
        # every page first: ending a run could move it between pages
        for run in every_run(client, experiment, f"tags.`{MLFLOW_PARENT_RUN_ID}` = '{parent_run_id}'"):
            failed_since = run.info.status == "FAILED" and (run.info.end_time or 0) >= stopped_at * 1000
            if run.info.status == "RUNNING" or failed_since or run.info.run_name in stopped:
                client.set_terminated(run.info.run_id, status="KILLED")
