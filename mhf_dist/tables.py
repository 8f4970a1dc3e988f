"""Plain-text tables for terminals and Markdown files."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def _cell(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if not isinstance(value, int | float):
        return str(value)
    if abs(value) >= 1e12 or 0 < abs(value) < 1e-3:  # no 25-digit numbers, no 0.0000
        return f"{value:.2e}"
    return f"{value:,.0f}" if isinstance(value, int) or abs(value) >= 1e4 else f"{value:.4f}"


def markdown_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> str:
    """A Markdown table (also readable in a terminal) of `columns` from each row."""
    cells = [[_cell(row.get(column, "")) for column in columns] for row in rows]
    widths = [max(len(column), *(len(row[i]) for row in cells)) for i, column in enumerate(columns)]

    def line(texts: Sequence[str]) -> str:
        return "| " + " | ".join(text.ljust(w) for text, w in zip(texts, widths, strict=True)) + " |"

    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(columns), rule, *map(line, cells)])
