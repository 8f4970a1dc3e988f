"""A JSON record written whole (`write_json_atomic`, published as `storage.Location.write_bytes`
publishes). Reading one: `mhf_dist.readers`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mhf_dist.storage import Location


def write_json_atomic(path: str | Path | Location, payload: dict[str, Any]) -> None:
    Location.of(path).write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
