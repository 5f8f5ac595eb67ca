"""Runs inside the test's network namespace (`ip netns exec NS python orthanc_driver.py ...`), where Orthanc
and `medserve serve` listen on loopback. Drives the round trip and prints one JSON summary line."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pydicom
from dicomweb_client.api import DICOMwebClient


def main() -> int:
    study_dir, orthanc_url, server_url, orthanc_cmd = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    dicomweb = f"{orthanc_url}/dicom-web"
    out: dict[str, object] = {}
    client = DICOMwebClient(dicomweb)
    datasets = [pydicom.dcmread(p) for p in sorted(study_dir.iterdir())]
    client.store_instances(datasets)  # STOW-RS the demo study into Orthanc
    study_uid, series_uid = datasets[0].StudyInstanceUID, datasets[0].SeriesInstanceUID

    # sync inference by UID
    r = httpx.post(f"{server_url}/v1/models/demo/infer", json={"study": study_uid, "series": series_uid},
                   timeout=300)
    out["sync_status"] = r.status_code
    if r.status_code == 200:
        seg = pydicom.dcmread(io.BytesIO(r.content))
        out["sync_modality"] = seg.Modality
        out["sync_pixels_sum"] = int(seg.pixel_array.sum())
        out["sync_references_series"] = seg.ReferencedSeriesSequence[0].SeriesInstanceUID == series_uid
    # unknown study -> 404 from the store
    r = httpx.post(f"{server_url}/v1/models/demo/infer", json={"study": "1.2.3.4.5"}, timeout=60)
    out["unknown_study_status"] = r.status_code

    # job with STOW-RS write-back, then find the SEG in Orthanc
    job = httpx.post(f"{server_url}/v1/jobs?model=demo", json={"study": study_uid, "writeback": True}).json()
    job = wait(server_url, job["id"])
    out["job_state"], out["job_error"] = job["state"], job["error"]
    found = client.search_for_series(study_instance_uid=study_uid, search_filters={"Modality": "SEG"})
    out["seg_series_in_store"] = len(found)

    # store down: sync -> 502, job retries with backoff and succeeds once the store is back
    subprocess.run(["pkill", "-STOP", "-f", "^" + orthanc_cmd], check=False) if False else None
    return_code = stop_store(orthanc_url)
    out["stopped_store"] = return_code
    r = httpx.post(f"{server_url}/v1/models/demo/infer", json={"study": study_uid}, timeout=60)
    out["down_sync_status"], out["down_sync_error"] = r.status_code, r.json().get("error")
    job = httpx.post(f"{server_url}/v1/jobs?model=demo", json={"study": study_uid}).json()
    time.sleep(1.5)
    out["down_job_stage"] = httpx.get(f"{server_url}/v1/jobs/{job['id']}").json()["stage"]
    print(json.dumps({**out, "restart_store": True, "pending_job": job["id"]}), flush=True)
    # the test restarts Orthanc, then tells us to go on by closing stdin
    sys.stdin.read()
    job = wait(server_url, job["id"])
    print(json.dumps({"retried_job_state": job["state"], "retried_job_error": job["error"]}), flush=True)
    return 0


def stop_store(orthanc_url: str) -> int:
    """Orthanc's own REST call to shut down (no signals to processes we did not start)."""
    try:
        status = httpx.post(f"{orthanc_url}/tools/shutdown", timeout=10).status_code
    except httpx.HTTPError:
        return -1
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # shutdown is asynchronous: wait until the port is closed
        try:
            httpx.get(f"{orthanc_url}/system", timeout=1)
        except httpx.HTTPError:
            return status
        time.sleep(0.1)
    return -2


def wait(server_url: str, job_id: str, timeout: float = 300) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = httpx.get(f"{server_url}/v1/jobs/{job_id}").json()
        if job["state"] in ("succeeded", "failed", "cancelled"):
            return job
        time.sleep(0.2)
    return job


if __name__ == "__main__":
    raise SystemExit(main())
