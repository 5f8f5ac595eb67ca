"""DICOM SEG (highdicom) from a label map: one segment per bundle label, referencing the source series.

Segment descriptions come from the bundle's metadata: each label name is looked up in the DICOM segmentation
context groups (PS3.16 CID 7150 categories and the type group of each category, CIDs 7191-7198), so a known
anatomy gets (Anatomical Structure, that structure) ("spleen", "Right Kidney" -> Kidney, "inferior_vena_cava"),
a known lesion (Morphologically Abnormal Structure, that finding) ("tumour" -> Neoplasm, "edema"), a known device
(Physical Object, that object) ("catheter"), and any other name the generic (Tissue, Tissue). Names are matched in
any word order, also with published bundles' own words ("vertebrae_L1", "small_bowel", "heart_atrium_left").
Empty frames are omitted.
"""

from __future__ import annotations

import functools
import logging
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import highdicom as hd
import highdicom._standard_utils as hd_standard_utils
import numpy as np
from pydicom import config
from pydicom.charset import convert_encodings
from pydicom.datadict import dictionary_VM
from pydicom.dataset import Dataset
from pydicom.multival import MultiValue
from pydicom.sr.codedict import codes
from pydicom.sr.coding import Code
from pydicom.uid import UID, generate_uid
from pydicom.valuerep import DA, TM, validate_value

import medserve
from medserve.dicom.edits import copy_with
from medserve.dicom.values import decimal_values, number_of_frames, stored_bytes
from medserve.dicom.volume import single_image_spacing
from medserve.errors import DicomInputError
from medserve.writers.files import atomic_output
from medserve.writers.labels import label_array

_LATERALITY_WORDS = {"left": "Left", "right": "Right", "l": "Left", "r": "Right"}  # CID 244 keywords
# DICOM PS3.16 CID 7150 (Segmentation Property Categories) and, for each category, the context group its
# Segmented Property Type comes from. When a concept is in more than one group, the first listed wins: an
# artery is an Anatomical Structure (7192) before a Tissue (7191); "background"/"normal" are Spatial and
# Relational Concepts (7196) before Morphologically Abnormal Structures (7194 lists them too).
_CATEGORY_TYPE_GROUPS = (
    ("AnatomicalStructure", 7192),  # Anatomical Structure Segmentation Property Type
    ("Tissue", 7191),  # Tissue Segmentation Property Type
    ("SpatialAndRelationalConcept", 7196),  # Spatial and Relational Concept Segmentation Property Type
    ("MorphologicallyAbnormalStructure", 7194),  # Morphologically Abnormal Structure Segmentation Property Type
    ("PhysicalObject", 7193),  # Physical Object Segmentation Property Type
    ("BodySubstance", 7197),  # Body Substance Segmentation Property Type
    ("Substance", 7198),  # Substance Segmentation Property Type
    ("Function", 7195),  # Function Segmentation Property Type
)
# British spellings of words the groups spell the American way. Other synonyms need no table: a SNOMED CT
# keyword that names the same code as a group member ("Tumor" is 108369006, which CID 7194 calls "Neoplasm")
# resolves to that member.
_SPELLINGS = {"tumour": "tumor", "oedema": "edema", "haemorrhage": "hemorrhage", "oesophagus": "esophagus",
              "faeces": "feces"}
# Latin, plural or lay words of published bundles (wholeBody_ct_segmentation's "vertebrae_L1", "clavicula_left",
# "iliac_vena_left", "small_bowel") for the groups' words; tried when a name as written matches nothing, as
# "vena" is the groups' own word in "inferior vena cava".
_BUNDLE_WORDS = {"vertebrae": "vertebra", "clavicula": "clavicle", "vena": "vein", "bowel": "intestine"}
_FILLER_WORDS = frozenset({"of", "the"})
log = logging.getLogger("medserve.writers.seg")
_TYPE2_COPIED_ATTRIBUTES = ("PatientID", "PatientName", "PatientBirthDate", "PatientSex", "AccessionNumber",
                            "StudyID", "StudyDate", "StudyTime")


