"""apps/bundle_seg end to end, run as a user runs it (a subprocess), and its refusals of bad input."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import highdicom as hd
import nibabel as nib
import numpy as np
import pydicom
import pytest
import torch

from medserve.bundle.predictor import BundlePredictor
from medserve.demo.phantom import dice, make_phantom
from medserve.dicom.index import index_folder
from medserve.dicom.select import select_series
from medserve.dicom.volume import ras_affine, series_to_volume
from medserve.pipeline import StudyResult, run_study, segmentation_of
from medserve.writers.seg import write_seg
from tests.conftest import APP, DEMO_BUNDLE, REPO, dciodvfy_errors, make_threshold_bundle, run_app


@pytest.fixture(scope="module")
def demo_run(demo_study, tmp_path_factory):
    folder, written, phantom = demo_study
    out = tmp_path_factory.mktemp("demo_out")
    completed = run_app("-i", folder, "-o", out, "-m", DEMO_BUNDLE)
    assert completed.returncode == 0, completed.stderr
    return out, completed, phantom


def test_app_writes_a_valid_seg_and_nifti_that_match_the_truth(demo_run, demo_study):
    out, completed, phantom = demo_run
    assert sorted(p.name for p in out.iterdir()) == ["labels.nii.gz", "seg.dcm"]
    assert "1 segment(s) found (spleen:" in completed.stdout
    assert "Traceback" not in completed.stderr
    assert dciodvfy_errors(out / "seg.dcm") == []

    source = series_to_volume(select_series(index_folder(demo_study[0]))[0].series)
    nifti = nib.load(out / "labels.nii.gz")
    np.testing.assert_allclose(nifti.affine, ras_affine(source), atol=1e-4)
    labels = np.asarray(nifti.dataobj).transpose(2, 1, 0)
    assert dice(labels, phantom.organ) >= 0.9

    seg = hd.seg.segread(out / "seg.dcm")
    assert seg.ReferencedSeriesSequence[0].SeriesInstanceUID == demo_study[1].series_uid
    back = seg.get_volume(combine_segments=True).match_geometry(source)
    np.testing.assert_array_equal(back.array, labels)


def test_holoscan_environment_variables_work_like_the_flags(demo_run, demo_study, tmp_path):
    out = tmp_path / "env_out"
    completed = run_app(env={"HOLOSCAN_INPUT_PATH": str(demo_study[0]), "HOLOSCAN_OUTPUT_PATH": str(out),
                             "HOLOSCAN_MODEL_PATH": str(DEMO_BUNDLE.parent)})  # a models folder, as in a MAP
    assert completed.returncode == 0, completed.stderr
    flags = pydicom.dcmread(demo_run[0] / "seg.dcm")
    env = pydicom.dcmread(out / "seg.dcm")
    assert env.PixelData == flags.PixelData


@pytest.mark.parametrize("entry", [["apps/bundle_seg"], ["-m", "apps.bundle_seg"]], ids=["folder", "module"])
def test_the_app_folder_runs_as_a_program_and_as_a_module(demo_run, demo_study, tmp_path, entry):
    out = tmp_path / "out"
    command = " ".join([sys.executable, *entry, "-i", str(demo_study[0]), "-o", str(out), "-m", str(DEMO_BUNDLE)])
    completed = subprocess.run(["bash", "-c", f"ulimit -s 32768; cd {REPO}; exec {command}"], capture_output=True,
                               text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr
    assert pydicom.dcmread(out / "seg.dcm").PixelData == pydicom.dcmread(demo_run[0] / "seg.dcm").PixelData


def test_pipeline_leaves_no_seg_alone_when_the_nifti_fails(tmp_path):
    """run_study writes both results or neither: a SEG without its NIfTI would pass for a whole result."""
    from medserve.demo.study import write_ct_series
    from medserve.errors import OutputError
    from tests.conftest import make_threshold_bundle

    hu = np.full((4, 12, 12), -50.0, np.float32)
    hu[1:3, 3:9, 3:9] = 300
    write_ct_series(hu, tmp_path / "study")
    predictor = BundlePredictor.from_dir(make_threshold_bundle(tmp_path / "thr"), device="cpu")
    out = tmp_path / "out"
    (out / "labels.nii.gz").mkdir(parents=True)  # the NIfTI cannot be written there
    with pytest.raises(OutputError, match="labels.nii.gz"):
        run_study(tmp_path / "study", predictor, out)
    assert sorted(p.name for p in out.iterdir()) == ["labels.nii.gz"]  # no seg.dcm


@pytest.mark.parametrize("source", ["dicom", "nifti"])
def test_pipeline_names_an_output_folder_it_cannot_create(tmp_path, source):
    """The server's job result folder failed as a bare OSError with the server's path (an internal error)."""
    import nibabel as nib

    from medserve.demo.study import write_ct_series
    from medserve.errors import OutputError
    from medserve.pipeline import run_nifti
    from tests.conftest import make_threshold_bundle

    hu = np.full((4, 12, 12), -50.0, np.float32)
    hu[1:3, 3:9, 3:9] = 300
    predictor = BundlePredictor.from_dir(make_threshold_bundle(tmp_path / "thr"), device="cpu")
    (tmp_path / "a_file").write_text("in the way")
    out = tmp_path / "a_file" / "result"
    with pytest.raises(OutputError, match=r"output folder .*a_file/result: cannot be created \(Not a directory\)"):
        if source == "dicom":
            write_ct_series(hu, tmp_path / "study")
            run_study(tmp_path / "study", predictor, out)
        else:
            nib.save(nib.Nifti1Image(hu.transpose(2, 1, 0), np.eye(4)), tmp_path / "ct.nii.gz")
            run_nifti(tmp_path / "ct.nii.gz", predictor, out)


def test_pipeline_reports_its_stages_and_a_stage_report_may_stop_it(tmp_path):
    """A job showed "inferring" at 0.4 through loading, inference and writing; a cancel now stops it between them."""
    from medserve.demo.study import write_ct_series
    from tests.conftest import make_threshold_bundle

    hu = np.full((4, 12, 12), -50.0, np.float32)
    hu[1:3, 3:9, 3:9] = 300
    write_ct_series(hu, tmp_path / "study")
    predictor = BundlePredictor.from_dir(make_threshold_bundle(tmp_path / "thr"), device="cpu")
    stages: list[tuple[str, float]] = []
    run_study(tmp_path / "study", predictor, tmp_path / "out", on_stage=lambda *stage: stages.append(stage))
    assert stages == [("loading the study", 0.35), ("inferring", 0.45), ("writing the results", 0.8)]

    class Stop(Exception):
        pass

    def stop_at_writing(stage: str, progress: float) -> None:
        if stage == "writing the results":
            raise Stop()

    with pytest.raises(Stop):
        run_study(tmp_path / "study", predictor, tmp_path / "stopped", on_stage=stop_at_writing)
    assert not (tmp_path / "stopped").exists()


def test_pipeline_gives_the_same_pixels_as_the_app(demo_run, demo_study, tmp_path):
    """One core: the in-process pipeline (what the server runs) and the Holoscan app agree bit for bit."""
    result = run_study(demo_study[0], BundlePredictor.from_dir(DEMO_BUNDLE, device="cpu"), tmp_path)
    assert pydicom.dcmread(result.seg_path).PixelData == pydicom.dcmread(demo_run[0] / "seg.dcm").PixelData
    assert np.array_equal(np.asarray(nib.load(result.nifti_path).dataobj),
                          np.asarray(nib.load(demo_run[0] / "labels.nii.gz").dataobj))
    assert result.segments["spleen"] > 0


def test_sdk_selection_of_all_matches_keeps_a_scout_that_is_no_volume(tmp_path):
    """--all-matched with --sort-by-sop-instance-count, the stock idiom to step past a scout: the SDK-typed
    selection holds the volume first (in slice order) and the two-image localizer after it, not an error."""
    from medserve.demo.study import write_ct_series
    from operators.series_selector import as_sdk_selection

    hu = np.random.default_rng(3).integers(-1000, 1000, size=(6, 20, 24)).astype(np.float32)
    ct = write_ct_series(hu, tmp_path / "ct", file_order_seed=2)
    scout = write_ct_series(hu[:2], tmp_path / "scout", study_uid=ct.study_uid, series_description="Topogram")
    views = (["1", "0", "0", "0", "0", "-1"], ["0", "1", "0", "0", "0", "-1"])  # AP and lateral
    for path, orientation in zip(sorted(scout.paths), views):
        dataset = pydicom.dcmread(path)
        dataset.ImageOrientationPatient, dataset.ImageType = orientation, ["ORIGINAL", "PRIMARY", "LOCALIZER"]
        dataset.save_as(path)
    rules = {"selections": [{"name": "ct", "conditions": {"Modality": "CT"}}]}
    selected = select_series(index_folder(tmp_path), rules, all_matched=True, sort_by_sop_instance_count=True)
    [study] = as_sdk_selection(selected)
    volume, localizer = (s.series for s in study.selected_series)
    assert volume.SeriesInstanceUID == ct.series_uid and localizer.SeriesInstanceUID == scout.series_uid
    positions = [float(i.get_native_sop_instance().ImagePositionPatient[2]) for i in volume.get_sop_instances()]
    assert positions == sorted(positions) or positions == sorted(positions, reverse=True)
    assert len(localizer.get_sop_instances()) == 2


def test_stock_sdk_operators_read_our_selection(tmp_path):
    """Interop: the stock series-to-volume operator consumes our selector's SDK-typed output unchanged, and our
    Image carries the stock metadata keys with the same values. Non-square pixels and unequal slice spacing, so
    that a swapped spacing or axis shows."""
    from monai.deploy.core import Fragment
    from monai.deploy.operators.dicom_series_to_volume_operator import DICOMSeriesToVolumeOperator

    from medserve.demo.study import SeriesGeometry, write_ct_series
    from operators.series_selector import as_sdk_selection
    from operators.series_to_volume import sdk_image

    hu = np.random.default_rng(3).integers(-1000, 1000, size=(6, 20, 24)).astype(np.float32)
    geometry = SeriesGeometry(pixel_spacing=(0.7, 0.9), slice_spacing=2.5)
    write_ct_series(hu, tmp_path, geometry)
    selected = select_series(index_folder(tmp_path))
    stock = DICOMSeriesToVolumeOperator(Fragment(), name="stock").convert_to_image(as_sdk_selection(selected))
    ours = series_to_volume(selected[0].series)
    np.testing.assert_allclose(stock.asnumpy(), ours.array, atol=1e-3)
    np.testing.assert_allclose(ours.affine, geometry.affine(), atol=1e-6)
    metadata = sdk_image(ours, selected[0].series, selected[0].name).metadata()
    assert (metadata["row_pixel_spacing"], metadata["col_pixel_spacing"]) == pytest.approx((0.7, 0.9))
    for key in ("row_pixel_spacing", "col_pixel_spacing", "depth_pixel_spacing", "row_direction_cosine",
                "col_direction_cosine", "depth_direction_cosine"):
        np.testing.assert_allclose(metadata[key], stock.metadata()[key], atol=1e-6, err_msg=key)
    # The affine is the true geometry: the stock's scales the in-plane axes with each other's spacing.
    np.testing.assert_allclose(metadata["affine"], ras_affine(ours), atol=1e-6)
    # Every other key of the stock Image (study and series attributes: StudyDate, AccessionNumber, ...) is there
    # with the stock value.
    assert set(stock.metadata()) <= set(metadata), set(stock.metadata()) - set(metadata)
    assert {"StudyDate", "StudyTime", "AccessionNumber", "SeriesTime", "PatientPosition"} <= set(metadata)
    geometry_keys = {"dicom_affine_transform", "nifti_affine_transform", "affine", "row_pixel_spacing",
                     "col_pixel_spacing", "depth_pixel_spacing", "row_direction_cosine", "col_direction_cosine",
                     "depth_direction_cosine"}
    for key in set(stock.metadata()) - geometry_keys:
        assert metadata[key] == stock.metadata()[key], key


def _enhanced_ct(paths: list[Path]) -> hd.legacy.LegacyConvertedEnhancedCTImage:
    """One Enhanced CT object of the single-frame slices at `paths` (frames stored as the converter orders them)."""
    return hd.legacy.LegacyConvertedEnhancedCTImage(
        legacy_datasets=[pydicom.dcmread(p) for p in paths], series_instance_uid=pydicom.uid.generate_uid(),
        series_number=4, sop_instance_uid=pydicom.uid.generate_uid(), instance_number=1)


def _valid_seg_of(enhanced: pydicom.Dataset, tmp_path: Path,
                  predictor: BundlePredictor) -> tuple[StudyResult, hd.Volume]:
    """The pipeline on `enhanced` saved alone in tmp_path/multi: its result (a SEG dciodvfy passes) and volume."""
    (tmp_path / "multi").mkdir()
    enhanced.save_as(tmp_path / "multi" / "enhanced.dcm")
    result = run_study(tmp_path / "multi", predictor, tmp_path / "out")
    assert dciodvfy_errors(result.seg_path) == []
    return result, series_to_volume(select_series(index_folder(tmp_path / "multi"))[0].series)


def test_an_enhanced_multiframe_source_gives_a_valid_seg_of_the_label_map(tmp_path, threshold_bundle):
    """The pipeline (the server's path; the app's operators call the same functions) on one multi-frame object
    whose frames are stored out of volume order; then the SEG writer operator's other source, an SDK selection."""
    from medserve.demo.phantom import make_phantom
    from medserve.demo.study import write_ct_series
    from operators.seg_writer import source_images
    from operators.series_selector import as_sdk_selection

    written = write_ct_series(make_phantom(shape=(10, 32, 36)).hu, tmp_path / "single", file_order_seed=1)
    enhanced = _enhanced_ct(written.paths)
    predictor = BundlePredictor.from_dir(threshold_bundle, device="cpu")
    result, source = _valid_seg_of(enhanced, tmp_path, predictor)
    label_map = predictor.predict(source)
    assert 0 < np.count_nonzero(label_map) < label_map.size
    seg = hd.seg.segread(result.seg_path)
    assert seg.ReferencedSeriesSequence[0].ReferencedInstanceSequence[0].ReferencedSOPInstanceUID == \
        enhanced.SOPInstanceUID
    back = seg.get_volume(combine_segments=True).match_geometry(source)
    np.testing.assert_array_equal(back.array, label_map)
    frame_z = [float(g.PlanePositionSequence[0].ImagePositionPatient[2])
               for g in enhanced.PerFrameFunctionalGroupsSequence]
    assert frame_z != sorted(frame_z)  # the converter stores them descending; the volume ascends

    sdk_source = source_images(as_sdk_selection(select_series(index_folder(tmp_path / "multi"))))
    write_seg(segmentation_of(sdk_source, label_map, predictor), tmp_path / "sdk.dcm")
    back = hd.seg.segread(tmp_path / "sdk.dcm").get_volume(combine_segments=True).match_geometry(source)
    np.testing.assert_array_equal(back.array, label_map)


