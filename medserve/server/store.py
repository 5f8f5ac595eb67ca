"""The model store: a watched folder of bundles, each callable by its folder name, with hot models kept loaded,
and of MAP descriptors, each callable by its file name.

Rules (documented in the README):
- MAP models: a file `NAME.map.json` at the top of the store, `{"image": "localhost/bundle-seg:0.1.0"}` with
  optional `"engine"` (auto|podman|docker) and `"gpus"` ("all" or a count), serves model NAME by running that
  image as a container per request (medserve.server.maps). Once the file settles the image's manifests are read
  (`available`, or `failed` with the reason, e.g. a missing image; a request on a failed MAP checks again, since
  the image can appear without the store changing). MAPs are never loaded, evicted or counted in the budget. A
  bundle folder `NAME/` takes precedence over `NAME.map.json`.
- Half-copy: a folder is considered only once the list of its files with their sizes and mtimes has stayed
  identical for `stable_seconds` (default 2 s). Folders whose name starts with `.` or ends with `.tmp`/`.partial`
  are ignored, so copy-then-rename (`cp -r b bundles/.b && mv bundles/.b bundles/b`) is also safe.
- Replace: when a loaded bundle's files change and settle, the new version loads in the background while the
  old predictor keeps serving; requests switch to the new one once it has loaded. A failed reload marks the
  model `failed` (what is on disk is what serves).
- Remove: the entry disappears and the predictor is dropped; in-flight requests finish with their reference.
- Budget: after a load, least-recently-used models are unloaded until `max_models` / `max_memory_bytes` hold.
  Idle models go first; a model that is running a request is evicted only if that is not enough (the request
  finishes with its reference and the memory is freed afterwards).
- Admission: per model at most `concurrency` running and `queue_size` waiting; the next sync request gets 429
  with Retry-After; waiting longer than `queue_timeout` gives 503. Sync requests wait on the event loop, so
  waiting ones hold no thread. Jobs wait for the model as long as it takes (until cancelled).
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio

from medserve.bundle.layout import BundleLayout
from medserve.errors import BundleError, MedserveError
from medserve.server.config import ServerConfig
from medserve.server.errors import ApiError, client_message, shown
from medserve.server.maps import SUFFIX as MAP_SUFFIX
from medserve.server.maps import MapModel

log = logging.getLogger("medserve.server.store")

NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
NAME_RULE = ("start with a letter or digit, then use letters, digits, '.', '_' or '-' (at most 128 in all), no '..' "
             "and no path separators")
ARCHIVES = (".zip", ".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tar.xz")
# Loads (and MAP image checks) that run at once: a bundle whose load takes minutes (big weights on a network
# share, slow imports) must not hold back a new version of another model. Each load is a model's memory.
LOADERS = 4
# The watcher spends at most a fifth of its time scanning: a store of many files (or on a slow share) is scanned
# less often rather than taking a core.
SCAN_SHARE = 0.2

Fingerprint = tuple[tuple[str, int, int, int, int], ...]


def is_model_name(name: str) -> bool:
    """Model names are folder names: no path separators, no `..`, nothing a path could be built from."""
    return bool(NAME_RE.fullmatch(name)) and ".." not in name


def check_model_name(name: Any) -> str:
    if not isinstance(name, str) or not is_model_name(name):
        raise ApiError(400, "bad_model_name",
                       f"invalid model name {shown(name)}: {NAME_RULE}")
    return name


def _take_metadata(entry: ModelEntry, meta: dict[str, Any]) -> None:
    """The version and description a listing shows, from the bundle's metadata.json."""
    entry.version = str(meta.get("version")) if meta.get("version") is not None else None
    entry.description = meta.get("description") or meta.get("name")


