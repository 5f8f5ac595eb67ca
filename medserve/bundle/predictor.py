"""A loaded MONAI bundle, kept hot: network on its device, parsed transforms and inferer, label names.

The bundle's own config is the recipe. `monai.bundle.ConfigParser` parses it once; we only edit it as data
before parsing: file loading and saving transforms are removed (the volume arrives in memory, results leave
in memory) and `bundle_root`/`device` are set. The volume is fed as a MetaTensor whose affine is its real RAS
affine, exactly what `LoadImaged` would have produced from a file, so the bundle's orientation and spacing
transforms, and `Invertd` in its postprocessing, bring the prediction back into the source geometry.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import highdicom as hd
import monai
import numpy as np
import torch
from monai.bundle import ConfigParser
from monai.data import MetaTensor

from medserve.bundle.layout import BundleLayout
from medserve.dicom.volume import ras_affine
from medserve.errors import BundleError

log = logging.getLogger("medserve.bundle")

_FILE_IO_TRANSFORMS = ("LoadImage", "SaveImage")
_CHANNEL_FIRST_TRANSFORMS = ("EnsureChannelFirst", "AddChannel")
MAX_LABEL = 65535
# Arguments that published zoo bundles pass and later MONAI releases removed; they never affect the weights.
_REMOVED_NETWORK_ARGUMENTS = {"SwinUNETR": ("img_size",)}
# monai.bundle's component locator iterates sys.modules; an import in another thread (a server loading bundles
# while serving) makes that fail with "dictionary changed size during iteration". The parse is pure: retry it.
_IMPORT_RACE_ATTEMPTS = 5


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class BundlePredictor:
    """Runs one bundle on volumes: `predict(volume)` gives a uint16 label map in the volume's own geometry."""

    def __init__(self, layout: BundleLayout, parser: ConfigParser, network: torch.nn.Module, device: torch.device):
        self.layout = layout
        self.device = device
        self.network = network
        self.image_key = str(parser.get("image_key", "image"))
        self.output_key = layout.output_key
        self.labels = layout.labels()
        try:
            self.inferer = parser.get_parsed_content("inferer")
            self.preprocessing = parser.get_parsed_content("preprocessing")
            self.postprocessing = parser.get_parsed_content("postprocessing") if "postprocessing" in parser else None
        except Exception as error:  # any component of the config can fail to instantiate
            raise BundleError(f"{layout.config_path}: cannot build inferer/preprocessing/postprocessing: "
                              f"{error}") from error
        self._expects_channel_first = _uses_transform(parser, "preprocessing", _CHANNEL_FIRST_TRANSFORMS)
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
        """Load the bundle at `path` on `device` (default: CUDA when available, else CPU)."""
        layout = BundleLayout.find(path)
        device = torch.device(device) if device is not None else default_device()
        for attempt in range(_IMPORT_RACE_ATTEMPTS):
            try:
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

    @torch.no_grad()
    def infer_tensor(self, batch: torch.Tensor) -> torch.Tensor:
        """The bundle's inferer over its network on a preprocessed (N, C, X, Y, Z) batch: raw network output."""
        return self.inferer(batch.to(self.device), self.network)

    def predict(self, volume: hd.Volume) -> np.ndarray:
        """Label map (uint16, same (slice, row, column) shape and geometry as `volume.array`)."""
        with self._lock:
            data = self.preprocessing({self.image_key: self._as_loaded_image(volume)})
            image = data[self.image_key]
            data[self.output_key] = self.infer_tensor(image.unsqueeze(0))[0].to("cpu")
            if self.postprocessing is not None:
                data = self.postprocessing(data)
        return self._label_map(data[self.output_key], volume.array.shape)

    def _as_loaded_image(self, volume: hd.Volume) -> MetaTensor:
        """The volume as LoadImaged gives it: (X, Y, Z) = (column, row, slice) with a RAS affine."""
        array = np.asarray(volume.array, dtype=np.float32).transpose(2, 1, 0)
        affine = ras_affine(volume)
        meta = {
            "original_affine": affine,
            "spatial_shape": np.asarray(array.shape),
            "space": "RAS",
            "original_channel_dim": "no_channel",
            "filename_or_obj": "volume",
        }
        tensor = torch.from_numpy(np.ascontiguousarray(array))
        if not self._expects_channel_first:
            tensor = tensor.unsqueeze(0)
            meta["original_channel_dim"] = 0
        return MetaTensor(tensor, affine=torch.as_tensor(affine, dtype=torch.float64), meta=meta)

    def _label_map(self, prediction: Any, shape: tuple[int, ...]) -> np.ndarray:
        values = prediction.detach().cpu().numpy() if isinstance(prediction, torch.Tensor) else np.asarray(prediction)
        if values.ndim == 4 and values.shape[0] > 1:
            values = values.argmax(axis=0)  # the bundle left class scores: take the winning class
        elif values.ndim == 4:
            values = values[0]
        values = values.transpose(2, 1, 0)
        if values.shape != tuple(shape):
            raise BundleError(f"bundle {self.name}: postprocessing returned shape {values.shape[::-1]} (X, Y, Z); "
                              f"expected the input's {tuple(shape)[::-1]}: does its postprocessing invert the "
                              f"preprocessing (Invertd)?")
        if values.size and (values.min() < 0 or values.max() > MAX_LABEL):
            raise BundleError(f"bundle {self.name}: label values {values.min()}..{values.max()} are outside "
                              f"0..{MAX_LABEL}")
        return np.rint(values).astype(np.uint16)


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
        parser.read_config(str(layout.config_path))
    except Exception as error:  # json/yaml decoders raise their own types
        raise BundleError(f"{layout.config_path}: cannot read config ({type(error).__name__}: {error})") from error
    for key in ("network_def", "preprocessing", "inferer"):
        if key not in parser:
            raise BundleError(f"{layout.config_path}: '{key}' is missing; a segmentation bundle's inference "
                              f"config defines network_def, preprocessing, inferer (and postprocessing)")
    parser["bundle_root"] = str(layout.root)
    parser["device"] = f"$torch.device('{device}')"
    for section in ("preprocessing", "postprocessing"):
        if section in parser:
            _drop_transforms(parser, section, _FILE_IO_TRANSFORMS, layout)
    return parser