def _cache_iod_attribute_lookup() -> None:
    """Answer highdicom's `is_attribute_in_iod` from a cache.

    highdicom 0.28 answers it by scanning its IOD and module tables (0.4-0.6 ms a call) and asks it once per source
    image when it builds a SEG from a series (`is_multiframe_image`): 0.1-0.2 s of a 300-slice SEG. The answer
    depends only on the arguments (the tables are constants of the installed highdicom), so a cache is exact.
    Only callers that look it up through `highdicom._standard_utils` (as `is_multiframe_image` does) see the
    cache; modules that imported the function by name keep the uncached one. The first `build_seg` installs it,
    not the import of this module: a process that only imports medserve leaves highdicom as it is.
    """
    lookup = hd_standard_utils.is_attribute_in_iod
    if hasattr(lookup, "uncached"):
        return

    @functools.lru_cache(maxsize=4096)
    def cached(attribute: str, sop_class_uid: str, exclude_path_elements: tuple[str, ...] | None) -> bool:
        excluded = list(exclude_path_elements) if exclude_path_elements is not None else None
        return lookup(attribute, sop_class_uid, excluded)

    def is_attribute_in_iod(attribute: str, sop_class_uid: str,
                            exclude_path_elements: Sequence[str] | None = None) -> bool:
        excluded = tuple(exclude_path_elements) if exclude_path_elements is not None else None
        return cached(attribute, str(sop_class_uid), excluded)

    is_attribute_in_iod.uncached = lookup  # type: ignore[attr-defined]
    hd_standard_utils.is_attribute_in_iod = is_attribute_in_iod


@dataclass(frozen=True)
class Algorithm:
    """What produced the segmentation, recorded in every segment's algorithm identification."""

    name: str
    version: str


def segment_concept(label: str) -> tuple[Code, Code]:
    """(category, type) coded concepts for a label name, from the DICOM segmentation context groups.

    The name's words, in any order and case (laterality words kept, then dropped: "left atrium" is a structure of
    its own, "Right Kidney" is a Kidney; then numbers dropped: "rib_left_3" is a Rib), are matched against the
    meanings and keywords of CIDs 7191-7198, then as a SNOMED CT keyword (or that of its "... structure") whose
    code is in one of them; then with published bundles' own words ("vertebrae", "clavicula", "vena", "bowel").
    An organ named before a sided part of it is dropped when the part is a structure of its own
    ("heart_atrium_left" is the Left atrium). A name that matches none of these is (Tissue, Tissue).
    """
    category, kind, _ = _segment_coding(label)
    return category, kind


@functools.lru_cache(maxsize=1024)
def _segment_coding(label: str) -> tuple[Code, Code, Code | None]:
    """(category, type, laterality): the laterality (CID 244) is the side a name states beyond its coded
    structure, for the segment's type modifier ("kidney_left" is a Kidney modified Left, "left atrium" a structure
    of its own with none); without it a bundle's left and right kidneys would be coded alike."""
    words = [w for w in (_SPELLINGS.get(w.lower(), w.lower()) for w in re.split(r"[^0-9A-Za-z]+", label) if w)
             if w not in _FILLER_WORDS]
    return (_coding_of_words(words) or _coding_of_words([_BUNDLE_WORDS.get(w, w) for w in words])
            or (codes.cid7150.Tissue, codes.cid7191.Tissue, None))


def _coding_of_words(words: list[str]) -> tuple[Code, Code, Code | None] | None:
    """The words as a concept in any order; else without their side words (as that side's modifier); else also
    without numbers ("rib_left_3" is a Rib, modified Left); else, when the first names an anatomical structure,
    the others as a structure whose own name holds their side ("heart_atrium_left" is the Left atrium). Only a side
    makes a part certain: "pancreas_head" is no Head, "tumor_liver" no Liver, "kidney_pelvis" no Pelvis."""
    laterality = _laterality(set(words) & _LATERALITY_WORDS.keys())
    structure = [w for w in words if w not in _LATERALITY_WORDS]
    unnumbered = [w for w in structure if not w.isdigit()]
    for candidate, modifier in ((words, None), (structure, laterality), (unnumbered, laterality)):
        found = _lookup_words(candidate)
        if found is not None:
            return (*found, modifier)
    if laterality is None or len(structure) < 2:
        return None
    organ = _lookup_words(structure[:1])
    if organ is None or organ[0] != codes.cid7150.AnatomicalStructure:
        return None
    found = _lookup_words([w for w in words if w != structure[0]])
    return (*found, None) if found is not None else None


