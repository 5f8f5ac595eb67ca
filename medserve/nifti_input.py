"""A NIfTI file as the core's input: a (slice, row, column) LPS volume in mm for the bundle, and the file's own
header, whose geometry fields the label map written for it copies (medserve.writers.nifti).

The geometry is read as NIfTI readers that place images in the world (niftilib, ITK) read it, not as nibabel's
`image.affine`, which guesses where the file states nothing:
- the sform when its code is above 0 and it is a rotation and scaling of the voxel grid, else the qform when its
  code is above 0 (a sheared or empty sform beside a good qform falls back to the qform, with a warning);
- neither code above 0 (no stated orientation) is refused: nibabel's Analyze guess flips x, which mirrors the
  result against the input in every other tool;
- a qform with a voxel size at or below 0 is refused (nibabel makes it 1 mm, or its absolute value, silently);
- directions orthogonal to within `_SKEW_TOLERANCE` (dcm2niix rounds oblique ones to about 4e-4) are made exactly
  orthogonal, as highdicom's Volume requires;
- metres and microns are converted to mm (the bundle's spacings are in mm); "unknown" is taken as mm.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import highdicom as hd
import nibabel as nib
import numpy as np
from nibabel.openers import ImageOpener

from medserve.dicom.volume import lps_affine
from medserve.errors import NiftiInputError, on_one_line

log = logging.getLogger("medserve.nifti_input")

_SKEW_TOLERANCE = 1e-2  # |cos| between two axes: 0.6 degrees from square
_MM_PER_UNIT = {1: 1000.0, 2: 1.0, 3: 1e-3}  # xyzt_units' spatial codes: metre, mm, micron; others as mm


@dataclass(frozen=True)
class NiftiInput:
    volume: hd.Volume  # for the bundle: LPS, mm, orthonormal directions
    header: nib.Nifti1Header  # as the file holds it (a Nifti2Header for NIfTI-2), unrepaired


def read_nifti(path: Path) -> NiftiInput:
    """The NIfTI file at `path`; errors name it by its path (the server stages an upload under the client's own
    file name, and shows messages without its folders)."""
    shown = str(path)
    header = _raw_header(path, shown)
    if bytes(header["magic"]).rstrip(b"\x00") in (b"ni1", b"ni2"):
        raise NiftiInputError(f"{shown}: a NIfTI header of a .hdr/.img pair, whose voxels are in a separate file; "
                              "expected a single-file .nii or .nii.gz")
    affine = _world_affine(header, shown)  # first: nibabel's loader fails on a qform it cannot use, in its words
    image = _load(path, shown)
    if 0 in image.shape:
        raise NiftiInputError(f"{shown}: NIfTI image of {' x '.join(map(str, image.shape))} voxels holds no voxels")
    array = _voxels(image, shown)
    return NiftiInput(hd.Volume(array=np.ascontiguousarray(array.transpose(2, 1, 0)), affine=lps_affine(affine),
                                coordinate_system="PATIENT"), header)


def _load(path: Path, shown: str) -> nib.Nifti1Image:
    try:
        return nib.load(str(path))
    except Exception as error:  # nibabel raises ImageFileError, EOFError, zlib errors on damaged files
        raise NiftiInputError(f"{shown}: not a readable NIfTI image ({on_one_line(error)})") from error


def _raw_header(path: Path, shown: str) -> nib.Nifti1Header:
    """The header as written: nibabel's loader repairs voxel sizes at or below 0 (to 1, or their absolute value)
    where niftilib and ITK would place the image otherwise. NIfTI-2 by its header size (540, either byte order)."""
    try:
        with ImageOpener(str(path)) as handle:
            size = handle.read(4)
            handle.seek(0)
            nifti2 = 540 in (int.from_bytes(size, "little"), int.from_bytes(size, "big"))
            return (nib.Nifti2Header if nifti2 else nib.Nifti1Header).from_fileobj(handle, check=False)
    except Exception as error:  # a damaged gzip stream, a file shorter than a header
        raise NiftiInputError(f"{shown}: not a readable NIfTI image ({on_one_line(error)})") from error


def _voxels(image: nib.Nifti1Image, shown: str) -> np.ndarray:
    dtype = image.get_data_dtype()
    if dtype.kind == "c":  # the cast below would drop the imaginary part
        raise NiftiInputError(f"{shown}: NIfTI image has complex voxels ({dtype}); expected real numbers")
    if dtype.fields is not None:  # RGB(A): numpy's cast error said only that it cannot
        raise NiftiInputError(f"{shown}: NIfTI image has colour voxels ({', '.join(dtype.names)}); expected one "
                              "intensity per voxel")
    try:
        with np.errstate(over="ignore", invalid="ignore"):  # values beyond float32 are refused below, by name
            array = np.asarray(image.dataobj, dtype=np.float32)
    except MemoryError as error:  # a damaged header's shape (32767^3) is met by the allocation
        gib = np.prod(image.shape, dtype=np.float64) * 4 / 2**30
        raise NiftiInputError(f"{shown}: NIfTI image of {' x '.join(map(str, image.shape))} voxels needs "
                              f"{gib:.1f} GiB as float32, more than can be allocated here") from error
    except Exception as error:
        raise NiftiInputError(f"{shown}: not a readable NIfTI image ({on_one_line(error)})") from error
    if array.ndim > 3 and all(size == 1 for size in array.shape[3:]):  # (x, y, z, 1): one volume of a series
        array = array.reshape(array.shape[:3])
    if array.ndim != 3:
        raise NiftiInputError(f"{shown}: NIfTI image has {array.ndim} dimensions; expected a 3D volume")
    if not np.isfinite(array).all():
        raise NiftiInputError(f"{shown}: NIfTI image holds NaN or infinite voxels, or values beyond float32's range; "
                              "expected finite intensities")
    return array


def _world_affine(header: nib.Nifti1Header, shown: str) -> np.ndarray:
    """The RAS affine (mm) of (column, row, slice) indices that the header states; see the module's rules."""
    sform_code, qform_code = int(header["sform_code"]), int(header["qform_code"])
    if sform_code <= 0 and qform_code <= 0:
        raise NiftiInputError(f"{shown}: NIfTI header states no orientation (sform_code {sform_code}, qform_code "
                              f"{qform_code}); expected a scanner, aligned or template space (code 1 to 5)")
    problems = []
    if sform_code > 0:
        affine, problem = _grid(header.get_sform(), "sform")
        if problem is None:
            return _in_mm(affine, header)
        problems.append(problem)
    if qform_code > 0:
        affine, problem = _qform(header)
        if problem is None:
            if problems:
                log.warning("%s: %s; using the qform (code %d)", shown, problems[0], qform_code)
            return _in_mm(affine, header)
        problems.append(problem)
    raise NiftiInputError(f"{shown}: {'; '.join(problems)}")


