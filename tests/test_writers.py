"""DICOM SEG and NIfTI writers: valid per dciodvfy, read back to the same label map, right geometry."""

from __future__ import annotations

import logging
import time
import re
import subprocess
import sys
from pathlib import Path

import highdicom as hd
import highdicom._standard_utils as standard_utils
import nibabel as nib
import numpy as np
import pydicom
import pytest

from medserve.demo.phantom import make_phantom
from medserve.demo.study import Patient, SeriesGeometry, write_ct_series
from medserve.dicom.index import index_folder
from medserve.dicom.volume import load_series
from medserve.errors import DicomInputError, OutputError
from medserve.writers.files import atomic_output
from medserve.writers.labels import label_array
from medserve.writers import seg as seg_module
from medserve.writers.nifti import write_nifti
from medserve.writers.seg import Algorithm, build_seg, segment_concept, segment_descriptions, write_seg
from tests.conftest import dciodvfy_errors

LABELS = {1: "spleen", 2: "Right Kidney", 3: "inferior_vena_cava", 4: "tumour core", 5: "tumour"}


def study(folder: Path, patient: Patient = Patient(), geometry: SeriesGeometry = SeriesGeometry()):
    phantom = make_phantom(shape=(16, 32, 32), seed=4)
    write_ct_series(phantom.hu, folder, geometry, patient=patient, file_order_seed=1)
    loaded = load_series(index_folder(folder).all_series[0])
    return loaded.series, loaded


def multi_label(loaded) -> np.ndarray:
    label_map = np.zeros(loaded.volume.array.shape, dtype=np.uint16)
    label_map[2:6, 4:12, 4:12] = 1
    label_map[8:10, 20:28, 6:9] = 2
    label_map[12, 10:20, 10:20] = 4  # label 3 is absent: an empty segment
    label_map[14, 2:8, 20:26] = 5
    return label_map


def write(tmp_path: Path, series, loaded, label_map) -> Path:
    seg = build_seg(label_map, loaded.source_datasets, LABELS, Algorithm("demo_organ_seg", "0.1.0"))
    return write_seg(seg, tmp_path / "seg.dcm")


@pytest.mark.parametrize("orientation", [(1, 0, 0, 0, 1, 0), (0, 1, 0, 0, 0, -1)])
def test_seg_is_valid_and_reads_back_to_the_label_map(tmp_path, orientation):
    series, volume = study(tmp_path / "study", geometry=SeriesGeometry(orientation=orientation))
    label_map = multi_label(volume)
    path = write(tmp_path, series, volume, label_map)
    assert dciodvfy_errors(path) == []
    seg = hd.seg.segread(path)
    back = seg.get_volume(combine_segments=True, relabel=False).match_geometry(volume.volume)
    np.testing.assert_array_equal(back.array, label_map)


def test_seg_references_the_source_series_and_omits_empty_frames(tmp_path):
    series, volume = study(tmp_path / "study")
    label_map = multi_label(volume)
    seg = pydicom.dcmread(write(tmp_path, series, volume, label_map))
    referenced = seg.ReferencedSeriesSequence[0]
    assert referenced.SeriesInstanceUID == series.series_uid
    assert {item.ReferencedSOPInstanceUID for item in referenced.ReferencedInstanceSequence} == {
        instance.dataset.SOPInstanceUID for instance in series.instances}
    non_empty_frames = sum(int(np.any(label_map[k] == n)) for k in range(label_map.shape[0]) for n in LABELS)
    assert seg.NumberOfFrames == non_empty_frames
    assert seg.StudyInstanceUID == series.study_uid
    assert seg.PatientID == series.header.PatientID


def test_segments_carry_names_and_coded_anatomy(tmp_path):
    series, volume = study(tmp_path / "study")
    seg = hd.seg.segread(write(tmp_path, series, volume, multi_label(volume)))
    descriptions = {d.segment_number: d for d in seg.SegmentSequence}
    assert [descriptions[n].SegmentLabel for n in sorted(descriptions)] == list(LABELS.values())
    assert descriptions[1].SegmentedPropertyTypeCodeSequence[0].CodeValue == "78961009"  # Spleen
    assert descriptions[2].SegmentedPropertyTypeCodeSequence[0].CodeMeaning == "Kidney"
    assert descriptions[3].SegmentedPropertyTypeCodeSequence[0].CodeMeaning == "Inferior vena cava"
    assert descriptions[4].SegmentedPropertyTypeCodeSequence[0].CodeMeaning == "Tissue"  # not a known concept
    assert descriptions[5].SegmentedPropertyCategoryCodeSequence[0].CodeValue == "49755003"  # Morph. abnormal
    assert descriptions[5].SegmentedPropertyTypeCodeSequence[0].CodeValue == "108369006"  # Neoplasm


