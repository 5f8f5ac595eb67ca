"""NIfTI input (the server's other input): the volume the bundle gets, and the label map written in the input's
own geometry, as NIfTI readers that place images in the world (niftilib, ITK) read it."""

from __future__ import annotations

import logging
import shutil
import struct

import nibabel as nib
import numpy as np
import pytest

from medserve.bundle.predictor import BundlePredictor
from medserve.dicom.volume import ras_affine
from medserve.errors import NiftiInputError
from medserve.nifti_input import read_nifti
from medserve.pipeline import run_nifti
from tests.conftest import THRESHOLD_HU

NIFTI_AFFINE = np.array([[-0.8, 0, 0, 100], [0, -0.8, 0, 90], [0, 0, 2.5, -40], [0, 0, 0, 1]])


def test_a_nifti_volume_keeps_its_voxels_and_affine(tmp_path):
    voxels = np.arange(4 * 5 * 6, dtype=np.float32).reshape(4, 5, 6)  # (X, Y, Z)
    nib.save(nib.Nifti1Image(voxels, NIFTI_AFFINE), tmp_path / "ct.nii.gz")
    volume = read_nifti(tmp_path / "ct.nii.gz").volume
    np.testing.assert_array_equal(volume.array, voxels.transpose(2, 1, 0))
    np.testing.assert_allclose(ras_affine(volume), NIFTI_AFFINE)


@pytest.mark.parametrize("image_class,shape", [(nib.Nifti2Image, (4, 5, 6)), (nib.Nifti1Image, (4, 5, 6, 1))],
                         ids=["nifti2", "one-volume-series"])
def test_nifti2_and_a_single_volume_series_are_read(tmp_path, image_class, shape):
    """NIfTI-2 was 'neither DICOM, a zip of DICOM nor NIfTI' to the server; (x, y, z, 1) was refused as 4D."""
    from medserve.server.inputs import sniff

    voxels = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    for name in ("ct.nii", "ct.nii.gz"):
        nib.save(image_class(voxels, NIFTI_AFFINE), tmp_path / name)
        assert sniff(tmp_path / name) == "nifti"
        volume = read_nifti(tmp_path / name).volume
        np.testing.assert_array_equal(volume.array, voxels.reshape(4, 5, 6).transpose(2, 1, 0))
        np.testing.assert_allclose(ras_affine(volume), NIFTI_AFFINE)


@pytest.mark.parametrize("affine", [np.zeros((4, 4)), np.where(np.eye(4) == 1, np.nan, 0.0),
                                    NIFTI_AFFINE + np.array([[0, 0.5, 0, 0], [0] * 4, [0] * 4, [0] * 4])],
                         ids=["zero", "nan", "sheared"])
def test_a_nifti_affine_that_is_no_voxel_grid_is_refused_naming_the_file(tmp_path, affine):
    image = nib.Nifti1Image(np.zeros((4, 5, 6), np.float32), None)
    image.header.set_qform(None, code=0)
    image.header.set_sform(affine, code=2)
    nib.save(image, tmp_path / "bad.nii")
    with pytest.raises(NiftiInputError, match=rf"^{tmp_path / 'bad.nii'}: the sform .* is not a rotation and "
                                              r"scaling of the voxel grid; expected orthogonal axes"):
        read_nifti(tmp_path / "bad.nii")


