"""Turn a series into a `highdicom.Volume`: float32 voxels in modality units with the patient-space affine.

The array is indexed (slice, row, column) and the affine maps those indices to LPS patient coordinates in mm,
slices ordered along the slice normal (a right-handed frame), whatever order the files came in. Geometry comes
from highdicom (`get_volume_positions`); we only check the series first, so that a broken series is refused
with the reason rather than turned into a silently wrong volume. The checks read positions, orientations and
spacings as stored (`medserve.dicom.values`), not through pydicom's per-value conversion.

Pixels are read into the volume slice by slice (`medserve.dicom.pixels`), several at once. The volume's memory
comes from `medserve.dicom.memory`: ordinary pages, already faulted in while the folder was indexed when the
series is the first one found.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import highdicom as hd
import numpy as np
import pydicom
from pydicom.datadict import keyword_for_tag
from pydicom.tag import Tag

from medserve.dicom.edits import copy_with
from medserve.dicom.index import Instance, Series, read_dataset
from medserve.dicom.memory import volume_array
from medserve.dicom.pixels import check_first_frame_length, check_jpeg_end, mask_native_frames, read_slices
from medserve.dicom.values import decimal_values, integer_value, number_of_frames, stored_bytes, uid_value
from medserve.errors import VolumeError, first_line, on_one_line

log = logging.getLogger("medserve.dicom.volume")

_ORIENTATION_TOLERANCE = 1e-4
# Direction cosines written with 3 decimals (as many scanners and anonymisers do) are unit and orthogonal to
# within 2 x sqrt(3) x 0.0005.
_ORTHONORMAL_TOLERANCE = 2e-3
# Slice positions written with 2 decimals are each off by up to sqrt(3) x 0.005 mm along an oblique normal: on
# thin slices more than the relative tolerance, so spacing may always vary by this much.
_POSITION_ROUNDING_MM = 0.02
# How far slice spacing may deviate from regular before a series is refused: relative to the mean, as highdicom.
_SPACING_RTOL = 0.01
_LPS_TO_RAS = np.diag([-1.0, -1.0, 1.0, 1.0])
_SPACING_TOLERANCE_MM = 1e-3
# Spacings outside this range are damaged values, not voxels (micro-CT voxels are a micrometre): highdicom's
# orthogonality check overflows or underflows on them (1e308, 1e-300) and refuses the affine with a ValueError.
_PLAUSIBLE_SPACING_MM = (1e-4, 1e4)
# A kilometre: farther coordinates are damaged values, and the bundles' float32 affines lose the millimetre there
# (positions at 1e300 mm gave an empty segmentation, exit 0).
_FARTHEST_POSITION_MM = 1e6
_LISTED_DUPLICATES = 5
# Compared as stored bytes across a series' slices: equal bytes, equal (already checked) values.
_SLICE_SIZE = ("Rows", "Columns", "SamplesPerPixel", "PhotometricInterpretation")
# Greyscale: values in modality units after the rescale. MONOCHROME1 only displays them inverted; PALETTE COLOR
# values (one sample per pixel too) are indices into a colour table.
_GREYSCALE = ("MONOCHROME1", "MONOCHROME2")
# With highdicom's (slice, row, column) index convention, a left-handed frame puts slices along +normal.
_ALONG_NORMAL = "LEFT_HANDED"


@dataclass(frozen=True)
class LoadedSeries:
    """A series read into a volume, with its instances in the volume's slice order (what a SEG references)."""

    series: Series
    volume: hd.Volume
    instances: list[Instance]

    @property
    def source_datasets(self) -> list[pydicom.Dataset]:
        return [instance.dataset for instance in self.instances]


def load_series(series: Series) -> LoadedSeries:
    """Build the volume of `series`; raise VolumeError naming the file and the problem if it is not regular."""
    if series.is_multiframe:
        return LoadedSeries(series, _multiframe_volume(series.instances[0]), list(series.instances))
    ordered, spacing = _volume_order(series)
    first = ordered[0].dataset
    shape = (len(ordered), int(first.Rows), int(first.Columns))
    check_first_frame_length(ordered[0], *shape[1:])
    prepared = series.volume_memory.take(shape) if series.volume_memory is not None else None
    array = prepared if prepared is not None else _allocated(shape, ordered[0])
    read_slices(ordered, array)
    volume = hd.Volume(array=array, affine=slice_affine(first, spacing), coordinate_system="PATIENT",
                       frame_of_reference_uid=first.get("FrameOfReferenceUID"))
    return LoadedSeries(series, volume, ordered)


