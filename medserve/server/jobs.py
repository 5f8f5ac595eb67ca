"""Async jobs: a SQLite queue under the data dir and worker threads that run them.

Crash rule: results are written to `jobs/ID/result.tmp` and renamed to `jobs/ID/result` before the row says
`succeeded`, so a finished job always has its files. On start, rows left `running` by a dead server are put
back to `queued` (attempt counter kept) and run again; after `job_max_attempts` interrupted attempts a job is
`failed` with the reason, so a job that crashes the server cannot crash it forever.
Stop rule: a clean stop (SIGTERM) claims no more jobs and gives running ones STOP_GRACE_S to finish, and those
that do are recorded; a job still running then, or waiting for its model, goes back to the queue with its attempt
given back, since a stop is no crash.
Cancel: a queued job is cancelled at once; a running one is marked `cancelled`, its worker stops at the next
stage boundary and drops whatever it produced (a forward pass in progress runs to its end).
Progress: 1 once succeeded; a job that ended without a result (failed, cancelled) reports 0 rather than how far
it got, so that no client reads a failed job as nearly done; its `error` says what stopped it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import shutil
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from medserve.errors import MedserveError
from medserve.net import without_credentials
from medserve.server import maps
from medserve.server.config import ServerConfig
from medserve.server.dicomweb import DicomWebClient, DicomWebError, with_retries
from medserve.server.errors import ApiError, client_message, for_want_of_room, shown
from medserve.server.inputs import InputSpec
from medserve.server.runner import execute, pull
from medserve.server.states import FINAL_STATES
from medserve.server.store import ModelStore

if TYPE_CHECKING:  # medserve.pipeline imports torch
    from medserve.pipeline import StudyResult

log = logging.getLogger("medserve.server.jobs")


SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,
    model TEXT NOT NULL,
    state TEXT NOT NULL,
    progress REAL NOT NULL DEFAULT 0,
    stage TEXT,
    input TEXT NOT NULL,
    writeback INTEGER NOT NULL DEFAULT 0,
    idempotency_key TEXT UNIQUE,
    created REAL NOT NULL,
    started REAL,
    finished REAL,
    attempts INTEGER NOT NULL DEFAULT 0,
    timings TEXT,
    segments TEXT,
    outputs TEXT,
    error TEXT
);
CREATE INDEX IF NOT EXISTS jobs_state ON jobs(state, created);
"""
STOP_GRACE_S = 5.0  # how long a stopping server waits for running jobs to finish
# A clean stop interrupts a job through no fault of its own: back to the queue, the attempt given back.
REQUEUE_ON_STOP = ("UPDATE jobs SET state='queued', attempts=attempts-1, progress=0, "
                   "stage='requeued: the server stopped' WHERE state='running'")
# A job whose result the server had no room to write: back to the queue, the attempt given back, to run when there
# is room again (the worker waits 1, 2, 4, ... 30 s between tries), for at most DISK_FULL_PATIENCE_S.
REQUEUE_DISK_FULL = ("UPDATE jobs SET state='queued', attempts=attempts-1, progress=0, outputs=NULL, segments=NULL, "
                     "segmented=NULL, stage='waiting for room: the server''s disk is full' WHERE state='running'")
DISK_FULL_PATIENCE_S = 1800.0
# A running job whose worker is gone (a crash, a restart) or could not record it (see `_put_back`): failed once it
# has used its attempts, else back in the queue. `{only}` narrows it to one job.
FAIL_INTERRUPTED = ("UPDATE jobs SET state='failed', finished=?, stage='interrupted', progress=0, outputs=NULL, "
                    "segmented=NULL, error=? WHERE state='running' AND attempts >= ?{only} RETURNING id")
REQUEUE_INTERRUPTED = "UPDATE jobs SET state='queued', progress=0, stage=? WHERE state='running'{only} RETURNING id"
# Waits after a worker's failure (the database refusing writes): 1, 2, 4, ... seconds, at most this.
_LONGEST_DATABASE_WAIT_S = 30.0


class Cancelled(Exception):
    pass