@pytest.mark.parametrize(("voxels", "expected"), [
    (np.full((4, 5, 6), np.nan, np.float32), "holds NaN or infinite voxels, or values beyond float32's range; "
                                             "expected finite intensities"),
    (np.full((4, 5, 6), 1e39), "holds NaN or infinite voxels, or values beyond float32's range"),  # finite float64
    (np.where(np.arange(120).reshape(4, 5, 6) == 7, np.inf, 0.0), "holds NaN or infinite voxels"),
    (np.zeros((4, 5, 6), np.complex64), r"has complex voxels \(complex64\); expected real numbers"),
    (np.zeros((4, 5, 6, 2), np.float32), "has 4 dimensions; expected a 3D volume"),
    (np.zeros((4, 5, 6), [("R", "u1"), ("G", "u1"), ("B", "u1")]),
     r"has colour voxels \(R, G, B\); expected one intensity per voxel"),  # was numpy's cast error
], ids=["nan", "float64-beyond-float32", "inf", "complex", "4d", "rgb"])
def test_a_nifti_volume_that_is_not_real_finite_3d_is_refused_naming_the_file(tmp_path, voxels, expected):
    nib.save(nib.Nifti1Image(voxels, NIFTI_AFFINE), tmp_path / "odd.nii.gz")
    with pytest.raises(NiftiInputError, match=rf"^{tmp_path / 'odd.nii.gz'}: NIfTI image {expected}"):
        read_nifti(tmp_path / "odd.nii.gz")


def test_a_nifti_header_declaring_more_voxels_than_memory_holds_is_refused_with_their_size(tmp_path):
    """A damaged dim field (32767 cubed, 128 TiB as float32) ended in 'not a readable NIfTI image ()': the
    MemoryError of the allocation has no message."""
    image = nib.Nifti1Image(np.zeros((4, 4, 4), np.float32), NIFTI_AFFINE)
    image.header.set_data_shape((32767, 32767, 32767))
    path = tmp_path / "huge.nii"
    path.write_bytes(image.header.binaryblock + bytes(4) + bytes(256))
    with pytest.raises(NiftiInputError, match=rf"^{path}: NIfTI image of 32767 x 32767 x 32767 voxels needs "
                                              r"131060\.0 GiB as float32, more than can be allocated here$"):
        read_nifti(path)


# ---- geometry as NIfTI readers that place images read it ---------------------------------------------------------

SCANNER = np.array([[-2.0, 0, 0, 30], [0, -2.0, 0, 20], [0, 0, 2.0, -10], [0, 0, 0, 1]])  # LPS-stored, 2 mm


def _hu() -> np.ndarray:
    """(X, Y, Z) intensities with a block above the threshold bundle's threshold."""
    hu = np.full((12, 10, 6), -50.0, np.float32)
    hu[3:9, 2:7, 1:4] = 300.0
    return hu


def _coded(image: nib.Nifti1Image, sform: tuple[np.ndarray, int], qform: tuple[np.ndarray, int],
           units: str = "mm") -> nib.Nifti1Image:
    image.header.set_sform(*sform)
    image.header.set_qform(*qform)
    image.header.set_xyzt_units(units)
    return image


@pytest.fixture(scope="module")
def threshold_predictor(tmp_path_factory):
    from tests.conftest import make_threshold_bundle

    return BundlePredictor.from_dir(make_threshold_bundle(tmp_path_factory.mktemp("nifti") / "thr"), device="cpu")


@pytest.mark.parametrize(("image_class", "sform", "qform", "units"), [
    (nib.Nifti1Image, (SCANNER, 1), (SCANNER, 1), "mm"),
    (nib.Nifti1Image, (SCANNER, 4), (None, 0), "mm"),  # MNI: was written back as scanner space (code 1)
    (nib.Nifti1Image, (np.diag([1e-3, 1e-3, 1e-3, 1]) @ SCANNER, 1), (None, 0), "meter"),  # was read as 0.002 mm
    (nib.Nifti2Image, (SCANNER, 2), (SCANNER, 1), "mm"),  # was written as NIfTI-1
], ids=["scanner", "mni", "metres", "nifti2"])
def test_the_label_map_has_the_input_header_geometry(tmp_path, threshold_predictor, image_class, sform, qform,
                                                      units):
    hu = _hu()
    nib.save(_coded(image_class(hu, None), sform, qform, units), tmp_path / "ct.nii.gz")
    source = nib.load(tmp_path / "ct.nii.gz").header
    result = run_nifti(tmp_path / "ct.nii.gz", threshold_predictor, tmp_path / "out")
    written = nib.load(result.nifti_path)
    assert type(written.header) is type(source)
    for field in ("sform_code", "qform_code", "srow_x", "srow_y", "srow_z", "quatern_b", "quatern_c", "quatern_d",
                  "qoffset_x", "qoffset_y", "qoffset_z"):
        np.testing.assert_array_equal(written.header[field], source[field], err_msg=field)
    np.testing.assert_array_equal(written.header["pixdim"][:4], source["pixdim"][:4])
    assert written.header.get_xyzt_units()[0] == units
    np.testing.assert_array_equal(np.asarray(written.dataobj), hu > THRESHOLD_HU)


