"""Connecting to Ray: a running cluster when RAY_ADDRESS is set, else a local instance."""

from __future__ import annotations

import logging
import os


def ensure_ray(num_cpus: int | None = None) -> None:
    """Start or join Ray once per process; `num_cpus` sizes a local instance (ignored on a cluster)."""
    import ray

    if ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS")
    local = {} if address else {"num_cpus": num_cpus, "include_dashboard": False}
    ray.init(address=address, logging_level=logging.WARNING, **local)