class IdempotencyKeyTaken(Exception):
    """A concurrent request with the same Idempotency-Key created its job first: `job` is that job."""

    def __init__(self, job: dict[str, Any]) -> None:
        super().__init__(job["id"])
        self.job = job


class ServerDiskFull(Exception):
    """The server's disk (or quota) was full while a job ran: the job waits in the queue for room."""


class ServerStopping(Exception):
    """The server is stopping: a waiting job goes back to the queue (a running one is given the grace period, then
    requeued by `close`) and runs again at the next start."""


def _iso(ts: float | None) -> str | None:
    if ts is None:
        return None
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ts)) + f".{int(ts % 1 * 1000):03d}Z"


class JobQueue:
    """The jobs table plus the workers draining it."""

    def __init__(self, config: ServerConfig, store: ModelStore, metrics: Any = None) -> None:
        self.config = config
        self.store = store
        self.metrics = metrics
        self.root = config.jobs_dir
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._closed = False
        self._wake = threading.Condition()
        self._stop = threading.Event()
        self._workers: list[threading.Thread] = []
        self._held: set[str] = set()  # jobs a worker is on: the retention sweep leaves them alone
        self._short_of_room: dict[str, float] = {}  # job -> when it first found the disk full (monotonic)
        self._db = sqlite3.connect(config.db_path, check_same_thread=False, isolation_level=None)
        try:
            self._prepare_database()
            self.recover()
        except BaseException:  # damaged or read-only: the caller says so; the file is not held open meanwhile
            self._db.close()
            raise

    # ---- persistence -----------------------------------------------------------------------------------
    def _prepare_database(self) -> None:
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")  # durable against a killed process, cheap commits
        self._db.executescript(SCHEMA)
        columns = {column["name"] for column in self._db.execute("PRAGMA table_info(jobs)")}
        if "writeback_result" not in columns:
            self._add_writeback_result()
        if "segmented" not in columns:  # jobs from before it read `segmented: null` (not recorded)
            self._db.execute("ALTER TABLE jobs ADD COLUMN segmented TEXT")
        if "result_format" not in columns:  # jobs from before it read `format: null` (the SEG first)
            self._db.execute("ALTER TABLE jobs ADD COLUMN result_format TEXT")

    def _exec(self, sql: str, args: tuple = ()) -> list[sqlite3.Row]:
        with self._lock:
            if self._closed:  # a worker still running when the server stopped
                raise ServerStopping()
            return self._db.execute(sql, args).fetchall()

    def _add_writeback_result(self) -> None:
        """A data dir from before the write-back's own record (JSON {"target", "state", "error"} once the STOW-RS
        has ended): the column, and what the old rows imply. A job with writeback succeeded only after its STOW,
        so those are `done` (where to was not recorded); jobs that ended without a result report progress 0 and
        keep no result files, as jobs do now."""
        self._db.execute("ALTER TABLE jobs ADD COLUMN writeback_result TEXT")
        self._db.execute("UPDATE jobs SET writeback_result=? WHERE writeback AND state='succeeded'",
                         (json.dumps({"target": None, "state": "done", "error": None}),))
        ended = self._db.execute("UPDATE jobs SET progress=0, outputs=NULL WHERE state IN ('failed', 'cancelled') "
                                 "RETURNING id").fetchall()
        for row in ended:
            shutil.rmtree(self.root / row["id"] / "result", ignore_errors=True)

    def recover(self) -> None:
        """Rows a killed server left `running`: rerun them, or fail them once they have used their attempts."""
        failed = self._exec(
            FAIL_INTERRUPTED.format(only=""),
            (time.time(), f"interrupted by a server crash or restart {self.config.job_max_attempts} times; "
             "not retried again", self.config.job_max_attempts))
        requeued = self._exec(REQUEUE_INTERRUPTED.format(only=""), ("requeued after a server restart",))
        for row in requeued:
            shutil.rmtree(self.root / row["id"] / "result.tmp", ignore_errors=True)
            shutil.rmtree(self.root / row["id"] / "work", ignore_errors=True)
        if requeued or failed:
            log.warning("recovered after restart: %d jobs requeued, %d failed", len(requeued), len(failed))
        # Gone whole: a job folder without a row (the server stopped while the request was still saving its input),
        # and one of a job that ended without a result (failed just above; cancelled while it ran, its worker dead
        # before it noticed), which keeps no folder.
        kept = {row["id"] for row in self._exec("SELECT id FROM jobs WHERE state NOT IN ('failed', 'cancelled')")}
        for folder in self.root.iterdir():
            if folder.is_dir() and folder.name not in kept:
                shutil.rmtree(folder, ignore_errors=True)

    def _drop_input(self, job_id: str) -> None:
        """A finished job keeps its result, not its input (a study can be gigabytes); one without a result
        (failed, cancelled) keeps no folder at all."""
        folder = self.job_dir(job_id)
        shutil.rmtree(folder / "input", ignore_errors=True)
        with contextlib.suppress(OSError):  # not empty: it holds the result
            folder.rmdir()

    def sweep_finished(self, now: float | None = None) -> int:
        """Remove the jobs that ended longer ago than the retention (`--job-retention-hours`), their results with
        them; the number removed. The row goes first: a job is never listed without its files."""
        retention = self.config.job_retention_seconds
        if retention is None:
            return 0
        cutoff = (time.time() if now is None else now) - retention
        with self._lock:  # a job cancelled while it ran may still have its worker, which writes into its folder
            held = sorted(self._held)
        states, skipped = ", ".join("?" * len(FINAL_STATES)), ", ".join("?" * len(held))
        rows = self._exec(f"DELETE FROM jobs WHERE state IN ({states}) AND finished < ? AND id NOT IN ({skipped}) "
                          "RETURNING id", (*FINAL_STATES, cutoff, *held))
        for row in rows:
            shutil.rmtree(self.job_dir(row["id"]), ignore_errors=True)
        return len(rows)

    def job_dir(self, job_id: str) -> Path:
        return self.root / job_id

    def new_id(self) -> str:
        return uuid.uuid4().hex

    def find_idempotent(self, key: str) -> dict[str, Any] | None:
        rows = self._exec("SELECT * FROM jobs WHERE idempotency_key=?", (key,))
        return self._public(rows[0]) if rows else None

    def submit(self, job_id: str, model: str, spec: InputSpec, writeback: bool, key: str | None,
               result_format: str | None = None) -> dict[str, Any]:
        """Queue a job; `result_format` is the result format it asked for, served when fetching names none."""
        try:
            self._exec("INSERT INTO jobs (id, model, state, stage, input, writeback, idempotency_key, created, "
                       "result_format) VALUES (?, ?, 'queued', 'queued', ?, ?, ?, ?, ?)",
                       (job_id, model, json.dumps(self._stored_input(job_id, spec)), int(writeback), key,
                        time.time(), result_format))
        except sqlite3.IntegrityError as error:  # a concurrent request with the same Idempotency-Key won
            shutil.rmtree(self.job_dir(job_id), ignore_errors=True)
            existing = self.find_idempotent(key or "")
            if existing is None:
                raise
            raise IdempotencyKeyTaken(existing) from error
        with self._wake:
            self._wake.notify()
        return self.get(job_id)

    def _stored_input(self, job_id: str, spec: InputSpec) -> dict[str, Any]:
        """The spec as the row keeps it: a path inside the job's folder relative to it, so that a restart that
        reaches the data dir by another path (another working directory, a moved or remounted folder) finds it."""
        data = spec.to_json()
        if spec.path is not None and spec.path.is_relative_to(self.job_dir(job_id)):
            data["path"] = spec.path.relative_to(self.job_dir(job_id)).as_posix()
        return data

    def _loaded_input(self, row: sqlite3.Row) -> InputSpec:
        spec = InputSpec.from_json(json.loads(row["input"]))
        return spec if spec.path is None else dataclasses.replace(spec, path=self.job_dir(row["id"]) / spec.path)

    def _row(self, job_id: str) -> sqlite3.Row:
        rows = self._exec("SELECT * FROM jobs WHERE id=?", (job_id,))
        if not rows:
            raise _unknown_job(job_id)
        return rows[0]

    def get(self, job_id: str) -> dict[str, Any]:
        return self._public(self._row(job_id))

    def list(self, state: str | None = None, limit: int = 100, offset: int = 0) -> list[dict[str, Any]]:
        """Newest first, ties in id order, so that pages with `offset` neither repeat nor skip a job."""
        if state:
            rows = self._exec("SELECT * FROM jobs WHERE state=? ORDER BY created DESC, id LIMIT ? OFFSET ?",
                              (state, limit, offset))
        else:
            rows = self._exec("SELECT * FROM jobs ORDER BY created DESC, id LIMIT ? OFFSET ?", (limit, offset))
        return [self._public(r) for r in rows]

    def counts(self) -> dict[str, int]:
        return {r["state"]: r["n"] for r in self._exec("SELECT state, COUNT(*) AS n FROM jobs GROUP BY state")}

    def _public(self, row: sqlite3.Row) -> dict[str, Any]:
        spec = json.loads(row["input"])
        source = {"type": spec["kind"]}
        if spec["kind"] == "dicomweb" or spec.get("study"):
            source.update(study=spec.get("study"), series=spec.get("series"))
        outputs = json.loads(row["outputs"]) if row["outputs"] else {}
        return {
            "id": row["id"], "model": row["model"], "state": row["state"], "progress": round(row["progress"], 3),
            "stage": row["stage"], "input": source, "writeback": bool(row["writeback"]),
            "created": _iso(row["created"]), "started": _iso(row["started"]), "finished": _iso(row["finished"]),
            "attempts": row["attempts"],
            "timings": {k: round(v, 4) for k, v in json.loads(row["timings"]).items()} if row["timings"] else {},
            "segments": json.loads(row["segments"]) if row["segments"] else None,
            "segmented": json.loads(row["segmented"]) if row["segmented"] else None,
            "outputs": sorted(outputs), "format": row["result_format"], "error": row["error"],
            "result_url": f"/v1/jobs/{row['id']}/result" if row["state"] == "succeeded" else None,
            "writeback_result": self._writeback_result(row),
        }

    def _writeback_result(self, row: sqlite3.Row) -> dict[str, Any] | None:
        """How the STOW-RS of the SEG went: `done` or `failed` (with the store's reason) once tried, `pending`
        before, `not_attempted` for a job that ended before it got there; None without writeback."""
        if not row["writeback"]:
            return None
        if row["writeback_result"]:
            return json.loads(row["writeback_result"])
        state = "not_attempted" if row["state"] in FINAL_STATES else "pending"
        return {"target": without_credentials(self.config.dicomweb_url or ""), "state": state, "error": None}

    def result_path(self, job_id: str, choose: Callable[[list[str]], str]) -> tuple[Path, str]:
        """The file of a succeeded job's result in the format `choose` picks from the job's outputs: the format the
        job asked for first, else the SEG."""
        row = self._row(job_id)
        if row["state"] != "succeeded":
            detail = f": {row['error']}" if row["error"] else ""
            raise ApiError(409, "job_not_finished" if row["state"] not in FINAL_STATES else "job_has_no_result",
                           f"job {job_id} is {row['state']}{detail}")
        outputs: dict[str, str] = json.loads(row["outputs"] or "{}")
        asked = row["result_format"]
        # The asked format first, even when the job did not write it (a MAP's app may write a SEG only): a fetch
        # that names no format then gets the 406 below rather than another format without a word.
        offered = set(outputs) | ({asked} if asked else set())
        fmt = choose(sorted(offered, key=lambda name: (name != asked, ("seg", "nifti").index(name))))
        if fmt not in outputs:
            raise ApiError(406, "format_unavailable", f"job {job_id} has no {fmt} output (has {sorted(outputs)})")
        path = self.job_dir(job_id) / "result" / outputs[fmt]
        if not path.is_file():  # removed behind the server's back (a clean-up of the data dir)
            raise ApiError(410, "result_gone", f"job {job_id}'s {fmt} result is no longer on the server")
        return path, fmt

    def cancel(self, job_id: str) -> dict[str, Any]:
        with self._lock:  # read and update in one step: a worker may claim or finish the job meanwhile
            if self._closed:
                raise ServerStopping()
            row = self._db.execute("SELECT state FROM jobs WHERE id=?", (job_id,)).fetchone()
            if row is None:
                raise _unknown_job(job_id)
            was = row["state"]
            if was in FINAL_STATES:
                raise ApiError(409, "job_finished", f"job {job_id} is already {was}")
            # outputs=NULL: a job cancelled after its result was saved (during write-back) loses the files, and
            # with them what they were of (segmented).
            self._db.execute("UPDATE jobs SET state='cancelled', progress=0, finished=?, stage='cancelled', "
                             "error='cancelled by request', outputs=NULL, segmented=NULL WHERE id=?",
                             (time.time(), job_id))
        if was == "queued":
            self._drop_input(job_id)  # no worker will see it
        else:  # a MAP's container ends now; a bundle's worker notices at its next step and drops the input
            maps.stop_containers(within=self.job_dir(job_id))
        log.info("job %s cancelled (was %s)", job_id, was)
        return self.get(job_id)

    # ---- workers ---------------------------------------------------------------------------------------
    def start(self) -> None:
        for index in range(max(1, self.config.job_workers)):
            thread = threading.Thread(target=self._work, name=f"medserve-job-{index}", daemon=True)
            thread.start()
            self._workers.append(thread)

    def stop(self) -> None:
        """Claim no more jobs; running ones get STOP_GRACE_S (in all) to finish and be recorded."""
        self._stop.set()
        with self._wake:
            self._wake.notify_all()
        deadline = time.monotonic() + STOP_GRACE_S
        for thread in self._workers:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        """Jobs still running after the grace period go back to the queue, without using up an attempt (a stop is
        no crash); their workers, still busy, can then no longer record anything."""
        with self._lock:
            requeued = self._db.execute(REQUEUE_ON_STOP + " RETURNING id").fetchall()
            self._closed = True
            self._db.close()
        for row in requeued:
            log.info("job %s still running at the stop; it runs again at the next start", row["id"])

    def when_workers_end(self, action: Callable[[], None]) -> None:
        """Run `action` once every worker thread has ended: now when they have, else from a watcher thread."""
        alive = [thread for thread in self._workers if thread.is_alive()]
        if not alive:
            action()
            return

        def wait() -> None:
            for thread in alive:
                thread.join()
            action()

        log.info("%d job workers still running after the stop; the data dir stays locked until they end", len(alive))
        threading.Thread(target=wait, name="jobs-ended", daemon=True).start()

    def _claim(self) -> sqlite3.Row | None:
        rows = self._exec(
            "UPDATE jobs SET state='running', started=?, attempts=attempts+1, stage='starting', progress=0.05 "
            "WHERE id=(SELECT id FROM jobs WHERE state='queued' ORDER BY created LIMIT 1) RETURNING *",
            (time.time(),))
        return rows[0] if rows else None

    def _work(self) -> None:
        # Until the first scan of the store has settled, every model is unknown or still settling: a job claimed
        # then (a re-run after a restart) would fail for nothing.
        while not self._stop.is_set() and not self.store.scanned.wait(timeout=1.0):
            pass
        stranded: str | None = None  # a job left `running` by a write the database refused
        refusals = 0
        while not self._stop.is_set():
            try:
                if stranded is not None:
                    self._put_back(stranded)
                    self._release(stranded)
                    stranded = None
                row = self._claim()
                if row is None:
                    with self._wake:
                        self._wake.wait(timeout=1.0)
                    continue
                stranded = row["id"]
                self._hold(stranded)
                self._run(row)
                self._release(stranded)
                stranded, refusals = None, 0
            except ServerStopping:
                return  # the database is closed, and `close` has requeued what was running
            except ServerDiskFull:  # requeued by `_run`
                self._release(stranded)
                stranded = None
                refusals += 1
                self._stop.wait(backoff_seconds(refusals))
            except Exception as error:  # a write the database refused, or a bug: the worker lives on
                refusals += 1
                wait = backoff_seconds(refusals)
                log.error("the job worker failed (%s: %s)%s; going on in %.0f s", type(error).__name__, error,
                          f" while job {stranded} ran" if stranded else "", wait,
                          exc_info=not isinstance(error, sqlite3.Error))
                self._stop.wait(wait)

    def _put_back(self, job_id: str) -> None:
        """Requeue a job whose worker could not record it, as `recover` does after a crash: failed once it has used
        its attempts. A job that ended meanwhile (cancelled) gets the clean-up its worker would have done."""
        limit = self.config.job_max_attempts
        message = (f"the server could not record this job (its jobs database refused writes, or its worker failed), "
                   f"and the job has used its {limit} attempt(s); not retried again")
        if self._exec(FAIL_INTERRUPTED.format(only=" AND id=?"), (time.time(), message, limit, job_id)):
            log.warning("job %s failed: %s", job_id, message)
        elif self._exec(REQUEUE_INTERRUPTED.format(only=" AND id=?"),
                        ("requeued: the server could not record it", job_id)):
            log.warning("job %s goes back to the queue: the server could not record it", job_id)
            return
        if self._row(job_id)["state"] != "succeeded":
            for name in ("result.tmp", "result", "work"):
                shutil.rmtree(self.job_dir(job_id) / name, ignore_errors=True)
        self._drop_input(job_id)

    def _hold(self, job_id: str) -> None:
        with self._lock:
            self._held.add(job_id)

    def _release(self, job_id: str) -> None:
        with self._lock:
            self._held.discard(job_id)

    def _progress(self, job_id: str, stage: str, progress: float) -> None:
        """Record a stage of a running job; Cancelled when it is no longer running. A stopping server lets the
        job go on: one that ends within the grace period is recorded, not thrown away (see `stop`)."""
        rows = self._exec("UPDATE jobs SET stage=?, progress=? WHERE id=? AND state='running' RETURNING id",
                          (stage, progress, job_id))
        if not rows:
            raise Cancelled()

    def _waiting(self, job_id: str, stage: str, progress: float) -> None:
        """A job waiting (for its model, or to retry the DICOM store): a stopping server puts it back in the queue
        now rather than at the end of the grace period, since it has done nothing worth waiting for."""
        if self._stop.is_set():
            raise ServerStopping()
        self._progress(job_id, stage, progress)

    def _run(self, row: sqlite3.Row) -> None:
        try:
            self._attempt(row)
        except ServerDiskFull as error:
            first = self._short_of_room.setdefault(row["id"], time.monotonic())
            if time.monotonic() - first > DISK_FULL_PATIENCE_S:  # a job that can never fit must not wait for ever
                del self._short_of_room[row["id"]]
                self._fail(row["id"], f"the server's disk stayed full for {DISK_FULL_PATIENCE_S / 60:.0f} minutes "
                           "while this job ran; submit it again when there is room", {})
                self._drop_input(row["id"])
            elif self._exec(REQUEUE_DISK_FULL + " AND id=? RETURNING id", (row["id"],)):
                log.warning("job %s goes back to the queue, its attempt given back: the server's disk is full (%s)",
                            row["id"], error)
            else:  # cancelled meanwhile: its input is the worker's to drop, as after any other ending
                self._short_of_room.pop(row["id"], None)
                self._drop_input(row["id"])
            raise  # the worker waits before it claims a job again
        except ServerStopping:
            try:  # not the job's fault: it goes back to the queue without using up an attempt
                self._exec(REQUEUE_ON_STOP + " AND id=?", (row["id"],))
            except ServerStopping:
                pass  # the database is closed already, and `close` has requeued it
            log.info("job %s interrupted by the server's stop; it runs again at the next start", row["id"])
        else:
            self._short_of_room.pop(row["id"], None)

    def _attempt(self, row: sqlite3.Row) -> None:
        job_id, model = row["id"], row["model"]
        try:
            spec = self._loaded_input(row)
        except (ValueError, KeyError, TypeError) as error:  # a row written by another version, or damaged
            self._fail(job_id, f"the job's stored input cannot be read ({type(error).__name__}: {error}); submit "
                       "the job again", {})
            self._drop_input(job_id)
            return
        folder = self.job_dir(job_id)
        work, tmp, final = folder / "work", folder / "result.tmp", folder / "result"
        shutil.rmtree(tmp, ignore_errors=True)
        timings: dict[str, float] = json.loads(row["timings"]) if row["timings"] else {}
        started = time.monotonic()
        try:
            outputs: dict[str, str] = json.loads(row["outputs"] or "{}")
            if not (outputs and final.is_dir()):  # else an interrupted attempt saved its result: keep it, UIDs too
                outputs = self._infer(job_id, model, spec, work, timings)
            if row["writeback"] and "seg" in outputs and spec.study is not None:
                # After the result is saved, so a re-run after a crash STOWs the same SEG instance again.
                self._progress(job_id, "storing the SEG back (STOW-RS)", 0.95)
                t = time.monotonic()
                self._store_back(job_id, final / outputs["seg"])
                timings["stow_s"] = time.monotonic() - t
            self._progress(job_id, "finishing", 0.99)
            timings["total_s"] = time.monotonic() - started
            if not self._succeed(job_id, timings):
                raise Cancelled()
            log.info("job %s succeeded in %.2f s", job_id, timings["total_s"])
        except (ServerStopping, sqlite3.Error):
            raise  # not the job's fault; a refused write leaves it to the worker to put back (see `_work`)
        except Cancelled:
            log.info("job %s was cancelled; dropping its output", job_id)
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.rmtree(final, ignore_errors=True)
        except Exception as error:
            if for_want_of_room(error):  # the server's condition, not the job's: it waits for room (see `_run`)
                shutil.rmtree(tmp, ignore_errors=True)
                raise ServerDiskFull(str(error)) from error
            self._fail(job_id, self._failure_message(job_id, error, spec), timings)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        self._drop_input(job_id)  # every way here ends the job; a failure to record that leaves it for recover()

    def _failure_message(self, job_id: str, error: Exception, spec: InputSpec) -> str:
        """What the job's record says of the error that ended it, in the client's terms (no server paths)."""
        folder = self.job_dir(job_id)
        if isinstance(error, ApiError):
            return error.message
        if isinstance(error, (MedserveError, DicomWebError)) and spec.path is not None and not spec.path.exists():
            # its own words would name a server path
            return "the job's input is gone from the server's data dir (removed while the job waited or ran); " \
                   "submit the job again"
        if isinstance(error, MedserveError):
            return client_message(error, folder / "input" / "dicom", folder / "input", folder / "work", folder)
        if isinstance(error, DicomWebError):
            return str(error)
        log.exception("job %s crashed", job_id, exc_info=error)  # a bug or a library failure: the worker lives on
        return f"{type(error).__name__}: {error}"

    def _infer(self, job_id: str, model: str, spec: InputSpec, work: Path,
               timings: dict[str, float]) -> dict[str, str]:
        """Pull (DICOMweb) and run the model into result.tmp, rename it to result, and record the outputs in the row
        (still `running`): from then on the result is the job's. Returns {format: path relative to result}."""
        folder = self.job_dir(job_id)
        tmp, final = folder / "result.tmp", folder / "result"
        if spec.kind == "dicomweb":
            self._progress(job_id, "pulling from the DICOM store", 0.1)
            t = time.monotonic()
            spec = pull(self.config, spec, work, retry=True, on_retry=lambda n, e: self._waiting(
                job_id, f"DICOM store failed ({e.code}); retry {n}", 0.1),
                check=lambda: self._waiting(job_id, "pulling from the DICOM store", 0.1))
            timings["pull_s"] = time.monotonic() - t
        outcome = execute(self.store, model, spec, tmp, nifti=True,
                          on_stage=lambda stage, progress: self._progress(job_id, stage, progress),
                          on_wait=lambda stage: self._waiting(job_id, stage, 0.3))
        timings.update(outcome.timings)
        result = outcome.result
        if self.metrics is not None:
            self.metrics.queue.labels(model).observe(outcome.queued_s)
        self._progress(job_id, "saving the result", 0.9)
        outputs: dict[str, str] = {}
        if result.seg_path is not None:
            outputs["seg"] = Path(result.seg_path).relative_to(tmp).as_posix()
        if result.nifti_path is not None:
            outputs["nifti"] = Path(result.nifti_path).relative_to(tmp).as_posix()
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)  # the files are in place before the row says so
        segments = json.dumps(result.segments, default=int)
        segmented = _segmented(result)
        saved = self._exec("UPDATE jobs SET outputs=?, segments=?, segmented=?, timings=? WHERE id=? AND "
                           "state='running' RETURNING id",
                           (json.dumps(outputs), segments, segmented, json.dumps(timings), job_id))
        if not saved:
            raise Cancelled()
        return outputs

    def _store_back(self, job_id: str, seg: Path) -> None:
        """STOW-RS the SEG to the configured store and record the outcome; a refusal fails the job."""
        client = DicomWebClient(self.config.dicomweb_url or "", self.config.dicomweb_timeout)
        target = client.shown
        try:
            with_retries(lambda: client.store([seg]), self.config.dicomweb_retries, self.config.dicomweb_backoff,
                         lambda n, e: self._progress(job_id, f"storing the SEG back failed ({e.code}); retry {n}",
                                                     0.95))
        except Cancelled:
            raise  # cancelled between tries: the job ends as cancelled, not as a failed write-back
        except DicomWebError as error:
            message = f"storing the SEG back to {target} failed: {error.message}"
            self._record_writeback(job_id, target, "failed", message)
            raise DicomWebError(error.status, error.code, message, error.retryable) from error
        except Exception as error:  # a fault of ours or of a library: the STOW was sent, so say how it ended
            self._record_writeback(job_id, target, "failed", f"{type(error).__name__}: {error}")
            raise
        self._record_writeback(job_id, target, "done", None)

    def _record_writeback(self, job_id: str, target: str, state: str, error: str | None) -> None:
        self._exec("UPDATE jobs SET writeback_result=? WHERE id=?",
                   (json.dumps({"target": target, "state": state, "error": error}), job_id))

    def _succeed(self, job_id: str, timings: dict[str, float]) -> bool:
        """Mark a running job succeeded; False when it is no longer running (cancelled meanwhile)."""
        return bool(self._exec("UPDATE jobs SET state='succeeded', progress=1, stage='done', finished=?, timings=? "
                               "WHERE id=? AND state='running' RETURNING id",
                               (time.time(), json.dumps(timings), job_id)))

    def _fail(self, job_id: str, message: str, timings: dict[str, float]) -> None:
        """A failed job keeps no result, even one that was complete (a write-back the store refused): the result
        endpoint serves succeeded jobs only, so its files could never be fetched, and it must not be listed as
        if it could. Re-submitting the job makes it again."""
        log.warning("job %s failed: %s", job_id, message)
        self._exec("UPDATE jobs SET state='failed', stage='failed', progress=0, outputs=NULL, segmented=NULL, "
                   "finished=?, error=?, timings=? WHERE id=? AND state='running'",
                   (time.time(), message, json.dumps(timings), job_id))
        for name in ("result.tmp", "result"):
            shutil.rmtree(self.job_dir(job_id) / name, ignore_errors=True)


def backoff_seconds(failures: int) -> float:
    """1, 2, 4, ... seconds after the worker's `failures`-th failure in a row, at most 30 (the exponent is capped:
    2.0 ** 1024 overflows, after some 8.5 hours of a database refusing writes)."""
    return min(_LONGEST_DATABASE_WAIT_S, 2.0 ** min(failures - 1, 8))


def _segmented(result: StudyResult) -> str | None:
    """The study and series a DICOM input's SEG was made of (an input may hold several; one is segmented), as the
    job's JSON shows them; None for a NIfTI input."""
    study, series = result.study_uid, result.series_uid
    if study is None and series is None:
        return None
    return json.dumps({"study_uid": study, "series_uid": series})


def _unknown_job(job_id: str) -> ApiError:
    return ApiError(404, "unknown_job", f"no job {shown(job_id)}")
