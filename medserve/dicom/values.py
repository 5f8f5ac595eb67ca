"""Values of the few attributes read from every file of a series, without pydicom's per-value conversion.

pydicom turns a raw element into a typed value on first access and validates each value (UIDs and decimal
strings against regular expressions). For the handful of attributes that indexing and geometry checks read from
each of hundreds of files, that conversion costs more than parsing the rest of the header. These helpers read the
stored bytes of a raw element (UI and DS are plain ASCII in every character set) or the typed value when pydicom
has already converted the element.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydicom.dataelem import RawDataElement
from pydicom.dataset import Dataset

from medserve.errors import DicomInputError

_PADDING = b"\x00 "


def uid_value(dataset: Dataset, keyword: str) -> str:
    """A UI attribute's value, or '' when it is absent or empty."""
    element = dataset.get_item(keyword)
    if element is None or element.value is None:
        return ""
    if isinstance(element, RawDataElement):
        return element.value.rstrip(_PADDING).decode("ascii", "replace")
    return str(element.value)


def decimal_values(dataset: Dataset, keyword: str) -> tuple[float, ...] | None:
    """A DS attribute's values as floats, or None when it is absent or empty.

    Raises ValueError naming the attribute when a value is not a decimal number.
    """
    element = dataset.get_item(keyword)
    if element is None or element.value is None:
        return None
    if isinstance(element, RawDataElement):
        stored = element.value.strip(_PADDING)
        if not stored:
            return None
        parts = stored.split(b"\\")
    else:
        value = element.value
        if value == "":
            return None
        parts = list(value) if isinstance(value, Sequence) and not isinstance(value, str) else [value]
    try:
        return tuple(float(part) for part in parts)
    except (TypeError, ValueError):
        raise ValueError(f"{keyword} {parts!r} is not a list of decimal numbers") from None


def integer_value(dataset: Dataset, keyword: str, default: int | None = None) -> int | None:
    """An IS/US attribute's one value as an int, `default` when it is absent or empty; DicomInputError naming the
    file and the attribute when it is not one whole number (pydicom leaves such values as text or a list)."""
    value = dataset.get(keyword)
    if value is None or value == "":
        return default
    try:
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
            return int(value)
    except (TypeError, ValueError):
        pass
    name = getattr(dataset, "filename", None) or "a DICOM header"
    raise DicomInputError(f"{name}: {keyword} {value!r} is not a whole number; expected one integer value")


def number_of_frames(dataset: Dataset) -> int:
    """NumberOfFrames, 1 when it is absent, empty or 0 (single-frame images leave it out)."""
    return integer_value(dataset, "NumberOfFrames", 1) or 1


def stored_bytes(dataset: Dataset, keyword: str) -> bytes | None:
    """A raw element's stored bytes (for a cheap equality test across files), or None once converted."""
    element = dataset.get_item(keyword)
    if isinstance(element, RawDataElement) and element.value is not None:
        return element.value
    return None
