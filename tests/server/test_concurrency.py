"""8 clients x 10 requests mixed across 2 models under an eviction budget of one loaded model: 0 errors; waiting
requests hold no threads; admission is first come, first served."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from pathlib import Path

import httpx
import pytest

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


def test_a_request_whose_client_went_away_leaves_the_queue(make_server, tmp_path: Path) -> None:
    """A client that gives up while its request waits for a busy model takes its place in the queue with it: the
    study is not run for nobody, and the requests behind it do not wait for it."""
    server = with_thr(make_server(concurrency=1, queue_size=4))
    files = multipart_files(small_study(tmp_path / "study", size=16, slices=8))
    gate = server.store.entry("thr").gate
    gate.enter(lambda: None)  # the model is busy, as with a long job
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server.url}/v1/models/thr/infer", files=files, timeout=httpx.Timeout(30, read=2))
        _wait_for(lambda: gate.waiting == 0, "the abandoned request still waits in the queue")
    finally:
        gate.leave()
    assert gate.active == 0
    # Counted as the request's handler unwinds, which may be just after it left the queue.
    _wait_for(lambda: 'medserve_requests_total{endpoint="v1",model="thr",status="499"} 1.0' in
              httpx.get(f"{server.url}/metrics").text, "the abandoned request is not counted as 499")


class _LoopThread:
    """An asyncio event loop in a thread, as the server's: coroutines are submitted from the test thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def submit(self, coroutine) -> concurrent.futures.Future:  # noqa: ANN001
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


def _wait_for(condition, what: str) -> None:  # noqa: ANN001
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_gate_serves_waiters_first_come_first_served() -> None:
    """A slot that is left goes to the longest waiter, be it a sync request (waiting on the event loop) or a job
    worker (waiting in its thread), never to a newcomer that arrives just then; a waiter that gives up leaves the
    line without taking a slot."""
    from medserve.server.errors import ApiError
    from medserve.server.store import Gate

    loop = _LoopThread()
    admitted: list[str] = []

    async def request(name: str, timeout: float = 30) -> None:
        await gate.enter_async(timeout)
        admitted.append(name)

    def job(name: str) -> threading.Thread:
        def run() -> None:
            gate.enter(lambda: None)
            admitted.append(name)
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread

    try:
        for round_ in range(5):
            gate = Gate(concurrency=1, queue_size=10)
            admitted.clear()
            gate.enter(lambda: None)  # busy
            loop.submit(request("a"))
            _wait_for(lambda: gate.waiting == 1, "a never queued")
            job("b")
            _wait_for(lambda: gate.waiting == 2, "b never queued")
            gives_up = loop.submit(request("gives up", timeout=0.2))
            loop.submit(request("c"))
            _wait_for(lambda: gate.waiting == 4, "c never queued")
            with pytest.raises(ApiError, match="waited 0 s"):
                gives_up.result(timeout=10)
            assert gate.waiting == 3
            expected = ["a", "b", "c", "newcomer"]
            for step, name in enumerate(expected):
                gate.leave()  # the holder of the slot is done
                if step == 0:
                    job("newcomer")  # arrives just as the slot is left
                _wait_for(lambda: len(admitted) == step + 1, f"round {round_}: nobody got the slot after {admitted}")
                assert admitted == expected[:step + 1], (round_, admitted)
                assert gate.active == 1
            gate.leave()
            assert (gate.active, gate.waiting) == (0, 0)
    finally:
        loop.close()
