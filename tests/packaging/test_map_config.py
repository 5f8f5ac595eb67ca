"""app.yaml validation and manifests, checked against holoscan-cli 4.2's own reader (no Docker needed)."""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import ssl
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import torch
import yaml
from holoscan_cli.packager.config_reader import ApplicationConfiguration
from holoscan_cli.packager.models import Models
from holoscan_cli.packager.parameters import PackageBuildParameters

from medserve.errors import MedserveError, PackagingError
from medserve.packaging.build import PackageRequest, prepare
from medserve.packaging.config import read_app_config
from medserve.packaging.containerfile import (TORCH_CPU_INDEX, PipIndexes, pip_config, render, torch_check,
                                              user_setup)
from medserve.packaging.context import (CA_BUNDLE_VARIABLES, CUDA_RUNTIME_PIN, app_requirements, host_ca_bundle,
                                        host_pip_indexes, write_context)
from medserve.packaging.manifest import (PLATFORMS, app_manifest, find_app, package_manifest, scan_models,
                                         sdk_versions)

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
    (bundle / "configs" / "inference.json").write_text("{}")
    torch.save({"weight": torch.zeros(1)}, bundle / "models" / "model.pt")
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
        ({"application": {"title": "T", "version": "1", "pip_packages": ["x"]}, "resources": {}},
         "application.pip_packages is snake_case; holoscan-cli 4.2 reads application.pip-packages"),
        ({"application": {"title": "T", "version": "1"}, "resources": {"gpu-memory": "1Gi"}},
         "resources.gpu-memory is kebab-case; the MAP runner reads resources.gpuMemory"),
        ({"application": {"title": "T", "version": "1"}, "resources": {"gpu": "one"}}, "resources.gpu"),
        ({"application": {"title": "T", "version": "1"}, "resources": {"memory": "lots"}}, "resources.memory"),
        ({"application": {"title": "T", "version": "1"}, "resources": {"sharedMemory": "1.2.3Gi"}},
         "resources.sharedMemory must be a size above zero like '2Gi', '512Mi', '1GB', got '1.2.3Gi'"),
        ({"application": {"title": "T", "version": "1"}, "resources": {"sharedMemory": "..Gi"}},
         "resources.sharedMemory must be a size"),
        ({"application": {"title": "T", "version": "1"}, "resources": {"shared_memory": "8Gi"}},
         "resources.shared_memory is snake_case; the MAP runner reads resources.sharedMemory"),
        ({"application": {"title": "T", "version": "1"}, "resources": {"fragments": {"f": {"sharedMemory": "x"}}}},
         "resources.fragments.f.sharedMemory must be a size"),
        ({"application": {"title": "T", "version": "1"}, "resources": {"fragments": ["f"]}},
         "resources.fragments must map each fragment's name to its resources"),
        ({"application": {"title": "T", "version": "1", "input-formats": "file"}, "resources": {}},
         "application.input-formats must be a list"),
        ("application: [unclosed", "not valid YAML"),
        # One line: the parser's own text quotes the line with a caret under it.
        ("application:\n  title: x\n   bad: [\n", "not valid YAML: mapping values are not allowed here (line 3, "
                                                  "column 7)"),
        ("application: {title: T, version: 1.10}\nresources: {}\n",
         'application.version 1.10 was read by YAML as 1.1, not as the text written'),
        # Ints and booleans were kept as str(): 010 became "8" in the labels and manifests.
        ("application: {title: T, version: 010}\nresources: {}\n",
         'application.version 010 was read by YAML as 8, not as the text written (010 is octal, 1.10 is 1.1); '
         'quote it: version: "010"'),
        ("application:\n  title: T\n  version: true\nresources: {}\n", 'version true was read by YAML as True'),
        ("defaults: &d {version: 010}\napplication:\n  <<: *d\n  title: T\nresources: {}\n",
         "application.version 8 was read by YAML as 8"),  # brought in by a merge key: shown as loaded
        # Keys YAML reads as numbers were tracebacks (AttributeError, TypeError).
        ("application: {title: T, version: '1'}\nresources: {1: 2}\n", "resources key 1 is not a name"),
        ("application: {5: x, title: T, version: '1'}\nresources: {}\n", "application key 5 is not a name"),
        ("application: [a]\nresources: {}\n", "'application' must be a mapping (title, version, input-formats, "
                                               "...), got ['a']"),
        ("application: {title: \"a\\nb\", version: '1'}\nresources: {}\n",
         "application.title 'a\\nb' must be one line of printable text"),
        # Amounts that made pkg.json invalid JSON (Infinity, NaN), or an unlimited /dev/shm (-1).
        ("application: {title: T, version: '1'}\nresources: {cpu: .inf}\n",
         "resources.cpu must be a positive number, got inf"),
        ("application: {title: T, version: '1'}\nresources: {cpu: true}\n", "resources.cpu must be a positive"),
        ("application: {title: T, version: '1'}\nresources: {cpu: " + "9" * 400 + "}\n", None),  # OverflowError
        ("application: {title: T, version: '1'}\nresources: {memory: -" + "9" * 400 + "}\n",
         "resources.memory must be a size"),
        ("application: {title: T, version: [1, 2]}\nresources: {}\n", "application.version must be a string, got "
                                                                       "[1, 2]"),
        ("application: {title: T, version: '1'}\nresources: {fragments: {1: {cpu: 1}}}\n",
         "resources.fragments key 1 is not a name; expected a name such as a fragment's name"),
        ("application: {title: T, version: '1'}\nresources: {memory: -4}\n",
         "resources.memory must be a size above zero like '2Gi', '512Mi', '1GB', got -4"),
        ("application: {title: T, version: '1'}\nresources: {memory: 0Gi}\n", "resources.memory must be a size"),
        ("application: {title: T, version: '1'}\nresources: {sharedMemory: -1}\n",
         "resources.sharedMemory must be a size"),
        ("application: {title: T, version: '1'}\nresources: {sharedMemory: .nan}\n",
         "resources.sharedMemory must be a size"),
        # packaged, then refused by every `medserve run` (/dev/shm of 0 bytes)
        ("application: {title: T, version: '1'}\nresources: {sharedMemory: 0.4}\n",
         "resources.sharedMemory (the largest of the app's and its fragments'): comes to 0 bytes. Expected a size "
         "such as 1Gi, 512Mi or 2GB, above zero"),
        # as the runner reads it: the largest value counts (these two run with 1 GiB, and are fine)
        ("application: {title: T, version: '1'}\nresources: {sharedMemory: 0.4, fragments: {f: {sharedMemory: 1Gi}}}\n",
         None),
        ("application: {title: T, version: '1'}\nresources: {fragments: {f: {sharedMemory: 0.4}}}\n", None),
        # a newline in app.json's version and the image label; spaces in a version
        ("application: {title: T, version: \"1.0\\nLABEL evil=1\"}\nresources: {}\n",
         "application.version '1.0\\nLABEL evil=1' must be one word of printable text, like 1.0.2"),
        ("application: {title: T, version: '   '}\nresources: {}\n", "application.version '   ' must be one word"),
        ("application: {title: T, version: 'not a version!'}\nresources: {}\n",
         "application.version 'not a version!' must be one word"),
        ("application: {title: T, version: '1'}\nresources: {fragments: {f: {cpu: -3}}}\n",
         "resources.fragments.f.cpu must be a positive number"),
        ("application: {title: T, version: '1'}\nresources: {fragments: {f: {gpu: banana}}}\n",
         "resources.fragments.f.gpu must be a whole number >= 0"),
        ("application: {title: T, version: '1'}\nresources: {fragments: {f: {gpu_memory: 1Gi}}}\n",
         "resources.fragments.f.gpu_memory is snake_case; the MAP runner reads resources.fragments.f.gpuMemory"),
        # pip failed inside the build, naming the image's requirements file.
        ("application: {title: T, version: '1', pip-packages: ['nibabel==5.3.2  # pinned', 'not a req !!']}\n"
         "resources: {}\n", "application.pip-packages item 2, 'not a req !!', is not a requirement pip can read"),
    ],
)
def test_bad_app_yaml_names_file_and_field(tmp_path: Path, data: object, message: str | None) -> None:
    path = write(tmp_path, data)
    if message is None:  # a valid one that once failed with a traceback
        read_app_config(path)
        return
    with pytest.raises(PackagingError) as error:
        read_app_config(path)
    assert message in str(error.value)
    assert str(path) in str(error.value) and "\n" not in str(error.value)
    assert isinstance(error.value, MedserveError)


