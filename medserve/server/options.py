"""What a study request asks for beside its input: the result's format (`?format=`, a form or JSON field, else
Accept) and whether a job writes its SEG back to the DICOMweb store."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request

from medserve.results import RESULT_MEDIA
from medserve.server.accept import preferred_format
from medserve.server.errors import ApiError
from medserve.server.inputs import InputSpec


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def check_format(fmt: Any) -> str:
    if not isinstance(fmt, str) or fmt not in RESULT_MEDIA:
        raise ApiError(400, "bad_format", f"format must be 'seg' or 'nifti', not {fmt!r}")
    return fmt


def requested_format(options: dict[str, Any]) -> str | None:
    """The `?format=` or form/JSON field, checked: known before the study is read, so a bad one is refused first."""
    fmt = options.get("format")
    return None if fmt is None else check_format(fmt)


def choose_format(request: Request, options: dict[str, Any], spec: InputSpec) -> str:
    """`?format=` / form field wins, then Accept, then the natural output of the input (SEG for DICOM)."""
    fmt = requested_format(options) or preferred_format(request.headers.get("accept", ""), _formats_of(spec))
    check_available(fmt, spec)
    return fmt


def _formats_of(spec: InputSpec) -> list[str]:
    return ["nifti"] if spec.kind == "nifti" else ["seg", "nifti"]


def check_available(fmt: str, spec: InputSpec) -> None:
    if fmt not in _formats_of(spec):
        raise ApiError(406, "format_unavailable", "a NIfTI input can only produce a NIfTI label map")


def writeback_option(options: dict[str, Any]) -> bool:
    """`?writeback=` or the form/JSON field: a boolean (JSON) or one of the usual words; anything else is a 400
    rather than a silent "no"."""
    value = options.get("writeback", False)
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    raise ApiError(400, "bad_parameter", f"writeback {value!r}: expected true or false")
