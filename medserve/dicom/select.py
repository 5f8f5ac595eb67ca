"""Select series with the selection-rules JSON of the stock DICOMSeriesSelectorOperator, with its semantics.

A rules file written for the stock operator (monai.deploy.operators.dicom_series_selector_operator) selects the
same series here, in the same order, with the same `all_matched` and `sort_by_sop_instance_count` options:

    {"selections": [{"name": "CT", "conditions": {"Modality": "(?i)CT", "SliceThickness": [1, 5]}}]}

Selection (stock `filter` / `_select_series`):
- every selection is applied to every study, in study order; within a study the series are tried in study order
  (the order their first files are found) and the first match is taken; with `all_matched` every match is
  kept, and with `sort_by_sop_instance_count` too, a selection's matches are ordered by SOP instance count,
  largest first (stable: ties keep study order). Instance counts are the stock loader's: instances at a
  duplicate ImagePositionPatient count once; a multi-frame instance counts once.
- a selection without conditions selects nothing; a blank name becomes the series' SeriesInstanceUID.

Attributes (stock `_get_instance_properties` + the instance-level fallback):
- StudyInstanceUID, StudyID, StudyDate, StudyTime, StudyDescription and AccessionNumber come from the study's
  first file; SeriesInstanceUID, SeriesDate, SeriesTime, Modality, SeriesDescription, BodyPartExamined,
  PatientPosition, SeriesNumber (an int), Laterality and the stock's own row_pixel_spacing, col_pixel_spacing,
  row_direction_cosine and col_direction_cosine from the series' first file. Any other keyword (or one of these
  when its value is empty) is read from the series' first SOP instance: an element with several values
  (VM > 1, e.g. ImageType, ImageOrientationPatient, PixelSpacing) as the one-item list `[element.repval]`.
- a falsy value (absent, empty, 0, "0") counts as missing: the condition fails.

Conditions (stock matching, in dict order, stopping at the first that fails):
- a falsy condition value (0, "", [], null, false) is ignored, as the stock ignores it (a warning is logged
  when the rules are loaded: a 0 condition looks like a mistake, but the stock silently skips it);
- text value: equal ignoring case, or else the condition as a regex searched anywhere in the value;
- numeric value: `number` (exact), `[min, max]` (inclusive), `[value, op]` with op one of > >= < <= !=, or a
  string regex that must match the whole value as written in the file (case-sensitive);
- multi-valued value (VM > 1): the condition's terms (a string, a number, or a list of them) must each occur,
  case-insensitively, as substrings of `str([element.repval]).lower()`; a term `"!TERM"` must not occur. A
  list is a set of terms here, even `[min, max]`: `{"PixelSpacing": [0.5, 1]}` is not a range;
- `ImageOrientationPatient`: "Axial", "Coronal" or "Sagittal" (any case), the dominant axis of the slice
  normal. As in the stock, the series must have a PatientPosition (HFP, HFS, HFDL, HFDR, FFP, FFS, FFDL or
  FFDR) or the selection fails with an error.

Where we differ from the stock, on purpose:
- no rules (None or a blank string): the largest CT or MR series of each study (most frames) whose headers form a
  volume, with `DEFAULT_RULES`; larger ones that do not (a DWI's repeated positions, a series missing slices) are
  left aside with a warning, or named in the error when no series is left. The stock without rules selects every
  series of every study, unnamed.
- rules are validated when loaded (`load_rules`), against the DICOM dictionary's VR and VM of each keyword;
  a rule the stock would crash on at match time (a list or number for a single text attribute, an invalid
  regex, `["abc", ">"]`, an unknown operator, a person-name, sequence or binary attribute, a keyword that is
  not a DICOM keyword or one of the stock's names above), or that is no JSON shape the stock accepts (`true`,
  an object), is refused with a SelectionError naming the selection and the condition. Two things the stock
  accepts are refused too: a string that is not a valid regex even where the stock uses it as a plain
  substring (multi-valued attributes), and a keyword it cannot know (it never matches in the stock). An empty
  object `{}` is refused (the stock treats it as no rules and selects every series).
- data the stock crashes on while matching (e.g. no PatientPosition with an ImageOrientationPatient
  condition, a term list against a single numeric value) raises a SelectionError naming the selection, the
  condition and the series, instead of NotImplementedError/ValueError/AttributeError. An ImageOrientationPatient
  whose cosines are zero is an error (the stock calls it "Sagittal" after dividing by zero).
- files are taken in path order (sorted), so "study order" is deterministic; the stock loader takes them in
  `os.listdir` order, which depends on the filesystem.
- nothing selected at all is a SelectionError listing the series found (the stock returns an empty list).

Where the two loaders see different series or instances (matching itself agreed on ~9,900 random rule sets):
- objects that are no image volume (SR, KO, PR, float-pixel maps) are left out by the index, so a rule that
  pins neither Modality nor ImageType cannot pick a dose report over the CT; the stock selects them (and then
  fails to build a volume);
- a series whose first file has an empty or malformed SeriesNumber, PixelSpacing or ImageOrientationPatient
  (blank after some anonymisers) is kept, with that property missing; the stock loader drops the whole series
  without a word (its TypeError/IndexError skips `add_series`), so no rule can see it there;
- instances without SOPClassUID in the dataset, and files without the 128-byte preamble, are kept (the stock
  skips them);
- at a duplicated ImagePositionPatient the instance with the highest AcquisitionNumber is kept, an empty one
  counting as -1 (the stock's `int(None)` fails and it keeps the first file);
- attributes stored after Pixel Data are not read (headers are read up to the pixels).
"""

