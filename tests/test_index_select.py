"""Folder indexing (headers only, skips, errors) and series selection with the stock rules' semantics."""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

import highdicom as hd
import numpy as np
import pydicom
import pydicom.uid
import pytest
from pydicom.fileset import FileSet
from pydicom.uid import ExplicitVRLittleEndian, JPEGLSLossless

from medserve.demo.phantom import make_phantom
from medserve.demo.study import write_ct_series
from medserve.dicom.index import index_folder
from medserve.dicom.select import load_rules, select_series
from medserve.dicom.volume import series_to_volume
from medserve.errors import DicomInputError, SelectionError, VolumeError
from operators.series_selector import as_sdk_selection
from tests.conftest import run_unprivileged


@pytest.fixture
def two_series_study(tmp_path) -> Path:
    """One study: a 16-slice CT and a 3-slice 'scout' in a sub-folder, plus junk and a DICOMDIR."""
    phantom = make_phantom(shape=(16, 24, 24), seed=9)
    main = write_ct_series(phantom.hu, tmp_path / "a" / "b", series_description="Abdomen 3mm")
    write_ct_series(phantom.hu[:3], tmp_path / "scout", study_uid=main.study_uid, series_description="Scout")
    (tmp_path / "notes.txt").write_text("not DICOM")
    (tmp_path / "empty.bin").write_bytes(b"")
    return tmp_path


def test_index_groups_by_study_and_series_and_skips_what_is_not_an_image(two_series_study, caplog):
    with caplog.at_level(logging.WARNING, logger="medserve.dicom.index"):
        index = index_folder(two_series_study)
    assert len(index.studies) == 1
    assert sorted(len(s.instances) for s in index.all_series) == [3, 16]
    skipped = {path.name: reason for path, reason in index.skipped}
    assert skipped == {"notes.txt": "not a DICOM file", "empty.bin": "not a DICOM file"}
    warned = sorted(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert warned == [f"skipping {two_series_study / name}: not a DICOM file" for name in ("empty.bin", "notes.txt")]
    # Headers only: pixel data was not read, but its position is known.
    instance = index.all_series[0].instances[0]
    assert "PixelData" not in instance.dataset
    assert instance.pixel_data_offset is not None


def test_headers_are_parsed_with_the_collector_paused_and_it_runs_again_after(two_series_study, monkeypatch):
    """Header parsing makes no reference cycles; the collector's passes over the process cost up to half its time."""
    import gc

    import medserve.dicom.index as index_module

    collector_on: list[bool] = []
    read_header = index_module.read_header

    def recording(path):
        collector_on.append(gc.isenabled())
        if path.name == "notes.txt":
            raise PermissionError(13, "refused")
        return read_header(path)

    monkeypatch.setattr(index_module, "read_header", recording)
    gc.enable()
    (two_series_study / "notes.txt").unlink()
    assert len(index_folder(two_series_study).all_series) == 2
    assert collector_on and not any(collector_on) and gc.isenabled()
    (two_series_study / "notes.txt").write_text("refused by the recording reader")
    with pytest.raises(DicomInputError, match="notes.txt: cannot be read .refused"):
        index_folder(two_series_study)
    assert gc.isenabled()


def test_dicomdir_is_skipped_and_the_files_it_lists_are_indexed(tmp_path, caplog):
    written = write_ct_series(make_phantom(shape=(3, 8, 8)).hu, tmp_path / "src")
    file_set = FileSet()
    for path in written.paths:
        file_set.add(pydicom.dcmread(path))
    file_set.write(tmp_path / "media")
    with caplog.at_level(logging.WARNING, logger="medserve.dicom.index"):
        index = index_folder(tmp_path / "media")
    assert [len(s.instances) for s in index.all_series] == [3]
    assert [(p.name, "DICOMDIR" in why) for p, why in index.skipped] == [("DICOMDIR", True)]
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        f"skipping {tmp_path / 'media' / 'DICOMDIR'}: DICOMDIR (the folder is scanned directly instead)"]


