"""Our selector against the stock DICOMSeriesSelectorOperator, side by side on the same folder and rules.

The stock loader reads the files in os.listdir order, which depends on the filesystem; here it is given them in
the sorted order our index uses (its own `_load_data`), so that "study order" is the same for both.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from pydicom.dataset import Dataset, FileMetaDataset
from pydicom.uid import CTImageStorage, ExplicitVRLittleEndian, MRImageStorage, generate_uid

from medserve.dicom.index import index_folder
from medserve.dicom.select import load_rules, select_series
from medserve.errors import SelectionError

AXIAL = [1, 0, 0, 0, 1, 0]
CORONAL = [1, 0, 0, 0, 0, -1]
SAGITTAL = [0, 1, 0, 0, 0, -1]
STUDY_A, STUDY_B = generate_uid(), generate_uid()


def write_series(folder: Path, study_uid: str, *, slices: int = 2, positions: list[int] | None = None,
                 acquisitions: list[int] | None = None, **attributes) -> str:
    """A series of tiny images; `attributes` are DICOM keywords (None: leave the attribute out)."""
    series_uid = generate_uid()
    folder.mkdir(parents=True, exist_ok=True)
    positions = positions if positions is not None else list(range(slices))
    modality = attributes.get("Modality", "CT")
    for k, z in enumerate(positions):
        ds = Dataset()
        ds.file_meta = FileMetaDataset()
        ds.file_meta.TransferSyntaxUID = ExplicitVRLittleEndian
        ds.SOPClassUID = MRImageStorage if modality == "MR" else CTImageStorage
        ds.file_meta.MediaStorageSOPClassUID = ds.SOPClassUID
        ds.SOPInstanceUID = ds.file_meta.MediaStorageSOPInstanceUID = generate_uid()
        ds.StudyInstanceUID, ds.SeriesInstanceUID = study_uid, series_uid
        ds.PatientName, ds.PatientID = "Parity^Test", "P1"
        ds.StudyDescription = "Abdomen CT" if study_uid == STUDY_A else "Brain MR"
        ds.Modality = modality
        ds.PatientPosition = "HFS"
        ds.ImageType = ["ORIGINAL", "PRIMARY", "AXIAL"]
        ds.ImageOrientationPatient = AXIAL
        ds.PixelSpacing = [0.7, 0.7]
        ds.InstanceNumber = k + 1
        ds.ImagePositionPatient = [0, 0, float(z)]
        if acquisitions is not None:
            ds.AcquisitionNumber = acquisitions[k]
        for keyword, value in attributes.items():
            if value is None:
                delattr(ds, keyword) if keyword in ds else None
            else:
                setattr(ds, keyword, value)
        ds.Rows = ds.Columns = 4
        ds.SamplesPerPixel, ds.PhotometricInterpretation = 1, "MONOCHROME2"
        ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 16, 16, 15, 0
        ds.PixelData = np.zeros((4, 4), np.uint16).tobytes()
        ds.save_as(folder / f"IM{k:03d}.dcm", enforce_file_format=True)
    return series_uid


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """Two studies, nine series; the paths' sorted order is the study order written down here."""
    root = tmp_path_factory.mktemp("parity")
    uids = {
        # Study A: a scout first, then larger series; a derived sagittal with SliceThickness/SeriesNumber 0.
        "A1 scout": write_series(root / "a1", STUDY_A, slices=2, SeriesDescription="Scout", SeriesNumber=1,
                                 SliceThickness="10", ImageType=["ORIGINAL", "PRIMARY", "LOCALIZER"],
                                 ImageOrientationPatient=CORONAL, BodyPartExamined="ABDOMEN"),
        "A2 5mm": write_series(root / "a2", STUDY_A, slices=3, SeriesDescription="Abdomen 5mm", SeriesNumber=2,
                               SliceThickness="5", Manufacturer="Acme", WindowCenter=["40", "400"]),
        "A3 1mm": write_series(root / "a3", STUDY_A, slices=5, SeriesDescription="Abdomen 1mm", SeriesNumber=3,
                               SliceThickness="1.0", BodyPartExamined="ABDOMEN", PixelSpacing=[0.5, 0.5]),
        "A4 mpr": write_series(root / "a4", STUDY_A, slices=4, SeriesDescription="MPR sagittal", SeriesNumber=0,
                               SliceThickness="0", ImageType=["DERIVED", "SECONDARY", "MPR"],
                               ImageOrientationPatient=SAGITTAL),
        "A5 t1": write_series(root / "a5", STUDY_A, slices=2, Modality="MR", SeriesDescription="T1 axial",
                              SeriesNumber=5, SliceThickness="3"),
        # Study B: an MR whose 4 files hold 2 positions (duplicates: the stock loader keeps one per position).
        "B1 t2": write_series(root / "b1", STUDY_B, slices=3, Modality="MR", SeriesDescription="T2 sag",
                              SeriesNumber=1, SliceThickness="4", ImageOrientationPatient=SAGITTAL),
        "B2 dup": write_series(root / "b2", STUDY_B, positions=[0, 0, 1, 1], acquisitions=[1, 2, 1, 2],
                               Modality="MR", SeriesDescription="T1 ax repeated", SeriesNumber=2,
                               SliceThickness="3"),
        "B3 ct": write_series(root / "b3", STUDY_B, slices=3, SeriesDescription="CT localizer", SeriesNumber=3,
                              SliceThickness="2.5", StudyDescription="", BodyPartExamined="HEAD"),
        "B4 flair": write_series(root / "b4", STUDY_B, slices=3, Modality="MR", SeriesDescription="FLAIR",
                                 SeriesNumber=4, SliceThickness="5", ImageOrientationPatient=CORONAL),
    }
    return root, uids


