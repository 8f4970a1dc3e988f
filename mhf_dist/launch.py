"""The console scripts' entry points: `mhf` and `mhf-lm-eval` answer Ctrl-C and SIGTERM from their
first instant.

Importing a command line (pyarrow, pydantic; lm-eval's) takes most of a second, before its own signal
handling is in place. A signal in that time ends the process here, with the one line the command lines
print later; nothing has been done yet, so there is nothing to clean up. (Before this module runs, in
the interpreter's own start, a signal has Python's default effect.) Torch, imported later by most
commands, is imported with the signals held (`interrupts.hold_signals_while_importing`).
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

# stdlib and mhf_dist.errors only: quick to import
from mhf_dist.interrupts import (
    SIGNALS,
    answered,
    delivered_again_when_swallowed,
    hold_signals_while_importing,
)


def _while_starting(signum: int, frame: object) -> None:
    sys.stderr.write(f"interrupted: {signal.Signals(signum).name} while starting; nothing was done\n")
    sys.stderr.flush()
    os._exit(128 + signum)


def _imported(module: str, name: str) -> Callable[[], Any]:
    """`module.name`, imported with the start-up handlers in place, which are restored after (a signal
    the process was started to ignore, as a shell's background job ignores SIGINT, stays ignored)."""
    previous = {
        sig: signal.signal(sig, _while_starting) for sig in SIGNALS if answered(signal.getsignal(sig))
    }
    try:
        return getattr(importlib.import_module(module), name)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _finished() -> None:
    """The command is done and has said so: a signal while the interpreter exits changes nothing."""
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def mhf() -> int:
    delivered_again_when_swallowed()
    hold_signals_while_importing()
    status = _imported("mhf_dist.cli", "main")()
    _finished()
    return status


def mhf_lm_eval() -> None:
    delivered_again_when_swallowed()
    hold_signals_while_importing()
    try:
        _imported("mhf_dist.eval.harness", "cli")()
    finally:
        _finished()