def test_a_bad_version_option_is_refused_naming_it(tmp_path: Path) -> None:
    with pytest.raises(PackagingError, match=r"^--version '1.0\\nLABEL evil=1' must be one word of printable text"):
        read_app_config(write(tmp_path, GOOD), version_override="1.0\nLABEL evil=1")


def test_a_shared_memory_of_a_few_bytes_is_warned_about(tmp_path: Path, caplog) -> None:
    """`sharedMemory: 1` (a GiB meant) gave the MAP a 4 kB /dev/shm without a word."""
    read_app_config(write(tmp_path, {**GOOD, "resources": {**GOOD["resources"], "sharedMemory": 1}}))
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        f"{tmp_path / 'app.yaml'}: resources.sharedMemory comes to 1 bytes of /dev/shm (a bare number is bytes; "
        "e.g. 1Gi is a GiB)"]


def test_the_base_image_tag_is_checked_before_debootstrap() -> None:
    from medserve.packaging import base

    with pytest.raises(PackagingError, match="image name 'localhost/Probe Base:bad'"):
        base.build_base_image("localhost/Probe Base:bad")


def test_requirements_pip_reads_and_app_sections_misplaced_at_the_top(tmp_path: Path, caplog) -> None:
    """Options, paths and comments in pip-packages are pip's to read; application keys written at the top level
    (where the packager ignores them) are named in a warning; other top-level sections may configure the app."""
    packages = ["nibabel==5.3.2  # pinned", "--extra-index-url https://example.org/simple", "./wheels/x.whl", "",
                "  -r more.txt"]
    path = write(tmp_path, {**GOOD, "application": {**GOOD["application"], "pip-packages": packages},
                            "pip-packages": ["x"], "segmenter": {"roi": 96}})
    with caplog.at_level("WARNING", logger="medserve.packaging.config"):
        assert read_app_config(path).pip_packages == packages
    assert caplog.messages == [f"{path}: pip-packages at the top level is ignored by the packager; it belongs under "
                               "application"]