def stock_select(root: Path, rules: dict, all_matched: bool, sort: bool) -> list[tuple[str, str]]:
    from monai.deploy.core import Fragment
    from monai.deploy.operators.dicom_data_loader_operator import DICOMDataLoaderOperator
    from monai.deploy.operators.dicom_series_selector_operator import DICOMSeriesSelectorOperator

    fragment = Fragment()
    files = [str(p) for p in sorted(Path(d) / n for d, _, names in os.walk(root) for n in names)]
    studies = DICOMDataLoaderOperator(fragment, name="loader")._load_data(files)
    selector = DICOMSeriesSelectorOperator(fragment, name="selector")
    found = selector.filter(rules, studies, all_matched, sort)
    return [(s.selection_name, s.series.SeriesInstanceUID) for study in found for s in study.selected_series]


def our_select(root: Path, rules: dict, all_matched: bool, sort: bool) -> list[tuple[str, str]]:
    try:
        selected = select_series(index_folder(root), rules, all_matched=all_matched, sort_by_sop_instance_count=sort)
    except SelectionError as error:
        if "no series in" in str(error):
            return []  # the stock returns an empty selection where we refuse
        raise
    return [(choice.name, choice.series.series_uid) for choice in selected]


def rules_of(*conditions: dict, names: list[str] | None = None) -> dict:
    names = names or [f"s{i}" for i in range(len(conditions))]
    return {"selections": [{"name": n, "conditions": c} for n, c in zip(names, conditions)]}