@pytest.mark.parametrize("transfer_syntax", [ExplicitVRLittleEndian, JPEGLSLossless], ids=["native", "jpeg-ls"])
def test_files_without_the_preamble_are_read_with_or_without_file_meta(tmp_path, transfer_syntax):
    """Archives and old modalities write the dataset without the 128-byte preamble and "DICM", some without the
    file meta (group 0002) too: implicit VR little endian, DICOM's default encoding. Compressed pixels are
    decoded from such a file too (the bare, meta-less case is native only: it has no transfer syntax to say)."""
    from pydicom.filebase import DicomBytesIO
    from pydicom.filewriter import write_dataset

    phantom = make_phantom(shape=(4, 16, 16), seed=2)
    written = write_ct_series(phantom.hu, tmp_path / "study", transfer_syntax=transfer_syntax)
    expected = series_to_volume(select_series(index_folder(tmp_path / "study"))[0].series).array
    meta_first, bare = written.paths[1], written.paths[2]
    meta_first.write_bytes(meta_first.read_bytes()[132:])  # starts with the file meta's (0002,0000)
    if transfer_syntax == ExplicitVRLittleEndian:
        dataset = pydicom.dcmread(bare)
        encoded = DicomBytesIO()
        encoded.is_little_endian, encoded.is_implicit_VR = True, True
        write_dataset(encoded, dataset)  # the dataset alone, from (0008,0005)
        bare.write_bytes(encoded.getvalue())
    index = index_folder(tmp_path / "study")
    assert not index.skipped
    [choice] = select_series(index)
    assert len(choice.series.instances) == 4
    np.testing.assert_array_equal(series_to_volume(choice.series).array, expected)
    [study] = as_sdk_selection([choice])  # what stock operators downstream of our selector read
    assert len(study.selected_series[0].series.get_sop_instances()) == 4


def test_a_file_meta_without_its_transfer_syntax_is_read_as_the_body_is_encoded(tmp_path):
    """The preamble and "DICM", then a file meta that lacks (0002,0010): the body's encoding is the syntax."""
    phantom = make_phantom(shape=(3, 16, 16), seed=3)
    written = write_ct_series(phantom.hu, tmp_path / "study")
    expected = series_to_volume(select_series(index_folder(tmp_path / "study"))[0].series).array
    dataset = pydicom.dcmread(written.paths[1])
    del dataset.file_meta.TransferSyntaxUID
    dataset.save_as(written.paths[1], enforce_file_format=False, implicit_vr=False, little_endian=True)
    np.testing.assert_array_equal(series_to_volume(select_series(index_folder(tmp_path / "study"))[0].series).array,
                                  expected)


@pytest.mark.parametrize("content", [
    np.array([8, 0, 3, 3, 1, 0, 0, 0] * 40, dtype=np.int16).tobytes(),  # a raw int16 volume whose first voxel is 8
    b"\x02\x00" + bytes(510),  # a raw uint8 mask
    b"\x08\x00\x00\x00\x01\x02\x03\x04",  # 8 bytes
    b"\x08\x00\x05\x00\x10\x00\x00\x00" + bytes(range(256)) * 2,  # starts as an implicit-VR element, then junk
], ids=["raw-int16", "raw-mask", "eight-bytes", "element-then-junk"])
def test_binary_files_that_start_like_a_dataset_are_skipped_not_refused(tmp_path, content):
    write_ct_series(make_phantom(shape=(4, 16, 16), seed=2).hu, tmp_path / "ct")
    (tmp_path / "other.raw").write_bytes(content)
    index = index_folder(tmp_path)
    assert [(path.name, reason) for path, reason in index.skipped] == [("other.raw", "not a DICOM file")]
    assert len(index.all_series[0].instances) == 4