def _transform_list(parser: ConfigParser, section: str, layout: BundleLayout) -> list[Any]:
    transforms = parser[section].get("transforms") if isinstance(parser[section], dict) else None
    if not isinstance(transforms, list):
        raise BundleError(f"{layout.config_path}: '{section}' must be a Compose with a 'transforms' list")
    return transforms


def _target_name(transform: Any) -> str:
    target = transform.get("_target_", "") if isinstance(transform, dict) else ""
    return str(target).rsplit(".", 1)[-1]


def _drop_transforms(parser: ConfigParser, section: str, prefixes: tuple[str, ...], layout: BundleLayout) -> None:
    kept = [t for t in _transform_list(parser, section, layout) if not _target_name(t).startswith(prefixes)]
    parser[f"{section}#transforms"] = kept


def _uses_transform(parser: ConfigParser, section: str, prefixes: tuple[str, ...]) -> bool:
    transforms = parser[section].get("transforms", []) if isinstance(parser[section], dict) else []
    return any(_target_name(t).startswith(prefixes) for t in transforms)


def network_from_config(config_path: Path) -> torch.nn.Module:
    """The untrained network of a bundle config (random weights), e.g. to give a config weights for tests."""
    parser = ConfigParser()
    parser.read_config(str(config_path))
    return build_network(config_path, parser)


def build_network(config_path: Path, parser: ConfigParser) -> torch.nn.Module:
    """Instantiate network_def, dropping arguments MONAI has since removed when a published config passes them."""
    target = _target_name(parser["network_def"])
    try:
        return parser.get_parsed_content("network_def", instantiate=True, lazy=False)
    except Exception as error:  # any network constructor argument can be wrong
        removed = [a for a in _REMOVED_NETWORK_ARGUMENTS.get(target, ()) if a in parser["network_def"]]
        if not removed:
            raise BundleError(f"{config_path}: cannot build network_def ({error})") from error
    log.warning("dropping network_def arguments %s: MONAI %s's %s no longer takes them", removed,
                monai.__version__, target)
    for argument in removed:
        parser["network_def"].pop(argument)
    parser.parse()
    try:
        return parser.get_parsed_content("network_def", instantiate=True, lazy=False)
    except Exception as error:  # any network constructor argument can be wrong
        raise BundleError(f"{config_path}: cannot build network_def ({error})") from error


def _load_network(layout: BundleLayout, parser: ConfigParser, device: torch.device) -> torch.nn.Module:
    if layout.weights_path.suffix == ".ts":
        try:
            network = torch.jit.load(str(layout.weights_path), map_location=device)
        except Exception as error:  # torch.jit raises RuntimeError or its own error types
            raise BundleError(f"{layout.weights_path}: not a loadable TorchScript model ({error})") from error
        return network.eval()
    network = build_network(layout.config_path, parser)
    try:
        checkpoint = torch.load(str(layout.weights_path), map_location="cpu", weights_only=True)
    except Exception as error:  # truncated files, pickles that weights_only refuses, non-torch files
        raise BundleError(f"{layout.weights_path}: not a readable PyTorch weights file ({error})") from error
    state = checkpoint.get("model", checkpoint) if isinstance(checkpoint, dict) else None
    if not isinstance(state, dict):
        raise BundleError(f"{layout.weights_path}: expected a state dict (or a checkpoint with a 'model' entry)")
    try:
        network.load_state_dict(state, strict=True)
    except RuntimeError as error:
        summary = str(error).split("\n", 1)[-1].strip()[:600]
        raise BundleError(f"{layout.weights_path}: weights do not fit network_def "
                          f"{type(network).__name__} in {layout.config_path.name}: {summary}") from error
    return network.to(device).eval()
