"""Input errors inside a Holoscan graph become one clear message and a non-zero exit, not a traceback.

An operator's compute wrapped with `reports_failures` records a MedserveError on its fragment (the
application) and emits nothing, so downstream operators never run on partial data; the app's entry point then
prints the message and exits non-zero.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from medserve.errors import MedserveError

FAILURE_ATTRIBUTE = "medserve_failure"


def reports_failures(compute: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(compute)
    def wrapper(self: Any, op_input: Any, op_output: Any, context: Any) -> None:
        if getattr(self.fragment, FAILURE_ATTRIBUTE, None) is not None:
            return
        try:
            compute(self, op_input, op_output, context)
        except MedserveError as error:
            setattr(self.fragment, FAILURE_ATTRIBUTE, error)

    return wrapper


def failure_of(application: Any) -> MedserveError | None:
    return getattr(application, FAILURE_ATTRIBUTE, None)
