"""Failures inside a Holoscan graph: as the stock operators raise them, or, for an app that watches its runs, one
clear message and a non-zero exit rather than a traceback.

By default an operator's error propagates as a stock operator's does: Holoscan logs it and re-raises it out of
`Application.run()`, so a user's own graph fails loudly. An app that calls `watch_failures(app)` takes the
reporting over for its runs (apps/bundle_seg does): an operator's compute wrapped with `reports_failures` then
records the first failure on its fragment (the application), emits nothing and stops the fragment, so
downstream operators never run on partial data and operators waiting for the failed one's output do not wait
forever; the app's entry point then prints the message, removes the files this run wrote, and exits non-zero. A
MedserveError is the user's input (exit 2); anything else is a fault of ours or of a library (exit 1), reported
with the operator's name and kept with its traceback for the debug log.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from monai.deploy.core import Operator

from medserve.errors import MedserveError

log = logging.getLogger("medserve.app")

_RUN_ATTRIBUTE = "medserve_run"


@dataclass(frozen=True)
class Failure:
    """The first error of a run, and where it was raised ("operator NAME", or "the application")."""

    where: str
    error: BaseException

    @property
    def is_input_error(self) -> bool:
        return isinstance(self.error, MedserveError)

    @property
    def exit_status(self) -> int:
        return 2 if self.is_input_error else 1

    def message(self) -> str:
        if self.is_input_error:
            return str(self.error)
        return (f"internal error in {self.where}: {type(self.error).__name__}: {self.error} "
                f"(run with --log-level DEBUG for the traceback)")


@dataclass
class RunRecord:
    """What one run of an app has done so far: the first failure (when watched), and the output files written."""

    failure: Failure | None = None
    outputs: list[Path] = field(default_factory=list)
    watched: bool = False  # failures are recorded here, not raised out of Application.run()
    ended: bool = False  # an operator of the run it describes has stopped: the next start begins a new run

    def clear(self) -> None:
        self.failure = None
        self.outputs.clear()
        self.ended = False

    def fail(self, where: str, error: Exception) -> None:
        """Keep the run's first failure; an internal one's traceback goes to the debug log."""
        if not isinstance(error, MedserveError):
            log.debug("%s failed", where, exc_info=error)
        if self.failure is None:
            self.failure = Failure(where=where, error=error)


def run_record(fragment: Any) -> RunRecord:
    """The current run's record (an unwatched one when `watch_failures` was not called)."""
    record = getattr(fragment, _RUN_ATTRIBUTE, None)
    if record is None:
        record = RunRecord()
        setattr(fragment, _RUN_ATTRIBUTE, record)
    return record


def watch_failures(fragment: Any) -> RunRecord:
    """Take over failure reporting for `fragment`'s runs: the first failure is recorded in the returned record,
    with the files the run wrote, instead of being raised. The record describes the latest run: it is cleared
    as the next run's operators start (see RunEndingOperator), so an earlier run's failure cannot silence the next
    one (its operators would skip every compute), nor its files be taken for the next one's. Calling it again
    returns the same record, cleared."""
    record = getattr(fragment, _RUN_ATTRIBUTE, None)
    if record is None or not record.watched:
        record = RunRecord(watched=True)
        setattr(fragment, _RUN_ATTRIBUTE, record)
    record.clear()
    return record


class RunEndingOperator(Operator):
    """The base of our operators: it keeps a watched run record to the run it describes. Holoscan calls stop()
    on an operator when it is done, which under the greedy scheduler can be while other branches of the same run
    still compute (a source whose CountCondition is spent), and start() on every operator of a run before any
    compute. So stop() only marks the record ended, and the first of our operators to start in the next run
    clears it."""

    def start(self) -> None:
        record = run_record(self.fragment)
        if record.ended:
            record.clear()

    def stop(self) -> None:
        run_record(self.fragment).ended = True


def reports_failures(compute: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(compute)
    def wrapper(self: Any, op_input: Any, op_output: Any, context: Any) -> None:
        record = run_record(self.fragment)
        if not record.watched:
            compute(self, op_input, op_output, context)
            return
        if record.failure is not None:
            return
        try:
            compute(self, op_input, op_output, context)
        except Exception as error:  # noqa: BLE001 - every failure ends the run with a message; see module doc
            record.fail(f"operator {self.name}", error)
            # Operators still holding messages (a writer beside the failed one) would otherwise wait forever.
            self.fragment.stop_execution()

    return wrapper


def records_output(fragment: Any, path: Path) -> Path:
    """Note a file written by this run (removed again if the run fails later)."""
    run_record(fragment).outputs.append(path)
    return path
