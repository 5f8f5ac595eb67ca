"""Turn a series into a `highdicom.Volume`: float32 voxels in modality units with the patient-space affine.

The array is indexed (slice, row, column) and the affine maps those indices to LPS patient coordinates in mm,
slices ordered along the slice normal (a right-handed frame), whatever order the files came in. Geometry comes
from highdicom (`get_volume_positions`, `Volume.from_attributes`); we only check the series first, so that a
broken series is refused with the reason rather than turned into a silently wrong volume.

Uncompressed little-endian pixel data is read straight from the file into the preallocated volume (no
per-file dataset copy); compressed transfer syntaxes are decoded by pydicom's plugins, several files at once.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import highdicom as hd
import numpy as np
import pydicom
from pydicom.uid import ExplicitVRLittleEndian, ImplicitVRLittleEndian

from medserve.dicom.index import Instance, Series
from medserve.errors import VolumeError

log = logging.getLogger("medserve.dicom.volume")

_NATIVE_LITTLE_ENDIAN = {ImplicitVRLittleEndian, ExplicitVRLittleEndian, "1.2.840.10008.1.2.1.99"}
_ORIENTATION_TOLERANCE = 1e-4
# With highdicom's (slice, row, column) index convention, a left-handed frame puts slices along +normal.
_ALONG_NORMAL = "LEFT_HANDED"


@dataclass(frozen=True)
class SpacingTolerance:
    """How far slice spacing may deviate from regular before a series is refused (relative, as highdicom)."""

    rtol: float = 0.01


def series_to_volume(series: Series, tolerance: SpacingTolerance = SpacingTolerance()) -> hd.Volume:
    """Build the volume of `series`; raise VolumeError naming the file and the problem if it is not regular."""
    if series.is_multiframe:
        return _multiframe_volume(series.instances[0])
    instances = series.instances
    _check_geometry_attributes(instances)
    order, spacing = _slice_order(instances, tolerance)
    ordered = [instances[i] for i in order]
    first = ordered[0].dataset
    array = np.empty((len(ordered), int(first.Rows), int(first.Columns)), dtype=np.float32)
    _read_pixels_into(ordered, array)
    return hd.Volume(array=array, affine=slice_affine(first, spacing), coordinate_system="PATIENT",
                     frame_of_reference_uid=first.get("FrameOfReferenceUID"))


def slice_affine(first: pydicom.Dataset, spacing: float) -> np.ndarray:
    """LPS affine of (slice, row, column) indices with slices ascending along the normal (row x column).

    This is the stock SDK operator's slice order; highdicom's `from_attributes` would stack the other way.
    """
    orientation = np.asarray(first.ImageOrientationPatient, dtype=np.float64)
    row_spacing, column_spacing = (float(v) for v in first.PixelSpacing)
    affine = np.eye(4)
    affine[:3, 0] = np.cross(orientation[:3], orientation[3:]) * spacing
    affine[:3, 1] = orientation[3:] * row_spacing
    affine[:3, 2] = orientation[:3] * column_spacing
    affine[:3, 3] = np.asarray(first.ImagePositionPatient, dtype=np.float64)
    return affine


def ordered_instances(series: Series, tolerance: SpacingTolerance = SpacingTolerance()) -> list[Instance]:
    """The series' instances in volume order (slice index 0 first), as `series_to_volume` stacks them."""
    if series.is_multiframe:
        return list(series.instances)
    _check_geometry_attributes(series.instances)
    order, _ = _slice_order(series.instances, tolerance)
    return [series.instances[i] for i in order]