def test_one_series_uid_in_two_studies_is_two_series(tmp_path):
    """An archive (or an anonymiser) that reuses a series UID in another study: each study keeps its own series,
    never one volume of both patients."""
    hu = np.zeros((4, 8, 8), dtype=np.float32)
    first = write_ct_series(hu, tmp_path / "a")
    second = write_ct_series(hu, tmp_path / "b")
    for path in second.paths:
        dataset = pydicom.dcmread(path)
        dataset.SeriesInstanceUID = first.series_uid
        dataset.save_as(path)
    index = index_folder(tmp_path)
    assert [(study.study_uid, [(s.series_uid, len(s.instances)) for s in study.series]) for study in index.studies] \
        == [(first.study_uid, [(first.series_uid, 4)]), (second.study_uid, [(first.series_uid, 4)])]
    for study in index.studies:
        assert {instance.dataset.StudyInstanceUID for instance in study.series[0].instances} == {study.study_uid}


@pytest.mark.parametrize(("keyword", "vr", "stored", "shown"), [
    ("NumberOfFrames", "IS", b"abc ", "'abc'"), ("SamplesPerPixel", "US", b"\x01\x00\x00\x00", "[1, 0]")])
def test_an_integer_attribute_that_is_no_whole_number_is_refused_naming_file_and_attribute(tmp_path, keyword, vr,
                                                                                          stored, shown):
    from pydicom.dataelem import RawDataElement
    from pydicom.tag import Tag

    from medserve.dicom.volume import load_series

    written = write_ct_series(np.zeros((3, 8, 8), dtype=np.float32), tmp_path)
    for path in written.paths:  # the stored bytes as a damaged file holds them
        dataset = pydicom.dcmread(path)
        tag = Tag(pydicom.datadict.tag_for_keyword(keyword))
        dataset._dict[tag] = RawDataElement(tag, vr, len(stored), stored, 0, False, True)
        dataset.save_as(path)
    first = sorted(written.paths)[0]
    with pytest.raises(DicomInputError, match=rf"^{re.escape(str(first))}: {keyword} {re.escape(shown)} is not a "
                                              r"whole number; expected one integer value$"):
        load_series(select_series(index_folder(tmp_path))[0].series)


def test_empty_folder_is_refused(tmp_path):
    with pytest.raises(DicomInputError, match="is empty"):
        index_folder(tmp_path)


def test_folder_without_dicom_is_refused_listing_what_was_skipped(tmp_path):
    (tmp_path / "readme.md").write_text("# hello")
    with pytest.raises(DicomInputError, match=r"no DICOM files found.*readme.md: not a DICOM file"):
        index_folder(tmp_path)


def test_images_of_floating_point_pixels_are_skipped_as_such_not_refused_as_truncated(tmp_path, caplog):
    """Float Pixel Data (parametric maps, some MR) was read as a file cut before its pixels: 'corrupt or truncated
    DICOM file: no Pixel Data'."""
    written = write_ct_series(make_phantom(shape=(3, 16, 16)).hu, tmp_path / "float")
    for path in written.paths:
        dataset = pydicom.dcmread(path)
        values = dataset.pixel_array.astype(np.float32)
        del dataset.PixelData
        dataset.BitsAllocated, dataset.BitsStored = 32, 32
        for keyword in ("HighBit", "PixelRepresentation"):
            delattr(dataset, keyword)
        dataset.FloatPixelData = values.tobytes()
        dataset.save_as(path)
    with pytest.raises(DicomInputError, match=r"no DICOM files found .*IM00000\.dcm: CT Image Storage with "
                                              r"floating-point pixel data \(Float Pixel Data\), which is not "
                                              r"supported; expected integer Pixel Data"):
        index_folder(tmp_path / "float")
    write_ct_series(make_phantom(shape=(3, 16, 16)).hu, tmp_path / "float" / "integers")
    assert len(index_folder(tmp_path / "float").all_series[0].instances) == 3
    assert "floating-point pixel data" in caplog.text


def test_missing_folder_is_refused(tmp_path):
    with pytest.raises(DicomInputError, match="does not exist"):
        index_folder(tmp_path / "nowhere")


def test_corrupt_dicom_header_is_refused_naming_the_file(tmp_path):
    written = write_ct_series(make_phantom(shape=(4, 16, 16)).hu, tmp_path)
    victim = written.paths[2]
    victim.write_bytes(victim.read_bytes()[:400])  # cut inside the header
    with pytest.raises(DicomInputError, match=f"{victim.name}: corrupt"):
        index_folder(tmp_path)


