"""Series to volume: geometry from the headers, any file order, compressed syntaxes, refusals with reasons."""

from __future__ import annotations

import copy
import logging
import re
import resource
import warnings
from pathlib import Path

import highdicom as hd
import numpy as np
import pydicom
import pytest
from pydicom.data import get_testdata_file
from pydicom.encaps import encapsulate, generate_frames
from pydicom.pixels import apply_modality_lut
from pydicom.filebase import DicomFileLike
from pydicom.filewriter import write_dataset, write_file_meta_info
from pydicom.uid import (DeflatedExplicitVRLittleEndian, ExplicitVRBigEndian, ExplicitVRLittleEndian,
                         ImplicitVRLittleEndian, JPEG2000Lossless, JPEGLSLossless, RLELossless)

import medserve.dicom.index as index_module
from medserve.demo.phantom import make_phantom
from medserve.demo.study import SeriesGeometry, write_ct_series
from medserve.dicom.index import index_folder
from medserve.dicom.select import select_series
from medserve.dicom.volume import load_series, multiframe_geometry, ordered_instances, ras_affine, series_to_volume
from medserve.errors import DicomInputError, VolumeError


def volume_of(folder: Path) -> hd.Volume:
    return series_to_volume(select_series(index_folder(folder))[0].series)


def rotation(axis: np.ndarray, degrees: float) -> np.ndarray:
    axis = axis / np.linalg.norm(axis)
    angle = np.radians(degrees)
    k = np.array([[0, -axis[2], axis[1]], [axis[2], 0, -axis[0]], [-axis[1], axis[0], 0]])
    return np.eye(3) + np.sin(angle) * k + (1 - np.cos(angle)) * k @ k


def oriented(row: np.ndarray, column: np.ndarray) -> tuple[float, ...]:
    return tuple(float(v) for v in np.concatenate([row, column]))


ORIENTATIONS = {
    "axial": (1, 0, 0, 0, 1, 0),
    "coronal": (1, 0, 0, 0, 0, -1),
    "sagittal": (0, 1, 0, 0, 0, -1),
    "oblique": oriented(rotation(np.array([1.0, 0.3, 0.2]), 25) @ [1, 0, 0],
                        rotation(np.array([1.0, 0.3, 0.2]), 25) @ [0, 1, 0]),
    "feet_first_flipped": (-1, 0, 0, 0, 1, 0),
}


@pytest.fixture(scope="module")
def phantom():
    return make_phantom(shape=(20, 40, 36), spacing=(2.5, 1.5, 1.25), seed=3)


@pytest.mark.parametrize("name", list(ORIENTATIONS))
def test_geometry_follows_the_headers_for_any_orientation(tmp_path, phantom, name):
    geometry = SeriesGeometry(origin=(12.5, -40.0, 310.0), orientation=ORIENTATIONS[name],
                              pixel_spacing=phantom.spacing[1:], slice_spacing=phantom.spacing[0])
    write_ct_series(phantom.hu, tmp_path, geometry, file_order_seed=11)
    volume = volume_of(tmp_path)
    np.testing.assert_allclose(volume.affine, geometry.affine(), atol=1e-4)
    np.testing.assert_allclose(volume.array, phantom.hu, atol=0.5)
    assert volume.array.dtype == np.float32


def test_slices_are_ordered_along_the_normal_whatever_the_file_and_instance_order(tmp_path, phantom):
    geometry = SeriesGeometry(slice_spacing=phantom.spacing[0], pixel_spacing=phantom.spacing[1:])
    written = write_ct_series(phantom.hu[::-1], tmp_path, SeriesGeometry(
        origin=tuple(geometry.slice_position(phantom.hu.shape[0] - 1)), orientation=geometry.orientation,
        pixel_spacing=geometry.pixel_spacing, slice_spacing=-geometry.slice_spacing))
    assert len(written.paths) == phantom.hu.shape[0]
    volume = volume_of(tmp_path)
    np.testing.assert_allclose(volume.array, phantom.hu, atol=0.5)
    np.testing.assert_allclose(volume.affine, geometry.affine(), atol=1e-4)


def test_world_coordinates_are_lps_and_match_nifti_ras(tmp_path, phantom):
    write_ct_series(phantom.hu, tmp_path, SeriesGeometry(origin=(10.0, 20.0, 30.0)))
    volume = volume_of(tmp_path)
    k, j, i = 3, 5, 7
    lps = volume.affine @ [k, j, i, 1]
    ras = ras_affine(volume) @ [i, j, k, 1]
    np.testing.assert_allclose(ras[:3], lps[:3] * [-1, -1, 1])
    np.testing.assert_allclose(lps[:3], np.array([10.0, 20.0, 30.0]) + [i * 3.0, j * 3.0, k * 3.0])


def test_real_ct_round_trips_through_dicom(real_ct_study, real_ct):
    folder, _, geometry = real_ct_study
    volume = volume_of(folder)
    np.testing.assert_allclose(volume.array, np.maximum(real_ct, -1024), atol=0.5)
    np.testing.assert_allclose(volume.affine, geometry.affine(), atol=1e-4)


@pytest.mark.parametrize("syntax", [RLELossless, JPEG2000Lossless])
def test_compressed_series_decode_to_the_same_volume(tmp_path, phantom, syntax):
    write_ct_series(phantom.hu, tmp_path, transfer_syntax=syntax)
    assert pydicom.dcmread(next(tmp_path.iterdir())).file_meta.TransferSyntaxUID == syntax
    np.testing.assert_allclose(volume_of(tmp_path).array, phantom.hu, atol=0.5)