def _lookup_words(words: list[str]) -> tuple[Code, Code] | None:
    """(category, type) of the concept these words name, in any order; None when none does."""
    if not words:
        return None
    by_words = _segmentation_concepts()[2]
    return by_words.get(frozenset(words)) or _lookup_concept("".join(w.capitalize() for w in words))


def _laterality(sides: set[str]) -> Code | None:
    named = {_LATERALITY_WORDS[side] for side in sides}
    if not named:
        return None
    return getattr(codes.cid244, named.pop()) if len(named) == 1 else codes.cid244.Bilateral


@functools.lru_cache(maxsize=1024)
def _lookup_concept(keyword: str) -> tuple[Code, Code] | None:
    by_keyword, by_code, _ = _segmentation_concepts()
    found = by_keyword.get(keyword.lower())
    # SNOMED CT names body structures "<name> structure" ("Urinary bladder structure" is the groups' Bladder).
    for snomed_keyword in (keyword, f"{keyword}Structure", f"StructureOf{keyword}"):
        if found is not None:
            break
        code = getattr(codes.SCT, snomed_keyword, None)
        if code is not None:
            found = by_code.get((code.scheme_designator, code.value))
    return found


@functools.cache
def _segmentation_concepts() -> tuple[dict[str, tuple[Code, Code]], dict[tuple[str, str], tuple[Code, Code]],
                                      dict[frozenset[str], tuple[Code, Code]]]:
    """(category, type) of every concept in the type groups: by lower-cased keyword (then meaning, without spaces
    or punctuation), by (scheme, code value), and by the words of its meaning in any order ("Lower lobe of lung" is
    {"lower", "lobe", "lung"}). Where concepts share a name, the first group listed wins."""
    by_keyword: dict[str, tuple[Code, Code]] = {}
    by_code: dict[tuple[str, str], tuple[Code, Code]] = {}
    by_words: dict[frozenset[str], tuple[Code, Code]] = {}
    groups = [(getattr(codes.cid7150, category), getattr(codes, f"cid{cid}").concepts)
              for category, cid in _CATEGORY_TYPE_GROUPS]
    for category, concepts in groups:
        for keyword, code in concepts.items():
            by_keyword.setdefault(keyword.lower(), (category, code))
            by_code.setdefault((code.scheme_designator, code.value), (category, code))
    # A code's meaning is a name too: CID 7191 keys Bone as "BoneTissue" but means "Bone".
    for category, concepts in groups:
        for code in concepts.values():
            meaning = code.meaning.lower()
            by_keyword.setdefault(re.sub(r"[^0-9a-z]+", "", meaning), (category, code))
            words = frozenset(re.split(r"[^0-9a-z]+", meaning)) - _FILLER_WORDS - {""}
            by_words.setdefault(words, (category, code))
    return by_keyword, by_code, by_words


def segment_descriptions(labels: dict[int, str], numbers: list[int],
                         algorithm: Algorithm) -> list[hd.seg.SegmentDescription]:
    identification = hd.AlgorithmIdentificationSequence(
        name=_written_as_long_string(algorithm.name, "algorithm name"),
        version=_written_as_long_string(algorithm.version or "0", "algorithm version"),
        family=codes.cid7162.ArtificialIntelligence)
    descriptions = []
    for number in numbers:
        label = labels.get(number, f"label {number}")
        category, kind, laterality = _segment_coding(label)
        description = hd.seg.SegmentDescription(
            segment_number=number,
            segment_label=_written_as_long_string(label, f"label {number}"),
            segmented_property_category=category,
            segmented_property_type=kind,
            algorithm_type=hd.seg.SegmentAlgorithmTypeValues.AUTOMATIC,
            algorithm_identification=identification,
        )
        if laterality is not None:  # highdicom's constructor takes no modifier; the module nests it in the type
            description.SegmentedPropertyTypeCodeSequence[0].SegmentedPropertyTypeModifierCodeSequence = [
                hd.sr.CodedConcept(laterality.value, laterality.scheme_designator, laterality.meaning)]
        descriptions.append(description)
    return descriptions


