"""Logging: the text log carries the same fields as the JSON one."""

from __future__ import annotations

import json
import logging

import pytest

from medserve import logs
from medserve.logs import configure_logging


@pytest.fixture
def restored_logging(monkeypatch):
    """configure_logging sets up the whole process: put back what it changes."""
    monkeypatch.delenv("HOLOSCAN_LOG_LEVEL", raising=False)
    root = logging.getLogger()
    handlers = root.handlers[:]
    levels = {name: logging.getLogger(name).level for name in ("", "py.warnings", *logs._LIBRARY_LOGGERS,
                                                                 *logs._ERRORS_ONLY_LOGGERS)}
    yield
    root.handlers[:] = handlers
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)
    logging.captureWarnings(False)


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_extra_fields_reach_both_log_formats(monkeypatch, capsys, restored_logging, log_format):
    """The default selection says in `extra` which series it left aside and why: a text log without it showed
    only that something was left aside."""
    monkeypatch.setenv("MEDSERVE_LOG_FORMAT", log_format)
    configure_logging(0)
    logging.getLogger("medserve.test").warning("series left aside", extra={"series": ["s1: mixed orientations"]})
    [line] = capsys.readouterr().err.splitlines()
    if log_format == "text":
        assert line == 'WARNING medserve.test: series left aside series=["s1: mixed orientations"]'
    else:
        entry = json.loads(line)
        assert (entry["level"], entry["logger"], entry["msg"], entry["series"]) == (
            "warning", "medserve.test", "series left aside", ["s1: mixed orientations"])


def test_a_traceback_follows_the_fields_in_the_text_log(monkeypatch, capsys, restored_logging):
    monkeypatch.setenv("MEDSERVE_LOG_FORMAT", "text")
    configure_logging(0)
    try:
        raise ValueError("bad value")
    except ValueError:
        logging.getLogger("medserve.test").error("failed", exc_info=True, extra={"job": "j1"})
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == 'ERROR medserve.test: failed job="j1"'
    assert lines[1] == "Traceback (most recent call last):" and lines[-1] == "ValueError: bad value"
