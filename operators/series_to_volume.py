"""SeriesToVolumeOperator: the first selected series as a volume with its patient-space geometry."""

from __future__ import annotations

import highdicom as hd
import numpy as np
from monai.deploy.core import ConditionType, OperatorSpec
from monai.deploy.core.domain.image import Image

from medserve.dicom.index import Series
from medserve.dicom.select import SelectedSeries, first_selected
from medserve.dicom.volume import load_series, ras_affine
from operators.arguments import received
from operators.failures import RunEndingOperator, reports_failures
from operators.sdk_domain import stock_image_metadata


class SeriesToVolumeOperator(RunEndingOperator):
    """Read the first selected series' pixels into a float32 volume (modality units, slices along the normal).

    Named input:
        selected_series: list of SelectedSeries from SeriesSelectorOperator.

    Named outputs (connect any of them; one left unconnected does not hold the operator back. As the stock
    operators' optional outputs, they have no back-pressure: one message per run):
        volume: `highdicom.Volume`, array (slice, row, column), LPS affine.
        source: `medserve.dicom.volume.LoadedSeries`: the series, its volume and its instances in slice order
            (what the SEG writer references).
        image: optional; the SDK `Image` the stock DICOMSeriesToVolumeOperator emits (DHW array, RAS "affine", the
            spacing/direction metadata keys), for stock inference operators.
    """

    def setup(self, spec: OperatorSpec):
        spec.input("selected_series")
        spec.output("volume").condition(ConditionType.NONE)
        spec.output("source").condition(ConditionType.NONE)
        spec.output("image").condition(ConditionType.NONE)

    @reports_failures
    def compute(self, op_input, op_output, context):
        choice = first_selected(received(
            "SeriesToVolumeOperator", "selected_series", op_input.receive("selected_series"), SelectedSeries,
            "the list of SelectedSeries of SeriesSelectorOperator (the stock DICOMSeriesSelectorOperator's "
            "study_selected_series_list goes to the stock DICOMSeriesToVolumeOperator)", list_of=True))
        source = load_series(choice.series)
        op_output.emit(source.volume, "volume")
        op_output.emit(source, "source")
        op_output.emit(sdk_image(source.volume, choice.series, choice.name), "image")


def sdk_image(volume: hd.Volume, series: Series, selection_name: str) -> Image:
    """The metadata keys of the stock operator's Image (the study and series attributes, the geometry), so that
    stock consumers and code written for the stock Image find what they read."""
    slice_vector, column_vector, row_vector = (volume.affine[:3, i] for i in range(3))
    geometry = {
        "row_pixel_spacing": float(np.linalg.norm(column_vector)),
        "col_pixel_spacing": float(np.linalg.norm(row_vector)),
        "depth_pixel_spacing": float(np.linalg.norm(slice_vector)),
        "row_direction_cosine": list(row_vector / np.linalg.norm(row_vector)),
        "col_direction_cosine": list(column_vector / np.linalg.norm(column_vector)),
        "depth_direction_cosine": list(slice_vector / np.linalg.norm(slice_vector)),
        "dicom_affine_transform": volume.affine[:, [2, 1, 0, 3]],
        "nifti_affine_transform": ras_affine(volume),
        "affine": ras_affine(volume),
        "space": "RAS",
        "selection_name": selection_name,
    }
    return Image(volume.array, metadata={**stock_image_metadata(series), **geometry})
