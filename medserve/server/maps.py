"""MAP models: a descriptor file in the store names a MONAI Application Package image; every request runs one
container of it (medserve.packaging.run, as `medserve run` does) over the staged study, mounted read-only, and
a fresh output folder, and answers with the `seg.dcm` / `labels.nii.gz` it wrote, like a bundle's result.

Nothing stays loaded: the container starts, reads the packaged model, writes and exits, per request."""

from __future__ import annotations

import json
import logging
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import highdicom as hd

from medserve.errors import BundleError, PackagingError
from medserve.packaging import engine
from medserve.packaging.run import RunRequest, app_exit_code, prepare, read_manifests, remove_container, wanted_gpus
from medserve.server.errors import ApiError
from medserve.server.inputs import InputSpec

if TYPE_CHECKING:  # medserve.pipeline imports torch; the store imports this module at server start
    from medserve.pipeline import StudyResult

log = logging.getLogger("medserve.server.maps")

SUFFIX = ".map.json"
LOG_TAIL_LINES = 15
# Requests whose container is starting or running, by container name, and those of them told to stop: a
# server that stops, or a job cancelled, removes their containers.
_running: dict[str, RunRequest] = {}
_stopped: set[str] = set()
_running_lock = threading.Lock()


@dataclass(frozen=True)
class MapModel:
    """What a descriptor says: the image, and optionally the engine (`auto`, `podman`, `docker`) and GPUs."""

    name: str
    image: str
    engine: str = "auto"
    gpus: str | None = None

    @classmethod
    def from_file(cls, path: Path) -> MapModel:
        """Parse `NAME.map.json`; raises BundleError (the model then shows as `failed` with the reason)."""
        name = path.name.removesuffix(SUFFIX)
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise BundleError(f"{path.name}: not valid JSON: {error}") from error
        except OSError as error:
            raise BundleError(f"{path.name}: cannot be read ({error.strerror})") from error
        if not isinstance(data, dict) or not isinstance(data.get("image"), str) or not data["image"]:
            raise BundleError(f'{path.name}: expected {{"image": "REPO:TAG"}} (optionally "engine", "gpus")')
        unknown = sorted(set(data) - {"image", "engine", "gpus"})
        if unknown:  # a typo such as "gpu" would otherwise be silently ignored
            raise BundleError(f"{path.name}: unknown field(s) {', '.join(unknown)}; allowed: image, engine, gpus")
        choice = data.get("engine", "auto")
        if choice not in ("auto", "podman", "docker"):
            raise BundleError(f"{path.name}: engine must be auto, podman or docker, not {choice!r}")
        gpus = None if data.get("gpus") is None else str(data["gpus"])
        try:
            wanted_gpus(gpus)
        except PackagingError as error:
            raise BundleError(f"{path.name}: {error}") from error
        return cls(name, data["image"], choice, gpus)

    def check(self) -> None:
        """The image is there (or pullable) and is a MAP: its manifests can be read. Raises PackagingError."""
        read_manifests(self.image, engine.pick(self.engine, "podman"))

    def run(self, spec: InputSpec, out_dir: Path) -> StudyResult:
        """One container over `spec`'s study folder; a failure raises ApiError and leaves no result behind
        that callers would mistake for one (they remove `out_dir` on any error)."""
        from medserve.results import NIFTI_NAME, SEG_NAME

        if spec.kind != "dicom" or spec.path is None:
            raise ApiError(415, "unsupported_input", f"MAP model {self.name!r} takes a DICOM study, not {spec.kind}")
        started = time.monotonic()
        try:
            # The engine once, here: removing the container later must speak to the one that started it.
            request = RunRequest(self.image, spec.path, out_dir, gpus=self.gpus,
                                 engine=engine.pick(self.engine, "podman"))
            with _running_lock:
                _running[request.name] = request  # before the image is read: a stop meanwhile still counts
            argv = prepare(request)
        except PackagingError as error:  # the image went away (or the engine did) after the store checked it
            raise ApiError(503, "map_unavailable", f"MAP model {self.name!r} ({self.image}): {error}") from error
        try:
            output = _run_container(request, argv, self.name)
        finally:
            with _running_lock:
                _running.pop(request.name, None)
                _stopped.discard(request.name)
        seconds = time.monotonic() - started
        code = app_exit_code(output.returncode, output.stdout)
        seg_path = out_dir / SEG_NAME
        if code != 0 or not seg_path.is_file():
            tail = " | ".join(output.stdout.strip().splitlines()[-LOG_TAIL_LINES:])
            what = f"exited with {code}" if code else f"exited 0 but wrote no {SEG_NAME}"
            raise ApiError(500, "map_failed", f"MAP {self.image} {what} after {seconds:.1f} s: {tail}")
        nifti_path = out_dir / NIFTI_NAME
        return result_of(seg_path, nifti_path if nifti_path.is_file() else None, {"container_s": seconds})


def _run_container(request: RunRequest, argv: list[str], model: str) -> subprocess.CompletedProcess:
    """Run the engine's client to the end. Once the request is told to stop, its container is removed every
    second until the client ends: a removal that came before the engine created the container finds none."""
    with _running_lock:
        if request.name in _stopped:
            raise ApiError(409, "map_stopped", f"MAP model {model!r}: stopped before its container started")
    log.info("MAP %s: %s", model, " ".join(argv))
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as process:
        while True:
            try:  # a communicate that times out keeps what it read for the next one
                stdout, _ = process.communicate(timeout=1.0)
                return subprocess.CompletedProcess(argv, process.returncode, stdout)
            except subprocess.TimeoutExpired:
                with _running_lock:
                    stopping = request.name in _stopped
                if stopping:
                    _remove_quietly(request)


def stop_containers(within: Path | None = None) -> None:
    """Remove the containers of MAP requests still running (those writing under the folder `within`: a
    cancelled job's). The engine would leave them running after the server has gone, writing into a job folder
    while the job itself runs again at the next start; a cancelled job's would hold its slot and its GPU."""
    with _running_lock:
        running = [request for request in _running.values()
                   if within is None or (request.output is not None and request.output.is_relative_to(within))]
        _stopped.update(request.name for request in running)
    for request in running:
        log.info("removing container %s of a MAP request still running", request.name)
        _remove_quietly(request)


def _remove_quietly(request: RunRequest) -> None:
    try:
        remove_container(request)
    except (PackagingError, OSError, subprocess.SubprocessError) as error:  # the engine went away meanwhile
        log.warning("could not remove container %s: %s", request.name, error)


def result_of(seg_path: Path, nifti_path: Path | None, timings: dict[str, float]) -> StudyResult:
    """A StudyResult read back from the SEG the container wrote, so MAP answers carry the same headers and
    job fields (study, source series, voxels per segment) as a bundle run in-process."""
    from medserve.pipeline import StudyResult, segment_counts

    seg = hd.seg.segread(seg_path)
    labels = {int(item.SegmentNumber): str(item.SegmentLabel) for item in seg.SegmentSequence}
    segments = segment_counts(seg.get_volume(combine_segments=True).array, labels)
    source_series = seg.ReferencedSeriesSequence[0].SeriesInstanceUID if "ReferencedSeriesSequence" in seg else None
    return StudyResult(seg_path=seg_path, nifti_path=nifti_path, study_uid=str(seg.StudyInstanceUID),
                       series_uid=str(source_series) if source_series else None,
                       segments=segments, timings=timings)
