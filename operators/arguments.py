"""Checks of operator constructor arguments: a wrong one is refused when the graph is composed, naming the operator
and the argument, rather than surfacing after inference as an internal error (or, for an empty folder name, as
files written into the current folder); and of what a port received from another operator, stock ones included."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from medserve.bundle.predictor import BundlePredictor
from medserve.errors import WiringError


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


def received(operator: str, port: str, value: Any, expected: type, what: str, list_of: bool = False) -> Any:
    """`value`, received on `port`, when it is an `expected` (a non-empty list of them with `list_of`); else a
    WiringError naming the port, `what` was expected and what came: a stock operator's output wired to ours, say,
    which would fail deep inside with an AttributeError."""
    fits = (isinstance(value, list) and bool(value) and all(isinstance(item, expected) for item in value)
            if list_of else isinstance(value, expected))
    if fits:
        return value
    if isinstance(value, list):
        got = f"a list of {_type_name(value[0])}" if value else "an empty list"
    else:
        got = _type_name(value)
    raise WiringError(f"{operator} {port}: expected {what}; got {got}")
