"""Index a folder of DICOM files by study and series, reading headers only.

Pixel data is never read here: each instance remembers where its Pixel Data element starts in the file, so
that `medserve.dicom.pixels` can read the pixels of the one series that is used, straight into the volume.
While the headers are parsed, memory for the first series' volume is faulted in on a background thread
(`medserve.dicom.memory`).
"""

from __future__ import annotations

import io
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import pydicom
from pydicom.dataset import Dataset
from pydicom.errors import InvalidDicomError
from pydicom.uid import UID, ExplicitVRLittleEndian, ImplicitVRLittleEndian
from pydicom.valuerep import VR

from medserve.dicom.memory import VolumeMemory
from medserve.dicom.values import number_of_frames, uid_value
from medserve.errors import DicomInputError
from medserve.gc_pause import collector_paused

log = logging.getLogger("medserve.dicom.index")
_SKIPS_LOGGED = 20  # skipped files named one by one in the log

MEDIA_STORAGE_DIRECTORY_STORAGE = "1.2.840.10008.1.3.10"
# Enough for the header of a typical CT/MR slice (a few kB) with room for private tags.
_HEADER_CHUNK_BYTES = 32768
_EXPLICIT_VRS = frozenset(vr.value.encode() for vr in VR)
# An Enhanced (multi-frame) object carries its frames' geometry here, even when it holds a single frame.
_FUNCTIONAL_GROUPS = ("SharedFunctionalGroupsSequence", "PerFrameFunctionalGroupsSequence")


@dataclass(frozen=True)
class Instance:
    """One DICOM file: its path, its header (no pixel data) and the file offset of its Pixel Data element."""

    path: Path
    dataset: Dataset
    pixel_data_offset: int | None
    # Written without the 128-byte preamble and "DICM" (some archives and old modalities do): read with force.
    without_preamble: bool = False
    # Its pixels are Float or Double Float Pixel Data (a parametric map, a float MR image), not integers.
    float_pixels: bool = False

    @property
    def number_of_frames(self) -> int:
        return number_of_frames(self.dataset)

    @property
    def transfer_syntax(self) -> UID:
        """The file meta's TransferSyntaxUID; an empty UID when the file has none."""
        return UID(uid_value(getattr(self.dataset, "file_meta", Dataset()), "TransferSyntaxUID") or "")

    @property
    def is_multiframe(self) -> bool:
        return is_multiframe_dataset(self.dataset)


@dataclass
class Series:
    """The instances of one series, in the order they were found."""

    study_uid: str
    series_uid: str
    instances: list[Instance] = field(default_factory=list)
    # Memory for this series' volume, faulted in while the folder was indexed (the first series found only).
    volume_memory: VolumeMemory | None = field(default=None, repr=False, compare=False)
    # The checked slice order once computed (medserve.dicom.volume): the default selection checks it, and loading
    # the selected series then uses it rather than checking the geometry twice.
    volume_order: tuple[list[Instance], float] | None = field(default=None, repr=False, compare=False)

    @property
    def header(self) -> Dataset:
        """The first instance's header: series-level attributes are read from here."""
        return self.instances[0].dataset

    @property
    def datasets(self) -> list[Dataset]:
        return [instance.dataset for instance in self.instances]

    @property
    def modality(self) -> str:
        return str(self.header.get("Modality", ""))

    @property
    def description(self) -> str:
        return str(self.header.get("SeriesDescription", ""))

    @property
    def is_multiframe(self) -> bool:
        return len(self.instances) == 1 and self.instances[0].is_multiframe

    def summary(self) -> str:
        return (
            f"series {self.series_uid} (Modality={self.modality or '?'}, "
            f"SeriesDescription={self.description!r}, {len(self.instances)} instance(s))"
        )


@dataclass
class Study:
    study_uid: str
    series: list[Series] = field(default_factory=list)


@dataclass
class StudyIndex:
    """Everything found under a folder: studies with their series, and the files skipped with the reason."""

    root: Path
    studies: list[Study]
    skipped: list[tuple[Path, str]]

    @property
    def all_series(self) -> list[Series]:
        return [series for study in self.studies for series in study.series]

    def describe(self) -> str:
        """A multi-line listing of the series found, for error messages."""
        lines = [f"  {series.summary()}" for series in self.all_series]
        return "\n".join(lines) if lines else "  (no DICOM series)"


_FLOAT_PIXEL_TAGS = (b"\xe0\x7f\x08\x00", b"\xe0\x7f\x09\x00")  # (7FE0,0008), (7FE0,0009), little endian


