"""A loaded MONAI bundle, kept hot: network on its device, parsed transforms and inferer, label names.

The bundle's own config is the recipe. `monai.bundle.ConfigParser` parses it once; we only edit it as data
before parsing: file loading and saving transforms are removed (the volume arrives in memory, results leave
in memory) and `bundle_root`/`device` are set. The volume is fed as a MetaTensor whose affine is its real RAS
affine, exactly what `LoadImaged` would have produced from a file, so the bundle's orientation and spacing
transforms, and `Invertd` in its postprocessing, bring the prediction back into the source geometry. The
postprocessing runs as configured, on the network's device (the CPU when a GPU runs out of memory there); only its
torch.argmax on CPU tensors is answered by a faster torch kernel that gives the same indices
(`medserve.bundle.argmax`).

What a user can get wrong is a BundleError: a device this machine lacks (checked when the predictor is created),
and any failure of the bundle's own preprocessing, network/inferer or postprocessing on a volume (named with
the stage, the volume's shape and the original error). `as_volume` takes the stock SDK's Image as input too.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import threading
import zipfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import highdicom as hd
import monai
import nibabel as nib
import numpy as np
import torch
from monai.bundle import ConfigParser
from monai.data import MetaTensor
from monai.transforms import SpatialResample
from monai.utils import CommonKeys, ensure_tuple

from medserve.bundle.argmax import MaxIndicesArgmax, class_indices
from medserve.bundle.imports import bundle_code
from medserve.bundle.layout import INFERENCE_CONFIG_NAMES, BundleLayout, weights_file_problem
from medserve.dicom.volume import lps_affine, ras_affine
from medserve.errors import (BundleError, InferenceError, InferenceOutOfMemory, described, first_line,
                             on_one_line, one_line)
from medserve.writers.labels import MAX_LABEL

log = logging.getLogger("medserve.bundle")

_FILE_IO_TRANSFORMS = ("LoadImage", "SaveImage")
_CHANNEL_FIRST_TRANSFORMS = ("EnsureChannelFirst", "AddChannel")
# Arguments that published zoo bundles pass and later MONAI releases removed; they never affect the weights.
_REMOVED_NETWORK_ARGUMENTS = {"SwinUNETR": ("img_size",)}
# monai.bundle's component locator iterates sys.modules; an import in another thread (a server loading bundles
# while serving) makes that fail with "dictionary changed size during iteration". The parse is pure: retry it.
_IMPORT_RACE_ATTEMPTS = 5
# How much of a failing component's error text goes into the one-line message (the chained error keeps it all).
_CAUSE_CHARACTERS = 500
# MONAI's Compose wraps a transform's error in RuntimeError("applying transform <its repr>") from the original.
_MONAI_TRANSFORM_FAILURE = re.compile(r"applying transform <?([\w.]+)")
# Where MONAI's evaluators put the network output, whatever the metadata names the output ("seg", "label").
_PREDICTION_KEY = str(CommonKeys.PRED)
# A config value that is nothing but a reference to another entry: "@id" or "$@id" (ids nest with :: or #).
_REFERENCE = re.compile(r"^\$?@([\w#:]+)$")
# Affines equal within this (mm for the origin, mm per voxel for the axes) are the same grid.
_GRID_TOLERANCE = 1e-3


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def available_devices() -> list[str]:
    """The torch devices this process can run a bundle on: cpu, then cuda:0..n-1 and mps when present."""
    devices = ["cpu"]
    if torch.cuda.is_available():
        devices += [f"cuda:{index}" for index in range(torch.cuda.device_count())]
    if torch.backends.mps.is_available():
        devices.append("mps")
    return devices


def resolve_device(device: str | torch.device | None) -> torch.device:
    """`device` as a torch.device this machine has (None: the default); BundleError naming what is available."""
    if device is None:
        return default_device()
    available = ", ".join(available_devices())
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise BundleError(f"device {str(device)!r} is not a torch device name (e.g. cpu, cuda, cuda:0); "
                          f"available here: {available}") from None
    if resolved.type == "cpu":
        return resolved
    if resolved.type == "mps":
        present = torch.backends.mps.is_available() and resolved.index in (None, 0)
    else:  # cuda and torch's other accelerator backends (xpu, ...) expose is_available() and device_count()
        backend = getattr(torch, resolved.type, None)
        is_available = getattr(backend, "is_available", None)
        device_count = getattr(backend, "device_count", None)
        present = (callable(is_available) and callable(device_count) and bool(is_available())
                   and (resolved.index is None or resolved.index < device_count()))
    if not present:
        raise BundleError(f"device {str(device)!r} is not available on this machine; available here: {available}")
    return resolved


def as_volume(value: Any, role: str = "bundle inference input") -> hd.Volume:
    """A volume input (of bundle inference, of the NIfTI writer) as a highdicom.Volume: a Volume as it is, or a
    stock SDK Image converted.

    A `monai.deploy.core.Image` from the stock DICOMSeriesToVolumeOperator holds the voxels as a (slice, row,
    column) ("DHW") array, the same axis order as our volumes, and the geometry as metadata: `affine` with
    `space` ("RAS" by default, "LPS" with affine_lps_to_ras=False), `dicom_affine_transform` (LPS) and
    `nifti_affine_transform` (RAS). Those affines index voxels in the reverse order, (column, row, slice), as
    NIfTI and MONAI's readers do; here they become an LPS affine of (slice, row, column) indices. The DICOM-derived
    ones are taken first: an Image may carry an `affine` another operator left stale. The SDK scales
    the column axis by PixelSpacing[0] and the row axis by PixelSpacing[1], the reverse of DICOM's meaning
    (PixelSpacing is row spacing, then column spacing); where the affine shows exactly that, the two in-plane
    axes are rebuilt from the direction cosines and the right spacings, so a series with non-square pixels gets
    its true geometry (square pixels: nothing changes).

    What cannot be converted is an InferenceError whose message starts with `role`.
    """
    if isinstance(value, hd.Volume):
        return value
    if not (callable(getattr(value, "asnumpy", None)) and callable(getattr(value, "metadata", None))):
        raise InferenceError(f"{role}: expected a highdicom.Volume or a monai.deploy.core.Image; "
                             f"got {type(value).__module__}.{type(value).__qualname__}")
    array = np.asarray(value.asnumpy())
    metadata = value.metadata() or {}
    if array.ndim != 3:
        raise InferenceError(f"{role}: the Image's array has shape {array.shape}; expected 3 "
                             f"dimensions (slice, row, column)")
    # The DICOM-derived affines first: the stock MonaiBundleInferenceOperator copies its input's metadata onto its
    # prediction (in the input's grid) but leaves there the preprocessing grid's `affine`.
    if metadata.get("dicom_affine_transform") is not None:
        affine, space = metadata["dicom_affine_transform"], "LPS"
    elif metadata.get("nifti_affine_transform") is not None:
        affine, space = metadata["nifti_affine_transform"], "RAS"
    elif metadata.get("affine") is not None:
        affine, space = metadata["affine"], str(metadata.get("space") or "RAS").upper()
    else:
        raise InferenceError(f"{role}: the Image has no geometry; expected an 'affine' (with "
                             "'space'), 'dicom_affine_transform' or 'nifti_affine_transform' in its metadata")
    try:
        affine = np.array(affine, dtype=np.float64).reshape(4, 4)
    except (TypeError, ValueError):
        raise InferenceError(f"{role}: the Image's {space} affine is not a 4x4 matrix") from None
    if space not in ("RAS", "LPS"):
        raise InferenceError(f"{role}: the Image's metadata 'space' is {space!r}; expected RAS or LPS")
    lps = lps_affine(affine) if space == "RAS" else affine[:, [2, 1, 0, 3]]
    _correct_sdk_pixel_spacing(lps, metadata)
    try:
        return hd.Volume(array=array, affine=lps, coordinate_system="PATIENT")
    except (TypeError, ValueError) as error:
        raise InferenceError(f"{role}: the Image's geometry does not form a volume ({error})") \
            from error


def _correct_sdk_pixel_spacing(lps: np.ndarray, metadata: dict[str, Any]) -> None:
    """Undo the SDK's swapped in-plane spacings in `lps` (an LPS affine of (slice, row, column)), in place."""
    try:
        along_row = np.asarray(metadata["row_direction_cosine"], dtype=np.float64)  # ImageOrientationPatient[:3]
        along_column = np.asarray(metadata["col_direction_cosine"], dtype=np.float64)  # [3:]
        row_spacing = float(metadata["row_pixel_spacing"])  # PixelSpacing[0]: between rows
        column_spacing = float(metadata["col_pixel_spacing"])  # PixelSpacing[1]: between columns
    except (KeyError, TypeError, ValueError):
        return
    if along_row.shape != (3,) or along_column.shape != (3,):
        return
    if (np.allclose(lps[:3, 2], along_row * row_spacing, atol=1e-6)
            and np.allclose(lps[:3, 1], along_column * column_spacing, atol=1e-6)):
        lps[:3, 2] = along_row * column_spacing
        lps[:3, 1] = along_column * row_spacing


