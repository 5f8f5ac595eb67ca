"""app.yaml validation and manifests, checked against holoscan-cli 4.2's own reader (no Docker needed)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from holoscan_cli.packager.config_reader import ApplicationConfiguration
from holoscan_cli.packager.models import Models
from holoscan_cli.packager.parameters import PackageBuildParameters

from medserve.errors import MedserveError, PackagingError
from medserve.packaging.build import PackageRequest, prepare
from medserve.packaging.config import read_app_config
from medserve.packaging.manifest import app_manifest, find_app, package_manifest, scan_models

REPO = Path(__file__).resolve().parents[2]

GOOD = {
    "application": {"title": "T", "version": "1.2", "input-formats": ["file"], "output-formats": ["file"]},
    "resources": {"cpu": 1, "gpu": 0, "memory": "1Gi", "gpuMemory": "2Gi"},
}


def write(tmp_path: Path, data: object, name: str = "app.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return path


def make_app(tmp_path: Path) -> Path:
    app = tmp_path / "app"
    app.mkdir()
    (app / "app.py").write_text("print('hi')\n")
    (app / "requirements.txt").write_text("monai-deploy-app-sdk==4.0.0\nholoscan-cu13==4.2.0\n")
    return app


def make_bundle(root: Path, name: str = "demo") -> Path:
    bundle = root / name
    (bundle / "configs").mkdir(parents=True)
    (bundle / "models").mkdir()
    (bundle / "configs" / "metadata.json").write_text("{}")
    (bundle / "models" / "model.pt").write_bytes(b"weights")
    return bundle


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"resources": {"cpu": 1}}, "'application' is missing"),
        ({"application": {"title": "T", "version": "1"}}, "'resources' is missing"),
        ({"application": {"version": "1"}, "resources": {}}, "application.title is missing"),
        ({"application": {"title": " ", "version": "1"}, "resources": {}}, "application.title is missing"),
        ({"application": {"title": "T"}, "resources": {}}, "application.version is missing"),
        ({"application": {"title": "T", "version": "1", "inputFormats": ["file"]}, "resources": {}},
         "application.inputFormats is camelCase; holoscan-cli 4.2 reads application.input-formats"),
        ({"application": {"title": "T", "version": "1", "pipPackages": ["x"]}, "resources": {}},
         "application.pip-packages"),
        ({"application": {"title": "T", "version": "1"}, "resources": {"gpu-memory": "1Gi"}},
         "resources.gpu-memory is kebab-case; the MAP runner reads resources.gpuMemory"),
        ({"application": {"title": "T", "version": "1"}, "resources": {"gpu": "one"}}, "resources.gpu"),
        ({"application": {"title": "T", "version": "1"}, "resources": {"memory": "lots"}}, "resources.memory"),
        ({"application": {"title": "T", "version": "1", "input-formats": "file"}, "resources": {}},
         "application.input-formats must be a list"),
        ("application: [unclosed", "not valid YAML"),
    ],
)
def test_bad_app_yaml_names_file_and_field(tmp_path: Path, data: object, message: str) -> None:
    path = write(tmp_path, data)
    with pytest.raises(PackagingError) as error:
        read_app_config(path)
    assert message in str(error.value)
    assert str(path) in str(error.value)
    assert isinstance(error.value, MedserveError)


def test_missing_app_yaml(tmp_path: Path) -> None:
    with pytest.raises(PackagingError, match="application config not found"):
        read_app_config(tmp_path / "nope.yaml")


def test_app_dir_without_app_py(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(PackagingError, match=r"empty has no app.py"):
        prepare(PackageRequest(tmp_path / "empty", write(tmp_path, GOOD), "x:1"))
    with pytest.raises(PackagingError, match="application directory not found"):
        find_app(tmp_path / "absent")


def test_models_path_missing(tmp_path: Path) -> None:
    with pytest.raises(PackagingError, match=r"models path not found: .*no-models"):
        prepare(PackageRequest(make_app(tmp_path), write(tmp_path, GOOD), "x:1", models=tmp_path / "no-models"))


def test_empty_wheel_dir_rejected(tmp_path: Path) -> None:
    (tmp_path / "wheels").mkdir()
    with pytest.raises(PackagingError, match="no .whl files"):
        prepare(PackageRequest(make_app(tmp_path), write(tmp_path, GOOD), "x:1", wheel_dir=tmp_path / "wheels"))


def test_bundle_dir_is_one_model(tmp_path: Path) -> None:
    bundle = make_bundle(tmp_path)
    assert scan_models(bundle) == {"demo": bundle}
    # a folder of models: one per subfolder, as the official scan
    assert scan_models(tmp_path) == {"demo": bundle}
    assert scan_models(bundle / "models" / "model.pt") == {"model": bundle / "models" / "model.pt"}


def official_manifests(app_py: Path, config: Path, models_dir: Path | None) -> tuple[dict, dict]:
    """What `monai-deploy package` (holoscan-cli 4.2) writes to map/app.json and map/pkg.json, computed by its
    own code: PackagingArguments minus the artifact download and the Docker build."""
    params = PackageBuildParameters()
    params.application = app_py
    if models_dir is not None:
        params.models = Models().build(models_dir)
    reader = ApplicationConfiguration()
    reader.read(config)
    app = reader.populate_app_manifest(params)
    pkg = reader.populate_package_manifest(params)
    app.sdk = "monai-deploy"  # PackagingArguments: SdkType.MonaiDeploy.value and its detected version
    app.sdk_version = "4.0.0"
    pkg.platform_config = "dgpu"  # --platform x86_64
    # The official packager writes json.dumps(manifest.data): compare the same serialisation.
    return json.loads(json.dumps(app.data)), json.loads(json.dumps(pkg.data))


def test_repo_app_yaml_matches_official_reader(tmp_path: Path) -> None:
    config = REPO / "app.yaml"
    ours = read_app_config(config)
    assert ours.input_formats and ours.output_formats, "app.yaml must declare formats (kebab-case)"
    models_parent = tmp_path / "models"
    models_parent.mkdir()
    bundle = make_bundle(models_parent, "demo_organ_seg")
    app_dir = make_app(tmp_path)
    app = find_app(app_dir)
    official_app, official_pkg = official_manifests(app_dir / "app.py", config, models_parent)
    our_app = app_manifest(ours, app, "4.0.0")
    our_pkg = package_manifest(ours, scan_models(bundle))
    assert json.dumps(our_app) == json.dumps(official_app)  # same keys, same order, same values
    assert json.dumps(our_pkg) == json.dumps(official_pkg)
    assert our_app["input"]["formats"] == ours.input_formats
    assert our_pkg["resources"] == yaml.safe_load(config.read_text())["resources"]


def test_camel_case_would_be_lost_by_official_packager(tmp_path: Path) -> None:
    """Why camelCase is an error here: the official reader accepts it and drops the formats."""
    config = write(tmp_path, {"application": {"title": "T", "version": "1", "inputFormats": ["file"]},
                              "resources": {"cpu": 1}})
    official_app, _ = official_manifests(make_app(tmp_path) / "app.py", config, None)
    assert official_app["input"]["formats"] is None
    with pytest.raises(PackagingError):
        read_app_config(config)


def test_variant_follows_gpu_request(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    gpu = dict(GOOD, resources={"cpu": 1, "gpu": 1})
    assert prepare(PackageRequest(app, write(tmp_path, gpu, "g.yaml"), "x:1")).variant == "cuda"
    assert prepare(PackageRequest(app, write(tmp_path, GOOD), "x:1")).variant == "cpu"
    assert prepare(PackageRequest(app, write(tmp_path, gpu, "g.yaml"), "x:1", variant="cpu")).variant == "cpu"


def test_containerfile_variants(tmp_path: Path) -> None:
    from medserve.packaging.containerfile import TORCH_CPU_INDEX, render

    app = make_app(tmp_path)
    cpu = prepare(PackageRequest(app, write(tmp_path, GOOD), "x:1", variant="cpu"))
    cuda = prepare(PackageRequest(app, write(tmp_path, GOOD), "x:1", variant="cuda"))
    cpu_file, cuda_file = render(cpu, False, "f"), render(cuda, False, "f")
    assert TORCH_CPU_INDEX in cpu_file and "CPU variant got a CUDA torch build" in cpu_file
    assert TORCH_CPU_INDEX not in cuda_file and "CPU variant got a CUDA torch build" not in cuda_file
    assert 'ENTRYPOINT ["/var/holoscan/tools"]' in cpu_file


def test_tools_script_is_the_official_one() -> None:
    from importlib import resources

    from medserve.packaging.context import tools_script

    official = resources.files("holoscan_cli.packager").joinpath("templates/tools.sh").read_text()
    assert tools_script() == official and "extract" in official