def test_left_and_right_structures_differ_by_a_laterality_modifier(tmp_path):
    series, volume = study(tmp_path / "study")
    label_map = multi_label(volume)
    labels = {1: "kidney_left", 2: "Right Kidney", 4: "left atrium", 5: "spleen"}
    path = write_seg(build_seg(label_map, volume.source_datasets, labels, Algorithm("algo", "1")),
                     tmp_path / "seg.dcm")
    assert dciodvfy_errors(path) == []
    types = {d.SegmentNumber: d.SegmentedPropertyTypeCodeSequence[0] for d in pydicom.dcmread(path).SegmentSequence}

    def modifiers(number):
        found = types[number].get("SegmentedPropertyTypeModifierCodeSequence", [])
        return [(modifier.CodeValue, modifier.CodeMeaning) for modifier in found]

    assert types[1].CodeValue == types[2].CodeValue == "64033007"  # Kidney, both
    assert modifiers(1) == [("7771000", "Left")] and modifiers(2) == [("24028007", "Right")]
    assert types[4].CodeValue == "82471001" and modifiers(4) == []  # Left atrium is its own structure
    assert modifiers(5) == []


def test_seg_works_when_the_source_lacks_optional_patient_attributes(tmp_path):
    series, volume = study(tmp_path / "study", patient=Patient(birth_date=None, sex=None))
    assert "PatientBirthDate" not in series.header and "PatientSex" not in series.header
    path = write(tmp_path, series, volume, multi_label(volume))
    assert dciodvfy_errors(path) == []


def _edited_study(folder: Path, edit) -> tuple:
    phantom = make_phantom(shape=(8, 24, 24), seed=4)
    for path in write_ct_series(phantom.hu, folder).paths:
        dataset = pydicom.dcmread(path)
        edit(dataset)
        dataset.save_as(path)
    loaded = load_series(index_folder(folder).all_series[0])
    return loaded, multi_label_small(loaded)


def multi_label_small(loaded) -> np.ndarray:
    label_map = np.zeros(loaded.volume.array.shape, dtype=np.uint16)
    label_map[1:4, 4:12, 4:12], label_map[5, 14:20, 14:20] = 1, 2
    return label_map


def _set(**values):
    def edit(dataset: pydicom.Dataset) -> None:
        for keyword, value in values.items():
            if value is None:
                delattr(dataset, keyword)
            else:
                setattr(dataset, keyword, value)
    return edit


@pytest.mark.parametrize(("edit", "expected"), [
    (_set(PatientSex="U"), {"PatientSex": ""}),
    (_set(PatientBirthDate="1970-01-01", StudyTime="09:30:00"), {"PatientBirthDate": "", "StudyTime": ""}),
    (_set(SpecificCharacterSet=""), {"SpecificCharacterSet": "ISO_IR 192"}),
    (_set(SpecificCharacterSet=["", "ISO 2022 IR 87"], PatientName="Yamada^Tarou=山田^太郎"),
     {"SpecificCharacterSet": "ISO_IR 192", "PatientName": "Yamada^Tarou=山田^太郎"}),
    (_set(SpecificCharacterSet="ISO_IR 6"), {"SpecificCharacterSet": "ISO_IR 192"}),
    (_set(SliceThickness=None), {"PixelMeasuresSequence": SeriesGeometry().slice_spacing}),
    (_set(StudyDate="2024.01.01", PatientAge="45", StudyID="S" * 17, AccessionNumber="A" * 17, PatientID="p" * 65),
     {"StudyDate": "", "PatientAge": "", "StudyID": "", "AccessionNumber": "", "PatientID": ""}),
    (_set(PatientName="N" * 65 + "^John", StudyDescription="d" * 65, PatientWeight="70.1234567890123456"),
     {"PatientName": "", "StudyDescription": "", "PatientWeight": ""}),
    (_set(StudyDescription=["A", "B"], ReferringPhysicianName="A^B^C^D^E^F", AdmittingDiagnosesDescription="a\tb",
          PatientComments="two\nlines"),
     {"StudyDescription": "", "ReferringPhysicianName": "", "AdmittingDiagnosesDescription": "",
      "PatientComments": "two\nlines"}),
], ids=["sex-U", "iso-date-and-time", "empty-charset", "japanese-code-extensions", "iso-ir-6", "no-slice-thickness",
        "acr-nema-date-age-and-long-ids", "long-name-description-and-weight", "multiplicity-components-controls"])