class BundlePredictor:
    """Runs one bundle on volumes: `predict(volume)` gives a uint16 label map in the volume's own geometry."""

    def __init__(self, layout: BundleLayout, parser: ConfigParser, network: torch.nn.Module, device: torch.device):
        self.layout = layout
        self.device = device
        self.network = network
        try:
            # "@image_key" in the transforms is resolved by the parser: so is the key itself ("$...IMAGE")
            self.image_key = str(parser.get_parsed_content("image_key")) if "image_key" in parser else "image"
            self.inferer = parser.get_parsed_content("inferer")
            self.preprocessing = parser.get_parsed_content("preprocessing")
            self.postprocessing = parser.get_parsed_content("postprocessing") if "postprocessing" in parser else None
        except Exception as error:  # any component of the config can fail to instantiate
            raise BundleError(f"{layout.config_path}: cannot build inferer/preprocessing/postprocessing: "
                              f"{_cause(error)}") from error
        steps = _steps(self.postprocessing)
        self.output_key = _prediction_key(layout, steps)
        # Sigmoid masks, one structure per channel: the evidence is in the postprocessing, not in a channel name.
        self.multi_label = layout.channel_zero_is_a_structure and _thresholds_without_argmax(steps)
        self.labels = layout.labels(self.multi_label)
        self._expects_channel_first = _uses_transform(parser, "preprocessing", _CHANNEL_FIRST_TRANSFORMS)
        self._inverts_preprocessing = "postprocessing" in parser and any(
            _target_name(step).startswith("Invert") for step in
            _nested(parser, _section_transforms(parser, "postprocessing")))
        # Transforms (Invertd's bookkeeping, random state) are not safe to share between threads.
        self._lock = threading.Lock()

    @property
    def name(self) -> str:
        return self.layout.name

    @property
    def version(self) -> str:
        return self.layout.version

    @property
    def description(self) -> str:
        return self.layout.description

    @classmethod
    def from_dir(cls, path: Path | str, device: str | torch.device | None = None) -> BundlePredictor:
        """Load the bundle at `path` on `device` (default: CUDA when available, else CPU).

        A device this machine does not have is refused (BundleError) before anything is read.
        """
        device = resolve_device(device)
        layout = BundleLayout.find(path)
        _check_input_format(layout)
        for attempt in range(_IMPORT_RACE_ATTEMPTS):
            try:
                with bundle_code(layout.root):
                    parser = _parse_config(layout, device)
                    network = _load_network(layout, parser, device)
                    predictor = cls(layout, parser, network, device)
                break
            except BundleError as error:
                if attempt + 1 == _IMPORT_RACE_ATTEMPTS or not _is_import_race(error):
                    raise
                log.info("retrying bundle load after a concurrent import", extra={"bundle": layout.name})
        log.info("loaded bundle", extra={"bundle": layout.name, "device": str(device),
                                         "labels": len(predictor.labels)})
        return predictor

    def memory_bytes(self) -> int:
        tensors = list(self.network.parameters()) + list(self.network.buffers())
        return sum(t.numel() * t.element_size() for t in tensors)

    def preprocess(self, volume: hd.Volume) -> torch.Tensor:
        """The bundle's preprocessing applied to `volume`: a (C, X, Y, Z) MetaTensor in the network's space."""
        return self.preprocessing({self.image_key: self._as_loaded_image(volume)})[self.image_key]

    def infer_tensor(self, batch: torch.Tensor) -> torch.Tensor:
        """The bundle's inferer over its network on a preprocessed (N, C, X, Y, Z) batch: raw network output.

        A failure is an InferenceError (InferenceOutOfMemory when memory ran out) naming the batch's shape.
        """
        with self._stage(self._network_stage, f"the input tensor of shape {list(batch.shape)}"):
            return self._network_output(batch)

    @torch.no_grad()
    def _network_output(self, batch: torch.Tensor) -> torch.Tensor:
        return self.inferer(batch.to(self.device), self.network)

    @property
    def _network_stage(self) -> str:
        return f"network/inferer ({type(self.inferer).__name__})"

    def predict(self, volume: hd.Volume) -> np.ndarray:
        """Label map (uint16, same (slice, row, column) shape and geometry as `volume.array`).

        A failure of the bundle's own preprocessing, network/inferer or postprocessing on this volume is a
        BundleError naming the bundle, the stage, the volume's shape and the original error (chained).
        """
        shape = tuple(volume.array.shape)
        on = f"the input volume of shape {shape} (slice, row, column)"
        if len(shape) != 3:
            raise InferenceError(f"bundle {self.name}: input volume has shape {shape}; expected 3 dimensions "
                                 f"(slice, row, column)")
        with self._lock:
            with self._stage("preprocessing", on):
                data = self.preprocessing({self.image_key: self._as_loaded_image(volume)})
                image = data[self.image_key]
            with self._stage(self._network_stage, on):
                batch = self._network_output(image.unsqueeze(0))
                if not isinstance(batch, torch.Tensor):  # a network returning a dict or tuple (deep supervision)
                    held = (f"keys {', '.join(map(repr, batch))}" if isinstance(batch, Mapping)
                            else f"{len(batch)} items" if isinstance(batch, (tuple, list)) else "no tensor")
                    raise InferenceError(f"bundle {self.name}: {self._network_stage} returned a "
                                         f"{type(batch).__qualname__} ({held}) on {on}; expected one tensor of "
                                         f"class scores")
                # Checked here, not after the postprocessing: an argmax there turns NaN scores into an empty label
                # map. Inside the stage: on a GPU the check itself may run out of memory, and says so.
                if not _all_finite(batch):
                    raise InferenceError(f"bundle {self.name}: {self._network_stage} returned NaN or infinite "
                                         f"values on {on}; expected finite class scores (are the weights damaged?)")
            data[self.output_key] = batch[0]
            if self.postprocessing is not None:
                with self._stage("postprocessing", on), MaxIndicesArgmax():
                    data = self._postprocess(data)
        return self._label_map(self._prediction(data), volume, getattr(image, "affine", None), tuple(image.shape[1:]))

    def _postprocess(self, data: dict[str, Any]) -> Any:
        """The bundle's postprocessing on the device its network ran on, as the bundle's own evaluator runs it.

        On a GPU, inverting the preprocessing resamples full-resolution class scores there (on CPU that took most
        of a 512x512x300 study's time). When that runs out of GPU memory (scores of many classes can take tens of
        GB), it runs again on the CPU.
        """
        try:
            return self.postprocessing(data)
        except Exception as error:  # torch and MONAI components raise any type
            if _out_of_memory(error) != "gpu":
                raise
        torch.cuda.empty_cache()
        log.warning("postprocessing ran out of GPU memory; running it on the CPU",
                    extra={"bundle": self.name, "device": str(self.device)})
        return self.postprocessing({key: value.cpu() if isinstance(value, torch.Tensor) else value
                                    for key, value in data.items()})

    @contextlib.contextmanager
    def _stage(self, stage: str, on: str) -> Iterator[None]:
        """Turn an error of the bundle's components into a one-line BundleError; out of memory says so.

        A SystemExit or GeneratorExit raised by the bundle's code (`exit(3)` in a Lambdad) is its failure too: let
        through, it ended the app with Holoscan's traceback and its output folder left behind. KeyboardInterrupt
        passes through untouched.
        """
        try:
            yield
        except BundleError:
            raise
        except (Exception, SystemExit, GeneratorExit) as error:  # torch and MONAI components raise any type
            where = f"bundle {self.name}: {stage} failed on {on}"
            memory = _out_of_memory(error)
            if memory == "gpu":
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()  # leave the device usable for the next, smaller, request
                raise InferenceOutOfMemory(f"{where}: out of GPU memory on {self.device} ({_cause(error)}); "
                                           f"free GPU memory, lower the inferer's sw_batch_size/roi_size, or use "
                                           f"device cpu") from error
            if memory == "host":
                raise InferenceOutOfMemory(f"{where}: out of host memory ({_cause(error)}); use a machine with "
                                           f"more memory or a smaller volume") from error
            raise InferenceError(f"{where}: {_cause(error)}") from error

    def _as_loaded_image(self, volume: hd.Volume) -> MetaTensor:
        """The volume as LoadImaged gives it: (X, Y, Z) = (column, row, slice) with a RAS affine."""
        array = _wrappable(volume.array, np.float32)
        # torch's permuted copy is blocked and threaded: about 1 s for a 512x512x300 volume on 2 cores, where
        # numpy's ascontiguousarray of the transposed view took 2.5 s (the same tensor).
        tensor = torch.from_numpy(array).permute(2, 1, 0).contiguous()
        affine = ras_affine(volume)
        meta = {
            "original_affine": affine,
            "spatial_shape": np.asarray(tensor.shape),
            "space": "RAS",
            "original_channel_dim": "no_channel",
            "filename_or_obj": "volume",
        }
        if not self._expects_channel_first:
            tensor = tensor.unsqueeze(0)
            meta["original_channel_dim"] = 0
        return MetaTensor(tensor, affine=torch.as_tensor(affine, dtype=torch.float64), meta=meta)

    def _prediction(self, data: Any) -> torch.Tensor:
        """What the postprocessing left under the output key, as a CPU tensor.

        A bundle whose postprocessing drops the key, or leaves something that is not numbers under it, is an
        InferenceError saying what it left instead.
        """
        where = f"bundle {self.name}: postprocessing"
        if not isinstance(data, Mapping):
            raise InferenceError(f"{where} returned a {type(data).__qualname__}; expected a dict holding the "
                                 f"prediction under '{self.output_key}'")
        if self.output_key not in data:
            raise InferenceError(f"{where} left no '{self.output_key}' (keys: {', '.join(map(str, data))}); expected "
                                 f"the label map or class scores under '{self.output_key}', where MONAI's evaluators "
                                 f"put the network output")
        prediction = data[self.output_key]
        if isinstance(prediction, torch.Tensor):
            return prediction.detach().cpu()
        try:
            array = np.asarray(prediction)
        except ValueError:  # ragged sequences
            array = None
        if array is None or array.dtype.kind not in "biuf":
            raise InferenceError(f"{where} left '{self.output_key}' as {type(prediction).__module__}."
                                 f"{type(prediction).__qualname__}"
                                 f"{f' of dtype {array.dtype}' if array is not None else ''}; expected a tensor "
                                 f"or array of labels or class scores")
        return torch.from_numpy(_wrappable(array))

    def _label_map(self, scores: torch.Tensor, volume: hd.Volume, network_affine: torch.Tensor | None,
                   network_shape: tuple[int, ...]) -> np.ndarray:
        """The label map on the input's grid, from what the postprocessing left; `network_affine` and
        `network_shape`: the grid the network saw, where a prediction that lost its geometry lies unless the
        postprocessing inverts the preprocessing."""
        shape = tuple(volume.array.shape)
        if not _all_finite(scores):
            raise InferenceError(f"bundle {self.name}: postprocessing returned NaN or infinite values in "
                                 f"'{self.output_key}'; expected labels")  # before an argmax makes them label 0
        grid = self._grid(scores, volume, network_affine, network_shape)
        if scores.ndim == 4 and self.multi_label:  # one sigmoid mask too: left unthresholded, it is refused
            scores = self._masks_as_labels(scores)
        elif scores.ndim == 4 and scores.shape[0] > 1:
            scores = class_indices(scores)  # the bundle left class scores: take the winning class
        elif scores.ndim == 4:
            scores = scores[0]
        if grid is not None and scores.ndim == 3:
            scores = self._on_input_grid(scores, grid, volume)
        values = scores.numpy()
        if values.shape[::-1] != shape:
            raise BundleError(f"bundle {self.name}: postprocessing returned shape {values.shape} (X, Y, Z); "
                              f"expected the input's {shape[::-1]}: does its postprocessing invert the "
                              f"preprocessing (Invertd)?")
        if values.size and (values.min() < 0 or values.max() > MAX_LABEL):
            raise BundleError(f"bundle {self.name}: label values {values.min()}..{values.max()} are outside "
                              f"0..{MAX_LABEL}")
        if values.dtype.kind == "f":
            values = np.rint(values)
        # (slice, row, column) in C order: highdicom cuts frames as slices and the NIfTI writer writes the transpose
        # as it lies. Writing the SEG and NIfTI of a 512x512x300 map took 4.0 s from the transposed view, 2.0 s
        # from a C-ordered copy, the copy included.
        return values.transpose(2, 1, 0).astype(np.uint16, order="C")

    def _grid(self, scores: torch.Tensor, volume: hd.Volume, network_affine: torch.Tensor | None,
              network_shape: tuple[int, ...]) -> torch.Tensor | None:
        """The RAS affine of the grid the prediction lies on; None for a plain tensor or array (taken as lying on
        the input's grid, as MONAI's evaluators take it).

        A MetaTensor with MetaTensor's default (identity) affine lost its geometry: a transform such as Lambdad
        wraps a plain result so (`torch.as_tensor(x.numpy())`), and resampled from the identity the organ moved.
        Its grid is then the one the network saw, or the input's when the postprocessing inverts the
        preprocessing (Invertd); of another shape than that grid's, nothing says where it lies, and it is
        refused. An input whose own affine is the identity leaves nothing to tell apart."""
        affine = scores.affine if isinstance(scores, MetaTensor) else None
        identity = np.eye(4)
        if affine is None or not np.array_equal(np.asarray(affine), identity):
            return affine
        input_affine = ras_affine(volume)
        if np.array_equal(input_affine, identity):
            return affine
        inverted = self._inverts_preprocessing or network_affine is None  # a plain tensor fed the network
        grid, grid_shape = (input_affine, volume.array.shape[::-1]) if inverted else (
            np.asarray(network_affine, dtype=np.float64), network_shape)
        if tuple(scores.shape[-3:]) != tuple(grid_shape):
            raise InferenceError(f"bundle {self.name}: postprocessing returned '{self.output_key}' of shape "
                                 f"{tuple(scores.shape)} without its geometry (an identity affine, as a transform "
                                 f"returning a plain tensor leaves it); expected the spatial shape "
                                 f"{tuple(grid_shape)} (X, Y, Z) of the {'input' if inverted else 'network input'}, "
                                 f"or a MetaTensor that keeps its affine")
        log.warning("the prediction carries no geometry (an identity affine); taken as lying on the grid of the "
                    "%s, whose shape it has", "input" if inverted else "network input", extra={"bundle": self.name})
        return torch.as_tensor(grid)

    def _on_input_grid(self, labels: torch.Tensor, affine: torch.Tensor, volume: hd.Volume) -> torch.Tensor:
        """Labels (X, Y, Z) whose RAS `affine` the postprocessing left as something other than the input's: moved
        onto the input's grid.

        A bundle without Invertd leaves its prediction in the space of its preprocessing, as MONAI's SaveImaged
        writes it with that affine: Orientationd alone keeps the shape of an LPS series but mirrors rows and
        columns, so the grid is checked, not the shape. When the two grids differ only by axis flips and
        permutations the labels are rearranged exactly; otherwise they are resampled, nearest neighbour.
        """
        labels = labels.as_tensor() if isinstance(labels, MetaTensor) else labels
        target = ras_affine(volume)
        target_shape = tuple(volume.array.shape[::-1])
        source = np.asarray(affine, dtype=np.float64)
        if tuple(labels.shape) == target_shape and np.allclose(source, target, atol=_GRID_TOLERANCE):
            return labels
        log.info("prediction is not on the input grid; moving it there",
                 extra={"bundle": self.name, "prediction_shape": list(labels.shape)})
        exact = _reoriented(labels, source, target, target_shape)
        if exact is not None:
            return exact
        resample = SpatialResample(mode="nearest", padding_mode="zeros", dtype=torch.float64)
        moved = resample(MetaTensor(labels[None].to(torch.float32), affine=torch.as_tensor(source)),
                         dst_affine=torch.as_tensor(target), spatial_size=target_shape)
        return moved[0].as_tensor().to(labels.dtype)

    def _masks_as_labels(self, masks: torch.Tensor) -> torch.Tensor:
        """A multi-label output's binary channels (C, X, Y, Z) as one label map: channel i is label i + 1.

        Taking the highest channel, as for class scores, would put channel 0 in the background and let one mask
        hide another. Values other than 0/1 (sigmoid probabilities left unthresholded) and masks that overlap (one
        label map cannot hold both) are refused, naming what was found.
        """
        where = f"bundle {self.name}: its multi-label output '{self.output_key}' ({masks.shape[0]} channels)"
        if not bool(((masks == 0) | (masks == 1)).all()):
            raise InferenceError(f"{where} holds values other than 0 and 1; expected binary masks, e.g. from "
                                 f"AsDiscreted(threshold=0.5) at the end of the bundle's postprocessing")
        present = masks > 0
        count = present.sum(0, dtype=torch.int16)
        overlapping = count > 1
        if bool(overlapping.any()):
            first = present[(slice(None), *overlapping.nonzero()[0])].nonzero().flatten().tolist()
            names = " and ".join(f"{channel} ({self.labels.get(channel + 1, 'unnamed')!r})" for channel in first)
            raise InferenceError(f"{where} has channels that overlap: {int(overlapping.sum())} voxels are in more "
                                 f"than one mask (first: channels {names}); medserve writes one label per voxel "
                                 f"and cannot represent overlapping structures")
        return torch.where(count > 0, class_indices(present.to(torch.uint8)) + 1, 0)