def test_thousands_of_other_files_are_logged_by_the_first_twenty_and_a_count(tmp_path, caplog):
    """A CD's 5,000 other files gave 5,000 warnings; the index still lists every one."""
    write_ct_series(make_phantom(shape=(3, 8, 8), seed=1).hu, tmp_path / "study")
    for number in range(25):
        (tmp_path / "study" / f"readme{number:02d}.txt").write_text("not DICOM")
    with caplog.at_level(logging.WARNING, logger="medserve.dicom.index"):
        index = index_folder(tmp_path / "study")
    assert len(index.skipped) == 25
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 21 and warned[0] == f"skipping {tmp_path / 'study' / 'readme00.txt'}: not a DICOM file"
    assert warned[-1] == "skipping 5 more files (not a DICOM file)"


def test_symbolic_links_to_folders_are_followed_once_and_broken_links_skipped(two_series_study, tmp_path_factory):
    linked = tmp_path_factory.mktemp("linked")
    (linked / "study").symlink_to(two_series_study, target_is_directory=True)
    (linked / "again").symlink_to(two_series_study / "a", target_is_directory=True)  # the same folder twice
    (two_series_study / "scout" / "loop").symlink_to(linked, target_is_directory=True)  # a link back up the tree
    (linked / "gone.dcm").symlink_to(linked / "nowhere.dcm")
    index = index_folder(linked)
    assert sorted(len(s.instances) for s in index.all_series) == [3, 16]
    assert (linked / "gone.dcm", "broken symbolic link") in index.skipped


def test_a_folder_that_cannot_be_read_is_refused_naming_it(tmp_path):
    """os.walk skipped it without a word: the study was segmented on the slices it could list, exit 0."""
    written = write_ct_series(make_phantom(shape=(6, 16, 16), seed=1).hu, tmp_path / "study")
    hidden = tmp_path / "study" / "more"
    hidden.mkdir()
    for path in written.paths[3:]:
        path.rename(hidden / path.name)
    hidden.chmod(0)
    try:
        result = run_unprivileged("import sys; from medserve.dicom.index import index_folder; "
                                  "index_folder(sys.argv[1])", tmp_path / "study")
    finally:
        hidden.chmod(0o755)
    assert result.returncode == 1, result.stderr
    assert (f"medserve.errors.DicomInputError: {hidden}: folder cannot be read (Permission denied); expected every "
            "folder of the study to be readable") in result.stderr


def test_an_image_file_cut_before_its_pixels_is_refused_even_alone_in_a_series(tmp_path):
    """Cut inside its SeriesInstanceUID, the last slice became a one-file 'series' of its own that the default
    selection passed over: a 39-slice volume, exit 0, not a word."""
    written = write_ct_series(make_phantom(shape=(6, 16, 16), seed=1).hu, tmp_path / "study")
    victim = written.paths[-1]
    data = victim.read_bytes()
    victim.write_bytes(data[:data.index(written.series_uid.encode()) + 30])
    with pytest.raises(DicomInputError, match=rf"^{re.escape(str(victim))}: corrupt or truncated DICOM file: no "
                                              r"Pixel Data, which every CT Image Storage object holds$"):
        index_folder(tmp_path / "study")


def test_image_without_sop_instance_uid_is_refused_naming_the_file(two_series_study):
    victim = sorted((two_series_study / "scout").iterdir())[1]
    dataset = pydicom.dcmread(victim)
    del dataset.SOPInstanceUID
    dataset.save_as(victim)
    with pytest.raises(DicomInputError, match=rf"^{victim}: SOPInstanceUID is missing"):
        index_folder(two_series_study)


def test_image_without_its_series_uid_is_refused_saying_which_uid(tmp_path):
    victim = write_ct_series(make_phantom(shape=(3, 8, 8), seed=1).hu, tmp_path / "study").paths[1]
    dataset = pydicom.dcmread(victim)
    del dataset.SeriesInstanceUID
    dataset.save_as(victim)
    with pytest.raises(DicomInputError, match=rf"^{re.escape(str(victim))}: corrupt or truncated DICOM file, "
                                              r"or an incomplete object: SeriesInstanceUID missing$"):
        index_folder(tmp_path / "study")