@pytest.mark.parametrize("keyword", ["PixelMeasuresSequence", "PlaneOrientationSequence"])
def test_an_enhanced_source_with_its_geometry_in_every_frame_gets_its_seg(tmp_path, threshold_bundle, keyword):
    """Scanners (Philips Enhanced MR) may keep the pixel measures or the orientation in every frame's functional
    groups rather than the shared ones: the volume loaded, and the SEG failed after the inference (internal error,
    exit 1: highdicom reads them from the shared groups only)."""
    import copy

    from medserve.demo.phantom import make_phantom
    from medserve.demo.study import write_ct_series
    from medserve.errors import DicomInputError
    from medserve.writers.seg import _shared_geometry

    written = write_ct_series(make_phantom(shape=(6, 24, 28)).hu, tmp_path / "single")
    enhanced = _enhanced_ct(written.paths)
    shared = enhanced.SharedFunctionalGroupsSequence[0]
    for frame in enhanced.PerFrameFunctionalGroupsSequence:
        setattr(frame, keyword, copy.deepcopy(shared[keyword].value))
    delattr(shared, keyword)
    predictor = BundlePredictor.from_dir(threshold_bundle, device="cpu")
    result, source = _valid_seg_of(enhanced, tmp_path, predictor)
    back = hd.seg.segread(result.seg_path).get_volume(combine_segments=True).match_geometry(source)
    np.testing.assert_array_equal(back.array, predictor.predict(source))
    assert keyword not in pydicom.dcmread(tmp_path / "multi" / "enhanced.dcm").SharedFunctionalGroupsSequence[0]

    first = enhanced.PerFrameFunctionalGroupsSequence[0]
    if keyword == "PixelMeasuresSequence":  # rounded differently by the writer: the same spacing
        first.PixelMeasuresSequence[0].PixelSpacing = [v + 0.0004 for v in first.PixelMeasuresSequence[0].PixelSpacing]
    else:
        first.PlaneOrientationSequence[0].ImageOrientationPatient = [
            v + 0.0004 for v in first.PlaneOrientationSequence[0].ImageOrientationPatient]
    assert _shared_geometry(enhanced, "enhanced.dcm") is not None
    if keyword == "PixelMeasuresSequence":
        first.PixelMeasuresSequence[0].PixelSpacing = [0.5, 0.5]
    else:
        first.PlaneOrientationSequence[0].ImageOrientationPatient = [0, 1, 0, 1, 0, 0]
    with pytest.raises(DicomInputError, match=f"{keyword} is neither in the shared functional groups nor the same "
                                              "in every frame's"):  # the loader refuses such frames before
        _shared_geometry(enhanced, "enhanced.dcm")


