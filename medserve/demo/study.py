"""Write a volume as a CT Image Storage series with complete, realistic headers.

Used for the embedded demo study (`python -m medserve.demo.study OUT_DIR`), the benchmark series and the test
fixtures (oblique geometry, shuffled files, compressed transfer syntaxes, the real CT from PyPI).
"""

from __future__ import annotations

import argparse
import datetime
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from pydicom.dataset import Dataset, FileMetaDataset
from pydicom.uid import CTImageStorage, ExplicitVRLittleEndian, RLELossless, UID, generate_uid

from medserve.demo.phantom import make_phantom

IMPLEMENTATION_CLASS_UID = "1.2.826.0.1.3680043.10.1457.1"


@dataclass(frozen=True)
class SeriesGeometry:
    """Where slice 0's first voxel lies (LPS mm), the row/column direction cosines and the spacings (mm)."""

    origin: tuple[float, float, float] = (-150.0, -150.0, -70.0)
    orientation: tuple[float, ...] = (1.0, 0.0, 0.0, 0.0, 1.0, 0.0)
    pixel_spacing: tuple[float, float] = (3.0, 3.0)
    slice_spacing: float = 3.0

    @property
    def normal(self) -> np.ndarray:
        return np.cross(self.orientation[:3], self.orientation[3:])

    def slice_position(self, k: int) -> np.ndarray:
        return np.asarray(self.origin) + k * self.slice_spacing * self.normal

    def affine(self) -> np.ndarray:
        """LPS affine of (slice, row, column) indices, as highdicom.Volume reports it."""
        affine = np.eye(4)
        affine[:3, 0] = self.normal * self.slice_spacing
        affine[:3, 1] = np.asarray(self.orientation[3:]) * self.pixel_spacing[0]
        affine[:3, 2] = np.asarray(self.orientation[:3]) * self.pixel_spacing[1]
        affine[:3, 3] = self.origin
        return affine


@dataclass(frozen=True)
class Patient:
    name: str = "Demo^Phantom"
    patient_id: str = "MEDSERVE-DEMO-001"
    birth_date: str | None = "19700101"
    sex: str | None = "O"


@dataclass
class WrittenSeries:
    study_uid: str
    series_uid: str
    frame_of_reference_uid: str
    paths: list[Path] = field(default_factory=list)


