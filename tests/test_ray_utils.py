"""The local Ray instance mhf starts: its workers drop the placement-group cleaner's State-API warning and
keep their output off the console."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

from mhf_dist.ray_utils import PLACEMENT_GROUP_CLEANER_LOGGER, drop_state_api_warnings

STATE_API_WARNING = (
    "Failed to query Ray Train Controller actor state. State API may be temporarily unavailable. "
    "Continuing to monitor."
)


def test_the_filter_drops_only_the_state_api_warning(caplog):
    logger = logging.getLogger(PLACEMENT_GROUP_CLEANER_LOGGER)
    filters = list(logger.filters)
    try:
        drop_state_api_warnings()
        with caplog.at_level(logging.WARNING, logger=PLACEMENT_GROUP_CLEANER_LOGGER):
            logger.warning(STATE_API_WARNING)
            logger.warning("Failed to clean up placement group: boom")
        assert [record.getMessage() for record in caplog.records] == [
            "Failed to clean up placement group: boom"
        ]
    finally:
        logger.filters = filters


def test_a_local_instance_keeps_its_workers_output_in_its_logs_and_their_filter_on():
    """What mhf starts: the workers drop the cleaner's warning; what they print stays in Ray's logs
    (the last line says where), and mhf's own lines reach the console through the relay, labelled."""
    script = f"""
import logging, os, sys, ray
os.environ.pop("RAY_ADDRESS", None)
from mhf_dist.console import ConsoleRelay
from mhf_dist.ray_utils import ensure_ray, logs_hint
ensure_ray(1)

@ray.remote(num_cpus=1)
def filter_verdicts(say):
    print("a worker's own output", flush=True)
    say("a line for the console")
    logger = logging.getLogger({PLACEMENT_GROUP_CLEANER_LOGGER!r})
    messages = ({STATE_API_WARNING!r}, "other")
    return [f(logging.makeLogRecord({{"msg": m}})) for f in logger.filters for m in messages]

with ConsoleRelay() as relay:  # one write, as the relay's own: the two threads' lines stay whole
    sys.stdout.write(f"kept {{ray.get(filter_verdicts.remote(relay.lines.labelled('run')))}}\\n")
print(logs_hint())
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert "kept [False, True]" in lines
    assert lines.count("[run] a line for the console") == 1 and "a worker's own output" not in done.stdout
    assert "Token authentication" not in done.stderr  # Ray's note on ~/.ray's token, where there is one
    assert "SIGTERM" not in done.stderr  # ray.init's notice, started off the main thread on purpose
    assert lines[-1].startswith("Ray's logs") and lines[-1].endswith("/logs")
    logs = Path(lines[-1].rsplit(" ", 1)[1])
    printed = [path.read_text() for path in logs.glob("worker-*.out")]
    assert sum("a worker's own output\na line for the console\n" in text for text in printed) == 1