def test_missing_app_yaml(tmp_path: Path) -> None:
    with pytest.raises(PackagingError, match="application config not found"):
        read_app_config(tmp_path / "nope.yaml")
    with pytest.raises(PackagingError, match=rf"^application config {tmp_path} is a folder; expected the app.yaml"):
        read_app_config(tmp_path)


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


@pytest.mark.parametrize("inside", [False, True])
@pytest.mark.parametrize(("remove", "reason"), [
    (["models/model.pt"], r"no weights; expected models/model.pt or models/model.ts"),
    # Only configs/inference.json: it was packaged as a model named "configs", and failed when the MAP ran.
    (["models/model.pt", "models", "configs/metadata.json"], r"configs/metadata.json is missing"),
], ids=["no-weights", "configs-only"])
def test_a_bundle_the_app_could_not_load_is_not_packaged(tmp_path: Path, inside: bool, remove: list[str],
                                                         reason: str) -> None:
    bundle = make_bundle(tmp_path / "models")
    for name in remove:
        if (bundle / name).is_dir():
            (bundle / name).rmdir()
        else:
            (bundle / name).unlink()
    with pytest.raises(PackagingError, match=rf"models path .*demo: not a usable MONAI bundle \(bundle .*demo: "
                                             rf"{reason}\)"):
        prepare(PackageRequest(make_app(tmp_path), write(tmp_path, GOOD), "x:1",
                               models=tmp_path / "models" if inside else bundle))


@pytest.mark.parametrize(("breakage", "reason"), [
    ("config", r"configs/inference.json: cannot read config \(JSONDecodeError: "),
    ("empty weights", r"models/model.pt: not a PyTorch weights file"),
])
def test_a_bundle_whose_files_the_app_cannot_read_is_not_packaged(tmp_path: Path, breakage: str, reason: str) -> None:
    """Both were packaged, and the MAP then failed on every run."""
    bundle = make_bundle(tmp_path / "models")
    if breakage == "config":
        (bundle / "configs" / "inference.json").write_text("{ broken")
    else:
        (bundle / "models" / "model.pt").write_bytes(b"")
    with pytest.raises(PackagingError, match=rf"models path .*demo: not a usable MONAI bundle \(.*demo/{reason}"):
        prepare(PackageRequest(make_app(tmp_path), write(tmp_path, GOOD), "x:1", models=bundle))


def test_packaging_checks_bundles_without_importing_torch() -> None:
    code = ("import sys, medserve.packaging.build, medserve.bundle; print('torch' in sys.modules, "
            "medserve.bundle.BundlePredictor.__module__, 'torch' in sys.modules)")
    shown = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert shown == ["False", "medserve.bundle.predictor", "True"]


def official_manifests(app_py: Path, config: Path, models_dir: Path | None,
                       platform: str = "x86_64") -> tuple[dict, dict]:
    """What `monai-deploy package` (holoscan-cli 4.2) writes to map/app.json and map/pkg.json, computed by its
    own code: PackagingArguments minus the artifact download and the Docker build."""
    from holoscan_cli.common.constants import SDK
    from holoscan_cli.common.enum_types import Platform

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
    pkg.platform_config = SDK.INTERNAL_PLATFORM_MAPPINGS[Platform(platform)][1].value  # as PackagingArguments
    # The official packager writes json.dumps(manifest.data): compare the same serialisation.
    return json.loads(json.dumps(app.data)), json.loads(json.dumps(pkg.data))


@pytest.mark.parametrize("platform", ["x86_64", "sbsa", "igx-dgpu", "igx-igpu", "jetson"])
def test_platforms_match_official(tmp_path: Path, platform: str) -> None:
    """--platform takes the names holoscan-cli 4.2 accepts, with its architecture and platformConfig."""
    from holoscan_cli.common.constants import SDK
    from holoscan_cli.common.enum_types import Platform

    assert sorted(PLATFORMS) == sorted(SDK.PLATFORMS)
    assert PLATFORMS[platform][0] == SDK.PLATFORM_ARCH_MAPPINGS[Platform(platform)].value
    config, app = write(tmp_path, GOOD), make_app(tmp_path)
    _, official_pkg = official_manifests(app / "app.py", config, None, platform)
    inputs = prepare(PackageRequest(app, config, "x:1", platform=platform))
    assert inputs.pkg_json["platformConfig"] == official_pkg["platformConfig"]


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
    app = make_app(tmp_path)
    cpu = prepare(PackageRequest(app, write(tmp_path, GOOD), "x:1", variant="cpu"))
    cuda = prepare(PackageRequest(app, write(tmp_path, GOOD), "x:1", variant="cuda"))
    cpu_file, cuda_file = render(cpu, False, "f"), render(cuda, False, "f")
    assert f"extra-index-url = {TORCH_CPU_INDEX}" in pip_config(cpu, PipIndexes(), False)
    assert TORCH_CPU_INDEX not in pip_config(cuda, PipIndexes(), False)
    assert torch_check("cpu") in cpu_file and torch_check("cuda") in cuda_file
    assert 'ENTRYPOINT ["/var/holoscan/tools"]' in cpu_file


