"""The watched store while requests are in flight: drop, half-copy, broken, replace, remove, LRU, admission."""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
import torch

from tests.server.conftest import (ServerThread, add_bundle, bundle_snapshot, multipart_files, small_study, wait_http,
                                   with_thr)


@pytest.fixture(scope="module")
def study(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return small_study(tmp_path_factory.mktemp("small") / "study")


class Hammer:
    """Background clients sending requests to one model until stopped; records every status."""

    def __init__(self, url: str, model: str, study: Path, clients: int = 2) -> None:
        self.url, self.model = url, model
        self.files = multipart_files(study)
        self.statuses: list[int] = []
        self.versions: list[str] = []
        self._stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(clients)]

    def _run(self) -> None:
        with httpx.Client(timeout=120) as client:
            while not self._stop.is_set():
                r = client.post(f"{self.url}/v1/models/{self.model}/infer", files=self.files)
                self.statuses.append(r.status_code)

    def __enter__(self) -> Hammer:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self.threads:
            t.join(timeout=120)


def _models(url: str) -> dict[str, dict]:
    return {m["name"]: m for m in httpx.get(url + "/v1/models").json()["models"]}


def test_a_bundle_removed_while_it_loads_is_gone_not_failed(make_server, study: Path, monkeypatch) -> None:
    """The request that set off the load got 409 model_failed for a folder that was being deleted (a flaky
    'remove while in flight' in the test below): the model is gone, 404."""
    from medserve.errors import BundleError
    from medserve.server import store as store_module

    server = make_server()
    add_bundle(server.config.store, "going")
    server.store.wait_until("going", ("loaded",), 30)  # loaded at once (it fits): unloaded, a request loads it
    assert httpx.post(server.url + "/v1/models/going/unload").status_code == 200
    server.store.wait_until("going", ("unloaded",), 30)

    def removed_meanwhile(path: Path, device: str) -> None:
        shutil.rmtree(path)
        raise BundleError(f"bundle {path}: configs/metadata.json is missing")

    monkeypatch.setattr(store_module, "_load_bundle", removed_meanwhile)
    r = httpx.post(server.url + "/v1/models/going/infer", files=multipart_files(study), timeout=60)
    assert r.status_code == 404 and r.json() == {"error": "unknown_model", "message": "model 'going' was removed "
                                                 "from the store while it loaded"}, r.text


