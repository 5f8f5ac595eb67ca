"""The label map both writers take: whole-number labels 0..65535 in a (slice, row, column) array.

Writers are where label maps from elsewhere arrive (a stock SDK inference operator's `Image`, a MONAI
post-transform's float array), so they check it here, naming what is wrong, rather than let highdicom or nibabel
fail on it or, worse, write a mask that does not fit the series it references.
"""

from __future__ import annotations

from typing import Any

import numpy as np

MAX_LABEL = 65535


def label_array(label_map: Any, shape: tuple[int, ...] | None = None, *, fits: str = "the source") -> np.ndarray:
    """`label_map` (a numpy array, or an SDK `Image` with `asnumpy()`) as a uint8 or uint16 array (as it is when
    it is one of those; else checked and cast to uint16).

    `shape`, when given, is the (slice, row, column) shape it must have, `fits` names what that shape belongs to.
    A float array is accepted when it holds whole numbers (MONAI's `AsDiscrete` leaves labels as floats).
    Raises ValueError naming the problem: not an array, not 3-D, wrong shape, or values that are not labels.
    """
    values = label_map.asnumpy() if callable(getattr(label_map, "asnumpy", None)) else label_map
    if not isinstance(values, np.ndarray):
        raise ValueError(f"label map: expected a numpy array or an SDK Image; got "
                         f"{type(label_map).__module__}.{type(label_map).__qualname__}")
    if values.ndim != 3:
        raise ValueError(f"label map has shape {values.shape}; expected 3 dimensions (slice, row, column)")
    if shape is not None and values.shape != tuple(shape):
        raise ValueError(f"label map has shape {values.shape} (slice, row, column); {fits} has {tuple(shape)}")
    if values.dtype in (np.uint8, np.uint16):
        return values
    if values.dtype != bool and not np.issubdtype(values.dtype, np.integer) and \
            not np.issubdtype(values.dtype, np.floating):
        raise ValueError(f"label map has dtype {values.dtype}; expected integer labels")
    if values.size:
        low, high = values.min(), values.max()
        if low < 0 or high > MAX_LABEL:
            raise ValueError(f"label map values {low}..{high} are outside the labels 0..{MAX_LABEL}")
        if np.issubdtype(values.dtype, np.floating) and not np.array_equal(values, np.trunc(values)):
            raise ValueError(f"label map has dtype {values.dtype} with fractional values; expected whole-number "
                             f"labels (a probability map must be thresholded or argmax-ed first)")
    return values.astype(np.uint16)
