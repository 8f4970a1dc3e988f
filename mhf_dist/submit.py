"""Ray job specs (`jobs/*.job.yaml`) and `mhf submit`: one job through Ray's Jobs API.

A spec holds what `ray job submit` takes: an entrypoint, a runtime_env and the entrypoint's resources.
`runtime_env.env_vars` values may name the submitter's environment (`${NAME}` or `${NAME:-default}`;
one that expands to "" is left unset), and relative local paths resolve as `ray job submit` does.
"""

from __future__ import annotations

import asyncio
import os
import re
import shlex
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, ValidationError, field_validator

from mhf_dist.config import StrictModel, check_place
from mhf_dist.errors import ConfigError, MhfError, first_line, first_problem
from mhf_dist.ray_utils import ray_answers
from mhf_dist.readers import read_yaml
from mhf_dist.storage import is_uri, local_path

DEFAULT_ADDRESS = "http://127.0.0.1:8265"
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")
_PLAIN_WORD = re.compile(r"[\w@%+=:,./$-]+")
_VARIABLE = re.compile(r"\$\{(\w+)(?::-([^}]*))?\}")


class JobError(MhfError):
    """The Ray cluster cannot be reached, refused the job, or the job did not succeed."""


class JobSpec(StrictModel):
    entrypoint: str
    runtime_env: dict[str, Any] = Field(default_factory=dict)
    entrypoint_num_cpus: float = Field(0, ge=0)
    entrypoint_num_gpus: float = Field(0, ge=0)
    entrypoint_resources: dict[Annotated[str, Field(min_length=1)], Annotated[float, Field(gt=0)]] = Field(
        default_factory=dict
    )
    metadata: dict[str, str] = Field(default_factory=dict)

    @field_validator("entrypoint")
    @classmethod
    def _a_command(cls, entrypoint: str) -> str:
        if not entrypoint.strip():
            raise ValueError("empty; give the command the job runs, e.g. mhf train --config 100m")
        return entrypoint

    @field_validator("runtime_env")
    @classmethod
    def _ray_runtime_env(cls, runtime_env: dict[str, Any]) -> dict[str, Any]:
        from ray.runtime_env import RuntimeEnv

        runtime_env = {key: value for key, value in runtime_env.items() if value is not None}  # `env_vars:`
        unknown = sorted(set(runtime_env) - RuntimeEnv.known_fields)
        if unknown:
            raise ValueError(f"unknown runtime_env field(s) {unknown}")
        if isinstance(runtime_env.get("working_dir"), str):
            runtime_env["working_dir"] = _as_local(runtime_env["working_dir"])
        if isinstance(runtime_env.get("py_modules"), list):
            runtime_env["py_modules"] = [_as_local(module) for module in runtime_env["py_modules"]]
        RuntimeEnv(**runtime_env)  # Ray's own type checks (env_vars must be strings, ...)
        for name, value in runtime_env.get("env_vars", {}).items():
            if "${" in _VARIABLE.sub("", value):
                raise ValueError(
                    f"env_vars.{name} {value!r} has an unclosed ${{; write ${{NAME}} or ${{NAME:-default}}"
                )
        return runtime_env

    @field_validator("entrypoint_resources")
    @classmethod
    def _custom_resources(cls, resources: dict[str, float]) -> dict[str, float]:
        from ray._common.utils import resources_from_ray_options  # the rule Ray applies on the cluster

        try:
            resources_from_ray_options({"resources": resources})
        except ValueError as err:
            raise ValueError(f"{err} (CPUs and GPUs: entrypoint_num_cpus and entrypoint_num_gpus)") from None
        return resources


def _as_local(location: Any) -> Any:
    """A runtime_env path as Ray reads it: a local one with `~` and `file:` resolved (a URI that lost a
    slash, white space around it or an empty one refused), a URI as it is."""
    if not isinstance(location, str) or is_uri(location):
        return location
    try:
        check_place(location)
        return str(local_path(location))
    except MhfError as err:
        raise ValueError(str(err)) from None


def load_job_spec(path: str | Path) -> JobSpec:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"job spec {str(path)!r} not found; see jobs/*.job.yaml")
    raw = read_yaml(path, ConfigError, "fix the YAML syntax (see jobs/*.job.yaml)")
    try:
        return JobSpec.model_validate(raw or {})
    except (ValidationError, TypeError, ValueError) as err:
        where, message = first_problem(err) if isinstance(err, ValidationError) else ("", str(err))
        raise ConfigError(f"{path}: {where or 'spec'}: {message}") from None


def expand_env_vars(env_vars: Mapping[str, str], environ: Mapping[str, str]) -> dict[str, str]:
    """`${NAME}` / `${NAME:-default}` from the submitter's environment; empty results are dropped."""

    def value(match: re.Match[str]) -> str:
        name, default = match.group(1), match.group(2)
        if environ.get(name):
            return environ[name]
        if default is None:
            given = f"{name} is empty" if name in environ else "it is not set"
            raise ConfigError(f"the job needs ${name} ({given}); export {name}=... or pass --env {name}=...")
        return default

    expanded = {key: _VARIABLE.sub(value, str(raw)) for key, raw in env_vars.items()}
    return {key: text for key, text in expanded.items() if text}


