"""End to end: the MAP of apps/bundle_seg with the demo bundle, built with buildah from the local base image,
run with podman on the demo study, must write the same DICOM SEG as `python apps/bundle_seg/app.py`."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path

import highdicom as hd
import numpy as np
import pydicom
import pytest

from conftest import REPO, SESSION, podman_run, remove_image
from medserve.cli import main as cli_main
from medserve.packaging.config import read_app_config
from medserve.packaging.context import app_requirements
from medserve.packaging.manifest import find_app
from medserve.packaging.run import inspect

TAG = f"localhost/medserve-test-bundle-seg:{SESSION}"
APP = REPO / "apps" / "bundle_seg"
BUNDLE = REPO / "bundles" / "demo_organ_seg"
pytestmark = pytest.mark.slow


def _big_stack() -> None:
    resource.setrlimit(resource.RLIMIT_STACK, (32 * 1024 * 1024, 32 * 1024 * 1024))


@pytest.fixture(scope="module")
def bundle_seg_map(base_image: str, wheel_dir_for) -> str:
    requirements = app_requirements(find_app(APP), read_app_config(REPO / "app.yaml"))
    wheels = wheel_dir_for(requirements)
    code = cli_main(["package", str(APP), "-c", str(REPO / "app.yaml"), "-t", TAG, "-m", str(BUNDLE),
                     "--platform", "x86_64", "--base-image", base_image, "--builder", "buildah",
                     "--wheel-dir", str(wheels), "--variant", "cpu"])
    assert code == 0
    yield TAG
    remove_image(TAG)


@pytest.fixture(scope="module")
def demo_study(tmp_path_factory: pytest.TempPathFactory) -> Path:
    study = tmp_path_factory.mktemp("demo") / "study"
    subprocess.run([sys.executable, "-m", "medserve.demo.study", str(study)], check=True, cwd=REPO)
    assert any(study.rglob("*.dcm"))
    return study


def test_map_layout(bundle_seg_map: str) -> None:
    info = inspect(bundle_seg_map, "podman")
    assert info["app.json"]["command"] == '["python3", "/opt/holoscan/app"]'  # __main__.py: a Python module
    assert info["app.json"]["sdk"] == "monai-deploy" and info["app.json"]["sdkVersion"] == "4.0.0"
    assert info["pkg.json"]["models"] == {"demo_organ_seg": "/opt/holoscan/models/demo_organ_seg"}
    assert info["pkg.json"]["resources"] == read_app_config(REPO / "app.yaml").resources
    assert info["labels"]["org.medserve.variant"] == "cpu"
    listing = podman_run(bundle_seg_map, "/opt/holoscan", "-maxdepth", "4", entrypoint="find").stdout.split()
    for relative in ("app/app.py", "app/__main__.py", "lib/medserve/pipeline.py", "lib/operators/__init__.py",
                     "models/demo_organ_seg/configs/inference.json", "models/demo_organ_seg/models/model.pt"):
        assert f"/opt/holoscan/{relative}" in listing, relative
    versions = podman_run(bundle_seg_map, "-c", "import torch, holoscan; print(torch.__version__, torch.version.cuda)",
                          entrypoint="python3")
    assert versions.returncode == 0, versions.stderr
    assert versions.stdout.split()[1] == "None"  # CPU variant: no CUDA torch


def test_map_seg_matches_direct_run(bundle_seg_map: str, demo_study: Path, tmp_path: Path) -> None:
    direct = subprocess.run([sys.executable, str(APP / "app.py"), "-i", str(demo_study), "-o",
                             str(tmp_path / "direct"), "-m", str(BUNDLE)], cwd=REPO, capture_output=True, text=True,
                            preexec_fn=_big_stack)
    assert direct.returncode == 0, direct.stderr[-2000:]
    assert cli_main(["run", bundle_seg_map, "-i", str(demo_study), "-o", str(tmp_path / "map")]) == 0

    direct_seg, map_seg = (sorted((tmp_path / name).rglob("*.dcm")) for name in ("direct", "map"))
    assert len(direct_seg) == len(map_seg) == 1
    ours, theirs = hd.seg.segread(map_seg[0]), hd.seg.segread(direct_seg[0])
    assert ours.SOPClassUID == pydicom.uid.SegmentationStorage
    assert [s.SegmentLabel for s in ours.SegmentSequence] == [s.SegmentLabel for s in theirs.SegmentSequence]
    assert ours.ReferencedSeriesSequence[0].SeriesInstanceUID == theirs.ReferencedSeriesSequence[0].SeriesInstanceUID
    ours_volume = ours.get_volume(combine_segments=True)
    theirs_volume = theirs.get_volume(combine_segments=True)
    assert ours_volume.array.shape == theirs_volume.array.shape
    assert np.array_equal(ours_volume.array, theirs_volume.array)
    assert np.allclose(ours_volume.affine, theirs_volume.affine)
    assert ours_volume.array.any(), "the demo study must produce a non-empty segmentation"