def test_drop_half_copy_broken_replace_remove(make_server, study: Path, tmp_path: Path) -> None:
    server = make_server(stable_seconds=1.5)
    store, url = server.config.store, server.url
    add_bundle(store, "a")
    server.store.wait_until("a", ("loaded",), 30)
    with Hammer(url, "a", study) as hammer:
        # Half copy: a bundle whose weights arrive in pieces (pauses below the 1.5 s rule) is never loaded.
        slow = store / "b"
        shutil.copytree(bundle_snapshot() / "configs", slow / "configs")
        (slow / "models").mkdir()
        # A separate process writes the weights in pieces with 0.3 s pauses (a thread of this process could
        # be starved of the GIL by the in-process server and pause longer than the rule allows).
        script = ("import sys, time\n"
                  "data = open(sys.argv[1], 'rb').read(); piece = len(data) // 6 + 1\n"
                  "with open(sys.argv[2], 'wb') as out:\n"
                  "    for i in range(0, len(data), piece):\n"
                  "        out.write(data[i:i + piece]); out.flush(); time.sleep(0.3)\n")
        writer = subprocess.Popen([sys.executable, "-c", script, str(bundle_snapshot() / "models" / "model.pt"),
                                   str(slow / "models" / "model.pt")])
        writer.is_alive = lambda: writer.poll() is None  # type: ignore[attr-defined]
        while writer.is_alive():
            state = _models(url).get("b", {}).get("state")
            assert state in (None, "copying"), state
            r = httpx.post(url + "/v1/models/b/infer", files=multipart_files(study))
            assert r.status_code in (404, 503), r.text
            time.sleep(0.1)
        assert writer.wait(timeout=30) == 0
        server.store.wait_until("b", ("loaded",), 30)
        assert httpx.post(url + "/v1/models/b/infer", files=multipart_files(study), timeout=120).status_code == 200

        # Broken: garbage weights -> failed with a reason; a is unaffected.
        broken = store / "broken"
        shutil.copytree(bundle_snapshot(), broken)
        (broken / "models" / "model.pt").write_bytes(b"not a torch file")
        entry = server.store.wait_until("broken", ("failed",), 30)
        assert entry.error
        info = _models(url)["broken"]
        assert info["state"] == "failed" and info["error"]
        r = httpx.post(url + "/v1/models/broken/infer", files=multipart_files(study))
        assert r.status_code == 409 and r.json()["error"] == "model_failed"
        # Named by its place in the store: the store's own path is the server's business.
        assert "broken/models/model.pt: not a PyTorch weights file" in r.json()["message"], r.text
        assert str(store) not in r.json()["message"] + info["error"]

        # Replace a while it serves: new metadata version; old keeps serving until the new one is loaded.
        meta_path = store / "a" / "configs" / "metadata.json"
        meta = json.loads(meta_path.read_text())
        meta["version"] = "9.9.9"
        meta_path.write_text(json.dumps(meta))
        deadline = time.monotonic() + 30
        while _models(url)["a"]["version"] != "9.9.9" or server.store.entry("a").reloading:
            assert time.monotonic() < deadline, "replacement not picked up"
            time.sleep(0.1)
        assert _models(url)["a"]["state"] == "loaded"

        # Remove b while a request on it is in flight: the request completes, then b is gone.
        result: dict[str, int] = {}
        inflight = threading.Thread(target=lambda: result.setdefault("status", httpx.post(
            url + "/v1/models/b/infer", files=multipart_files(study), timeout=120).status_code))
        inflight.start()
        time.sleep(0.05)
        shutil.rmtree(store / "b")
        inflight.join(timeout=120)
        assert result["status"] in (200, 404)
        deadline = time.monotonic() + 10
        while "b" in _models(url):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert httpx.post(url + "/v1/models/b/infer", files=multipart_files(study)).status_code == 404
    assert hammer.statuses and set(hammer.statuses) == {200}, hammer.statuses


def test_lru_budget_and_admin(make_server, study: Path) -> None:
    server = make_server(max_models=1)
    store, url = server.config.store, server.url
    add_bundle(store, "a")
    add_bundle(store, "b")
    deadline = time.monotonic() + 30
    while True:
        models = _models(url)
        if len(models) == 2 and all(m["state"] in ("loaded", "available", "unloaded") for m in models.values()):
            break
        assert time.monotonic() < deadline, models
        time.sleep(0.1)
    for name in ("a", "b", "a"):
        r = httpx.post(f"{url}/v1/models/{name}/infer", files=multipart_files(study), timeout=120)
        assert r.status_code == 200, (r.text, _models(url))
        models = _models(url)
        assert models[name]["loaded"] and sum(m["loaded"] for m in models.values()) == 1
    # admin load/unload
    assert httpx.post(url + "/v1/models/a/unload").json()["loaded"] is False
    loaded = httpx.post(url + "/v1/models/b/load", timeout=60).json()
    assert loaded["loaded"] and loaded["memory_bytes"] > 0 and loaded["device"] == "cpu"
    metrics = httpx.get(url + "/metrics").text
    assert "medserve_models_loaded 1.0" in metrics
    assert 'medserve_requests_total{endpoint="v1",model="a",status="200"} 2.0' in metrics
    assert "medserve_queue_seconds_bucket" in metrics and 'medserve_jobs{state="queued"}' in metrics


