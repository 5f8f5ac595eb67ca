"""ResultSummaryOperator: print where the results are and what was found, once they are all written."""

from __future__ import annotations

import time

from monai.deploy.core import ConditionType, Fragment, Operator, OperatorSpec

from medserve.pipeline import segment_counts, summary_line
from operators.failures import reports_failures


class ResultSummaryOperator(Operator):
    """One line on stdout: the files written, the segments found with their voxel counts, the elapsed time.

    Named inputs:
        label_map: the uint16 label map.
        seg_path: Path from SegWriterOperator.
        nifti_path: optional Path from NiftiWriterOperator.
    """

    def __init__(self, fragment: Fragment, *args, labels: dict[int, str], started: float, **kwargs):
        self.labels = labels
        self.started = started
        super().__init__(fragment, *args, **kwargs)

    def setup(self, spec: OperatorSpec):
        spec.input("label_map")
        spec.input("seg_path")
        spec.input("nifti_path").condition(ConditionType.NONE)

    @reports_failures
    def compute(self, op_input, op_output, context):
        counts = segment_counts(op_input.receive("label_map"), self.labels)
        paths = [p for p in (op_input.receive("seg_path"), op_input.receive("nifti_path")) if p is not None]
        print(f"wrote {', '.join(str(p) for p in paths)}")
        print(summary_line(counts, time.perf_counter() - self.started), flush=True)