def _all_finite(values: Any) -> bool:
    """No NaN or infinity among float `values`: their minimum and maximum say so (NaN and infinities reach both),
    in one pass that copies nothing, where a sum in float64 copied the scores of every class."""
    if not isinstance(values, torch.Tensor) or not values.is_floating_point() or values.numel() == 0:
        return True
    low, high = torch.aminmax(values)
    return bool(torch.isfinite(low) and torch.isfinite(high))


def _reoriented(labels: torch.Tensor, source: np.ndarray, target: np.ndarray,
                target_shape: tuple[int, ...]) -> torch.Tensor | None:
    """`labels` on the `source` grid rearranged onto the `target` grid by flips and axis permutations alone, or None
    when the grids differ otherwise (spacing, origin, rotation)."""
    transform = nib.orientations.ornt_transform(nib.orientations.io_orientation(source),
                                                nib.orientations.io_orientation(target))
    in_shape = tuple(labels.shape)
    rearranged_affine = source @ nib.orientations.inv_ornt_aff(transform, in_shape)
    out_shape = tuple(in_shape[int(axis)] for axis in np.argsort(transform[:, 0]))
    if out_shape != target_shape or not np.allclose(rearranged_affine, target, atol=_GRID_TOLERANCE):
        return None
    return torch.from_numpy(np.ascontiguousarray(nib.orientations.apply_orientation(labels.numpy(), transform)))