# pydicom, as the test writes the invalid source values
@pytest.mark.filterwarnings("ignore:Invalid value for VR", "ignore:The value length", "ignore:The PN component length")
def test_seg_survives_headers_seen_in_the_wild(tmp_path, edit, expected):
    """Values PACS and anonymisers write every day but highdicom refuses to copy: the SEG is written (values
    DICOM does not allow are left empty, the character set becomes UTF-8) and reads back to the label map."""
    loaded, label_map = _edited_study(tmp_path / "study", edit)
    before = [(element.keyword, element.value) for element in loaded.source_datasets[0]]
    path = write_seg(build_seg(label_map, loaded.source_datasets, {1: "spleen", 2: "liver"}, Algorithm("a", "1")),
                     tmp_path / "seg.dcm")
    assert [(element.keyword, element.value) for element in loaded.source_datasets[0]] == before  # caller's header
    assert dciodvfy_errors(path) == []
    back = pydicom.dcmread(path)
    for keyword, value in expected.items():
        if keyword == "PixelMeasuresSequence":  # the spacing between the images stands in for the thickness
            measures = back.SharedFunctionalGroupsSequence[0].PixelMeasuresSequence[0]
            assert float(measures.SliceThickness) == pytest.approx(value)
        else:
            assert str(back[keyword].value or "") == value, keyword  # an empty number reads back as None
    volume = hd.seg.segread(path).get_volume(combine_segments=True, relabel=False).match_geometry(loaded.volume)
    np.testing.assert_array_equal(volume.array, label_map)


def _slice_thickness_written_as(text: bytes):
    """An edit that stores `text` as SliceThickness bytes as they are: pydicom refuses to hold 'abc' as a DS."""
    def edit(dataset: pydicom.Dataset) -> None:
        dataset[0x00180050] = pydicom.dataelem.RawDataElement(
            pydicom.tag.Tag(0x00180050), "DS", len(text), text, 0, False, True)
    return edit


@pytest.mark.parametrize("text", [b"abc ", b"3\\3 ", b"nan ", b"0 ", b"-2"])
@pytest.mark.filterwarnings("ignore:Invalid value for VR")
def test_a_slice_thickness_that_is_not_one_positive_number_becomes_the_spacing_with_a_warning(tmp_path, text,
                                                                                             caplog):
    """highdicom cannot copy 'abc', '3\\3' or 'nan' (it stopped the app after the inference had run) and dciodvfy
    refuses 0: the SEG states the spacing between the images, as for an absent thickness."""
    loaded, label_map = _edited_study(tmp_path / "study", _slice_thickness_written_as(text))
    first = loaded.source_datasets[0].filename
    path = write_seg(build_seg(label_map, loaded.source_datasets, {1: "spleen", 2: "liver"}, Algorithm("a", "1")),
                     tmp_path / "seg.dcm")
    assert dciodvfy_errors(path) == []
    measures = pydicom.dcmread(path).SharedFunctionalGroupsSequence[0].PixelMeasuresSequence[0]
    assert float(measures.SliceThickness) == pytest.approx(SeriesGeometry().slice_spacing)
    assert [record.getMessage() for record in caplog.records if "SliceThickness" in record.getMessage()] == [
        f"{first}: SliceThickness {text.decode().strip()!r} is not one positive number of mm; the SEG states the "
        f"spacing between the images instead"]
    volume = hd.seg.segread(path).get_volume(combine_segments=True, relabel=False).match_geometry(loaded.volume)
    np.testing.assert_array_equal(volume.array, label_map)