def _allocated(shape: tuple[int, int, int], first: Instance) -> np.ndarray:
    try:
        return volume_array(shape)
    except (OSError, MemoryError) as error:  # the kernel refused the address space (ENOMEM)
        gib = math.prod(shape) * np.dtype(np.float32).itemsize / 2**30
        raise VolumeError(f"{first.path}: {shape[0]} slices of Rows {shape[1]} x Columns {shape[2]} need "
                          f"{gib:.1f} GiB as float32, more than can be allocated here ({error})") from None


def series_to_volume(series: Series) -> hd.Volume:
    return load_series(series).volume


def ras_affine(volume: hd.Volume) -> np.ndarray:
    """RAS affine of (column, row, slice) indices: what NIfTI and MONAI's LoadImaged use for the same voxels."""
    return _LPS_TO_RAS @ volume.affine[:, [2, 1, 0, 3]]


def lps_affine(ras: np.ndarray) -> np.ndarray:
    """LPS affine of (slice, row, column) indices from a RAS affine of (column, row, slice): `ras_affine` undone."""
    return (_LPS_TO_RAS @ ras)[:, [2, 1, 0, 3]]


def slice_affine(first: pydicom.Dataset, spacing: float) -> np.ndarray:
    """LPS affine of (slice, row, column) indices with slices ascending along the normal (row x column).

    This is the stock SDK operator's slice order; highdicom's `from_attributes` would stack the other way.
    """
    row, column = _orthonormal(np.asarray(first.ImageOrientationPatient, dtype=np.float64))
    row_spacing, column_spacing = (float(v) for v in first.PixelSpacing)
    affine = np.eye(4)
    affine[:3, 0] = np.cross(row, column) * spacing
    affine[:3, 1] = column * row_spacing
    affine[:3, 2] = row * column_spacing
    affine[:3, 3] = np.asarray(first.ImagePositionPatient, dtype=np.float64)
    return affine


