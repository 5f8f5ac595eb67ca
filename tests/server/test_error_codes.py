"""Clients branch on error codes: every code the server can answer is listed in the README under its status."""

from __future__ import annotations

import re

from tests.server.conftest import REPO

# ApiError(400, "code", ...), DicomWebError(502, "code", ...) and the core errors' (Class, 422, "code") mapping.
_RAISED = re.compile(r'(?:ApiError|DicomWebError)\(\s*(\d{3}),\s*"([a-z_]+)"|\(\w+Error, (\d{3}), "([a-z_]+)"\)')
# Starlette's own errors, in our shape (errors.http_error_handler names them by their HTTP phrase).
_STARLETTE = {("404", "not_found"), ("405", "method_not_allowed")}


def _codes_in_the_code() -> set[tuple[str, str]]:
    found = set(_STARLETTE)
    for path in (REPO / "medserve" / "server").glob("*.py"):
        for match in _RAISED.finditer(path.read_text()):
            status, code = (match[1], match[2]) if match[1] else (match[3], match[4])
            found.add((status, code))
    return found


def _codes_in_the_readme() -> set[tuple[str, str]]:
    documented = set()
    for row in re.finditer(r"^\| ([\d, ]+) \| (.*) \|$", (REPO / "README.md").read_text(), re.MULTILINE):
        statuses = [status.strip() for status in row[1].split(",")]
        for code in re.findall(r"`([a-z_]+)`", row[2]):
            documented.update((status, code) for status in statuses)
    return documented


def test_every_error_code_is_documented_under_its_status():
    in_code = _codes_in_the_code()
    assert len(in_code) > 50  # the pattern still finds the server's errors
    undocumented = sorted(f"{status} {code}" for status, code in in_code - _codes_in_the_readme())
    assert not undocumented, f"README's error table lacks: {', '.join(undocumented)}"
