"""8 clients x 10 requests mixed across 2 models under an eviction budget of one loaded model: 0 errors."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx

from tests.server.conftest import add_bundle, multipart_files, small_study


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