@pytest.mark.parametrize("syntax", [JPEGLSLossless, JPEG2000Lossless])
def test_a_compressed_frame_cut_short_is_refused_naming_the_file(tmp_path, phantom, syntax):
    """The JPEG-LS decoder returned noise for half a stream (values up to 65530 in one slice, exit 0)."""
    written = write_ct_series(phantom.hu, tmp_path / "half", transfer_syntax=syntax)
    victim = pydicom.dcmread(written.paths[5])
    [frame] = generate_frames(victim.PixelData, number_of_frames=1)
    victim.PixelData = encapsulate([frame[:len(frame) // 2]])
    victim.save_as(written.paths[5])
    with pytest.raises(VolumeError, match=rf"{written.paths[5].name}: pixel data frame 1 \(.*\) does not end with "
                                          r"the end-of-image marker FFD9: the stream is cut or damaged"):
        volume_of(tmp_path / "half")
    cut = write_ct_series(phantom.hu, tmp_path / "cut", transfer_syntax=syntax).paths[5]
    cut.write_bytes(cut.read_bytes()[:-100])  # the file itself cut: was "The dataset has no 'Pixel Data' element"
    with pytest.raises(VolumeError, match=rf"{cut.name}: pixel data is truncated: the file ends inside its Pixel "
                                          r"Data element"):
        volume_of(tmp_path / "cut")


def test_deflated_series_decodes_to_the_same_volume(tmp_path, phantom):
    written = _write(tmp_path, phantom)
    for path in written.paths:
        dataset = pydicom.dcmread(path)
        dataset.file_meta.TransferSyntaxUID = DeflatedExplicitVRLittleEndian
        dataset.save_as(path, enforce_file_format=True)
    assert b"\xe0\x7f\x10\x00" not in written.paths[0].read_bytes()  # the Pixel Data tag is deflated too
    np.testing.assert_allclose(volume_of(tmp_path).array, phantom.hu, atol=0.5)


@pytest.mark.parametrize("name", ["JPEG-LL.dcm", "JPGLosslessP14SV1_1s_1f_8b.dcm", "MR2_J2KI.dcm",
                                  "MR2_J2KR.dcm", "MR_small_jpeg_ls_lossless.dcm", "MR_small_RLE.dcm",
                                  "CT_small.dcm", "MR_small_bigendian.dcm"])
def test_single_files_of_many_transfer_syntaxes_decode_like_pydicom(tmp_path, name):
    reference = pydicom.dcmread(get_testdata_file(name))
    # Some of pydicom's test files carry no geometry: give them one, a single slice is a volume.
    reference.ImagePositionPatient = reference.get("ImagePositionPatient", [0, 0, 0])
    reference.ImageOrientationPatient = reference.get("ImageOrientationPatient", [1, 0, 0, 0, 1, 0])
    reference.PixelSpacing = reference.get("PixelSpacing", [1, 1])
    reference.save_as(tmp_path / name)
    slope, intercept = float(reference.get("RescaleSlope", 1)), float(reference.get("RescaleIntercept", 0))
    expected = reference.pixel_array * slope + intercept
    volume = series_to_volume(index_folder(tmp_path).all_series[0])
    np.testing.assert_allclose(volume.array[0], expected, atol=1e-3)


def test_jpeg_baseline_series_decodes(tmp_path, phantom):
    """8-bit JPEG baseline (lossy), encoded with Pillow, as older scanners' secondary captures are."""
    from io import BytesIO

    from PIL import Image
    from pydicom.encaps import encapsulate
    from pydicom.uid import JPEGBaseline8Bit

    written = _write(tmp_path, phantom)
    expected = []
    for path in written.paths:
        dataset = pydicom.dcmread(path)
        stored = np.clip((dataset.pixel_array.astype(np.float32) - 900) / 2, 0, 255).astype(np.uint8)
        buffer = BytesIO()
        Image.fromarray(stored).save(buffer, format="JPEG", quality=95)
        dataset.PixelData = encapsulate([buffer.getvalue()])
        dataset["PixelData"].VR = "OB"
        dataset.file_meta.TransferSyntaxUID = JPEGBaseline8Bit
        dataset.BitsAllocated, dataset.BitsStored, dataset.HighBit = 8, 8, 7
        dataset.RescaleSlope, dataset.RescaleIntercept = "2", "-124"
        dataset.save_as(path)
        expected.append(stored.astype(np.float32) * 2 - 124)
    volume = volume_of(tmp_path)
    assert np.abs(volume.array - np.stack(expected)).mean() < 4.0


def _as_mr(dataset: pydicom.Dataset) -> pydicom.Dataset:
    """The same slice as an MR Image Storage object (the CT-only attributes dropped)."""
    dataset.SOPClassUID = dataset.file_meta.MediaStorageSOPClassUID = pydicom.uid.MRImageStorage
    dataset.Modality = "MR"
    for keyword in ("KVP", "RescaleType", "ConvolutionKernel", "XRayTubeCurrent", "ExposureTime", "CTDIvol"):
        dataset.pop(keyword, None)
    return dataset


@pytest.mark.parametrize("modality,converter", [("CT", hd.legacy.LegacyConvertedEnhancedCTImage),
                                                 ("MR", hd.legacy.LegacyConvertedEnhancedMRImage)])
def test_enhanced_multiframe_image_gives_the_same_volume(tmp_path, phantom, modality, converter):
    single = tmp_path / "single"
    write_ct_series(phantom.hu, single, file_order_seed=2)
    datasets = [pydicom.dcmread(p) for p in sorted(single.iterdir())]
    if modality == "MR":
        datasets = [_as_mr(dataset) for dataset in datasets]
    enhanced = converter(legacy_datasets=datasets, series_instance_uid=pydicom.uid.generate_uid(), series_number=3,
                         sop_instance_uid=pydicom.uid.generate_uid(), instance_number=1)
    multi = tmp_path / "multi"
    multi.mkdir()
    enhanced.save_as(multi / "enhanced.dcm")
    series = index_folder(multi).all_series[0]
    assert series.is_multiframe and series.modality == modality
    volume = series_to_volume(series)
    reference = volume_of(single)
    np.testing.assert_allclose(volume.match_geometry(reference).array, reference.array, atol=0.5)
    # Slices ascend along the normal, as in volumes of single-frame series.
    normal = np.cross(*np.asarray(enhanced.SharedFunctionalGroupsSequence[0].PlaneOrientationSequence[0]
                                  .ImageOrientationPatient, dtype=float).reshape(2, 3))
    assert volume.affine[:3, 0] @ normal > 0
    np.testing.assert_allclose(volume.affine, reference.affine, atol=1e-4)


def _real_world_value_mapping() -> pydicom.Dataset:
    mapping = pydicom.Dataset()
    mapping.RealWorldValueFirstValueMapped, mapping.RealWorldValueLastValueMapped = 0, 65535
    mapping.RealWorldValueSlope, mapping.RealWorldValueIntercept = 0.001, 0
    mapping.LUTExplanation = mapping.LUTLabel = "arbitrary units"
    units = pydicom.Dataset()
    units.CodeValue, units.CodingSchemeDesignator, units.CodeMeaning = "1", "UCUM", "no units"
    mapping.MeasurementUnitsCodeSequence = [units]
    return mapping


def test_an_enhanced_image_gives_modality_units_not_its_real_world_values(tmp_path, phantom):
    """A Real World Value Mapping (Enhanced MR carries them routinely) is not the modality transform: the volume
    is in modality units, as a single-frame series' is."""
    write_ct_series(phantom.hu, tmp_path / "single")
    datasets = [pydicom.dcmread(p) for p in sorted((tmp_path / "single").iterdir())]
    enhanced = hd.legacy.LegacyConvertedEnhancedCTImage(
        legacy_datasets=datasets, series_instance_uid=pydicom.uid.generate_uid(), series_number=3,
        sop_instance_uid=pydicom.uid.generate_uid(), instance_number=1)
    enhanced.SharedFunctionalGroupsSequence[0].RealWorldValueMappingSequence = [_real_world_value_mapping()]
    (tmp_path / "multi").mkdir()
    enhanced.save_as(tmp_path / "multi" / "enhanced.dcm")
    reference = volume_of(tmp_path / "single")
    volume = volume_of(tmp_path / "multi")
    np.testing.assert_allclose(volume.match_geometry(reference).array, reference.array, atol=0.5)


def test_an_enhanced_image_written_without_the_preamble_is_read(tmp_path, phantom):
    write_ct_series(phantom.hu, tmp_path / "single")
    datasets = [pydicom.dcmread(p) for p in sorted((tmp_path / "single").iterdir())]
    enhanced = hd.legacy.LegacyConvertedEnhancedCTImage(
        legacy_datasets=datasets, series_instance_uid=pydicom.uid.generate_uid(), series_number=3,
        sop_instance_uid=pydicom.uid.generate_uid(), instance_number=1)
    enhanced.save_as(tmp_path / "with_preamble.dcm")
    (tmp_path / "multi").mkdir()
    (tmp_path / "multi" / "enhanced.dcm").write_bytes((tmp_path / "with_preamble.dcm").read_bytes()[132:])
    reference = volume_of(tmp_path / "single")
    np.testing.assert_allclose(volume_of(tmp_path / "multi").match_geometry(reference).array, reference.array,
                               atol=0.5)


def _enhanced_of(single: Path, folder: Path) -> Path:
    datasets = [pydicom.dcmread(p) for p in sorted(single.iterdir())]
    folder.mkdir()
    hd.legacy.LegacyConvertedEnhancedCTImage(
        legacy_datasets=datasets, series_instance_uid=pydicom.uid.generate_uid(), series_number=3,
        sop_instance_uid=pydicom.uid.generate_uid(), instance_number=1).save_as(folder / "enhanced.dcm")
    return folder


def test_an_enhanced_image_of_thin_slices_with_rounded_positions_forms_a_volume(tmp_path, phantom):
    """The frames of an Enhanced image get the single-frame series' tolerance: positions written with 2 decimals
    are off by more than 1 % of a 0.5 mm spacing along an oblique normal (highdicom's own tolerance)."""
    geometry = SeriesGeometry(origin=(12.5, -40.0, 310.0), orientation=ORIENTATIONS["oblique"],
                              pixel_spacing=(0.7, 0.7), slice_spacing=0.5)
    written = write_ct_series(phantom.hu, tmp_path / "single", geometry)
    for path in written.paths:
        dataset = pydicom.dcmread(path)
        dataset.ImagePositionPatient = [f"{float(v):.2f}" for v in dataset.ImagePositionPatient]
        dataset.save_as(path)
    multi = _enhanced_of(tmp_path / "single", tmp_path / "multi")
    volume = volume_of(multi)
    np.testing.assert_allclose(volume.affine, geometry.affine(), atol=0.01)
    np.testing.assert_allclose(volume.array, phantom.hu, atol=0.5)
    series = index_folder(multi).all_series[0]
    assert select_series(index_folder(multi))[0].series.series_uid == series.series_uid


def test_an_enhanced_image_whose_spacing_changes_along_the_stack_is_refused(tmp_path, phantom):
    """As single-frame slices are: each gap is within the tolerance of the mean gap, yet frames lie 0.12 mm from
    where a regular spacing puts them. Both the default selection and the volume refuse it."""
    _shift_slices(write_ct_series(phantom.hu, tmp_path / "single", SeriesGeometry(slice_spacing=0.6)),
                  lambda k: 0.025 * max(k - 10, 0))
    multi = _enhanced_of(tmp_path / "single", tmp_path / "multi")
    refusal = (r"enhanced.dcm: multi-frame image does not form a regular volume \(frame spacing is irregular: the "
               r"frame at .* mm along the normal lies 0\.1\d\d mm")
    with pytest.raises(VolumeError, match=refusal):
        select_series(index_folder(multi))
    with pytest.raises(VolumeError, match=refusal) as refused:
        series_to_volume(index_folder(multi).all_series[0])
    assert str(refused.value).count("does not form a regular volume") == 1


def _fewer_frames(dataset):
    dataset.NumberOfFrames = dataset.NumberOfFrames // 2


def _one_more_frame_of_pixels(dataset):
    dataset.PixelData += dataset.PixelData[:dataset.Rows * dataset.Columns * 2]


def _frame_without_its_position(dataset):
    del dataset.PerFrameFunctionalGroupsSequence[3].PlanePositionSequence


@pytest.mark.parametrize(("edit", "message"), [
    (_fewer_frames, r"NumberOfFrames is (\d+) but PerFrameFunctionalGroupsSequence has \d+ items; expected one item "
                    r"per frame"),
    (_one_more_frame_of_pixels, r"pixel data holds (\d+) frames of Rows x Columns x BitsAllocated/8 = \d+ bytes; "
                                r"NumberOfFrames says \d+"),
    (_frame_without_its_position, r"multi-frame image does not form a regular volume \(frame 4 has no "
                                  r"ImagePositionPatient of 3 numbers, in its own PlanePositionSequence or the "
                                  r"shared one\)"),
], ids=["number-of-frames-halved", "a-frame-of-pixels-too-many", "a-frame-without-its-position"])
def test_an_enhanced_image_whose_frames_do_not_add_up_is_refused(tmp_path, phantom, edit, message):
    """highdicom read NumberOfFrames frames and dropped the rest: half the slices segmented, exit 0; a frame
    without its position was refused as '((0020,9113))', and is now refused naming the frame."""
    path = _enhanced_of(write_ct_series(phantom.hu, tmp_path / "single").paths[0].parent, tmp_path / "multi")
    dataset = pydicom.dcmread(path / "enhanced.dcm")
    edit(dataset)
    dataset.save_as(path / "enhanced.dcm")
    with pytest.raises(VolumeError, match=r"enhanced.dcm: " + message):
        series_to_volume(index_folder(path).all_series[0])


def _second_phase_at_the_first_position(dataset):
    frames = dataset.PerFrameFunctionalGroupsSequence
    frames[5].PlanePositionSequence = frames[0].PlanePositionSequence


def _frame_group(dataset, frame: int, sequence: str, **values) -> None:
    item = pydicom.Dataset()
    for keyword, value in values.items():
        setattr(item, keyword, value)
    setattr(dataset.PerFrameFunctionalGroupsSequence[frame], sequence, [item])


def _a_frame_of_other_pixel_spacing(dataset):
    _frame_group(dataset, 3, "PixelMeasuresSequence", PixelSpacing=[0.9, 0.9], SliceThickness=2.5)


def _a_frame_of_other_orientation(dataset):
    _frame_group(dataset, 3, "PlaneOrientationSequence", ImageOrientationPatient=[1, 0, 0, 0, 0, -1])


def _no_per_frame_groups(dataset):
    del dataset.PerFrameFunctionalGroupsSequence


@pytest.mark.parametrize(("edit", "message"), [
    (_second_phase_at_the_first_position, r"duplicated slice at [-\d.]+ mm along the slice normal: frames 1, 6; "
                                          r"an object of several phases, echoes or times is no single volume"),
    (_a_frame_of_other_pixel_spacing, r"its frames differ in PixelSpacing: 3\\3 in frame 1, 0.9\\0.9 in "
                                      r"frame 4"),
    (_a_frame_of_other_orientation, r"its frames differ in ImageOrientationPatient: 1\\0\\0\\0\\1\\0 in frame 1, "
                                    r"1\\0\\0\\0\\0\\-1 in frame 4"),
    (_no_per_frame_groups, r"it has no PerFrameFunctionalGroupsSequence, where the positions of its 20 frames are "
                           r"stated"),
], ids=["two-phases", "pixel-spacing", "orientation", "no-per-frame-groups"])
def test_an_enhanced_image_that_is_no_volume_is_refused_saying_why(tmp_path, phantom, edit, message):
    """All were refused as 'its frames' positions are not a regular stack along one normal', the same whether the
    default selection looked at the headers or the volume was built from the chosen series."""
    path = _enhanced_of(write_ct_series(phantom.hu, tmp_path / "single").paths[0].parent, tmp_path / "multi")
    dataset = pydicom.dcmread(path / "enhanced.dcm")
    edit(dataset)
    dataset.save_as(path / "enhanced.dcm")
    expected = r"enhanced.dcm: multi-frame image does not form a regular volume \(" + message + r"\)$"
    with pytest.raises(VolumeError, match=r"^series .*" + expected):
        select_series(index_folder(path))
    with pytest.raises(VolumeError, match=expected):
        series_to_volume(index_folder(path).all_series[0])


def test_a_big_endian_enhanced_image_is_refused_saying_so(tmp_path, phantom):
    """highdicom's 'Parsing of datasets is only valid for datasets with little endian transfer syntaxes' was given
    as a reason the frames do not form a volume."""
    path = _enhanced_of(write_ct_series(phantom.hu, tmp_path / "single").paths[0].parent, tmp_path / "multi")
    dataset = pydicom.dcmread(path / "enhanced.dcm")
    dataset.PixelData = dataset.pixel_array.astype(">i2" if dataset.PixelRepresentation else ">u2").tobytes()
    dataset.file_meta.TransferSyntaxUID = ExplicitVRBigEndian
    pydicom.dcmwrite(path / "enhanced.dcm", dataset, little_endian=False, implicit_vr=False, force_encoding=True)
    expected = (r"enhanced.dcm: multi-frame image in Explicit VR Big Endian \(a retired transfer syntax\), which "
                r"highdicom cannot read; expected a little-endian transfer syntax")
    with pytest.raises(VolumeError, match=r"^series .*" + expected):
        select_series(index_folder(path))
    with pytest.raises(VolumeError, match=expected):
        series_to_volume(index_folder(path).all_series[0])


def _float_noise_in_a_frame(keyword: str):
    def edit(dataset):
        frames = dataset.PerFrameFunctionalGroupsSequence
        shared = dataset.SharedFunctionalGroupsSequence[0]
        for sequence in ("PlaneOrientationSequence", "PixelMeasuresSequence"):  # per frame, as Philips writes them
            for frame in frames:
                setattr(frame, sequence, copy.deepcopy(shared[sequence].value))
            delattr(shared, sequence)
        item = frames[4].PlaneOrientationSequence[0] if keyword == "ImageOrientationPatient" else \
            frames[4].PixelMeasuresSequence[0]
        item[keyword].value = [f"{float(v) + 1e-6:.7f}" for v in item[keyword].value]
    return edit


@pytest.mark.parametrize("keyword", ["ImageOrientationPatient", "PixelSpacing"])
def test_an_enhanced_image_whose_frames_differ_by_float_noise_only_forms_its_volume(tmp_path, phantom, keyword):
    """highdicom wants every frame's orientation and pixel spacing equal: 1e-6 apart, it refused the frames as 'not
    a regular stack along one normal'. The caller's header keeps its values."""
    single = write_ct_series(phantom.hu, tmp_path / "single")
    path = _enhanced_of(single.paths[0].parent, tmp_path / "multi")
    dataset = pydicom.dcmread(path / "enhanced.dcm")
    _float_noise_in_a_frame(keyword)(dataset)
    dataset.save_as(path / "enhanced.dcm")
    [selected] = select_series(index_folder(path))
    header = selected.series.header
    noisy_before = str(header.PerFrameFunctionalGroupsSequence[4])
    volume = series_to_volume(selected.series)
    assert str(header.PerFrameFunctionalGroupsSequence[4]) == noisy_before
    expected = series_to_volume(index_folder(single.paths[0].parent).all_series[0])
    np.testing.assert_allclose(volume.affine, expected.affine, atol=1e-4)
    np.testing.assert_array_equal(volume.array, expected.array)


@pytest.mark.parametrize("syntax", [JPEGLSLossless, JPEG2000Lossless])
def test_a_cut_frame_of_a_compressed_enhanced_image_is_refused_naming_it(tmp_path, phantom, syntax):
    """As for single-frame slices: the JPEG-LS decoder returned noise for the cut frame (exit 0), the JPEG 2000
    one a highdicom error with pydicom's tracebacks logged. Frames missing altogether are named as such (they were
    "does not form a regular volume")."""
    path = _enhanced_of(write_ct_series(phantom.hu, tmp_path / "single").paths[0].parent, tmp_path / "multi")
    dataset = pydicom.dcmread(path / "enhanced.dcm")
    dataset.compress(syntax)
    frames = list(generate_frames(dataset.PixelData, number_of_frames=dataset.NumberOfFrames))
    frames[3] = frames[3][:len(frames[3]) // 2]
    dataset.PixelData = encapsulate(frames)
    dataset.save_as(path / "enhanced.dcm")
    with pytest.raises(VolumeError, match=r"enhanced.dcm: pixel data frame 4 \(.*\) does not end with the "
                                          r"end-of-image marker FFD9: the stream is cut or damaged"):
        series_to_volume(index_folder(path).all_series[0])
    dataset.PixelData = encapsulate(frames[:-1], has_bot=False)  # a frame fewer than NumberOfFrames says
    dataset.save_as(path / "enhanced.dcm")
    with pytest.raises(VolumeError, match=r"enhanced.dcm: cannot read the encapsulated frames \(.*fewer fragments "
                                          r"than frames"):
        series_to_volume(index_folder(path).all_series[0])


def test_a_series_of_several_multiframe_objects_is_refused_with_the_reason(tmp_path, phantom):
    single = tmp_path / "single"
    write_ct_series(phantom.hu, single)
    datasets = [pydicom.dcmread(p) for p in sorted(single.iterdir())]
    series_uid = pydicom.uid.generate_uid()
    multi = tmp_path / "multi"
    multi.mkdir()
    for number, half in enumerate((datasets[:len(datasets) // 2], datasets[len(datasets) // 2:]), start=1):
        hd.legacy.LegacyConvertedEnhancedCTImage(
            legacy_datasets=half, series_instance_uid=series_uid, series_number=3,
            sop_instance_uid=pydicom.uid.generate_uid(), instance_number=number).save_as(multi / f"part{number}.dcm")
    with pytest.raises(VolumeError, match=r"2 instances of which 2 are multi-frame .*expected one multi-frame"):
        series_to_volume(index_folder(multi).all_series[0])


def _write(tmp_path, phantom, **overrides):
    geometry = SeriesGeometry(pixel_spacing=phantom.spacing[1:], slice_spacing=phantom.spacing[0])
    return write_ct_series(phantom.hu, tmp_path, geometry, **overrides)


def test_missing_slice_is_refused_with_the_gap(tmp_path, phantom):
    written = _write(tmp_path, phantom)
    written.paths[7].unlink()
    with pytest.raises(VolumeError, match=r"missing 1 slice\(s\)"):
        volume_of(tmp_path)


def test_duplicated_slice_is_refused_naming_the_files(tmp_path, phantom):
    written = _write(tmp_path, phantom)
    duplicate = pydicom.dcmread(written.paths[4])
    duplicate.SOPInstanceUID = pydicom.uid.generate_uid()
    duplicate.save_as(tmp_path / "copy.dcm")
    with pytest.raises(VolumeError, match=r"duplicated slice.*copy\.dcm"):
        volume_of(tmp_path)


def test_many_slices_at_one_position_are_listed_by_the_first_five(tmp_path, phantom):
    """A series whose positions all collapse onto one (damaged, or 1e-300 apart) is one readable line."""
    written = _write(tmp_path, phantom)
    _edit_every_file(written, _set("ImagePositionPatient", ["0", "0", "0"]))
    listed = ", ".join(re.escape(str(path)) for path in sorted(written.paths)[:5])
    with pytest.raises(VolumeError, match=rf"^series \S+ \(.*\): duplicated slice at 0.000 mm along the slice normal: "
                                          rf"{listed} and {len(written.paths) - 5} more$"):
        volume_of(tmp_path)


def test_two_slices_with_one_sop_instance_uid_are_refused_naming_both(tmp_path, phantom):
    """A SEG frame refers to its source image by this UID: two positions under one UID make the SEG ambiguous."""
    written = _write(tmp_path, phantom)
    first, other = pydicom.dcmread(written.paths[0]), pydicom.dcmread(written.paths[5])
    other.SOPInstanceUID = other.file_meta.MediaStorageSOPInstanceUID = first.SOPInstanceUID
    other.save_as(written.paths[5])
    names = sorted([written.paths[0].name, written.paths[5].name])
    with pytest.raises(VolumeError, match=rf"SOPInstanceUID {first.SOPInstanceUID} is also that of .*"
                                          rf"({names[0]}|{names[1]}), at another position"):
        volume_of(tmp_path)


@pytest.mark.parametrize("shift_mm", [0.0, 50.0, 1.5], ids=["one-slice", "apart", "interleaved"])
def test_slices_in_two_frames_of_reference_are_refused(tmp_path, phantom, shift_mm):
    """Also when the second frame of reference's slices do not continue the first's stack: comparing their
    positions said 'spacing is irregular' or 'duplicated slice' rather than why."""
    written = _write(tmp_path, phantom)
    other = pydicom.uid.generate_uid()
    for path in written.paths[len(written.paths) // 2:] if shift_mm else written.paths[2:3]:
        dataset = pydicom.dcmread(path)
        dataset.FrameOfReferenceUID = other
        position = [float(value) for value in dataset.ImagePositionPatient]
        dataset.ImagePositionPatient = [*position[:2], position[2] + shift_mm]
        dataset.save_as(path)
    with pytest.raises(VolumeError, match=r"IM\d+\.dcm: FrameOfReferenceUID .* differs from .* slices of one series "
                                          r"must share one frame of reference"):
        volume_of(tmp_path)


def _shift_slices(written, shift) -> None:
    """Move slice k of an axial series by shift(k) mm along z."""
    for k, path in enumerate(written.paths):
        dataset = pydicom.dcmread(path)
        dataset.ImagePositionPatient[2] = float(dataset.ImagePositionPatient[2]) + shift(k)
        dataset.save_as(path)


def test_irregular_spacing_is_refused(tmp_path, phantom):
    _shift_slices(_write(tmp_path, phantom), lambda k: 0.9 if k % 2 else 0.0)
    with pytest.raises(VolumeError, match="irregular"):
        volume_of(tmp_path)


def test_oblique_thin_slices_with_rounded_positions_and_orientation_form_a_volume(tmp_path, phantom):
    """Scanners and anonymisers round ImagePositionPatient to 2 decimals and ImageOrientationPatient to a few: on
    oblique 0.5 mm slices that is more than 1 % of the spacing, and the cosines are orthogonal to about 1e-3."""
    geometry = SeriesGeometry(origin=(12.5, -40.0, 310.0), orientation=ORIENTATIONS["oblique"],
                              pixel_spacing=(0.7, 0.7), slice_spacing=0.5)
    written = write_ct_series(phantom.hu, tmp_path, geometry)
    for path in written.paths:
        dataset = pydicom.dcmread(path)
        dataset.ImagePositionPatient = [f"{float(v):.2f}" for v in dataset.ImagePositionPatient]
        dataset.ImageOrientationPatient = [f"{float(v):.3f}" for v in dataset.ImageOrientationPatient]
        dataset.save_as(path)
    volume = volume_of(tmp_path)
    np.testing.assert_allclose(volume.affine, geometry.affine(), atol=0.01)
    np.testing.assert_allclose(volume.array, phantom.hu, atol=0.5)


def test_irregular_thin_slices_are_refused_beyond_position_rounding(tmp_path, phantom):
    _shift_slices(write_ct_series(phantom.hu, tmp_path, SeriesGeometry(slice_spacing=0.5)),
                  lambda k: 0.05 if k % 2 else 0.0)
    with pytest.raises(VolumeError, match="irregular"):
        volume_of(tmp_path)


def test_thin_slices_whose_spacing_changes_along_the_stack_are_refused(tmp_path, phantom):
    """Each gap is within the rounding floor of the mean gap, yet the middle slice lies 0.12 mm from where a
    regular spacing puts it: accepting the series would misplace it."""
    _shift_slices(write_ct_series(phantom.hu, tmp_path, SeriesGeometry(slice_spacing=0.6)),
                  lambda k: 0.025 * max(k - 10, 0))
    with pytest.raises(VolumeError, match=r"slice spacing is irregular: the slice at .* mm along the normal lies "
                                          r"0\.1\d\d mm from where a regular spacing of 0\.6\d+ mm puts it"):
        volume_of(tmp_path)


def test_oblique_slices_with_three_decimal_cosines_form_a_volume(tmp_path, phantom):
    """|row x column| of 3-decimal cosines can differ from 1 by 1.5e-3, beyond highdicom's stacking tolerance when
    it takes them as written: the orthonormal cosines nearest to them go into the geometry checks."""
    orientation = (-0.461, -0.847, -0.267, 0.572, -0.513, 0.641)
    row, column = np.asarray(orientation[:3]), np.asarray(orientation[3:])
    assert abs(np.linalg.norm(np.cross(row, column)) - 1) > 1e-3
    geometry = SeriesGeometry(origin=(12.5, -40.0, 310.0), orientation=orientation, pixel_spacing=(0.8, 0.8),
                              slice_spacing=2.0)
    written = write_ct_series(phantom.hu, tmp_path, geometry)
    for path in written.paths:
        dataset = pydicom.dcmread(path)
        dataset.ImagePositionPatient = [f"{float(v):.2f}" for v in dataset.ImagePositionPatient]
        dataset.save_as(path)
    volume = volume_of(tmp_path)
    last = volume.affine @ [len(written.paths) - 1, 0, 0, 1]
    np.testing.assert_allclose(last[:3], pydicom.dcmread(written.paths[-1]).ImagePositionPatient, atol=0.01)


def test_a_tilted_stack_is_refused_saying_so(tmp_path, phantom):
    written = _write(tmp_path, phantom)
    for path in written.paths:
        dataset = pydicom.dcmread(path)
        z = float(dataset.ImagePositionPatient[2])
        dataset.ImagePositionPatient[1] = float(dataset.ImagePositionPatient[1]) + 0.2 * z  # 11 degrees of tilt
        dataset.save_as(path)
    with pytest.raises(VolumeError, match=r"not stacked along their normal: their positions shift by up to "
                                          r"\d+\.\d+ mm within the slice plane \(a gantry tilt"):
        volume_of(tmp_path)


def test_mixed_orientations_are_refused(tmp_path, phantom):
    written = _write(tmp_path, phantom)
    dataset = pydicom.dcmread(written.paths[3])
    dataset.ImageOrientationPatient = [1, 0, 0, 0, 0.8, -0.6]
    dataset.save_as(written.paths[3])
    with pytest.raises(VolumeError, match="mixed orientations"):
        volume_of(tmp_path)


def test_mixed_sizes_are_refused(tmp_path, phantom):
    written = _write(tmp_path, phantom)
    dataset = pydicom.dcmread(written.paths[2])
    dataset.Rows = 20
    dataset.PixelData = dataset.PixelData[: 20 * dataset.Columns * 2]
    dataset.save_as(written.paths[2])
    with pytest.raises(VolumeError, match="mixed sizes"):
        volume_of(tmp_path)


def test_mixed_pixel_spacings_are_refused(tmp_path, phantom):
    written = _write(tmp_path, phantom)
    dataset = pydicom.dcmread(written.paths[6])
    dataset.PixelSpacing = [1.0, 1.0]
    dataset.save_as(written.paths[6])
    with pytest.raises(VolumeError, match="mixed pixel spacings"):
        volume_of(tmp_path)


def test_truncated_file_is_refused_naming_it(tmp_path, phantom):
    written = _write(tmp_path, phantom)
    victim = written.paths[5]
    victim.write_bytes(victim.read_bytes()[:-1000])
    with pytest.raises((VolumeError, DicomInputError), match=victim.name):
        volume_of(tmp_path)


def _paths_in_slice_order(folder: Path) -> list[Path]:
    return [instance.path for instance in ordered_instances(index_folder(folder).all_series[0])]


def test_of_several_unreadable_slices_the_first_along_the_normal_is_named(tmp_path, phantom):
    _write(tmp_path, phantom)
    paths = _paths_in_slice_order(tmp_path)
    for victim in (paths[2], paths[-3]):  # one in each reading thread's run of slices
        victim.write_bytes(victim.read_bytes()[:-1000])
    for _ in range(3):
        with pytest.raises(VolumeError, match=f"{paths[2].name}: pixel data is truncated"):
            volume_of(tmp_path)


def test_each_slice_keeps_its_own_rescale(tmp_path, phantom):
    _write(tmp_path, phantom)
    reference = volume_of(tmp_path).array.copy()
    paths = _paths_in_slice_order(tmp_path)
    intercept = float(pydicom.dcmread(paths[0], stop_before_pixels=True).RescaleIntercept)
    for k, path in enumerate(paths):
        dataset = pydicom.dcmread(path)
        if k == 3:
            del dataset.RescaleIntercept  # absent: 0
        else:
            dataset.RescaleIntercept = f"{intercept + k % 4}"
        dataset.save_as(path)
    series = index_folder(tmp_path).all_series[0]
    by_path = {instance.path: instance for instance in series.instances}
    by_path[paths[4]].dataset.RescaleIntercept = intercept + 100  # converted by pydicom: no stored bytes left
    expected = reference + (np.arange(len(paths)) % 4)[:, None, None]
    expected[3] = reference[3] - intercept
    expected[4] = reference[4] + 100
    np.testing.assert_allclose(series_to_volume(series).array, expected, atol=1e-3)


@pytest.mark.parametrize("syntax", [ExplicitVRLittleEndian, RLELossless])
def test_a_modality_lut_sequence_gives_modality_units_as_pydicom_applies_it(tmp_path, phantom, syntax):
    """A modality transform given as a LUT rather than slope/intercept: the volume holds what pydicom's
    apply_modality_lut (the stock operator's rescale) makes of each slice, not the stored values."""
    _write(tmp_path, phantom)
    paths = _paths_in_slice_order(tmp_path)
    expected = []
    for k, path in enumerate(paths):
        dataset = pydicom.dcmread(path)
        del dataset.RescaleSlope, dataset.RescaleIntercept
        lut = pydicom.Dataset()
        lut.LUTDescriptor, lut.ModalityLUTType = [4096, 0, 16], "HU"
        lut.LUTData = (np.arange(4096) * 2 + 10 + k).astype("<u2").tobytes()  # each slice its own LUT
        lut["LUTData"].VR = "OW"
        dataset.ModalityLUTSequence = [lut]
        if syntax == RLELossless:
            dataset.compress(RLELossless, encoding_plugin="pydicom")
        dataset.save_as(path)
        expected.append(apply_modality_lut(dataset.pixel_array, dataset))
    np.testing.assert_array_equal(volume_of(tmp_path).array, np.stack(expected).astype(np.float32))


def test_missing_geometry_attribute_is_refused(tmp_path, phantom):
    written = _write(tmp_path, phantom)
    dataset = pydicom.dcmread(written.paths[1])
    del dataset.PixelSpacing
    dataset.save_as(written.paths[1])
    with pytest.raises(VolumeError, match="PixelSpacing is missing"):
        volume_of(tmp_path)


def test_empty_samples_per_pixel_is_refused_naming_it(tmp_path, phantom):
    written = _write(tmp_path, phantom)
    dataset = pydicom.dcmread(written.paths[2])
    dataset.SamplesPerPixel = None
    dataset.save_as(written.paths[2])
    with pytest.raises(VolumeError, match=f"{written.paths[2].name}: SamplesPerPixel is empty; expected 1"):
        volume_of(tmp_path)


def test_stored_bits_below_allocated_are_sign_extended(tmp_path, phantom):
    written = _write(tmp_path, phantom)
    for path in written.paths:
        dataset = pydicom.dcmread(path)
        values = dataset.pixel_array.astype(np.int32) - 2048  # 12-bit signed range
        dataset.PixelRepresentation, dataset.BitsStored, dataset.HighBit = 1, 12, 11
        dataset.RescaleIntercept = "0"
        garbage_high_bits = (values.astype(np.int16) & 0x0FFF) | 0x5000  # a writer that leaves junk above bit 11
        dataset.PixelData = garbage_high_bits.astype(np.int16).tobytes()
        dataset.save_as(path)
    expected = np.clip(np.rint(phantom.hu + 1024), 0, 65535) - 2048
    np.testing.assert_allclose(volume_of(tmp_path).array, expected, atol=0.5)


@pytest.mark.parametrize("signed", [True, False])
def test_stored_bits_below_allocated_are_honoured_in_an_enhanced_image_too(tmp_path, phantom, signed):
    """highdicom decodes an Enhanced image's native frames as the bytes are: 12-bit two's complement values in
    16-bit words read as 0..4095 (-1000 HU as 3096), junk in the high bits as values; exit 0, a wrong SEG."""
    write_ct_series(phantom.hu, tmp_path / "single")
    enhanced = pydicom.dcmread(_enhanced_of(tmp_path / "single", tmp_path / "multi") / "enhanced.dcm")
    values = enhanced.pixel_array.astype(np.int32) - (2048 if signed else 0)
    junk = 0x5000 if signed else 0xB000
    stored = (values.astype(np.int16).view(np.uint16) & 0x0FFF) | junk
    enhanced.PixelRepresentation, enhanced.BitsStored, enhanced.HighBit = int(signed), 12, 11
    enhanced.PixelData = stored.astype(np.uint16).tobytes()
    enhanced.save_as(tmp_path / "multi" / "enhanced.dcm")
    reference = volume_of(tmp_path / "single")
    expected = reference.array - (2048 if signed else 0)
    np.testing.assert_allclose(volume_of(tmp_path / "multi").match_geometry(reference).array, expected, atol=0.5)


def test_damaged_rle_frame_is_refused_naming_the_file(tmp_path, phantom):
    write_ct_series(phantom.hu, tmp_path, transfer_syntax=RLELossless)
    damaged = sorted(tmp_path.iterdir())[3]
    dataset = pydicom.dcmread(damaged)
    frame = bytearray(next(generate_frames(dataset.PixelData, number_of_frames=1)))
    frame[0:4] = (1).to_bytes(4, "little")  # one segment declared: 16-bit pixels need two
    dataset.PixelData = encapsulate([bytes(frame)])
    dataset.save_as(damaged)
    with pytest.raises(VolumeError, match=f"{damaged.name}: cannot decode pixel data"):
        volume_of(tmp_path)


def test_non_numeric_geometry_is_refused_naming_file_and_attribute(tmp_path, phantom):
    written = _write(tmp_path, phantom)
    data = bytearray(written.paths[2].read_bytes())
    at = data.index(b"\x20\x00\x32\x00DS")  # (0020,0032) ImagePositionPatient, explicit VR
    length = int.from_bytes(data[at + 6:at + 8], "little")
    data[at + 8:at + 8 + length] = b"1.5\\abc".ljust(length)
    written.paths[2].write_bytes(bytes(data))
    with pytest.raises(VolumeError, match=rf"{written.paths[2].name}: ImagePositionPatient .* not a list of decimal"):
        volume_of(tmp_path)


def test_orientations_written_with_other_digits_but_equal_values_are_one_orientation(tmp_path, phantom):
    written = _write(tmp_path, phantom)
    reference = volume_of(tmp_path)
    dataset = pydicom.dcmread(written.paths[4])
    dataset.ImageOrientationPatient = ["1.000000", "0.0", "0", "0", "1.00000", "-0.0"]
    dataset.save_as(written.paths[4])
    volume = volume_of(tmp_path)
    np.testing.assert_array_equal(volume.array, reference.array)
    np.testing.assert_allclose(volume.affine, reference.affine)


def test_a_header_longer_than_the_first_read_is_parsed_from_the_file(tmp_path, phantom):
    written = _write(tmp_path, phantom)
    reference = volume_of(tmp_path).array.copy()
    for path in written.paths:
        dataset = pydicom.dcmread(path)
        dataset.add_new(0x00291010, "OB", b"\x01" * (index_module._HEADER_CHUNK_BYTES + 100))  # private, 33 kB
        dataset.save_as(path)
    index = index_folder(tmp_path)
    instance = index.all_series[0].instances[0]
    assert instance.pixel_data_offset > index_module._HEADER_CHUNK_BYTES
    np.testing.assert_array_equal(series_to_volume(index.all_series[0]).array, reference)


def test_the_first_series_volume_is_built_in_memory_prepared_while_indexing(tmp_path, phantom):
    _write(tmp_path, phantom)
    series = index_folder(tmp_path).all_series[0]
    assert series.volume_memory is not None
    first = load_series(series).volume.array
    second = load_series(series).volume.array  # the prepared memory is handed out once: no shared array
    assert not np.shares_memory(first, second)
    np.testing.assert_array_equal(first, second)
    first[:] = 0
    assert np.any(second != 0)


def _rewrite_body(path: Path, implicit_vr: bool) -> None:
    """Rewrite a file's body in the other VR encoding than its file meta's transfer syntax says (as some writers
    in the wild do); pydicom reads such files by looking at the body."""
    dataset = pydicom.dcmread(path)
    body = pydicom.Dataset()
    body.update(dataset)
    with path.open("wb") as stream:
        stream.write(b"\0" * 128 + b"DICM")
        writer = DicomFileLike(stream)
        write_file_meta_info(writer, dataset.file_meta, enforce_standard=True)
        writer.is_little_endian, writer.is_implicit_VR = True, implicit_vr
        write_dataset(writer, body)


@pytest.mark.parametrize("meta_syntax,body_implicit", [(ImplicitVRLittleEndian, False),
                                                        (ExplicitVRLittleEndian, True)],
                         ids=["explicit-body-implicit-meta", "implicit-body-explicit-meta"])
def test_a_body_encoded_otherwise_than_its_transfer_syntax_gives_the_right_pixels(tmp_path, phantom, meta_syntax,
                                                                                   body_implicit):
    written = _write(tmp_path, phantom)
    reference = volume_of(tmp_path).array.copy()
    for path in written.paths:
        dataset = pydicom.dcmread(path)
        dataset.file_meta.TransferSyntaxUID = meta_syntax
        dataset.save_as(path, enforce_file_format=True)
        _rewrite_body(path, body_implicit)
    assert pydicom.dcmread(written.paths[0]).file_meta.TransferSyntaxUID == meta_syntax
    np.testing.assert_array_equal(volume_of(tmp_path).array, reference)


def _edit_every_file(written, edit) -> None:
    for path in written.paths:
        dataset = pydicom.dcmread(path)
        edit(dataset)
        dataset.save_as(path)


def _drop(keyword):
    return lambda dataset: delattr(dataset, keyword)


def _set(keyword, value):
    return lambda dataset: setattr(dataset, keyword, value)


def _slice_size(rows, columns):
    def edit(dataset):
        dataset.Rows, dataset.Columns = rows, columns
    return edit


def _two_frames_of_pixel_data(dataset):
    dataset.PixelData = dataset.PixelData * 2


@pytest.mark.parametrize("edit,message", [
    (_set("PixelSpacing", ["0", "0"]), r"PixelSpacing \[0.0, 0.0\]: expected two positive spacings"),
    (_set("ImageOrientationPatient", [2, 0, 0, 0, 2, 0]), r"ImageOrientationPatient \[2.0, 0.0, 0.0, 0.0, 2.0, "
                                                          r"0.0\]: expected two orthogonal unit vectors"),
    (_set("ImageOrientationPatient", [1, 0, 0, 0.1, 1, 0]), r"expected two orthogonal unit vectors"),
    (_set("ImagePositionPatient", ["nan", "0", "0"]), r"ImagePositionPatient \[nan, 0.0, 0.0\]: expected finite"),
    (_set("ImagePositionPatient", ["1e300", "0", "0"]), r"ImagePositionPatient \[1e\+300, 0.0, 0.0\]: expected "
                                                        r"coordinates within 1e\+06 mm of the patient origin"),
    (_set("PixelSpacing", ["1e308", "1e308"]), r"PixelSpacing \[1e\+308, 1e\+308\]: expected two positive spacings "
                                               r"\(mm\) from 0.0001 to 10000"),
    (_set("PixelSpacing", ["1e-300", "1"]), r"PixelSpacing \[1e-300, 1.0\]: expected two positive spacings"),
    (_set("Rows", 0), r"Rows is 0; expected at least 1"),
    (_drop("BitsAllocated"), r"BitsAllocated is missing; the pixels cannot be read without it"),
    (_drop("PixelRepresentation"), r"PixelRepresentation is missing"),
    (_set("BitsStored", 20), r"BitsStored 20 does not fit BitsAllocated 16; expected 1 to 16"),
    (_set("PixelRepresentation", 2), r"PixelRepresentation 2 is not supported; expected 0 \(unsigned\) or 1 "
                                      r"\(two's complement\)"),
    (_set("PhotometricInterpretation", "PALETTE COLOR"), r"PhotometricInterpretation is PALETTE COLOR; expected "
                                                         r"MONOCHROME1 or MONOCHROME2 \(greyscale CT/MR\)"),
    (_set("PhotometricInterpretation", "RGB"), r"PhotometricInterpretation is RGB; expected MONOCHROME1"),
    (_set("RescaleSlope", "0"), r"RescaleSlope 0.0 / RescaleIntercept -1024.0: expected a finite, non-zero slope"),
    (_set("RescaleIntercept", "inf"), r"RescaleIntercept inf: expected a finite"),
    (_set("RescaleSlope", "1e-50"), r"RescaleSlope 1e-50 / RescaleIntercept -1024.0: expected a finite, non-zero "
                                    r"slope"),  # zero in float32
    (_set("RescaleSlope", "1e35"), r"RescaleSlope 1e\+35 / .* keep 16-bit stored values within float32 range"),
    (_set("RescaleIntercept", "-1e40"), r"RescaleIntercept -1e\+40: .* within float32 range"),
    (_two_frames_of_pixel_data, r"pixel data holds \d+ bytes; Rows x Columns x BitsAllocated/8 is \d+: more than "
                                r"one frame"),
    (_set("Columns", 32), r"pixel data holds 2880 bytes; Rows x Columns x BitsAllocated/8 is 2560: more than one "
                          r"frame, or Rows/Columns/BitsAllocated are wrong"),
    # Refused before the volume is allocated: 16 GiB a slice (the kernel refused the address space before).
    (_slice_size(65535, 65535), r"pixel data is truncated \(2880 of the 8589672450 bytes Rows x Columns x "
                                r"BitsAllocated/8 call for\)"),
], ids=["zero-pixel-spacing", "unnormalised-orientation", "skewed-orientation", "nan-position",
        "position-beyond-a-kilometre", "pixel-spacing-1e308", "pixel-spacing-1e-300", "zero-rows",
        "no-bits-allocated", "no-pixel-representation", "bits-stored-above-allocated",
        "pixel-representation-2", "palette-color", "rgb-with-one-sample", "zero-slope",
        "infinite-intercept", "slope-zero-in-float32", "slope-overflowing-float32", "intercept-beyond-float32",
        "two-frames-of-pixels", "columns-below-the-pixels", "rows-and-columns-far-beyond-the-pixels"])
def test_headers_that_do_not_describe_a_volume_are_refused_naming_the_file(tmp_path, phantom, edit, message):
    written = _write(tmp_path, phantom)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # pydicom warns about the invalid values it is asked to write
        _edit_every_file(written, edit)
    with pytest.raises(VolumeError, match=r"IM\d+\.dcm: .*" + message):
        volume_of(tmp_path)


def test_a_volume_beyond_the_address_space_is_refused_with_its_size(tmp_path, phantom):
    """Compressed pixels cannot be measured against Rows x Columns before they are decoded, so a damaged size is
    met by the allocation itself: refused here by an address-space limit, as the kernel refuses one beyond its
    memory."""
    written = _write(tmp_path, phantom, transfer_syntax=RLELossless)
    _edit_every_file(written, _slice_size(65535, 65535))
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    in_use = int(re.search(r"VmSize:\s+(\d+) kB", Path("/proc/self/status").read_text())[1]) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (in_use + 2**31, hard))
    try:
        with pytest.raises(VolumeError, match=rf"IM\d+\.dcm: {len(written.paths)} slices of Rows 65535 x Columns "
                                              r"65535 need \d+\.\d GiB as float32, more than can be allocated here"):
            volume_of(tmp_path)
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def test_padding_bytes_after_the_frame_are_ignored_with_a_warning(tmp_path, phantom, caplog):
    """Some writers pad Pixel Data beyond the frame (to a block size, say); pydicom and the stock read the frame."""
    written = _write(tmp_path, phantom)
    _edit_every_file(written, lambda dataset: setattr(dataset, "PixelData", dataset.PixelData + bytes(64)))
    with caplog.at_level(logging.WARNING, logger="medserve.dicom.pixels"):
        volume = volume_of(tmp_path)
    np.testing.assert_allclose(volume.array, phantom.hu, atol=0.5)
    assert [message for message in caplog.messages if "after their frame" in message] == [
        f"{len(written.paths)} slice(s) hold up to 64 bytes of pixel data after their frame (e.g. "
        f"{written.paths[0]}); ignoring them"]  # once per series


def test_an_enhanced_object_of_one_frame_is_read_as_multi_frame(tmp_path, phantom):
    single = tmp_path / "single"
    write_ct_series(phantom.hu[:1], single)
    enhanced = hd.legacy.LegacyConvertedEnhancedCTImage(
        legacy_datasets=[pydicom.dcmread(p) for p in single.iterdir()], series_instance_uid=pydicom.uid.generate_uid(),
        series_number=3, sop_instance_uid=pydicom.uid.generate_uid(), instance_number=1)
    assert enhanced.NumberOfFrames == 1
    # The converter writes a SpacingBetweenSlices of 1.0 for one frame; a scanner's object states SliceThickness.
    del enhanced.SharedFunctionalGroupsSequence[0].PixelMeasuresSequence[0].SpacingBetweenSlices
    (tmp_path / "multi").mkdir()
    enhanced.save_as(tmp_path / "multi" / "enhanced.dcm")
    series = index_folder(tmp_path / "multi").all_series[0]
    assert series.is_multiframe
    volume, reference = series_to_volume(series), volume_of(single)
    np.testing.assert_array_equal(volume.array, reference.array)
    # Its slice spacing is its SliceThickness, as a one-image series takes it (highdicom's default was 1 mm).
    assert reference.spacing[0] != 1.0
    np.testing.assert_allclose(volume.affine, reference.affine, atol=1e-4)
    np.testing.assert_allclose(multiframe_geometry(enhanced).affine, reference.affine, atol=1e-4)


def test_an_enhanced_object_of_one_frame_without_a_spacing_is_warned_about_once(tmp_path, phantom, caplog):
    single = tmp_path / "single"
    write_ct_series(phantom.hu[:1], single)
    enhanced = hd.legacy.LegacyConvertedEnhancedCTImage(
        legacy_datasets=[pydicom.dcmread(p) for p in single.iterdir()], series_instance_uid=pydicom.uid.generate_uid(),
        series_number=3, sop_instance_uid=pydicom.uid.generate_uid(), instance_number=1)
    measures = enhanced.SharedFunctionalGroupsSequence[0].PixelMeasuresSequence[0]
    for keyword in ("SpacingBetweenSlices", "SliceThickness"):
        if keyword in measures:
            delattr(measures, keyword)
    (tmp_path / "multi").mkdir()
    enhanced.save_as(tmp_path / "multi" / "enhanced.dcm")
    with caplog.at_level(logging.WARNING, logger="medserve.dicom.volume"):
        volume = load_series(select_series(index_folder(tmp_path / "multi"))[0].series).volume
    assert volume.spacing[0] == pytest.approx(1.0)
    # The selection's check of the headers and the volume both place the frame; only the volume's 1 mm is news.
    assert [r.getMessage() for r in caplog.records if "taking 1 mm" in r.getMessage()] == [
        f"{tmp_path / 'multi' / 'enhanced.dcm'}: one frame without SpacingBetweenSlices or SliceThickness; taking 1 mm"]