# (id, rules, all_matched, sort_by_sop_instance_count, the series our selection must be, in order)
CASES = [
    ("first match in study order", rules_of({"Modality": "CT"}), False, False, ["A1 scout", "B3 ct"]),
    ("case-insensitive equality", rules_of({"Modality": "mr"}), False, False, ["A5 t1", "B1 t2"]),
    ("regex searched anywhere", rules_of({"SeriesDescription": "1mm|t2"}), False, False, ["A3 1mm", "B1 t2"]),
    ("all matched", rules_of({"SeriesDescription": "(?i)^abdomen"}), True, False, ["A2 5mm", "A3 1mm"]),
    ("all matched, by instance count", rules_of({"Modality": "(?i)CT|MR"}), True, True,
     ["A3 1mm", "A4 mpr", "A2 5mm", "A1 scout", "A5 t1", "B1 t2", "B3 ct", "B4 flair", "B2 dup"]),
    ("sort without all_matched is first match", rules_of({"Modality": "MR"}), False, True, ["A5 t1", "B1 t2"]),
    ("several selections, several matches, blank name and no conditions",
     rules_of({"Modality": "MR"}, {"SliceThickness": [3, 5]}, {}, {"BodyPartExamined": "abdomen"},
              names=["mr", "", "nothing", "abdomen"]), True, False,
     ["A5 t1", "A2 5mm", "A5 t1", "A1 scout", "A3 1mm", "B1 t2", "B2 dup", "B4 flair", "B1 t2", "B2 dup",
      "B4 flair"]),
    ("a name used twice groups its matches", rules_of({"Modality": "CT"}, {"Modality": "MR"},
                                                       {"SeriesDescription": "1mm"}, names=["img", "mr", "img"]),
     False, False, ["A1 scout", "A3 1mm", "A5 t1", "B3 ct", "B1 t2"]),
    ("numeric range", rules_of({"SliceThickness": [2, 4.5]}), True, False, ["A5 t1", "B1 t2", "B2 dup", "B3 ct"]),
    ("relational >", rules_of({"SliceThickness": [4, ">"]}), True, False, ["A1 scout", "A2 5mm", "B4 flair"]),
    ("relational <= with a string number", rules_of({"SliceThickness": ["2.5", "<="]}), True, False,
     ["A3 1mm", "B3 ct"]),
    ("relational !=", rules_of({"SeriesNumber": [2, "!="], "Modality": "CT"}), True, False,
     ["A1 scout", "A3 1mm", "B3 ct"]),
    ("numeric regex is a full match", rules_of({"SliceThickness": "1|2"}), True, False, []),
    ("numeric regex on the written value", rules_of({"SliceThickness": r"1\.0|2\.5"}), True, False,
     ["A3 1mm", "B3 ct"]),
    ("exact number", rules_of({"SliceThickness": 5}), True, False, ["A2 5mm", "B4 flair"]),
    ("falsy condition is ignored", rules_of({"SliceThickness": 0, "SeriesDescription": "MPR"}), False, False,
     ["A4 mpr"]),
    ("falsy attribute is missing", rules_of({"SeriesNumber": [0, 1]}), True, False, ["A1 scout", "B1 t2"]),
    ("zero thickness never matches", rules_of({"SliceThickness": [-1, 0.5]}), True, False, []),
    ("ImageType terms with !TERM", rules_of({"ImageType": ["PRIMARY", "!LOCALIZER"], "Modality": "CT"}), True,
     False, ["A2 5mm", "A3 1mm", "B3 ct"]),
    ("ImageType single exclusion", rules_of({"ImageType": "!original"}), True, False, ["A4 mpr"]),
    ("multi-valued list is terms, not a range", rules_of({"PixelSpacing": [0.5, 0.5]}), True, False, ["A3 1mm"]),
    ("orientation axial", rules_of({"ImageOrientationPatient": "axial", "Modality": "CT"}), True, False,
     ["A2 5mm", "A3 1mm", "B3 ct"]),
    ("orientation sagittal and coronal", rules_of({"ImageOrientationPatient": "Sagittal"},
                                                  {"ImageOrientationPatient": " CORONAL "}), False, False,
     ["A4 mpr", "A1 scout", "B1 t2", "B4 flair"]),
    ("study attribute", rules_of({"StudyDescription": "brain", "Modality": "MR"}), False, False, ["B1 t2"]),
    ("study attribute from the study's first file", rules_of({"StudyDescription": "brain", "Modality": "CT"}),
     True, False, ["B3 ct"]),
    ("StudyInstanceUID", rules_of({"StudyInstanceUID": STUDY_B}), True, False,
     ["B1 t2", "B2 dup", "B3 ct", "B4 flair"]),
    ("instance-level text attribute", rules_of({"Manufacturer": "acme"}), False, False, ["A2 5mm"]),
    ("instance-level multi-valued numbers", rules_of({"WindowCenter": "400"}), False, False, ["A2 5mm"]),
    ("multi-valued terms are searched in the element's repval", rules_of({"WindowCenter": "40, 400"}), False,
     False, ["A2 5mm"]),
    ("instance-level integer", rules_of({"Rows": [4, ">="], "Modality": "MR"}), False, False, ["A5 t1", "B1 t2"]),
    ("stock property row_pixel_spacing", rules_of({"row_pixel_spacing": [0.4, 0.6]}), True, False, ["A3 1mm"]),
    ("missing attribute fails", rules_of({"BodyPartExamined": "(.*?)"}), True, False,
     ["A1 scout", "A3 1mm", "B3 ct"]),
]


