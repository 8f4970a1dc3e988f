"""Stopping a command by SIGINT (Ctrl-C) or SIGTERM: one line `interrupted: ...`, exit 130 or 143. This
module owns both signals, with one entry point per phase of a command:

- `started` (importing the command line): a signal ends the process at once, with the one line.
- `importing` (a command's heavy imports): torch's C++ calls back into Python as it loads, and an
  exception raised there aborts the process (pybind11's "terminate called after throwing ...
  error_already_set"); numpy interrupted half-way fails its next import. The signals are held until
  the imports have finished (`deferred`).
- `starting_ray` (`ray.init`): an exception raised inside its C++ core worker crashes the process, and
  ray.init puts its own SIGTERM handler (sys.exit) in place from its first line. Held the same way,
  with the caller's SIGTERM handler kept.
- `running`: SIGTERM unwinds the main thread as Ctrl-C does (`Interrupted`), so that staging is removed.
  A fit of Ray Train or Tune stops its workers or trials itself: Ray Train on SIGINT
  (`sigterm_as_sigint` sends SIGTERM down that path), Tune on SIGUSR1 (`tune_stops_gracefully`).
- `finished` (the interpreter exits): a signal changes nothing.

Holding is a Python handler that records the signal, not `signal.pthread_sigmask`: a process-directed
signal goes to any thread that does not block it (torch, pyarrow and gRPC start threads of their own
as they load), whose C handler then makes the main thread run the Python handler inside the import all
the same; a child started while the signals are blocked inherits the mask (every Ray process started
inside ray.init would ignore SIGTERM); and the kernel keeps one pending instance of a signal, so a
second Ctrl-C could not end a start-up that hangs.
"""

from __future__ import annotations

import importlib
import os
import shlex
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from mhf_dist.errors import Interrupted

SIGNALS = (signal.SIGINT, signal.SIGTERM)
# Tune's graceful stop: every fit in the main thread handles it (its SIGINT handler, which would take
# SIGINT without saying it came, is switched off by this variable).
TUNE_STOP_SIGNAL = signal.SIGUSR1
TUNE_SIGINT_VARIABLE = "TUNE_DISABLE_SIGINT_HANDLER"


class Resumable(Interrupted):
    """Stopped work that the same command line goes on with, `flag` added to it (`--resume`; "": as it
    was); the CLI prints that command after `lead`."""

    def __init__(self, message: str, exit_code: int, flag: str, lead: str = "go on with") -> None:
        super().__init__(message, exit_code)
        self.flag = flag
        self.lead = lead


def stopped(sig: int, what: str = "rerun the command to start again") -> Interrupted:
    """The `Interrupted` of signal `sig`: its name, then `what` to do next."""
    return Interrupted(f"{signal.Signals(sig).name}; {what}", 128 + sig)


@contextmanager
def advising(what: str) -> Iterator[None]:
    """An interrupt of the block says `what` to do next in place of its own advice."""
    try:
        yield
    except (KeyboardInterrupt, Interrupted) as err:
        raise stopped(err.exit_code - 128 if isinstance(err, Interrupted) else signal.SIGINT, what) from None


def as_interrupted(err: BaseException) -> Interrupted | None:
    """`err` as the CLI reports it: an `Interrupted` as it is, a KeyboardInterrupt as SIGINT's; or the
    interrupt `err` was raised while handling (a library's clean-up that failed as the interrupt
    unwound through it); None for anything else."""
    seen: set[int] = set()
    cause: BaseException | None = err
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, Interrupted):
            return cause
        if isinstance(cause, KeyboardInterrupt):
            return stopped(signal.SIGINT)
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return None


def console_line(stop: Interrupted, argv: Sequence[str]) -> str:
    """What the CLI prints after `interrupted: `; a `Resumable` names the whole command that goes on."""
    if not isinstance(stop, Resumable):
        return str(stop)
    words = ["mhf", *argv, stop.flag] if stop.flag and stop.flag not in argv else ["mhf", *argv]
    return f"{stop}; {stop.lead}: {shlex.join(words)}"


def answered(handler: Any) -> bool:
    """Whether mhf may take a signal whose handler is `handler`: not one the process was started to
    ignore (a shell's background job ignores SIGINT), nor one installed outside Python (None)."""
    return handler not in (signal.SIG_IGN, None)


def _end(line: str, signum: int) -> None:
    """End the process now with its one line: nothing is unwound (no exception crosses C++ code)."""
    sys.stderr.write(f"interrupted: {line}\n")
    sys.stderr.flush()
    os._exit(128 + signum)


# Phase 1, importing the command line.
def started(module: str, name: str) -> Callable[[], Any]:
    """The console scripts' start: `module.name`, imported while a signal ends the process at once
    (nothing has been done yet); C code's swallowed interrupts are sent again from now on."""
    delivered_again_when_swallowed()

    def ended(signum: int, frame: object) -> None:
        _end(f"{signal.Signals(signum).name} while starting; nothing was done", signum)

    with _handling({sig: ended for sig in SIGNALS if answered(signal.getsignal(sig))}):
        return getattr(importlib.import_module(module), name)


def delivered_again_when_swallowed() -> None:
    """C code that cannot pass an exception on (a Cython module's start-up, an object's `__del__`)
    hands it to `sys.unraisablehook`, which prints a traceback and goes on: a Ctrl-C or SIGTERM that
    lands there would be lost. Such an interrupt is sent again as its signal, a moment later from a
    timer thread: raising it here would only be swallowed again, inside the hook."""
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


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


