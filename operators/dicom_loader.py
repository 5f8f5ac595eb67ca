"""DicomLoaderOperator: index a folder of DICOM files by study and series (headers only)."""

from __future__ import annotations

from pathlib import Path

from monai.deploy.core import ConditionType, Fragment, OperatorSpec

from medserve.dicom.index import index_folder
from medserve.errors import DicomInputError
from operators.arguments import folder_argument
from operators.failures import RunEndingOperator, reports_failures


class DicomLoaderOperator(RunEndingOperator):
    """Index the DICOM files under a folder (recursively); pixel data is read later, for the selected series.

    `exclude`: a folder under the input folder to leave out (the app's own output folder).

    Named input:
        input_folder: optional Path; when no operator sends one, the `input_folder` given at construction.

    Named output:
        study_index: a `medserve.dicom.index.StudyIndex` (studies, series, instance headers, skipped files).
    """

    def __init__(self, fragment: Fragment, *args, input_folder: Path | str | None = None,
                 exclude: Path | str | None = None, **kwargs):
        self.input_folder = (folder_argument("DicomLoaderOperator", "input_folder", input_folder)
                             if input_folder is not None else None)
        self.exclude = folder_argument("DicomLoaderOperator", "exclude", exclude) if exclude is not None else None
        super().__init__(fragment, *args, **kwargs)

    def setup(self, spec: OperatorSpec):
        spec.input("input_folder").condition(ConditionType.NONE)
        spec.output("study_index")

    @reports_failures
    def compute(self, op_input, op_output, context):
        folder = op_input.receive("input_folder") or self.input_folder
        if folder is None:
            raise DicomInputError(f"operator {self.name}: no input folder; pass input_folder= or connect an "
                                  f"operator to its input_folder port")
        op_output.emit(index_folder(folder, self.exclude), "study_index")
