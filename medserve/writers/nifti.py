"""NIfTI label maps: the (slice, row, column) label map written in RAS with the volume's own affine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import highdicom as hd
import nibabel as nib
import numpy as np

from medserve.dicom.volume import ras_affine
from medserve.writers.files import atomic_output
from medserve.writers.labels import label_array


def write_nifti(label_map: Any, volume: hd.Volume, path: Path) -> Path:
    """Write `label_map` (an array, or an SDK Image of one, of `volume.array`'s shape) to `path` (.nii or .nii.gz)
    atomically.

    A label map that is not whole-number labels or not of the volume's shape is a ValueError naming both."""
    values = label_array(label_map, volume.spatial_shape, fits="the volume").astype(np.uint16, copy=False)
    # NIfTI stores (X, Y, Z) with X varying fastest, which is the memory order of a C-ordered (slice, row, column)
    # array: its transposed view is written as it lies (0.3 s for 512x512x300, against 1.9 s for a C-ordered copy
    # that nibabel then reorders again).
    image = nib.Nifti1Image(values.transpose(2, 1, 0), ras_affine(volume))
    image.header.set_xyzt_units("mm")
    image.set_qform(image.affine, code=1)
    image.set_sform(image.affine, code=1)
    with atomic_output(path) as partial:
        nib.save(image, partial)
    return path


def read_label_map(path: Path) -> np.ndarray:
    """A label map written by `write_nifti`, back in (slice, row, column) order."""
    return np.asarray(nib.load(path).dataobj).transpose(2, 1, 0)
