"""Our series as the App SDK's domain objects, with the attributes the stock loader's own code copies."""

from __future__ import annotations

from typing import Any

from monai.deploy.core.domain.dicom_series import DICOMSeries
from monai.deploy.core.domain.dicom_study import DICOMStudy
from monai.deploy.operators.dicom_data_loader_operator import DICOMDataLoaderOperator
from monai.deploy.operators.dicom_series_to_volume_operator import DICOMSeriesToVolumeOperator
from pydicom import valuerep
from pydicom.dataset import Dataset

from medserve.dicom.index import Series

_POPULATE = DICOMDataLoaderOperator  # its attribute-copying methods use no instance state


def sdk_study(study_uid: str, header: Dataset) -> DICOMStudy:
    study = DICOMStudy(study_uid)
    _POPULATE.populate_study_attributes(None, study, header)
    return study


def sdk_series(series_uid: str, datasets: list[Dataset]) -> DICOMSeries:
    """A DICOMSeries of `datasets` (in that order), its attributes from the first."""
    series = DICOMSeries(series_uid)
    for dataset in datasets:
        series.add_sop_instance(dataset)
    _POPULATE.populate_series_attributes(None, series, _convertible(datasets[0]))
    return series


def _convertible(header: Dataset) -> Dataset:
    """`header` without the values the stock code converts unguarded and would crash on (an empty Type 2
    SeriesNumber, as anonymisers leave it; a PixelSpacing of one value): such attributes are left unset, as
    absent ones are. A copy: the header itself is what the SEG references."""
    trimmed = Dataset(dict(header))
    for keyword, usable in _STOCK_CONVERSIONS.items():
        if keyword in trimmed:
            try:
                usable(trimmed[keyword].value)
            except (TypeError, ValueError, IndexError):
                del trimmed[keyword]
    return trimmed


def _series_number(value: Any) -> None:
    if not isinstance(value, valuerep.IS):
        int(value)


def _pixel_spacing(value: Any) -> None:
    value[1]  # noqa: B018 - the stock code reads both values


def _orientation(value: Any) -> None:
    if len(value) > 6:
        raise ValueError(value)
    [float(v) for v in value]


_STOCK_CONVERSIONS = {"SeriesNumber": _series_number, "PixelSpacing": _pixel_spacing,
                      "ImagerPixelSpacing": _pixel_spacing, "ImageOrientationPatient": _orientation}


def stock_image_metadata(series: Series) -> dict[str, Any]:
    """The study and series properties the stock DICOMSeriesToVolumeOperator puts in its Image's metadata (series
    first, then study, values that are not None), read from the series' first header."""
    properties = DICOMSeriesToVolumeOperator._get_instance_properties
    return {**properties(sdk_series(series.series_uid, [series.header])),
            **properties(sdk_study(series.study_uid, series.header))}