@pytest.mark.parametrize(("header", "expected"), [
    ({"SliceThickness": None, "SpacingBetweenSlices": "3.5"}, 3.5),
    ({"SliceThickness": None}, 1.0),
    ({"SliceThickness": "2.0"}, 2.0),
], ids=["spacing-between-slices", "nothing-stated", "slice-thickness-only"])
def test_a_single_image_s_seg_states_the_spacing_its_volume_has(tmp_path, header, expected, caplog):
    """One image: the volume takes SpacingBetweenSlices, else SliceThickness, else 1 mm (with a warning), and the
    SEG's pixel measures state the same thickness and spacing. Without a thickness highdicom stopped with an
    AttributeError after the inference had run; without SpacingBetweenSlices it stated 1 mm. The warning is given
    once, not again by the SEG writer."""
    [path] = write_ct_series(make_phantom(shape=(1, 24, 24), seed=4).hu, tmp_path / "study").paths
    dataset = pydicom.dcmread(path)
    _set(**header)(dataset)
    dataset.save_as(path)
    loaded = load_series(index_folder(tmp_path / "study").all_series[0])
    assert np.linalg.norm(loaded.volume.affine[:3, 0]) == pytest.approx(expected)
    label_map = np.zeros(loaded.volume.array.shape, dtype=np.uint16)
    label_map[0, 4:12, 4:12] = 1
    seg_path = write_seg(build_seg(label_map, loaded.source_datasets, {1: "spleen"}, Algorithm("a", "1")),
                         tmp_path / "seg.dcm")
    assert dciodvfy_errors(seg_path) == []
    measures = pydicom.dcmread(seg_path).SharedFunctionalGroupsSequence[0].PixelMeasuresSequence[0]
    assert (float(measures.SliceThickness), float(measures.SpacingBetweenSlices)) == pytest.approx((expected,) * 2)
    warnings = [r for r in caplog.records if "taking 1 mm" in r.getMessage()]
    assert len(warnings) == (1 if expected == 1.0 else 0)  # said by the volume; the SEG states what the volume took


@pytest.mark.filterwarnings("ignore:Invalid value for VR")
def test_source_datasets_built_in_memory_without_file_meta_are_mended_too(tmp_path):
    """Datasets a caller assembled in memory (no file meta) whose first needs mending: the mended copy has no file
    meta to carry over either."""
    loaded, label_map = _edited_study(tmp_path / "study", _set(PatientSex="U"))
    in_memory = []
    for source in loaded.source_datasets:
        dataset = pydicom.Dataset()
        for element in source:
            dataset.add(element)
        in_memory.append(dataset)
    seg = build_seg(label_map, in_memory, {1: "spleen", 2: "liver"}, Algorithm("a", "1"))
    assert not seg.PatientSex  # "U" is not a DICOM value: written empty
    assert dciodvfy_errors(write_seg(seg, tmp_path / "seg.dcm")) == []


@pytest.mark.parametrize("keyword", ["FrameOfReferenceUID", "SOPClassUID"])
def test_seg_without_what_it_must_refer_to_is_refused_naming_the_file(tmp_path, keyword):
    loaded, label_map = _edited_study(tmp_path / "study", _set(**{keyword: None}))
    first = Path(loaded.source_datasets[0].filename)
    with pytest.raises(DicomInputError, match=f"{first.name}: {keyword} is missing; a DICOM SEG must refer"):
        build_seg(label_map, loaded.source_datasets, {1: "spleen"}, Algorithm("a", "1"))


def _drop_sop_class(dataset):
    del dataset.SOPClassUID


@pytest.mark.parametrize(("edit", "message"), [
    (_drop_sop_class, r"SOPClassUID is missing; a DICOM SEG must refer to its source images by it"),
    (_set(SOPClassUID="1.2.3.4"), r"SOPClassUID 1\.2\.3\.4 is not a standard DICOM storage class; a DICOM SEG can "
                                  r"refer only to images of one \(CT Image Storage, \.\.\.\)"),
    (_set(SOPClassUID=pydicom.uid.SegmentationStorage), r"SOPClassUID 1\.2\.840\.10008\.5\.1\.4\.1\.1\.66\.4 "
                                                       r"\(Segmentation Storage\) is a multi-frame class, but the "
                                                       r"series has 8 images; expected single-frame images"),
], ids=["missing", "unknown", "multi-frame-class"])
def test_a_source_image_of_no_class_a_seg_can_refer_to_is_refused_naming_it(tmp_path, edit, message):
    """On any slice, not only the first: highdicom raised AttributeError, KeyError or a ValueError about
    multi-frame images (exit 1, after the whole inference)."""
    loaded, label_map = _edited_study(tmp_path / "study", lambda dataset: None)
    victim = loaded.source_datasets[3]
    edit(victim)
    with pytest.raises(DicomInputError, match=rf"^{re.escape(victim.filename)}: {message}"):
        build_seg(label_map, loaded.source_datasets, {1: "spleen"}, Algorithm("a", "1"))