def _object_outside_any_study(sop_class: str) -> pydicom.Dataset:
    dataset = pydicom.Dataset()
    dataset.SOPClassUID, dataset.SOPInstanceUID = sop_class, pydicom.uid.generate_uid()
    dataset.ContentLabel = "PALETTE"
    dataset.file_meta = pydicom.dataset.FileMetaDataset()
    dataset.file_meta.MediaStorageSOPClassUID, dataset.file_meta.MediaStorageSOPInstanceUID = (
        dataset.SOPClassUID, dataset.SOPInstanceUID)
    dataset.file_meta.TransferSyntaxUID = ExplicitVRLittleEndian
    return dataset


def test_objects_outside_any_study_are_skipped_but_an_image_without_uids_is_refused(two_series_study, caplog):
    """A Color Palette or Hanging Protocol has no study or series, as its IOD says: the stock loader skips it. An
    object of an image class without them is damaged, as before."""
    _object_outside_any_study("1.2.840.10008.5.1.4.39.1").save_as(two_series_study / "palette.dcm",
                                                                     enforce_file_format=True)
    with caplog.at_level(logging.WARNING, logger="medserve.dicom.index"):
        index = index_folder(two_series_study)
    assert sorted(len(s.instances) for s in index.all_series) == [3, 16]
    reason = "no StudyInstanceUID/SeriesInstanceUID (Color Palette Storage, not an image)"
    assert (two_series_study / "palette.dcm", reason) in index.skipped
    assert f"skipping {two_series_study / 'palette.dcm'}: {reason}" in caplog.messages
    _object_outside_any_study(pydicom.uid.CTImageStorage).save_as(two_series_study / "cut.dcm",
                                                                  enforce_file_format=True)
    with pytest.raises(DicomInputError, match=r"cut.dcm: corrupt or truncated DICOM file, or an incomplete object: "
                                              r"StudyInstanceUID and SeriesInstanceUID missing$"):
        index_folder(two_series_study)


def test_objects_of_other_classes_within_an_image_series_are_left_out_of_it(two_series_study, caplog):
    """A dose report or a presentation state filed under the CT's SeriesInstanceUID is no slice: it is skipped
    naming its class, and the series still forms its volume (it was refused as 'Rows is missing')."""
    main = pydicom.dcmread(next((two_series_study / "a" / "b").iterdir()))
    report = _object_outside_any_study(pydicom.uid.BasicTextSRStorage)
    report.StudyInstanceUID, report.SeriesInstanceUID, report.Modality = (main.StudyInstanceUID,
                                                                          main.SeriesInstanceUID, "SR")
    report.save_as(two_series_study / "a" / "b" / "report.dcm", enforce_file_format=True)
    with caplog.at_level(logging.WARNING, logger="medserve.dicom.index"):
        index = index_folder(two_series_study)
    reason = "Basic Text SR Storage, not an image"
    assert (two_series_study / "a" / "b" / "report.dcm", reason) in index.skipped
    assert f"skipping {two_series_study / 'a' / 'b' / 'report.dcm'}: {reason}" in caplog.messages
    [choice] = select_series(index)
    assert len(choice.series.instances) == 16
    assert series_to_volume(choice.series).array.shape == (16, 24, 24)
    # Deflated, as SRs often are: the header read cannot see whether it holds pixels, so its class decides.
    report.save_as(two_series_study / "a" / "b" / "report.dcm", enforce_file_format=True)
    deflated = pydicom.dcmread(two_series_study / "a" / "b" / "report.dcm")
    deflated.file_meta.TransferSyntaxUID = pydicom.uid.DeflatedExplicitVRLittleEndian
    deflated.save_as(two_series_study / "a" / "b" / "report.dcm", enforce_file_format=True)
    assert (two_series_study / "a" / "b" / "report.dcm", reason) in index_folder(two_series_study).skipped


def test_default_rules_pick_the_largest_ct_series(two_series_study):
    [choice] = select_series(index_folder(two_series_study))
    assert choice.series.description == "Abdomen 3mm"


