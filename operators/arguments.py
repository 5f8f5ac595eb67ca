"""Checks of operator constructor arguments: a wrong one is refused when the graph is composed, naming the operator
and the argument, rather than surfacing after inference as an internal error (or, for an empty folder name, as
files written into the current folder)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from medserve.bundle.predictor import BundlePredictor


def _type_name(value: Any) -> str:
    return f"{type(value).__module__}.{type(value).__qualname__}"


def predictor_argument(operator: str, predictor: Any) -> BundlePredictor:
    if not isinstance(predictor, BundlePredictor):
        folder = isinstance(predictor, (str, Path))
        hint = "; for a bundle folder, pass BundlePredictor.from_dir(FOLDER)" if folder else ""
        raise TypeError(f"{operator}: predictor= expects a BundlePredictor; got {_type_name(predictor)}{hint}")
    return predictor


def folder_argument(operator: str, name: str, folder: Any) -> Path:
    if not isinstance(folder, (str, Path)):
        raise TypeError(f"{operator}: {name}= expects a folder path (str or Path); got {_type_name(folder)}")
    if not str(folder).strip():
        raise ValueError(f"{operator}: {name}= is empty; expected a folder path")
    return Path(folder)


def flag_argument(operator: str, name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{operator}: {name}= expects True or False; got {value!r}")
    return value