def fingerprint(folder: Path) -> Fingerprint:
    """Every file under `folder` (or the file itself, for a descriptor) with its size, mtime, inode and mode;
    any change during a copy changes this value. Folders linked into the bundle (`models -> /weights`) are
    walked too. Size and mtime alone missed a bundle switched by `ln -sfn` between two versions whose files
    have the same sizes and mtimes (reproducible archives), and a permission fixed by chmod. Not the ctime:
    backups that hard-link the store (`cp -al`), chown runs and relabelling change it too, and every model
    would reload (twice its memory meanwhile) for nothing."""
    def stamp(name: str, st: os.stat_result) -> tuple[str, int, int, int, int]:
        return name, st.st_size, st.st_mtime_ns, st.st_ino, st.st_mode

    if folder.is_file():
        try:
            return (stamp(folder.name, folder.stat()),)
        except FileNotFoundError:
            return ()
    items = []
    walked: set[tuple[int, int]] = set()  # real folders, each once: a link back up must not loop
    for top, folders, files in os.walk(folder, followlinks=True):
        try:
            st = os.stat(top)
        except FileNotFoundError:  # removed while we walk: the next scan sees the new state
            continue
        if (st.st_dev, st.st_ino) in walked:
            folders.clear()
            continue
        walked.add((st.st_dev, st.st_ino))
        for name in files:
            path = Path(top, name)
            try:
                if path.is_file():
                    items.append(stamp(path.relative_to(folder).as_posix(), path.stat()))
            except FileNotFoundError:
                continue
    return tuple(sorted(items))


@dataclass(eq=False)
class _Ticket:
    """A place in a gate's queue. `wake` tells its waiter; `admitted` is set when a slot is handed to it."""

    wake: Callable[[], None]
    admitted: bool = False


class Gate:
    """Per-model admission: a bounded number of running requests and a bounded queue of waiting ones, served
    first come, first served.

    Sync requests wait on the event loop (`enter_async`), so a waiting request holds no thread; job workers wait
    in their own thread (`enter`). Both queue in one line. A slot that is left goes straight to the longest
    waiter (it stays counted in `active`), so a newcomer cannot take it first; a newcomer takes a free slot
    only when nobody is waiting."""

    def __init__(self, concurrency: int, queue_size: int) -> None:
        self.concurrency = max(1, concurrency)
        self.queue_size = max(0, queue_size)
        self.active = 0
        # Threads for the runs of admitted sync requests, apart from anyio's shared pool (auth, file I/O, ...).
        self.limiter = anyio.CapacityLimiter(self.concurrency)
        self._lock = threading.Lock()
        self._queue: deque[_Ticket] = deque()

    @property
    def waiting(self) -> int:
        return len(self._queue)

    def _take_free_slot(self) -> bool:
        """Under the lock: a newcomer's slot, when one is free and nobody waits for it."""
        if self.active < self.concurrency and not self._queue:
            self.active += 1
            return True
        return False

    async def enter_async(self, timeout: float) -> float:
        """Sync requests: take a slot, or wait for one without holding a thread; 429 at once when the queue is
        full, 503 after `timeout` seconds. Returns the seconds spent queued."""
        start = time.monotonic()
        loop = asyncio.get_running_loop()
        admitted: asyncio.Future[None] = loop.create_future()
        with self._lock:
            if self._take_free_slot():
                return 0.0
            if len(self._queue) >= self.queue_size:
                raise ApiError(429, "queue_full", "model is busy and its queue is full; retry later",
                               {"Retry-After": "1"})
            ticket = _Ticket(lambda: loop.call_soon_threadsafe(_wake, admitted))
            self._queue.append(ticket)
        try:
            with anyio.fail_after(timeout):
                await admitted
        except TimeoutError as error:
            self._withdraw(ticket)
            raise ApiError(503, "queue_timeout", f"waited {timeout:.0f} s for the model; retry later",
                           {"Retry-After": "5"}) from error
        except BaseException:  # the client went away, or the server is stopping
            self._withdraw(ticket)
            raise
        return time.monotonic() - start

    def enter(self, check: Callable[[], None]) -> float:
        """Job workers: wait in this thread for a slot, outside the queue limit (the job queue is bounded by the
        number of workers) and without a timeout; `check()` runs every second and may raise to stop waiting
        (a cancelled job). Returns the seconds spent queued."""
        start = time.monotonic()
        admitted = threading.Event()
        with self._lock:
            if self._take_free_slot():
                return 0.0
            ticket = _Ticket(admitted.set)
            self._queue.append(ticket)
        try:
            while not admitted.wait(timeout=1.0):
                check()
        except BaseException:
            self._withdraw(ticket)
            raise
        return time.monotonic() - start

    def leave(self) -> None:
        with self._lock:
            self._pass_on()

    def _withdraw(self, ticket: _Ticket) -> None:
        """A waiter gives up: leave the queue, or pass on the slot it was handed meanwhile."""
        with self._lock:
            if ticket.admitted:
                self._pass_on()
            else:
                self._queue.remove(ticket)

    def _pass_on(self) -> None:
        """Under the lock: a slot is free; hand it to the longest waiter, or free it."""
        while self._queue:
            ticket = self._queue.popleft()
            ticket.admitted = True
            try:
                ticket.wake()
                return
            except RuntimeError:  # its event loop has closed (the server is stopping): nobody will take it
                continue
        self.active -= 1


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


