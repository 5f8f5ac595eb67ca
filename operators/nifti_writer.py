"""NiftiWriterOperator: write the label map as NIfTI with the source volume's affine."""

from __future__ import annotations

from pathlib import Path

from monai.deploy.core import ConditionType, Fragment, OperatorSpec

from medserve.bundle.predictor import as_volume
from medserve.results import NIFTI_NAME
from medserve.writers.nifti import write_nifti
from operators.arguments import folder_argument
from operators.failures import RunEndingOperator, records_output, reports_failures


class NiftiWriterOperator(RunEndingOperator):
    """Write `labels.nii.gz` (uint16, RAS affine of the source volume) into the output folder.

    Named inputs:
        label_map: the label map, (slice, row, column): a numpy array, or an SDK `Image` holding one.
        volume: the volume it was computed on (geometry): a `highdicom.Volume`, or the stock
            DICOMSeriesToVolumeOperator's `Image` (converted as BundleInferenceOperator converts it).
        A label map of another shape than the volume is refused, naming both shapes.
        output_folder: optional Path, as the stock DICOMSegmentationWriterOperator's: this run's folder; when
            no operator sends one, the `output_folder` given at construction.

    Named output (may be left unconnected; no back-pressure, as the SegWriterOperator's):
        nifti_path: Path of the written file.
    """

    def __init__(self, fragment: Fragment, *args, output_folder: Path | str, **kwargs):
        self.output_folder = folder_argument("NiftiWriterOperator", "output_folder", output_folder)
        super().__init__(fragment, *args, **kwargs)

    def setup(self, spec: OperatorSpec):
        spec.input("label_map")
        spec.input("volume")
        spec.input("output_folder").condition(ConditionType.NONE)
        spec.output("nifti_path").condition(ConditionType.NONE)  # optional: see the class docstring

    @reports_failures
    def compute(self, op_input, op_output, context):
        label_map = op_input.receive("label_map")
        volume = as_volume(op_input.receive("volume"), role="NIfTI writer volume")
        folder = Path(op_input.receive("output_folder") or self.output_folder)
        folder.mkdir(parents=True, exist_ok=True)
        path = write_nifti(label_map, volume, folder / NIFTI_NAME)
        op_output.emit(records_output(self.fragment, path), "nifti_path")
