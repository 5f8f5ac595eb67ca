"""Ctrl-C and SIGTERM end a program with its clean-up done and the conventional exit status 128 + N.

Two mechanisms: a Holoscan application's (below), and `termination_as_interrupt` for the CLI's other
commands, which run no graph and can let SIGTERM/SIGHUP raise where the code is, as Ctrl-C does.

Left to Holoscan, SIGINT reaches its executor's own handler: it asks the graph to stop, waits 3 seconds for the
operator that is busy (a bundle's inference takes minutes), then ends the process from C++ with status 1 and
"Application did not shut down within 3 seconds of interrupt. Forcing exit...". Python's `finally` blocks and
`atexit` never run, so an interrupted run left its output folder, and partial files, behind.

Instead an app blocks both signals in every thread and lets one watcher thread take them with `sigwait`: it runs
the app's clean-up and ends the process with 128 + the signal number, what a shell reports for a process ended by
that signal. A thread inherits its creator's signal mask, and importing torch, Holoscan or the SDK starts threads,
so `block_stop_signals()` must run before those imports; an app calls it only when run as a program. Child
processes inherit the mask too: the app's path starts none, and code that adds one must unblock both signals in
the child (`subprocess`'s `preexec_fn`), or Ctrl-C and SIGTERM will not reach it.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

# SIGHUP (a closed terminal, a dropped SSH session) too: Holoscan installs a C handler that ignores it, so a run
# went on to its end, its output written for no one.
STOP_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM, signal.SIGHUP})


def block_stop_signals() -> None:
    """Block SIGINT, SIGTERM and SIGHUP in this thread and every thread it starts from now on."""
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)


def watch_stop_signals(clean_up: Callable[[signal.Signals], None]) -> bool:
    """On the first SIGINT, SIGTERM or SIGHUP, run `clean_up(signal)` in a watcher thread, then end the process
    with status 128 + its number. Does nothing, and returns False, unless `block_stop_signals()` ran first in this
    thread (an app's main() called from a test or another program keeps Python's own KeyboardInterrupt)."""
    if not STOP_SIGNALS <= signal.pthread_sigmask(signal.SIG_BLOCK, []):
        return False

    def watch() -> None:
        received = signal.Signals(signal.sigwait(STOP_SIGNALS))
        try:
            clean_up(received)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(128 + received)  # skips the interpreter's shutdown, which would wait on the graph's threads

    threading.Thread(target=watch, name="stop-signals", daemon=True).start()
    return True


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP (a closed terminal), handled like Ctrl-C; `signum` gives the exit status 128 + N."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


_TERMINATING = (signal.SIGTERM, signal.SIGHUP)


@contextmanager
def termination_as_interrupt() -> Iterator[None]:
    """For the CLI's commands that run no Holoscan graph (package, push, run, inspect; the server's client):
    SIGTERM and SIGHUP raise Terminated where the code is, so the clean-up that Ctrl-C runs (temporary folders,
    containers, partial downloads) runs for them too, instead of the process dying with its containers, build
    context or half-written files left behind."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield
        return

    def interrupt(signum: int, frame: object) -> None:
        for repeated in _TERMINATING:  # a second SIGTERM must not cut the clean-up the first one started short
            signal.signal(repeated, signal.SIG_IGN)
        raise Terminated(signum)

    previous = {signum: signal.signal(signum, interrupt) for signum in _TERMINATING}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def terminable(command: Callable[[Any], int]) -> Callable[[Any], int]:
    """A CLI command that SIGTERM/SIGHUP end as Ctrl-C does, with its clean-up (partial files, folders it made,
    containers)."""

    @functools.wraps(command)
    def run_terminable(args: Any) -> int:
        with termination_as_interrupt():
            return command(args)

    return run_terminable
