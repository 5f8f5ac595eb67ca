"""MONAI bundles: layout checks (`layout`) and the hot, reusable predictor (`predictor`)."""

from medserve.bundle.layout import BundleLayout
from medserve.bundle.predictor import BundlePredictor

__all__ = ["BundleLayout", "BundlePredictor"]
