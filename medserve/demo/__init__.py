"""The embedded demo: CT-like phantoms, the DICOM series written from them, and the demo bundle's training."""
