"""NiftiWriterOperator: write the label map as NIfTI with the source volume's affine."""

from __future__ import annotations

from pathlib import Path

from monai.deploy.core import Fragment, Operator, OperatorSpec

from medserve.pipeline import NIFTI_NAME
from medserve.writers.nifti import write_nifti
from operators.failures import records_output, reports_failures


class NiftiWriterOperator(Operator):
    """Write `labels.nii.gz` (uint16, RAS affine of the source volume) into the output folder.

    Named inputs:
        label_map: uint16 label map, (slice, row, column).
        volume: the volume it was computed on (geometry).

    Named output:
        nifti_path: Path of the written file.
    """

    def __init__(self, fragment: Fragment, *args, output_folder: Path | str, **kwargs):
        self.output_folder = Path(output_folder)
        super().__init__(fragment, *args, **kwargs)

    def setup(self, spec: OperatorSpec):
        spec.input("label_map")
        spec.input("volume")
        spec.output("nifti_path")

    @reports_failures
    def compute(self, op_input, op_output, context):
        self.output_folder.mkdir(parents=True, exist_ok=True)
        path = write_nifti(op_input.receive("label_map"), op_input.receive("volume"), self.output_folder / NIFTI_NAME)
        op_output.emit(records_output(self.fragment, path), "nifti_path")
