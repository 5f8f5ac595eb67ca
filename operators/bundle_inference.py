"""BundleInferenceOperator: run a MONAI bundle (its own transforms, network, inferer) on a volume."""

from __future__ import annotations

from pathlib import Path

from monai.deploy.core import Fragment, Operator, OperatorSpec

from medserve.bundle.predictor import BundlePredictor
from operators.failures import reports_failures


class BundleInferenceOperator(Operator):
    """Segment a volume with a bundle loaded once, at construction, and reused for every volume.

    Named input:
        volume: `highdicom.Volume` from SeriesToVolumeOperator (or any volume with a patient-space affine).

    Named output:
        label_map: numpy uint16 array, same (slice, row, column) shape and geometry as the input volume.
    """

    def __init__(self, fragment: Fragment, *args, predictor: BundlePredictor, **kwargs):
        self.predictor = predictor
        super().__init__(fragment, *args, **kwargs)

    @classmethod
    def from_bundle(cls, fragment: Fragment, *args, bundle_path: Path | str, device: str | None = None, **kwargs):
        return cls(fragment, *args, predictor=BundlePredictor.from_dir(bundle_path, device), **kwargs)

    def setup(self, spec: OperatorSpec):
        spec.input("volume")
        spec.output("label_map")

    @reports_failures
    def compute(self, op_input, op_output, context):
        op_output.emit(self.predictor.predict(op_input.receive("volume")), "label_map")