def _check_geometry_attributes(instances: list[Instance]) -> None:
    first = instances[0].dataset
    for instance in instances:
        dataset = instance.dataset
        for keyword in ("ImagePositionPatient", "ImageOrientationPatient", "PixelSpacing", "Rows", "Columns"):
            if dataset.get(keyword) in (None, ""):
                raise VolumeError(f"{instance.path}: {keyword} is missing; a volume needs the geometry of every "
                                  f"slice")
        if int(dataset.get("SamplesPerPixel", 1)) != 1:
            raise VolumeError(f"{instance.path}: SamplesPerPixel is {dataset.SamplesPerPixel}; expected 1 "
                              f"(greyscale CT/MR)")
        if (dataset.Rows, dataset.Columns) != (first.Rows, first.Columns):
            raise VolumeError(f"{instance.path}: slice size {dataset.Rows}x{dataset.Columns} differs from "
                              f"{first.Rows}x{first.Columns} of {instances[0].path}: mixed sizes in one series")
        if not np.allclose(np.asarray(dataset.ImageOrientationPatient, dtype=float),
                           np.asarray(first.ImageOrientationPatient, dtype=float), atol=_ORIENTATION_TOLERANCE):
            raise VolumeError(f"{instance.path}: ImageOrientationPatient {list(dataset.ImageOrientationPatient)} "
                              f"differs from {list(first.ImageOrientationPatient)} of {instances[0].path}: "
                              f"mixed orientations in one series")


def _slice_order(instances: list[Instance], tolerance: SpacingTolerance) -> tuple[list[int], float]:
    """Indices of `instances` in volume order and the slice spacing, or VolumeError with the reason."""
    if len(instances) == 1:
        thickness = instances[0].dataset.get("SpacingBetweenSlices") or instances[0].dataset.get("SliceThickness")
        return [0], float(thickness or 1.0)
    orientation = [float(v) for v in instances[0].dataset.ImageOrientationPatient]
    positions = [[float(v) for v in instance.dataset.ImagePositionPatient] for instance in instances]
    normal = np.cross(orientation[:3], orientation[3:])
    distances = np.asarray(positions) @ normal
    sorted_distances = np.sort(distances)
    gaps = np.diff(sorted_distances)
    if np.any(gaps < 1e-3):
        duplicate = float(sorted_distances[int(np.argmin(gaps))])
        paths = [str(instances[i].path) for i in np.flatnonzero(np.abs(distances - duplicate) < 1e-3)]
        raise VolumeError(f"duplicated slice at {duplicate:.3f} mm along the slice normal: {', '.join(paths)}")
    spacing, indices = hd.spatial.get_volume_positions(positions, orientation, rtol=tolerance.rtol, sort=True,
                                                       handedness=_ALONG_NORMAL)
    if spacing is None or indices is None:
        spacing_hint, _ = hd.spatial.get_volume_positions(positions, orientation, rtol=tolerance.rtol, sort=True,
                                                          handedness=_ALONG_NORMAL, allow_missing_positions=True)
        if spacing_hint is not None:
            missing = int(round((sorted_distances[-1] - sorted_distances[0]) / spacing_hint)) + 1 - len(instances)
            where = float(sorted_distances[int(np.argmax(gaps))])
            raise VolumeError(f"series is missing {missing} slice(s) (spacing {spacing_hint:.3f} mm; gap after "
                              f"{where:.3f} mm along the slice normal)")
        raise VolumeError(f"slice spacing is irregular (between {gaps.min():.3f} and {gaps.max():.3f} mm, "
                          f"tolerance {tolerance.rtol:.0%}) or slices are not stacked along their normal")
    order = [0] * len(instances)
    for position, volume_index in enumerate(indices):
        order[volume_index] = position
    return order, float(spacing)


def _read_pixels_into(instances: list[Instance], array: np.ndarray) -> None:
    """Fill `array[k]` with slice k of `instances`, rescaled to modality units, in place."""
    native = [k for k, instance in enumerate(instances) if _is_native(instance)]
    encoded = [k for k, instance in enumerate(instances) if not _is_native(instance)]
    for k in native:
        _read_native_slice(instances[k], array[k])
    if encoded:
        workers = min(len(encoded), os.cpu_count() or 1)
        with ThreadPoolExecutor(max_workers=workers) as pool:
            list(pool.map(lambda k: _decode_slice(instances[k], array[k]), encoded))


