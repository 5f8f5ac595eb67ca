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


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message and any `extra=` fields."""

    _RESERVED = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        entry.update({k: v for k, v in vars(record).items() if k not in self._RESERVED})
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure_logging(verbosity: int = 0) -> None:
    """WARNING by default, INFO with -v, DEBUG with -vv, ERROR with -1 (errors only); MEDSERVE_LOG_FORMAT=json
    for machine-readable logs."""
    level = {-1: logging.ERROR, 0: logging.WARNING, 1: logging.INFO}.get(verbosity, logging.DEBUG)
    level = getattr(logging, os.environ.get("MEDSERVE_LOG_LEVEL", "").upper(), level)
    handler = logging.StreamHandler(sys.stderr)
    if os.environ.get("MEDSERVE_LOG_FORMAT", "text") == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
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
    os.environ.setdefault("HOLOSCAN_LOG_LEVEL", {logging.DEBUG: "DEBUG", logging.INFO: "INFO"}.get(level, "ERROR"))
