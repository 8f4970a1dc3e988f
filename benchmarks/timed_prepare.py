"""One timed `prepare` in a fresh process, for `prepare_throughput.py` to compare two versions of mhf-dist
side by side: run with PYTHONPATH pointing at the tree to measure. Ray is started first and not timed.

    python benchmarks/timed_prepare.py '{"overrides": [...], "out": "...", "cpus": 2}'

Prints one JSON line: seconds, content_sha256 and the manifest's stream tokens. Uses only what every
version measured has: load_config, prepare(cfg, out, num_cpus=..., log=...), ensure_ray(cpus).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from mhf_dist.config import load_config
from mhf_dist.data.prepare import prepare
from mhf_dist.ray_utils import ensure_ray


def main() -> None:
    spec = json.loads(sys.argv[1])
    cfg = load_config("tiny", spec["overrides"])
    ensure_ray(spec["cpus"])
    start = time.perf_counter()
    manifest = prepare(cfg, spec["out"], num_cpus=spec["cpus"], log=lambda _: None)
    seconds = time.perf_counter() - start
    result = {
        "seconds": seconds,
        "content_sha256": manifest.content_sha256,
        "tokens": stream_tokens(manifest),
    }
    print(json.dumps(result))


def stream_tokens(manifest: Any) -> int:
    """Tokens in the prepared streams (the first token of each split's stream is no target)."""
    return sum(
        info.target_tokens + info.dropped_tokens + (1 if info.rows else 0)
        for info in manifest.splits.values()
    )


if __name__ == "__main__":
    main()
