"""Corpus readers. The built-in corpus needs no network: it ships with every Python install."""

from __future__ import annotations

import pydoc_data.topics

BUILTIN_NAME = "builtin"


def builtin_documents() -> list[str]:
    """The Python documentation topics shipped in the standard library (`pydoc_data.topics`).

    About 80 English documents, 0.47M characters, in a fixed (sorted-by-topic) order.
    """
    topics = pydoc_data.topics.topics
    return [topics[name].strip() for name in sorted(topics) if topics[name].strip()]
