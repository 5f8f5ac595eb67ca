"""The medserve model server: a bundle store with hot models, sync and async inference, tus uploads, DICOMweb
and the Open Inference Protocol v2, all on top of medserve's core (bundle, pipeline)."""
