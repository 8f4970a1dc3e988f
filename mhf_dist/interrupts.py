"""Stopping a command by SIGINT (Ctrl-C) or SIGTERM: one line `interrupted: ...`, exit 130 or 143.

The CLI turns SIGTERM into `Interrupted` and SIGINT is Python's KeyboardInterrupt, both raised wherever
the main thread is. Three places must not be unwound that way:
- Ray's start-up (`ray.init`): an exception raised inside its C++ core worker aborts or crashes the
  process. `deferred` holds both signals until the block ends.
- Imports of torch and of the packages whose modules run torch's C++ as they load, and numpy's
  (`HELD_IMPORTS`): torch's C++ calls back into Python, and an exception raised where it cannot pass
  on aborts the process (pybind11's "terminate called after throwing ... error_already_set"); numpy
  interrupted half-way fails its next import with a RuntimeError, a traceback.
  `hold_signals_while_importing` runs those imports under `deferred`.
- A fit of Ray Train or Ray Tune, which stop their workers or trials themselves: Ray Train on SIGINT
  (`sigterm_as_sigint` sends SIGTERM down the same path), Tune on SIGUSR1 (`tune_stops_gracefully`
  sends both there), which then saves its experiment for `mhf sweep --resume`. Both remember which
  signal came.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import shlex
import signal
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from mhf_dist.errors import Interrupted

SIGNALS = (signal.SIGINT, signal.SIGTERM)
# Tune's graceful stop: every fit in the main thread handles it (its SIGINT handler, which would take
# SIGINT without saying it came, is switched off by this variable).
TUNE_STOP_SIGNAL = signal.SIGUSR1
TUNE_SIGINT_VARIABLE = "TUNE_DISABLE_SIGINT_HANDLER"
RERUN = "rerun the command to start again"
HELD_IMPORTS = frozenset({"numpy", "torch", "transformers", "deepspeed"})


class Resumable(Interrupted):
    """Stopped work that the same command line goes on with, `flag` added to it (`--resume`; "": as it
    was); the CLI prints that command after `lead`."""

    def __init__(self, message: str, exit_code: int, flag: str, lead: str = "go on with") -> None:
        super().__init__(message, exit_code)
        self.flag = flag
        self.lead = lead


def stopped(sig: int, what: str = RERUN) -> Interrupted:
    """The `Interrupted` of signal `sig`: its name, then `what` to do next."""
    return Interrupted(f"{signal.Signals(sig).name}; {what}", 128 + sig)


def terminated(signum: int, frame: object) -> None:
    """A SIGTERM handler: unwinds the main thread as Ctrl-C does, so that staging is removed."""
    raise stopped(signal.SIGTERM)


def restated(err: Interrupted | KeyboardInterrupt, what: str) -> Interrupted:
    """The interrupt `err` with `what` to do next in place of its own advice."""
    exit_code = err.exit_code if isinstance(err, Interrupted) else 128 + signal.SIGINT
    return stopped(exit_code - 128, what)


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


def answered(handler: Any) -> bool:
    """Whether mhf may take a signal whose handler is `handler`: not one the process was started to
    ignore (a shell's background job ignores SIGINT), nor one installed outside Python (None)."""
    return handler not in (signal.SIG_IGN, None)


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
            sys.stderr.write(f"interrupted: {stopped(signum, f'stopped {during}')}\n")
            sys.stderr.flush()
            os._exit(128 + signum)
        held.append(signum)

    previous = {sig: signal.getsignal(sig) for sig in SIGNALS}
    _holding = True
    try:
        for sig, handler in previous.items():
            if answered(handler):
                signal.signal(sig, hold)
        yield
    finally:
        _restore(previous)
        _holding = False
        if held:
            signal.raise_signal(held[0])


class _HoldingFinder(importlib.abc.MetaPathFinder):
    """Finds a module of a package in `HELD_IMPORTS` as the finders after it do, and hands it a loader
    that runs it under `deferred`; every other module is left to those finders."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname.partition(".")[0] not in HELD_IMPORTS:
            return None
        for finder in sys.meta_path[sys.meta_path.index(self) + 1 :]:
            find = getattr(finder, "find_spec", None)  # a finder of the old protocol has none
            spec = find(fullname, path, target) if find else None
            if spec is not None:
                if spec.loader is not None and not isinstance(spec.loader, _HoldingLoader):
                    spec.loader = _HoldingLoader(spec.loader)
                return spec
        return None


class _HoldingLoader(importlib.abc.Loader):
    """`loader`, with its module run under `deferred`; everything else it has (`get_source`, resource
    readers) is its own."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        with deferred(f"while importing {module.__name__}"):
            self._loader.exec_module(module)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "_loader":  # copy and pickle look these up before __init__
            raise AttributeError(name)
        return getattr(self._loader, name)


def hold_signals_while_importing() -> None:
    """From now on, importing a module of a package in `HELD_IMPORTS` holds SIGINT and SIGTERM until
    it has finished (the console scripts' start). The held signal is delivered as the import ends,
    which then fails: that package cannot be imported again in this process, which the interrupt
    ends."""
    if not any(isinstance(finder, _HoldingFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _HoldingFinder())


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
    previous = {sig: signal.getsignal(sig) for sig in SIGNALS}

    def on_sigterm(signum: int, frame: Any) -> None:
        stop.signal = signal.SIGTERM
        signal.raise_signal(signal.SIGINT)

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield stop
    finally:
        _restore(previous)


@contextmanager
def tune_stops_gracefully() -> Iterator[Stop]:
    """SIGINT or SIGTERM in the block stops a Tune fit as Tune stops on its own signal (the trials
    stopped, the experiment saved, the fit returns); `Stop.signal` says which came. A signal before
    the fit has set up, or a second one (no waiting for the save), is a KeyboardInterrupt."""
    stop = Stop()
    if not _in_main_thread():
        yield stop
        return
    previous = {sig: signal.getsignal(sig) for sig in (*SIGNALS, TUNE_STOP_SIGNAL)}

    def on_signal(signum: int, frame: Any) -> None:
        if stop.signal is not None:
            raise KeyboardInterrupt
        stop.signal, stop.at = signum, time.time()
        signal.raise_signal(TUNE_STOP_SIGNAL)

    def before_tune(signum: int, frame: Any) -> None:  # Tune's own handler replaces it
        raise KeyboardInterrupt

    for sig in SIGNALS:
        signal.signal(sig, on_signal)
    signal.signal(TUNE_STOP_SIGNAL, before_tune)
    tune_sigint = os.environ.get(TUNE_SIGINT_VARIABLE)
    os.environ[TUNE_SIGINT_VARIABLE] = "1"
    try:
        yield stop
    finally:
        if tune_sigint is None:
            os.environ.pop(TUNE_SIGINT_VARIABLE)
        else:
            os.environ[TUNE_SIGINT_VARIABLE] = tune_sigint
        _restore(previous)


def _restore(handlers: dict[int, Any]) -> None:
    for sig, handler in handlers.items():
        if handler is not None:  # None: a handler installed outside Python, which cannot be put back
            signal.signal(sig, handler)
