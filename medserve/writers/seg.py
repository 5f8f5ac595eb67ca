"""DICOM SEG (highdicom) from a label map: one segment per bundle label, referencing the source series.

Segment descriptions come from the bundle's metadata: each label name is looked up as a SNOMED CT anatomy
concept ("spleen", "Right Kidney" -> Kidney, "inferior_vena_cava"), falling back to the generic "Tissue"
concept when the name is not a known structure. Empty frames are omitted.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import highdicom as hd
import highdicom._standard_utils as hd_standard_utils
import numpy as np
from pydicom.dataset import Dataset
from pydicom.sr.codedict import codes
from pydicom.uid import generate_uid

import medserve

_LATERALITY_WORDS = {"left", "right", "l", "r"}
_TYPE2_COPIED_ATTRIBUTES = ("PatientID", "PatientName", "PatientBirthDate", "PatientSex", "AccessionNumber",
                            "StudyID", "StudyDate", "StudyTime")


def _cache_iod_attribute_lookup() -> None:
    """Answer highdicom's `is_attribute_in_iod` from a cache.

    highdicom 0.28 answers it by scanning its IOD and module tables (0.4-0.6 ms a call) and asks it once per source
    image when it builds a SEG from a series (`is_multiframe_image`): 0.1-0.2 s of a 300-slice SEG. The answer
    depends only on the arguments (the tables are constants of the installed highdicom), so a cache is exact.
    Only callers that look it up through `highdicom._standard_utils` (as `is_multiframe_image` does) see the
    cache; modules that imported the function by name keep the uncached one.
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


_cache_iod_attribute_lookup()


@dataclass(frozen=True)
class Algorithm:
    """What produced the segmentation, recorded in every segment's algorithm identification."""

    name: str
    version: str


def segment_concept(label: str) -> tuple[hd.sr.CodedConcept, hd.sr.CodedConcept]:
    """(category, type) coded concepts for a label name: a SNOMED CT anatomy concept when one matches."""
    words = [w for w in re.split(r"[^0-9A-Za-z]+", label) if w]
    structure_words = [w for w in words if w.lower() not in _LATERALITY_WORDS]
    keyword = "".join(w.capitalize() for w in structure_words)
    try:
        code = getattr(codes.SCT, keyword) if keyword else None
    except AttributeError:
        code = None
    if code is None:
        return codes.cid7150.Tissue, codes.SCT.Tissue
    return codes.cid7150.AnatomicalStructure, code


def segment_descriptions(labels: dict[int, str], numbers: list[int], algorithm: Algorithm) -> list[hd.seg.SegmentDescription]:
    identification = hd.AlgorithmIdentificationSequence(
        name=algorithm.name, version=algorithm.version or "0", family=codes.cid7162.ArtificialIntelligence)
    descriptions = []
    for number in numbers:
        label = labels.get(number, f"label {number}")
        category, kind = segment_concept(label)
        descriptions.append(hd.seg.SegmentDescription(
            segment_number=number,
            segment_label=label[:64],
            segmented_property_category=category,
            segmented_property_type=kind,
            algorithm_type=hd.seg.SegmentAlgorithmTypeValues.AUTOMATIC,
            algorithm_identification=identification,
        ))
    return descriptions


def build_seg(label_map: np.ndarray | hd.Volume, source: list[Dataset], labels: dict[int, str],
              algorithm: Algorithm, *, series_number: int = 900) -> hd.seg.Segmentation:
    """A BINARY Segmentation of `label_map`: an array with one frame per `source` dataset in that order, or a
    Volume that highdicom maps onto the source frames by position (multi-frame sources)."""
    values = label_map.array if isinstance(label_map, hd.Volume) else label_map
    numbers = list(range(1, max(max(labels, default=0), int(values.max(initial=0)), 1) + 1))
    first = _with_type2_attributes(source[0])
    return hd.seg.Segmentation(
        source_images=[first, *source[1:]],
        pixel_array=label_map,
        segmentation_type=hd.seg.SegmentationTypeValues.BINARY,
        segment_descriptions=segment_descriptions(labels, numbers, algorithm),
        series_instance_uid=generate_uid(),
        series_number=series_number,
        sop_instance_uid=generate_uid(),
        instance_number=1,
        manufacturer="medserve",
        manufacturer_model_name=algorithm.name[:64],
        software_versions=f"medserve {medserve.__version__}",
        device_serial_number="0",
        series_description=f"{algorithm.name} segmentation"[:64],
        content_label="SEGMENTATION",
        omit_empty_frames=True,
        content_creator_name=None,
        content_description=f"Segmentation of series {first.SeriesInstanceUID}"[:64],
    )


def _with_type2_attributes(dataset: Dataset) -> Dataset:
    """highdicom copies these patient/study attributes from the first source image and fails when one is
    absent; DICOM makes them type 2 (present, may be empty), so an absent one is written empty."""
    missing = [k for k in _TYPE2_COPIED_ATTRIBUTES if k not in dataset]
    if not missing:
        return dataset
    patched = Dataset()  # a new element dict: the caller's header stays as it was
    patched.update(dataset)
    patched.file_meta = dataset.file_meta
    for keyword in missing:
        setattr(patched, keyword, None)
    return patched


def write_seg(segmentation: hd.seg.Segmentation, path: Path) -> Path:
    """Save atomically: a reader never sees a half-written file under the final name."""
    partial = path.with_name(f".{path.name}.partial")
    segmentation.save_as(partial)
    partial.replace(path)
    return path