def build_seg(label_map: np.ndarray | hd.Volume, source: list[Dataset], labels: dict[int, str],
              algorithm: Algorithm, *, series_number: int = 900) -> hd.seg.Segmentation:
    """A BINARY Segmentation of `label_map`: an array with one frame per `source` dataset in that order, or a
    Volume that highdicom maps onto the source frames by position (multi-frame sources).

    A label map that is not whole-number labels is a ValueError, and so is an array whose shape does not fit
    single-frame source images, naming both shapes (see `medserve.writers.labels`); highdicom checks an array
    against multi-frame sources itself."""
    if isinstance(label_map, hd.Volume):
        values = label_array(label_map.array)
        pixels: np.ndarray | hd.Volume = label_map.with_array(values)
    else:
        values = pixels = label_array(label_map, _frames_shape(source),
                                      fits="the source series (images, rows, columns)")
    named, largest = max(labels, default=0), int(values.max(initial=0))
    if labels and largest > named:
        log.warning("the label map holds values up to %d, beyond the bundle's labels (channel_def names up to %d): "
                    "they are written as segments 'label N', one per value up to %d", largest, named, largest)
    numbers = list(range(1, max(named, largest, 1) + 1))
    _cache_iod_attribute_lookup()
    first = _first_source(source)
    segmentation = hd.seg.Segmentation(
        source_images=[first, *source[1:]],
        pixel_array=pixels,
        segmentation_type=hd.seg.SegmentationTypeValues.BINARY,
        segment_descriptions=segment_descriptions(labels, numbers, algorithm),
        series_instance_uid=generate_uid(),
        series_number=series_number,
        sop_instance_uid=generate_uid(),
        instance_number=1,
        manufacturer="medserve",
        manufacturer_model_name=_long_string(algorithm.name),
        software_versions=f"medserve {medserve.__version__}",
        device_serial_number="0",
        series_description=_long_string(f"{algorithm.name} segmentation"),
        content_label="SEGMENTATION",
        omit_empty_frames=True,
        content_creator_name=None,
        content_description=_long_string(f"Segmentation of series {first.SeriesInstanceUID}"),
    )
    _declare_character_set(segmentation, [*labels.values(), algorithm.name, algorithm.version])
    if labels and largest:  # an empty map is written with every frame of every segment (highdicom's rule)
        _warn_of_unnamed_values_between(segmentation, labels)
    return segmentation


def _warn_of_unnamed_values_between(segmentation: hd.seg.Segmentation, labels: dict[int, str]) -> None:
    """Values below the largest named one that channel_def does not name (a 2 where it names 1 and 3) are written
    as segments "label N" too. They are found from the frames written, which costs less than a scan of the map;
    values above the named ones were warned about before the build. Only frames that hold a segment are written
    when the map is not empty."""
    named_up_to = max(labels)
    # A SEG of one frame states its segment once, among the groups all frames share.
    shared = segmentation.SharedFunctionalGroupsSequence[0].get("SegmentIdentificationSequence")
    written: set[int] = set()
    for item in segmentation.PerFrameFunctionalGroupsSequence:
        identification = item.get("SegmentIdentificationSequence") or shared
        written.add(int(identification[0].ReferencedSegmentNumber))
    unnamed = sorted(value for value in written if value < named_up_to and value not in labels)
    if unnamed:
        log.warning("the label map holds values the bundle's labels do not name (channel_def names %s): %s; they "
                    "are written as segments 'label N'", ", ".join(map(str, sorted(labels))),
                    ", ".join(map(str, unnamed)))


def _declare_character_set(segmentation: hd.seg.Segmentation, texts: list[str]) -> None:
    """Switch the SEG to UTF-8 (ISO_IR 192) when the source's character set (ASCII when it declares none) cannot
    hold the bundle's names: pydicom would write '?' for what it cannot encode. Values copied from the source
    are decoded text by now and are written in UTF-8 as well."""
    declared = segmentation.get("SpecificCharacterSet")
    encodings = convert_encodings(declared) if declared else ["ascii"]
    for text in texts:
        try:
            text.encode(encodings[0])
        except UnicodeEncodeError:
            segmentation.SpecificCharacterSet = "ISO_IR 192"
            return


def _written_as_long_string(text: str, what: str) -> str:
    """`_long_string(text)`, with a warning naming `what` when that is not the text the bundle gave: a cut name
    may no longer tell two segments apart."""
    written = _long_string(text)
    if written != text.strip():
        log.warning("%s %r is written as %r: a DICOM LO value holds at most 64 characters, without backslashes or "
                    "control characters", what, text, written)
    return written


