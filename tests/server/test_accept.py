"""Content negotiation of the result format (medserve.server.accept), as a plain function."""

from __future__ import annotations

import pytest

from medserve.server.accept import preferred_format
from medserve.server.errors import ApiError

BOTH, NIFTI_ONLY, SEG_ONLY = ["seg", "nifti"], ["nifti"], ["seg"]


@pytest.mark.parametrize("accept,available,expected", [
    ("", BOTH, "seg"),
    ("*/*", BOTH, "seg"),
    ("application/json", BOTH, "seg"),  # names neither: the natural result, not a 406
    ("application/gzip", BOTH, "nifti"),
    ("application/x-nifti, application/dicom", BOTH, "nifti"),  # equal q: the first named
    ("application/gzip;q=0.3, application/dicom;q=0.9", BOTH, "seg"),
    ("application/dicom;q=0, */*", BOTH, "nifti"),
    ("*/*;q=0.1, application/dicom;q=0", BOTH, "nifti"),
    ("application/dicom, application/gzip;q=0.5", NIFTI_ONLY, "nifti"),  # the best one the result has
    ("application/gzip, application/dicom;q=0.5", SEG_ONLY, "seg"),
    ("application/gzip;q=abc, application/dicom;q=0.5", BOTH, "nifti"),  # a q that is no number is ignored
    ("application/gzip;q=nan, application/dicom;q=0.5", BOTH, "nifti"),  # was q=0: NaN passed the clamp
    ("application/gzip;q=-inf, application/dicom;q=0.5", BOTH, "nifti"),
    ("application/dicom;q=1.5, application/gzip", BOTH, "seg"),  # clamped to 1, then the first named
    ('application/dicom; profile="a,b";q=0.1, application/gzip;q=0.5', BOTH, "nifti"),  # a quoted comma
    ("APPLICATION/DICOM;Q=0.2, application/gzip;q=0.1", BOTH, "seg"),
])
def test_the_preferred_available_format(accept: str, available: list[str], expected: str) -> None:
    assert preferred_format(accept, available) == expected


@pytest.mark.parametrize("accept,available", [("application/dicom;q=0", SEG_ONLY),
                                              ("application/dicom;q=0", BOTH),  # nifti is not named either
                                              ("application/dicom", NIFTI_ONLY),
                                              ("application/dicom;q=0, application/gzip;q=0", BOTH),
                                              ("*/*;q=0", BOTH)])
def test_a_header_refusing_every_available_format_is_406(accept: str, available: list[str]) -> None:
    with pytest.raises(ApiError) as refused:
        preferred_format(accept, available)
    assert (refused.value.status, refused.value.code) == (406, "format_unavailable")
    assert "application/dicom for seg" in refused.value.message
