"""Result writers: DICOM SEG (`seg`, highdicom) and NIfTI label maps (`nifti`, nibabel)."""