def _steps(transform: Any) -> list[Any]:
    """The transforms of a (nested) Compose, in order; [] for none."""
    if transform is None:
        return []
    inner = getattr(transform, "transforms", None)
    if isinstance(inner, (list, tuple)):
        return [step for item in inner for step in _steps(item)]
    return [transform]


def _set_anywhere(step: Any, attribute: str) -> bool:
    """Whether a transform's option (per key in dictionary transforms) is set for some key: True, or a value
    that is not None/False (a threshold of 0.0 is set)."""
    return any(value is not None and value is not False for value in ensure_tuple(getattr(step, attribute, None)))


def _thresholds_without_argmax(steps: list[Any]) -> bool:
    """A postprocessing that makes binary masks (sigmoid and/or a threshold) and takes no argmax."""
    masks = any(_set_anywhere(step, "sigmoid") or _set_anywhere(step, "threshold") for step in steps)
    return masks and not any(_set_anywhere(step, "argmax") for step in steps)


def _prediction_key(layout: BundleLayout, steps: list[Any]) -> str:
    """"pred", where MONAI's evaluators put the network output; the metadata's own output name where the
    postprocessing reads that name and not "pred" (a bundle written for it to be there)."""
    named = layout.output_key
    keys = {str(key) for step in steps for key in ensure_tuple(getattr(step, "keys", ()))}
    return named if named != _PREDICTION_KEY and named in keys and _PREDICTION_KEY not in keys else _PREDICTION_KEY