def test_each_variant_checks_the_torch_build_it_installed() -> None:
    """Run as the build runs them, against this venv's torch: the check of the other variant than this torch's
    fails naming the mismatch (a --wheel-dir holding the CPU wheel made a "cuda" image without a word)."""
    import torch

    here = "cuda" if torch.version.cuda else "cpu"
    other = {"cpu": "cuda", "cuda": "cpu"}[here]
    environment = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    assert subprocess.run(["sh", "-c", torch_check(here)], env=environment).returncode == 0
    refused = subprocess.run(["sh", "-c", torch_check(other)], env=environment, capture_output=True, text=True)
    assert refused.returncode == 1
    assert refused.stderr.strip() == f"{other.upper()} variant got a {here.upper()} torch build"


def _requirements(tmp_path: Path, lines: str, pip_packages: list[str] | None = None) -> list[str]:
    app = tmp_path / "app"
    app.mkdir(parents=True)
    (app / "app.py").write_text("print('hi')\n")
    (app / "requirements.txt").write_text(lines)
    config = write(tmp_path, {**GOOD, "application": {**GOOD["application"], "pip-packages": pip_packages or []}})
    return app_requirements(find_app(app), read_app_config(config))


def test_sdk_installed_at_the_version_the_manifests_record(tmp_path: Path) -> None:
    """As the official Dockerfile (`pip install monai-deploy-app-sdk=={version}`): an app that does not pin the
    SDK gets the version app.json and the labels record, and Holoscan likewise."""
    sdk, holoscan = metadata.version("monai-deploy-app-sdk"), metadata.version("holoscan-cu13")
    lines = _requirements(tmp_path, "pyyaml==6.0.4\n")
    assert lines == ["pyyaml==6.0.4", f"holoscan-cu13=={holoscan}", f"monai-deploy-app-sdk=={sdk}",
                     CUDA_RUNTIME_PIN]
    inputs = prepare(PackageRequest(tmp_path / "app", tmp_path / "app.yaml", "x:1"))
    assert (inputs.sdk_version, inputs.holoscan_version) == (sdk, holoscan)
    assert inputs.app_json["sdkVersion"] == sdk
    assert f'org.monai.deploy.app-sdk="{sdk}"' in render(inputs, False, "f")


def test_sdk_pins_of_the_app_win(tmp_path: Path) -> None:
    pinned = _requirements(tmp_path / "a", "Monai_Deploy_App_SDK==3.9.1\n", ["holoscan-cu13==4.1.0"])
    assert pinned == ["Monai_Deploy_App_SDK==3.9.1", "holoscan-cu13==4.1.0", CUDA_RUNTIME_PIN]
    assert sdk_versions(pinned) == ("4.1.0", "3.9.1")
    # named without an exact pin: the recorded (installed) version is pinned next to it, so pip must agree
    ranged = _requirements(tmp_path / "b", "monai-deploy-app-sdk>=4\n")
    assert f"monai-deploy-app-sdk=={metadata.version('monai-deploy-app-sdk')}" in ranged


def test_sdk_neither_pinned_nor_installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    installed = metadata.version

    def version(name: str) -> str:
        if name == "monai-deploy-app-sdk":
            raise metadata.PackageNotFoundError(name)
        return installed(name)

    monkeypatch.setattr(metadata, "version", version)
    with pytest.raises(PackagingError, match=r"monai-deploy-app-sdk is not pinned \(==\) in .*requirements.txt "
                                             r"or in .*app.yaml application.pip-packages.*add "
                                             r"monai-deploy-app-sdk==VERSION"):
        _requirements(tmp_path, "pyyaml\n")


def test_index_token_stays_out_of_the_containerfile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """PIP_INDEX_URL goes to the build through the bind-mounted pip.conf only: no RUN line (image history),
    label or cache key holds the token."""
    inputs = prepare(PackageRequest(make_app(tmp_path), write(tmp_path, GOOD), "x:1", variant="cpu"))
    fingerprints = set()
    for token in ("s3cret-one", "s3cret-two"):
        monkeypatch.setenv("PIP_INDEX_URL", f"https://user:{token}@pypi.example.org/simple")
        context = tmp_path / token
        containerfile = write_context(inputs, context).read_text()
        assert token not in containerfile
        assert f"index-url = https://user:{token}@pypi.example.org/simple" in (context / "pip/pip.conf").read_text()
        assert "PIP_CONFIG_FILE=/tmp/pip/pip.conf" in containerfile
        fingerprints.add(re.search(r": deps-(\w+);", containerfile).group(1))
    assert len(fingerprints) == 2  # a new index still rebuilds the environment
    monkeypatch.setenv("PIP_INDEX_URL", "file:///opt/pypi/simple")  # not reachable from the build
    assert "index-url" not in pip_config(inputs, host_pip_indexes(), False).replace("extra-index-url", "")


