"""8 clients x 10 requests mixed across 2 models under an eviction budget of one loaded model: 0 errors."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx

from tests.server.conftest import add_bundle, multipart_files, small_study, with_thr


def test_8_clients_2_models_budget_1(make_server, tmp_path: Path) -> None:
    server = make_server(max_models=1, concurrency=1, queue_size=16)
    for name in ("a", "b"):
        add_bundle(server.config.store, name)
    deadline = time.monotonic() + 60
    while {e.state for e in server.store.entries()} - {"loaded", "available", "unloaded"} or \
            len(server.store.entries()) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    files = multipart_files(small_study(tmp_path / "study", size=16, slices=8))
    results: list[tuple[str, int]] = []
    peak_loaded = 0

    def client(index: int) -> None:
        with httpx.Client(timeout=300) as http:
            for request in range(10):
                model = "ab"[(index + request) % 2]
                r = http.post(f"{server.url}/v1/models/{model}/infer", files=files)
                results.append((model, r.status_code))

    def watch() -> None:
        nonlocal peak_loaded
        while len(results) < 80 and time.monotonic() < deadline + 600:
            peak_loaded = max(peak_loaded, sum(e.predictor is not None for e in server.store.entries()))
            time.sleep(0.05)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    watcher = threading.Thread(target=watch)
    watcher.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    watcher.join(timeout=10)
    assert len(results) == 80
    errors = [r for r in results if r[1] != 200]
    assert not errors, errors
    assert {m for m, _ in results} == {"a", "b"}
    assert peak_loaded <= 2  # one over the budget only while an evicted model finishes its last request
    assert sum(e.predictor is not None for e in server.store.entries()) == 1


def test_waiting_requests_hold_no_threads(make_server, tmp_path: Path) -> None:
    """60 sync requests wait for a busy model, more than anyio's shared pool of 40 threads: all of them count in
    its queue at once, the next one gets 429 at once, and authenticated endpoints answer meanwhile."""
    tokens = tmp_path / "tokens"
    tokens.write_text("tok infer\n")
    server = with_thr(make_server(tokens_file=tokens, concurrency=1, queue_size=60))
    auth = {"Authorization": "Bearer tok"}
    files = multipart_files(small_study(tmp_path / "study", size=16, slices=8))
    gate = server.store.entry("thr").gate
    gate.enter(lambda: None)  # the model is busy, as with a long job
    statuses: list[int] = []

    def call() -> None:
        statuses.append(httpx.post(f"{server.url}/v1/models/thr/infer", files=files, headers=auth,
                                   timeout=300).status_code)

    threads = [threading.Thread(target=call) for _ in range(60)]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while gate.waiting < 60:
            assert time.monotonic() < deadline, f"only {gate.waiting} requests counted as waiting"
            time.sleep(0.05)
        started = time.monotonic()
        full = httpx.post(f"{server.url}/v1/models/thr/infer", files=files, headers=auth, timeout=30)
        assert full.status_code == 429 and full.json()["error"] == "queue_full"
        assert httpx.get(f"{server.url}/v1/jobs?limit=1", headers=auth, timeout=30).status_code == 200
        created = httpx.post(f"{server.url}/v1/uploads", headers={**auth, "Tus-Resumable": "1.0.0",
                                                                  "Upload-Length": "10"}, timeout=30)
        assert created.status_code == 201
        assert time.monotonic() - started < 5
    finally:
        gate.leave()
        for t in threads:
            t.join(timeout=300)
    assert statuses == [200] * 60
