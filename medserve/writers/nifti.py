"""NIfTI label maps: the (slice, row, column) label map written in RAS with the volume's own affine, or, for a
NIfTI input, in its header's own geometry."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import highdicom as hd
import nibabel as nib
import numpy as np

from medserve.dicom.volume import ras_affine
from medserve.writers.files import atomic_output
from medserve.writers.labels import label_array


# The header fields that place voxels in the world: copied whole, they place the label map's voxels where the
# input's are in every reader, whichever transform it prefers, and keep the input's space codes (aligned,
# Talairach, MNI) and units.
_GEOMETRY_FIELDS = ("pixdim", "quatern_b", "quatern_c", "quatern_d", "qoffset_x", "qoffset_y", "qoffset_z",
                    "srow_x", "srow_y", "srow_z", "qform_code", "sform_code")
_NIFTI1_MAX_SIZE = 32767  # dim[] is int16 in NIfTI-1


def write_nifti(label_map: Any, volume: hd.Volume, path: Path, like: nib.Nifti1Header | None = None) -> Path:
    """Write `label_map` (an array, or an SDK Image of one, of `volume.array`'s shape) to `path` (.nii or .nii.gz)
    atomically: in scanner space with `volume`'s affine, or, given the header of the NIfTI input `like`, in that
    header's geometry (NIfTI-2 where the input was).

    A label map that is not whole-number labels or not of the volume's shape is a ValueError naming both."""
    values = label_array(label_map, volume.spatial_shape, fits="the volume").astype(np.uint16, copy=False)
    # NIfTI stores (X, Y, Z) with X varying fastest, which is the memory order of a C-ordered (slice, row, column)
    # array: its transposed view is written as it lies (0.3 s for 512x512x300, against 1.9 s for a C-ordered copy
    # that nibabel then reorders again).
    voxels = values.transpose(2, 1, 0)
    nifti2 = isinstance(like, nib.Nifti2Header) or max(voxels.shape) > _NIFTI1_MAX_SIZE
    image_class = nib.Nifti2Image if nifti2 else nib.Nifti1Image
    if like is None:
        image = image_class(voxels, ras_affine(volume))
        image.header.set_xyzt_units("mm")
        image.set_qform(image.affine, code=1)
        image.set_sform(image.affine, code=1)
    else:
        image = image_class(voxels, None)
        for field in _GEOMETRY_FIELDS:
            image.header[field] = like[field]
        image.header["pixdim"][4:] = 1.0  # a (x, y, z, 1) input's time step says nothing of a label map
        image.header["xyzt_units"] = int(like["xyzt_units"]) & 0x07  # its spatial unit; nibabel names only 0-3
    with atomic_output(path) as partial:
        nib.save(image, partial)
    return path


def read_label_map(path: Path) -> np.ndarray:
    """A label map written by `write_nifti`, back in (slice, row, column) order."""
    return np.asarray(nib.load(path).dataobj).transpose(2, 1, 0)