def _bad_bundle(tmp_path: Path, damage: str) -> Path:
    if damage == "no bundle":
        return tmp_path / "nowhere"
    bundle = tmp_path / "bundle"
    shutil.copytree(DEMO_BUNDLE, bundle)
    if damage == "no weights":
        (bundle / "models" / "model.pt").unlink()
    elif damage == "malformed config":
        (bundle / "configs" / "inference.json").write_text("{ this is not json")
    elif damage == "weights do not fit":
        torch.save(torch.nn.Linear(3, 3).state_dict(), bundle / "models" / "model.pt")
    return bundle


def _damaged_study(tmp_path: Path, demo_study, damage: str) -> Path:
    folder = tmp_path / "study"
    if damage == "empty":
        folder.mkdir()
        return folder
    if damage == "no dicom":
        folder.mkdir()
        (folder / "scan.txt").write_text("hello")
        return folder
    shutil.copytree(demo_study[0], folder)
    paths = sorted(folder.iterdir())
    if damage == "corrupt file":
        paths[3].write_bytes(paths[3].read_bytes()[:-5000])
    elif damage == "missing slice":
        paths[len(paths) // 2].unlink()
    return folder


BAD_INPUTS = [
    ("empty", None, "is empty"),
    ("no dicom", None, "no DICOM files found"),
    ("corrupt file", None, "pixel data is truncated"),
    ("missing slice", None, r"missing 1 slice\(s\)"),
    ("fine", "no series", "no series in .* matches the selection rules"),
    ("fine", "no bundle", "model path .*nowhere does not exist; expected a bundle folder"),
    ("fine", "no weights", "no weights; expected models/model.pt"),
    ("fine", "malformed config", "inference.json: cannot read config"),
    ("fine", "weights do not fit", "weights do not fit network_def UNet in inference.json: Missing key.*; "
                                   "Unexpected key"),
]


@pytest.mark.parametrize("study_damage,bundle_damage,message", BAD_INPUTS)
def test_bad_input_exits_non_zero_with_a_clear_message_and_no_output(tmp_path, demo_study, study_damage,
                                                                     bundle_damage, message):
    study = _damaged_study(tmp_path, demo_study, study_damage)
    bundle = _bad_bundle(tmp_path, bundle_damage) if bundle_damage not in (None, "no series") else DEMO_BUNDLE
    out = tmp_path / "out"
    extra = ["--rules", json.dumps({"selections": [{"name": "mr", "conditions": {"Modality": "MR"}}]})] \
        if bundle_damage == "no series" else []
    completed = run_app("-i", study, "-o", out, "-m", bundle, *extra)
    assert completed.returncode != 0
    assert "Traceback" not in completed.stderr + completed.stdout
    error_lines = [line for line in completed.stderr.splitlines() if line.startswith("error: ")]
    assert len(error_lines) == 1 and re.search(message, error_lines[0]), completed.stderr
    assert not out.exists() or not any(out.iterdir())


def test_all_matched_sorted_by_instance_count_segments_the_largest_match(tmp_path, demo_study):
    """With rules, the first match in study order is used (a scout that sorts first), as the stock selector does;
    --all-matched --sort-by-sop-instance-count, the stock's way to prefer the largest, takes the full series."""
    from medserve.demo.study import SeriesGeometry, write_ct_series

    folder, written, phantom = demo_study
    study = tmp_path / "study"
    shutil.copytree(folder, study / "b_full")
    geometry = SeriesGeometry(pixel_spacing=phantom.spacing[1:], slice_spacing=phantom.spacing[0])
    scout = write_ct_series(phantom.hu[:16], study / "a_scout", geometry, study_uid=written.study_uid,
                            series_description="Scout")
    rules = json.dumps({"selections": [{"name": "ct", "conditions": {"Modality": "CT"}}]})
    for flags, expected in [((), scout.series_uid),
                            (("--all-matched", "--sort-by-sop-instance-count"), written.series_uid)]:
        out = tmp_path / f"out{len(flags)}"
        completed = run_app("-i", study, "-o", out, "-m", DEMO_BUNDLE, "--rules", rules, *flags)
        assert completed.returncode == 0, completed.stderr
        seg = pydicom.dcmread(out / "seg.dcm")
        assert seg.ReferencedSeriesSequence[0].SeriesInstanceUID == expected, flags
        # With --all-matched the other match is named as not segmented (one volume per run, as the stock's).
        assert (f"1 more selected series not segmented (only the first is): {scout.series_uid}" in completed.stderr
                ) == bool(flags), completed.stderr

    refused = run_app("-i", study, "-o", tmp_path / "refused", "-m", DEMO_BUNDLE, "--rules", rules,
                      "--sort-by-sop-instance-count")
    assert refused.returncode == 2
    assert "error: --sort-by-sop-instance-count orders the matches of --all-matched; pass both" in refused.stderr
    assert not (tmp_path / "refused").exists()


@pytest.mark.parametrize("refusal", ["no such input", "sort without all-matched"])
def test_a_refused_run_leaves_no_earlier_results_behind(tmp_path, demo_study, refusal):
    """A script that runs the app with a wrong -i must not find the previous run's seg.dcm beside the error."""
    out = tmp_path / "out"
    out.mkdir()
    for name in ("seg.dcm", "labels.nii.gz"):
        (out / name).write_bytes(b"an earlier run's result")
    arguments = {"no such input": ["-i", tmp_path / "nowhere"],
                 "sort without all-matched": ["-i", demo_study[0], "--sort-by-sop-instance-count"]}[refusal]
    completed = run_app(*arguments, "-o", out, "-m", DEMO_BUNDLE)
    assert completed.returncode == 2 and completed.stderr.count("error: ") == 1, completed.stderr
    assert list(out.iterdir()) == []


def test_an_output_path_that_is_a_file_is_refused_and_left_alone(tmp_path, demo_study):
    out = tmp_path / "out"
    out.write_text("not a folder")
    completed = run_app("-i", demo_study[0], "-o", out, "-m", DEMO_BUNDLE)
    assert completed.returncode == 2
    assert re.search(r"error: output folder .*out: cannot be created", completed.stderr), completed.stderr
    assert "Traceback" not in completed.stderr
    assert out.read_text() == "not a folder"


# Runs the app's main() with one function replaced by one that raises: a fault of ours (RuntimeError), or the
# environment's (OSError: the disk is full); or by one that never returns ("stall"); or, for an operator's compute,
# by one that emits nothing ("silent").
_BROKEN_APP = """
import errno, importlib, importlib.util, os, sys, time
from medserve.stopping import block_stop_signals
block_stop_signals()  # as apps/bundle_seg/__main__.py does before importing the app
module_name, attribute, kind, app_path = sys.argv[1:5]
spec = importlib.util.spec_from_file_location("bundle_seg_app", app_path)
app = importlib.util.module_from_spec(spec)
spec.loader.exec_module(app)
owner = importlib.import_module(module_name)
for name in attribute.split(".")[:-1]:
    owner = getattr(owner, name)
def broken(*args, **kwargs):
    if kind == "silent":  # an operator's compute that takes its inputs and emits nothing
        operator, op_input = args[:2]
        for name in operator.spec.inputs:
            op_input.receive(name)
        return
    if kind == "OSError":
        raise OSError(errno.ENOSPC, "No space left on device")
    if kind == "stall":  # says so in the file $STALLED, then takes for ever
        open(os.environ["STALLED"], "w").close()
        time.sleep(600)
    raise RuntimeError("disk on fire")
setattr(owner, attribute.split(".")[-1], broken)
sys.exit(app.main(sys.argv[5:]))
"""


def broken_app_command(tmp_path: Path, folder: Path, module_name: str, attribute: str, kind: str,
                       out: Path) -> list[str]:
    driver = tmp_path / "broken_app.py"
    driver.write_text(_BROKEN_APP)
    return ["bash", "-c", f"ulimit -s 32768; cd {REPO}; exec {sys.executable} {driver} {module_name} {attribute} "
                          f"{kind} {APP} -i {folder} -o {out} -m {DEMO_BUNDLE} --device cpu"]


def run_broken_app(tmp_path: Path, folder: Path, module_name: str, attribute: str, kind: str,
                   out: Path) -> subprocess.CompletedProcess:
    command = broken_app_command(tmp_path, folder, module_name, attribute, kind, out)
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("module_name,attribute,operator", [
    ("operators.seg_writer", "write_seg", "seg_writer"),  # fails beside the NIfTI writer, which may finish
    ("operators.result_summary", "summary_line", "summary"),  # fails after both outputs are written
])
def test_an_internal_failure_is_one_line_exit_1_and_nothing_written_is_left(tmp_path, demo_study, module_name,
                                                                             attribute, operator):
    out = tmp_path / "out"
    completed = run_broken_app(tmp_path, demo_study[0], module_name, attribute, "RuntimeError", out)
    assert completed.returncode == 1, completed.stderr
    assert f"error: internal error in operator {operator}: RuntimeError: disk on fire" in completed.stderr
    assert "Traceback" not in completed.stderr + completed.stdout
    assert "wrote" not in completed.stdout
    assert not out.exists()


def test_a_graph_that_stops_without_writing_its_results_is_an_error(tmp_path, demo_study):
    """An operator that emits nothing leaves those waiting on it unscheduled: Holoscan ends the run without an
    error. The NIfTI beside the missing SEG must not be left as a complete result, nor the exit be 0."""
    out = tmp_path / "out"
    completed = run_broken_app(tmp_path, demo_study[0], "operators.seg_writer", "SegWriterOperator.compute",
                               "silent", out)
    assert completed.returncode == 1, completed.stderr
    assert ("error: internal error in the application: RuntimeError: the graph finished without writing seg.dcm"
            in completed.stderr), completed.stderr
    assert "wrote" not in completed.stdout
    assert not out.exists()


def test_a_full_disk_is_one_line_naming_the_file_exit_2_and_nothing_is_left(tmp_path, demo_study):
    out = tmp_path / "out"
    completed = run_broken_app(tmp_path, demo_study[0], "highdicom.seg", "Segmentation.save_as", "OSError", out)
    assert completed.returncode == 2, completed.stderr
    assert re.search(r"error: cannot write .*out/seg.dcm: No space left on device", completed.stderr), \
        completed.stderr
    assert "Traceback" not in completed.stderr + completed.stdout
    assert not out.exists()


def interrupt_when_stalled(command: list[str], stalled: Path, sent: signal.Signals) -> tuple[int, str]:
    """Start `command`, send it `sent` once the file `stalled` appears; its exit status and stderr."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "STALLED": str(stalled)})
    try:
        deadline = time.monotonic() + 240
        while not stalled.exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert stalled.exists(), f"the run did not reach the stalled step: {process.poll()=}"
        process.send_signal(sent)
        _, stderr = process.communicate(timeout=30)  # Holoscan alone would wait 3 s, then force status 1
    finally:
        process.kill()
    return process.returncode, stderr


@pytest.mark.parametrize("sent,entry", [(signal.SIGINT, APP), (signal.SIGTERM, APP), (signal.SIGHUP, APP),
                                        (signal.SIGINT, APP.parent)],
                         ids=["ctrl-c", "sigterm", "sighup", "ctrl-c-app-folder"])
def test_an_interrupted_inference_exits_128_plus_the_signal_leaving_no_output_folder(tmp_path, demo_study, sent,
                                                                                      entry):
    stalled = tmp_path / "inferring"
    bundle = make_threshold_bundle(tmp_path / "slow")
    config = json.loads((bundle / "configs" / "inference.json").read_text())
    config["inferer"] = ("$lambda inputs, network: (open(__import__('os').environ['STALLED'], 'w').close(), "
                         "__import__('time').sleep(600), network(inputs))[2]")
    (bundle / "configs" / "inference.json").write_text(json.dumps(config))
    out = tmp_path / "new" / "out"
    command = ["bash", "-c", f"ulimit -s 32768; exec {sys.executable} {entry} -i {demo_study[0]} -o {out} "
                             f"-m {bundle} --device cpu"]
    status, stderr = interrupt_when_stalled(command, stalled, sent)
    assert status == 128 + sent, stderr
    assert stderr.splitlines()[-1] == f"error: interrupted by {sent.name}; this run's outputs were removed", stderr
    assert "Forcing exit" not in stderr and "Traceback" not in stderr
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("sent", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_an_interrupt_during_start_up_leaves_no_folder(tmp_path, demo_study, sent):
    """A signal that comes while the app still imports (held until it is ready to clean up) ends the run with
    128 + the signal and one line, and removes the output folders it made: the clean-up waits until they exist.
    The signal is sent blocked before the app starts, the earliest a Ctrl-C can come once its handling is set."""
    out = tmp_path / "new" / "a" / "b"

    def start_with_the_signal_pending() -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, {sent})
        os.kill(os.getpid(), sent)

    command = ["bash", "-c", f"ulimit -s 32768; exec {sys.executable} {APP} -i {demo_study[0]} -o {out} "
                             f"-m {DEMO_BUNDLE} --device cpu"]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=240,
                               preexec_fn=start_with_the_signal_pending)
    assert completed.returncode == 128 + sent, completed.stderr
    assert completed.stderr.splitlines() == [f"error: interrupted by {sent.name}; this run's outputs were removed"], \
        completed.stderr
    assert not (tmp_path / "new").exists()


def test_an_interrupt_after_the_results_were_written_removes_them(tmp_path, demo_study):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("the user's own file")
    command = broken_app_command(tmp_path, demo_study[0], "operators.result_summary", "summary_line", "stall", out)
    status, stderr = interrupt_when_stalled(command, tmp_path / "summarizing", signal.SIGINT)
    assert status == 130, stderr
    assert stderr.splitlines()[-1] == "error: interrupted by SIGINT; this run's outputs were removed", stderr
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_a_failing_run_removes_its_own_results_not_those_another_run_finished_meanwhile(tmp_path, demo_study):
    """Two runs into one folder: the one that failed removed the fixed names seg.dcm and labels.nii.gz, the other
    run's complete results (after that one had printed 'wrote ...'), and the folder."""
    out = tmp_path / "out"
    command = broken_app_command(tmp_path, demo_study[0], "operators.result_summary", "summary_line", "stall", out)
    failing = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "STALLED": str(tmp_path / "summarizing")})
    try:
        deadline = time.monotonic() + 240
        while not (tmp_path / "summarizing").exists() and failing.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        other = run_app("-i", demo_study[0], "-o", out, "-m", DEMO_BUNDLE, "--device", "cpu")
        assert other.returncode == 0, other.stderr
        failing.send_signal(signal.SIGINT)
        _, stderr = failing.communicate(timeout=30)
    finally:
        failing.kill()
    assert failing.returncode == 130, stderr
    assert sorted(p.name for p in out.iterdir()) == ["labels.nii.gz", "seg.dcm"]
    assert hd.seg.segread(out / "seg.dcm").SOPInstanceUID  # the other run's, whole