def write_repeated_positions_series(folder: Path, study_uid: str, repeats: int = 3) -> str:
    """A DWI-like series: the same 6 slice positions acquired `repeats` times (b-values); its SeriesInstanceUID."""
    first = write_ct_series(make_phantom(shape=(6, 24, 24), seed=3).hu, folder, study_uid=study_uid,
                            series_description="DWI b0/b500/b1000")
    for repeat in range(1, repeats):
        for path in first.paths:
            dataset = pydicom.dcmread(path)
            dataset.SOPInstanceUID = dataset.file_meta.MediaStorageSOPInstanceUID = pydicom.uid.generate_uid()
            dataset.save_as(path.with_name(f"b{repeat}_{path.name}"), enforce_file_format=True)
    return first.series_uid


def test_default_rules_leave_aside_a_larger_series_that_is_no_volume(two_series_study, caplog):
    study_uid = pydicom.dcmread(next((two_series_study / "scout").iterdir())).StudyInstanceUID
    write_repeated_positions_series(two_series_study / "dwi", study_uid, repeats=4)  # 24 instances > 16
    with caplog.at_level(logging.WARNING, logger="medserve.dicom.select"):
        [choice] = select_series(index_folder(two_series_study))
    assert choice.series.description == "Abdomen 3mm"
    [record] = [r for r in caplog.records if "left aside" in r.getMessage()]
    assert len(record.series) == 1 and "duplicated slice" in record.series[0], record.series


def test_default_rules_leave_aside_a_larger_enhanced_object_holding_several_phases(two_series_study, caplog):
    """An Enhanced object's frames are checked as a single-frame series' slices are: two phases at each position
    form no volume, so the valid single-frame CT is taken rather than the run failing on the larger object."""
    study_uid = pydicom.dcmread(next((two_series_study / "scout").iterdir())).StudyInstanceUID
    write_repeated_positions_series(two_series_study / "dwi", study_uid, repeats=3)  # 18 frames > 16 slices
    legacy = [pydicom.dcmread(path) for path in sorted((two_series_study / "dwi").iterdir())]
    shutil.rmtree(two_series_study / "dwi")
    enhanced = hd.legacy.LegacyConvertedEnhancedCTImage(
        legacy_datasets=legacy, series_instance_uid=pydicom.uid.generate_uid(), series_number=7,
        sop_instance_uid=pydicom.uid.generate_uid(), instance_number=1)
    enhanced.save_as(two_series_study / "enhanced.dcm")
    with caplog.at_level(logging.WARNING, logger="medserve.dicom.select"):
        [choice] = select_series(index_folder(two_series_study))
    assert choice.series.description == "Abdomen 3mm"
    [record] = [r for r in caplog.records if "left aside" in r.getMessage()]
    assert "multi-frame image does not form a regular volume" in record.series[0], record.series


def test_default_rules_name_the_series_left_aside_when_none_forms_a_volume(tmp_path):
    study_uid = pydicom.uid.generate_uid()
    series_uid = write_repeated_positions_series(tmp_path / "dwi", study_uid)
    # The only candidate: its own error, naming it as the warning does
    with pytest.raises(VolumeError, match=rf"^series {re.escape(series_uid)} \(Modality=CT, SeriesDescription='DWI "
                                          r"b0/b500/b1000', \d+ instance\(s\)\): duplicated slice at"):
        select_series(index_folder(tmp_path))
    write_repeated_positions_series(tmp_path / "dwi2", study_uid)
    with pytest.raises(SelectionError, match=r"no CT or MR series in .* forms a volume, so none was selected by "
                                             r"default; choose one with selection rules. Left aside:\n  .*DWI "
                                             r"b0/b500/b1000.*: duplicated slice at(.|\n)*\n  .*DWI"):
        select_series(index_folder(tmp_path))


def test_user_rules_keep_a_series_that_is_no_volume_as_the_stock(tmp_path):
    series_uid = write_repeated_positions_series(tmp_path / "dwi", pydicom.uid.generate_uid())
    [choice] = select_series(index_folder(tmp_path), {"selections": [{"name": "ct", "conditions": {"Modality": "CT"}}]})
    assert choice.series.series_uid == series_uid


