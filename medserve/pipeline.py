"""The path from a study to results for the server (and its benchmarks), over the same core functions that the
App SDK operators of apps/bundle_seg call one by one.

study folder -> index -> select -> volume -> predictor -> label map in source geometry -> SEG (+ NIfTI)
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import highdicom as hd
import numpy as np
from pydicom.dataset import Dataset

from medserve.bundle.predictor import BundlePredictor
from medserve.dicom.index import index_folder, is_multiframe_dataset
from medserve.dicom.select import first_selected, select_series
from medserve.dicom.volume import LoadedSeries, load_series, multiframe_geometry
from medserve.errors import one_line
from medserve.nifti_input import read_nifti
from medserve.results import NIFTI_NAME, SEG_NAME
from medserve.writers.files import writable_folder
from medserve.writers.nifti import write_nifti
from medserve.writers.seg import Algorithm, build_seg, write_seg

log = logging.getLogger("medserve.pipeline")


@dataclass
class StudyResult:
    seg_path: Path | None
    nifti_path: Path | None
    study_uid: str | None
    series_uid: str | None
    segments: dict[str, int]
    timings: dict[str, float] = field(default_factory=dict)



def summary_line(segments: dict[str, int], seconds: float) -> str:
    """The one-line result summary the app and the demo print; a bundle's label names written escaped where they
    hold a newline, an escape sequence or a lone surrogate (which stdout could not even encode)."""
    found = ", ".join(f"{name}: {voxels} voxels" for name, voxels in segments.items()) or "none"
    return one_line(f"{len(segments)} segment(s) found ({found}) in {seconds:.1f} s")


def segment_counts(label_map: np.ndarray, labels: dict[int, str]) -> dict[str, int]:
    """Voxels per label present in the map, named by the bundle's labels; a name that several labels share gets
    each one's value ("kidney (label 2)"), as the SEG has a segment for each."""
    values, counts = np.unique(label_map, return_counts=True)
    shared = {name for name, uses in Counter(labels.values()).items() if uses > 1}
    named = {}
    for value, count in ((int(v), int(c)) for v, c in zip(values, counts) if v != 0):
        name = labels.get(value, f"label {value}")
        named[f"{name} (label {value})" if name in shared else name] = count
    return named


def segmentation_of(source: LoadedSeries | list[Dataset], label_map: np.ndarray,
                    predictor: BundlePredictor) -> hd.seg.Segmentation:
    """The SEG of `label_map` over `source`: a loaded series, single-frame source images in the label map's
    slice order (one per slice), or one multi-frame image.

    A multi-frame source's frames need not be in volume order: the label map goes to highdicom as a Volume, which
    it maps onto the frames by position."""
    if isinstance(source, LoadedSeries):
        pixels = source.volume.with_array(label_map) if source.series.is_multiframe else label_map
        datasets = source.source_datasets
    elif len(source) == 1 and is_multiframe_dataset(source[0]):
        pixels, datasets = multiframe_geometry(source[0]).with_array(label_map), source
    else:
        pixels, datasets = label_map, source
    return build_seg(pixels, datasets, predictor.labels, Algorithm(predictor.name, predictor.version))


def run_study(study_dir: Path | str, predictor: BundlePredictor, out_dir: Path | str, *,
              rules: dict[str, Any] | None = None, nifti: bool = True,
              on_stage: Callable[[str, float], None] | None = None) -> StudyResult:
    """Segment the first selected series of the study in `study_dir`; write `seg.dcm` (+ `labels.nii.gz`).
    `on_stage(stage, progress)` is told as each stage starts (a job's progress); it may raise to stop the run
    between stages."""
    timings: dict[str, float] = {}
    clock = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        timings[name] = round(now - clock, 4)
        clock = now

    report = on_stage or (lambda stage, progress: None)
    report("loading the study", 0.35)
    index = index_folder(study_dir)
    selected = first_selected(select_series(index, rules)).series
    source = load_series(selected)
    lap("load")
    report("inferring", 0.45)
    label_map = predictor.predict(source.volume)
    lap("inference")
    report("writing the results", 0.8)
    out = Path(out_dir)
    writable_folder(out)  # an OutputError naming it, as the writers' own failures are
    seg_path = write_seg(segmentation_of(source, label_map, predictor), out / SEG_NAME)
    try:
        nifti_path = write_nifti(label_map, source.volume, out / NIFTI_NAME) if nifti else None
    except BaseException:  # all or nothing: a SEG alone would pass for the whole result
        seg_path.unlink(missing_ok=True)
        raise
    lap("write")
    result = StudyResult(seg_path=seg_path, nifti_path=nifti_path, study_uid=selected.study_uid,
                         series_uid=selected.series_uid, segments=segment_counts(label_map, predictor.labels),
                         timings=timings)
    log.info("study segmented", extra={"series": selected.series_uid, "segments": result.segments,
                                       "timings": timings})
    return result


def run_nifti(nifti_path: Path | str, predictor: BundlePredictor, out_dir: Path | str) -> StudyResult:
    """Segment a NIfTI volume; the result is a NIfTI label map in the input's geometry (no SEG without DICOM)."""
    started = time.perf_counter()
    source = read_nifti(Path(nifti_path))
    label_map = predictor.predict(source.volume)
    out = Path(out_dir)
    writable_folder(out)
    nifti_out = write_nifti(label_map, source.volume, out / NIFTI_NAME, like=source.header)
    return StudyResult(seg_path=None, nifti_path=nifti_out, study_uid=None, series_uid=None,
                       segments=segment_counts(label_map, predictor.labels),
                       timings={"total": round(time.perf_counter() - started, 4)})
