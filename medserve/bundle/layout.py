"""Find and check the files of a bundle directory before anything is parsed or loaded.

The standard layout: `configs/metadata.json`, `configs/inference.json|yaml|yml`, and weights in
`models/model.pt` (a state dict or a checkpoint holding one) or `models/model.ts` (TorchScript).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from medserve.errors import BundleError, described
from medserve.writers.labels import MAX_LABEL

INFERENCE_CONFIG_NAMES = ("inference.json", "inference.yaml", "inference.yml")
WEIGHT_NAMES = ("model.pt", "model.ts")


@dataclass(frozen=True)
class BundleLayout:
    root: Path
    metadata_path: Path
    config_path: Path
    weights_path: Path
    metadata: dict[str, Any]

    @property
    def name(self) -> str:
        """The bundle's folder name (what the server calls the model): also for a root given as '.'."""
        return self.root.resolve().name

    @property
    def version(self) -> str:
        return str(self.metadata.get("version", ""))

    @property
    def description(self) -> str:
        return str(self.metadata.get("description") or self.metadata.get("name") or "")

    @property
    def output_key(self) -> str:
        """`pred`, the name the bundle format gives the network's output, when the metadata lists it (beside an
        auxiliary output listed first, say); else the one output it lists."""
        outputs = self.metadata.get("network_data_format", {}).get("outputs", {})
        return "pred" if "pred" in outputs else next(iter(outputs), "pred")

    def _channel_def(self) -> dict[str, Any]:
        outputs = self.metadata.get("network_data_format", {}).get("outputs", {})
        channel_def = outputs.get(self.output_key, {}).get("channel_def", {}) if outputs else {}
        return channel_def if isinstance(channel_def, dict) else {}

    @property
    def channel_zero_is_a_structure(self) -> bool:
        """Whether channel 0 of the output's channel_def names a structure rather than the background, as in a
        sigmoid bundle's masks (BraTS-style "0": "tumor core", ...; a single "0": "liver"). Whether the output
        is multi-label is the predictor's call: a softmax bundle may call its channel 0 "other"."""
        channel_def = self._channel_def()
        return "0" in channel_def and not _names_background(channel_def["0"])

    def labels(self, multi_label: bool = False) -> dict[int, str]:
        """Foreground labels {value: name} of the label map made from the output, from its channel_def: the class
        index of each name (background, value 0, left out), or channel + 1 for a `multi_label` output."""
        shift = 1 if multi_label else 0
        labels = {}
        for value, name in self._channel_def().items():  # keys checked by find(): channel numbers
            number = int(value) + shift
            if number > MAX_LABEL:  # channel 65535 of a multi-label output
                raise BundleError(f"{self.metadata_path}: channel {value} of the multi-label output "
                                  f"'{self.output_key}' would be label {number}; labels go up to {MAX_LABEL}")
            if number > 0:
                labels[number] = str(name)
        return labels

    @classmethod
    def find(cls, root: Path | str) -> BundleLayout:
        root = Path(root)
        if not root.is_dir():
            raise BundleError(f"bundle {root} does not exist or is not a folder")
        metadata_path = root / "configs" / "metadata.json"
        if not metadata_path.is_file():
            raise BundleError(f"bundle {root}: configs/metadata.json is missing")
        try:
            metadata = json.loads(metadata_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise BundleError(f"{metadata_path}: not valid JSON ({error})") from error
        except OSError as error:
            raise BundleError(f"{metadata_path}: cannot be read ({error.strerror or error})") from error
        if not isinstance(metadata, dict):
            raise BundleError(f"{metadata_path}: holds {_object_found(metadata)}; expected a JSON object")
        _check_data_format(metadata, metadata_path)
        config_path = next((root / "configs" / n for n in INFERENCE_CONFIG_NAMES
                            if (root / "configs" / n).is_file()), None)
        if config_path is None:
            raise BundleError(f"bundle {root}: no inference config; expected configs/"
                              f"{' or configs/'.join(INFERENCE_CONFIG_NAMES)}")
        _check_config_decodes(config_path)
        weights_path = next((root / "models" / n for n in WEIGHT_NAMES if (root / "models" / n).is_file()), None)
        if weights_path is None:
            raise BundleError(f"bundle {root}: no weights; expected models/{' or models/'.join(WEIGHT_NAMES)}")
        problem = weights_file_problem(weights_path)
        if problem is not None:
            raise BundleError(f"{weights_path}: {problem}")
        return cls(root=root, metadata_path=metadata_path, config_path=config_path, weights_path=weights_path,
                   metadata=metadata)


def _check_config_decodes(path: Path) -> None:
    """The inference config decodes, as monai.bundle's parser will read it, to a mapping of ids. Told when the
    bundle is found (a store lists it, a MAP packages it) rather than when it is first loaded."""
    try:
        text = path.read_text(encoding="utf-8")
        config = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except Exception as error:  # json's, yaml's and the codec's own types, an unreadable file
        raise BundleError(f"{path}: cannot read config ({type(error).__name__}: {error})") from error
    if not isinstance(config, dict):
        raise BundleError(f"{path}: the config is {described(config)}; expected a mapping of ids (network_def, "
                          "preprocessing, inferer, postprocessing, ...)")


def weights_file_problem(path: Path) -> str | None:
    """Why a weights file cannot be what its name says, from its first bytes (no torch needed): torch.save
    writes a zip archive (a legacy one, a pickle), TorchScript always a zip. None when it may be."""
    try:
        with open(path, "rb") as stream:
            head = stream.read(4)
    except OSError as unreadable:
        return f"cannot be read ({unreadable.strerror or unreadable})"
    if head.startswith(b"PK\x03\x04") or (path.suffix == ".pt" and head[:1] == b"\x80"):
        return None
    if path.suffix == ".ts":
        return "not a TorchScript file (the zip archive torch.jit.save writes)"
    return "not a PyTorch weights file (neither the zip archive torch.save writes nor a pickle)"


def _check_data_format(metadata: dict[str, Any], path: Path) -> None:
    """BundleError naming the field when a part of network_data_format that medserve reads is not the JSON object
    the bundle format makes it: the format itself, its inputs and outputs, each of their entries, a channel_def."""
    if "network_data_format" not in metadata:
        return
    data_format = _object(metadata["network_data_format"], path, "network_data_format")
    for section in ("inputs", "outputs"):
        if section not in data_format:
            continue
        field = f"network_data_format.{section}"
        for key, entry in _object(data_format[section], path, field).items():
            entry = _object(entry, path, f"{field}.{key}")
            if "channel_def" in entry:
                channel_def = _object(entry["channel_def"], path, f"{field}.{key}.channel_def")
                if section == "outputs":  # segment numbers and labels are made of these
                    for channel, name in channel_def.items():
                        where = f"{field}.{key}.channel_def[{json.dumps(channel)}]"
                        _channel_number(channel, path, where)
                        _name(name, path, where)


def _channel_number(key: str, path: Path, field: str) -> None:
    """A channel's number as the bundle format writes it ("0", "1", ...): a label value of the label map, so at
    most 65535 (a DICOM segment number). A name, "-1", "1.0" or "01" (which "1" would overwrite) is refused
    rather than its channel left nameless."""
    if not (key.isdecimal() and key.isascii() and str(int(key)) == key and int(key) <= MAX_LABEL):
        raise BundleError(f"{path}: {field}: the key is not a channel number; expected a whole number 0..{MAX_LABEL} "
                          "written without leading zeros")


def _object(value: Any, path: Path, field: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise BundleError(f"{path}: {field} is {_object_found(value)}; expected a JSON object")
    return value


def _name(value: Any, path: Path, field: str) -> None:
    if not isinstance(value, str) or not value.strip():
        found = "blank" if isinstance(value, str) else _object_found(value)
        raise BundleError(f"{path}: {field} is {found}; expected the name of what the channel holds")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:  # JSON's "\ud800": no file, response or terminal can carry it
        raise BundleError(f"{path}: {field} holds {error.object[error.start:error.end]!r}, a lone surrogate; "
                          "expected text") from error


def _object_found(value: Any) -> str:
    return "null" if value is None else f"a JSON {_JSON_TYPES.get(type(value), type(value).__name__)}"


_JSON_TYPES = {list: "array", dict: "object", str: "string", int: "number", float: "number", bool: "boolean"}


def _names_background(name: Any) -> bool:
    words = str(name).strip().lower()
    return "background" in words or words in ("bg", "bkg", "_background_")