def test_full_queue_gives_429(make_server, study: Path) -> None:
    server = make_server(concurrency=1, queue_size=1)
    add_bundle(server.config.store, "a")
    server.store.wait_until("a", ("loaded",), 30)
    files = multipart_files(study)
    statuses: list[httpx.Response] = []

    def call() -> None:
        statuses.append(httpx.post(server.url + "/v1/models/a/infer", files=files, timeout=120))

    threads = [threading.Thread(target=call) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    codes = sorted(r.status_code for r in statuses)
    assert 200 in codes and 429 in codes, codes
    refused = next(r for r in statuses if r.status_code == 429)
    assert refused.headers["Retry-After"] and refused.json()["error"] == "queue_full"


def test_unloaded_model_with_changing_files_waits_for_them_to_settle(make_server, study: Path) -> None:
    """The half-copy rule also holds for a model that is not loaded: a request that would load it while its
    files are changing gets 503 model_settling (before and after the watcher notices), never a half copy."""
    server = with_thr(make_server(stable_seconds=1.0))
    url, files = server.url, multipart_files(study)
    weights = server.config.store / "thr" / "models" / "model.pt"
    full = weights.read_bytes()
    assert httpx.post(url + "/v1/models/thr/unload").json()["state"] == "unloaded"
    weights.write_bytes(full[: len(full) // 2])  # a new version is being copied in: half of it so far
    r = httpx.post(url + "/v1/models/thr/infer", files=files)
    assert r.status_code == 503 and r.json()["error"] == "model_settling", r.text
    time.sleep(0.5)
    assert _models(url)["thr"]["state"] == "copying"
    r = httpx.post(url + "/v1/models/thr/load")
    assert r.status_code == 503 and r.json()["error"] == "model_settling", r.text
    weights.write_bytes(full)
    server.store.wait_until("thr", ("loaded", "available"), 30)
    assert httpx.post(url + "/v1/models/thr/infer", files=files, timeout=120).status_code == 200


@pytest.fixture
def held_loads(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Bundle loads in the server (the real loader) wait until the returned event is set."""
    from medserve.server import store as store_module

    release = threading.Event()
    real_loader = store_module._load_bundle

    def held_loader(path: Path, device: str | None) -> object:
        assert release.wait(60), "the test never released the load"
        return real_loader(path, device)

    monkeypatch.setattr(store_module, "_load_bundle", held_loader)
    yield release
    release.set()


@pytest.mark.parametrize("preload", [["demo", "broken"], ["all"], []])
def test_readiness_waits_for_preloaded_models(base_config, held_loads: threading.Event, preload: list[str]) -> None:
    """/readyz and /v2/health/ready answer 503 while a --preload model is loading (a probe must not send
    requests that would wait for it), and 200 once each is loaded or failed. Without --preload, models that
    load on their own do not hold readiness back."""
    release = held_loads
    add_bundle(base_config.store, "demo")
    # Weights that fail only when loaded: a torch file that does not fit the network.
    torch.save({"unrelated": torch.zeros(1)}, add_bundle(base_config.store, "broken") / "models" / "model.pt")
    server = ServerThread(replace(base_config, preload=preload))
    server.thread.start()
    try:
        server.store.wait_until("demo", ("loading",), 30)
        time.sleep(3 * base_config.poll_interval)  # the watcher has had its chances to declare readiness
        readyz, v2 = httpx.get(server.url + "/readyz"), httpx.get(server.url + "/v2/health/ready")
        if preload:
            assert readyz.status_code == 503 and v2.status_code == 503, (readyz.text, v2.text)
            assert readyz.json() == {"ready": False, "models": {"broken": "loading", "demo": "loading"}}
        else:
            assert readyz.status_code == 200 and v2.status_code == 200, (readyz.text, v2.text)
        release.set()
        wait_http(server.url, 60)
        wait_http(server.url, 5, path="/v2/health/ready")
        # Without --preload /readyz was 200 all along: wait for both loads (the demo's is the slower) to end.
        server.store.wait_until("broken", ("failed",), 30)
        server.store.wait_until("demo", ("loaded",), 60)
        assert httpx.get(server.url + "/readyz").json() == {"ready": True,
                                                            "models": {"broken": "failed", "demo": "loaded"}}
    finally:
        release.set()
        server.__exit__(None, None, None)


def test_unload_during_a_load_wins(make_server, held_loads: threading.Event, study: Path) -> None:
    """An admin unload of a model that is still loading leaves it unloaded when the load finishes; the next
    request loads it again."""
    server = make_server()
    add_bundle(server.config.store, "a")
    server.store.wait_until("a", ("loading",), 30)
    load_lock = server.store.entry("a").load_lock
    deadline = time.monotonic() + 30
    while not load_lock.locked():  # the background load has started and waits in the loader
        assert time.monotonic() < deadline, "the load never started"
        time.sleep(0.05)
    assert httpx.post(server.url + "/v1/models/a/unload").json()["state"] == "unloaded"
    held_loads.set()
    while load_lock.locked():
        assert time.monotonic() < deadline, "the held load never finished"
        time.sleep(0.05)
    model = _models(server.url)["a"]
    assert (model["state"], model["loaded"]) == ("unloaded", False), model
    r = httpx.post(server.url + "/v1/models/a/infer", files=multipart_files(study), timeout=120)
    assert r.status_code == 200, r.text
    assert _models(server.url)["a"]["state"] == "loaded"


def test_unload_cancels_a_queued_background_load(make_server, held_loads: threading.Event,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """An admin unload of a model whose eager load is still queued behind other models' loads leaves it
    unloaded: the queued load does not run at all."""
    from medserve.server import store as store_module

    monkeypatch.setattr(store_module, "LOADERS", 1)  # one load at a time: the second waits in the queue
    server = make_server(stable_seconds=0.3)
    add_bundle(server.config.store, "a")
    add_bundle(server.config.store, "b")
    for name in ("a", "b"):  # both settled, so both loads are queued (the loader thread runs one at a time)
        server.store.wait_until(name, ("loading",), 30)
    deadline = time.monotonic() + 30
    while not any(server.store.entry(name).load_lock.locked() for name in ("a", "b")):
        assert time.monotonic() < deadline, "no load started"
        time.sleep(0.05)
    queued = next(name for name in ("a", "b") if not server.store.entry(name).load_lock.locked())
    assert httpx.post(f"{server.url}/v1/models/{queued}/unload").json()["state"] == "unloaded"
    held_loads.set()
    server.store._background.submit(lambda: None).result(timeout=60)  # the loader thread's queue has run dry
    models = _models(server.url)
    assert (models[queued]["state"], models[queued]["loaded"]) == ("unloaded", False), models[queued]
    other = ({"a", "b"} - {queued}).pop()
    assert (models[other]["state"], models[other]["loaded"]) == ("loaded", True), models[other]


class _CountingLock:
    """A model's load lock that tells when a second caller has come to wait for it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._arrivals = 0
        self.second_arrived = threading.Event()

    def __enter__(self) -> bool:
        self._arrivals += 1
        if self._arrivals == 2:
            self.second_arrived.set()
        return self._lock.__enter__()

    def __exit__(self, *exc: object) -> None:
        self._lock.__exit__(*exc)

    def locked(self) -> bool:
        return self._lock.locked()


def test_unload_wins_over_a_request_waiting_for_the_load(make_server, held_loads: threading.Event,
                                                         study: Path) -> None:
    """A request that waits for a model's load in progress when an admin unload comes is served once; the store
    keeps neither that load nor the one the request makes after it."""
    server = make_server(stable_seconds=2.0)
    add_bundle(server.config.store, "a")
    entry = server.store.wait_until("a", ("copying",), 30)  # before it settles and its load starts
    lock = entry.load_lock = _CountingLock()  # type: ignore[assignment]
    server.store.wait_until("a", ("loading",), 30)
    deadline = time.monotonic() + 30
    while not lock.locked():
        assert time.monotonic() < deadline, "the background load never started"
        time.sleep(0.05)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        request = pool.submit(httpx.post, server.url + "/v1/models/a/infer", files=multipart_files(study),
                              timeout=120)
        assert lock.second_arrived.wait(30), "the request never came to wait for the load"
        assert httpx.post(server.url + "/v1/models/a/unload").json()["state"] == "unloaded"
        held_loads.set()
        assert request.result().status_code == 200, request.result().text
    model = _models(server.url)["a"]
    assert (model["state"], model["loaded"]) == ("unloaded", False), model


@pytest.mark.parametrize(("descriptor", "expected"), [
    ({"image": "x:1", "gpus": "0,0"}, "seg.map.json: --gpus 0,0: a device is listed twice"),
    ({"image": "x:1", "gpus": "some"}, "seg.map.json: --gpus some: expected 'all', a number of GPUs"),
    ({"image": "x:1", "gpu": 1}, "seg.map.json: unknown field(s) gpu; allowed: image, engine, gpus"),
])
def test_map_descriptor_fields_are_checked_when_read(tmp_path: Path, descriptor: dict, expected: str) -> None:
    """A MAP descriptor's mistakes show when the store reads it (the model is `failed` with this reason), not
    at its first request."""
    from medserve.errors import BundleError
    from medserve.server.maps import MapModel

    path = tmp_path / "seg.map.json"
    path.write_text(json.dumps(descriptor))
    with pytest.raises(BundleError) as caught:
        MapModel.from_file(path)
    assert str(caught.value).startswith(expected), caught.value
    path.write_text(json.dumps({"image": "x:1", "gpus": "device=1"}))
    assert MapModel.from_file(path).gpus == "device=1"


def _settled_without_loading(config) -> dict[str, tuple[str, str | None]]:
    """Each model's (state, error) once the store's files have settled, with no room to load any."""
    from medserve.server.store import ModelStore

    store = ModelStore(replace(config, stable_seconds=0.0, max_models=0))
    try:
        for _ in range(2):  # the first pass sees the files, the second finds them unchanged
            store.scan()
        return {entry.name: (entry.state, entry.error) for entry in store.entries()}
    finally:
        store.stop()


def test_a_bundle_that_cannot_load_is_failed_when_found_even_with_no_room_to_load_it(base_config) -> None:
    """With --max-models full, nothing is loaded eagerly: a config that is not JSON or empty weights were listed
    `available` (and /readyz said so) until a request failed on them."""
    root = Path(base_config.store)
    (add_bundle(root, "bad_config") / "configs" / "inference.json").write_text("{ broken")
    (add_bundle(root, "empty_weights") / "models" / "model.pt").write_bytes(b"")
    add_bundle(root, "good")
    states = _settled_without_loading(base_config)
    assert states["good"] == ("available", None), states
    assert states["bad_config"][0] == "failed" and states["bad_config"][1].startswith(
        "bad_config/configs/inference.json: cannot read config (JSONDecodeError: "), states
    assert states["empty_weights"] == ("failed", "empty_weights/models/model.pt: not a PyTorch weights file (neither "
                                                 "the zip archive torch.save writes nor a pickle)"), states


def test_one_unreadable_model_does_not_keep_the_others_from_settling(base_config, tmp_path: Path) -> None:
    """A metadata.json that is not an object, a folder named like a MAP descriptor and a folder whose name cannot
    be a model name: each is failed or ignored on its own; the bundle listed beside them settles."""
    root = Path(base_config.store)
    good = add_bundle(root, "good")
    broken = add_bundle(root, "broken")
    (broken / "configs" / "metadata.json").write_text("[]")
    (root / "e.map.json").mkdir()
    (root / "e.map.json" / "notes.txt").write_text("not a descriptor")
    shutil.copytree(good, root / "v1..2")
    states = _settled_without_loading(base_config)
    assert states["good"] == ("available", None), states
    assert states["broken"][0] == "failed" and "holds a JSON array; expected a JSON object" in states["broken"][1]
    assert states["e.map.json"][0] == "failed" and "configs/metadata.json is missing" in states["e.map.json"][1]
    assert "v1..2" not in states


def test_the_store_sees_changes_behind_links_and_that_size_and_mtime_miss(tmp_path: Path) -> None:
    """A models/ folder linked into the bundle was not walked (its new weights never loaded); a bundle switched
    with `ln -sfn` between two versions whose files have equal sizes and mtimes, or a model.pt whose
    permission was fixed with chmod, kept the same fingerprint, so the old weights (or the failure) stayed."""
    from medserve.server.store import fingerprint

    bundle = add_bundle(tmp_path / "store", "linked")
    weights = tmp_path / "weights"
    (bundle / "models").rename(weights)
    (bundle / "models").symlink_to(weights, target_is_directory=True)
    (weights / "loop").symlink_to(weights, target_is_directory=True)  # walked once, not for ever
    names = [item[0] for item in fingerprint(bundle)]
    assert "models/model.pt" in names and not any(name.startswith("models/loop/") for name in names), names
    (weights / "loop").unlink()
    before = fingerprint(bundle)
    os.link(weights / "model.pt", tmp_path / "backup-of-model.pt")  # a backup hard-linking the store
    assert fingerprint(bundle) == before
    (weights / "model.pt").chmod(0o600)
    assert fingerprint(bundle) != before

    versions = tmp_path / "versions"
    for version in ("v1", "v2"):
        shutil.copytree(bundle, versions / version, symlinks=False)
        for path in (versions / version).rglob("*"):
            os.utime(path, ns=(0, 1_700_000_000 * 10**9), follow_symlinks=False)
    switched = tmp_path / "store" / "blue"
    switched.symlink_to(versions / "v1", target_is_directory=True)
    first = fingerprint(switched)
    assert [item[:3] for item in first] == [item[:3] for item in fingerprint(versions / "v2")]  # equal stamps
    switched.unlink()
    switched.symlink_to(versions / "v2", target_is_directory=True)
    assert fingerprint(switched) != first


def test_a_replaced_bundle_lists_its_new_version_once_the_new_version_serves(make_server,
                                                                          held_loads: threading.Event) -> None:
    """The new metadata's version was listed (and answered under /v2) as soon as the files settled, while the
    old weights still answered during the reload."""
    import json

    release = held_loads
    release.set()
    server = make_server()
    bundle = add_bundle(server.config.store, "demo")
    server.store.wait_until("demo", ("loaded",), 60)
    old = server.store.entry("demo").version
    release.clear()  # the replacement's load waits
    metadata = json.loads((bundle / "configs" / "metadata.json").read_text())
    metadata["version"] = "9.9.9"
    (bundle / "configs" / "metadata.json").write_text(json.dumps(metadata))
    deadline = time.monotonic() + 30
    while not server.store.entry("demo").reloading:
        assert time.monotonic() < deadline, "the replacement never began to load"
        time.sleep(0.1)
    assert httpx.get(server.url + "/v1/models/demo").json()["version"] == old != "9.9.9"
    assert httpx.get(server.url + "/v2/models/demo").json()["versions"] == [old]
    release.set()
    deadline = time.monotonic() + 60
    while server.store.entry("demo").reloading:
        assert time.monotonic() < deadline, "the replacement never finished loading"
        time.sleep(0.1)
    assert httpx.get(server.url + "/v1/models/demo").json()["version"] == "9.9.9"
    assert httpx.get(server.url + "/v2/models/demo").json()["versions"] == ["9.9.9"]


def _settle(store, passes: int = 2) -> None:
    for _ in range(passes):  # the first pass sees the files, the second finds them unchanged
        store.scan()


def test_a_slow_scan_holds_back_no_request(base_config, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bundle of 100,000 files took 1.3 s to walk, under the lock that requests read the models under on the
    event loop: /readyz, /v1/models, inference and even /healthz (queued behind them) waited on every scan."""
    from medserve.server import store as store_module

    walking, release = threading.Event(), threading.Event()
    real = store_module.fingerprint

    def slow_fingerprint(path: Path) -> object:
        if path.name == "big" and not walking.is_set():
            walking.set()
            assert release.wait(30)
        return real(path)

    add_bundle(Path(base_config.store), "big")
    store = store_module.ModelStore(replace(base_config, stable_seconds=0.0, max_models=0))
    monkeypatch.setattr(store_module, "fingerprint", slow_fingerprint)
    scanning = threading.Thread(target=store.scan)
    scanning.start()
    try:
        assert walking.wait(10)
        reader = threading.Thread(target=store.entries)
        started = time.monotonic()
        reader.start()
        reader.join(timeout=2)
        assert not reader.is_alive() and time.monotonic() - started < 0.5, "the models' listing waited for the scan"
    finally:
        release.set()
        scanning.join(timeout=30)
        store.stop()
    assert [entry.name for entry in store.entries()] == ["big"]


def test_the_watcher_takes_at_most_a_fifth_of_its_time_scanning(base_config, monkeypatch: pytest.MonkeyPatch) -> None:
    """A store whose walk takes longer than the poll interval was walked again right away, for ever: half a core
    for a bundle of 100,000 files, with the server idle."""
    from medserve.server import store as store_module

    walks: list[float] = []
    real = store_module.fingerprint

    def slow_fingerprint(path: Path) -> object:
        walks.append(time.monotonic())
        time.sleep(0.5)
        return real(path)

    add_bundle(Path(base_config.store), "big")
    monkeypatch.setattr(store_module, "fingerprint", slow_fingerprint)
    store = store_module.ModelStore(replace(base_config, poll_interval=0.1, max_models=0))
    store.start()
    try:
        deadline = time.monotonic() + 20
        while len(walks) < 3:
            assert time.monotonic() < deadline, walks
            time.sleep(0.05)
    finally:
        store.stop()
    gaps = [later - earlier for earlier, later in zip(walks, walks[1:])]
    assert min(gaps) >= 0.5 / store_module.SCAN_SHARE * 0.9, gaps


def test_a_slow_load_holds_back_no_other_model(base_config, monkeypatch: pytest.MonkeyPatch) -> None:
    """Loads ran one at a time: a new version of one model waited for another bundle's load (40 s of imports in
    the probe), serving the old weights meanwhile without a word."""
    from medserve.server import store as store_module

    release = threading.Event()
    real = store_module._load_bundle

    def loader(path: Path, device: str | None) -> object:
        if path.name == "slow":
            assert release.wait(60)
        return real(path, device)

    monkeypatch.setattr(store_module, "_load_bundle", loader)
    root = Path(base_config.store)
    store = store_module.ModelStore(replace(base_config, stable_seconds=0.0))
    try:
        add_bundle(root, "slow")
        _settle(store)
        assert store.entry("slow").state == "loading"
        add_bundle(root, "fast")
        _settle(store)
        store.wait_until("fast", ("loaded",), 30)
        assert store.entry("slow").state == "loading"
        assert store.entry("fast").summary()["reloading"] is False
    finally:
        release.set()
        store.stop()


def test_archives_in_the_store_are_named_in_the_log_once(base_config, caplog: pytest.LogCaptureFixture) -> None:
    """A zipped bundle dropped into the store was ignored without a word: its model was just not there."""
    from medserve.server.store import ModelStore

    root = Path(base_config.store)
    (root / "zipped.zip").write_bytes(b"PK\x05\x06" + bytes(18))
    (root / "tarred.tar.gz").write_bytes(b"\x1f\x8b")
    (root / "notes.txt").write_text("not a bundle, not an archive")
    store = ModelStore(replace(base_config, stable_seconds=0.0, max_models=0))
    try:
        with caplog.at_level("WARNING", logger="medserve.server.store"):
            _settle(store, 3)
    finally:
        store.stop()
    warned = [r.getMessage() for r in caplog.records if r.name == "medserve.server.store"]
    assert len(warned) == 2 and all("archives are not unpacked; extract the bundle into a folder" in m
                                    for m in warned), warned
    assert {m.split()[1].rsplit("/", 1)[-1] for m in warned} == {"zipped.zip", "tarred.tar.gz"}
    assert store.entries() == []


def test_a_failed_bundle_being_copied_again_shows_no_old_error(base_config) -> None:
    """While new files were copied over a failed bundle, the listing said `copying` beside the old failure."""
    from medserve.server.store import ModelStore

    weights = add_bundle(Path(base_config.store), "b") / "models" / "model.pt"
    weights.write_bytes(b"")
    store = ModelStore(replace(base_config, stable_seconds=0.0, max_models=0))
    try:
        _settle(store)
        assert store.entry("b").state == "failed"
        weights.write_bytes(b"half a copy")
        store.scan()
        assert (store.entry("b").state, store.entry("b").error) == ("copying", None)
    finally:
        store.stop()
