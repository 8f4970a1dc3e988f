"""Byte sizes as users write them (`1048576`, `500MB`, `5GiB`), read by transformers' own parser, so that
`mhf export-hf --max-shard-size` means what `save_pretrained(max_shard_size=...)` does. Kept apart from
`hf_layout` (which imports torch and the transformers models) so the CLI checks a size at once."""

from __future__ import annotations

import re

from mhf_dist.errors import MhfError


def byte_size(size: int | str, error: type[MhfError] = MhfError) -> int:
    """`size` in bytes: an int, a string of digits, or a number with KB, MB, GB (or KiB, MiB, GiB); any
    other, or one not above 0, is `error`."""
    from transformers.utils.hub import convert_file_size_to_int

    try:
        digits = isinstance(size, str) and re.fullmatch(r"[+-]?\d+", size.strip())
        value = None if isinstance(size, bool) else convert_file_size_to_int(int(size) if digits else size)
    except (ValueError, AttributeError):  # AttributeError: neither an int nor a string
        value = None
    if not isinstance(value, int):
        raise error(
            f"max shard size {size!r} is not a size; give bytes or a number with KB, MB or GB, e.g. 500MB"
        )
    if value <= 0:
        raise error(f"max shard size {size!r} is {value} bytes; give a size above 0, e.g. 500MB")
    return value