def _is_native(instance: Instance) -> bool:
    return instance.dataset.file_meta.get("TransferSyntaxUID") in _NATIVE_LITTLE_ENDIAN


def _pixel_dtype(instance: Instance) -> np.dtype:
    dataset = instance.dataset
    bits = int(dataset.BitsAllocated)
    if bits not in (8, 16, 32):
        raise VolumeError(f"{instance.path}: BitsAllocated {bits} is not supported; expected 8, 16 or 32")
    kind = "i" if int(dataset.PixelRepresentation) == 1 else "u"
    return np.dtype(f"<{kind}{bits // 8}")


def _read_native_slice(instance: Instance, out: np.ndarray) -> None:
    if instance.pixel_data_offset is None:
        raise VolumeError(f"{instance.path}: no Pixel Data element")
    dataset = instance.dataset
    dtype = _pixel_dtype(instance)
    count = out.size
    header_bytes = 8 if dataset.file_meta.TransferSyntaxUID == ImplicitVRLittleEndian else 12
    with instance.path.open("rb") as stream:
        stream.seek(instance.pixel_data_offset + header_bytes - 4)
        declared = int.from_bytes(stream.read(4), "little")
        raw = np.fromfile(stream, dtype=dtype, count=count)
    if declared < count * dtype.itemsize or raw.size < count:
        raise VolumeError(f"{instance.path}: pixel data is truncated ({raw.size * dtype.itemsize} of "
                          f"{count * dtype.itemsize} bytes)")
    raw = _mask_stored_bits(dataset, raw)
    _rescale_into(dataset, raw.reshape(out.shape), out)


def _decode_slice(instance: Instance, out: np.ndarray) -> None:
    try:
        dataset = pydicom.dcmread(instance.path)
        pixels = dataset.pixel_array
    except Exception as error:  # decoders raise assorted types on damaged data
        raise VolumeError(f"{instance.path}: cannot decode pixel data "
                          f"({_transfer_syntax_name(instance)}): {error}") from error
    if pixels.shape != out.shape:
        raise VolumeError(f"{instance.path}: decoded frame has shape {pixels.shape}; expected {out.shape}")
    _rescale_into(dataset, pixels, out)


def _transfer_syntax_name(instance: Instance) -> str:
    uid = instance.dataset.file_meta.get("TransferSyntaxUID")
    return f"{uid.name} {uid}" if uid is not None else "no transfer syntax"


def _mask_stored_bits(dataset: pydicom.Dataset, raw: np.ndarray) -> np.ndarray:
    """Honour BitsStored < BitsAllocated: drop the unused high bits, sign-extending signed values."""
    unused = raw.dtype.itemsize * 8 - int(dataset.get("BitsStored", raw.dtype.itemsize * 8))
    if unused <= 0:
        return raw
    if raw.dtype.kind == "i":
        return (raw << unused) >> unused
    return raw & np.array((1 << (raw.dtype.itemsize * 8 - unused)) - 1, dtype=raw.dtype)


def _rescale_into(dataset: pydicom.Dataset, pixels: np.ndarray, out: np.ndarray) -> None:
    np.copyto(out, pixels, casting="unsafe")
    slope = float(dataset.get("RescaleSlope", 1.0) or 1.0)
    intercept = float(dataset.get("RescaleIntercept", 0.0) or 0.0)
    if slope != 1.0:
        out *= slope
    if intercept != 0.0:
        out += intercept


def _multiframe_volume(instance: Instance) -> hd.Volume:
    """Enhanced CT/MR: highdicom reads per-frame functional groups and applies the modality transform."""
    try:
        image = hd.imread(instance.path)
        volume = image.get_volume(dtype=np.float32)
    except Exception as error:  # highdicom raises ValueError/RuntimeError for non-volume frame layouts
        raise VolumeError(f"{instance.path}: multi-frame image does not form a regular volume ({error})") from error
    if volume.array.ndim != 3:
        raise VolumeError(f"{instance.path}: multi-frame image has {volume.array.ndim} dimensions; expected 3")
    return volume