def _long_string(text: str) -> str:
    """`text` as one DICOM LO value: a backslash would split it into several values, LO holds no control
    characters (tabs, line breaks) and at most 64 characters."""
    return re.sub(r"[\x00-\x1f\x7f]+", " ", text.replace("\\", "/")).strip()[:64]


def _frames_shape(source: list[Dataset]) -> tuple[int, int, int] | None:
    """(images, rows, columns) of single-frame source images, the shape a label map over them has; None when
    there are multi-frame ones (highdicom checks a label map against their frames)."""
    if not source or any(number_of_frames(dataset) != 1 for dataset in source):
        return None
    return len(source), int(source[0].Rows), int(source[0].Columns)


def _first_source(source: list[Dataset]) -> Dataset:
    """The first source image as highdicom may copy its patient and study attributes: a copy, so the caller's
    header stays as it was, when one of them needs mending.

    highdicom copies these attributes from the first image and validates them, so headers that PACS and
    anonymisers write every day would fail the SEG after the whole inference had run:
    - a type-2 attribute (present, may be empty) that is absent is written empty;
    - a patient or study value DICOM does not allow there (PatientSex 'U', a date '1970-01-01' or '2024.01.01', a
      time '09:30:00', an age '45', a StudyID over 16 characters) is written empty, with a warning; the SEG still
      references the source series;
    - a SpecificCharacterSet highdicom refuses (empty, code extensions such as '\\ISO 2022 IR 87', the default
      'ISO_IR 6' spelled out) becomes ISO_IR 192: the values are decoded text by now, and UTF-8 holds them all;
    - an absent or empty SliceThickness (type 2 in CT and MR images) is taken as the spacing between the first
      two images (of a single image: the spacing its volume was built with), as highdicom needs one for the SEG's
      pixel measures; so is one that is not a single positive number (with a warning), which highdicom cannot
      copy ('abc', '3\\3', 'nan') or dciodvfy refuses (0);
    - a single image's SpacingBetweenSlices is the spacing its volume was built with, which highdicom states in the
      SEG's pixel measures (it would say 1 mm where the image states only its thickness).
    Frame of reference, SOP class and instance UIDs are type 1: without them no SEG can refer to the source
    (DicomInputError).
    """
    dataset = source[0]
    name = _name(dataset, "the first source image")
    if not dataset.get("FrameOfReferenceUID"):
        raise DicomInputError(f"{name}: FrameOfReferenceUID is missing; a DICOM SEG must refer to its source images "
                              "by it")
    _check_source_classes(source)
    changes: dict[str, object] = {keyword: None for keyword in _TYPE2_COPIED_ATTRIBUTES if keyword not in dataset}
    for keyword in _patient_and_study_keywords(str(dataset.SOPClassUID)):
        if keyword in dataset and (problem := _not_allowed(dataset, keyword)):
            log.warning("%s: %s is not a valid DICOM value (%s); the SEG has it empty", name, keyword, problem)
            changes[keyword] = None
    declared = dataset.get("SpecificCharacterSet")
    if declared is not None and not _highdicom_accepts_character_set(declared):
        changes["SpecificCharacterSet"] = "ISO_IR 192"
    if not _states_slice_thickness(dataset, name) and (spacing := _slice_spacing(source)) is not None:
        changes["SliceThickness"] = spacing
    if len(source) == 1 and number_of_frames(dataset) == 1:  # highdicom would state 1 mm unless the image does
        changes["SpacingBetweenSlices"] = single_image_spacing(dataset, warn=False)
    if (shared := _shared_geometry(dataset, name)) is not None:
        changes["SharedFunctionalGroupsSequence"] = shared
    return copy_with(dataset, changes) if changes else dataset


_SHARED_GEOMETRY = ("PixelMeasuresSequence", "PlaneOrientationSequence")