def test_the_torch_index_is_checked_before_the_build_and_used_by_it(tmp_path: Path) -> None:
    """A mirror of the PyTorch CPU index (`--torch-index`) is what the pip step uses; before the build it must
    answer for the torch project."""
    import http.server
    import threading

    from medserve.packaging.context import check_torch_index

    class Index(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the http.server API
            self.send_response(200 if self.path == "/mirror/torch/" else 404)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Index)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        mirror = f"http://127.0.0.1:{server.server_port}/mirror"
        check_torch_index(mirror)
        check_torch_index(mirror + "/")
        with pytest.raises(PackagingError, match=r"/other, which has no torch project \(404\); pass --wheel-dir"):
            check_torch_index(f"http://127.0.0.1:{server.server_port}/other")
    finally:
        server.shutdown()
    inputs = prepare(PackageRequest(make_app(tmp_path), write(tmp_path, GOOD), "x:1", variant="cpu",
                                    torch_index=mirror))
    assert f"extra-index-url = {mirror}\n" in pip_config(inputs, PipIndexes(), False)


def test_the_build_uses_the_indexes_pip_install_uses_here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A mirror set in pip.conf (as hospitals' networks do) reaches the build: [install] before [global], PIP_*
    variables before both; file:// indexes (this machine's folders) stay out."""
    for name in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_TRUSTED_HOST"):
        monkeypatch.delenv(name, raising=False)
    config = tmp_path / "pip.conf"
    config.write_text("[global]\nindex-url = https://global.example/simple\n"
                      "extra-index-url =\n    http://extra.example/simple\n    file:///opt/pypi/simple\n"
                      "trusted-host = extra.example\n[install]\nindex-url = https://mirror.example/simple\n")
    monkeypatch.setenv("PIP_CONFIG_FILE", str(config))
    assert host_pip_indexes() == PipIndexes("https://mirror.example/simple", ("http://extra.example/simple",),
                                            ("extra.example",))
    inputs = prepare(PackageRequest(make_app(tmp_path), write(tmp_path, GOOD), "x:1", variant="cpu"))
    assert pip_config(inputs, host_pip_indexes(), False) == (
        "[global]\nindex-url = https://mirror.example/simple\n"
        f"extra-index-url = http://extra.example/simple {TORCH_CPU_INDEX}\ntrusted-host = extra.example\n")
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "https://env-one.example/simple https://env-two.example/simple")
    assert host_pip_indexes().extra_index_urls == ("https://env-one.example/simple", "https://env-two.example/simple")


