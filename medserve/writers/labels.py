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
    Raises TypeError when it is not an array, ValueError naming the problem when it is not 3-D, has the wrong
    shape, or holds values that are not labels.
    """
    values = label_map.asnumpy() if callable(getattr(label_map, "asnumpy", None)) else label_map
    if not isinstance(values, np.ndarray):
        raise TypeError(f"label map: expected a numpy array or an SDK Image of one; got "
                        f"{type(values).__module__}.{type(values).__qualname__}")
    if values.ndim != 3:
        raise ValueError(f"label map has shape {values.shape}; expected 3 dimensions (slice, row, column)")
    if shape is not None and values.shape != tuple(shape):
        raise ValueError(f"label map has shape {values.shape} (slice, row, column); {fits} has {tuple(shape)}")
    if values.dtype in (np.uint8, np.uint16):
        return values
    if values.dtype.kind not in "biuf":
        raise ValueError(f"label map has dtype {values.dtype}; expected integer labels")
    if values.size:
        if values.dtype.kind == "f" and not np.isfinite(values).all():
            raise ValueError(f"label map has dtype {values.dtype} with NaN or infinite values; expected whole-number "
                             f"labels")
        low, high = values.min().item(), values.max().item()  # Python numbers: float16 cannot hold 65535
        if low < 0 or high > MAX_LABEL:
            raise ValueError(f"label map values {low}..{high} are outside the labels 0..{MAX_LABEL}")
        if values.dtype.kind == "f" and not np.array_equal(values, np.trunc(values)):
            raise ValueError(f"label map has dtype {values.dtype} with fractional values; expected whole-number "
                             f"labels (a probability map must be thresholded or argmax-ed first)")
    return values.astype(np.uint16)
