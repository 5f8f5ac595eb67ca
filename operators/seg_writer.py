"""SegWriterOperator: write the label map as a DICOM SEG referencing its source series."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from monai.deploy.core import ConditionType, Fragment, OperatorSpec
from monai.deploy.core.domain.dicom_series_selection import StudySelectedSeries
from pydicom.dataset import Dataset

from medserve.bundle.predictor import BundlePredictor
from medserve.dicom.volume import LoadedSeries, datasets_in_slice_order
from medserve.pipeline import segmentation_of
from medserve.results import SEG_NAME
from medserve.writers.labels import label_array
from medserve.writers.seg import write_seg
from operators.arguments import folder_argument, predictor_argument
from operators.failures import RunEndingOperator, records_output, reports_failures


class SegWriterOperator(RunEndingOperator):
    """Write `seg.dcm` (highdicom, BINARY, empty frames omitted) into the output folder.

    Segment names and codes come from the predictor's bundle metadata.

    Named inputs:
        label_map: the label map, (slice, row, column): a numpy array (BundleInferenceOperator), or an SDK
            `Image` holding one (as stock inference operators emit it).
        source: what it was computed on (geometry, referenced instances, patient/study attributes), either
            - the `LoadedSeries` from our SeriesToVolumeOperator, or
            - the SDK's List[StudySelectedSeries] (the stock or our selector's `study_selected_series_list`): its
              first selected series is referenced, as the stock DICOMSegmentationWriterOperator does, with the
              label map's slices in volume order (ascending along the slice normal, as both to-volume operators
              stack them).
        A label map that does not fit the source's images is refused, naming both shapes.
        output_folder: optional Path, as the stock DICOMSegmentationWriterOperator's: this run's folder; when
            no operator sends one, the `output_folder` given at construction.

    Named output (may be left unconnected, as the stock writer has none; like the stock operators' optional
    outputs it has no back-pressure: one message per run, as apps with a CountCondition(1) loader send):
        seg_path: Path of the written file (written under a temporary name, then renamed).
    """

    def __init__(self, fragment: Fragment, *args, output_folder: Path | str, predictor: BundlePredictor, **kwargs):
        self.output_folder = folder_argument("SegWriterOperator", "output_folder", output_folder)
        self.predictor = predictor_argument("SegWriterOperator", predictor)
        super().__init__(fragment, *args, **kwargs)

    def setup(self, spec: OperatorSpec):
        spec.input("label_map")
        spec.input("source")
        spec.input("output_folder").condition(ConditionType.NONE)
        spec.output("seg_path").condition(ConditionType.NONE)  # optional: see the class docstring

    @reports_failures
    def compute(self, op_input, op_output, context):
        label_map = label_array(op_input.receive("label_map"))
        source = source_images(op_input.receive("source"))
        folder = Path(op_input.receive("output_folder") or self.output_folder)
        folder.mkdir(parents=True, exist_ok=True)
        segmentation = segmentation_of(source, label_map, self.predictor)
        path = write_seg(segmentation, folder / SEG_NAME)
        op_output.emit(records_output(self.fragment, path), "seg_path")


def source_images(source: Any) -> LoadedSeries | list[Dataset]:
    """The `source` input as `segmentation_of` takes it: our LoadedSeries as it is; an SDK selection as its first
    selected series' datasets in volume order (ascending along the slice normal, the order of the stock
    DICOMSeriesToVolumeOperator's Image and of ours), whether or not the stock operator has sorted them yet.

    A series that does not form a volume is a VolumeError; an empty selection a ValueError; anything else a
    TypeError naming what was expected.
    """
    if isinstance(source, LoadedSeries):
        return source
    if isinstance(source, list) and all(isinstance(s, StudySelectedSeries) for s in source):
        if not source or not source[0].selected_series:
            raise ValueError("SEG writer source: the SDK selection holds no selected series")
        series = source[0].selected_series[0].series
        return datasets_in_slice_order([instance.get_native_sop_instance() for instance in series.get_sop_instances()])
    raise TypeError(f"SEG writer source: expected a LoadedSeries (SeriesToVolumeOperator) or the SDK's "
                    f"List[StudySelectedSeries]; got {type(source).__module__}.{type(source).__qualname__}")
