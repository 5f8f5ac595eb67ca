"""SegWriterOperator: write the label map as a DICOM SEG referencing its source series."""

from __future__ import annotations

from pathlib import Path

from monai.deploy.core import Fragment, Operator, OperatorSpec

from medserve.bundle.predictor import BundlePredictor
from medserve.pipeline import SEG_NAME, segmentation_of
from medserve.writers.seg import write_seg
from operators.failures import records_output, reports_failures


class SegWriterOperator(Operator):
    """Write `seg.dcm` (highdicom, BINARY, empty frames omitted) into the output folder.

    Segment names and codes come from the predictor's bundle metadata.

    Named inputs:
        label_map: uint16 label map from BundleInferenceOperator.
        source: the LoadedSeries it was computed on (geometry, referenced instances, patient/study attributes).

    Named output:
        seg_path: Path of the written file (written under a temporary name, then renamed).
    """

    def __init__(self, fragment: Fragment, *args, output_folder: Path | str, predictor: BundlePredictor, **kwargs):
        self.output_folder = Path(output_folder)
        self.predictor = predictor
        super().__init__(fragment, *args, **kwargs)

    def setup(self, spec: OperatorSpec):
        spec.input("label_map")
        spec.input("source")
        spec.output("seg_path")

    @reports_failures
    def compute(self, op_input, op_output, context):
        label_map = op_input.receive("label_map")
        source = op_input.receive("source")
        self.output_folder.mkdir(parents=True, exist_ok=True)
        segmentation = segmentation_of(source, label_map, self.predictor)
        path = write_seg(segmentation, self.output_folder / SEG_NAME)
        op_output.emit(records_output(self.fragment, path), "seg_path")