def _wrappable(array: np.ndarray, dtype: np.dtype | type | None = None) -> np.ndarray:
    """`array` (as `dtype`) in a form `torch.from_numpy` can share: as it is when writable with non-negative
    strides, else a C-ordered copy."""
    if (dtype is not None and array.dtype != dtype) or not array.flags.writeable or min(array.strides, default=0) < 0:
        return np.array(array, dtype=dtype, order="C")
    return array


def _error_chain(error: BaseException) -> list[BaseException]:
    chain: list[BaseException] = []
    current: BaseException | None = error
    while current is not None and current not in chain:
        chain.append(current)
        current = current.__cause__ or (None if current.__suppress_context__ else current.__context__)
    return chain


def _out_of_memory(error: BaseException) -> str | None:
    """'gpu' or 'host' when `error` (or what it wraps) is an allocation failure, else None."""
    for link in _error_chain(error):
        text = str(link)
        if isinstance(link, torch.cuda.OutOfMemoryError) or "CUDA out of memory" in text:
            return "gpu"
        if isinstance(link, MemoryError) or "DefaultCPUAllocator: can't allocate memory" in text:
            return "host"
    return None


def _cause(error: BaseException) -> str:
    """One line: the innermost error's type and text, with the MONAI transform it happened in."""
    chain = _error_chain(error)
    transforms = [m.group(1).rsplit(".", 1)[-1] for link in chain
                  if (m := _MONAI_TRANSFORM_FAILURE.match(str(link)))]
    root = chain[-1]
    text = root.args[0] if isinstance(root, KeyError) and len(root.args) == 1 else str(root)
    text = on_one_line(text)
    if len(text) > _CAUSE_CHARACTERS:
        text = text[:_CAUSE_CHARACTERS] + "..."
    described = f"{type(root).__name__}: {text}" if text else type(root).__name__
    return f"in {transforms[-1]}: {described}" if transforms else described


