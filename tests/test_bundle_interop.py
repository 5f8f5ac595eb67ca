"""Mixing our operators and the stock SDK's: bundle inference takes the stock Image as well as our highdicom.Volume,
with the same geometry; our writers take the stock selection and Image; the stock SEG writer takes our outputs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import highdicom as hd
import nibabel as nib
import numpy as np
import pydicom
import pytest
from monai.deploy.core import Fragment
from monai.deploy.core.domain.image import Image

from medserve.bundle.predictor import BundlePredictor
from medserve.bundle.predictor import as_volume
from medserve.demo.phantom import make_phantom
from medserve.demo.study import SeriesGeometry, write_ct_series
from medserve.dicom.index import index_folder
from medserve.dicom.select import select_series
from medserve.dicom.volume import load_series, ras_affine
from medserve.errors import BundleError, DicomInputError, WiringError
from operators.bundle_inference import BundleInferenceOperator
from operators.dicom_loader import DicomLoaderOperator
from operators.failures import run_record, watch_failures
from operators.nifti_writer import NiftiWriterOperator
from operators.result_summary import ResultSummaryOperator
from operators.seg_writer import SegWriterOperator
from operators.series_selector import SeriesSelectorOperator
from tests.conftest import REPO, dciodvfy_errors
from tests.test_volume import ORIENTATIONS

SQUARE = (0.8, 0.8)
NON_SQUARE = (0.7, 0.9)  # PixelSpacing: between rows, between columns


def stock_selection(folder: Path) -> list:
    """The stock loader -> selector, called outside a graph: the series' instances in the loader's order."""
    from monai.deploy.operators.dicom_data_loader_operator import DICOMDataLoaderOperator
    from monai.deploy.operators.dicom_series_selector_operator import DICOMSeriesSelectorOperator

    fragment = Fragment()
    studies = DICOMDataLoaderOperator(fragment, name="loader").load_data_to_studies(folder)
    return DICOMSeriesSelectorOperator(fragment, name="selector").filter(None, studies)


def stock_pipeline(folder: Path, affine_lps_to_ras: bool = True) -> tuple[Image, list]:
    """The stock loader -> selector -> to-volume operators, called outside a graph (as bench_pipeline does):
    the Image and the selection (its instances sorted into the Image's slice order by the to-volume step)."""
    from monai.deploy.operators.dicom_series_to_volume_operator import DICOMSeriesToVolumeOperator

    selection = stock_selection(folder)
    to_volume = DICOMSeriesToVolumeOperator(Fragment(), affine_lps_to_ras=affine_lps_to_ras, name="to_volume")
    return to_volume.convert_to_image(selection), selection


def stock_load(folder: Path, affine_lps_to_ras: bool = True) -> Image:
    return stock_pipeline(folder, affine_lps_to_ras)[0]


def our_load(folder: Path) -> hd.Volume:
    return load_series(select_series(index_folder(folder))[0].series).volume


def write_series(folder: Path, orientation: str, pixel_spacing: tuple[float, float],
                 shape=(20, 40, 44)) -> Path:
    phantom = make_phantom(shape=shape, spacing=(2.5, *pixel_spacing), seed=5, bone=False)
    geometry = SeriesGeometry(origin=(-40.0, -30.0, 20.0), orientation=ORIENTATIONS[orientation],
                              pixel_spacing=pixel_spacing, slice_spacing=2.5)
    write_ct_series(phantom.hu, folder, geometry, file_order_seed=4)
    return folder


@pytest.mark.parametrize("pixel_spacing", [SQUARE, NON_SQUARE], ids=["square", "non_square"])
@pytest.mark.parametrize("orientation", ["axial", "coronal", "sagittal", "oblique", "feet_first_flipped"])
@pytest.mark.parametrize("affine_lps_to_ras", [True, False], ids=["ras", "lps"])
def test_stock_image_converts_to_the_volume_we_load(tmp_path, orientation, pixel_spacing, affine_lps_to_ras):
    folder = write_series(tmp_path / "series", orientation, pixel_spacing, shape=(6, 10, 12))
    ours = our_load(folder)
    converted = as_volume(stock_load(folder, affine_lps_to_ras))
    assert converted.array.shape == ours.array.shape
    assert np.array_equal(converted.array, ours.array)
    # The SDK's slice step is (last - first position) / (n - 1), ours the normal times the fitted spacing: on an
    # oblique plane, the positions' decimal-string rounding makes them differ by ~1e-5 mm.
    np.testing.assert_allclose(converted.affine, ours.affine, rtol=0, atol=1e-4)
    if orientation != "oblique":
        np.testing.assert_allclose(converted.affine, ours.affine, rtol=0, atol=1e-12)
    assert converted.coordinate_system == ours.coordinate_system


def test_stock_image_gets_the_label_map_of_our_volume(tmp_path, threshold_bundle):
    """Non-square pixels on an oblique plane: the geometry must be exact for the bundle's resampling (to 2 mm and
    back, in its own RAS axis order) to give the same labels from both inputs."""
    folder = write_series(tmp_path / "series", "oblique", NON_SQUARE)
    predictor = BundlePredictor.from_dir(threshold_bundle, device="cpu")
    image = stock_load(folder)
    expected = predictor.predict(our_load(folder))
    assert expected.any() and not expected.all()
    assert np.array_equal(predictor.predict(as_volume(image)), expected)
    # The comparison can tell: the stock affine taken literally (in-plane spacings swapped) labels differently.
    literal = np.diag([-1.0, -1.0, 1.0, 1.0]) @ image.metadata()["nifti_affine_transform"][:, [2, 1, 0, 3]]
    swapped = hd.Volume(array=image.asnumpy(), affine=literal, coordinate_system="PATIENT")
    assert not np.array_equal(predictor.predict(swapped), expected)


class Receiver:
    def __init__(self, value=None, **named):
        self.named = named if named else {"volume": value}

    def receive(self, name):
        return self.named.get(name)  # None, as Holoscan gives for an optional port nothing was sent to


class Emitter:
    def __init__(self):
        self.emitted = {}

    def emit(self, value, name):
        self.emitted[name] = value


def test_loader_without_an_input_folder_says_so():
    fragment = Fragment()
    watch_failures(fragment)
    loader = DicomLoaderOperator(fragment, name="loader")
    output = Emitter()
    loader.compute(Receiver(input_folder=None), output, None)
    failure = run_record(fragment).failure
    assert isinstance(failure.error, DicomInputError) and failure.exit_status == 2
    assert str(failure.error) == ("operator loader: no input folder; pass input_folder= or connect an operator to its "
                                  "input_folder port")
    assert output.emitted == {}


def test_loader_arguments_are_checked_when_it_is_made():
    """An empty input_folder= became Path('') (the current folder), and exclude= was not checked at all."""
    with pytest.raises(ValueError, match=r"^DicomLoaderOperator: input_folder= is empty; expected a folder path$"):
        DicomLoaderOperator(Fragment(), input_folder=" ", name="loader")
    with pytest.raises(TypeError, match=r"^DicomLoaderOperator: exclude= expects a folder path \(str or Path\); "):
        DicomLoaderOperator(Fragment(), exclude=3, name="loader")


def test_operator_accepts_a_stock_image_and_refuses_other_types(tmp_path, threshold_bundle):
    folder = write_series(tmp_path / "series", "axial", SQUARE)
    predictor = BundlePredictor.from_dir(threshold_bundle, device="cpu")
    fragment = Fragment()
    watch_failures(fragment)
    operator = BundleInferenceOperator.from_bundle(fragment, bundle_path=threshold_bundle, device="cpu",
                                                   name="bundle_inference")  # the README's other way to make it
    output = Emitter()
    operator.compute(Receiver(stock_load(folder)), output, None)
    assert run_record(fragment).failure is None
    assert np.array_equal(output.emitted["label_map"], predictor.predict(our_load(folder)))

    refused = Fragment()
    watch_failures(refused)
    operator = BundleInferenceOperator(refused, predictor=predictor, name="bundle_inference")
    output = Emitter()
    operator.compute(Receiver(np.zeros((4, 4, 4))), output, None)
    assert output.emitted == {}
    failure = run_record(refused).failure
    assert isinstance(failure.error, BundleError)
    assert str(failure.error) == ("bundle inference input: expected a highdicom.Volume or a monai.deploy.core.Image; "
                                  "got numpy.ndarray")


# ---- as_volume on hand-made Images: each metadata source, and what is refused --------------------------------

def reference_volume() -> hd.Volume:
    geometry = SeriesGeometry(origin=(-10.0, 5.0, 30.0), orientation=ORIENTATIONS["oblique"],
                              pixel_spacing=(0.7, 0.9), slice_spacing=2.0)
    array = np.arange(3 * 4 * 5, dtype=np.float32).reshape(3, 4, 5)
    return hd.Volume(array=array, affine=geometry.affine(), coordinate_system="PATIENT")


@pytest.mark.parametrize("metadata", [
    lambda v: {"affine": ras_affine(v), "space": "RAS"},
    lambda v: {"affine": ras_affine(v)},  # MONAI's default space is RAS
    lambda v: {"affine": v.affine[:, [2, 1, 0, 3]], "space": "LPS"},
    lambda v: {"dicom_affine_transform": v.affine[:, [2, 1, 0, 3]]},
    lambda v: {"nifti_affine_transform": ras_affine(v).tolist()},
], ids=["affine_ras", "affine_default_space", "affine_lps", "dicom_affine", "nifti_affine"])
def test_image_geometry_is_read_from_any_of_the_sdk_affines(metadata):
    reference = reference_volume()
    converted = as_volume(Image(reference.array.copy(), metadata(reference)))
    assert np.array_equal(converted.array, reference.array)
    np.testing.assert_allclose(converted.affine, reference.affine, rtol=0, atol=1e-12)


def test_an_images_dicom_affines_win_over_a_stale_affine():
    """The stock MonaiBundleInferenceOperator copies its input's metadata onto its prediction but leaves there the
    preprocessing grid's `affine` (RAS, 3 mm): our NIfTI writer wrote a mirrored, shifted file from it."""
    reference = reference_volume()
    stale = np.diag([3.0, 3.0, 3.0, 1.0])
    for metadata in ({"affine": stale, "space": "RAS", "dicom_affine_transform": reference.affine[:, [2, 1, 0, 3]],
                      "nifti_affine_transform": ras_affine(reference)},
                     {"affine": stale, "nifti_affine_transform": ras_affine(reference)}):
        converted = as_volume(Image(reference.array.copy(), metadata))
        np.testing.assert_allclose(converted.affine, reference.affine, rtol=0, atol=1e-12)


def test_a_volume_passes_through_unchanged():
    volume = reference_volume()
    assert as_volume(volume) is volume


@pytest.mark.parametrize("value,message", [
    (Image(np.zeros((2, 3, 4)), {"row_pixel_spacing": 1.0}), "the Image has no geometry; expected an 'affine'"),
    (Image(np.zeros((2, 3, 4)), None), "the Image has no geometry"),
    (Image(np.zeros((2, 3)), {"affine": np.eye(4)}), r"array has shape \(2, 3\); expected 3 dimensions"),
    (Image(np.zeros((2, 3, 4)), {"affine": np.eye(3)}), "RAS affine is not a 4x4 matrix"),
    (Image(np.zeros((2, 3, 4)), {"affine": np.eye(4), "space": "LPI"}), "'space' is 'LPI'; expected RAS or LPS"),
    ({"array": np.zeros((2, 3, 4))}, "expected a highdicom.Volume or a monai.deploy.core.Image; got builtins.dict"),
])
def test_unusable_inputs_are_refused(value, message):
    with pytest.raises(BundleError, match=rf"^bundle inference input: .*{message}"):
        as_volume(value)


@pytest.mark.parametrize("orientation", ["axial", "oblique"])
def test_the_stock_seg_writer_writes_our_label_map_onto_our_selection(tmp_path, threshold_bundle, orientation):
    """Ours -> stock: our label map and our selector's SDK selection are what the stock
    DICOMSegmentationWriterOperator takes; its SEG puts every label where our volume has it (files shuffled)."""
    from monai.deploy.operators.dicom_seg_writer_operator import (DICOMSegmentationWriterOperator,
                                                                   SegmentDescription)

    from operators.series_selector import as_sdk_selection

    folder = write_series(tmp_path / "series", orientation, NON_SQUARE, shape=(8, 24, 28))
    selected = select_series(index_folder(folder))
    volume = load_series(selected[0].series).volume
    label_map = BundlePredictor.from_dir(threshold_bundle, device="cpu").predict(volume)
    assert 0 < np.count_nonzero(label_map) < label_map.size
    description = SegmentDescription(segment_label="dense", segmented_property_category=hd.sr.CodedConcept(
        "91723000", "SCT", "Anatomical Structure"), segmented_property_type=hd.sr.CodedConcept(
        "85756007", "SCT", "Tissue"), algorithm_name="threshold", algorithm_version="1")
    out = tmp_path / "out"
    writer = DICOMSegmentationWriterOperator(Fragment(), segment_descriptions=[description], output_folder=out,
                                             name="stock_seg_writer")
    writer.process_images(label_map, as_sdk_selection(selected), out)
    seg = hd.seg.segread(next(out.glob("*.dcm")))
    # Positions stored as decimal strings put oblique frames ~1e-5 mm off the exact grid.
    back = seg.get_volume(combine_segments=True).match_geometry(volume, tol=1e-3)
    np.testing.assert_array_equal(back.array, label_map)


# ---- stock -> ours: our writers take the stock pipeline's selection and Image --------------------------------

def stock_label_map(folder: Path, predictor: BundlePredictor) -> tuple[np.ndarray, Image, list]:
    image, selection = stock_pipeline(folder)
    label_map = predictor.predict(as_volume(image))
    assert 0 < np.count_nonzero(label_map) < label_map.size
    return label_map, image, selection


@pytest.mark.parametrize("label_map_as", ["array", "sdk_image"])
def test_our_seg_writer_writes_onto_the_stock_selection(tmp_path, threshold_bundle, label_map_as):
    """The stock pipeline's Image through our inference; the label map (as our operator emits it, or as a float
    SDK Image as stock inference operators emit one) and the stock selection into our SEG writer: a valid SEG
    of the stock selection's series with every label where our own volume has it (files shuffled, oblique)."""
    folder = write_series(tmp_path / "series", "oblique", NON_SQUARE, shape=(8, 24, 28))
    predictor = BundlePredictor.from_dir(threshold_bundle, device="cpu")
    label_map, _, selection = stock_label_map(folder, predictor)
    sent = label_map if label_map_as == "array" else Image(label_map.astype(np.float32), {})
    fragment = Fragment()
    watch_failures(fragment)
    writer = SegWriterOperator(fragment, output_folder=tmp_path / "out", predictor=predictor, name="seg_writer")
    writer.compute(Receiver(label_map=sent, source=selection), Emitter(), None)
    assert run_record(fragment).failure is None
    path = tmp_path / "out" / "seg.dcm"
    assert dciodvfy_errors(path) == []
    seg = hd.seg.segread(path)
    series = selection[0].selected_series[0].series
    assert seg.ReferencedSeriesSequence[0].SeriesInstanceUID == series.SeriesInstanceUID
    back = seg.get_volume(combine_segments=True).match_geometry(our_load(folder), tol=1e-3)
    np.testing.assert_array_equal(back.array, label_map)


def test_our_seg_writer_puts_each_slice_on_its_image_of_an_unsorted_stock_selection(tmp_path, threshold_bundle):
    """The stock loader and selector alone leave the series in file order; the label map (here from our own
    volume) is in volume order, and the writer must match them up by position."""
    folder = write_series(tmp_path / "series", "oblique", NON_SQUARE, shape=(8, 24, 28))
    selection = stock_selection(folder)
    datasets = [i.get_native_sop_instance() for i in selection[0].selected_series[0].series.get_sop_instances()]
    orientation = np.array(datasets[0].ImageOrientationPatient, dtype=float)
    distances = [float(np.dot(np.cross(orientation[:3], orientation[3:]), d.ImagePositionPatient)) for d in datasets]
    assert distances != sorted(distances)  # the files' order is shuffled: otherwise this test could not fail
    predictor = BundlePredictor.from_dir(threshold_bundle, device="cpu")
    volume = our_load(folder)
    label_map = predictor.predict(volume)
    assert len({tuple(np.flatnonzero(plane)) for plane in label_map}) > 1  # slices differ: order matters
    fragment = Fragment()
    watch_failures(fragment)
    writer = SegWriterOperator(fragment, output_folder=tmp_path / "out", predictor=predictor, name="seg_writer")
    writer.compute(Receiver(label_map=label_map, source=selection), Emitter(), None)
    assert run_record(fragment).failure is None
    back = hd.seg.segread(tmp_path / "out" / "seg.dcm").get_volume(combine_segments=True)
    np.testing.assert_array_equal(back.match_geometry(volume, tol=1e-3).array, label_map)


def test_our_writers_write_into_the_folder_a_run_sends_them(tmp_path, threshold_bundle):
    """As the stock SEG writer's: an `output_folder` sent on the optional port is this run's folder; without
    one, the folder given at construction."""
    folder = write_series(tmp_path / "series", "axial", SQUARE, shape=(4, 16, 16))
    predictor = BundlePredictor.from_dir(threshold_bundle, device="cpu")
    loaded = load_series(select_series(index_folder(folder))[0].series)
    label_map = predictor.predict(loaded.volume)
    fragment = Fragment()
    record = watch_failures(fragment)
    seg_writer = SegWriterOperator(fragment, output_folder=tmp_path / "default", predictor=predictor, name="seg")
    nifti_writer = NiftiWriterOperator(fragment, output_folder=tmp_path / "default", name="nifti")
    for run in ("study-1", None):
        sent = {"output_folder": tmp_path / run} if run else {}
        seg_writer.compute(Receiver(label_map=label_map, source=loaded, **sent), Emitter(), None)
        nifti_writer.compute(Receiver(label_map=label_map, volume=loaded.volume, **sent), Emitter(), None)
    assert record.failure is None
    assert record.outputs == [tmp_path / "study-1" / "seg.dcm", tmp_path / "study-1" / "labels.nii.gz",
                              tmp_path / "default" / "seg.dcm", tmp_path / "default" / "labels.nii.gz"]


def test_the_summary_takes_the_label_map_as_the_writers_do(capsys):
    """A stock inference operator's `Image` reaches the summary as it reaches our writers."""
    label_map = np.zeros((2, 3, 4), np.uint16)
    label_map[0, :2] = 1
    fragment = Fragment()
    record = watch_failures(fragment)
    summary = ResultSummaryOperator(fragment, labels={1: "spleen"}, started=0.0, nifti=False, name="summary")
    summary.compute(Receiver(label_map=Image(label_map.astype(np.float32)), seg_path=Path("seg.dcm")), Emitter(),
                    None)
    assert record.failure is None
    wrote, found = capsys.readouterr().out.splitlines()
    assert wrote == "wrote seg.dcm"
    assert found.startswith("1 segment(s) found (spleen: 8 voxels) in ")


@pytest.mark.parametrize("operator,arguments,error,message", [
    (BundleInferenceOperator, {"predictor": "bundles/demo_organ_seg"}, TypeError,
     "BundleInferenceOperator: predictor= expects a BundlePredictor; got builtins.str; for a bundle folder, pass "
     "BundlePredictor.from_dir(FOLDER)"),
    (SegWriterOperator, {"predictor": None, "output_folder": "out"}, TypeError,
     "SegWriterOperator: predictor= expects a BundlePredictor; got builtins.NoneType"),
    (NiftiWriterOperator, {"output_folder": ""}, ValueError,
     "NiftiWriterOperator: output_folder= is empty; expected a folder path"),
    (NiftiWriterOperator, {"output_folder": 3}, TypeError,
     "NiftiWriterOperator: output_folder= expects a folder path (str or Path); got builtins.int"),
    (SeriesSelectorOperator, {"all_matched": "no"}, TypeError,
     "SeriesSelectorOperator: all_matched= expects True or False; got 'no'"),
    (SeriesSelectorOperator, {"sort_by_sop_instance_count": True}, ValueError,
     "SeriesSelectorOperator: sort_by_sop_instance_count=True orders the matches of all_matched=True; pass both"),
])
def test_operators_refuse_wrong_arguments_when_constructed(operator, arguments, error, message):
    """Rather than fail after inference as an internal error, write into the current folder, or ignore them."""
    with pytest.raises(error) as raised:
        operator(Fragment(), name="op", **arguments)
    assert str(raised.value) == message


@pytest.mark.parametrize(("value", "got"), [([], "an empty list"), ([1], "a list of builtins.int"),
                                          (3, "builtins.int")])
def test_a_port_receiving_what_it_does_not_take_is_a_wiring_error(value, got):
    from operators.arguments import received

    with pytest.raises(WiringError, match=rf"^Op port: expected strings; got {re.escape(got)}$"):
        received("Op", "port", value, str, "strings", list_of=True)
    assert received("Op", "port", ["a"], str, "strings", list_of=True) == ["a"]


def test_our_nifti_writer_takes_the_stock_image_as_its_volume(tmp_path, threshold_bundle):
    folder = write_series(tmp_path / "series", "oblique", NON_SQUARE, shape=(8, 24, 28))
    label_map, image, _ = stock_label_map(folder, BundlePredictor.from_dir(threshold_bundle, device="cpu"))
    fragment = Fragment()
    watch_failures(fragment)
    writer = NiftiWriterOperator(fragment, output_folder=tmp_path / "out", name="nifti_writer")
    writer.compute(Receiver(label_map=label_map, volume=image), Emitter(), None)
    assert run_record(fragment).failure is None
    written = nib.load(tmp_path / "out" / "labels.nii.gz")
    np.testing.assert_allclose(written.affine, ras_affine(our_load(folder)), rtol=0, atol=1e-4)
    np.testing.assert_array_equal(np.asarray(written.dataobj).transpose(2, 1, 0), label_map)


@pytest.mark.parametrize("damage,error,message", [
    ("one_slice_less", ValueError, r"^label map has shape \(7, 24, 28\) \(slice, row, column\); the source series "
                                   r"\(images, rows, columns\) has \(8, 24, 28\)$"),
    ("not_a_selection", TypeError, r"^SEG writer source: expected a LoadedSeries \(SeriesToVolumeOperator\) or "
                                   r"the SDK's List\[StudySelectedSeries\]; got builtins.dict$"),
    ("empty_selection", ValueError, r"^SEG writer source: the SDK selection holds no selected series$"),
    ("probabilities", ValueError, r"^label map has dtype float32 with fractional values; expected whole-number "
                                  r"labels"),
])
def test_our_seg_writer_refuses_what_does_not_fit_and_writes_nothing(tmp_path, threshold_bundle, damage, error,
                                                                     message):
    folder = write_series(tmp_path / "series", "axial", SQUARE, shape=(8, 24, 28))
    predictor = BundlePredictor.from_dir(threshold_bundle, device="cpu")
    label_map, _, selection = stock_label_map(folder, predictor)
    source = {"not_a_selection": {"selection": selection}, "empty_selection": []}.get(damage, selection)
    sent = {"one_slice_less": label_map[1:], "probabilities": label_map * np.float32(0.5)}.get(damage, label_map)
    fragment = Fragment()
    watch_failures(fragment)
    writer = SegWriterOperator(fragment, output_folder=tmp_path / "out", predictor=predictor, name="seg_writer")
    output = Emitter()
    writer.compute(Receiver(label_map=sent, source=source), output, None)
    failure = run_record(fragment).failure
    assert isinstance(failure.error, error)
    assert re.search(message, str(failure.error))
    assert output.emitted == {}
    assert not (tmp_path / "out" / "seg.dcm").exists()


MIXED_APP = """
import sys
from pathlib import Path

from monai.deploy.conditions import CountCondition
from monai.deploy.core import Application
from monai.deploy.operators.dicom_data_loader_operator import DICOMDataLoaderOperator
from monai.deploy.operators.dicom_seg_writer_operator import DICOMSegmentationWriterOperator, SegmentDescription
from monai.deploy.operators.dicom_series_selector_operator import DICOMSeriesSelectorOperator
from monai.deploy.operators.dicom_series_to_volume_operator import DICOMSeriesToVolumeOperator
from pydicom.sr.codedict import codes

from medserve.bundle.predictor import BundlePredictor
from operators import (BundleInferenceOperator, DicomLoaderOperator, NiftiWriterOperator, SegWriterOperator,
                       SeriesSelectorOperator, SeriesToVolumeOperator)
from operators.failures import watch_failures

composition, input_folder, output_folder, bundle = sys.argv[1], *(Path(a) for a in sys.argv[2:5])


class StockFrontOurBack(Application):
    def compose(self):
        predictor = BundlePredictor.from_dir(bundle, "cpu")
        loader = DICOMDataLoaderOperator(self, CountCondition(self, 1), input_folder=input_folder, name="loader")
        selector = DICOMSeriesSelectorOperator(self, name="selector")
        to_volume = DICOMSeriesToVolumeOperator(self, name="to_volume")
        inference = BundleInferenceOperator(self, predictor=predictor, name="inference")
        seg_writer = SegWriterOperator(self, output_folder=output_folder, predictor=predictor, name="seg_writer")
        nifti_writer = NiftiWriterOperator(self, output_folder=output_folder, name="nifti_writer")
        self.add_flow(loader, selector, {("dicom_study_list", "dicom_study_list")})
        self.add_flow(selector, to_volume, {("study_selected_series_list", "study_selected_series_list")})
        self.add_flow(to_volume, inference, {("image", "volume")})
        self.add_flow(inference, seg_writer, {("label_map", "label_map")})
        self.add_flow(selector, seg_writer, {("study_selected_series_list", "source")})
        self.add_flow(inference, nifti_writer, {("label_map", "label_map")})
        self.add_flow(to_volume, nifti_writer, {("image", "volume")})


class OurFrontStockWriter(Application):
    def compose(self):
        predictor = BundlePredictor.from_dir(bundle, "cpu")
        description = SegmentDescription(segment_label="dense", segmented_property_category=codes.SCT.Tissue,
                                         segmented_property_type=codes.SCT.Tissue, algorithm_name="threshold",
                                         algorithm_version="1")
        loader = DicomLoaderOperator(self, CountCondition(self, 1), input_folder=input_folder, name="loader")
        selector = SeriesSelectorOperator(self, sdk_selection=composition == "stock_writer", name="selector")
        to_volume = SeriesToVolumeOperator(self, name="to_volume")
        inference = BundleInferenceOperator(self, predictor=predictor, name="inference")
        writer = DICOMSegmentationWriterOperator(self, segment_descriptions=[description],
                                                 output_folder=output_folder, name="stock_seg_writer")
        self.add_flow(loader, selector, {("study_index", "study_index")})
        self.add_flow(selector, to_volume, {("selected_series", "selected_series")})
        self.add_flow(to_volume, inference, {("volume", "volume")})  # "source" and "image" left unconnected
        self.add_flow(inference, writer, {("label_map", "seg_image")})
        self.add_flow(selector, writer, {("study_selected_series_list", "study_selected_series_list")})


# Wrong wirings: the stock loader's output into our selector, or the stock selector's into our to-volume.
class StockOutputIntoOurs(Application):
    def compose(self):
        loader = DICOMDataLoaderOperator(self, CountCondition(self, 1), input_folder=input_folder, name="loader")
        to_volume = SeriesToVolumeOperator(self, name="to_volume")
        if composition == "stock_loader_our_selector":
            selector, flows = SeriesSelectorOperator(self, name="selector"), [
                {("dicom_study_list", "study_index")}, {("selected_series", "selected_series")}]
        else:
            selector, flows = DICOMSeriesSelectorOperator(self, name="selector"), [
                {("dicom_study_list", "dicom_study_list")}, {("study_selected_series_list", "selected_series")}]
        self.add_flow(loader, selector, flows[0])
        self.add_flow(selector, to_volume, flows[1])


application = {"stock_front": StockFrontOurBack, "stock_writer": OurFrontStockWriter,
               "stock_writer_without_sdk_selection": OurFrontStockWriter,
               "stock_loader_our_selector": StockOutputIntoOurs,
               "stock_selector_our_volume": StockOutputIntoOurs}[composition]
app = application([sys.executable, __file__, "--log-level", "WARN"])
record = watch_failures(app)
app.run()
sys.exit(f"error: {record.failure.message()}" if record.failure else 0)
"""


RERUN_APP = """
import sys
from pathlib import Path

from monai.deploy.conditions import CountCondition
from monai.deploy.core import Application

from medserve.bundle.predictor import BundlePredictor
from operators import (BundleInferenceOperator, DicomLoaderOperator, SegWriterOperator, SeriesSelectorOperator,
                       SeriesToVolumeOperator)
from operators.failures import watch_failures

mode, output_folder, bundle, *folders = sys.argv[1], *(Path(a) for a in sys.argv[2:])
current = {}


class StudyLoader(DicomLoaderOperator):
    def compute(self, op_input, op_output, context):
        self.input_folder = current["folder"]  # this run's study
        super().compute(op_input, op_output, context)


class OurPipeline(Application):
    def compose(self):
        predictor = BundlePredictor.from_dir(bundle, "cpu")
        loader = StudyLoader(self, CountCondition(self, 1), name="loader")
        selector = SeriesSelectorOperator(self, name="selector")
        to_volume = SeriesToVolumeOperator(self, name="to_volume")
        inference = BundleInferenceOperator(self, predictor=predictor, name="inference")
        writer = SegWriterOperator(self, output_folder=output_folder, predictor=predictor, name="seg_writer")
        self.add_flow(loader, selector, {("study_index", "study_index")})
        self.add_flow(selector, to_volume, {("selected_series", "selected_series")})
        self.add_flow(to_volume, inference, {("volume", "volume")})
        self.add_flow(inference, writer, {("label_map", "label_map")})
        self.add_flow(to_volume, writer, {("source", "source")})


app = OurPipeline([sys.executable, __file__, "--log-level", "WARN"])
record = watch_failures(app) if mode == "watched_once" else None
for folder in folders:
    current["folder"] = folder
    (output_folder / "seg.dcm").unlink(missing_ok=True)
    if mode == "watched_each_run":
        record = watch_failures(app)
    app.run()
    outcome = record.failure.message() if record and record.failure else "ok"
    outputs = [path.name for path in record.outputs] if record else None
    print(f"{folder.name}: {outcome}; seg.dcm written: {(output_folder / 'seg.dcm').exists()}; recorded: {outputs}",
          flush=True)
"""


EARLY_STOP_APP = """
import sys
from pathlib import Path

from holoscan.conditions import CountCondition, PeriodicCondition
from monai.deploy.core import Application

from operators.failures import RunEndingOperator, records_output, reports_failures, watch_failures

written = Path(sys.argv[1])


class Source(RunEndingOperator):
    def setup(self, spec):
        spec.output("out")

    @reports_failures
    def compute(self, op_input, op_output, context):
        op_output.emit(1, "out")


class Writer(RunEndingOperator):
    def setup(self, spec):
        spec.input("in")

    @reports_failures
    def compute(self, op_input, op_output, context):
        op_input.receive("in")
        records_output(self.fragment, written)


class Late(RunEndingOperator):
    computed = 0

    @reports_failures
    def compute(self, op_input, op_output, context):
        Late.computed += 1
        if Late.computed == 2:
            raise RuntimeError("late failure")


class TwoBranches(Application):
    def compose(self):
        source = Source(self, CountCondition(self, 1), name="source")
        self.add_flow(source, Writer(self, name="writer"), {("out", "in")})
        self.add_operator(Late(self, CountCondition(self, 2), PeriodicCondition(self, 200_000_000), name="late"))


app = TwoBranches([sys.executable, __file__, "--log-level", "WARN"])
record = watch_failures(app)
app.run()
print(record.failure.message() if record.failure else "ok", [path.name for path in record.outputs])
"""


def test_a_branch_that_ends_early_does_not_clear_its_runs_record(tmp_path):
    """Under the greedy scheduler Holoscan stops a source whose CountCondition is spent while a periodic branch
    of the same run still computes; the record must keep that run's files and the later branch's failure."""
    script = tmp_path / "early_stop_app.py"
    script.write_text(EARLY_STOP_APP)
    run = subprocess.run(["bash", "-c", f"ulimit -s 32768; exec {sys.executable} {script} '{tmp_path / 'seg.dcm'}'"],
                         capture_output=True, text=True, timeout=300, cwd=REPO, env={**os.environ,
                                                                                      "PYTHONPATH": str(REPO)})
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.splitlines()[-1] == ("internal error in operator late: RuntimeError: late failure (run with "
                                           "--log-level DEBUG for the traceback) ['seg.dcm']"), run.stdout


@pytest.mark.parametrize("mode", ["raised", "watched_each_run", "watched_once"])
def test_failures_in_a_users_graph_are_raised_unless_the_app_watches_its_runs(tmp_path, threshold_bundle, mode):
    """A user's own graph of our operators fails as one of stock operators does (the error raised out of
    `Application.run()`, a non-zero exit); an app that watches its runs gets the failure recorded instead, and
    the next run of the same Application starts afresh, also when it was watched once before the first run
    (the record then describes the latest run: the first run's failure neither silences the second nor stays)."""
    good = write_series(tmp_path / "good", "axial", SQUARE, shape=(4, 16, 16))
    script = tmp_path / "rerun_app.py"
    script.write_text(RERUN_APP)
    out = tmp_path / "out"
    out.mkdir()
    command = (f"ulimit -s 32768; exec {sys.executable} {script} {mode} '{out}' "
               f"'{threshold_bundle}' '{tmp_path / 'missing'}' '{good}'")
    run = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=300, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    if mode != "raised":
        assert run.returncode == 0, run.stdout + run.stderr
        assert run.stdout.splitlines() == [f"missing: input folder {tmp_path / 'missing'} does not exist; seg.dcm "
                                           "written: False; recorded: []",
                                           "good: ok; seg.dcm written: True; recorded: ['seg.dcm']"]
    else:
        assert run.returncode != 0, run.stdout + run.stderr
        assert f"input folder {tmp_path / 'missing'} does not exist" in run.stdout + run.stderr
        assert not (out / "seg.dcm").exists()


def test_wiring_the_sdk_selection_without_asking_for_it_fails_when_composed(tmp_path, threshold_bundle):
    """Our selector's `study_selected_series_list` exists only with `sdk_selection=True`: a graph that wires it
    to the stock SEG writer without that fails at once, naming the port, instead of running without output."""
    folder = write_series(tmp_path / "series", "axial", NON_SQUARE, shape=(4, 16, 16))
    script = tmp_path / "mixed_app.py"
    script.write_text(MIXED_APP)
    out = tmp_path / "out"
    command = (f"ulimit -s 32768; exec {sys.executable} {script} stock_writer_without_sdk_selection '{folder}' "
               f"'{out}' '{threshold_bundle}'")
    run = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=300, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert run.returncode != 0, run.stdout + run.stderr
    assert "study_selected_series_list" in run.stdout + run.stderr
    assert not list(out.glob("*.dcm"))


@pytest.mark.parametrize(("composition", "message"), [
    ("stock_loader_our_selector", "SeriesSelectorOperator study_index: expected the StudyIndex of DicomLoaderOperator "
                                  "(the stock DICOMDataLoaderOperator's dicom_study_list goes to the stock "
                                  "DICOMSeriesSelectorOperator); got a list of "
                                  "monai.deploy.core.domain.dicom_study.DICOMStudy"),
    ("stock_selector_our_volume", "SeriesToVolumeOperator selected_series: expected the list of SelectedSeries of "
                                  "SeriesSelectorOperator (the stock DICOMSeriesSelectorOperator's "
                                  "study_selected_series_list goes to the stock DICOMSeriesToVolumeOperator); got a "
                                  "list of monai.deploy.core.domain.dicom_series_selection.StudySelectedSeries"),
])
def test_a_stock_output_wired_to_our_operator_is_refused_naming_the_port(tmp_path, threshold_bundle, composition,
                                                                        message):
    """They failed deep inside ('list' object has no attribute 'studies'; 'StudySelectedSeries' object has no
    attribute 'series')."""
    folder = write_series(tmp_path / "series", "axial", NON_SQUARE, shape=(4, 16, 16))
    script = tmp_path / "mixed_app.py"
    script.write_text(MIXED_APP)
    command = (f"ulimit -s 32768; exec {sys.executable} {script} {composition} '{folder}' '{tmp_path / 'out'}' "
               f"'{threshold_bundle}'")
    run = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=300, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert run.returncode == 1, run.stdout + run.stderr  # the script's sys.exit(text)
    assert f"error: {message}" in run.stderr.splitlines(), run.stderr  # not an 'internal error'


@pytest.mark.parametrize("composition", ["stock_front", "stock_writer"])
def test_graphs_of_stock_operators_and_ours_write_the_right_seg(tmp_path, threshold_bundle, composition):
    """Users mix, in one Holoscan graph: the stock loader, selector and to-volume with our inference and writers
    (their path outputs left unconnected); or ours up to inference with the stock SEG writer (our to-volume's
    `source` and `image` left unconnected). Either writes the SEG of the label map our own pipeline computes."""
    folder = write_series(tmp_path / "series", "oblique", NON_SQUARE, shape=(8, 24, 28))
    script = tmp_path / "mixed_app.py"
    script.write_text(MIXED_APP)
    out = tmp_path / "out"
    command = f"ulimit -s 32768; exec {sys.executable} {script} {composition} '{folder}' '{out}' '{threshold_bundle}'"
    run = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=300, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert run.returncode == 0, run.stdout + run.stderr
    volume = our_load(folder)
    expected = BundlePredictor.from_dir(threshold_bundle, device="cpu").predict(volume)
    [seg_path] = out.glob("*.dcm")
    errors = dciodvfy_errors(seg_path)
    if composition == "stock_writer":  # the stock writer's Contributing Equipment item has an empty Manufacturer
        stock_error = "Error - Empty attribute (no value) Type 1 Required Element=<Manufacturer> Module=<SOPCommon>"
        errors = [error for error in errors if error != stock_error]
    assert errors == []
    back = hd.seg.segread(seg_path).get_volume(combine_segments=True).match_geometry(volume, tol=1e-3)
    np.testing.assert_array_equal(back.array, expected)
    if composition == "stock_front":
        written = nib.load(out / "labels.nii.gz")
        np.testing.assert_array_equal(np.asarray(written.dataobj).transpose(2, 1, 0), expected)
        np.testing.assert_allclose(written.affine, ras_affine(volume), rtol=0, atol=1e-4)


def test_stock_attributes_the_stock_code_cannot_convert_are_left_unset():
    """The stock loader's attribute copying calls int() on SeriesNumber and reads two PixelSpacing values unguarded:
    an empty Type 2 SeriesNumber (as anonymisers leave it) or a one-value spacing must not crash our Image."""
    from pydicom.data import get_testdata_file

    from operators.sdk_domain import sdk_series

    header = pydicom.dcmread(get_testdata_file("CT_small.dcm"), stop_before_pixels=True)
    header.SeriesNumber, header.PixelSpacing = None, [0.5]
    series = sdk_series("1.2.3", [header])
    assert series.SeriesNumber is None and series.row_pixel_spacing is None
    assert header.SeriesNumber is None and header.PixelSpacing == 0.5  # the header itself is untouched
    intact = sdk_series("1.2.3", [pydicom.dcmread(get_testdata_file("CT_small.dcm"), stop_before_pixels=True)])
    assert intact.SeriesNumber == 1 and intact.row_pixel_spacing == pytest.approx(0.661468)
