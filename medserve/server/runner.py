"""One inference on a staged input, shared by the sync endpoints and the job workers: pull (DICOMweb) ->
admission -> hot predictor -> medserve.pipeline (the core functions apps/bundle_seg's operators call) -> files in
`out_dir`.
A MAP model takes the same path with one container run in place of the hot predictor."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from medserve.server.config import ServerConfig
from medserve.server.dicomweb import DicomWebClient, with_retries
from medserve.server.errors import ApiError
from medserve.server.inputs import InputSpec
from medserve.server.maps import MapModel
from medserve.server.store import ModelStore

if TYPE_CHECKING:  # medserve.pipeline imports torch; it is imported when a run needs it
    from medserve.pipeline import StudyResult

log = logging.getLogger("medserve.server.runner")


@dataclass
class Outcome:
    result: StudyResult  # from the pipeline, or read back from a MAP's SEG
    queued_s: float
    timings: dict[str, float] = field(default_factory=dict)


def pull(config: ServerConfig, spec: InputSpec, dest: Path, retry: bool,
         on_retry: Callable[[int, Exception], None] | None = None,
         check: Callable[[], None] | None = None) -> InputSpec:
    """Resolve a DICOMweb reference into a local folder; jobs retry with backoff, sync calls fail fast. `check()`
    is called about once a second while instances arrive, and may raise to stop the pull."""
    assert config.dicomweb_url and spec.study
    client = DicomWebClient(config.dicomweb_url, config.dicomweb_timeout)
    folder = dest / "dicom"

    def attempt() -> int:
        if folder.exists():  # a retry starts from scratch rather than mixing partial pulls
            for path in folder.iterdir():
                path.unlink()
        return client.pull(spec.study, spec.series, folder, check)

    if retry:
        with_retries(attempt, config.dicomweb_retries, config.dicomweb_backoff, on_retry)
    else:
        attempt()
    return InputSpec("dicom", folder, spec.study, spec.series)


def _run(predictor: Any, spec: InputSpec, out_dir: Path, nifti: bool, queued: float, start: float,
         on_stage: Callable[[str, float], None] | None = None) -> Outcome:
    """Once admitted, with the predictor at hand (loaded just now on a cold start): the pipeline."""
    from medserve import pipeline

    timings = {"queue_s": queued, "model_s": time.monotonic() - start - queued}
    run_start = time.monotonic()
    report = on_stage or (lambda stage, progress: None)
    if isinstance(predictor, MapModel):
        report("running the MAP", 0.4)  # one step, as far as this process can see
        result = predictor.run(spec, out_dir)
    elif spec.kind == "nifti":
        report("inferring", 0.4)
        result = pipeline.run_nifti(spec.path, predictor, out_dir)
    else:
        result = pipeline.run_study(spec.path, predictor, out_dir, nifti=nifti, on_stage=on_stage)
    timings["pipeline_s"] = time.monotonic() - run_start
    for key, value in result.timings.items():
        timings[f"pipeline.{key}"] = float(value)
    return Outcome(result, queued, timings)


def execute(store: ModelStore, name: str, spec: InputSpec, out_dir: Path, *, nifti: bool,
            on_stage: Callable[[str, float], None], on_wait: Callable[[str], None]) -> Outcome:
    """Job workers: run model `name` on a local input (dicom folder or NIfTI file); outputs land in `out_dir`.
    Waits for the model in this thread for as long as it takes, calling `on_wait(stage)` every second, which may
    raise to stop waiting (a cancelled job, a stopping server); `on_stage` reports the run's own stages."""
    start = time.monotonic()
    on_wait("waiting for the model")
    while True:
        # Outside the model's queue, so that sync requests meanwhile get model_settling at once, not a wait.
        _wait_until_settled(store, name, lambda: on_wait("waiting for the model's files to settle"))
        with store.use(name, lambda: on_wait("waiting for the model")) as queued:
            try:
                predictor = store.predictor(name)
            except ApiError as error:
                if error.code != "model_settling":
                    raise
                continue  # its files started changing while the job waited for its turn: wait again, outside
            return _run(predictor, spec, out_dir, nifti, queued, start, on_stage)


def _wait_until_settled(store: ModelStore, name: str, check: Callable[[], None]) -> None:
    """Jobs: wait until a model whose files are still being copied (or were just found at a restart) has settled,
    where a sync request gets 503 model_settling, and load it; `check` runs every second and may raise."""
    while True:
        try:
            store.predictor(name)  # loads it now on a cold start
            return
        except ApiError as error:
            if error.code != "model_settling":
                raise
        check()
        time.sleep(1.0)


async def execute_async(store: ModelStore, name: str, spec: InputSpec, out_dir: Path, *, nifti: bool) -> Outcome:
    """Sync requests: the same run, admitted on the event loop (429/503 from the model's queue) and run in a
    thread of the model's own limiter."""
    start = time.monotonic()
    async with store.admit(name) as (queued, limiter):
        return await anyio.to_thread.run_sync(
            lambda: _run(store.predictor(name), spec, out_dir, nifti, queued, start), limiter=limiter)
