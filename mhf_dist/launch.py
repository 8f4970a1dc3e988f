"""The console scripts' entry points, `mhf` and `mhf-lm-eval`: they answer Ctrl-C and SIGTERM from their
first instant (`interrupts` says how in each phase)."""

from __future__ import annotations

from mhf_dist import interrupts  # stdlib and mhf_dist.errors only: quick to import


def mhf() -> int:
    status = interrupts.started("mhf_dist.cli", "main")()
    interrupts.finished()
    return status


def mhf_lm_eval() -> None:
    try:
        interrupts.started("mhf_dist.eval.harness", "cli")()
    finally:
        interrupts.finished()