_holding = False  # whether a `deferred` block is running (in the main thread)


@contextmanager
def deferred(during: str) -> Iterator[None]:
    """Hold SIGINT and SIGTERM until the block ends, then deliver the first that came to the handlers
    that were in place before it, also when the block raised (its exception becomes the interrupt's
    context). A second signal while the block still runs (a start-up that hangs) ends the process at
    once, with the one line, which says it came `during` the block ("while starting Ray"). A block
    inside another is held as part of it. A signal the process ignores (a background job of a shell
    without job control ignores SIGINT) stays ignored, and so does one whose handler is not Python's."""
    global _holding
    if not _in_main_thread() or _holding:  # only the main thread receives signals in Python
        yield
        return
    held: list[int] = []

    def hold(signum: int, frame: object) -> None:
        if held:
            _end(str(stopped(signum, f"stopped {during}")), signum)
        held.append(signum)

    previous = {sig: signal.getsignal(sig) for sig in SIGNALS}
    _holding = True
    try:
        with _handling({sig: hold if answered(handler) else handler for sig, handler in previous.items()}):
            yield
    finally:
        _holding = False
        if held:
            signal.raise_signal(held[0])


# Phase 2, a command's heavy imports (torch and what loads it, numpy).
def importing() -> Any:
    """Around a command's imports: a signal is held until they have finished (see the module's text)."""
    return deferred("while importing")


# Phase 3, starting Ray.
@contextmanager
def starting_ray() -> Iterator[None]:
    """Around ray.init: a signal is held until it returns. ray.init's SIGTERM handler (sys.exit, from
    its first line) is never put in place: Ray has no switch for it, so its one registration point is
    patched for the block; the caller's handler (the CLI's: one line, exit 143) stays."""
    from ray._private import utils

    with deferred("while starting Ray"):
        register, handler = utils.set_sigterm_handler, signal.getsignal(signal.SIGTERM)
        utils.set_sigterm_handler = lambda handler: None
        try:
            yield
        finally:
            utils.set_sigterm_handler = register
            signal.signal(signal.SIGTERM, handler)  # should a later Ray register elsewhere


# Phase 4, running.
def _terminated(signum: int, frame: object) -> None:
    raise stopped(signal.SIGTERM)


@contextmanager
def running() -> Iterator[None]:
    """Around a command: SIGTERM raises `Interrupted` in the main thread as Ctrl-C raises
    KeyboardInterrupt, unless the process was started to ignore it (then it goes on ignoring it)."""
    previous = signal.getsignal(signal.SIGTERM)
    with _handling({signal.SIGTERM: _terminated if answered(previous) else previous}):
        yield


@dataclass
class Stop:
    """Which signal stopped a fit, if one came, and when (seconds since the epoch)."""

    signal: int | None = None
    at: float | None = None


@contextmanager
def sigterm_as_sigint() -> Iterator[Stop]:
    """SIGTERM in the block takes SIGINT's path, which Ray Train and Tune handle as a graceful stop;
    `Stop.signal` says which one came. The handlers of both signals are put back after the block (Ray
    Train leaves its own SIGINT handler behind)."""
    stop = Stop()
    if not _in_main_thread():  # a Tune trial: the sweep's driver owns the signals
        yield stop
        return

    def on_sigterm(signum: int, frame: Any) -> None:
        stop.signal = signal.SIGTERM
        signal.raise_signal(signal.SIGINT)

    with _handling({signal.SIGTERM: on_sigterm, signal.SIGINT: signal.getsignal(signal.SIGINT)}):
        yield stop


@contextmanager
def tune_stops_gracefully() -> Iterator[Stop]:
    """SIGINT or SIGTERM in the block stops a Tune fit as Tune stops on its own signal (the trials
    stopped, the experiment saved, the fit returns); `Stop.signal` says which came. A signal before
    the fit has set up, or a second one (no waiting for the save), is a KeyboardInterrupt."""
    stop = Stop()
    if not _in_main_thread():
        yield stop
        return

    def on_signal(signum: int, frame: Any) -> None:
        if stop.signal is not None:
            raise KeyboardInterrupt
        stop.signal, stop.at = signum, time.time()
        signal.raise_signal(TUNE_STOP_SIGNAL)

    def before_tune(signum: int, frame: Any) -> None:  # Tune's own handler replaces it
        raise KeyboardInterrupt

    with _handling({signal.SIGINT: on_signal, signal.SIGTERM: on_signal, TUNE_STOP_SIGNAL: before_tune}):
        tune_sigint = os.environ.get(TUNE_SIGINT_VARIABLE)
        os.environ[TUNE_SIGINT_VARIABLE] = "1"
        try:
            yield stop
        finally:
            if tune_sigint is None:
                os.environ.pop(TUNE_SIGINT_VARIABLE)
            else:
                os.environ[TUNE_SIGINT_VARIABLE] = tune_sigint


@contextmanager
def _handling(handlers: dict[int, Any]) -> Iterator[None]:
    """Each signal's handler in `handlers` in place for the block, the one before put back after it (a
    handler installed outside Python, None, can be neither: it is left alone)."""
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


# Phase 5, finished.
def finished() -> None:
    """The command is done and has said so: a signal while the interpreter exits changes nothing."""
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
