"""What every benchmark script shares: writing its JSON results with the machine they came from."""

from __future__ import annotations

import platform
from pathlib import Path
from typing import Any

import torch

from mhf_dist.files import write_json_atomic


def write_results(path: Path, payload: dict[str, Any]) -> None:
    """Write `payload` plus machine facts to `path` atomically (temp file, then rename)."""
    payload = {
        **payload,
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, payload)
    print(f"wrote {path}")
