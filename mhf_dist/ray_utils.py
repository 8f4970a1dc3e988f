"""Connecting to Ray: a running cluster when RAY_ADDRESS is set, else a local instance."""

from __future__ import annotations

import functools
import logging
import os

from mhf_dist.console import quiet_driver
from mhf_dist.errors import MhfError
from mhf_dist.interrupts import starting_ray
from mhf_dist.storage import reachable

# Logical CPUs a local instance adds beyond the cores: Ray Train's workers hold one CPU each for the whole
# run, and what runs beside them (a `--prepare` job's Ray Data tasks) would otherwise wait for its end.
LOCAL_CPU_HEADROOM = 2
# Ray Train's placement-group cleaner asks the State API (the dashboard's) every second, and logs this
# warning where a local instance runs without one; the instance dies with its driver, so nothing is lost.
PLACEMENT_GROUP_CLEANER_LOGGER = "ray.train.v2._internal.execution.controller.placement_group_cleaner"
STATE_API_UNAVAILABLE = "State API may be temporarily unavailable"
# ray.init's notice that it set no SIGTERM handler: `interrupts.starting_ray` starts it off the main thread
# for that
RAY_INIT_LOGGER, NO_SIGTERM_HANDLER = "ray._private.worker", "SIGTERM handler is not set"
UNHANDLED_ERRORS_VARIABLE = "RAY_IGNORE_UNHANDLED_ERRORS"  # read by the driver each time it would print
# A local instance has no node a cloud could preempt: Ray Train's preemption watcher, one more process to
# start for every fit (each sweep trial's too), would have nothing to watch.
LOCAL_INSTANCE_VARIABLES = {"RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0"}
_session_dir: str | None = None  # the Ray session this process started or joined (its logs)


def ensure_ray(num_cpus: int | None = None, verbose: bool = False) -> None:
    """Start or join Ray once per process; `num_cpus` sizes a local instance (ignored on a cluster).
    Unless `verbose`, the workers' output stays in Ray's logs (`logs_hint`)."""
    import ray

    if not ray.is_initialized():
        quiet_driver(verbose)  # Ray's own notices at start-up too
        if not verbose:  # the errors of tasks nobody waits for any more (a run that stopped): Ray's logs
            os.environ.setdefault(UNHANDLED_ERRORS_VARIABLE, "1")
        _drop_lines(RAY_INIT_LOGGER, NO_SIGTERM_HANDLER)
        starting_ray(lambda: _init(num_cpus, verbose))  # a signal waits for ray.init to return
    quiet_driver(verbose=workers_print_to_console())


def workers_print_to_console() -> bool:
    """Whether Ray forwards what its workers print to this console (a relay would print it twice); True
    in a Ray worker (a Tune trial), where it is the driver's business."""
    from ray._private import worker  # Ray has no public query for log_to_driver

    driver = worker.global_worker
    if driver.mode != worker.SCRIPT_MODE:
        return True
    printer = getattr(driver, "logger_thread", None)  # started by ray.init(log_to_driver=True)
    return printer is not None and printer.is_alive()


def ray_answers(address: str) -> bool:
    """Whether something listens at a Ray address (a bare host:port is a GCS); `auto` and `local` are
    resolved inside Ray. A first look: Ray Client and ray.init retry a closed port for half a minute."""
    return address in ("auto", "local") or reachable(address if "://" in address else f"tcp://{address}")


def _init(num_cpus: int | None, verbose: bool) -> None:
    import ray

    global _session_dir
    address = os.environ.get("RAY_ADDRESS")
    if address and not ray_answers(address):
        raise MhfError(  # ray.init retries a closed port for half a minute
            f"cannot reach the Ray cluster at RAY_ADDRESS={address} (nothing answers there); start it, or "
            "unset RAY_ADDRESS to run on a local Ray"
        )
    logs = {"logging_level": logging.WARNING, "log_to_driver": verbose}
    if address:
        forwarded = {name: os.environ[name] for name in FORWARDED_VARIABLES if os.environ.get(name)}
        runtime_env = {"env_vars": forwarded} if forwarded else {}
        context = ray.init(address=address, runtime_env=runtime_env, **logs)
    else:
        cpus = num_cpus if num_cpus is not None else (os.cpu_count() or 1) + LOCAL_CPU_HEADROOM
        # "local" starts a new instance even where `ray start` left a cluster that ray.init() would join.
        local_instance_environment()
        hook = {"worker_process_setup_hook": drop_state_api_warnings}
        context = ray.init(address="local", num_cpus=cpus, include_dashboard=False, runtime_env=hook, **logs)
    _session_dir = context.address_info["session_dir"]


def local_instance_environment() -> None:
    """What a local instance's processes inherit (set before it starts; a variable already set wins)."""
    for name, value in LOCAL_INSTANCE_VARIABLES.items():
        os.environ.setdefault(name, value)


def logs_dir() -> str | None:
    """The logs directory of the Ray session this process started or joined (on this node)."""
    return None if _session_dir is None else f"{_session_dir}/logs"


def logs_hint() -> str | None:
    """The console's last line once this process started or joined Ray: where Ray's logs are."""
    if (logs := logs_dir()) is None:
        return None
    where = " on each node" if os.environ.get("RAY_ADDRESS") else ""
    return f"Ray's logs (what its workers printed among them): {logs}{where}"


# Where storage is, for workers on other nodes. Credentials are not forwarded (a runtime_env is visible
# in Ray's dashboard): nodes take theirs from their own environment or instance role.
FORWARDED_VARIABLES = (
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "STORAGE_EMULATOR_HOST",
)


def drop_state_api_warnings() -> None:
    """Run in each worker of a local instance: silence the cleaner's State-API warning (see above)."""
    _drop_lines(PLACEMENT_GROUP_CLEANER_LOGGER, STATE_API_UNAVAILABLE)


@functools.cache  # once per process
def _drop_lines(logger: str, text: str) -> None:
    """A Ray log line that does not apply to how mhf runs it: no type tells it, its text does (a test
    per text fails where Ray rewords it)."""
    logging.getLogger(logger).addFilter(lambda record: text not in record.getMessage())