@dataclass
class ModelEntry:
    """One folder (bundle) or descriptor file (MAP) of the store and what we know about it."""

    name: str
    path: Path
    gate: Gate
    is_map: bool  # a descriptor file, not a bundle folder
    # bundles: copying -> available -> loading -> loaded; failed; unloaded after eviction.
    # MAPs: copying -> checking -> available; failed.
    state: str = "copying"
    error: str | None = None
    version: str | None = None
    description: str | None = None
    predictor: Any = None
    loaded_fp: Fingerprint | None = None  # files the predictor (or the failure) came from
    seen_fp: Fingerprint | None = None  # last scan's files
    stable_since: float = 0.0
    settled_fp: Fingerprint | None = None  # last fingerprint that satisfied the half-copy rule
    last_used: float = 0.0
    memory: int = 0
    load_seconds: float | None = None
    reloading: bool = False
    unloads: int = 0  # admin unloads so far: a load asked for before an unload does not keep its predictor
    load_lock: threading.Lock = field(default_factory=threading.Lock)
    map: MapModel | None = None  # set once a MAP descriptor has been parsed

    def summary(self) -> dict[str, Any]:
        device = getattr(self.predictor, "device", None)
        return {
            "name": self.name,
            "kind": "map" if self.is_map else "bundle",
            "image": self.map.image if self.map is not None else None,
            "version": self.version,
            "description": self.description,
            "state": self.state,
            "loaded": self.predictor is not None,
            "device": str(device) if device is not None else None,
            "memory_bytes": self.memory if self.predictor is not None else 0,
            "error": self.error,
            "load_seconds": None if self.load_seconds is None else round(self.load_seconds, 3),
            "reloading": self.reloading,  # a new version of its files is loading; this one serves until then
            "active": self.gate.active,
            "queued": self.gate.waiting,
        }


def _load_bundle(path: Path, device: str | None) -> Any:
    from medserve.bundle.predictor import BundlePredictor

    return BundlePredictor.from_dir(path, device=device)