def is_multiframe_dataset(dataset: Dataset) -> bool:
    """A multi-frame object: several frames, or an Enhanced object (functional groups) with any number."""
    return number_of_frames(dataset) > 1 or any(keyword in dataset for keyword in _FUNCTIONAL_GROUPS)


def read_header(path: Path) -> Instance:
    """Read one file's header, stopping before the pixel data; raise InvalidDicomError if it is not DICOM.

    The first `_HEADER_CHUNK_BYTES` are read in one call and parsed in memory, which took a fifth less time here
    than pydicom's many small reads on the file; a header that does not end within them is parsed from the file.
    """
    with path.open("rb") as stream:
        head = stream.read(_HEADER_CHUNK_BYTES)
        # Some archives and old modalities write the dataset without the 128-byte preamble and "DICM" prefix.
        without_preamble = not _has_preamble(head) and _starts_as_a_dataset(head)
        if len(head) < _HEADER_CHUNK_BYTES:
            return _parse_header(path, io.BytesIO(head), without_preamble)
        try:
            instance = _parse_header(path, io.BytesIO(head), without_preamble)
        except Exception:  # the chunk ended inside an element; the whole file decides
            instance = None
        if instance is not None and instance.pixel_data_offset is not None:
            return instance
        stream.seek(0)
        return _parse_header(path, stream, without_preamble)


def _parse_header(path: Path, stream: BinaryIO, without_preamble: bool = False) -> Instance:
    dataset = _read(stream, without_preamble, stop_before_pixels=True)
    dataset.filename = str(path)
    # pydicom leaves the stream at the tag of the element it stopped before.
    position = stream.tell()
    tag = stream.read(4)
    at_pixel_data = tag == b"\xe0\x7f\x10\x00"
    return Instance(path=path, dataset=dataset, pixel_data_offset=position if at_pixel_data else None,
                    without_preamble=without_preamble, float_pixels=tag in _FLOAT_PIXEL_TAGS)


def read_dataset(instance: Instance, **options: Any) -> Dataset:
    """The whole file of `instance` (pydicom.dcmread `options`), read as its header was: files written without
    the preamble too."""
    return _read(instance.path, instance.without_preamble, **options)


def _read(source: Path | BinaryIO, without_preamble: bool, **options: Any) -> Dataset:
    dataset = pydicom.dcmread(source, force=without_preamble, **options)
    if not dataset.file_meta.get("TransferSyntaxUID"):
        # No file meta (or one without it): the encoding pydicom found is the transfer syntax, as pixels are read.
        dataset.file_meta.TransferSyntaxUID = (
            ImplicitVRLittleEndian if dataset.original_encoding[0] else ExplicitVRLittleEndian)
    return dataset


@collector_paused()  # header parsing allocates much, in no reference cycles (medserve.gc_pause)
def index_folder(folder: Path | str, exclude: Path | str | None = None) -> StudyIndex:
    """Index every DICOM file under `folder` (recursively) by StudyInstanceUID and SeriesInstanceUID.

    Non-DICOM files, DICOMDIR files and objects of a class that is not an image (an SR, a presentation state) are
    skipped with a warning. A file that starts as DICOM but cannot be
    parsed is an error: it would silently drop a slice from its series otherwise. `exclude`: a folder left out
    (an app's output folder inside its input folder, whose SEG would otherwise be read as input next time).
    """
    root = Path(folder)
    if not root.exists():
        raise DicomInputError(f"input folder {root} does not exist")
    if not root.is_dir():
        raise DicomInputError(f"input {root} is not a folder: expected a folder of DICOM files")
    if exclude is not None and os.path.realpath(exclude) == os.path.realpath(root):
        exclude = None  # the same folder for input and output: only a folder below the input is left out
    paths = sorted(files_under(root, exclude))
    if not paths:
        raise DicomInputError(f"input folder {root} is empty: expected DICOM files")

    studies: dict[str, Study] = {}
    # A series belongs to one study: an archive that reuses a series UID in another study holds two series.
    series_by_uid: dict[tuple[str, str], Series] = {}
    skipped: list[tuple[Path, str]] = []
    prepared: Series | None = None
    for path in paths:
        instance = _read_or_skip(path, skipped)
        if instance is None:
            continue
        uids = _series_uids(instance, skipped)
        if uids is None:
            continue
        study_uid, series_uid = uids
        series = series_by_uid.get((study_uid, series_uid))
        if series is None:
            series = series_by_uid[study_uid, series_uid] = Series(study_uid=study_uid, series_uid=series_uid)
            studies.setdefault(study_uid, Study(study_uid=study_uid)).series.append(series)
        series.instances.append(instance)
        if prepared is None:
            prepared = series
            series.volume_memory = VolumeMemory.for_header(instance.dataset, capacity=len(paths))
        if series is prepared and series.volume_memory is not None:
            series.volume_memory.reserve(len(series.instances))

    if not studies:
        reasons = "; ".join(f"{p.name}: {why}" for p, why in skipped[:5])
        raise DicomInputError(f"no DICOM files found in {root} ({len(skipped)} file(s) skipped: {reasons})")
    log.info("indexed folder", extra={"root": str(root), "series": len(series_by_uid), "skipped": len(skipped)})
    if len(skipped) > _SKIPS_LOGGED:
        log.warning("skipping %d more files (%s)", len(skipped) - _SKIPS_LOGGED,
                    ", ".join(sorted({reason for _, reason in skipped[_SKIPS_LOGGED:]})))
    return StudyIndex(root=root, studies=list(studies.values()), skipped=skipped)