def test_an_output_folder_we_cannot_write_to_is_refused_before_the_run(tmp_path, demo_study, monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("bundle_seg_app_probe", APP)
    app = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(app)

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "TemporaryFile", refuse)  # as medserve.writers.files calls it
    for variable in ("HOLOSCAN_INPUT_PATH", "HOLOSCAN_OUTPUT_PATH", "HOLOSCAN_MODEL_PATH"):
        monkeypatch.setenv(variable, "")  # main() sets them; restored after the test
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    (tmp_path / "out").mkdir()
    try:
        status = app.main(["-i", str(demo_study[0]), "-o", str(tmp_path / "out"), "-m", str(DEMO_BUNDLE)])
    finally:  # main() configures logging for the process
        root.handlers[:] = handlers
        root.setLevel(level)
    assert status == 2
    assert re.search(r"error: output folder .*out: cannot be written to \(Permission denied\)",
                     capsys.readouterr().err)


def test_a_file_name_with_control_characters_cannot_split_the_error_line(tmp_path):
    """A bad slice named 'bad\\nerror: all good\\x1b[2K.dcm' made two error lines, the second a fake, and sent the
    terminal an escape sequence."""
    from medserve.demo.study import write_ct_series

    written = write_ct_series(make_phantom(shape=(6, 16, 16), seed=1).hu, tmp_path / "study")
    named = written.paths[2].with_name("bad\nerror: all good\x1b[2K.dcm")
    written.paths[2].rename(named)
    named.write_bytes(named.read_bytes()[:-100])  # pixel data cut short
    completed = run_app("-i", tmp_path / "study", "-o", tmp_path / "out", "-m", DEMO_BUNDLE)
    assert completed.returncode == 2, completed.stderr
    errors = [line for line in completed.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: {tmp_path / 'study'}/bad\\nerror: all good\\x1b[2K.dcm: pixel data is truncated (412 "
                      f"of the 512 bytes Rows x Columns x BitsAllocated/8 call for)"], completed.stderr
    assert "\x1b" not in completed.stderr


@pytest.mark.parametrize("unreadable", [".", "configs"])
def test_a_bundle_folder_that_cannot_be_read_is_refused_as_the_users(tmp_path, demo_study, unreadable):
    """It was 'internal error in the application: PermissionError' (exit 1) from the SDK's look at the folder."""
    bundle = tmp_path / "bundle"
    shutil.copytree(DEMO_BUNDLE, bundle)
    (bundle / unreadable).chmod(0)
    drop = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search"] if os.geteuid() == 0 else []
    try:
        completed = subprocess.run([*drop, "bash", "-c", f"ulimit -s 32768; exec {sys.executable} {APP} -i "
                                    f"'{demo_study[0]}' -o '{tmp_path / 'out'}' -m '{bundle}'"],
                                   capture_output=True, text=True, timeout=120)
    finally:
        (bundle / unreadable).chmod(0o755)
    assert completed.returncode == 2, completed.stderr
    assert re.fullmatch(rf"error: model path {bundle}(/configs)?: cannot be read \(Permission denied\); expected a "
                        r"bundle folder we can read", completed.stderr.strip().splitlines()[-1]), completed.stderr


@pytest.mark.parametrize("flag", ["-i", "-o", "-m"])
def test_an_empty_path_flag_is_refused_and_touches_nothing(tmp_path, demo_study, flag):
    """`-o ""` was the current folder: its seg.dcm was removed as an earlier run's, even when -i was wrong."""
    (tmp_path / "seg.dcm").write_text("the user's own file")
    paths = {"-i": str(demo_study[0]), "-o": str(tmp_path / "out"), "-m": str(DEMO_BUNDLE), flag: ""}
    command = f"cd '{tmp_path}' && ulimit -s 32768; exec {sys.executable} {APP} " + " ".join(
        f"{name} '{value}'" for name, value in paths.items())
    completed = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120)
    assert completed.returncode == 2, completed.stderr
    assert completed.stderr.splitlines()[-1].endswith(": empty path; expected a folder"), completed.stderr
    assert (tmp_path / "seg.dcm").read_text() == "the user's own file"
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("case", ["long -o", "long -i", "long --rules", "blank HOLOSCAN_OUTPUT_PATH"])
def test_paths_that_cannot_even_be_looked_at_are_one_line_exit_2(tmp_path, demo_study, case):
    """A name too long for the file system (and a folder we may not search) made Path.exists() raise: a bare
    traceback, exit 1, the output folder left; a blank HOLOSCAN_OUTPUT_PATH was an internal error."""
    long = "a" * 300
    paths = {"-i": str(demo_study[0]), "-o": str(tmp_path / "out"), "-m": str(DEMO_BUNDLE)}
    extra: list[str] = []
    env = dict(os.environ)
    expected = {"long -o": "output folder", "long -i": "input folder", "long --rules": "selection rules file",
                "blank HOLOSCAN_OUTPUT_PATH": "no output path"}[case]
    if case == "long -o":
        paths["-o"] = str(tmp_path / long)
    elif case == "long -i":
        paths["-i"] = str(tmp_path / long)
    elif case == "long --rules":
        extra = ["--rules", str(tmp_path / f"{long}.json")]
    else:
        del paths["-o"]
        env["HOLOSCAN_OUTPUT_PATH"] = " "
    command = f"cd '{tmp_path}' && ulimit -s 32768; exec {sys.executable} {APP} " + " ".join(
        f"{name} '{value}'" for name, value in [*paths.items(), *zip(extra[::2], extra[1::2])])
    completed = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120, env=env)
    assert completed.returncode == 2, completed.stderr
    assert "Traceback" not in completed.stderr
    assert completed.stderr.splitlines()[-1].startswith(f"error: {expected}"), completed.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("redirection", ["> /dev/full", ">&-"], ids=["full", "closed"])