@pytest.mark.parametrize("codes", [(0, 0), (-1, 0)])
def test_an_image_that_states_no_orientation_is_refused(tmp_path, codes):
    """nibabel's guess for codes 0 flips x: the label map came back as scanner space, mirrored in ITK readers."""
    image = _coded(nib.Nifti1Image(_hu(), None), (SCANNER, 0), (SCANNER, 0))
    image.header["sform_code"], image.header["qform_code"] = codes
    nib.save(image, tmp_path / "bare.nii")
    with pytest.raises(NiftiInputError, match=rf"^{tmp_path / 'bare.nii'}: NIfTI header states no orientation "
                                              rf"\(sform_code {codes[0]}, qform_code {codes[1]}\); expected a "):
        read_nifti(tmp_path / "bare.nii")


def test_the_qform_is_read_with_its_qfac_and_a_bad_quaternion_is_named(tmp_path):
    image = _coded(nib.Nifti1Image(_hu(), None), (None, 0), (SCANNER, 1))
    image.header["pixdim"][0] = -1.0  # qfac: the slice axis runs the other way
    nib.save(image, tmp_path / "flipped.nii")
    np.testing.assert_allclose(ras_affine(read_nifti(tmp_path / "flipped.nii").volume)[:3, 2], [0, 0, -2.0])
    image.header["quatern_b"] = image.header["quatern_c"] = 0.9  # b, c, d beyond a unit quaternion
    nib.save(image, tmp_path / "bad.nii")
    with pytest.raises(NiftiInputError, match=r"bad.nii: the qform's quaternion is not a rotation \(w2 should be "):
        read_nifti(tmp_path / "bad.nii")  # was nibabel's own words from its loader, naming no qform


def test_a_coded_sform_wins_over_a_different_coded_qform(tmp_path):
    nib.save(_coded(nib.Nifti1Image(_hu(), None), (SCANNER, 2), (np.diag([1.0, 1, 1, 1]), 1)), tmp_path / "two.nii")
    np.testing.assert_allclose(ras_affine(read_nifti(tmp_path / "two.nii").volume), SCANNER)


@pytest.mark.parametrize("size", [0.0, -2.0])
def test_a_qform_with_a_voxel_size_at_or_below_zero_is_refused(tmp_path, size):
    """nibabel makes such a size 1 mm (or its absolute value) with a log line; niftilib and ITK take 1 mm."""
    nib.save(_coded(nib.Nifti1Image(_hu(), None), (SCANNER, 0), (SCANNER, 1)), tmp_path / "q.nii")
    written = bytearray((tmp_path / "q.nii").read_bytes())
    struct.pack_into("<f", written, 80, size)  # pixdim[1]
    (tmp_path / "q.nii").write_bytes(written)
    with pytest.raises(NiftiInputError, match=rf"the qform's voxel sizes \(pixdim\[1..3\]\) are \[{size}, 2.0, 2.0\]; "
                                              r"expected positive numbers"):
        read_nifti(tmp_path / "q.nii")