def test_long_names_backslashes_and_control_characters_become_valid_single_values(tmp_path):
    series, volume = study(tmp_path / "study")
    long_name, long_version = "bundle_" + "x" * 70, "1." * 40
    seg = build_seg(multi_label(volume), volume.source_datasets, {1: "core\\rim", 2: "y" * 80, 3: "left\tlobe\n"},
                    Algorithm(long_name, long_version))
    path = write_seg(seg, tmp_path / "seg.dcm")
    assert dciodvfy_errors(path) == []
    back = hd.seg.segread(path)
    assert [d.SegmentLabel for d in back.SegmentSequence][:3] == ["core/rim", "y" * 64, "left lobe"]
    algorithm = back.SegmentSequence[0].SegmentationAlgorithmIdentificationSequence[0]
    assert (algorithm.AlgorithmName, algorithm.AlgorithmVersion) == (long_name[:64], long_version[:64])


@pytest.mark.parametrize("labels,character_set", [({1: "Rétine", 2: "肝臓"}, "ISO_IR 192"),
                                                  ({1: "Rétine", 2: "spleen"}, "ISO_IR 100")],
                         ids=["beyond-latin-1", "latin-1"])
def test_names_the_source_character_set_cannot_hold_make_the_seg_utf8(tmp_path, labels, character_set):
    phantom = make_phantom(shape=(4, 16, 16), seed=4)
    written = write_ct_series(phantom.hu, tmp_path / "study")
    for path in written.paths:
        dataset = pydicom.dcmread(path)
        dataset.SpecificCharacterSet, dataset.PatientName = "ISO_IR 100", "Müller^Jürgen"
        dataset.save_as(path)
    loaded = load_series(index_folder(tmp_path / "study").all_series[0])
    label_map = np.zeros(loaded.volume.array.shape, np.uint16)
    label_map[1, 2:6, 2:6], label_map[2, 8:12, 8:12] = 1, 2
    path = write_seg(build_seg(label_map, loaded.source_datasets, labels, Algorithm("algo", "1")),
                     tmp_path / "seg.dcm")
    assert dciodvfy_errors(path) == []
    back = pydicom.dcmread(path)
    assert back.SpecificCharacterSet == character_set
    assert [d.SegmentLabel for d in back.SegmentSequence] == list(labels.values())
    assert back.PatientName == "Müller^Jürgen"


ANATOMY, ABNORMAL, OBJECT, TISSUE = ("91723000", "49755003", "260787004", "85756007")  # CID 7150 categories


@pytest.mark.parametrize(("label", "category", "kind"), [
    ("spleen", ANATOMY, ("SCT", "78961009")),  # CID 7192
    ("liver", ANATOMY, ("SCT", "10200004")),
    ("Right Kidney", ANATOMY, ("SCT", "64033007")),  # laterality dropped: Kidney
    ("kidney_left", ANATOMY, ("SCT", "64033007")),
    ("left atrium", ANATOMY, ("SCT", "82471001")),  # a structure of its own, not "Atrium"
    ("inferior_vena_cava", ANATOMY, ("SCT", "64131007")),
    ("urinary_bladder", ANATOMY, ("SCT", "89837001")),  # SNOMED's "Urinary bladder structure": CID 7192 Bladder
    ("tumor", ABNORMAL, ("SCT", "108369006")),  # CID 7194 Neoplasm
    ("tumour", ABNORMAL, ("SCT", "108369006")),
    ("lesion", ABNORMAL, ("SCT", "52988006")),
    ("edema", ABNORMAL, ("SCT", "79654002")),
    ("oedema", ABNORMAL, ("SCT", "79654002")),
    ("necrosis", ABNORMAL, ("SCT", "6574001")),
    ("catheter", OBJECT, ("SCT", "19923001")),  # CID 7193
    ("central line", OBJECT, ("DCM", "112174")),
    ("adipose tissue", TISSUE, ("SCT", "55603005")),  # CID 7191 Fat
    ("fat", TISSUE, ("SCT", "55603005")),  # by the code's meaning
    ("bone", TISSUE, ("SCT", "3138006")),  # CID 7191 keys it BoneTissue, means Bone
    ("muscle", TISSUE, ("SCT", "91727004")),
    ("background-ish nonsense", TISSUE, ("SCT", "85756007")),  # not a known concept: the generic one
    ("tumour core", TISSUE, ("SCT", "85756007")),
    ("label 7", TISSUE, ("SCT", "85756007")),
    # wholeBody_ct_segmentation's names: words in any order, Latin/plural/lay words, numbers, an organ's part
    ("vertebrae_L1", ANATOMY, ("SCT", "66794005")),  # L1 vertebra
    ("lung_middle_lobe_right", ANATOMY, ("SCT", "72481006")),  # Middle lobe of right lung
    ("lung_lower_lobe_left", ANATOMY, ("SCT", "90572001")),  # Lower lobe of lung (modified Left)
    ("heart_atrium_left", ANATOMY, ("SCT", "82471001")),  # Left atrium
    ("small_bowel", ANATOMY, ("SCT", "30315005")),  # Small intestine
    ("clavicula_right", ANATOMY, ("SCT", "51299004")),  # Clavicle
    ("iliac_vena_left", ANATOMY, ("SCT", "244411005")),  # Iliac vein
    ("rib_left_3", ANATOMY, ("SCT", "113197003")),  # Rib
    ("gluteus_maximus_left", TISSUE, ("SCT", "85756007")),  # no such concept in the groups
    # A part or finding named with its organ is not the organ, nor a body region of the part's name
    ("tumor_liver", TISSUE, ("SCT", "85756007")),
    ("stent_aorta", TISSUE, ("SCT", "85756007")),
    ("necrosis_tumor", TISSUE, ("SCT", "85756007")),
    ("pancreas_head", TISSUE, ("SCT", "85756007")),
    ("head_of_pancreas", TISSUE, ("SCT", "85756007")),
    ("kidney_pelvis_left", TISSUE, ("SCT", "85756007")),
])
def test_segment_concept_comes_from_the_segmentation_context_groups(label, category, kind):
    found_category, found_kind = segment_concept(label)
    assert (found_category.scheme_designator, found_category.value) == ("SCT", category)
    assert (found_kind.scheme_designator, found_kind.value) == kind


