"""Shared fixtures: generated studies, the demo bundle, random-weight zoo bundles, a thresholding bundle."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from medserve.demo.study import SeriesGeometry, WrittenSeries, write_ct_series, write_demo_study

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
MODEL_ZOO = SHARED / "model-zoo"
DEMO_BUNDLE = REPO / "bundles" / "demo_organ_seg"
APP = REPO / "apps" / "bundle_seg" / "app.py"
THRESHOLD_HU = 100.0


def run_app(*args: str | Path, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run apps/bundle_seg as a user does: a separate Python process with the 32 MB stack Holoscan wants."""
    command = f"ulimit -s 32768; exec {sys.executable} {APP} " + " ".join(f"'{a}'" for a in args)
    return subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def run_unprivileged(code: str, *args: str | Path) -> subprocess.CompletedProcess:
    """Python `code` in a process for which chmod 000 holds: as root (how the tests run), without the capabilities
    that override file permissions."""
    drop = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search"] if os.geteuid() == 0 else []
    return subprocess.run([*drop, sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True,
                          timeout=120, cwd=REPO)


@pytest.fixture(scope="session")
def demo_study(tmp_path_factory) -> tuple[Path, WrittenSeries, object]:
    folder = tmp_path_factory.mktemp("demo_study")
    written, phantom = write_demo_study(folder)
    return folder, written, phantom


@pytest.fixture(scope="session")
def zoo_bundle(tmp_path_factory):
    """Copy a model-zoo bundle and give it random weights from its own network_def."""
    from medserve.bundle.predictor import write_random_weights

    made: dict[str, Path] = {}

    def make(name: str) -> Path:
        if name not in made:
            target = tmp_path_factory.mktemp("zoo") / name
            shutil.copytree(MODEL_ZOO / name, target)
            write_random_weights(target)
            made[name] = target
        return made[name]

    return make


def make_threshold_bundle(root: Path, pixdim: tuple[float, float, float] = (2.0, 2.0, 2.0),
                          axcodes: str = "RAS") -> Path:
    """A bundle whose 'network' is a fixed 1x1x1 convolution: label 1 where HU > THRESHOLD_HU.

    Its result is known without training, so geometry handling (orientation, resampling, inversion) can be
    checked exactly on any acquisition.
    """
    (root / "configs").mkdir(parents=True)
    (root / "models").mkdir()
    config = {
        "image_key": "image",
        "network_def": {"_target_": "torch.nn.Conv3d", "in_channels": 1, "out_channels": 2, "kernel_size": 1},
        "preprocessing": {"_target_": "Compose", "transforms": [
            {"_target_": "LoadImaged", "keys": "image"},
            {"_target_": "EnsureChannelFirstd", "keys": "image"},
            {"_target_": "Orientationd", "keys": "image", "axcodes": axcodes},
            {"_target_": "Spacingd", "keys": "image", "pixdim": list(pixdim), "mode": "bilinear"},
            {"_target_": "ScaleIntensityRanged", "keys": "image", "a_min": -1000, "a_max": 1000,
             "b_min": -1.0, "b_max": 1.0, "clip": True},
        ]},
        "inferer": {"_target_": "SlidingWindowInferer", "roi_size": [32, 32, 32], "sw_batch_size": 2,
                    "overlap": 0.25},
        "postprocessing": {"_target_": "Compose", "transforms": [
            {"_target_": "Activationsd", "keys": "pred", "softmax": True},
            {"_target_": "Invertd", "keys": "pred", "transform": "@preprocessing", "orig_keys": "image",
             "nearest_interp": False},
            {"_target_": "AsDiscreted", "keys": "pred", "argmax": True},
            {"_target_": "SaveImaged", "keys": "pred", "output_dir": "/nonexistent"},
        ]},
    }
    (root / "configs" / "inference.json").write_text(json.dumps(config))
    (root / "configs" / "metadata.json").write_text(json.dumps({
        "version": "1.0.0", "name": "threshold", "description": "HU > 100",
        "network_data_format": {"outputs": {"pred": {"channel_def": {"0": "background", "1": "Liver"}}}},
    }))
    scaled = THRESHOLD_HU / 1000.0
    # Steep logits: probabilities are ~0 or ~1, so resampling them moves no boundary by more than a voxel.
    weight = torch.tensor([-1.0, 1.0]).reshape(2, 1, 1, 1, 1) * 100.0
    bias = torch.tensor([scaled, -scaled]) * 100.0
    torch.save({"weight": weight, "bias": bias}, root / "models" / "model.pt")
    return root


@pytest.fixture(scope="session")
def threshold_bundle(tmp_path_factory) -> Path:
    return make_threshold_bundle(tmp_path_factory.mktemp("threshold") / "threshold")


@pytest.fixture(scope="session")
def real_ct() -> np.ndarray:
    """The real 128^3 CT (HU) shipped by liver-ct-segmentation-package, as (slice, row, column)."""
    import mrcfile
    import liver_ct_segmentation_package

    path = Path(liver_ct_segmentation_package.__file__).parent / "data" / "img_117.mrc"
    with mrcfile.open(path, permissive=True) as mrc:
        return np.array(mrc.data, dtype=np.float32)


@pytest.fixture(scope="session")
def real_ct_study(tmp_path_factory, real_ct) -> tuple[Path, WrittenSeries, SeriesGeometry]:
    folder = tmp_path_factory.mktemp("real_ct")
    geometry = SeriesGeometry(origin=(-120.0, -140.0, 300.0), pixel_spacing=(1.5, 1.5), slice_spacing=2.0)
    written = write_ct_series(real_ct, folder, geometry, series_description="LiTS case 117 (real CT)",
                              file_order_seed=7)
    return folder, written, geometry


def dciodvfy_errors(path: Path) -> list[str]:
    """The lines dciodvfy reports as errors (it exits 0 either way)."""
    assert Path(path).is_file(), f"{path} was not written"  # dciodvfy reports no "Error" line for a missing file
    tool = shutil.which("dciodvfy")
    if tool is None:
        pytest.fail("dciodvfy is not installed: run `make system-deps` (Debian package dicom3tools)")
    output = subprocess.run([tool, str(path)], capture_output=True, text=True).stderr
    return [line for line in output.splitlines() if line.startswith("Error")]
