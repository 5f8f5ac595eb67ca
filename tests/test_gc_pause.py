"""The collector pause: counted across threads, restoring the state found by the first pause."""

from __future__ import annotations

import gc
import threading

import pytest

from medserve.gc_pause import collector_paused


@pytest.fixture(autouse=True)
def collector_enabled_after():
    yield
    gc.enable()


def test_the_collector_is_off_inside_and_on_again_after():
    gc.enable()
    with collector_paused():
        assert not gc.isenabled()
    assert gc.isenabled()


def test_a_failure_inside_still_enables_the_collector_again():
    gc.enable()
    with pytest.raises(KeyError), collector_paused():
        raise KeyError("inside")
    assert gc.isenabled()


def test_a_caller_that_disabled_the_collector_keeps_it_disabled():
    gc.disable()
    with collector_paused():
        pass
    assert not gc.isenabled()


def test_overlapping_pauses_of_two_threads_enable_it_when_the_last_ends():
    """Thread A pauses, B pauses, A ends, B ends: naive save-and-restore would leave it off (B saw it off)."""
    gc.enable()
    b_paused, b_may_end = threading.Event(), threading.Event()
    seen: dict[str, bool] = {}

    def second() -> None:
        with collector_paused():
            b_paused.set()
            b_may_end.wait(10)
            seen["b, after a ended"] = gc.isenabled()

    with collector_paused():
        thread = threading.Thread(target=second)
        thread.start()
        assert b_paused.wait(10)
    seen["a ended, b paused"] = gc.isenabled()
    b_may_end.set()
    thread.join(10)
    assert seen == {"a ended, b paused": False, "b, after a ended": False}
    assert gc.isenabled()


def test_a_child_forked_while_another_thread_pauses_runs_with_the_collector():
    """The pausing thread does not exist in the child: its pause would never end there."""
    import os

    gc.enable()
    paused, may_end = threading.Event(), threading.Event()

    def pausing() -> None:
        with collector_paused():
            paused.set()
            may_end.wait(10)

    thread = threading.Thread(target=pausing)
    thread.start()
    try:
        assert paused.wait(10) and not gc.isenabled()
        child = os.fork()
        if child == 0:
            os._exit(0 if gc.isenabled() else 1)
        _, status = os.waitpid(child, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        may_end.set()
        thread.join(10)
    assert gc.isenabled()