@pytest.mark.parametrize("rules,all_matched,sort,expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_same_series_in_the_same_order_as_the_stock_selector(folder, rules, all_matched, sort, expected):
    root, uids = folder
    ours = our_select(root, rules, all_matched, sort)
    assert ours == stock_select(root, rules, all_matched, sort)
    assert [uid for _, uid in ours] == [uids[name] for name in expected]


def test_blank_selection_name_is_the_series_uid_as_in_the_sdk(folder):
    root, uids = folder
    rules = {"selections": [{"conditions": {"SeriesDescription": "scout"}}]}
    assert our_select(root, rules, False, False) == [(uids["A1 scout"], uids["A1 scout"])]


def test_orientation_without_patient_position_fails_in_both(tmp_path):
    write_series(tmp_path / "x", STUDY_A, PatientPosition=None)
    rules = rules_of({"ImageOrientationPatient": "Axial"})
    with pytest.raises(NotImplementedError, match="PatientPosition"):
        stock_select(tmp_path, rules, False, False)
    with pytest.raises(SelectionError, match=r"selection 's0': condition \"ImageOrientationPatient\".*no "
                                             r"PatientPosition"):
        select_series(index_folder(tmp_path), rules)


def test_default_without_rules_differs_from_the_stock_on_purpose(folder):
    """No rules: ours takes the largest CT or MR series per study that forms a volume (B2, with the most files,
    repeats its positions; B1's sagittal slices all lie at one point of their normal); the stock takes every
    series."""
    root, uids = folder
    assert [c.series.series_uid for c in select_series(index_folder(root))] == [uids["A3 1mm"], uids["B3 ct"]]
    assert len(stock_select(root, None, False, False)) == len(uids)


@pytest.mark.parametrize("conditions,message", [
    ({"SeriesDescription": "("}, r"selections\[0\] \('bad'\): condition \"SeriesDescription\": \"\(\"; "
                                 r"expected a valid regular expression"),
    ({"SliceThickness": ["abc", ">"]}, r"selections\[0\] \('bad'\): condition \"SliceThickness\": "
                                       r"\[\"abc\", \">\"\]; expected a number before '>'"),
    ({"SliceThickness": [1, "~"]}, r"condition \"SliceThickness\".*operator '~' is not supported"),
    ({"SliceThickness": [1, 2, 3]}, r"condition \"SliceThickness\".*expected \[min, max\]"),
    ({"Modality": ["CT", "MR"]}, r"condition \"Modality\".*expected a string \(Modality is a single text"),
    ({"StudyID": 12}, r"condition \"StudyID\": 12; expected a string"),
    ({"ImageOrientationPatient": "oblique"}, r"expected \"Axial\", \"Coronal\" or \"Sagittal\""),
    ({"ImageType": [["PRIMARY"]]}, r"expected a list of strings or numbers"),
    ({"Modality": True}, r"not true"),
    ({"Modality": {"in": ["CT"]}}, r"expected a string, a number or a list"),
    ({"Modalty": "CT"}, r"'Modalty' is not a DICOM attribute keyword"),
    ({"PatientName": "Doe"}, r"PatientName has VR PN, which the stock selector cannot match"),
])
def test_malformed_conditions_are_refused_when_the_rules_are_loaded(conditions, message):
    with pytest.raises(SelectionError, match=message):
        load_rules({"selections": [{"name": "bad", "conditions": conditions}]})


def test_malformed_selections_are_refused_when_the_rules_are_loaded():
    with pytest.raises(SelectionError, match=r"selections\[1\]: name 3 must be a string"):
        load_rules({"selections": [{"name": "ok", "conditions": {"Modality": "CT"}}, {"name": 3}]})
    with pytest.raises(SelectionError, match=r"selections\[0\] \('x'\): conditions must be an object"):
        load_rules({"selections": [{"name": "x", "conditions": ["Modality", "CT"]}]})
    with pytest.raises(SelectionError, match=r"expected \{\"selections\""):
        load_rules("{}")
    # What the stock accepts is accepted: no conditions, null conditions, falsy values (ignored).
    assert load_rules({"selections": [{"name": "x"}, {"conditions": None}, {"conditions": {"SliceThickness": 0}}]})
    assert load_rules("  ") is None and load_rules(None) is None
