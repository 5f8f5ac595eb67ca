"""The files a run writes, by result format, and their media types. This module imports nothing: the CLI
client names results with it without loading the inference stack."""

SEG_NAME = "seg.dcm"
NIFTI_NAME = "labels.nii.gz"
RESULT_FILES = {"seg": SEG_NAME, "nifti": NIFTI_NAME}
RESULT_MEDIA = {"seg": "application/dicom", "nifti": "application/gzip"}
