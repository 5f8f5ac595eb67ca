"""Select series with the selection-rules JSON of the stock DICOMSeriesSelectorOperator.

The rules and their matching semantics are the SDK's, so that a rules file written for the stock operator
selects the same series here:

    {"selections": [{"name": "CT", "conditions": {"Modality": "(?i)CT", "SliceThickness": [1, 5]}}]}

- strings match case-insensitively, or else as a regex searched anywhere in the value;
- numbers match exactly, as `[min, max]` (inclusive), as `[value, ">="]` (also >, <, <=, !=), or as a regex;
- multi-valued attributes (ImageType) match when every listed term occurs, `"!TERM"` excludes a term;
- `ImageOrientationPatient` matches "Axial", "Coronal" or "Sagittal" by the slice normal's dominant axis;
- an empty condition value is ignored; an attribute the series lacks fails the condition.
Attributes are read from the series' first instance, which carries the study and series modules.
"""

from __future__ import annotations

import json
import numbers
import operator
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from pydicom.multival import MultiValue

from medserve.dicom.index import Series, StudyIndex
from medserve.errors import SelectionError

# Without rules, the largest CT or MR series of each study is used.
DEFAULT_RULES: dict[str, Any] = {
    "selections": [{"name": "image", "conditions": {"Modality": "(?i)^(CT|MR)$"}}]
}

_RELATIONS = {">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le, "!=": operator.ne}
_ORIENTATIONS = ("Sagittal", "Coronal", "Axial")


@dataclass(frozen=True)
class SelectedSeries:
    """A series chosen by a named selection."""

    name: str
    series: Series


def load_rules(source: str | Path | dict[str, Any] | None) -> dict[str, Any]:
    """Rules from a dict, a JSON string or a JSON file; None gives DEFAULT_RULES. Validates the shape."""
    if source is None:
        return DEFAULT_RULES
    if isinstance(source, dict):
        rules = source
    else:
        text = str(source)
        origin = "selection rules"
        if not text.lstrip().startswith("{"):
            path = Path(text)
            if not path.is_file():
                raise SelectionError(f"selection rules file {path} does not exist")
            text, origin = path.read_text(), str(path)
        try:
            rules = json.loads(text)
        except json.JSONDecodeError as error:
            raise SelectionError(f"{origin}: not valid JSON ({error})") from error
    selections = rules.get("selections") if isinstance(rules, dict) else None
    if not isinstance(selections, list) or not selections:
        raise SelectionError('selection rules: expected {"selections": [{"name": ..., "conditions": {...}}, ...]}')
    for position, selection in enumerate(selections):
        if not isinstance(selection, dict) or not isinstance(selection.get("conditions", {}), dict):
            raise SelectionError(f"selection rules: selections[{position}] must be an object with a "
                                 f"'conditions' object")
    return rules


def select_series(index: StudyIndex, rules: dict[str, Any] | None = None, *,
                  all_matched: bool = False) -> list[SelectedSeries]:
    """Apply every selection to every study; with all_matched, each selection keeps all its matches.

    Raises SelectionError listing the series found when nothing matches.
    """
    rules = load_rules(rules)
    selected: list[SelectedSeries] = []
    for study in index.studies:
        # Larger series first, so that "first match" prefers the full acquisition over scouts.
        candidates = sorted(study.series, key=lambda s: len(s.instances) * max(s.instances[0].number_of_frames, 1),
                            reverse=True)
        for selection in rules["selections"]:
            conditions = selection.get("conditions") or {}
            if not conditions:
                continue
            name = str(selection.get("name", "")).strip()
            for series in candidates:
                if series_matches(series, conditions):
                    selected.append(SelectedSeries(name=name, series=series))
                    if not all_matched:
                        break
    if not selected:
        raise SelectionError(
            f"no series in {index.root} matches the selection rules {json.dumps(rules['selections'])}; "
            f"found:\n{index.describe()}"
        )
    return selected


def series_matches(series: Series, conditions: dict[str, Any]) -> bool:
    header = series.header
    for keyword, expected in conditions.items():
        if expected is None or expected == "" or expected == []:
            continue
        actual = header.get(keyword)
        if actual is None or actual == "" or (isinstance(actual, MultiValue) and len(actual) == 0):
            return False
        if not _value_matches(keyword, expected, actual):
            return False
    return True


def _value_matches(keyword: str, expected: Any, actual: Any) -> bool:
    if keyword == "ImageOrientationPatient":
        return _orientation_matches(expected, actual)
    if isinstance(actual, MultiValue):
        return _terms_match(expected, str([str(v) for v in actual]).lower())
    if isinstance(actual, numbers.Number):
        return _number_matches(keyword, expected, actual)
    if isinstance(actual, str):
        if not isinstance(expected, str):
            raise SelectionError(f"selection rules: condition {keyword}={expected!r} must be a string")
        return actual.casefold() == expected.casefold() or re.search(expected, actual, re.IGNORECASE) is not None
    raise SelectionError(f"selection rules: attribute {keyword} (value {actual!r}) cannot be matched")


def _terms_match(expected: Any, values: str) -> bool:
    terms = [str(term).lower() for term in (expected if isinstance(expected, list) else [expected])]
    return all((term[1:] not in values) if term.startswith("!") else (term in values) for term in terms)


def _number_matches(keyword: str, expected: Any, actual: numbers.Number) -> bool:
    if isinstance(expected, list) and len(expected) == 2 and isinstance(expected[1], str):
        relation = _RELATIONS.get(expected[1])
        if relation is None:
            raise SelectionError(f"selection rules: {keyword} uses operator {expected[1]!r}; "
                                 f"expected one of {', '.join(_RELATIONS)}")
        return bool(relation(actual, float(expected[0])))
    if isinstance(expected, list) and len(expected) == 2 and all(isinstance(v, numbers.Number) for v in expected):
        return expected[0] <= actual <= expected[1]
    if isinstance(expected, str):
        return re.fullmatch(expected, str(actual)) is not None
    if isinstance(expected, numbers.Number):
        return expected == actual
    raise SelectionError(f"selection rules: {keyword}={expected!r}; expected a number, [min, max], "
                         f"[value, '>='] or a regex")


def _orientation_matches(expected: Any, actual: Any) -> bool:
    wanted = str(expected).strip().capitalize()
    if wanted not in _ORIENTATIONS:
        raise SelectionError(f"selection rules: ImageOrientationPatient={expected!r}; expected one of "
                             f"{', '.join(_ORIENTATIONS)}")
    cosines = np.asarray([float(v) for v in actual], dtype=np.float64)
    normal = np.cross(cosines[:3], cosines[3:])
    return _ORIENTATIONS[int(np.argmax(np.abs(normal)))] == wanted
