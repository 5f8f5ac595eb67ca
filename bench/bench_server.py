"""Server benchmark (`make bench-server`): writes bench/results/server.json.

In one run on the demo study: in-process pipeline vs the same request through a hot server (overhead ratio),
the first request after the bundle is dropped into the store (cold) vs hot, a tus upload of a large file vs a
plain HTTP PUT of it on loopback, and 8 concurrent clients (throughput, p50/p99, errors, peak server RSS).
Medians of at least 3 runs where it applies. The server is a real `medserve serve` subprocess.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil

REPO = Path(__file__).resolve().parents[1]
BUNDLE = REPO / "bundles" / "demo_organ_seg"
sys.path.insert(0, str(REPO))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/readyz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(url)


def files_of(study: Path) -> list[tuple[str, tuple[str, bytes, str]]]:
    return [("files", (p.name, p.read_bytes(), "application/dicom")) for p in sorted(study.iterdir())]


class RssSampler(threading.Thread):
    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.process = psutil.Process(pid)
        self.peak = 0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self.peak = max(self.peak, self.process.memory_info().rss)
            except psutil.Error:
                return
            time.sleep(0.05)


def bench_overhead(url: str, study: Path, runs: int) -> dict:
    from medserve import pipeline
    from medserve.bundle.predictor import BundlePredictor

    predictor = BundlePredictor.from_dir(BUNDLE)
    out = Path(tempfile.mkdtemp())
    worker = ThreadPoolExecutor(max_workers=1)
    worker.submit(pipeline.run_study, study, predictor, out, nifti=False).result()  # warm-up: the server is hot
    files = files_of(study)
    inproc, server = [], []
    with httpx.Client(timeout=600) as client:
        client.post(f"{url}/v1/models/demo/infer", files=files).raise_for_status()  # hot
        # Interleaved, so that background load on the machine hits both sides alike.
        for _ in range(runs):
            t = time.perf_counter()
            # On a worker thread, as the server runs it: torch on this machine runs the same work several times
            # faster off the main thread (its OpenMP pool), which would otherwise swamp the HTTP overhead.
            worker.submit(pipeline.run_study, study, predictor, out, nifti=False).result()
            inproc.append(time.perf_counter() - t)
            t = time.perf_counter()
            client.post(f"{url}/v1/models/demo/infer", files=files).raise_for_status()
            server.append(time.perf_counter() - t)
    shutil.rmtree(out, ignore_errors=True)
    inproc_s, server_s = statistics.median(inproc), statistics.median(server)
    return {"inproc_s": round(inproc_s, 4), "server_s": round(server_s, 4), "ratio": round(server_s / inproc_s, 3)}


def bench_cold(url: str, store: Path, study: Path, runs: int) -> dict:
    """Drop a fresh copy of the bundle, send a request as soon as the store lists it as settled."""
    files = files_of(study)
    cold, hot = [], []
    with httpx.Client(timeout=600) as client:
        for index in range(runs):
            name = f"cold{index}"
            shutil.copytree(BUNDLE, store / name)
            deadline = time.monotonic() + 60
            while True:
                models = {m["name"]: m for m in client.get(f"{url}/v1/models").json()["models"]}
                if models.get(name, {}).get("state") not in (None, "copying"):
                    break
                assert time.monotonic() < deadline, "bundle never settled"
                time.sleep(0.02)
            t = time.perf_counter()
            client.post(f"{url}/v1/models/{name}/infer", files=files).raise_for_status()
            cold.append(time.perf_counter() - t)
            t = time.perf_counter()
            client.post(f"{url}/v1/models/{name}/infer", files=files).raise_for_status()
            hot.append(time.perf_counter() - t)
            shutil.rmtree(store / name)
    return {"cold_s": round(statistics.median(cold), 4), "hot_s": round(statistics.median(hot), 4)}


PUT_SERVER = '''
import sys, anyio, uvicorn
from starlette.applications import Starlette
from starlette.responses import Response
from starlette.routing import Route
async def put(request):
    buffer = bytearray()
    with open(sys.argv[2], "wb") as out:
        async for chunk in request.stream():
            buffer += chunk
            if len(buffer) >= 4 * 1024 * 1024:
                await anyio.to_thread.run_sync(out.write, bytes(buffer)); buffer.clear()
        if buffer:
            await anyio.to_thread.run_sync(out.write, bytes(buffer))
    return Response(status_code=201)
async def ready(request):
    return Response("ok")
app = Starlette(routes=[Route("/put", put, methods=["PUT"]), Route("/readyz", ready)])
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
'''


def bench_upload(url: str, size_mb: int, runs: int, work: Path) -> dict:
    """tus (tuspy, 64 MiB chunks, as `medserve infer` would with a big study) vs one streamed PUT, same disk."""
    from tusclient import client as tus

    blob = work / "blob.bin"
    with open(blob, "wb") as out:
        block = os.urandom(1024 * 1024)
        for _ in range(size_mb):
            out.write(block)
    port = free_port()
    put_server = subprocess.Popen([sys.executable, "-c", PUT_SERVER, str(port), str(work / "put.bin")])
    try:
        wait_ready(f"http://127.0.0.1:{port}")
        tus_rates, put_rates = [], []
        for _ in range(runs):
            t = time.perf_counter()
            uploader = tus.TusClient(f"{url}/v1/uploads").uploader(str(blob), chunk_size=64 * 1024 * 1024)
            uploader.upload()
            tus_rates.append(size_mb / (time.perf_counter() - t))
            httpx.delete(uploader.url, headers={"Tus-Resumable": "1.0.0"})

            def stream():
                with open(blob, "rb") as handle:
                    while chunk := handle.read(1024 * 1024):
                        yield chunk

            t = time.perf_counter()
            r = httpx.put(f"http://127.0.0.1:{port}/put", content=stream(), timeout=600,
                          headers={"Content-Length": str(blob.stat().st_size)})
            r.raise_for_status()
            put_rates.append(size_mb / (time.perf_counter() - t))
    finally:
        put_server.terminate()
        put_server.wait(timeout=20)
        blob.unlink(missing_ok=True)
        (work / "put.bin").unlink(missing_ok=True)
    tus_mb_s, put_mb_s = statistics.median(tus_rates), statistics.median(put_rates)
    return {"tus_mb_s": round(tus_mb_s, 1), "put_mb_s": round(put_mb_s, 1), "ratio": round(tus_mb_s / put_mb_s, 3)}


def bench_concurrency(url: str, study: Path, clients: int, per_client: int, sampler: RssSampler) -> dict:
    files = files_of(study)
    latencies: list[float] = []
    errors = 0
    lock = threading.Lock()

    def client() -> None:
        nonlocal errors
        with httpx.Client(timeout=900) as http:
            for _ in range(per_client):
                t = time.perf_counter()
                r = http.post(f"{url}/v1/models/demo/infer", files=files)
                with lock:
                    latencies.append(time.perf_counter() - t)
                    errors += r.status_code != 200

    threads = [threading.Thread(target=client) for _ in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    latencies.sort()
    p99 = latencies[min(len(latencies) - 1, int(round(0.99 * (len(latencies) - 1))))]
    return {"clients": clients, "requests": len(latencies), "errors": errors,
            "p50_s": round(statistics.median(latencies), 4), "p99_s": round(p99, 4),
            "throughput_rps": round(len(latencies) / wall, 3), "server_peak_mb": round(sampler.peak / 1024**2, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--upload-mb", type=int, default=1024)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests-per-client", type=int, default=3)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "server.json")
    args = parser.parse_args()

    from medserve.demo.study import write_demo_study

    work = Path(tempfile.mkdtemp(prefix="medserve-bench-"))
    study = work / "study"
    write_demo_study(study)
    store = work / "store"
    store.mkdir()
    shutil.copytree(BUNDLE, store / "demo")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # queue_size above clients x 1 so that the concurrency run measures queueing, not refusals
    server = subprocess.Popen([sys.executable, "-m", "medserve.cli", "serve", "--store", str(store), "--data-dir",
                               str(work / "data"), "--port", str(port), "--stable-seconds", "1", "--poll-interval",
                               "0.2", "--queue-size", str(args.clients * 2), "--max-upload-mb",
                               str(args.upload_mb + 1)], cwd=REPO)
    sampler = RssSampler(server.pid)
    try:
        wait_ready(url)
        sampler.start()
        results = {}
        print("overhead ...", flush=True)
        results["overhead"] = bench_overhead(url, study, args.runs)
        print(results["overhead"], "\ncold vs hot ...", flush=True)
        results["cold_vs_hot"] = bench_cold(url, store, study, args.runs)
        print(results["cold_vs_hot"], "\nupload ...", flush=True)
        results["upload"] = bench_upload(url, args.upload_mb, args.runs, work)
        print(results["upload"], "\nconcurrency ...", flush=True)
        results["concurrency"] = bench_concurrency(url, study, args.clients, args.requests_per_client, sampler)
        print(results["concurrency"], flush=True)
    finally:
        sampler.stop.set()
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
        shutil.rmtree(work, ignore_errors=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
