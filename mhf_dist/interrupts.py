"""SIGINT (Ctrl-C) and SIGTERM stop a command with one line `interrupted: ...` (`errors.Interrupted`),
exit 130 or 143. One entry point per phase: `started` (importing the command line: a signal ends the
process at once), `importing` (held until torch's imports return: an exception raised in their C++
callbacks aborts the process), `starting_ray` (held while ray.init runs in a thread of its own), `running`
(SIGTERM unwinds as Ctrl-C does; Ray Train's and Tune's fits stop gracefully in `sigterm_as_sigint` and
`tune_stops_gracefully`) and `finished`. A signal the process was started to ignore (a shell's background
job), or one handled outside Python (None), is left alone until a fit's own stop takes it.

Holding is a Python handler that records the signal, not `pthread_sigmask`: a thread of torch's, pyarrow's
or gRPC's would take the signal anyway, a child started meanwhile (every Ray process) would inherit the
mask, and the kernel keeps one pending signal, so a second Ctrl-C could not end a start-up that hangs.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

from mhf_dist.errors import Interrupted, stopped

SIGNALS = (signal.SIGINT, signal.SIGTERM)
# Tune stops gracefully on SIGUSR1; its SIGINT handler (which would not say SIGINT came) is switched off.
TUNE_STOP_SIGNAL = signal.SIGUSR1
TUNE_SIGINT_VARIABLE = "TUNE_DISABLE_SIGINT_HANDLER"
_holding = False  # whether a `deferred` block is running


def _answering(handler: Any, signals: tuple[int, ...] = SIGNALS) -> dict[int, Any]:
    """`handler` for each of `signals` that the process answers (see the module's docstring)."""
    return {sig: handler for sig in signals if signal.getsignal(sig) not in (signal.SIG_IGN, None)}


def _end(line: str, signum: int) -> None:
    """Exit at once with the one line: no exception crosses C++ code."""
    sys.stderr.write(f"interrupted: {line}\n")
    sys.stderr.flush()
    os._exit(128 + signum)


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()  # the only one Python signals


def started(module: str, name: str) -> Callable[[], Any]:
    """The console scripts' start: `module.name`, imported while a signal ends the process at once."""
    delivered_again_when_swallowed()

    def ended(signum: int, frame: object) -> None:
        _end(f"{signal.Signals(signum).name} while starting; nothing was done", signum)

    with _handling(_answering(ended)):
        return getattr(importlib.import_module(module), name)


def delivered_again_when_swallowed() -> None:
    """An interrupt that C code hands to `sys.unraisablehook` (a Cython module's start-up, a `__del__`)
    would be printed and lost: it is sent again as its signal, from a timer thread, since raising it
    inside the hook would be swallowed again."""
    shown = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        error = unraisable.exc_value
        if not isinstance(error, KeyboardInterrupt | Interrupted):  # a clean-up's own failure is shown
            shown(unraisable)
            return
        sig = error.exit_code - 128 if isinstance(error, Interrupted) else signal.SIGINT
        again = threading.Timer(0.05, signal.pthread_kill, (threading.main_thread().ident, sig))
        again.daemon = True  # a process that has finished by then does not wait for it
        again.start()

    sys.unraisablehook = hook


@contextmanager
def deferred(during: str) -> Iterator[None]:
    """Hold SIGINT and SIGTERM until the block ends (also by an exception), then deliver the first to the
    handlers before it; a second ends the process at once, `during` the block. Nested blocks are one."""
    global _holding
    if not _in_main_thread() or _holding:
        yield
        return
    held: list[int] = []

    def hold(signum: int, frame: object) -> None:
        if held:
            _end(str(stopped(signum, f"stopped {during}")), signum)
        held.append(signum)

    _holding = True
    try:
        with _handling(_answering(hold)):
            yield
    finally:
        _holding = False
        if held:
            signal.raise_signal(held[0])


def importing() -> AbstractContextManager[None]:
    """Around a command's heavy imports (torch, numpy: interrupted half-way, its next import fails)."""
    return deferred("while importing")


def starting_ray(start: Callable[[], None]) -> None:
    """`start()` (ray.init) in a thread of its own while this one holds the signals: Ray sets its SIGTERM
    handler (sys.exit, no line) only when started from the main thread, and no handler can raise inside
    its C++ start-up. The thread then stays, idle: Ray's processes die with the thread that started them
    (PR_SET_PDEATHSIG)."""
    started: Future[None] = Future()

    def start_and_stay() -> None:
        try:
            started.set_result(start())
        except BaseException as error:  # raised in the caller's thread
            started.set_exception(error)
        threading.Event().wait()

    with deferred("while starting Ray"):
        threading.Thread(target=start_and_stay, name="ray-init", daemon=True).start()
        started.result()


@contextmanager
def running() -> Iterator[None]:
    """Around a command: SIGTERM raises `Interrupted` as Ctrl-C raises KeyboardInterrupt (staging is
    removed as it unwinds)."""

    def terminated(signum: int, frame: object) -> None:
        raise stopped(signal.SIGTERM)

    with _handling(_answering(terminated, (signal.SIGTERM,))):
        yield


@dataclass
class Stop:
    """Which signal stopped a fit, if one came, and when (seconds since the epoch)."""

    signal: int | None = None
    at: float | None = None


@contextmanager
def sigterm_as_sigint() -> Iterator[Stop]:
    """SIGTERM takes SIGINT's path, Ray Train's graceful stop. Both handlers are put back after the block
    (Ray Train leaves its own behind); in a Tune trial's thread the sweep's driver owns the signals."""
    stop = Stop()

    def on_sigterm(signum: int, frame: Any) -> None:
        stop.signal = signal.SIGTERM
        signal.raise_signal(signal.SIGINT)

    handlers = {signal.SIGTERM: on_sigterm, signal.SIGINT: signal.getsignal(signal.SIGINT)}
    with _handling(handlers if _in_main_thread() else {}):
        yield stop


@contextmanager
def tune_stops_gracefully() -> Iterator[Stop]:
    """SIGINT or SIGTERM stops a Tune fit as its own signal does (trials stopped, experiment saved, the
    fit returns). One before the fit has set up, or a second (no waiting for the save), is a
    KeyboardInterrupt."""
    stop = Stop()
    if not _in_main_thread():
        yield stop
        return

    def on_signal(signum: int, frame: Any) -> None:
        # TUNE_STOP_SIGNAL reaches this handler only before Tune's own has replaced it
        if stop.signal is not None or signum == TUNE_STOP_SIGNAL:
            raise KeyboardInterrupt
        stop.signal, stop.at = signum, time.time()
        signal.raise_signal(TUNE_STOP_SIGNAL)

    tune_sigint = os.environ.get(TUNE_SIGINT_VARIABLE)
    os.environ[TUNE_SIGINT_VARIABLE] = "1"
    try:
        with _handling(dict.fromkeys((*SIGNALS, TUNE_STOP_SIGNAL), on_signal)):
            yield stop
    finally:
        if tune_sigint is None:
            os.environ.pop(TUNE_SIGINT_VARIABLE)
        else:
            os.environ[TUNE_SIGINT_VARIABLE] = tune_sigint


@contextmanager
def _handling(handlers: dict[int, Any]) -> Iterator[None]:
    """Each handler in place for the block, the one before put back after it; None (installed outside
    Python) can be neither."""
    previous: dict[int, Any] = {}
    try:  # installed inside: a signal between two installs still puts the first one back
        for sig, handler in handlers.items():
            if handler is not None:
                previous[sig] = signal.signal(sig, handler)
        yield
    finally:
        for sig, handler in previous.items():
            if handler is not None:
                signal.signal(sig, handler)


def finished() -> None:
    """The command is done and has said so: a signal while the interpreter exits changes nothing."""
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
