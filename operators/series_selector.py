"""SeriesSelectorOperator: choose series with the stock selector's rules JSON."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from monai.deploy.core import ConditionType, Fragment, OperatorSpec
from monai.deploy.core.domain.dicom_series_selection import SelectedSeries as SdkSelectedSeries
from monai.deploy.core.domain.dicom_series_selection import StudySelectedSeries

from medserve.dicom.select import SelectedSeries, load_rules, select_series
from medserve.dicom.index import Instance, Series, StudyIndex, read_dataset
from medserve.dicom.volume import ordered_instances
from medserve.errors import VolumeError
from operators.arguments import flag_argument, received
from operators.failures import RunEndingOperator, reports_failures
from operators.sdk_domain import sdk_series, sdk_study

_DEFER_BYTES = 4096


class SeriesSelectorOperator(RunEndingOperator):
    """Select series by rules (same JSON and matching semantics as DICOMSeriesSelectorOperator).

    rules: a JSON string, a JSON file or a dict, validated here (SelectionError when malformed); None or blank:
        the largest CT or MR series of each study (the stock selects every series). See medserve.dicom.select.
    all_matched, sort_by_sop_instance_count: as the stock operator's (all matches of each selection; with
        all_matched, ordered by SOP instance count, largest first), but checked: True or False, and
        sort_by_sop_instance_count only with all_matched (the stock operator ignores it alone).

    Named input:
        study_index: a StudyIndex from DicomLoaderOperator.

    Named outputs (connect either or both; no back-pressure, as the stock selector's: one message per run):
        selected_series: list of `medserve.dicom.select.SelectedSeries`, in selection order.
        study_selected_series_list: declared only with `sdk_selection=True`: the same selection as the SDK's
            List[StudySelectedSeries] (pixel data deferred: read from the files on access), for stock operators
            such as DICOMSeriesToVolumeOperator or the stock SEG writer.
    """

    def __init__(self, fragment: Fragment, *args, rules: str | Path | dict[str, Any] | None = None,
                 all_matched: bool = False, sort_by_sop_instance_count: bool = False, sdk_selection: bool = False,
                 **kwargs):
        self.rules = load_rules(rules)
        self.all_matched = flag_argument("SeriesSelectorOperator", "all_matched", all_matched)
        self.sort_by_sop_instance_count = flag_argument("SeriesSelectorOperator", "sort_by_sop_instance_count",
                                                        sort_by_sop_instance_count)
        if sort_by_sop_instance_count and not all_matched:
            raise ValueError("SeriesSelectorOperator: sort_by_sop_instance_count=True orders the matches of "
                             "all_matched=True; pass both")
        self.sdk_selection = flag_argument("SeriesSelectorOperator", "sdk_selection", sdk_selection)
        super().__init__(fragment, *args, **kwargs)

    def setup(self, spec: OperatorSpec):
        spec.input("study_index")
        spec.output("selected_series").condition(ConditionType.NONE)
        if self.sdk_selection:  # undeclared otherwise, so that a graph wiring it fails when composed, not stalls
            spec.output("study_selected_series_list").condition(ConditionType.NONE)

    @reports_failures
    def compute(self, op_input, op_output, context):
        index = received("SeriesSelectorOperator", "study_index", op_input.receive("study_index"), StudyIndex,
                         "the StudyIndex of DicomLoaderOperator (the stock DICOMDataLoaderOperator's "
                         "dicom_study_list goes to the stock DICOMSeriesSelectorOperator)")
        selected = select_series(index, self.rules, all_matched=self.all_matched,
                                 sort_by_sop_instance_count=self.sort_by_sop_instance_count)
        op_output.emit(selected, "selected_series")
        if self.sdk_selection:
            op_output.emit(as_sdk_selection(selected), "study_selected_series_list")


def as_sdk_selection(selected: list[SelectedSeries]) -> list[StudySelectedSeries]:
    """Our selection as the stock loader + selector would have built it, attributes filled by the stock code."""
    studies: dict[str, StudySelectedSeries] = {}
    for choice in selected:
        series = choice.series
        # Stock operators read pixel_array from the datasets: defer it, so it comes from disk on access.
        datasets = [read_dataset(i, defer_size=_DEFER_BYTES) for i in _slice_order_if_any(series)]
        if series.study_uid not in studies:
            studies[series.study_uid] = StudySelectedSeries(sdk_study(series.study_uid, datasets[0]))
        selected_series = sdk_series(series.series_uid, datasets)
        studies[series.study_uid].study.add_series(selected_series)
        studies[series.study_uid].add_selected_series(SdkSelectedSeries(choice.name, selected_series, None))
    return list(studies.values())


def _slice_order_if_any(series: Series) -> list[Instance]:
    """Volume order when the series forms a volume; otherwise (a scout or a localizer that --all-matched picked up
    as well) the index's order, as the stock loader would hand it on: the stock operators use only the first
    series, and a series that is used as a volume is checked where it becomes one."""
    try:
        return ordered_instances(series)
    except VolumeError:
        return list(series.instances)
