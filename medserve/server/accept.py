"""Content negotiation of a result's format from the HTTP Accept header (RFC 9110 section 12.5.1).

`seg` is sent as application/dicom, `nifti` as application/gzip; a NIfTI media type (application/x-nifti, say)
asks for `nifti` too. A header that names formats the result lacks, or refuses (q=0) the ones it has, is a 406
(RFC 9110 allows ignoring it instead, but that would send what the client said it cannot use). A header that
names neither type nor a wildcard (application/json, text/html) gets the natural result, as if there were none:
refusing it would break clients that send one fixed Accept everywhere.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

from medserve.server.errors import ApiError

_ITEM = re.compile(r'(?:[^,"]|"[^"]*")+')  # one comma-separated item; a quoted parameter may hold commas
_WILDCARDS = ("*/*", "application/*")


def preferred_format(accept: str, available: Sequence[str]) -> str:
    """The format of `available` (the natural one first) that `accept` prefers: the highest q-value, then the
    first named; the natural one when the header names no format; else 406 `format_unavailable`."""
    named: dict[str, tuple[float, int]] = {}  # format -> (q, position) of the first type naming it
    wildcard: tuple[float, int] | None = None
    for position, item in enumerate(_ITEM.findall(accept.lower())):
        media, *parameters = (part.strip() for part in item.split(";"))
        quality = _quality(parameters)
        if media in _WILDCARDS:
            wildcard = wildcard or (quality, position)
        elif (fmt := _format_of(media)) is not None:
            named.setdefault(fmt, (quality, position))
    if not named and wildcard is None:
        return available[0]
    wanted = []
    for order, fmt in enumerate(available):
        quality, position = named.get(fmt) or wildcard or (0.0, 0)
        if quality > 0:
            wanted.append((-quality, position, order, fmt))
    if wanted:
        return min(wanted)[3]
    raise ApiError(406, "format_unavailable", f"the Accept header accepts none of the formats this result has "
                   f"({', '.join(available)}: application/dicom for seg, application/gzip for nifti)")


def _format_of(media: str) -> str | None:
    if media == "application/dicom":
        return "seg"
    if "nifti" in media or "gzip" in media:
        return "nifti"
    return None


def _quality(parameters: list[str]) -> float:
    """The item's q-value, clamped to 0..1; one that is not a finite number ('abc', 'nan') is ignored (1), as a
    lenient reader does."""
    for parameter in parameters:
        name, _, value = parameter.partition("=")
        if name.strip() == "q":
            try:
                quality = float(value.strip())
            except ValueError:
                return 1.0
            return min(max(quality, 0.0), 1.0) if math.isfinite(quality) else 1.0
    return 1.0