def _is_import_race(error: BaseException | None) -> bool:
    while error is not None:
        if isinstance(error, RuntimeError) and "changed size during iteration" in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False


def _parse_config(layout: BundleLayout, device: torch.device) -> ConfigParser:
    parser = ConfigParser()
    try:
        parser.read_meta(str(layout.metadata_path))
        config = ConfigParser.load_config_file(str(layout.config_path))
    except Exception as error:  # json/yaml decoders raise their own types
        raise BundleError(f"{layout.config_path}: cannot read config ({type(error).__name__}: {error})") from error
    parser.read_config(config)  # a mapping: BundleLayout.find checked the file decodes to one
    required = ("preprocessing", "inferer") if layout.weights_path.suffix == ".ts" else \
        ("network_def", "preprocessing", "inferer")  # TorchScript holds its network
    for key in required:
        if key not in parser:
            raise BundleError(f"{layout.config_path}: '{key}' is missing; a segmentation bundle's inference "
                              f"config defines {', '.join(required)} (and postprocessing)")
    parser["bundle_root"] = str(layout.root)
    parser["device"] = f"$torch.device('{device}')"
    _inferer_on_the_device(parser)
    for section in ("preprocessing", "postprocessing"):
        if section in parser:
            _drop_transforms(parser, section, _FILE_IO_TRANSFORMS, layout)
    return parser


def _inferer_on_the_device(parser: ConfigParser) -> None:
    """An inferer `device`/`sw_device` that picks a GPU itself (wholeBody_ct_segmentation writes
    "$torch.device('cuda:0' if torch.cuda.is_available() else 'cpu')") follows the chosen device instead: with
    --device cpu on a GPU host, its sliding window would otherwise stitch the full-size output on cuda:0, and
    --device cuda:1 would put it on cuda:0. A plain 'cpu' there (stitching kept off the GPU on purpose) stays."""
    inferer = parser["inferer"]
    if not isinstance(inferer, dict):
        return
    for key in ("device", "sw_device"):
        value = inferer.get(key)
        if isinstance(value, str) and "cuda" in value:
            parser[f"inferer#{key}"] = "@device"