class ModelStore:
    """Watches `config.store` and hands out hot predictors by name."""

    def __init__(self, config: ServerConfig, on_change: Any = None) -> None:
        self.config = config
        self.root = Path(config.store)
        self._entries: dict[str, ModelEntry] = {}
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._background = ThreadPoolExecutor(max_workers=LOADERS, thread_name_prefix="medserve-load")
        self._ignored: set[str] = set()  # names in the store that cannot be model names, warned about once
        self.scanned = threading.Event()  # set after the first scan has settled
        # Readiness: the first scan has settled and every --preload model found then is loaded or failed, so a
        # probe does not route requests to a server that would make them wait for a load.
        self.ready = threading.Event()
        self.on_change = on_change  # called after loads/unloads (metrics)

    # ---- lifecycle -------------------------------------------------------------------------------------
    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self._thread = threading.Thread(target=self._watch, name="medserve-store", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._background.shutdown(wait=False, cancel_futures=True)

    def _watch(self) -> None:
        first = time.monotonic()
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self.scan()
            except Exception:  # the watcher must survive anything a user does to the folder
                log.exception("store scan failed")
            took = time.monotonic() - started
            if not self.scanned.is_set() and (
                all(e.state != "copying" for e in self.entries())
                or time.monotonic() - first > self.config.stable_seconds * 5
            ):
                self.scanned.set()
            if self.scanned.is_set() and not self.ready.is_set() and not self._preloading():
                self.ready.set()
            self._stop.wait(max(self.config.poll_interval, took * (1 / SCAN_SHARE - 1)))

    def _preloading(self) -> bool:
        """Whether a model asked for by --preload settled and is still on its way to loaded (or failed). One still
        being copied when the first scan gave up waiting (see `_watch`) does not hold readiness back."""
        preload = self.config.preload
        return any(("all" in preload or e.name in preload) and e.state in ("checking", "loading")
                   for e in self.entries())

    # ---- scanning --------------------------------------------------------------------------------------
    def _folders(self) -> dict[str, Path]:
        """Model name -> bundle folder or MAP descriptor file."""
        found: dict[str, Path] = {}
        descriptors: dict[str, Path] = {}
        if not self.root.is_dir():
            return found
        for child in self.root.iterdir():
            name = child.name
            if name.startswith(".") or name.endswith((".tmp", ".partial")):
                continue
            if child.is_dir():
                model, models = name, found
            elif child.is_file() and name.endswith(MAP_SUFFIX):
                model, models = name.removesuffix(MAP_SUFFIX), descriptors
            else:
                if name.lower().endswith(ARCHIVES) and name not in self._ignored:
                    self._ignored.add(name)
                    log.warning("ignoring %s in the model store: archives are not unpacked; extract the bundle into "
                                "a folder of its own (%s/NAME/configs, %s/NAME/models)", child, self.root, self.root)
                continue
            if is_model_name(model):
                models[model] = child
            elif name not in self._ignored:
                self._ignored.add(name)
                log.warning("ignoring %s in the model store: %r is not a model name (%s)", child, model, NAME_RULE)
        return {**descriptors, **found}  # a bundle folder wins over a descriptor of the same name

    def scan(self) -> None:
        """One pass of the watcher: new, changed and removed folders."""
        now = time.monotonic()
        folders = self._folders()
        # Outside the lock: walking a bundle of many files, or on a slow share, takes seconds, and requests read
        # the entries under it on the event loop (every route waited, /healthz too).
        prints: dict[str, Fingerprint | Exception] = {}
        for name, path in folders.items():
            try:
                prints[name] = fingerprint(path)
            except Exception as error:  # one unreadable model must not keep the others from settling
                prints[name] = error
        with self._lock:
            for name in list(self._entries):
                if folders.get(name) != self._entries[name].path:  # gone, or now a bundle instead of a MAP
                    entry = self._entries.pop(name)
                    log.info("model %s removed from the store; unloading", name)
                    entry.predictor = None
                    entry.state = "removed"
                    self._changed()
            for name, path in folders.items():
                entry = self._entries.get(name)
                if entry is None:
                    entry = ModelEntry(name, path, Gate(self.config.concurrency, self.config.queue_size),
                                       is_map=path.is_file())
                    self._entries[name] = entry
                    log.info("bundle %s appeared; waiting for it to settle", name)
                try:
                    self._scan_entry(entry, now, prints[name])
                except Exception as error:  # one unreadable model must not keep the others from settling
                    log.exception("model %s cannot be read", name)
                    entry.state, entry.error, entry.predictor = "failed", self._reason(error), None
                    entry.loaded_fp = entry.settled_fp
                    self._changed()

    def _scan_entry(self, entry: ModelEntry, now: float, fp: Fingerprint | Exception) -> None:
        if isinstance(fp, Exception):
            raise fp
        if fp != entry.seen_fp:
            entry.seen_fp = fp
            entry.stable_since = now
            if entry.predictor is None:  # nothing to keep serving: unusable until the files settle
                entry.state, entry.error = "copying", None  # a failure of the files being replaced is past
            return
        if now - entry.stable_since < self.config.stable_seconds or (
                fp == entry.settled_fp and entry.state != "copying"):
            return
        entry.settled_fp = fp
        self._settled(entry, fp)

    def _settled(self, entry: ModelEntry, fp: Fingerprint) -> None:
        """Files stopped changing: (re)read metadata, and load eagerly when that is wanted and fits."""
        if entry.is_map:
            try:
                entry.map = MapModel.from_file(entry.path)
            except MedserveError as error:
                log.warning("MAP descriptor %s is broken: %s", entry.path.name, error)
                entry.map, entry.state, entry.error, entry.loaded_fp = None, "failed", str(error), fp
                return
            entry.state = "checking"
            self._background.submit(self._check_map, entry)
            return
        if not fp:
            entry.state, entry.error = "failed", f"{entry.name}: the bundle folder is empty"
            entry.loaded_fp = fp
            return
        try:
            # The files the app needs, its metadata, a config that decodes, weights that may be weights: a
            # bundle that cannot load is `failed` now, not when a request first loads it.
            meta = BundleLayout.find(entry.path).metadata
        except MedserveError as error:
            log.warning("bundle %s is broken: %s", entry.name, error)
            entry.state, entry.error, entry.loaded_fp = "failed", self._reason(error), fp
            entry.predictor = None
            self._changed()
            return
        if entry.predictor is not None:
            # Replacement: the old predictor keeps serving until the new one is ready, and its version is the
            # one listed (and answered under /v2) until then.
            entry.reloading = True
            self._load_in_background(entry)
            return
        _take_metadata(entry, meta)
        entry.state, entry.error = "available", None
        if self._wants_eager_load(entry):
            entry.state = "loading"
            self._load_in_background(entry)

    def _wants_eager_load(self, entry: ModelEntry) -> bool:
        preload = self.config.preload
        if "all" in preload or entry.name in preload:
            return True
        # Load right away when it fits without evicting anything: broken bundles then show as `failed` early.
        busy = [e for e in self._entries.values() if e.predictor is not None or e.state == "loading"]
        return self.config.max_models is None or len(busy) < self.config.max_models

    def _load_in_background(self, entry: ModelEntry) -> None:
        """Queue a load behind the ones already queued; an admin unload before it starts cancels it."""
        self._background.submit(self._load_safely, entry, entry.unloads)

    def _load_safely(self, entry: ModelEntry, asked_at_unloads: int) -> None:
        with self._lock:
            if self._entries.get(entry.name) is not entry:  # removed from the store while the load was queued
                return
        if entry.unloads != asked_at_unloads:  # nobody waits for a background load: the unload wins outright
            with self._lock:
                entry.reloading = False
            log.info("%s was unloaded before its queued load started; not loading it", entry.name)
            return
        try:
            self.load(entry.name, asked_at_unloads=asked_at_unloads)
        except Exception as error:  # state already records the failure
            log.debug("background load of %s failed: %s", entry.name, error)

    def _reason(self, error: Exception) -> str:
        """Why a model failed, as clients see it: files named by their path in the store (the store's own path is
        the server's business), a fault of ours or of a library with its type."""
        text = str(error) if isinstance(error, MedserveError) else f"{type(error).__name__}: {error}"
        return client_message(text, self.config.store)

    def _check_map(self, entry: ModelEntry) -> None:
        """Read the MAP's manifests from its image: `available`, or `failed` naming the image and the reason."""
        assert entry.map is not None
        checked_fp = entry.settled_fp
        try:
            entry.map.check()
        except MedserveError as error:
            message = f"MAP image {entry.map.image}: {error}"
            log.warning("model %s: %s", entry.name, message)
            with self._lock:
                entry.state, entry.error, entry.loaded_fp = "failed", message, checked_fp
            return
        with self._lock:
            entry.state, entry.error, entry.loaded_fp = "available", None, checked_fp
        log.info("MAP model %s ready: %s", entry.name, entry.map.image)

    # ---- loading ---------------------------------------------------------------------------------------
    def load(self, name: str, asked_at_unloads: int | None = None) -> Any:
        """Load (or reload) `name` now and return its predictor; raises BundleError and marks `failed`, or 503
        model_settling when its files are not the ones that last satisfied the half-copy rule.

        An admin unload after the load was asked for (`asked_at_unloads`, the entry's unload count then; by
        default now, before waiting for another caller's load of the same model) wins: the caller gets the
        predictor for this once, and the store does not keep it."""
        entry = self.entry(name)
        asked = entry.unloads if asked_at_unloads is None else asked_at_unloads
        with entry.load_lock:
            current = entry.settled_fp
            if entry.predictor is not None and entry.loaded_fp == current and not entry.reloading:
                return entry.predictor
            if entry.state == "failed" and entry.loaded_fp == current:
                raise BundleError(entry.error or f"{name} failed to load")
            if current is None or fingerprint(entry.path) != current:  # changed since it settled, maybe mid-copy
                raise self._settling(entry)
            before = entry.state
            if entry.predictor is None:
                entry.state = "loading"
            start = time.monotonic()
            try:
                predictor = _load_bundle(entry.path, self.config.device)
            except Exception as error:
                if not entry.path.exists():  # the folder went while it loaded: its removal, not a broken bundle
                    entry.state = before  # not `loading` for good: the next scan drops the entry
                    raise ApiError(404, "unknown_model", f"model {name!r} was removed from the store while it "
                                   "loaded") from error
                message = self._reason(error)
                log.warning("bundle %s failed to load: %s", name, message)
                with self._lock:
                    entry.state, entry.error = "failed", message
                    entry.predictor, entry.loaded_fp, entry.reloading = None, current, False
                self._changed()
                raise BundleError(f"model {name!r} failed to load: {message}") from error
            with self._lock:
                if self._entries.get(name) is not entry:  # removed while loading
                    raise ApiError(404, "unknown_model", f"model {name!r} was removed from the store")
                if entry.unloads != asked:
                    entry.reloading = False
                    if entry.predictor is None:  # a load that began after the unload set `loading`
                        entry.state = "unloaded"
                    log.info("%s was unloaded while it loaded; not keeping it", name)
                    return predictor
                entry.predictor, entry.loaded_fp, entry.reloading = predictor, current, False
                entry.state, entry.error = "loaded", None
                _take_metadata(entry, predictor.layout.metadata)
                entry.load_seconds = time.monotonic() - start
                try:
                    entry.memory = int(predictor.memory_bytes())
                except Exception:
                    entry.memory = 0
                entry.last_used = time.monotonic()
                log.info("loaded %s in %.2f s (%d bytes)", name, entry.load_seconds, entry.memory)
                self._enforce_budget(keep=name)
            self._changed()
            return predictor

    def unload(self, name: str) -> None:
        entry = self.entry(name)
        with self._lock:
            entry.predictor = None
            entry.unloads += 1
            if entry.state in ("loaded", "loading"):
                entry.state = "unloaded"
        self._changed()

    def _enforce_budget(self, keep: str) -> None:
        loaded = [e for e in self._entries.values() if e.predictor is not None]

        def over() -> bool:
            live = [e for e in loaded if e.predictor is not None]
            too_many = self.config.max_models is not None and len(live) > self.config.max_models
            too_big = (self.config.max_memory_bytes is not None
                       and sum(e.memory for e in live) > self.config.max_memory_bytes)
            return too_many or too_big

        # Idle first, then busy; oldest use first within each group.
        order = sorted((e for e in loaded if e.name != keep), key=lambda e: (e.gate.active > 0, e.last_used))
        for victim in order:
            if not over():
                break
            log.info("evicting %s (least recently used) to stay within the budget", victim.name)
            victim.predictor = None
            victim.state = "unloaded"

    def _changed(self) -> None:
        if self.on_change is not None:
            try:
                self.on_change(self)
            except Exception:
                log.exception("store change hook failed")

    # ---- lookups ---------------------------------------------------------------------------------------
    def entries(self) -> list[ModelEntry]:
        with self._lock:
            return sorted(self._entries.values(), key=lambda e: e.name)

    def entry(self, name: str) -> ModelEntry:
        check_model_name(name)
        with self._lock:
            entry = self._entries.get(name)
        if entry is None:  # the store's path is the server's business, not the client's
            available = ", ".join(e.name for e in self.entries()) or "none"
            raise ApiError(404, "unknown_model", f"no model {name!r} in the store; available: {available}")
        return entry

    def predictor(self, name: str) -> Any:
        """The hot predictor for `name`, loading it on demand (cold start); for a MAP, its MapModel."""
        entry = self.entry(name)
        if entry.state == "copying" and entry.predictor is None:
            raise self._settling(entry)
        if entry.is_map:
            return self._map_model(entry)
        if entry.state == "failed" and entry.loaded_fp == entry.settled_fp:
            raise ApiError(409, "model_failed", f"model {name!r} failed to load: {entry.error}")
        predictor = entry.predictor
        if predictor is None:
            predictor = self.load(name)
        entry.last_used = time.monotonic()
        return predictor

    def _settling(self, entry: ModelEntry) -> ApiError:
        return ApiError(503, "model_settling", f"bundle {entry.name!r} is still being copied; retry shortly",
                        {"Retry-After": str(max(1, int(self.config.stable_seconds)))})

    def _map_model(self, entry: ModelEntry) -> MapModel:
        if entry.map is not None and entry.state != "available":
            self._check_map(entry)  # the image may have been built or pulled since the last check
        if entry.map is None or entry.state == "failed":
            raise ApiError(409, "model_failed", f"model {entry.name!r} failed: {entry.error}")
        entry.last_used = time.monotonic()
        return entry.map

    @contextmanager
    def use(self, name: str, check: Callable[[], None]) -> Iterator[float]:
        """Job workers' admission, waiting in the calling thread: `with store.use(name, check) as queued_s: ...`
        (see Gate.enter); get the predictor inside with `store.predictor(name)`."""
        entry = self.entry(name)
        queued = entry.gate.enter(check)
        try:
            yield queued
        finally:
            entry.gate.leave()
            entry.last_used = time.monotonic()

    @asynccontextmanager
    async def admit(self, name: str) -> AsyncIterator[tuple[float, anyio.CapacityLimiter]]:
        """Sync requests' admission on the event loop: `async with store.admit(name) as (queued_s, limiter):`,
        then run the work with `anyio.to_thread.run_sync(..., limiter=limiter)`."""
        entry = self.entry(name)
        queued = await entry.gate.enter_async(self.config.queue_timeout)
        try:
            yield queued, entry.gate.limiter
        finally:
            entry.gate.leave()
            entry.last_used = time.monotonic()

    def wait_until(self, name: str, states: tuple[str, ...], timeout: float) -> ModelEntry:
        """Test and CLI helper: poll until `name` is in one of `states`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                entry = self._entries.get(name)
            if entry is not None and entry.state in states and not entry.reloading:
                return entry
            time.sleep(0.05)
        raise TimeoutError(f"{name} not in {states} after {timeout} s")
