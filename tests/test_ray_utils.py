"""The local Ray instance mhf starts: its workers drop the placement-group cleaner's State-API warning."""

from __future__ import annotations

import logging
import subprocess
import sys

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


def test_workers_of_a_local_instance_carry_the_filter():
    script = f"""
import logging, os, ray
os.environ.pop("RAY_ADDRESS", None)
from mhf_dist.ray_utils import ensure_ray
ensure_ray(1)

@ray.remote(num_cpus=1)
def filter_verdicts():
    logger = logging.getLogger({PLACEMENT_GROUP_CLEANER_LOGGER!r})
    messages = ({STATE_API_WARNING!r}, "other")
    return [f(logging.makeLogRecord({{"msg": m}})) for f in logger.filters for m in messages]

print("kept", ray.get(filter_verdicts.remote()))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "kept [False, True]" in done.stdout
