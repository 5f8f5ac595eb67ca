"""MAP benchmark (`make bench-map`): build time cold and cached, image size by layer, container run vs direct run.

Builds apps/bundle_seg + bundles/demo_organ_seg (CPU variant) with buildah from the local base image, runs it
with podman on the demo study, and writes bench/results/map.json.
"""

from __future__ import annotations

import json
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from medserve.packaging import layout  # noqa: E402
from medserve.packaging.base import build_base_image, image_exists  # noqa: E402
from medserve.packaging.build import PackageRequest, package  # noqa: E402
from medserve.packaging.engine import base_command  # noqa: E402
from medserve.packaging.run import RunRequest, run  # noqa: E402
from medserve.packaging.wheels import wheels_for_app  # noqa: E402

TAG = "localhost/medserve-bench-bundle-seg:bench"
APP, CONFIG, BUNDLE = REPO / "apps" / "bundle_seg", REPO / "app.yaml", REPO / "bundles" / "demo_organ_seg"
RUNS = 3


def _big_stack() -> None:
    resource.setrlimit(resource.RLIMIT_STACK, (32 * 1024 * 1024, 32 * 1024 * 1024))


def layers(tag: str) -> list[dict]:
    out = subprocess.run([*base_command("podman"), "history", "--format", "json", tag], capture_output=True,
                         text=True, check=True).stdout
    rows = json.loads(out)
    return [{"size_mb": round(row["size"] / 1e6, 2), "step": row.get("CreatedBy", "")[:90].strip()}
            for row in reversed(rows) if row["size"] > 0]


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def main() -> int:
    results: dict = {"machine": f"{platform.machine()}, {__import__('os').cpu_count()} CPUs", "variant": "cpu"}
    if not image_exists(layout.DEFAULT_BASE_IMAGE):
        results["base_image_build_s"] = round(timed(lambda: build_base_image()), 1)
    started = time.perf_counter()
    wheels = wheels_for_app(APP, CONFIG, Path.home() / ".cache" / "medserve")
    results["wheel_download_s"] = round(time.perf_counter() - started, 1)

    request = PackageRequest(APP, CONFIG, TAG, models=BUNDLE, builder="buildah", wheel_dir=wheels, variant="cpu")
    cold = package(PackageRequest(**{**request.__dict__, "no_cache": True}))
    cached = package(request)
    results["build_cold_s"] = round(cold.seconds, 1)
    results["build_cached_s"] = round(cached.seconds, 1)
    with tempfile.TemporaryDirectory() as temp:
        changed_app = Path(temp) / "bundle_seg"
        subprocess.run(["cp", "-r", str(APP), str(changed_app)], check=True)
        (changed_app / "app.py").write_text((APP / "app.py").read_text() + "\n# benchmark: app changed\n")
        changed = package(PackageRequest(**{**request.__dict__, "application": changed_app}))
        results["build_app_changed_s"] = round(changed.seconds, 1)
    package(request)  # the bench image again, as the last build

    inspect = json.loads(subprocess.run([*base_command("podman"), "image", "inspect", TAG], capture_output=True,
                                        text=True, check=True).stdout)[0]
    results["image_size_mb"] = round(inspect["Size"] / 1e6, 1)
    results["layers"] = layers(TAG)

    with tempfile.TemporaryDirectory() as temp:
        study = Path(temp) / "study"
        subprocess.run([sys.executable, "-m", "medserve.demo.study", str(study)], check=True, cwd=REPO,
                       capture_output=True)
        container, direct = [], []
        for i in range(RUNS):
            out = Path(temp) / f"map{i}"
            container.append(timed(lambda: run(RunRequest(TAG, study, out, engine="podman"))))
            assert list(out.rglob("*.dcm")), "the MAP wrote no SEG"
            out = Path(temp) / f"direct{i}"
            direct.append(timed(lambda: subprocess.run(
                [sys.executable, str(APP / "app.py"), "-i", str(study), "-o", str(out), "-m", str(BUNDLE)],
                cwd=REPO, check=True, capture_output=True, preexec_fn=_big_stack)))
        results["run_container_s"] = {"median": round(statistics.median(container), 2),
                                      "all": [round(v, 2) for v in container]}
        results["run_direct_s"] = {"median": round(statistics.median(direct), 2), "all": [round(v, 2) for v in direct]}
    # untag only: rmi would also delete the cached layers that `make test` reuses
    subprocess.run([*base_command("podman"), "untag", TAG, TAG], capture_output=True)

    target = REPO / "bench" / "results" / "map.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