def write_ct_series(hu: np.ndarray, out_dir: Path, geometry: SeriesGeometry = SeriesGeometry(), *,
                    transfer_syntax: UID = ExplicitVRLittleEndian, patient: Patient = Patient(),
                    study_uid: str | None = None, series_description: str = "Demo phantom CT",
                    file_order_seed: int | None = None) -> WrittenSeries:
    """Write `hu` (slice, row, column; Hounsfield units) as one file per slice under `out_dir`.

    With `file_order_seed`, file names are shuffled so that name order says nothing about slice order.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    written = WrittenSeries(study_uid=study_uid or generate_uid(), series_uid=generate_uid(),
                            frame_of_reference_uid=generate_uid())
    stored = np.clip(np.rint(hu + 1024.0), 0, 65535).astype(np.uint16)
    names = list(range(hu.shape[0]))
    if file_order_seed is not None:
        np.random.default_rng(file_order_seed).shuffle(names)
    now = datetime.datetime(2026, 1, 15, 9, 30, 0)
    for k in range(hu.shape[0]):
        dataset = _slice_dataset(stored[k], k, geometry, written, patient, series_description, now)
        if transfer_syntax != ExplicitVRLittleEndian:
            dataset.compress(transfer_syntax)
        path = out_dir / f"IM{names[k]:05d}.dcm"
        dataset.save_as(path, enforce_file_format=True)
        written.paths.append(path)
    return written


def _slice_dataset(pixels: np.ndarray, k: int, geometry: SeriesGeometry, written: WrittenSeries,
                   patient: Patient, series_description: str, when: datetime.datetime) -> Dataset:
    sop_uid = generate_uid()
    meta = FileMetaDataset()
    meta.MediaStorageSOPClassUID = CTImageStorage
    meta.MediaStorageSOPInstanceUID = sop_uid
    meta.TransferSyntaxUID = ExplicitVRLittleEndian
    meta.ImplementationClassUID = IMPLEMENTATION_CLASS_UID
    ds = Dataset()
    ds.file_meta = meta
    ds.SpecificCharacterSet = "ISO_IR 100"
    ds.ImageType = ["ORIGINAL", "PRIMARY", "AXIAL"]
    ds.SOPClassUID = CTImageStorage
    ds.SOPInstanceUID = sop_uid
    ds.StudyDate = ds.SeriesDate = ds.ContentDate = ds.AcquisitionDate = when.strftime("%Y%m%d")
    ds.StudyTime = ds.SeriesTime = ds.ContentTime = ds.AcquisitionTime = when.strftime("%H%M%S")
    ds.AccessionNumber = "DEMO0001"
    ds.Modality = "CT"
    ds.Manufacturer = "medserve"
    ds.ManufacturerModelName = "phantom"
    ds.InstitutionName = "medserve demo"
    ds.ReferringPhysicianName = ""
    ds.StudyDescription = "Demo abdomen CT"
    ds.SeriesDescription = series_description
    ds.PatientName = patient.name
    ds.PatientID = patient.patient_id
    if patient.birth_date is not None:
        ds.PatientBirthDate = patient.birth_date
    if patient.sex is not None:
        ds.PatientSex = patient.sex
    ds.BodyPartExamined = "ABDOMEN"
    ds.SliceThickness = f"{geometry.slice_spacing:g}"
    ds.KVP = "120"
    ds.PatientPosition = "HFS"
    ds.StudyInstanceUID = written.study_uid
    ds.SeriesInstanceUID = written.series_uid
    ds.StudyID = "1"
    ds.SeriesNumber = 2
    ds.AcquisitionNumber = 1
    ds.InstanceNumber = k + 1
    position = geometry.slice_position(k)
    ds.ImagePositionPatient = [f"{v:.6g}" for v in position]
    ds.ImageOrientationPatient = [f"{v:.8g}" for v in geometry.orientation]
    ds.FrameOfReferenceUID = written.frame_of_reference_uid
    ds.PositionReferenceIndicator = ""
    ds.SliceLocation = f"{float(position @ geometry.normal):.6g}"
    ds.SamplesPerPixel = 1
    ds.PhotometricInterpretation = "MONOCHROME2"
    ds.Rows, ds.Columns = pixels.shape
    ds.PixelSpacing = [f"{v:g}" for v in geometry.pixel_spacing]
    ds.BitsAllocated = 16
    ds.BitsStored = 16
    ds.HighBit = 15
    ds.PixelRepresentation = 0
    ds.WindowCenter = "40"
    ds.WindowWidth = "400"
    ds.RescaleIntercept = "-1024"
    ds.RescaleSlope = "1"
    ds.RescaleType = "HU"
    ds.PixelData = np.ascontiguousarray(pixels).tobytes()
    return ds


def write_demo_study(out_dir: Path, *, transfer_syntax: UID = ExplicitVRLittleEndian, seed: int = 2026):
    """The embedded demo study: one phantom (fixed seed) as a CT series. Returns (WrittenSeries, Phantom)."""
    phantom = make_phantom(seed=seed)
    geometry = SeriesGeometry(pixel_spacing=phantom.spacing[1:], slice_spacing=phantom.spacing[0])
    return write_ct_series(phantom.hu, out_dir, geometry, transfer_syntax=transfer_syntax), phantom


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write the medserve demo CT study (a DICOM series).")
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--rle", action="store_true", help="RLE Lossless instead of uncompressed")
    args = parser.parse_args(argv)
    written, _ = write_demo_study(args.out_dir, transfer_syntax=RLELossless if args.rle else ExplicitVRLittleEndian)
    print(f"wrote {len(written.paths)} slices of series {written.series_uid} to {args.out_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