def _series_uids(instance: Instance, skipped: list[tuple[Path, str]]) -> tuple[str, str] | None:
    """The (study, series) UIDs an image slice belongs under; None for a file skipped (its reason added to
    `skipped`): an object that is no image, or a kind of image we cannot read. DicomInputError for a damaged
    image, which would otherwise be a slice silently missing from its series."""
    dataset, path = instance.dataset, instance.path
    study_uid = uid_value(dataset, "StudyInstanceUID")
    series_uid = uid_value(dataset, "SeriesInstanceUID")
    if not study_uid or not series_uid:
        if not _is_image(instance):
            _skip(skipped, path, f"no StudyInstanceUID/SeriesInstanceUID ({_sop_class_name(dataset)}, not an "
                                 "image)")
        elif instance.without_preamble:  # parsed with force: perhaps not DICOM at all
            _skip(skipped, path, "no StudyInstanceUID/SeriesInstanceUID")
        else:
            # pydicom returns what it could read of a cut file; an image without its UIDs is damaged.
            missing = " and ".join(k for k, v in (("StudyInstanceUID", study_uid),
                                                   ("SeriesInstanceUID", series_uid)) if not v)
            raise DicomInputError(f"{path}: corrupt or truncated DICOM file, or an incomplete object: {missing} "
                                  "missing")
        return None
    if _is_other_object(instance):
        # A dose report or presentation state filed in an image series is no slice of it.
        _skip(skipped, path, f"{_sop_class_name(dataset)}, not an image")
        return None
    if instance.float_pixels:  # read as a file cut before its pixels, it was refused as truncated
        _skip(skipped, path, f"{_sop_class_name(dataset)} with floating-point pixel data (Float Pixel Data), "
                             "which is not supported; expected integer Pixel Data")
        return None
    if not uid_value(dataset, "SOPInstanceUID"):
        # Every result references its source images by this UID (a SEG cannot be written without it).
        raise DicomInputError(f"{path}: SOPInstanceUID is missing; every DICOM image must have one")
    if instance.pixel_data_offset is None and _pixel_data_offset_is_known(instance) and _has_image_class(dataset):
        # A file cut before its pixels, perhaps inside a UID: alone in a "series" of its own, it would otherwise be
        # left out of the volume without a word.
        raise DicomInputError(f"{path}: corrupt or truncated DICOM file: no Pixel Data, which every "
                              f"{_sop_class_name(dataset)} object holds")
    return study_uid, series_uid


def _is_image(instance: Instance) -> bool:
    """Whether a file holds, or by its SOP class should hold, an image. Objects of other classes may lack study
    and series (a Color Palette, a Hanging Protocol): the stock loader skips them, and so do we."""
    return (instance.pixel_data_offset is not None or _sop_class(instance.dataset) is None
            or _has_image_class(instance.dataset))


def _is_other_object(instance: Instance) -> bool:
    """An object of a standard class that holds no image: an SR, a presentation state, a key object selection.
    Where the header read cannot see Pixel Data (a deflated SR, as SRs often are), its class decides alone; the
    classes with pixels whose names lack "Image Storage" are kept."""
    sop_class = _sop_class(instance.dataset)
    if sop_class is None or _has_image_class(instance.dataset):
        return False
    if _pixel_data_offset_is_known(instance):
        return instance.pixel_data_offset is None
    known = sop_class.name != sop_class  # pydicom names the standard classes it knows
    return known and sop_class not in _PIXEL_CLASSES_NOT_NAMED_IMAGE


_PIXEL_CLASSES_NOT_NAMED_IMAGE = frozenset({
    "1.2.840.10008.5.1.4.1.1.66.4",  # Segmentation Storage
    "1.2.840.10008.5.1.4.1.1.30",  # Parametric Map Storage
    "1.2.840.10008.5.1.4.1.1.481.2",  # RT Dose Storage
})


