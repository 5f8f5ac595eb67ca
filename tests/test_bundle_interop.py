"""Bundle inference takes the stock SDK's Image as well as our highdicom.Volume, with the same geometry."""

from __future__ import annotations

from pathlib import Path

import highdicom as hd
import numpy as np
import pytest
from monai.deploy.core import Fragment
from monai.deploy.core.domain.image import Image

from medserve.bundle import BundlePredictor
from medserve.bundle.predictor import as_volume
from medserve.demo.phantom import make_phantom
from medserve.demo.study import SeriesGeometry, write_ct_series
from medserve.dicom.index import index_folder
from medserve.dicom.select import select_series
from medserve.dicom.volume import load_series, ras_affine
from medserve.errors import BundleError
from operators.bundle_inference import BundleInferenceOperator
from operators.failures import run_record
from tests.test_volume import ORIENTATIONS

SQUARE = (0.8, 0.8)
NON_SQUARE = (0.7, 0.9)  # PixelSpacing: between rows, between columns


def stock_load(folder: Path, affine_lps_to_ras: bool = True) -> Image:
    """The stock loader -> selector -> to-volume operators, called outside a graph (as bench_pipeline does)."""
    from monai.deploy.operators.dicom_data_loader_operator import DICOMDataLoaderOperator
    from monai.deploy.operators.dicom_series_selector_operator import DICOMSeriesSelectorOperator
    from monai.deploy.operators.dicom_series_to_volume_operator import DICOMSeriesToVolumeOperator

    fragment = Fragment()
    studies = DICOMDataLoaderOperator(fragment, name="loader").load_data_to_studies(folder)
    selection = DICOMSeriesSelectorOperator(fragment, name="selector").filter(None, studies)
    to_volume = DICOMSeriesToVolumeOperator(fragment, affine_lps_to_ras=affine_lps_to_ras, name="to_volume")
    return to_volume.convert_to_image(selection)


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
    def __init__(self, value):
        self.value = value

    def receive(self, name):
        assert name == "volume"
        return self.value


class Emitter:
    def __init__(self):
        self.emitted = {}

    def emit(self, value, name):
        self.emitted[name] = value


def test_operator_accepts_a_stock_image_and_refuses_other_types(tmp_path, threshold_bundle):
    folder = write_series(tmp_path / "series", "axial", SQUARE)
    predictor = BundlePredictor.from_dir(threshold_bundle, device="cpu")
    fragment = Fragment()
    operator = BundleInferenceOperator(fragment, predictor=predictor, name="bundle_inference")
    output = Emitter()
    operator.compute(Receiver(stock_load(folder)), output, None)
    assert run_record(fragment).failure is None
    assert np.array_equal(output.emitted["label_map"], predictor.predict(our_load(folder)))

    refused = Fragment()
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
