"""argmax over a dimension of a CPU tensor as `torch.max(...).indices`: the same indices, in a tenth of the time.

On CPU, torch.argmax over the channel dimension of class scores takes a slow generic reduction path
(pytorch/pytorch#140000): 8-11 s for the (2, 512, 512, 300) scores of a CT on 2 cores, where torch.max over the
same dimension gives the same indices (the first maximum; a NaN counts as the maximum) in 0.6 s. Bundles take that
argmax in their own postprocessing (MONAI's `AsDiscreted(argmax=True)` calls torch.argmax), so the predictor runs
the bundle's postprocessing under `MaxIndicesArgmax`: it answers torch.argmax / Tensor.argmax on a CPU tensor with
a dimension given, and leaves every other call, and every other device, untouched.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_ARGMAX = frozenset({torch.argmax, torch.Tensor.argmax})


def class_indices(scores: torch.Tensor, dim: int = 0, keepdim: bool = False) -> torch.Tensor:
    """Index of the highest score along `dim`, as torch.argmax gives it (ties: the first; NaN: the first NaN)."""
    return torch.max(scores, dim, keepdim).indices


def _argmax_arguments(input: torch.Tensor, dim: int | None = None, keepdim: bool = False,
                      **unsupported: Any) -> tuple[torch.Tensor, int | None, bool, dict[str, Any]]:
    return input, dim, keepdim, unsupported


class MaxIndicesArgmax(TorchFunctionMode):
    """Within this context, argmax over one dimension of a CPU tensor is computed by `class_indices`."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _ARGMAX:
            scores, dim, keepdim, unsupported = _argmax_arguments(*args, **kwargs)
            if dim is not None and not unsupported and scores.device.type == "cpu":
                return class_indices(scores, dim, keepdim)
        return func(*args, **kwargs)