def test_a_closed_stdout_leaves_the_results_complete_and_the_run_a_success(tmp_path, demo_study, redirection):
    """The summary's print into a full stdout was an 'internal error' (exit 1) that removed the complete results;
    into a stdout closed from the start (Python's sys.stdout is None) it was lost without a word."""
    out = tmp_path / "out"
    command = (f"ulimit -s 32768; exec {sys.executable} {APP} -i '{demo_study[0]}' -o '{out}' -m '{DEMO_BUNDLE}' "
               f"--device cpu {redirection}")
    completed = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr
    assert "the summary could not be printed" in completed.stderr
    assert sorted(p.name for p in out.iterdir()) == ["labels.nii.gz", "seg.dcm"]


def test_reruns_into_an_output_folder_inside_the_input(tmp_path):
    """-o inside -i: the second run does not read the first one's results as input; an earlier run's
    labels.nii.gz does not stay beside a --no-nifti run's seg.dcm; -l ERROR silences the warnings; an unknown
    -l is refused."""
    from medserve.demo.study import write_ct_series
    from tests.conftest import make_threshold_bundle

    hu = np.full((4, 12, 12), -50.0, np.float32)
    hu[1:3, 3:9, 3:9] = 300
    study, out = tmp_path / "study", tmp_path / "study" / "out"
    write_ct_series(hu, study)
    (study / "README.txt").write_text("not DICOM: skipped with a warning")
    bundle = make_threshold_bundle(tmp_path / "thr")
    first = run_app("-i", study, "-o", out, "-m", bundle)
    assert first.returncode == 0, first.stderr
    assert sorted(p.name for p in out.iterdir()) == ["labels.nii.gz", "seg.dcm"]
    second = run_app("-i", study, "-o", out, "-m", bundle, "--no-nifti")
    assert second.returncode == 0, second.stderr
    assert "README.txt" in second.stderr and "out/" not in second.stderr, second.stderr  # out/ is not input
    assert sorted(p.name for p in out.iterdir()) == ["seg.dcm"]  # no stale labels.nii.gz beside it
    quiet = run_app("-i", study, "-o", out, "-m", bundle, "-l", "error")
    assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr
    # The environment sets the level when no -l is given (a container's default); an explicit -l wins over it.
    chatty_env = {"MEDSERVE_LOG_LEVEL": "INFO", "HOLOSCAN_LOG_LEVEL": "INFO"}
    flag_wins = run_app("-i", study, "-o", out, "-m", bundle, "-l", "error", env=chatty_env)
    assert flag_wins.returncode == 0 and flag_wins.stderr == "", flag_wins.stderr
    from_env = run_app("-i", study, "-o", out, "-m", bundle, env={"MEDSERVE_LOG_LEVEL": "error"})
    assert from_env.returncode == 0 and from_env.stderr == "", from_env.stderr  # no README.txt warning either
    unknown = run_app("-i", study, "-o", out, "-m", bundle, "-l", "verbose")
    assert unknown.returncode == 2 and "invalid choice: 'VERBOSE'" in unknown.stderr, unknown.stderr
    # -o the same folder as -i after a run killed outright (SIGKILL) while writing: its partial SEG, a cut DICOM
    # file, would be read as input and refused as corrupt by every later run.
    (study / ".seg.dcm.partial.dcm").write_bytes(b"\0" * 128 + b"DICM" + b"\x02\x00\x00\x00UL\x04")
    shutil.rmtree(out)
    in_place = run_app("-i", study, "-o", study, "-m", bundle, "--no-nifti")
    assert in_place.returncode == 0, in_place.stderr
    assert not (study / ".seg.dcm.partial.dcm").exists() and (study / "seg.dcm").is_file()
    # A run that fails (no MR series here) removes its results and every folder it created for them.
    rules = json.dumps({"selections": [{"name": "mr", "conditions": {"Modality": "MR"}}]})
    failed = run_app("-i", study, "-o", tmp_path / "a" / "b" / "c", "-m", bundle, "--rules", rules)
    assert failed.returncode == 2 and "matches the selection rules" in failed.stderr, failed.stderr
    assert not (tmp_path / "a").exists()
