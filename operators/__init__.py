"""App SDK (Holoscan) operators over medserve's core functions: one operator per module, logic in medserve."""

from operators.bundle_inference import BundleInferenceOperator
from operators.dicom_loader import DicomLoaderOperator
from operators.nifti_writer import NiftiWriterOperator
from operators.result_summary import ResultSummaryOperator
from operators.seg_writer import SegWriterOperator
from operators.series_selector import SeriesSelectorOperator
from operators.series_to_volume import SeriesToVolumeOperator

__all__ = [
    "BundleInferenceOperator",
    "DicomLoaderOperator",
    "NiftiWriterOperator",
    "ResultSummaryOperator",
    "SegWriterOperator",
    "SeriesSelectorOperator",
    "SeriesToVolumeOperator",
]