def _qform(header: nib.Nifti1Header) -> tuple[np.ndarray, str | None]:
    sizes = [float(size) for size in header["pixdim"][1:4]]
    if not all(size > 0 for size in sizes):  # finite too: NaN > 0 is False
        return np.eye(4), f"the qform's voxel sizes (pixdim[1..3]) are {sizes}; expected positive numbers"
    signed = header.copy()  # qfac: -1 when pixdim[0] is negative, else 1 (nibabel refuses anything but +-1)
    signed["pixdim"][0] = -1.0 if header["pixdim"][0] < 0 else 1.0
    try:
        return _grid(signed.get_qform(), "qform")
    except ValueError as error:  # quaternion b, c, d beyond a unit quaternion
        return np.eye(4), f"the qform's quaternion is not a rotation ({on_one_line(error)})"


def _grid(affine: np.ndarray, which: str) -> tuple[np.ndarray, str | None]:
    """`affine` with its axes made exactly orthogonal when they nearly are, or the reason it is no voxel grid."""
    refused = (f"the {which} {np.round(affine, 4).tolist()} is not a rotation and scaling of the voxel grid; "
               "expected orthogonal axes with non-zero spacings")
    linear = affine[:3, :3]
    spacings = np.linalg.norm(linear, axis=0)
    if not np.isfinite(affine).all() or not (spacings > 0).all():
        return affine, refused
    directions = linear / spacings
    skew = np.abs(directions.T @ directions - np.eye(3)).max()
    if skew > _SKEW_TOLERANCE:
        return affine, refused
    u, _, vt = np.linalg.svd(directions)
    grid = affine.copy()
    grid[:3, :3] = (u @ vt) * spacings
    return grid, None


def _in_mm(affine: np.ndarray, header: nib.Nifti1Header) -> np.ndarray:
    scale = _MM_PER_UNIT.get(int(header["xyzt_units"]) & 0x07, 1.0)
    return np.diag([scale, scale, scale, 1.0]) @ affine
