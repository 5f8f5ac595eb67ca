"""BundleInferenceOperator: run a MONAI bundle (its own transforms, network, inferer) on a volume."""

from __future__ import annotations

from pathlib import Path

from monai.deploy.core import Fragment, OperatorSpec

from medserve.bundle.predictor import BundlePredictor, as_volume
from operators.arguments import predictor_argument
from operators.failures import RunEndingOperator, reports_failures


class BundleInferenceOperator(RunEndingOperator):
    """Segment a volume with a bundle loaded once, at construction, and reused for every volume.

    Named input:
        volume: either
            - a `highdicom.Volume` (from our SeriesToVolumeOperator, or any volume with an LPS patient-space
              affine of its (slice, row, column) indices), or
            - a stock `monai.deploy.core.Image`, as the SDK's DICOMSeriesToVolumeOperator emits it: a
              (slice, row, column) array with `affine`/`space`, `dicom_affine_transform` or
              `nifti_affine_transform` metadata; it is converted by `medserve.bundle.predictor.as_volume`.
        Anything else, or an Image without geometry, is a BundleError (reported, no output).

    Named output:
        label_map: numpy uint16 array, same (slice, row, column) shape and geometry as the input volume.
    """

    def __init__(self, fragment: Fragment, *args, predictor: BundlePredictor, **kwargs):
        self.predictor = predictor_argument("BundleInferenceOperator", predictor)
        super().__init__(fragment, *args, **kwargs)

    @classmethod
    def from_bundle(cls, fragment: Fragment, *args, bundle_path: Path | str, device: str | None = None,
                    **kwargs) -> BundleInferenceOperator:
        return cls(fragment, *args, predictor=BundlePredictor.from_dir(bundle_path, device), **kwargs)

    def setup(self, spec: OperatorSpec):
        spec.input("volume")  # highdicom.Volume or monai.deploy.core.Image (see the class docstring)
        spec.output("label_map")

    @reports_failures
    def compute(self, op_input, op_output, context):
        volume = as_volume(op_input.receive("volume"))
        op_output.emit(self.predictor.predict(volume), "label_map")