def resolved_runtime_env(spec: JobSpec, environ: Mapping[str, str], cwd: Path) -> dict[str, Any]:
    runtime_env = dict(spec.runtime_env)
    runtime_env["env_vars"] = expand_env_vars(runtime_env.get("env_vars", {}), environ)
    if "working_dir" in runtime_env and not is_uri(runtime_env["working_dir"]):
        local = (cwd / runtime_env["working_dir"]).resolve()  # `~` and `file:` resolved by JobSpec
        if not local.is_dir():
            raise ConfigError(
                f"runtime_env.working_dir {str(local)!r} is not a directory; run from the repo root"
            )
        runtime_env["working_dir"] = str(local)
    if "py_modules" in runtime_env:
        runtime_env["py_modules"] = [
            module if is_uri(module) else str((cwd / module).resolve())
            for module in runtime_env["py_modules"]
        ]
    return runtime_env


def _check_named(spec: JobSpec, env: Mapping[str, str]) -> None:
    """`--env NAME=...` fills the spec's `${NAME}`: a NAME it does not name would be dropped unseen."""
    raw = spec.runtime_env.get("env_vars", {}).values()
    named = sorted({match.group(1) for value in raw for match in _VARIABLE.finditer(str(value))})
    stray = next((name for name in env if name not in named), None)
    if stray is not None:
        names = ", ".join(named) if named else "no variable"
        raise ConfigError(f"--env {stray}: the job spec has no ${{{stray}}} (it names {names}); drop it")


def _client(address: str) -> Any:
    from ray.exceptions import AuthenticationError, RpcError
    from ray.job_submission import JobSubmissionClient

    advice = "; start a cluster (mhf cluster start) or pass --address"
    target = os.environ.get("RAY_ADDRESS", "auto") if address == "auto" else address
    if not ray_answers(target):
        named = f"RAY_ADDRESS={target}" if target != address else target
        raise JobError(f"cannot reach the Ray Jobs API at {named} (nothing answers there){advice}")
    try:
        return JobSubmissionClient(address)
    except AuthenticationError:
        raise JobError(
            f"the Ray cluster at {address} uses token authentication; export RAY_AUTH_MODE=token "
            "(the token comes from ~/.ray/auth_token or RAY_AUTH_TOKEN)"
        ) from None
    except (ConnectionError, RuntimeError, ValueError, RpcError) as err:  # RpcError: a GCS (ray://, auto)
        raise JobError(
            f"cannot reach the Ray Jobs API at {address} ({first_line(err)[:160]}){advice}"
        ) from None


def submit_job(
    spec: JobSpec,
    address: str,
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    submission_id: str | None = None,
) -> tuple[Any, str]:
    """Submit the job; returns the client and the submission id."""
    _check_named(spec, env or {})
    environ = {**os.environ, **(env or {})}
    runtime_env = resolved_runtime_env(spec, environ, Path.cwd())
    # Arguments are quoted for the entrypoint's shell unless plainly safe: a bare `$NAME` expands there.
    words = [arg if _PLAIN_WORD.fullmatch(arg) else shlex.quote(arg) for arg in extra_args]
    entrypoint = " ".join([spec.entrypoint, *words])
    client = _client(address)
    taken = JobError(
        f"submission id {submission_id!r} is taken on the cluster at {address}; choose another "
        "--submission-id, or leave it out for Ray to pick one"
    )
    # Looked up first: Ray's client uploads the working directory (and says so) before it is refused.
    if submission_id is not None and any(job.submission_id == submission_id for job in client.list_jobs()):
        raise taken
    try:
        job_id = client.submit_job(
            entrypoint=entrypoint,
            runtime_env=runtime_env,
            metadata=spec.metadata or None,
            submission_id=submission_id,
            entrypoint_num_cpus=spec.entrypoint_num_cpus,
            entrypoint_num_gpus=spec.entrypoint_num_gpus,
            entrypoint_resources=spec.entrypoint_resources or None,
        )
    except RuntimeError as err:  # the Jobs API's refusal, as Ray's client raises it
        if submission_id is not None and "already exists" in str(err):  # submitted meanwhile
            raise taken from None
        raise
    return client, job_id


def follow_job(client: Any, job_id: str, write: Callable[[str], None], poll_s: float = 1.0) -> str:
    """Stream the job's logs until it ends; returns its final status (SUCCEEDED, FAILED or STOPPED)."""

    async def tail() -> None:
        async for lines in client.tail_job_logs(job_id):
            write(lines)

    asyncio.run(tail())
    while (status := str(client.get_job_status(job_id).value)) not in TERMINAL:
        time.sleep(poll_s)  # the log stream can close a moment before the status is final
    return status


def job_message(client: Any, job_id: str) -> str:
    """The first line of Ray's message about the job's end, e.g. the entrypoint's exit code."""
    lines = (client.get_job_info(job_id).message or "").strip().splitlines()
    return lines[0][:300] if lines else ""
