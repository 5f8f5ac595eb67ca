"""medserve: MONAI bundles to DICOM SEG, as App SDK operators, MAPs and a model server."""

__version__ = "0.1.0"
