"""Structured, quiet-by-default logging shared by the CLI, the apps and the server."""

from __future__ import annotations

import json
import logging
import os
import sys
import time

_LIBRARY_LOGGERS = ("holoscan", "monai", "highdicom", "pydicom", "ignite", "urllib3", "httpx")
# The SDK's model factory warns about every bundle folder it cannot classify; bundles are ours to load.
_ERRORS_ONLY_LOGGERS = ("monai.deploy.core.models",)


_RECORD_ATTRIBUTES = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


def extra_fields(record: logging.LogRecord) -> dict[str, object]:
    """The fields a call passed with `extra=`: what the record holds beyond the standard attributes."""
    return {key: value for key, value in vars(record).items() if key not in _RECORD_ATTRIBUTES}


class TextFormatter(logging.Formatter):
    """`LEVEL logger: message`, then any `extra=` fields as key=JSON: the text log says what the JSON one does
    (which series the default selection left aside, and why)."""

    def __init__(self) -> None:
        super().__init__("%(levelname)s %(name)s: %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        fields = "".join(f" {key}={json.dumps(value, default=str)}" for key, value in extra_fields(record).items())
        return super().formatMessage(record) + fields


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message and any `extra=` fields."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        entry.update(extra_fields(record))
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def log_level(verbosity: int | None) -> int:
    """INFO for -v, DEBUG for -vv, ERROR for -1 (errors only), WARNING for 0. None (no flag given): the level
    MEDSERVE_LOG_LEVEL names (a container's default), else WARNING; a flag wins over the variable."""
    if verbosity is None:
        named = os.environ.get("MEDSERVE_LOG_LEVEL", "").strip().upper()
        return logging.getLevelNamesMapping().get(named, logging.WARNING)
    return {-1: logging.ERROR, 0: logging.WARNING, 1: logging.INFO}.get(verbosity, logging.DEBUG)


def sdk_log_level(level: int) -> str:
    """The App SDK's --log-level for a logging level."""
    if level >= logging.ERROR:
        return "ERROR"
    return "WARN" if level >= logging.WARNING else "INFO" if level >= logging.INFO else "DEBUG"


def _json_format() -> bool:
    return os.environ.get("MEDSERVE_LOG_FORMAT", "text") == "json"


def announce(logger: logging.Logger, message: str, **fields: object) -> None:
    """A line for whoever started the process, on stderr at any log level (where a server listens): as it is in
    the text format, and with MEDSERVE_LOG_FORMAT=json one object like the log's records, `fields` included."""
    if _json_format():
        message = JsonFormatter().format(logger.makeRecord(logger.name, logging.INFO, "", 0, message, None, None,
                                                          extra=fields))
    print(message, file=sys.stderr, flush=True)


def configure_logging(verbosity: int | None = None) -> int:
    """Set up logging at `log_level(verbosity)` and return that level; MEDSERVE_LOG_FORMAT=json for
    machine-readable logs. Holoscan's own logger follows (HOLOSCAN_LOG_LEVEL: set outright for a flag, kept
    when set and no flag was given)."""
    level = log_level(verbosity)
    handler = logging.StreamHandler(sys.stderr)
    if _json_format():
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for name in _LIBRARY_LOGGERS:
        logging.getLogger(name).setLevel(max(level, logging.WARNING))
    for name in _ERRORS_ONLY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR if level > logging.DEBUG else logging.DEBUG)
    # Libraries' deprecation chatter (MONAI, Holoscan) shows only when asked for with -v.
    logging.captureWarnings(True)
    logging.getLogger("py.warnings").setLevel(logging.WARNING if level <= logging.INFO else logging.ERROR)
    holoscan_level = "DEBUG" if level <= logging.DEBUG else "INFO" if level <= logging.INFO else "ERROR"
    if verbosity is None:
        os.environ.setdefault("HOLOSCAN_LOG_LEVEL", holoscan_level)
    else:
        os.environ["HOLOSCAN_LOG_LEVEL"] = holoscan_level
    return level