def _section_transforms(parser: ConfigParser, section: str) -> list[Any] | None:
    """The `transforms` list of the Compose `section`, also when the section or its list refers to one defined
    elsewhere in the config (the zoo's segmentation_template: `transforms: $@transforms`); None when there is no
    such list."""
    compose = _dereferenced(parser, parser[section])  # "preprocessing": "@pre" as well
    transforms = _dereferenced(parser, compose.get("transforms")) if isinstance(compose, dict) else None
    return transforms if isinstance(transforms, list) else None


def _dereferenced(parser: ConfigParser, value: Any) -> Any:
    """`value`, or when it is nothing but a reference ("@id", "$@id") the config entry it names, followed through
    chains of references; None for a reference to nothing, or a cycle."""
    return _followed(parser, value, None)[1]


def _followed(parser: ConfigParser, value: Any, at: str | None) -> tuple[str | None, Any]:
    """(id, value) of the config entry `value` (found at id `at`) ends at once its references are followed."""
    followed: set[str] = set()
    while isinstance(value, str) and (reference := _REFERENCE.match(value.strip())):
        target = reference.group(1)
        if target in followed or target not in parser:
            return None, None
        followed.add(target)
        at, value = target, parser[target]
    return at, value


def _transform_list(parser: ConfigParser, section: str, layout: BundleLayout) -> list[Any]:
    transforms = _section_transforms(parser, section)
    if transforms is None:
        raise BundleError(f"{layout.config_path}: '{section}' must be a Compose with a 'transforms' list (or a "
                          f"reference to one)")
    return transforms


def _target_name(transform: Any) -> str:
    target = transform.get("_target_", "") if isinstance(transform, dict) else ""
    return str(target).rsplit(".", 1)[-1]


def _drop_transforms(parser: ConfigParser, section: str, prefixes: tuple[str, ...], layout: BundleLayout) -> None:
    """Remove the transforms whose class name starts with one of `prefixes`, written in the list or named there by
    reference ("@load_image", defined elsewhere in the config), also inside a nested Compose (or any transform
    holding a `transforms` list): a SaveImaged there wrote into the bundle folder."""
    transforms = _transform_list(parser, section, layout)
    compose = _followed(parser, parser[section], section)[0]  # "preprocessing": "@pre": the list is pre's
    parser[f"{compose}#transforms"] = _without(parser, transforms, prefixes)


def _without(parser: ConfigParser, transforms: list[Any], prefixes: tuple[str, ...],
             inside: frozenset[int] = frozenset()) -> list[Any]:
    kept = []
    for transform in transforms:
        written = _dereferenced(parser, transform)
        if _target_name(written).startswith(prefixes):
            continue
        nested = _nested_list(parser, written, inside)
        if nested is not None:  # changed in the config itself, where a reference to it points too
            written["transforms"] = _without(parser, nested, prefixes, inside | {id(written)})
        kept.append(transform)
    return kept


def _uses_transform(parser: ConfigParser, section: str, prefixes: tuple[str, ...]) -> bool:
    return any(_target_name(t).startswith(prefixes) for t in _nested(parser, _section_transforms(parser, section)))


def _nested(parser: ConfigParser, transforms: list[Any] | None, inside: frozenset[int] = frozenset()) -> Iterator[Any]:
    """The transforms of a list, references followed, and those of the lists nested in them, in order."""
    for transform in transforms or []:
        written = _dereferenced(parser, transform)
        yield written
        nested = _nested_list(parser, written, inside)
        if nested is not None:
            yield from _nested(parser, nested, inside | {id(written)})


def _nested_list(parser: ConfigParser, transform: Any, inside: frozenset[int]) -> list[Any] | None:
    """The `transforms` list a Compose (OneOf, ...) holds, None for other transforms and for a Compose that holds
    itself, which MONAI cannot build either."""
    if not isinstance(transform, dict) or id(transform) in inside:
        return None
    nested = _dereferenced(parser, transform.get("transforms"))
    return nested if isinstance(nested, list) else None


def network_from_config(config_path: Path) -> torch.nn.Module:
    """The untrained network of a bundle config (random weights), e.g. to give a config weights for tests."""
    parser = ConfigParser()
    parser.read_config(str(config_path))
    parser["bundle_root"] = str(config_path.parent.parent)  # as for inference: networks may read files from it
    with bundle_code(config_path.parent.parent):
        return build_network(config_path, parser)


def write_random_weights(bundle: Path, seed: int = 0) -> Path:
    """Give a bundle published without weights (a model-zoo config) `models/model.pt`: its own network_def's
    untrained weights, drawn with `seed`, e.g. to run the config in tests and benchmarks. Returns the file."""
    configs = bundle / "configs"
    config = next(configs / name for name in INFERENCE_CONFIG_NAMES if (configs / name).is_file())
    torch.manual_seed(seed)
    weights = bundle / "models" / "model.pt"
    weights.parent.mkdir(exist_ok=True)
    torch.save(network_from_config(config).state_dict(), weights)
    return weights


def build_network(config_path: Path, parser: ConfigParser) -> torch.nn.Module:
    """Instantiate network_def, dropping arguments MONAI has since removed when a published config passes them."""
    network = _instantiated_network(config_path, parser)
    if not isinstance(network, torch.nn.Module):  # a list, a string, a transform: it has no weights to load
        raise BundleError(f"{config_path}: network_def builds {described(network)}; expected a torch.nn.Module "
                          f"(a `_target_` naming a network class, e.g. monai.networks.nets.UNet)")
    return network