def test_a_nearly_orthogonal_sform_is_squared_for_the_bundle_and_kept_in_the_label_map(tmp_path,
                                                                                        threshold_predictor):
    """dcm2niix writes an oblique series' directions rounded (4e-4 from orthogonal): it was refused."""
    a, b = np.radians(20), np.radians(10)
    rotation = np.array([[np.cos(a), -np.sin(a), 0], [np.sin(a), np.cos(a), 0], [0, 0, 1]]) @ np.array(
        [[1, 0, 0], [0, np.cos(b), -np.sin(b)], [0, np.sin(b), np.cos(b)]])
    rounded = np.round(rotation, 3)
    rounded /= np.linalg.norm(rounded, axis=0)
    assert np.abs(rounded.T @ rounded - np.eye(3)).max() > 1e-4  # beyond what highdicom's Volume accepts
    sform = np.eye(4)
    sform[:3, :3] = rounded * 2.0
    nib.save(_coded(nib.Nifti1Image(_hu(), None), (sform, 1), (None, 0)), tmp_path / "oblique.nii.gz")
    source = read_nifti(tmp_path / "oblique.nii.gz")
    directions = ras_affine(source.volume)[:3, :3] / 2.0
    np.testing.assert_allclose(directions.T @ directions, np.eye(3), atol=1e-12)
    np.testing.assert_allclose(ras_affine(source.volume), sform, atol=2e-3)
    result = run_nifti(tmp_path / "oblique.nii.gz", threshold_predictor, tmp_path / "out")
    np.testing.assert_array_equal(nib.load(result.nifti_path).header.get_sform(), sform.astype(np.float32))


def test_a_sheared_sform_beside_a_good_qform_falls_back_to_the_qform(tmp_path, caplog):
    sheared = SCANNER + np.array([[0, 0.5, 0, 0], [0] * 4, [0] * 4, [0] * 4])
    nib.save(_coded(nib.Nifti1Image(_hu(), None), (sheared, 1), (SCANNER, 1)), tmp_path / "ct.nii")
    with caplog.at_level(logging.WARNING, logger="medserve.nifti_input"):
        volume = read_nifti(tmp_path / "ct.nii").volume
    np.testing.assert_allclose(ras_affine(volume), SCANNER)
    assert [r.getMessage() for r in caplog.records] == [
        f"{tmp_path / 'ct.nii'}: the sform {sheared.tolist()} is not a rotation and scaling of the voxel grid; "
        "expected orthogonal axes with non-zero spacings; using the qform (code 1)"]


def test_other_files_are_refused_naming_what_they_are(tmp_path):
    nib.save(nib.Nifti1Pair(_hu(), SCANNER), tmp_path / "pair.hdr")
    shutil.copy(tmp_path / "pair.hdr", tmp_path / "pair.nii")  # a header whose voxels are in pair.img
    with pytest.raises(NiftiInputError, match=r"pair.nii: a NIfTI header of a .hdr/.img pair, whose voxels are in "
                                              r"a separate file; expected a single-file .nii or .nii.gz"):
        read_nifti(tmp_path / "pair.nii")
    nib.save(nib.Nifti1Image(np.zeros((12, 10, 0), np.float32), SCANNER), tmp_path / "empty.nii.gz")
    with pytest.raises(NiftiInputError, match=r"empty.nii.gz: NIfTI image of 12 x 10 x 0 voxels holds no voxels$"):
        read_nifti(tmp_path / "empty.nii.gz")  # was 422 inference_failed from the bundle's Spacingd
    (tmp_path / "cut.nii.gz").write_bytes((tmp_path / "empty.nii.gz").read_bytes()[:40])
    with pytest.raises(NiftiInputError, match=r"cut.nii.gz: not a readable NIfTI image \([^\n]*\)$"):
        read_nifti(tmp_path / "cut.nii.gz")  # nibabel's text, on one line


def test_a_label_map_too_long_for_nifti1_is_written_as_nifti2(tmp_path):
    """dim[] is int16 in NIfTI-1: the write failed (500) after inference had run."""
    import highdicom as hd

    from medserve.writers.nifti import write_nifti

    volume = hd.Volume(array=np.zeros((1, 2, 33000), np.float32), affine=np.eye(4), coordinate_system="PATIENT")
    label_map = np.zeros((1, 2, 33000), np.uint16)
    label_map[0, 1, 32999] = 3
    written = nib.load(write_nifti(label_map, volume, tmp_path / "long.nii.gz"))
    assert isinstance(written, nib.Nifti2Image)
    np.testing.assert_array_equal(np.asarray(written.dataobj).transpose(2, 1, 0), label_map)
