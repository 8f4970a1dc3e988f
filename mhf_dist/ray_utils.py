"""Connecting to Ray: a running cluster when RAY_ADDRESS is set, else a local instance."""

from __future__ import annotations

import logging
import os

# Logical CPUs a local instance adds beyond the physical cores: Ray Train's workers each hold one CPU
# for the whole run, and the Ray Data tasks that feed them need slots of their own, or they wait forever.
LOCAL_CPU_HEADROOM = 2


def ensure_ray(num_cpus: int | None = None) -> None:
    """Start or join Ray once per process; `num_cpus` sizes a local instance (ignored on a cluster)."""
    import ray

    if ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS")
    cpus = num_cpus if num_cpus is not None else (os.cpu_count() or 1) + LOCAL_CPU_HEADROOM
    # "local" starts a new instance even where `ray start` left a cluster that ray.init() would join.
    local = {} if address else {"num_cpus": cpus, "include_dashboard": False}
    ray.init(address=address or "local", logging_level=logging.WARNING, **local)