from __future__ import annotations

import json
import logging
import numbers
import operator
import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
from pydicom.datadict import dictionary_VM, dictionary_VR
from pydicom.dataset import Dataset
from pydicom.tag import Tag

from medserve.dicom.index import Series, Study, StudyIndex
from medserve.dicom.volume import multiframe_geometry, ordered_instances
from medserve.errors import SelectionError, VolumeError

log = logging.getLogger("medserve.dicom.select")

# Without rules, the largest CT or MR series of each study is used (our default; see the module docstring).
DEFAULT_RULES: dict[str, Any] = {
    "selections": [{"name": "image", "conditions": {"Modality": "(?i)^(CT|MR)$"}}]
}

_RELATIONS = {">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le, "!=": operator.ne}
_ORIENTATIONS = ("Sagittal", "Coronal", "Axial")  # by the slice normal's dominant axis, x, y, z
_PATIENT_POSITIONS = ("HFP", "HFS", "HFDL", "HFDR", "FFP", "FFS", "FFDL", "FFDR")

# The stock loader's study and series properties (populate_study_attributes / populate_series_attributes).
_STUDY_TAGS = {"StudyID": 0x00200010, "StudyDate": 0x00080020, "StudyTime": 0x00080030,
               "StudyDescription": 0x00081030, "AccessionNumber": 0x00080050}
_SERIES_TAGS = {"SeriesDate": 0x00080021, "SeriesTime": 0x00080031, "Modality": 0x00080060,
                "SeriesDescription": 0x0008103E, "BodyPartExamined": 0x00080015, "PatientPosition": 0x00185100,
                "Laterality": 0x00200060}
_STOCK_NAMES = {"row_pixel_spacing": "number", "col_pixel_spacing": "number",
                "row_direction_cosine": "multi", "col_direction_cosine": "multi"}

_TEXT_VRS = {"AE", "AS", "CS", "DA", "DT", "LO", "LT", "SH", "ST", "TM", "UC", "UI", "UR", "UT"}
_NUMBER_VRS = {"AT", "DS", "IS", "FD", "FL", "SL", "SS", "SV", "UL", "US", "UV"}

_RULES_SHAPE = '{"selections": [{"name": "...", "conditions": {"Keyword": value, ...}}, ...]}'


@dataclass(frozen=True)
class SelectedSeries:
    """A series chosen by a named selection (a blank name is the series' SeriesInstanceUID, as in the SDK)."""

    name: str
    series: Series


def load_rules(source: str | Path | dict[str, Any] | None) -> dict[str, Any] | None:
    """Rules from a dict, a JSON string or a JSON file, validated; None or a blank string give None (no rules).

    Raises SelectionError naming the selection and condition for anything the stock selector cannot apply.
    """
    if source is None:
        return None
    if isinstance(source, dict):
        rules = source
    else:
        text = str(source)
        if not text.strip():
            return None
        origin = "selection rules"
        if not text.lstrip().startswith(("{", "[")):
            path = Path(text)
            try:
                if not path.is_file():
                    what = "is not a file" if path.exists() else "does not exist"
                    raise SelectionError(f"selection rules file {path} {what}; expected a JSON file or JSON text")
                # utf-8-sig: a byte order mark, as editors on Windows write, is not part of the JSON
                text, origin = path.read_text(encoding="utf-8-sig"), str(path)
            except (UnicodeDecodeError, OSError) as error:  # also a name too long, a folder we may not search
                raise SelectionError(f"selection rules file {path}: cannot be read as text ({error})") from error
        try:
            rules = json.loads(text)
        except json.JSONDecodeError as error:
            raise SelectionError(f"{origin}: not valid JSON ({error})") from error
    selections = rules.get("selections") if isinstance(rules, dict) else None
    if not isinstance(selections, list) or not selections:
        raise SelectionError(f"selection rules: expected {_RULES_SHAPE}")
    for position, selection in enumerate(selections):
        _check_selection(position, selection)
    return rules


def _check_selection(position: int, selection: Any) -> None:
    where = f"selection rules: selections[{position}]"
    if not isinstance(selection, dict):
        raise SelectionError(f"{where} is {json.dumps(selection)}; expected an object "
                             f'{{"name": "...", "conditions": {{...}}}}')
    name = selection.get("name", "")
    if not isinstance(name, str):
        raise SelectionError(f"{where}: name {json.dumps(name)} must be a string")
    where = f"{where} ({name.strip()!r})" if name.strip() else where
    conditions = selection.get("conditions")
    if not conditions:
        return  # the stock skips a selection without conditions
    if not isinstance(conditions, dict):
        raise SelectionError(f"{where}: conditions must be an object of DICOM keyword: value, "
                             f"not {json.dumps(conditions)}")
    for keyword, value in conditions.items():
        _check_condition(where, keyword, value)


def _check_condition(where: str, keyword: str, value: Any) -> None:
    condition = f"{where}: condition {json.dumps(keyword)}: {json.dumps(value)}"
    if not value:
        if value is not None and value != "":
            log.warning("%s is ignored: the stock selector ignores a condition whose value is falsy", condition)
        return
    kind = _keyword_kind(condition, keyword)

    def refuse(expected: str) -> SelectionError:
        return SelectionError(f"{condition}; expected {expected}")

    if isinstance(value, bool):
        raise refuse("a string, a number or a list, not true")
    if keyword == "ImageOrientationPatient":
        if not isinstance(value, str) or value.strip().lower().capitalize() not in _ORIENTATIONS:
            raise refuse('"Axial", "Coronal" or "Sagittal"')
        return
    if isinstance(value, str):
        _check_regex(condition, value)
    elif isinstance(value, numbers.Real):
        if kind == "text":
            raise refuse(f"a string ({keyword} is text: matched ignoring case, else as a regex)")
    elif isinstance(value, list):
        if kind == "text":
            raise refuse(f"a string ({keyword} is a single text value: matched ignoring case, else as a regex)")
        for element in value:
            if isinstance(element, bool) or not isinstance(element, (str, numbers.Real)):
                raise refuse("a list of strings or numbers")
        if len(value) == 2 and isinstance(value[1], str) and value[1] in _RELATIONS:
            if not _is_float(value[0]):
                raise refuse(f"a number before {value[1]!r}, as in [3, {json.dumps(value[1])}]")
        elif kind == "number":
            if len(value) == 2 and isinstance(value[1], str):
                raise refuse(f"[value, operator] with operator one of {', '.join(_RELATIONS)}; "
                             f"operator {value[1]!r} is not supported")
            if len(value) != 2 or not all(isinstance(v, numbers.Real) for v in value):
                raise refuse("[min, max] (numbers) or [value, operator] for a single numeric value")
    else:
        raise refuse("a string, a number or a list")


def _keyword_kind(condition: str, keyword: str) -> str:
    """"text", "number", "multi" (may hold several values) or "any" (not in the dictionary), by VR and VM."""
    if keyword in _STOCK_NAMES:
        return _STOCK_NAMES[keyword]
    try:
        tag = Tag(keyword)
    except (ValueError, TypeError, OverflowError):
        raise SelectionError(f"{condition}; {keyword!r} is not a DICOM attribute keyword (nor one of the "
                             f"stock selector's {', '.join(_STOCK_NAMES)})") from None
    try:
        vrs, vm = set(dictionary_VR(tag).split(" or ")), dictionary_VM(tag)
    except KeyError:
        return "any"  # a private or unknown tag: only the value found decides
    if vm != "1":
        return "multi"
    if vrs <= _TEXT_VRS:
        return "text"
    if vrs <= _NUMBER_VRS:
        return "number"
    raise SelectionError(f"{condition}; {keyword} has VR {' or '.join(sorted(vrs))}, which the stock selector "
                         f"cannot match (only text, numeric and multi-valued attributes)")


def _check_regex(condition: str, pattern: str) -> None:
    try:
        re.compile(pattern)
    except re.error as error:
        raise SelectionError(f"{condition}; expected a valid regular expression ({error})") from None


def _is_float(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True


def select_series(index: StudyIndex, rules: str | Path | dict[str, Any] | None = None, *,
                  all_matched: bool = False, sort_by_sop_instance_count: bool = False) -> list[SelectedSeries]:
    """Apply every selection to every study, as the stock DICOMSeriesSelectorOperator.filter does.

    all_matched: each selection keeps all its matches in a study, not just the first.
    sort_by_sop_instance_count: with all_matched, a selection's matches in a study, most SOP instances first.
    Without rules: the largest CT or MR series of each study (see the module docstring).
    Raises SelectionError listing the series found when nothing matches.
    """
    loaded = load_rules(rules)
    selections = (loaded or DEFAULT_RULES)["selections"]
    selected: list[SelectedSeries] = []
    skipped: list[tuple[Series, VolumeError]] = []  # by the default rules: series that form no volume, and why
    for study in index.studies:
        # The stock StudySelectedSeries groups a study's matches by selection name, in order of first use.
        by_name: dict[str, list[SelectedSeries]] = {}
        views = [_SeriesView(series, study) for series in study.series]
        if loaded is None:
            # Our default: larger series first, so that the first match is the full acquisition, not a scout.
            views.sort(key=lambda v: len(v.series.instances) * max(v.series.instances[0].number_of_frames, 1),
                       reverse=True)
        for position, selection in enumerate(selections):
            conditions = selection.get("conditions")
            if not conditions:
                continue
            name = selection.get("name", "").strip()
            found = []
            for view in views:
                if not _matches(view, conditions, name or f"selections[{position}]"):
                    continue
                if loaded is None and (reason := _not_a_volume(view.series)):
                    skipped.append((view.series, reason))
                    continue
                found.append(view)
                if not all_matched:
                    break
            if sort_by_sop_instance_count and len(found) > 1:
                found.sort(key=lambda v: v.sop_instance_count, reverse=True)
            for view in found:
                chosen = name or view.series.series_uid
                by_name.setdefault(chosen, []).append(SelectedSeries(name=chosen, series=view.series))
        selected.extend(match for matches in by_name.values() for match in matches)
    left_aside = [f"{series.summary()}: {reason}" for series, reason in skipped]
    if skipped:
        log.warning("series left aside by the default selection: they do not form a volume",
                    extra={"series": left_aside})
    if not selected and len(skipped) == 1:  # the only candidate: what is wrong with it is the whole story
        raise type(skipped[0][1])(left_aside[0]) from skipped[0][1]
    if not selected and skipped:
        raise SelectionError(f"no CT or MR series in {index.root} forms a volume, so none was selected by default; "
                             f"choose one with selection rules. Left aside:\n"
                             + "\n".join(f"  {line}" for line in left_aside))
    if not selected:
        raise SelectionError(
            f"no series in {index.root} matches the selection rules {json.dumps(selections)}; "
            f"found:\n{index.describe()}"
        )
    return selected


def first_selected(selected: list[SelectedSeries]) -> SelectedSeries:
    """The selection that is segmented: the first, as the stock operators take one volume per run. The others
    (more studies in the input, or `all_matched`) are named in a warning rather than dropped silently."""
    choice, *others = selected
    if others:
        log.warning("%d more selected series not segmented (only the first is): %s", len(others),
                    ", ".join(f"{o.series.series_uid} of study {o.series.study_uid}" for o in others))
    return choice


def _not_a_volume(series: Series) -> VolumeError | None:
    """Why the headers of `series` do not form a volume (a DWI's repeated positions, a localizer's planes, an
    Enhanced object holding several phases), or None when they do. Checked before any pixels are read, as
    `load_series` will check them."""
    try:
        if series.is_multiframe:
            multiframe_geometry(series.header)
        else:
            ordered_instances(series)
    except VolumeError as error:
        return error
    return None


class _Unmatchable(Exception):
    """The stock selector would fail on this condition and value (it raises while matching)."""


class _SeriesView:
    """A series' attributes as the stock loader and selector see them."""

    def __init__(self, series: Series, study: Study):
        self.series = series
        self.study_header = study.series[0].header  # the study's first file
        self.header = series.header  # the series' first file

    @cached_property
    def sop_instances(self) -> list[Dataset]:
        """The stock loader's instances: one per ImagePositionPatient (highest AcquisitionNumber), in file order."""
        by_position: dict[tuple[float, ...] | None, list[Dataset]] = {}
        for dataset in self.series.datasets:
            position = dataset.get("ImagePositionPatient", None)
            if position is None:
                by_position.setdefault(None, []).append(dataset)
                continue
            try:
                key = tuple(float(v) for v in position)
            except (TypeError, ValueError):
                continue  # the stock loader drops an instance it cannot parse
            kept = by_position.setdefault(key, [])
            if not kept:
                kept.append(dataset)
            elif _acquisition_number(dataset) > _acquisition_number(kept[0]):
                kept[0] = dataset
        return [dataset for group in by_position.values() for dataset in group]

    @property
    def sop_instance_count(self) -> int:
        return len(self.sop_instances)

    def property_value(self, keyword: str) -> Any:
        """The stock DICOMStudy/DICOMSeries property named `keyword`, or None when it is not set."""
        if keyword == "StudyInstanceUID":
            return self.series.study_uid
        if keyword == "SeriesInstanceUID":
            return self.series.series_uid
        if keyword in _STUDY_TAGS:
            return _element_value(self.study_header, _STUDY_TAGS[keyword])
        if keyword in _SERIES_TAGS:
            return _element_value(self.header, _SERIES_TAGS[keyword])
        try:
            if keyword == "SeriesNumber":
                value = _element_value(self.header, 0x00200011)
                return None if value is None else int(value)
            if keyword in ("row_pixel_spacing", "col_pixel_spacing"):
                spacing = self.header.get("PixelSpacing", None) if "PixelSpacing" in self.header else \
                    self.header.get("ImagerPixelSpacing", None)
                return None if spacing is None else spacing[0 if keyword == "row_pixel_spacing" else 1]
            if keyword in ("row_direction_cosine", "col_direction_cosine"):
                cosines = self.header.get("ImageOrientationPatient", None)
                if cosines is None:
                    return None
                padded = [0.0] * 6
                for i, value in enumerate(cosines):
                    padded[i] = float(value)
                return padded[:3] if keyword == "row_direction_cosine" else padded[3:]
        except (TypeError, ValueError, IndexError):
            return None  # the stock loader drops the whole series here (see the module's differences)
        return None

    def attribute(self, keyword: str) -> Any:
        """The value the stock selector matches: the property, else the first SOP instance's element."""
        value = self.property_value(keyword)
        if not value:
            try:
                element = self.sop_instances[0][keyword]
                value = [element.repval] if element.VM > 1 else element.value
            except Exception:  # noqa: BLE001 - as the stock: any failure means the attribute is missing
                value = None
        return value


def _element_value(dataset: Dataset, tag: int) -> Any:
    element = dataset.get(tag)
    return None if element is None else element.value


def _acquisition_number(dataset: Dataset) -> int:
    try:
        return int(dataset.get("AcquisitionNumber", -1))
    except (TypeError, ValueError):
        return -1


def _matches(view: _SeriesView, conditions: dict[str, Any], selection: str) -> bool:
    for keyword, expected in conditions.items():
        if not expected:
            continue
        actual = view.attribute(keyword)
        if not actual:
            return False
        try:
            if not _value_matches(view, keyword, expected, actual):
                return False
        except _Unmatchable as why:
            raise SelectionError(f"selection {selection!r}: condition {json.dumps(keyword)}: "
                                 f"{json.dumps(expected)} cannot be applied to series {view.series.series_uid} "
                                 f"({keyword} = {actual!r}): {why}") from None
    return True


def _value_matches(view: _SeriesView, keyword: str, expected: Any, actual: Any) -> bool:
    if keyword == "ImageOrientationPatient":
        position = view.property_value("PatientPosition")
        if position is None:
            raise _Unmatchable("the series has no PatientPosition, which the stock selector requires for an "
                               "ImageOrientationPatient condition")
        if position not in _PATIENT_POSITIONS:
            raise _Unmatchable(f"PatientPosition {position!r} is not one of {', '.join(_PATIENT_POSITIONS)}, "
                               f"which the stock selector requires for an ImageOrientationPatient condition")
        return _orientation_matches(expected, actual)
    if isinstance(actual, (float, int)):
        return _number_matches(expected, actual)
    if isinstance(actual, str):
        if not isinstance(expected, str):
            raise _Unmatchable("a text value is matched by a string only")
        return actual.casefold() == expected.casefold() or re.search(expected, actual, re.IGNORECASE) is not None
    if isinstance(actual, list):
        return _terms_match(expected, str(actual).lower())
    raise _Unmatchable(f"a value of type {type(actual).__name__} cannot be matched by the stock selector")


def _terms_match(expected: Any, values: str) -> bool:
    terms = {str(term).lower() for term in (expected if isinstance(expected, list) else [expected])}
    return all(term[1:] not in values if term.startswith("!") else term in values for term in terms)


def _number_matches(expected: Any, actual: float | int) -> bool:
    if isinstance(expected, list):
        if len(expected) == 2 and isinstance(expected[1], str):
            relation = _RELATIONS.get(expected[1])
            if relation is None or not _is_float(expected[0]):
                raise _Unmatchable(f"a single numeric value is matched by [value, operator] with operator one of "
                                   f"{', '.join(_RELATIONS)}, or [min, max]")
            return bool(relation(actual, float(expected[0])))
        if len(expected) == 2 and all(isinstance(v, (int, float)) for v in expected):
            return bool(expected[0] <= actual <= expected[1])
        raise _Unmatchable("a single numeric value is matched by [min, max] or [value, operator], not a term list")
    if isinstance(expected, str):
        return re.fullmatch(expected, str(actual)) is not None
    return bool(expected == actual)


def _orientation_matches(expected: str, actual: Any) -> bool:
    """The stock `_match_image_orientation`: the dominant axis of the normalised slice normal."""
    wanted = expected.strip().lower().capitalize()
    try:
        cosines = np.asarray([float(v.strip()) for v in actual[0].strip("[]").split(",")], dtype=np.float64)
    except (TypeError, ValueError, AttributeError, IndexError, KeyError):
        raise _Unmatchable("expected six direction cosines") from None
    if cosines.shape != (6,):
        raise _Unmatchable("expected six direction cosines")
    row, column = cosines[:3], cosines[3:]
    if np.linalg.norm(row) == 0 or np.linalg.norm(column) == 0:
        raise _Unmatchable("a direction cosine vector is zero")
    normal = np.cross(row / np.linalg.norm(row), column / np.linalg.norm(column))
    if np.linalg.norm(normal) == 0:
        raise _Unmatchable("the row and column cosines are parallel")
    normal /= np.linalg.norm(normal)
    return _ORIENTATIONS[int(np.argmax(np.abs(normal)))] == wanted
