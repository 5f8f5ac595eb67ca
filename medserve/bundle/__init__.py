"""MONAI bundles: layout checks (`layout`, no torch needed) and the hot, reusable predictor (`predictor`).

`BundlePredictor` is imported on first use, so that `medserve.bundle.layout` (which packaging uses) does not
pull in torch and MONAI.
"""

from typing import Any

from medserve.bundle.layout import BundleLayout

__all__ = ["BundleLayout", "BundlePredictor"]


def __getattr__(name: str) -> Any:
    if name == "BundlePredictor":
        from medserve.bundle.predictor import BundlePredictor

        return BundlePredictor
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