def test_user_rules_take_the_first_match_in_study_order_as_the_stock(tmp_path):
    """The largest-first order is our default's only: given rules, the stock's first match wins."""
    phantom = make_phantom(shape=(8, 16, 16), seed=3)
    scout = write_ct_series(phantom.hu[:2], tmp_path / "1_scout", series_description="Scout")
    write_ct_series(phantom.hu, tmp_path / "2_main", study_uid=scout.study_uid, series_description="Main")
    index = index_folder(tmp_path)
    assert select_series(index)[0].series.description == "Main"
    rules = {"selections": [{"name": "ct", "conditions": {"Modality": "CT"}}]}
    assert [c.series.description for c in select_series(index, rules)] == ["Scout"]
    by_count = select_series(index, rules, all_matched=True, sort_by_sop_instance_count=True)
    assert [c.series.description for c in by_count] == ["Main", "Scout"]


RULES = {"selections": [{"name": "scout", "conditions": {"SeriesDescription": "(?i)^scout$"}}]}


@pytest.mark.parametrize("conditions,expected", [
    ({"Modality": "ct"}, "Abdomen 3mm"),                             # case-insensitive equality
    ({"SeriesDescription": "(?i)scou"}, "Scout"),                    # regex search
    ({"SliceThickness": [2, 4]}, "Abdomen 3mm"),                     # inclusive numeric range
    ({"SliceThickness": [3, ">="]}, "Abdomen 3mm"),                  # relational
    ({"ImageType": ["PRIMARY", "!SECONDARY"]}, "Abdomen 3mm"),       # multi-value inclusion/exclusion
    ({"ImageOrientationPatient": "Axial"}, "Abdomen 3mm"),           # orientation by slice normal
    ({"SeriesDescription": "Scout", "Modality": None}, "Scout"),     # empty condition ignored
])
def test_conditions_match_like_the_stock_selector(two_series_study, conditions, expected):
    rules = {"selections": [{"name": "x", "conditions": conditions}]}
    assert select_series(index_folder(two_series_study), rules)[0].series.description == expected


def test_several_selections_and_all_matched(two_series_study):
    rules = {"selections": [{"name": "all ct", "conditions": {"Modality": "CT"}}, RULES["selections"][0]]}
    index = index_folder(two_series_study)
    names = [(c.name, c.series.description) for c in select_series(index, rules, all_matched=True)]
    assert ("all ct", "Abdomen 3mm") in names and ("all ct", "Scout") in names and ("scout", "Scout") in names


def test_no_match_lists_what_was_found(two_series_study):
    rules = {"selections": [{"name": "mr", "conditions": {"Modality": "MR"}}]}
    with pytest.raises(SelectionError, match=r"no series .* matches(.|\n)*Abdomen 3mm(.|\n)*Scout"):
        select_series(index_folder(two_series_study), rules)


def test_rules_from_a_file_and_malformed_rules(tmp_path):
    path = tmp_path / "rules.json"
    path.write_text(json.dumps(RULES))
    assert load_rules(str(path)) == RULES
    path.write_text("{not json")
    with pytest.raises(SelectionError, match="rules.json: not valid JSON"):
        load_rules(str(path))
    with pytest.raises(SelectionError, match="expected"):
        load_rules({"rules": []})
    with pytest.raises(SelectionError, match="operator '~'"):  # when loaded, before any series is matched
        load_rules({"selections": [{"conditions": {"SliceThickness": [1, "~"]}}]})
    path.write_bytes(b"\xff\xfe{}")  # UTF-16 from a Windows editor: the user's input, not an internal error
    with pytest.raises(SelectionError, match="rules.json: cannot be read as text"):
        load_rules(str(path))
    with pytest.raises(SelectionError, match=f"rules file {tmp_path} is not a file"):
        load_rules(str(tmp_path))
    with pytest.raises(SelectionError, match="selection rules: .*expected"):  # JSON text that is not an object
        load_rules("[1, 2]")
