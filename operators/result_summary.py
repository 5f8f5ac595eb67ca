"""ResultSummaryOperator: print where the results are and what was found, once they are all written."""

from __future__ import annotations

import logging
import os
import sys
import time

from monai.deploy.core import Fragment, OperatorSpec

from medserve.errors import one_line
from medserve.pipeline import segment_counts, summary_line
from medserve.writers.labels import label_array
from operators.failures import RunEndingOperator, reports_failures

log = logging.getLogger("medserve.app")


class ResultSummaryOperator(RunEndingOperator):
    """One line on stdout: the files written, the segments found with their voxel counts, the elapsed time.

    Named inputs:
        label_map: the label map: a numpy array, or an SDK `Image` holding one (as the writers take it).
        seg_path: Path from SegWriterOperator.
        nifti_path: Path from NiftiWriterOperator; declared only when `nifti` is true, and then waited for.
    """

    def __init__(self, fragment: Fragment, *args, labels: dict[int, str], started: float, nifti: bool = True,
                 **kwargs):
        self.labels = labels
        self.started = started
        self.nifti = nifti
        super().__init__(fragment, *args, **kwargs)

    def setup(self, spec: OperatorSpec):
        spec.input("label_map")
        spec.input("seg_path")
        if self.nifti:
            spec.input("nifti_path")

    @reports_failures
    def compute(self, op_input, op_output, context):
        counts = segment_counts(label_array(op_input.receive("label_map")), self.labels)
        paths = [op_input.receive("seg_path")]
        if self.nifti:
            paths.append(op_input.receive("nifti_path"))
        summary = summary_line(counts, time.perf_counter() - self.started)
        if sys.stdout is None:  # started with stdout closed: print() would drop the line without a word
            log.warning("the summary could not be printed (standard output is closed); the results are written")
            return
        try:
            print(f"wrote {one_line(', '.join(str(p) for p in paths))}\n{summary}", flush=True)
        except OSError as error:  # stdout closed (a pipe's reader gone) or full: the results are complete
            log.warning("the summary could not be printed (%s); the results are written", error)
            # Python would otherwise fail again flushing stdout at exit (and exit 120).
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