def _orthonormal(orientation: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The row and column cosines as written, the stock operator's too, when they are orthogonal to within what
    highdicom's Volume accepts; else (3-decimal ones are orthogonal to about 1e-3 only) the orthonormal pair
    nearest to them: the polar factor of the 3x2 matrix."""
    row, column = orientation[:3], orientation[3:]
    length, skew = _deviation_from_orthonormal(row, column)
    if length <= _ORIENTATION_TOLERANCE * 10 and skew <= _ORIENTATION_TOLERANCE:
        return row, column
    u, _, vt = np.linalg.svd(orientation.reshape(2, 3).T, full_matrices=False)
    row, column = (u @ vt).T
    return row, column


def _deviation_from_orthonormal(row: np.ndarray, column: np.ndarray) -> tuple[float, float]:
    """How far direction cosines are from unit length (the larger of the two) and from orthogonal (|row . column|)."""
    length = max(abs(np.linalg.norm(row) - 1), abs(np.linalg.norm(column) - 1))
    return float(length), float(abs(row @ column))


def ordered_instances(series: Series) -> list[Instance]:
    """The series' instances in volume order (slice index 0 first), as `load_series` stacks them."""
    return _volume_order(series)[0]


def datasets_in_slice_order(datasets: list[pydicom.Dataset]) -> list[pydicom.Dataset]:
    """Datasets of one series read elsewhere (the stock SDK loader's, say) in volume order, after the checks
    `load_series` makes; VolumeError with the reason when they do not form a volume."""
    if not datasets:
        raise VolumeError("the series has no instances")
    instances = [Instance(path=Path(str(getattr(dataset, "filename", None)
                                        or f"SOP instance {dataset.get('SOPInstanceUID', '?')}")),
                          dataset=dataset, pixel_data_offset=None) for dataset in datasets]
    first = datasets[0]
    series = Series(study_uid=str(first.get("StudyInstanceUID", "")),
                    series_uid=str(first.get("SeriesInstanceUID", "")), instances=instances)
    return [instance.dataset for instance in ordered_instances(series)]


def _volume_order(series: Series) -> tuple[list[Instance], float]:
    """Instances in volume order and the slice spacing, after checking the series' geometry (once per series)."""
    if series.is_multiframe:
        return list(series.instances), 0.0
    if series.volume_order is None:
        series.volume_order = _checked_volume_order(series)
    return series.volume_order


def _checked_volume_order(series: Series) -> tuple[list[Instance], float]:
    multiframe = [instance for instance in series.instances if instance.is_multiframe]
    if multiframe:
        raise VolumeError(f"series {series.series_uid} has {len(series.instances)} instances of which "
                          f"{len(multiframe)} are multi-frame (e.g. {multiframe[0].path}); expected one "
                          f"multi-frame (Enhanced) object or single-frame slices")
    positions, orientation = _check_geometry_attributes(series.instances)
    _check_one_frame_of_reference(series.instances)  # before the positions are compared: they may not be comparable
    # highdicom takes |row x column| as the unit normal: rounded cosines would scale the spacing and fail its
    # stacking check.
    order, spacing = _slice_order(series.instances, positions, np.concatenate(_orthonormal(orientation)))
    _check_distinct_images(series.instances)  # after: a copied file is a duplicated slice first
    return [series.instances[i] for i in order], spacing


def _check_one_frame_of_reference(instances: list[Instance]) -> None:
    """Refuse slices that lie in different frames of reference: their positions are not comparable, and
    comparing them gave 'spacing is irregular' or 'duplicated slice' instead of the reason."""
    reference_uid, reference = uid_value(instances[0].dataset, "FrameOfReferenceUID"), instances[0]
    for instance in instances:
        frame_of_reference = uid_value(instance.dataset, "FrameOfReferenceUID")
        if frame_of_reference != reference_uid:
            raise VolumeError(f"{instance.path}: FrameOfReferenceUID {frame_of_reference or '(none)'} differs from "
                              f"{reference_uid or '(none)'} of {reference.path}: slices of one series must share one "
                              f"frame of reference")


def _check_distinct_images(instances: list[Instance]) -> None:
    """Refuse slices that share a SOPInstanceUID: a SEG frame refers to its source image by it."""
    by_uid: dict[str, Instance] = {}
    for instance in instances:
        uid = uid_value(instance.dataset, "SOPInstanceUID")
        if uid in by_uid:
            raise VolumeError(f"{instance.path}: SOPInstanceUID {uid} is also that of {by_uid[uid].path}, at another "
                              f"position; expected each slice of a series to be its own image with its own UID")
        by_uid[uid] = instance


def _check_geometry_attributes(instances: list[Instance]) -> tuple[np.ndarray, np.ndarray]:
    """Refuse a series whose slices lack geometry or differ in size, pixel spacing or orientation; return the
    slices' ImagePositionPatient (n x 3) and the series' ImageOrientationPatient."""
    first = instances[0]
    shape = (first.dataset.get("Rows"), first.dataset.get("Columns"))
    positions = np.empty((len(instances), 3))
    reference: dict[str, tuple[bytes | None, np.ndarray]] = {}
    checked_size: tuple[bytes | None, ...] | None = None  # stored bytes of a slice size that passed the checks
    for k, instance in enumerate(instances):
        dataset = instance.dataset
        stored_size = tuple(stored_bytes(dataset, keyword) for keyword in _SLICE_SIZE)
        if stored_size != checked_size:
            _check_slice_size(instance, shape, first)
            if all(value is not None or keyword not in dataset for keyword, value in zip(_SLICE_SIZE, stored_size)):
                checked_size = stored_size
        positions[k] = _geometry_values(instance, "ImagePositionPatient", 3)
        if np.abs(positions[k]).max() > _FARTHEST_POSITION_MM:
            raise VolumeError(f"{instance.path}: ImagePositionPatient {positions[k].tolist()}: expected coordinates "
                              f"within {_FARTHEST_POSITION_MM:g} mm of the patient origin")
        for keyword, count, limit, what in (("ImageOrientationPatient", 6, _ORIENTATION_TOLERANCE, "orientations"),
                                            ("PixelSpacing", 2, _SPACING_TOLERANCE_MM, "pixel spacings")):
            stored = stored_bytes(dataset, keyword)
            if keyword not in reference:
                reference[keyword] = (stored, _checked_reference(instance, keyword, count))
                continue
            first_stored, first_values = reference[keyword]
            if stored is not None and stored == first_stored:
                continue  # the same text as the first slice's: the same values
            values = np.asarray(_geometry_values(instance, keyword, count))
            if np.abs(values - first_values).max() > limit:
                raise VolumeError(f"{instance.path}: {keyword} {values.tolist()} differs from "
                                  f"{first_values.tolist()} of {first.path}: mixed {what} in one series")
    return positions, reference["ImageOrientationPatient"][1]


def _check_slice_size(instance: Instance, shape: tuple[int, int], first: Instance) -> None:
    """Refuse a slice without Rows/Columns, of another size than the first slice's, or not greyscale."""
    dataset = instance.dataset
    for keyword in ("Rows", "Columns"):
        size = integer_value(dataset, keyword)
        if size is None:
            raise VolumeError(f"{instance.path}: {keyword} is missing; a volume needs the geometry of every slice")
        if size <= 0:
            raise VolumeError(f"{instance.path}: {keyword} is {size}; expected at least 1")
    samples = integer_value(dataset, "SamplesPerPixel") if "SamplesPerPixel" in dataset else 1
    if samples != 1:
        raise VolumeError(f"{instance.path}: SamplesPerPixel is {'empty' if samples is None else samples}; "
                          "expected 1 (greyscale CT/MR)")
    photometric = str(dataset.get("PhotometricInterpretation") or "").strip()
    if photometric and photometric not in _GREYSCALE:
        raise VolumeError(f"{instance.path}: PhotometricInterpretation is {photometric}; expected MONOCHROME1 or "
                          "MONOCHROME2 (greyscale CT/MR)")
    if (dataset.Rows, dataset.Columns) != shape:
        raise VolumeError(f"{instance.path}: slice size {dataset.Rows}x{dataset.Columns} differs from "
                          f"{shape[0]}x{shape[1]} of {first.path}: mixed sizes in one series")


def _checked_reference(instance: Instance, keyword: str, count: int) -> np.ndarray:
    """The first slice's PixelSpacing (both positive) or ImageOrientationPatient (two orthogonal unit vectors),
    which every other slice is compared with."""
    values = np.asarray(_geometry_values(instance, keyword, count))
    if keyword == "PixelSpacing" and not (_PLAUSIBLE_SPACING_MM[0] <= values.min()
                                          and values.max() <= _PLAUSIBLE_SPACING_MM[1]):
        raise VolumeError(f"{instance.path}: PixelSpacing {values.tolist()}: expected two positive spacings (mm) from "
                          f"{_PLAUSIBLE_SPACING_MM[0]:g} to {_PLAUSIBLE_SPACING_MM[1]:g}")
    if keyword == "ImageOrientationPatient":
        if max(_deviation_from_orthonormal(values[:3], values[3:])) > _ORTHONORMAL_TOLERANCE:
            raise VolumeError(f"{instance.path}: ImageOrientationPatient {values.tolist()}: expected two orthogonal "
                              f"unit vectors (row and column direction cosines)")
    return values


def _geometry_values(instance: Instance, keyword: str, count: int) -> tuple[float, ...]:
    try:
        values = decimal_values(instance.dataset, keyword)
    except ValueError as error:
        raise VolumeError(f"{instance.path}: {error}") from None
    if values is None:
        raise VolumeError(f"{instance.path}: {keyword} is missing; a volume needs the geometry of every slice")
    if len(values) != count:
        raise VolumeError(f"{instance.path}: {keyword} has {len(values)} values; expected {count}")
    if not all(math.isfinite(value) for value in values):
        raise VolumeError(f"{instance.path}: {keyword} {list(values)}: expected finite numbers")
    return values


def _slice_order(instances: list[Instance], positions: np.ndarray, orientation: np.ndarray) -> tuple[list[int], float]:
    """Indices of `instances` in volume order and the slice spacing, or VolumeError with the reason."""
    if len(instances) == 1:
        return [0], single_image_spacing(instances[0].dataset)
    normal = np.cross(orientation[:3], orientation[3:])
    distances = positions @ normal
    sorted_distances = np.sort(distances)
    gaps = np.diff(sorted_distances)
    if np.any(gaps < 1e-3):
        duplicate = float(sorted_distances[int(np.argmin(gaps))])
        paths = [str(instances[i].path) for i in np.flatnonzero(np.abs(distances - duplicate) < 1e-3)]
        listed = ", ".join(paths[:_LISTED_DUPLICATES]) + (f" and {len(paths) - _LISTED_DUPLICATES} more"
                                                           if len(paths) > _LISTED_DUPLICATES else "")
        raise VolumeError(f"duplicated slice at {duplicate:.3f} mm along the slice normal: {listed}")
    position_list, orientation_list = positions.tolist(), orientation.tolist()
    atol = _spacing_atol(gaps)
    spacing, indices = hd.spatial.get_volume_positions(position_list, orientation_list, atol=atol,
                                                       sort=True, handedness=_ALONG_NORMAL)
    if spacing is None or indices is None:
        spacing_hint, _ = hd.spatial.get_volume_positions(position_list, orientation_list, atol=atol,
                                                          sort=True, handedness=_ALONG_NORMAL,
                                                          allow_missing_positions=True)
        if spacing_hint is not None:
            missing = int(round((sorted_distances[-1] - sorted_distances[0]) / spacing_hint)) + 1 - len(instances)
            where = float(sorted_distances[int(np.argmax(gaps))])
            raise VolumeError(f"series is missing {missing} slice(s) (spacing {spacing_hint:.3f} mm; gap after "
                              f"{where:.3f} mm along the slice normal)")
        in_plane = positions - np.outer(distances, normal)
        shift = float(np.linalg.norm(in_plane - in_plane[np.argmin(distances)], axis=1).max())
        if gaps.max() - gaps.min() <= atol and shift > atol:
            raise VolumeError(f"slices are not stacked along their normal: their positions shift by up to "
                              f"{shift:.3f} mm within the slice plane (a gantry tilt or a sheared stack); expected "
                              f"each ImagePositionPatient on the line through the first along the normal")
        raise VolumeError(f"slice spacing is irregular (between {gaps.min():.3f} and {gaps.max():.3f} mm, "
                          f"tolerance {atol:.3f} mm) or slices are not stacked along their normal")
    _check_drift(sorted_distances, atol, "slice")
    order = [0] * len(instances)
    for position, volume_index in enumerate(indices):
        order[volume_index] = position
    return order, float(spacing)


def _spacing_atol(gaps: np.ndarray) -> float:
    """How far, in mm, slice positions may lie from a regular stack: 1 % of the mean spacing (highdicom's
    rtol is of the mean spacing too), and never less than what positions written with 2 decimals are off by."""
    return max(_SPACING_RTOL * float(gaps.mean()), _POSITION_ROUNDING_MM)


def _check_drift(sorted_distances: np.ndarray, atol: float, what: str) -> None:
    """Refuse slices that lie further than `atol` from where the regular spacing (their mean gap) puts them.

    highdicom compares each gap with the mean gap: gaps that change along the stack (0.600 mm, then 0.625 mm) pass
    that one by one while the slices drift millimetres from where a regular spacing puts them."""
    spacing = (sorted_distances[-1] - sorted_distances[0]) / (len(sorted_distances) - 1)
    drift = sorted_distances - (sorted_distances[0] + spacing * np.arange(len(sorted_distances)))
    if np.abs(drift).max() > atol:
        where = int(np.argmax(np.abs(drift)))
        raise VolumeError(f"{what} spacing is irregular: the {what} at {sorted_distances[where]:.3f} mm along the "
                          f"normal lies {abs(drift[where]):.3f} mm from where a regular spacing of {spacing:.4f} mm "
                          f"puts it (tolerance {atol:.3f} mm)")


def _frame_values(dataset: pydicom.Dataset, sequence: str, keyword: str) -> list[tuple[float, ...] | None]:
    """Each frame's value of a functional group attribute (from its own groups, else the shared ones) as numbers;
    None for a frame that has none, or one that is not numbers."""
    shared = (dataset.get("SharedFunctionalGroupsSequence") or [pydicom.Dataset()])[0]
    values: list[tuple[float, ...] | None] = []
    for frame in dataset.get("PerFrameFunctionalGroupsSequence") or []:
        value = None
        for groups in (frame, shared):
            items = groups.get(sequence)
            if items and keyword in items[0]:
                try:
                    value = tuple(float(v) for v in items[0][keyword].value)
                except (TypeError, ValueError):
                    value = None
                break
        values.append(value)
    return values


def _frame_distances(dataset: pydicom.Dataset) -> np.ndarray | None:
    """Where the frames of a multi-frame image lie along its normal (mm, ascending); None when they do not all
    carry one plane position and one orientation (highdicom then tells what is wrong)."""
    orientations = set(_frame_values(dataset, "PlaneOrientationSequence", "ImageOrientationPatient"))
    positions = _frame_values(dataset, "PlanePositionSequence", "ImagePositionPatient")
    if len(positions) < 2 or None in positions or len(orientations) != 1 or None in orientations:
        return None
    orientation, located = np.asarray(orientations.pop()), np.asarray(positions, dtype=np.float64)
    if orientation.shape != (6,) or located.shape != (len(positions), 3):
        return None
    if not (np.isfinite(orientation).all() and np.isfinite(located).all()):
        return None
    normal = np.cross(*_orthonormal(orientation))
    return np.sort(located @ normal)


_FRAME_GEOMETRY = (("PlaneOrientationSequence", "ImageOrientationPatient", 6),
                   ("PixelMeasuresSequence", "PixelSpacing", 2),
                   ("PlanePositionSequence", "ImagePositionPatient", 3))


def _frames_for_highdicom(dataset: pydicom.Dataset, name: str) -> pydicom.Dataset:
    """`dataset` as highdicom can place its frames, or VolumeError naming from the header what keeps them from
    forming a volume, where highdicom would say 'not a regular stack' or something unrelated: functional groups
    missing or not one per frame, a frame without a position, frames of several orientations or pixel spacings,
    several frames at one position (phases or echoes), a big-endian object. highdicom wants every frame's
    orientation and pixel spacing exactly equal: values apart by float noise only (within 1e-4) are made the first
    frame's, in a copy; the caller's dataset stays as it is. The geometry of an object of one frame is left to
    highdicom."""
    def refuse(problem: str) -> VolumeError:
        return VolumeError(f"{name}: multi-frame image does not form a regular volume ({problem})")

    frames, per_frame = number_of_frames(dataset), dataset.get("PerFrameFunctionalGroupsSequence")
    if per_frame is not None and len(per_frame) != frames:  # highdicom would read NumberOfFrames, drop the rest
        raise VolumeError(f"{name}: NumberOfFrames is {frames} but PerFrameFunctionalGroupsSequence has "
                          f"{len(per_frame)} items; expected one item per frame")
    noisy: list[tuple[str, str, tuple[float, ...]]] = []
    if frames > 1:
        if not per_frame:
            raise refuse(f"it has no PerFrameFunctionalGroupsSequence, where the positions of its {frames} frames "
                         "are stated")
        values = {}
        for sequence, keyword, count in _FRAME_GEOMETRY:
            values[keyword] = _frame_values(dataset, sequence, keyword)
            if (missing := next((i for i, v in enumerate(values[keyword]) if v is None or len(v) != count),
                                None)) is not None:
                raise refuse(f"frame {missing + 1} has no {keyword} of {count} numbers, in its own {sequence} or "
                             "the shared one")
            first = values[keyword][0]
            if keyword == "ImagePositionPatient" or all(v == first for v in values[keyword]):
                continue
            other = next((i for i, v in enumerate(values[keyword])
                          if not np.allclose(v, first, rtol=0, atol=_ORIENTATION_TOLERANCE)), None)
            if other is not None:
                raise refuse(f"its frames differ in {keyword}: {_decimals(first)} in frame 1, "
                             f"{_decimals(values[keyword][other])} in frame {other + 1}")
            noisy.append((sequence, keyword, first))
        _check_distinct_positions(values["ImagePositionPatient"], values["ImageOrientationPatient"][0], refuse)
    if _is_big_endian(dataset):
        raise VolumeError(f"{name}: multi-frame image in Explicit VR Big Endian (a retired transfer syntax), which "
                          "highdicom cannot read; expected a little-endian transfer syntax (convert it, e.g. "
                          "`dcmconv +te`)")
    if not noisy:
        return dataset
    evened_frames = copy.deepcopy(per_frame)
    for frame in evened_frames:
        for sequence, keyword, first in noisy:
            if frame.get(sequence) and keyword in frame[sequence][0]:
                frame[sequence][0][keyword].value = list(first)
    return copy_with(dataset, {"PerFrameFunctionalGroupsSequence": evened_frames})


def _check_distinct_positions(positions: list, orientation: tuple[float, ...],
                              refuse: Callable[[str], VolumeError]) -> None:
    """Refuse (with `refuse(problem)`) frames that lie at one position along the normal."""
    normal = np.cross(*_orthonormal(np.asarray(orientation)))
    distances = np.asarray(positions, dtype=np.float64) @ normal
    order = np.argsort(distances, kind="stable")
    if (at := next((i for i, gap in enumerate(np.diff(distances[order])) if gap < 1e-3), None)) is not None:
        shared = [int(f) + 1 for f in order if abs(distances[f] - distances[order[at]]) < 1e-3]
        listed = ", ".join(map(str, shared[:5])) + (f" and {len(shared) - 5} more" if len(shared) > 5 else "")
        raise refuse(f"duplicated slice at {distances[order[at]]:.3f} mm along the slice normal: frames {listed}; "
                     "an object of several phases, echoes or times is no single volume")


def _decimals(values: tuple[float, ...]) -> str:
    return "\\".join(f"{v:g}" for v in values)


def _is_big_endian(dataset: pydicom.Dataset) -> bool:
    syntax = getattr(dataset, "file_meta", pydicom.Dataset()).get("TransferSyntaxUID")
    if syntax is not None:
        return str(syntax) == pydicom.uid.ExplicitVRBigEndian
    return dataset.original_encoding[1] is False


def _multiframe_atol(dataset: pydicom.Dataset, name: str) -> float | None:
    """The spacing tolerance of a multi-frame image's frames, as `_slice_order` has it for single-frame slices,
    after refusing frames that drift from a regular spacing beyond it; None (highdicom's own tolerance) when the
    frames' positions cannot be read here."""
    distances = _frame_distances(dataset)
    if distances is None:
        return None
    gaps = np.diff(distances)
    if np.any(gaps < 1e-3):
        return None  # several frames at one position: highdicom refuses them (allow_duplicate_positions=False)
    atol = _spacing_atol(gaps)
    try:
        _check_drift(distances, atol, "frame")
    except VolumeError as error:
        raise VolumeError(f"{name}: multi-frame image does not form a regular volume ({error})") from None
    return atol


def multiframe_geometry(dataset: pydicom.Dataset) -> hd.VolumeGeometry:
    """Where the frames of a multi-frame (Enhanced) image lie as a volume, slices ascending along the normal as
    `load_series` stacks them: a label map in that order becomes a Volume (`with_array`) that highdicom maps onto
    the frames by position, whatever order they are stored in. VolumeError when they do not form a volume."""
    name = getattr(dataset, "filename", None) or f"SOP instance {dataset.get('SOPInstanceUID', '?')}"
    evened = _frames_for_highdicom(dataset, name)
    atol = _multiframe_atol(evened, name)  # as the volume build has it: on the evened frames
    try:  # from_dataset without copying converts the object it is given: a shallow copy keeps the caller's as it is
        geometry = hd.Image.from_dataset(copy.copy(evened), copy=False).get_volume_geometry(
            atol=atol, allow_duplicate_positions=False)  # as get_volume: several phases at one position are no volume
    except Exception as error:  # highdicom raises assorted types on frame layouts it cannot place
        raise VolumeError(f"{name}: multi-frame image does not form a regular volume ({error})") from error
    if geometry is None:
        raise VolumeError(f"{name}: multi-frame image does not form a regular volume (its frames' positions are "
                          f"not a regular stack along one normal)")
    geometry = geometry.ensure_handedness(_ALONG_NORMAL, flip_axis=0)
    affine = _one_frame_affine(dataset, geometry.affine, warn=False)  # building the volume warns, once
    if affine is None:
        return geometry
    return hd.VolumeGeometry(affine, geometry.spatial_shape, geometry.coordinate_system,
                             geometry.frame_of_reference_uid)


def _one_frame_affine(dataset: pydicom.Dataset, affine: np.ndarray, *, warn: bool) -> np.ndarray | None:
    """For an object of one frame, `affine` with the slice spacing its pixel measures state (SpacingBetweenSlices,
    else SliceThickness), as a one-image series takes it; highdicom gives one frame 1 mm. None for several frames
    or when they state none (1 mm then, with a warning unless `warn` is false)."""
    if number_of_frames(dataset) != 1:
        return None
    measures = None
    for groups in (dataset.get("SharedFunctionalGroupsSequence"), dataset.get("PerFrameFunctionalGroupsSequence")):
        if groups and groups[0].get("PixelMeasuresSequence"):
            measures = groups[0].PixelMeasuresSequence[0]
            break
    spacing = _stated_slice_spacing(measures) if measures is not None else None
    if spacing is None:
        if warn:
            log.warning("%s: one frame without SpacingBetweenSlices or SliceThickness; taking 1 mm",
                        getattr(dataset, "filename", None) or "the multi-frame image")
        return None
    spaced = np.array(affine, dtype=np.float64)
    spaced[:3, 0] *= spacing / np.linalg.norm(spaced[:3, 0])
    return spaced


def single_image_spacing(dataset: pydicom.Dataset, *, warn: bool = True) -> float:
    """The slice spacing of a series of one image: SpacingBetweenSlices, else SliceThickness, else 1 mm (with a
    warning unless `warn` is false: the NIfTI's affine and the SEG's slice thickness then say 1 mm, which nothing in
    the header states; the SEG writer, which restates what the volume took, passes false)."""
    spacing = _stated_slice_spacing(dataset)
    if spacing is not None:
        return spacing
    if warn:
        log.warning("%s: a single image without SpacingBetweenSlices or SliceThickness; taking 1 mm",
                    getattr(dataset, "filename", None) or "the source image")
    return 1.0


def _stated_slice_spacing(dataset: pydicom.Dataset) -> float | None:
    """SpacingBetweenSlices, else SliceThickness, where one is a positive number."""
    for keyword in ("SpacingBetweenSlices", "SliceThickness"):
        values = _optional_decimals(dataset, keyword)
        if values and values[0] > 0:
            return values[0]
    return None


def _optional_decimals(dataset: pydicom.Dataset, keyword: str) -> tuple[float, ...] | None:
    try:
        return decimal_values(dataset, keyword)
    except ValueError:
        return None  # unreadable text counts as absent: the spacing has a fallback


def _frames_problem(error: Exception) -> str:
    """highdicom's reason on one line; a missing attribute (a bare KeyError of its tag) by name."""
    if isinstance(error, KeyError) and error.args and isinstance(error.args[0], int):
        tag = Tag(error.args[0])
        return f"{keyword_for_tag(tag) or 'an attribute'} {tag} is missing from a frame's functional groups"
    return on_one_line(error)


def _check_frame_count(dataset: pydicom.Dataset, instance: Instance) -> None:
    """Refuse a NumberOfFrames that the uncompressed pixel data do not bear out: highdicom reads that many frames
    and drops the rest (20 of 40 slices, without a word). The functional groups' count is checked with their
    layout."""
    frames = number_of_frames(dataset)
    pixels = dataset.get("PixelData")
    syntax = instance.transfer_syntax
    if isinstance(pixels, bytes) and syntax.is_transfer_syntax and not syntax.is_compressed:
        frame_bytes = int(dataset.Rows) * int(dataset.Columns) * int(dataset.BitsAllocated) // 8
        if frame_bytes and len(pixels) // frame_bytes != frames:
            raise VolumeError(f"{instance.path}: pixel data holds {len(pixels) // frame_bytes} frames of Rows x "
                              f"Columns x BitsAllocated/8 = {frame_bytes} bytes; NumberOfFrames says {frames}")


def _multiframe_volume(instance: Instance) -> hd.Volume:
    """Enhanced CT/MR: highdicom reads per-frame functional groups and applies the modality transform only, as
    for single-frame slices: not a Real World Value Mapping (which Enhanced MR often carries, in other units than
    the modality's) and not the presentation LUT."""
    try:
        dataset = read_dataset(instance)  # also a file written without the preamble
    except Exception as error:  # pydicom raises assorted types on damaged files
        raise VolumeError(f"{instance.path}: cannot be read ({error})") from error
    dataset = _frames_for_highdicom(dataset, str(instance.path))
    _check_frame_count(dataset, instance)
    if "PixelData" in dataset:
        try:
            check_jpeg_end(dataset.PixelData, instance, number_of_frames(dataset))
        except VolumeError:
            raise
        except Exception as error:  # pydicom's frame splitting on items that do not add up to the frames
            raise VolumeError(f"{instance.path}: cannot read the encapsulated frames ({first_line(error)})") from error
    atol = _multiframe_atol(dataset, str(instance.path))
    mask_native_frames(dataset)
    try:
        image = hd.Image.from_dataset(dataset, copy=False)
        volume = image.get_volume(dtype=np.float32, apply_real_world_transform=False, apply_presentation_lut=False,
                                  atol=atol)
    except Exception as error:  # highdicom raises ValueError/RuntimeError for non-volume frame layouts
        raise VolumeError(f"{instance.path}: multi-frame image does not form a regular volume "
                          f"({_frames_problem(error)})") from error
    if volume.array.ndim != 3:
        raise VolumeError(f"{instance.path}: multi-frame image has {volume.array.ndim} dimensions; expected 3")
    volume = volume.ensure_handedness(_ALONG_NORMAL, flip_axis=0)  # slices ascending along the normal, as ours
    affine = _one_frame_affine(dataset, volume.affine, warn=True)
    if affine is None:
        return volume
    return hd.Volume(volume.array, affine, volume.coordinate_system, volume.frame_of_reference_uid)