def _pixel_data_offset_is_known(instance: Instance) -> bool:
    """Whether reading the header finds the Pixel Data element where the file has one: not in a deflated body
    (read inflated), a big-endian one (its tag reads otherwise) or a file read with force."""
    syntax = instance.transfer_syntax
    return (not instance.without_preamble and syntax.is_transfer_syntax and syntax.is_little_endian
            and not syntax.is_deflated)


def _has_image_class(dataset: Dataset) -> bool:
    sop_class = _sop_class(dataset)
    return sop_class is not None and "Image Storage" in sop_class.name


def _sop_class(dataset: Dataset) -> UID | None:
    value = uid_value(dataset.file_meta, "MediaStorageSOPClassUID") or uid_value(dataset, "SOPClassUID")
    return UID(value) if value else None


def _sop_class_name(dataset: Dataset) -> str:
    sop_class = _sop_class(dataset)
    if sop_class is None:
        return "no SOP class"
    return sop_class.name if sop_class.name != sop_class else f"SOP class {sop_class}"  # unknown: name is the UID


def files_under(root: Path, exclude: Path | str | None = None) -> list[Path]:
    """Every file under `root`, following symbolic links to folders (mounted volumes often are), each real
    folder once, none under `exclude`. A folder that cannot be listed is a DicomInputError naming it: the study
    would otherwise be read in part and segmented as if whole."""
    files: list[Path] = []
    seen: set[str] = {os.path.realpath(exclude)} if exclude is not None else set()
    for dirpath, dirnames, names in os.walk(root, onerror=_unlistable, followlinks=True):
        real = os.path.realpath(dirpath)
        if real in seen:
            dirnames.clear()  # a link back up the tree, or a second link to the same folder
            continue
        seen.add(real)
        files.extend(Path(dirpath) / name for name in names)
    return files


def _unlistable(error: OSError) -> None:
    raise DicomInputError(f"{error.filename}: folder cannot be read ({error.strerror or error}); expected every "
                          "folder of the study to be readable") from error


def _read_or_skip(path: Path, skipped: list[tuple[Path, str]]) -> Instance | None:
    try:
        instance = read_header(path)
    except InvalidDicomError:
        _skip(skipped, path, "not a DICOM file")
        return None
    except OSError as error:
        if not path.exists():
            _skip(skipped, path, "broken symbolic link")
            return None
        raise DicomInputError(f"{path}: cannot be read ({error.strerror or error})") from error
    except Exception as error:  # pydicom raises many types on damaged files
        if _has_dicom_preamble(path):
            raise DicomInputError(f"{path}: corrupt DICOM file ({type(error).__name__}: {error})") from error
        _skip(skipped, path, "not a DICOM file")  # without the preamble, only a dataset that parses is DICOM
        return None
    meta = getattr(instance.dataset, "file_meta", None)
    if meta is not None and uid_value(meta, "MediaStorageSOPClassUID") == MEDIA_STORAGE_DIRECTORY_STORAGE:
        _skip(skipped, path, "DICOMDIR (the folder is scanned directly instead)")
        return None
    return instance


def _has_dicom_preamble(path: Path) -> bool:
    with path.open("rb") as stream:
        return _has_preamble(stream.read(132))


def looks_like_dicom(head: bytes) -> bool:
    """Whether a file's first 132 bytes start as DICOM does: the preamble and "DICM", or (written without the
    preamble) a dataset's first tag."""
    return _has_preamble(head) or _starts_as_a_dataset(head)


def _has_preamble(head: bytes) -> bool:
    return head[128:132] == b"DICM"


def _starts_as_a_dataset(head: bytes) -> bool:
    """A little-endian dataset without preamble: its first element is in the file meta (group 0002, explicit VR)
    or in group 0008, where an image's first elements are (explicit VR, or implicit with a header-sized even
    length). Other binary files (a raw volume, a mask) may start with the same two bytes, rarely with all of it;
    one that does and then does not parse as a dataset with UIDs is skipped, not refused."""
    if len(head) < 8 or head[:2] not in (b"\x02\x00", b"\x08\x00"):
        return False
    if head[4:6] in _EXPLICIT_VRS:
        return True
    element, length = int.from_bytes(head[2:4], "little"), int.from_bytes(head[4:8], "little")
    return head[:2] == b"\x08\x00" and element < 0x0100 and length % 2 == 0 and length <= 1024


def _skip(skipped: list[tuple[Path, str]], path: Path, reason: str) -> None:
    if len(skipped) < _SKIPS_LOGGED:  # a CD's thousands of other files: the rest in one line at the end
        log.warning("skipping %s: %s", path, reason)
    skipped.append((path, reason))