def _shared_geometry(dataset: Dataset, name: str) -> list[Dataset] | None:
    """A multi-frame image's shared functional groups with its pixel measures and plane orientation among them,
    or None when they are there already. Scanners may keep these in every frame's groups instead (Philips
    Enhanced MR does); highdicom's SEG reads them from the shared groups only ("'Dataset' object has no
    attribute 'PixelMeasuresSequence'", "Source images must have a shared orientation", after the inference).
    The volume was built from the frames' own values, so they are the same in every frame, which is checked."""
    groups = dataset.get("SharedFunctionalGroupsSequence")
    frames = dataset.get("PerFrameFunctionalGroupsSequence")
    if not groups or not frames:
        return None
    missing = [keyword for keyword in _SHARED_GEOMETRY if keyword not in groups[0]]
    if not missing:
        return None
    shared = Dataset()
    for element in groups[0]:
        shared.add(element)
    for keyword in missing:
        values = [frame.get(keyword) for frame in frames]
        numbers = [_geometry_numbers(value) for value in values]
        if numbers[0] is None or any(n is None or n.shape != numbers[0].shape
                                     or not np.allclose(n, numbers[0], rtol=0, atol=_GEOMETRY_ATOL)
                                     for n in numbers[1:]):
            raise DicomInputError(f"{name}: {keyword} is neither in the shared functional groups nor the same in "
                                  "every frame's; a DICOM SEG of a multi-frame image needs one for all frames")
        setattr(shared, keyword, values[0])
    return [shared]


_GEOMETRY_ATOL = 0.002  # as the volume's own check of orientations (3-decimal cosines pass); spacings in mm
_GEOMETRY_KEYWORDS = ("ImageOrientationPatient", "PixelSpacing", "SliceThickness", "SpacingBetweenSlices")


def _geometry_numbers(value: Any) -> np.ndarray | None:
    """A frame's pixel measures or plane orientation item as numbers (orientation cosines, spacings), compared
    with a tolerance: writers round per frame, and the volume was built with one."""
    if not value:
        return None
    try:
        return np.array([number for keyword in _GEOMETRY_KEYWORDS
                         for number in (decimal_values(value[0], keyword) or ())], dtype=np.float64)
    except ValueError:
        return None


def _check_source_classes(source: list[Dataset]) -> None:
    """Refuse source images a SEG cannot refer to, before highdicom meets them (it raised AttributeError,
    KeyError or a ValueError about multi-frame images): every one needs its SOP class and instance UIDs, and a
    class highdicom has the IOD of, which allows multiple frames only when there is a single source image."""
    first_of_class: dict[str, Dataset] = {}
    for position, dataset in enumerate(source):
        for keyword in ("SOPClassUID", "SOPInstanceUID"):
            if not dataset.get(keyword):
                raise DicomInputError(f"{_name(dataset, f'source image {position + 1}')}: {keyword} is missing; a "
                                      "DICOM SEG must refer to its source images by it")
        first_of_class.setdefault(str(dataset.SOPClassUID), dataset)
    iods = hd_standard_utils.get_sop_class_iod_map()
    for value, dataset in first_of_class.items():
        sop_class = UID(value)
        described = f"SOPClassUID {value}" + (f" ({sop_class.name})" if sop_class.name != value else "")
        if value not in iods:
            raise DicomInputError(f"{_name(dataset, 'a source image')}: {described} is not a standard DICOM storage "
                                  "class; a DICOM SEG can refer only to images of one (CT Image Storage, ...)")
        if len(source) > 1 and hd_standard_utils.is_multiframe_image(dataset):
            raise DicomInputError(f"{_name(dataset, 'a source image')}: {described} is a multi-frame class, but the "
                                  f"series has {len(source)} images; expected single-frame images (CT Image "
                                  "Storage, ...) or one multi-frame image")


def _name(dataset: Dataset, otherwise: str) -> str:
    return getattr(dataset, "filename", None) or otherwise


def _states_slice_thickness(dataset: Dataset, name: str) -> bool:
    """Whether the source states one positive, finite SliceThickness; a warning when it states another value."""
    try:
        values = decimal_values(dataset, "SliceThickness")
    except ValueError:
        values = (math.nan,)
    if values is None:
        return False
    if len(values) == 1 and 0 < values[0] < math.inf:
        return True
    log.warning("%s: SliceThickness %r is not one positive number of mm; the SEG states the spacing between the "
                "images instead", name, _stored_text(dataset, "SliceThickness"))
    return False


def _stored_text(dataset: Dataset, keyword: str) -> str:
    """An element's value as written, without converting it (which raises for text that is no valid value)."""
    raw = stored_bytes(dataset, keyword)
    return raw.decode("ascii", "replace").strip() if raw is not None else str(dataset[keyword].value)