@pytest.mark.parametrize(("label", "modifier"), [
    ("rib_left_3", "Left"), ("lung_upper_lobe_right", "Right"), ("iliac_vena_left", "Left"),
    ("heart_atrium_left", None), ("lung_middle_lobe_right", None), ("vertebrae_T12", None),
])
def test_a_side_beyond_the_coded_structure_is_its_modifier(label, modifier):
    description, = segment_descriptions({1: label}, [1], Algorithm("algo", "1"))
    found = description.SegmentedPropertyTypeCodeSequence[0].get("SegmentedPropertyTypeModifierCodeSequence", [])
    assert [code.CodeMeaning for code in found] == ([modifier] if modifier else [])


def test_label_values_the_bundle_does_not_name_are_written_with_a_warning(tmp_path, caplog):
    series, volume = study(tmp_path / "study")
    label_map = multi_label(volume)
    label_map[15, 0:2, 0:2] = 8
    seg = build_seg(label_map, volume.source_datasets, LABELS, Algorithm("algo", "1"))
    assert [d.SegmentLabel for d in seg.SegmentSequence][5:] == ["label 6", "label 7", "label 8"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["the label map holds values up to 8, beyond the bundle's labels (channel_def names up to 5): "
                        "they are written as segments 'label N', one per value up to 8"]


def test_label_values_between_the_named_ones_are_written_with_a_warning(tmp_path, caplog):
    series, volume = study(tmp_path / "study")
    label_map = multi_label(volume)
    label_map[15, 0:2, 0:2] = 3
    gapped = {number: name for number, name in LABELS.items() if number != 3}
    seg = build_seg(label_map, volume.source_datasets, gapped, Algorithm("algo", "1"))
    assert [d.SegmentLabel for d in seg.SegmentSequence][2] == "label 3"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["the label map holds values the bundle's labels do not name (channel_def names 1, 2, 4, 5): "
                        "3; they are written as segments 'label N'"]
    caplog.clear()
    build_seg(multi_label(volume), volume.source_datasets, gapped, Algorithm("algo", "1"))  # 3 named nowhere, absent
    empty = np.zeros_like(label_map)  # highdicom writes every frame of every segment then: none holds a 3
    build_seg(empty, volume.source_datasets, gapped, Algorithm("algo", "1"))
    assert not [r for r in caplog.records if r.levelno == logging.WARNING and r.name.startswith("medserve")]


def test_a_label_name_cut_to_a_dicom_long_string_is_warned_about(caplog):
    long_name = "left anterior descending coronary artery, proximal and middle segments"  # 71 characters
    descriptions = segment_descriptions({1: long_name, 2: "spleen"}, [1, 2], Algorithm("algo", "1"))
    assert [d.SegmentLabel for d in descriptions] == [long_name[:64].strip(), "spleen"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith(f"label 1 {long_name!r} is written as {long_name[:64]!r}")


def test_nifti_has_the_source_geometry(tmp_path):
    geometry = SeriesGeometry(origin=(5.0, -7.0, 11.0), orientation=(0, 1, 0, 0, 0, -1))
    series, volume = study(tmp_path / "study", geometry=geometry)
    label_map = multi_label(volume)
    image = nib.load(write_nifti(label_map, volume.volume, tmp_path / "labels.nii.gz"))
    np.testing.assert_array_equal(np.asarray(image.dataobj).transpose(2, 1, 0), label_map)
    lps = volume.volume.affine @ [2, 3, 4, 1]
    ras = image.affine @ [4, 3, 2, 1]
    np.testing.assert_allclose(ras[:3], lps[:3] * [-1, -1, 1], atol=1e-4)
    assert image.get_data_dtype() == np.uint16
    assert not list(tmp_path.glob(".*partial*"))


def test_importing_the_seg_writer_leaves_highdicom_as_it_is():
    """The benchmark's stock SEG writer runs in a process that imports medserve: it must get highdicom unchanged."""
    code = ("import highdicom._standard_utils as u, medserve.writers.seg, medserve.pipeline; "
            "print(hasattr(u.is_attribute_in_iod, 'uncached'))")
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert completed.stdout.strip() == "False"


def test_cached_iod_lookup_answers_as_highdicom_does():
    seg_module._cache_iod_attribute_lookup()  # what the first build_seg does
    cached = standard_utils.is_attribute_in_iod
    uncached = cached.uncached
    ct, seg = "1.2.840.10008.5.1.4.1.1.2", "1.2.840.10008.5.1.4.1.1.66.4"
    for attribute, sop_class, excluded in [("PerFrameFunctionalGroupsSequence", ct, None),
                                           ("PerFrameFunctionalGroupsSequence", seg, None),
                                           ("PixelData", ct, ["IconImageSequence"]),
                                           ("ContentDate", seg, None), ("NoSuchKeyword", ct, None)]:
        assert cached(attribute, sop_class, excluded) == uncached(attribute, sop_class, excluded)
        assert cached(attribute, pydicom.uid.UID(sop_class), excluded) == uncached(attribute, sop_class, excluded)
    with pytest.raises(KeyError, match="No IOD found"):
        cached("PixelData", "1.2.3.4")


@pytest.mark.parametrize("error,raised", [(OSError(28, "No space left on device"), OutputError),
                                          (ValueError("bad value"), ValueError)])
def test_a_failed_write_leaves_neither_the_file_nor_its_partial(tmp_path, error, raised):
    target = tmp_path / "labels.nii.gz"
    with pytest.raises(raised) as caught:
        with atomic_output(target) as partial:
            assert partial.name.endswith(".nii.gz")  # nibabel picks the format from the suffixes
            partial.write_bytes(b"half a file")
            raise error
    if raised is OutputError:
        assert str(caught.value) == f"cannot write {target}: No space left on device"
    assert list(tmp_path.iterdir()) == []


def test_a_write_error_pydicom_wraps_is_one_line(tmp_path):
    """pydicom re-raises an error inside an element (a disk filling up mid-sequence) with the whole traceback as
    its text and no strerror: the message keeps the OS's reason, in one line."""
    from pydicom.tag import Tag, tag_in_exception

    target = tmp_path / "seg.dcm"
    with pytest.raises(OutputError) as caught:
        with atomic_output(target), tag_in_exception(Tag(0x5200, 0x9230)):
            raise OSError(28, "No space left on device")
    assert str(caught.value) == f"cannot write {target}: No space left on device"


# ---- label maps from elsewhere: checked where they reach a writer -------------------------------------------

@pytest.mark.parametrize("values", [
    np.array([0, 1, 2], dtype=np.float32),  # MONAI's AsDiscrete leaves labels as floats
    np.array([0, 1, 60000], dtype=np.float16),
    np.array([0, 300, 65535], dtype=np.int64),
    np.array([0, 7], dtype=np.int8),
    np.array([0, 65535], dtype=np.uint32),
    np.array([False, True]),
], ids=lambda values: str(values.dtype))
def test_label_maps_of_whole_numbers_become_uint16_labels(values):
    converted = label_array(values.reshape(1, 1, -1))
    assert converted.dtype == np.uint16
    np.testing.assert_array_equal(converted.ravel(), values.astype(np.int64))


def test_unsigned_label_maps_pass_through_uncopied():
    for dtype in (np.uint8, np.uint16):
        values = np.zeros((2, 3, 4), dtype=dtype)
        assert label_array(values) is values


@pytest.mark.parametrize("value,message", [
    (np.array([0.0, 0.5], dtype=np.float32), "dtype float32 with fractional values"),
    (np.array([0, np.inf], dtype=np.float16), "dtype float16 with NaN or infinite values"),
    (np.array([0, np.nan]), "dtype float64 with NaN or infinite values"),
    (np.array([-1, 2], dtype=np.int8), "values -1..2 are outside the labels 0..65535"),
    (np.array([0, 70000], dtype=np.uint32), "values 0..70000 are outside the labels 0..65535"),
    (np.array([0, 1], dtype="timedelta64[s]"), "dtype timedelta64.s.; expected integer labels"),
    (np.zeros((1, 2), dtype=np.complex64), "dtype complex64; expected integer labels"),
])
def test_values_that_are_not_labels_are_refused_by_name(value, message):
    with pytest.raises(ValueError, match=rf"^label map has {message}|^label map {message}"):
        label_array(value.reshape(1, 1, -1))


def test_what_is_not_a_3d_array_is_refused_by_name():
    with pytest.raises(ValueError, match=r"^label map has shape \(3, 4\); expected 3 dimensions "
                                         r"\(slice, row, column\)$"):
        label_array(np.zeros((3, 4), dtype=np.uint8))
    with pytest.raises(TypeError, match=r"^label map: expected a numpy array or an SDK Image of one; "
                                        r"got builtins.list$"):
        label_array([[[0, 1]]])


def test_writers_refuse_a_label_map_that_does_not_fit_their_source(tmp_path):
    series, volume = study(tmp_path / "study")  # 16 slices of 32x32
    label_map = multi_label(volume)
    with pytest.raises(ValueError, match=r"^label map has shape \(16, 32, 31\) \(slice, row, column\); the volume "
                                         r"has \(16, 32, 32\)$"):
        write_nifti(label_map[:, :, 1:], volume.volume, tmp_path / "labels.nii.gz")
    with pytest.raises(ValueError, match=r"^label map has shape \(15, 32, 32\) \(slice, row, column\); the source "
                                         r"series \(images, rows, columns\) has \(16, 32, 32\)$"):
        build_seg(label_map[1:], volume.source_datasets, LABELS, Algorithm("demo_organ_seg", "0.1.0"))
    assert list(tmp_path.glob("labels*")) == []


def test_the_summary_counts_labels_that_share_a_name_apart() -> None:
    """Two labels named alike are two segments in the SEG; the summary and the server's segment counts keep both,
    each named with its value."""
    from medserve.pipeline import segment_counts, summary_line

    label_map = np.zeros((2, 4, 4), np.uint16)
    label_map[0, :2] = 1
    label_map[1, :1] = 2
    label_map[1, 3] = 3
    counts = segment_counts(label_map, {1: "kidney", 2: "kidney", 3: "liver"})
    assert counts == {"kidney (label 1)": 8, "kidney (label 2)": 4, "liver": 4}
    assert summary_line(counts, 1.0).startswith("3 segment(s) found (kidney (label 1): 8 voxels, ")
    # the same name for the same label in every study, whichever of the alike-named labels it holds
    assert segment_counts(np.where(label_map == 2, 2, 0), {1: "kidney", 2: "kidney"}) == {"kidney (label 2)": 4}


def test_the_summary_stays_one_line_whatever_the_label_names_hold() -> None:
    """Names from a bundle's metadata: a newline split the "one-line" summary, an escape sequence reached the
    terminal, and a lone surrogate stopped the app after its outputs were written (UnicodeEncodeError, exit 1)."""
    from medserve.pipeline import summary_line

    line = summary_line({"spl\neen": 5, "liver\x1b[31m": 3, "\ud800": 1}, 1.0)
    assert line == "3 segment(s) found (spl\\neen: 5 voxels, liver\\x1b[31m: 3 voxels, \\ud800: 1 voxels) in 1.0 s"
    line.encode("utf-8")


def test_a_failed_run_removes_its_published_files_not_another_runs_under_the_same_inode(tmp_path):
    """Another run that removed our seg.dcm and wrote its own often got the freed inode back: the failed run then
    removed that run's complete result as its own (seen as a flaky app test)."""
    from medserve.writers import files

    published = files.track_published()
    try:
        for name in ("ours.dcm", "theirs.dcm"):
            with atomic_output(tmp_path / name) as partial:
                partial.write_bytes(b"ours")
        inode = (tmp_path / "theirs.dcm").stat().st_ino
        time.sleep(0.01)
        (tmp_path / "theirs.dcm").write_bytes(b"another run's")  # the same inode, written again
        assert (tmp_path / "theirs.dcm").stat().st_ino == inode
        files.remove_published(published)
    finally:
        files._published = None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["theirs.dcm"]