def _instantiated_network(config_path: Path, parser: ConfigParser) -> Any:
    target = _target_name(parser["network_def"])
    try:
        return parser.get_parsed_content("network_def", instantiate=True, lazy=False)
    except Exception as error:  # any network constructor argument can be wrong
        removed = [a for a in _REMOVED_NETWORK_ARGUMENTS.get(target, ())
                   if isinstance(parser["network_def"], dict) and a in parser["network_def"]]
        if not removed:
            raise BundleError(f"{config_path}: cannot build network_def ({_cause(error)})") from error
    log.warning("dropping network_def arguments %s: MONAI %s's %s no longer takes them", removed,
                monai.__version__, target)
    for argument in removed:
        parser["network_def"].pop(argument)
    parser.parse()
    try:
        return parser.get_parsed_content("network_def", instantiate=True, lazy=False)
    except Exception as error:  # any network constructor argument can be wrong
        raise BundleError(f"{config_path}: cannot build network_def ({_cause(error)})") from error


def _load_network(layout: BundleLayout, parser: ConfigParser, device: torch.device) -> torch.nn.Module:
    if layout.weights_path.suffix == ".ts":
        try:
            network = torch.jit.load(str(layout.weights_path), map_location=device)
        except Exception as error:  # torch.jit raises RuntimeError or its own error types
            raise BundleError(f"{layout.weights_path}: not a loadable TorchScript model ({error})") from error
        return network.eval()
    if _is_torchscript(layout.weights_path):  # torch.load's own error suggests unpickling it unsafely instead
        raise BundleError(f"{layout.weights_path}: a TorchScript model, where model.pt holds a state dict; rename it "
                          f"to models/model.ts")
    network = build_network(layout.config_path, parser)
    try:
        checkpoint = torch.load(str(layout.weights_path), map_location="cpu", weights_only=True)
    except Exception as error:  # truncated files, pickles that weights_only refuses, non-torch files
        raise BundleError(f"{layout.weights_path}: {_unreadable_weights(layout.weights_path, error)}") from error
    state = checkpoint.get("model", checkpoint) if isinstance(checkpoint, dict) else None
    if not isinstance(state, dict):
        raise BundleError(f"{layout.weights_path}: expected a state dict (or a checkpoint with a 'model' entry)")
    try:
        network.load_state_dict(state, strict=True)
    except RuntimeError as error:
        summary = _state_dict_mismatch(error)
        raise BundleError(f"{layout.weights_path}: weights do not fit network_def "
                          f"{type(network).__name__} in {layout.config_path.name}: {summary}") from error
    return network.to(device).eval()


def _unreadable_weights(path: Path, error: Exception) -> str:
    """Why torch.load refused a model.pt, in words: its own text is a KeyError of a stray byte for a file that is
    no torch file at all, and advice to unpickle unsafely for a pickled model."""
    problem = weights_file_problem(path)
    if problem is not None:
        return problem
    refused = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(error))
    if refused:
        return (f"holds a pickled {refused.group(1)} object, which medserve does not unpickle (unpickling can run "
                f"any code); expected a state dict, saved with torch.save(model.state_dict(), path)")
    return f"not a readable PyTorch weights file ({type(error).__name__}: {one_line(first_line(error))})"


def _state_dict_mismatch(error: RuntimeError, shown: int = 4, width: int = 160) -> str:
    """torch's load_state_dict error on one line, as every `error:` is: it lists each kind of mismatch (missing
    keys, unexpected keys, one line per size mismatch) on its own line, some of them thousands of characters."""
    lines = [line.strip() for line in str(error).splitlines()[1:] if line.strip()]
    kept = [line if len(line) <= width else line[:width - 4] + " ..." for line in lines[:shown]]
    more = f"; and {len(lines) - shown} more" if len(lines) > shown else ""
    return "; ".join(kept) + more


def _is_torchscript(path: Path) -> bool:
    """Whether `path` is a TorchScript archive: a zip whose records hold the scripted code (`<name>/code/`)."""
    try:
        with zipfile.ZipFile(path) as archive:
            return any("/code/" in name for name in archive.namelist())
    except (OSError, zipfile.BadZipFile):
        return False


def _check_input_format(layout: BundleLayout) -> None:
    """A bundle whose input is not one 3D image (a BraTS-style 4-channel input, a 2D model) is refused before
    it is loaded, from what its metadata declares, rather than failing deep in its network."""
    inputs = layout.metadata.get("network_data_format", {}).get("inputs", {})
    image = next(iter(inputs.values()), None) if isinstance(inputs, dict) else None
    if not isinstance(image, dict):
        return
    channels, shape = image.get("num_channels"), image.get("spatial_shape")
    where = f"bundle {layout.name}: {layout.metadata_path.name} network_data_format.inputs"
    if isinstance(channels, float) and channels.is_integer():
        channels = int(channels)  # JSON writers may give 1.0
    if channels is not None and (not isinstance(channels, int) or isinstance(channels, bool)):
        raise BundleError(f"{where} num_channels is {json.dumps(channels)}; expected a whole number (1: medserve "
                          f"feeds a bundle one series)")
    if isinstance(channels, int) and channels != 1:
        raise BundleError(f"{where} num_channels is {channels}; medserve feeds a bundle one series, a single-channel "
                          f"image (a multi-sequence input needs its own app)")
    if isinstance(shape, list) and len(shape) == 2:
        raise BundleError(f"{where} spatial_shape {shape} is 2D; medserve feeds a bundle a 3D volume")