def test_context_leaves_out_what_the_official_dockerignore_does(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    (app / ".env").write_text("TOKEN=s3cret\n")
    for folder in (".venv/bin", "venv", "sub/__pycache__", "sub/.git", "build-x86", "wheels", ".pytest_cache"):
        (app / folder).mkdir(parents=True)
        (app / folder / "f").write_text("x")
    for name in ("run.log", "sub/debug.log", "sub/x.pyc", ".coverage.1", "sub/keep.py", "wheels.txt"):
        (app / name).write_text("x")
    inputs = prepare(PackageRequest(app, write(tmp_path, GOOD), "x:1"))
    write_context(inputs, tmp_path / "context")
    copied = sorted(p.relative_to(tmp_path / "context" / "app").as_posix()
                    for p in (tmp_path / "context" / "app").rglob("*"))
    assert copied == ["app.py", "requirements.txt", "sub", "sub/keep.py", "wheels.txt"]


@pytest.mark.parametrize("where", ["app", "models"])
def test_dangling_symlink_is_one_error_line(tmp_path: Path, where: str, capsys: pytest.CaptureFixture,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from medserve.cli import main as cli_main
    from medserve.packaging import build, engine

    app, bundle = make_app(tmp_path), make_bundle(tmp_path / "models")
    link = (app if where == "app" else bundle / "configs") / "broken"
    link.symlink_to(tmp_path / "gone")
    monkeypatch.setattr(engine, "pick", lambda choice, daemonless: "buildah")  # fails before any build
    monkeypatch.setattr(build, "_check_local_base_image", lambda *args: None)  # whether it was built or not
    code = cli_main(["package", str(app), "-c", str(write(tmp_path, GOOD)), "-t", "x:1", "-m", str(bundle)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("error: ")
    assert f"cannot copy {link}: a symlink to {tmp_path / 'gone'}, which does not exist" in err


def test_a_map_without_models_is_built_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Without -m the bundle_seg MAP built silently, then failed on every run ("bundle folders found: none")."""
    with caplog.at_level("WARNING", logger="medserve.packaging.build"):
        app = make_app(tmp_path)
        inputs = prepare(PackageRequest(app, write(tmp_path, GOOD), "x:1"))
    assert inputs.models == {} and inputs.pkg_json.get("models", {}) == {}
    assert [r.getMessage() for r in caplog.records if r.name == "medserve.packaging.build"] == [
        "no -m: the MAP holds no model (/opt/holoscan/models is empty); give -m BUNDLE_DIR unless the app needs none"]
    caplog.clear()
    with caplog.at_level("WARNING", logger="medserve.packaging.build"):
        prepare(PackageRequest(app, write(tmp_path, GOOD), "x:1", models=make_bundle(tmp_path / "models")))
    assert not [r for r in caplog.records if r.name == "medserve.packaging.build"]


def test_a_tools_last_words_leave_out_its_progress_and_retries() -> None:
    from medserve.packaging.engine import last_words

    error = ('Error: initializing source docker://127.0.0.1:5999/x:1: pinging container registry 127.0.0.1:5999: '
             'dial tcp 127.0.0.1:5999: connect: connection refused')
    pull = ("Trying to pull 127.0.0.1:5999/x:1...\n"
            'time="2026-12-08T00:10:00Z" level=warning msg="Failed, retrying in 1s ... (1/3). Error: initializing"\n'
            f"{error}\n")
    push = f"Getting image source signatures\nCopying blob sha256:881d\nCopying config sha256:27a0\n{error}\n"
    assert last_words(pull) == last_words(push) == error
    assert last_words("one\ntwo\nthree\nfour\n") == "two | three | four"  # no error line: the last lines
    skopeo = 'Getting image source signatures\ntime="x" level=fatal msg="initializing source: connection refused"\n'
    assert last_words(skopeo) == 'time="x" level=fatal msg="initializing source: connection refused"'
    only_chatter = 'Trying to pull quay.io/x:1...\ntime="x" level=warning msg="cgroupv2 manager"\n'
    assert last_words(only_chatter) == 'Trying to pull quay.io/x:1... | time="x" level=warning msg="cgroupv2 manager"'
    apt = ("dpkg: error processing package libc-bin (--configure):\n installed post-installation script failed\n"
           "Errors were encountered while processing:\n libc-bin\n"
           "E: Sub-process /usr/bin/dpkg returned an error code (1)\n")
    assert last_words(apt, 5) == "E: Sub-process /usr/bin/dpkg returned an error code (1)"
    early = "Error: a first attempt failed\nretrying\nstep 2\nstep 3\nstep 4 failed for good\n"
    assert last_words(early) == "step 2 | step 3 | step 4 failed for good"  # an error line long past says less


def _onto_full_disk(source: object, target: object) -> None:
    shutil.copyfile(source, "/dev/full")  # ENOSPC, as from a full disk


@pytest.mark.parametrize("copying", ["a tree", "a file"])
def test_a_full_build_context_disk_is_named_not_the_file_copied(tmp_path: Path, copying: str,
                                                                capsys: pytest.CaptureFixture,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A TMPDIR with no room left: the error blamed the source file ("cannot copy .../engine.py: [Errno 28] No
    space left on device; expected readable files (remove or fix it)")."""
    from medserve.cli import main as cli_main
    from medserve.packaging import build, context, engine

    app, bundle = make_app(tmp_path), make_bundle(tmp_path / "models")
    if copying == "a tree":
        monkeypatch.setattr(context.shutil, "copytree",
                            functools.partial(shutil.copytree, copy_function=_onto_full_disk))
    else:
        monkeypatch.setattr(context.shutil, "copy2", _onto_full_disk)
    monkeypatch.setattr(engine, "pick", lambda choice, daemonless: "buildah")  # fails before any build
    monkeypatch.setattr(build, "_check_local_base_image", lambda *args: None)
    code = cli_main(["package", str(app), "-c", str(write(tmp_path, GOOD)), "-t", "x:1", "-m", str(bundle)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("error: no room left on the disk of the build context "), err
    assert "set TMPDIR to a folder on a disk with room" in err and "expected readable files" not in err


def test_ca_bundle_found_where_pip_and_python_look(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bundle, empty = tmp_path / "corp.pem", tmp_path / "empty.pem"
    bundle.write_text("-----BEGIN CERTIFICATE-----\n")
    empty.write_text("")
    for name in CA_BUNDLE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(ssl, "get_default_verify_paths",
                        lambda: ssl.DefaultVerifyPaths(None, None, None, None, None, None))
    assert host_ca_bundle() is None
    monkeypatch.setenv("SSL_CERT_FILE", str(empty))  # an empty bundle would fail every TLS handshake
    assert host_ca_bundle() is None
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(bundle))
    assert host_ca_bundle() == bundle

    inputs = prepare(PackageRequest(make_app(tmp_path), write(tmp_path, GOOD), "x:1"))
    monkeypatch.delenv("REQUESTS_CA_BUNDLE")
    write_context(inputs, tmp_path / "none")
    assert not (tmp_path / "none/pip/ca.crt").exists() and "cert" not in (tmp_path / "none/pip/pip.conf").read_text()
    monkeypatch.setenv("PIP_CERT", str(bundle))
    write_context(inputs, tmp_path / "some")
    assert (tmp_path / "some/pip/ca.crt").read_text() == bundle.read_text()
    assert "cert = /tmp/pip/ca.crt" in (tmp_path / "some/pip/pip.conf").read_text()


def test_labels_keep_text_and_dollars(tmp_path: Path) -> None:
    config = write(tmp_path, {**GOOD, "application": {**GOOD["application"], "title": "Rétine ${HOME} $x"}})
    containerfile = render(prepare(PackageRequest(make_app(tmp_path), config, "x:1")), False, "f")
    assert 'org.opencontainers.image.title="Rétine \\${HOME} \\$x"' in containerfile


def test_user_setup_is_the_official_one() -> None:
    script = user_setup(1000, 1000)
    assert "groupadd -f -g 1000 holoscan" in script and "userdel" in script


def test_tools_script_is_the_official_one() -> None:
    from importlib import resources

    from medserve.packaging.context import tools_script

    official = resources.files("holoscan_cli.packager").joinpath("templates/tools.sh").read_text()
    assert tools_script() == official and "extract" in official


def test_base_image_help_builds_nothing(capsys) -> None:
    from medserve.packaging import base

    with pytest.raises(SystemExit) as exited:
        base.main(["--help"])
    assert exited.value.code == 0 and "image tag" in capsys.readouterr().out


@pytest.mark.parametrize("model", ["bundle folder", "single file"])
def test_files_only_their_owner_may_read_are_readable_in_the_image(tmp_path: Path, model: str) -> None:
    """The image runs as another user than the one who wrote the app, app.yaml and the bundle (umask 077): the
    build context, which COPY keeps the modes of, has everything that goes into the image readable by all:
    the manifests and app.config too, and the folders made for them."""
    app, bundle = make_app(tmp_path), make_bundle(tmp_path / "models")
    config = write(tmp_path, GOOD)
    for path in [*app.rglob("*"), *bundle.rglob("*"), config]:
        path.chmod(0o700 if path.is_dir() else 0o600)
    bundle.chmod(0o700)
    models = bundle if model == "bundle folder" else next(bundle.rglob("model.pt"))
    inputs = prepare(PackageRequest(app, config, "x:1", models=models))
    previous = os.umask(0o077)
    try:
        write_context(inputs, tmp_path / "context")
    finally:
        os.umask(previous)
    context = tmp_path / "context"
    in_image = [context / name for name in ("app", "lib", "models", "map", "app.config", "tools")]
    checked = [path for part in in_image for path in (part, *part.rglob("*"))]
    assert any(path.name == "app.json" for path in checked) and any(path.suffix == ".pt" for path in checked)
    for path in checked:
        wanted = 0o555 if path.is_dir() else 0o444
        assert path.stat().st_mode & wanted == wanted, (path, oct(path.stat().st_mode))


PUSH_CASES = {
    "push without registry": ("bundle-seg:0.1.0", "push destination 'bundle-seg:0.1.0' must name a registry"),
    "push to an uppercase repository": ("127.0.0.1:5999/Review/X:1", "repository 'Review/X' is not a valid name"),
    "push to a digest": ("ghcr.io/org/seg@sha256:" + "0" * 64, "names a digest, which cannot be pushed to"),
    "push with a bad tag": ("ghcr.io/org/seg:.1", "tag '.1' is not valid"),
    "push to nowhere": ("", "push destination '' must name a registry"),  # was taken as no push
    # was "repository '/127.0.0.1' is not a valid name"
    # passed here, then buildah failed with "invalid reference format"
    "push to an IPv6 address": ("[::1]:5077/medserve/y:2", "an IPv6 registry address is not an image reference"),
    "push to a URL": ("http://127.0.0.1:5077/medserve/y:2", "push destination 'http://127.0.0.1:5077/medserve/y:2' "
                      "starts with 'http://': an image reference has no URL scheme; drop it"),
}
TAG_CASES = {  # -t was not checked: the engine would refuse it after the build
    "uppercase name": ("UPPER:case", "image name 'UPPER:case': repository 'UPPER' is not a valid name"),
    "name with a space": ("a b", "image name 'a b': repository 'a b' is not a valid name"),
    "tag without a name": (":x", "image name ':x': repository '' is not a valid name"),
    "bad tag": ("ghcr.io/org/seg:-1", "image name 'ghcr.io/org/seg:-1': tag '-1' is not valid"),
}
USER_CASES = {"uid 0": (["--uid", "0"], "--uid 0: expected a number from 1 to 65533"),
              "negative gid": (["--gid", "-5"], "--gid -5: expected a number from 1 to 65533"),
              # Without --wheel-dir, an unreachable torch index is refused in seconds, not after minutes of retries.
              "torch index unreachable": (["--variant", "cpu", "--torch-index", "http://127.0.0.1:9/whl/cpu"],
                                          "the CPU variant installs torch from http://127.0.0.1:9/whl/cpu, which "
                                          "this machine cannot reach"),
              "torch index not http": (["--variant", "cpu", "--torch-index", "/srv/wheels"],
                                       "--torch-index /srv/wheels: expected an http(s) URL")}


@pytest.mark.parametrize("case", ["latin-1 app.yaml", "latin-1 requirements", "symlink loop", "models not a folder",
                                  *PUSH_CASES, *USER_CASES, *TAG_CASES])
def test_unreadable_packaging_inputs_are_one_error_line(tmp_path: Path, case: str, capsys: pytest.CaptureFixture,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Refused before any build, in one line naming the file; --push's destination is checked before the build
    (a cold build is minutes), not after it."""
    from medserve.cli import main as cli_main
    from medserve.packaging import build, engine

    app, config = make_app(tmp_path), write(tmp_path, GOOD)
    args = ["package", str(app), "-c", str(config), "-t", "x:1", "-m", str(make_bundle(tmp_path / "models"))]
    expected = {"latin-1 app.yaml": f"{config}: cannot be read as text",
                "latin-1 requirements": f"{app / 'requirements.txt'}: cannot be read as text",
                "symlink loop": f"{app / 'up'} is a symlink back up the tree it is in (a loop)",
                "models not a folder": "models path /dev/null is neither a file nor a folder",
                **{name: message for name, (_, message) in {**PUSH_CASES, **USER_CASES, **TAG_CASES}.items()}}[case]
    if case == "latin-1 app.yaml":
        config.write_bytes(config.read_bytes() + "# Résumé\n".encode("latin-1"))
    elif case == "latin-1 requirements":
        requirements = app / "requirements.txt"
        requirements.write_bytes(requirements.read_bytes() + "# Résumé\n".encode("latin-1"))
    elif case == "symlink loop":
        (app / "up").symlink_to(app, target_is_directory=True)
    elif case == "models not a folder":
        args[args.index("-m") + 1] = "/dev/null"
    elif case in USER_CASES:
        args += USER_CASES[case][0]
    elif case in TAG_CASES:
        args[args.index("x:1")] = TAG_CASES[case][0]
        monkeypatch.setattr(build, "package", lambda *a, **k: pytest.fail("built before the name was checked"))
    else:
        args += ["--push", PUSH_CASES[case][0]]
        monkeypatch.setattr(build, "package", lambda *a, **k: pytest.fail("built before the destination was checked"))
    monkeypatch.setattr(engine, "pick", lambda choice, daemonless: "buildah")  # nothing gets as far as a build
    monkeypatch.setattr(build, "_check_local_base_image", lambda *args: None)  # whether it was built or not
    monkeypatch.setattr(engine, "run_build", lambda *a, **k: pytest.fail("a build was started"), raising=False)
    code = cli_main(args)
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: ") and expected in err, err


def test_without_pip_config_the_pip_variables_still_reach_the_build(monkeypatch: pytest.MonkeyPatch,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """Where `pip config list` cannot run (a venv without pip), PIP_INDEX_URL and friends still count."""
    from medserve.packaging import context

    monkeypatch.setattr(context.sys, "executable", "/bin/false")  # 'python -m pip' fails
    monkeypatch.setenv("PIP_INDEX_URL", "https://mirror.example/simple")
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "https://extra.example/simple file:///opt/pypi")
    monkeypatch.delenv("PIP_TRUSTED_HOST", raising=False)
    assert host_pip_indexes() == PipIndexes("https://mirror.example/simple", ("https://extra.example/simple",), ())
    assert "cannot read pip's configuration" in caplog.text


HASH = "--hash=sha256:" + "0" * 64


def test_hashed_requirements_are_read_and_kept_whole(tmp_path: Path) -> None:
    """pip-compile --generate-hashes output: continuation lines and --hash options are read as pip reads them,
    so pins the app has are found; the build adds no unhashed line of its own (pip would refuse the file)."""
    text = "".join(f"{pin} \\\n    {HASH}\n" for pin in ("monai-deploy-app-sdk==4.0.0", "holoscan-cu13==4.2.0",
                                                      "nvidia-cuda-runtime==13.0.96"))
    lines = _requirements(tmp_path / "whole", text)
    assert lines == [f"{pin}      {HASH}" for pin in ("monai-deploy-app-sdk==4.0.0", "holoscan-cu13==4.2.0",
                                                      "nvidia-cuda-runtime==13.0.96")]
    partial = "".join(f"{pin} \\\n    {HASH}\n" for pin in ("monai-deploy-app-sdk==4.0.0", "holoscan-cu13==4.2.0"))
    with pytest.raises(PackagingError, match=r"uses pip's hash-checking mode \(--hash\), so the build cannot add "
                                             r"its own pins: add nvidia-cuda-runtime==13.0.\* to it, "
                                             r"with their hashes"):
        _requirements(tmp_path / "partial", partial)