@functools.lru_cache(maxsize=64)
def _patient_and_study_keywords(sop_class_uid: str) -> tuple[str, ...]:
    """The root attributes of the Patient and Study modules of the source's IOD: what highdicom copies from the
    first source image into the SEG (`copy_patient_and_study_information`)."""
    modules = hd_standard_utils.get_iod_module_map()[hd_standard_utils.get_sop_class_iod_map()[sop_class_uid]]
    attributes = hd_standard_utils.get_module_attribute_map()
    return tuple(dict.fromkeys(str(item["keyword"]) for module in modules if module["ie"] in ("Patient", "Study")
                               for item in attributes[module["key"]] if not item["path"]))


# Values of these VRs are text, which pydicom's validators check for characters, length and form (numbers and
# binary values were checked by their decoding).
_TEXT_VRS = frozenset({"AE", "AS", "CS", "DA", "DS", "DT", "IS", "LO", "LT", "PN", "SH", "ST", "TM", "UC", "UR",
                       "UT"})


# Control characters: text VRs allow none but ESC (of character set switches); LT, ST, UT also TAB, LF, FF, CR.
_CONTROL_CHARACTERS = re.compile(r"[\x00-\x1a\x1c-\x1f\x7f]")
_CONTROL_CHARACTERS_IN_FREE_TEXT = re.compile(r"[\x00-\x08\x0b\x0e-\x1a\x1c-\x1f\x7f]")


def _not_allowed(dataset: Dataset, keyword: str) -> str:
    """Why a value highdicom would copy into the SEG is one dciodvfy refuses, or '' when it is allowed: a value
    not of its VR's characters, length or form, several values where one is allowed, a name of more than five
    components, a date or time that does not exist, a PatientSex other than M, F or O."""
    try:
        element = dataset[keyword]
        value = element.value
        if element.VR not in _TEXT_VRS or value in (None, ""):
            return ""
        values = list(value) if isinstance(value, MultiValue) else [value]
        if len(values) > 1 and dictionary_VM(element.tag) == "1":
            return f"{len(values)} values where one is allowed"
        controls = _CONTROL_CHARACTERS_IN_FREE_TEXT if element.VR in ("LT", "ST", "UT") else _CONTROL_CHARACTERS
        for one in values:
            text = str(one)
            if keyword == "PatientSex" and text not in ("M", "F", "O"):
                return f"{text!r} is not M, F or O"
            if controls.search(text):
                return f"{text!r} holds a control character"
            if element.VR == "PN" and any(group.count("^") > 4 for group in text.split("=")):
                return f"{text!r} has more than the five components of a name"
            validate_value(element.VR, text, config.RAISE)
            if element.VR == "DA":
                DA(text)
            elif element.VR == "TM":
                TM(text)
    except ValueError as error:  # also a value that does not decode ('abc' as a DS)
        return str(error) or type(error).__name__
    return ""


def _highdicom_accepts_character_set(declared: object) -> bool:
    """One defined term without code extensions, as highdicom's SEG constructor accepts it."""
    values = [declared] if isinstance(declared, str) else list(declared)  # type: ignore[call-overload]
    if len(values) != 1 or not values[0] or str(values[0]).startswith("ISO 2022"):
        return False
    try:
        hd.enum.SpecificCharacterSetValues(str(values[0]))
    except ValueError:
        return False
    return True


def _slice_spacing(source: list[Dataset]) -> float | None:
    """The distance between the first two single-frame images' positions (the source comes in slice order), in
    mm; for a single image the spacing its volume was built with; None for multi-frame images."""
    if any(number_of_frames(d) != 1 for d in source[:2]):
        return None
    if len(source) == 1:
        return single_image_spacing(source[0], warn=False)  # the volume has warned
    if any("ImagePositionPatient" not in d for d in source[:2]):
        return None
    step = np.asarray(source[1].ImagePositionPatient, float) - np.asarray(source[0].ImagePositionPatient, float)
    return round(float(np.linalg.norm(step)), 6)


def write_seg(segmentation: hd.seg.Segmentation, path: Path) -> Path:
    """Save atomically: a reader never sees a half-written file under the final name."""
    with atomic_output(path) as partial:
        segmentation.save_as(partial)
    return path
