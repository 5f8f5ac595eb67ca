"""`medserve serve | infer | models | jobs | job`: the server and its command-line client."""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import logging
import os
import socket
import sys
from pathlib import Path
from typing import Any
from urllib.parse import quote

from medserve.logs import announce
from medserve.net import http_url, is_loopback
from medserve.results import RESULT_FILES
from medserve.server.config import ServerConfig
from medserve.server.states import JOB_STATES
from medserve.stopping import terminable

log = logging.getLogger("medserve.server.commands")

DEFAULT_URL = "http://127.0.0.1:8000"


def _at_least(lowest: float, kind: type = float) -> Any:
    """An argparse type: a number of `kind` no smaller than `lowest` (0 models or workers is a mistake, not a
    way to say 'no limit')."""
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a{'n integer' if kind is int else ' number'}, not {text!r}") \
                from None
        if value < lowest:
            raise argparse.ArgumentTypeError(f"expected at least {lowest}, not {text}")
        return value
    return parse


def _port(text: str) -> int:
    value = _at_least(0, int)(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"expected a TCP port, 0 to 65535, not {text}")
    return value


def _origin(text: str) -> str:
    from medserve.server.cors import origin_problem

    if problem := origin_problem(text):
        raise argparse.ArgumentTypeError(problem)
    return text


def _positive(text: str) -> float:
    value = _at_least(0.0)(text)
    if value == 0:
        raise argparse.ArgumentTypeError("expected more than 0, not 0")
    return value


class IntermixedParser(argparse.ArgumentParser):
    """A sub-command parser that takes options between positionals. Plain argparse matches all the positionals
    it can at the first one, so an optional STUDY_DIR after `-o out` is taken as absent and then refused as an
    unrecognized argument. The sub-command parser is reached through `parse_known_args` (that is what
    argparse's sub-parsers action calls), so that is where the intermixed parsing goes in."""

    _intermixing = False

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        if self._intermixing:  # parse_known_intermixed_args calls back here for its two passes
            return super().parse_known_args(args, namespace)
        self._intermixing = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._intermixing = False


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    serve = subparsers.add_parser("serve", help="run the model server on a bundle store")
    serve.add_argument("--store", type=Path, default=Path("bundles"), help="bundle store folder (default bundles/)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=_port, default=8000, help="port (default 8000)")
    serve.add_argument("--data-dir", type=Path, default=Path(".medserve"), help="jobs, uploads (default .medserve/)")
    serve.add_argument("--tokens", type=Path, help="bearer tokens file: one 'TOKEN SCOPE[,SCOPE]' per line")
    serve.add_argument("--insecure", action="store_true", help="allow a non-loopback address without tokens")
    serve.add_argument("--max-models", type=_at_least(1, int),
                       help="keep at most this many models loaded (LRU eviction)")
    serve.add_argument("--max-memory-mb", type=_positive, help="keep loaded models under this many MB (LRU eviction)")
    serve.add_argument("--preload", action="append", default=[], metavar="NAME",
                       help="load this model at start; /readyz waits for it (repeatable; 'all' for every bundle)")
    serve.add_argument("--concurrency", type=_at_least(1, int), default=1, help="requests running at once per model")
    serve.add_argument("--queue-size", type=_at_least(0, int), default=16, help="requests waiting per model before 429")
    serve.add_argument("--job-workers", type=_at_least(1, int), default=1, help="threads running async jobs")
    serve.add_argument("--job-max-attempts", type=_at_least(1, int), default=2,
                       help="runs of a job a server crash may interrupt before it is failed (default 2)")
    serve.add_argument("--job-retention-hours", type=_positive,
                       help="remove finished jobs (record and result) this many hours after they ended (default: "
                            "keep them)")
    serve.add_argument("--dicomweb", default=os.environ.get("MEDSERVE_DICOMWEB") or None,
                       help="DICOMweb root of the DICOM store that {study, series} inputs refer to (default "
                            "$MEDSERVE_DICOMWEB, the place for a URL with credentials, http://user:password@host/"
                            "dicom-web: a command line is visible to every local user)")
    serve.add_argument("--dicomweb-timeout", type=_positive, default=30.0,
                       help="seconds the DICOM store may keep silent (default 30); a retrieve that has run ten times "
                            "that long must have brought 1 MiB per this many seconds on average")
    serve.add_argument("--max-upload-mb", type=_positive, default=4096, help="largest accepted upload (default 4096)")
    serve.add_argument("--stable-seconds", type=_at_least(0, float), default=2.0,
                       help="a bundle folder must be unchanged this long before it is loaded (default 2)")
    serve.add_argument("--poll-interval", type=_positive, default=1.0, help="store scan interval in seconds")
    serve.add_argument("--device", help="torch device for all models (default: the bundle's choice)")
    serve.add_argument("--cors-origin", action="append", default=[], type=_origin, metavar="ORIGIN",
                       help="let browser apps on ORIGIN (https://host[:port], or *) call the server; repeatable")
    serve.set_defaults(handler=serve_command)

    infer = subparsers.add_parser("infer", help="run a model on a study through the server")
    # `infer demo -o out STUDY`. Only here: the sub-parsers action builds every sub-command with one class, and
    # other commands (packaging's `run`, which passes what follows `--` on) want plain parsing.
    infer.__class__ = IntermixedParser
    infer.add_argument("name", help="model (bundle folder name)")
    infer.add_argument("study_dir", nargs="?", type=Path, help="folder of DICOM files to upload")
    infer.add_argument("-o", "--output", type=Path, default=Path("output"), help="output folder (default output/)")
    infer.add_argument("--study", help="Study Instance UID in the DICOM store (instead of STUDY_DIR)")
    infer.add_argument("--series", help="Series Instance UID (with --study)")
    infer.add_argument("--dicomweb", help="DICOMweb URL of the store holding --study (must be the server's)")
    infer.add_argument("--writeback", action="store_true", help="STOW-RS the SEG back to the DICOM store")
    infer.add_argument("--format", choices=tuple(RESULT_FILES), default=None, help="result to download")
    _client_args(infer)
    infer.set_defaults(handler=terminable(infer_command))

    models = subparsers.add_parser("models", help="list the server's models")
    _client_args(models)
    models.set_defaults(handler=terminable(models_command))

    jobs = subparsers.add_parser("jobs", help="list recent jobs")
    jobs.add_argument("--state", choices=JOB_STATES)
    jobs.add_argument("--limit", type=int, default=50)
    _client_args(jobs)
    jobs.set_defaults(handler=terminable(jobs_command))

    job = subparsers.add_parser("job", help="show one job")
    job.add_argument("job_id")
    job.add_argument("--cancel", action="store_true", help="cancel it")
    _client_args(job)
    job.set_defaults(handler=terminable(job_command))


def _client_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=os.environ.get("MEDSERVE_URL") or DEFAULT_URL,
                        help=f"server URL (default $MEDSERVE_URL or {DEFAULT_URL})")
    parser.add_argument("--token", default=os.environ.get("MEDSERVE_TOKEN"), help="bearer token ($MEDSERVE_TOKEN)")


# ---- serve --------------------------------------------------------------------------------------------
def config_from_args(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(
        store=args.store, data_dir=args.data_dir, host=args.host, port=args.port, tokens_file=args.tokens,
        insecure=args.insecure, max_models=args.max_models,
        max_memory_bytes=int(args.max_memory_mb * 1024**2) if args.max_memory_mb is not None else None,
        preload=args.preload, concurrency=args.concurrency, queue_size=args.queue_size,
        job_workers=args.job_workers, job_max_attempts=args.job_max_attempts,
        job_retention_seconds=args.job_retention_hours * 3600 if args.job_retention_hours is not None else None,
        dicomweb_url=args.dicomweb, dicomweb_timeout=args.dicomweb_timeout,
        max_upload_bytes=int(args.max_upload_mb * 1024**2), stable_seconds=args.stable_seconds,
        poll_interval=args.poll_interval, device=args.device, cors_origins=args.cors_origin)


def serve_command(args: argparse.Namespace) -> int:
    import uvicorn
    from uvicorn.config import STARTUP_FAILURE

    from medserve.server.app import Server, create_app
    from medserve.server.auth import load_tokens
    from medserve.server.dicomweb import url_problem
    from medserve.server.lock import lock_data_dir

    config = config_from_args(args)
    if config.dicomweb_url and (problem := url_problem(config.dicomweb_url)):
        print(f"error: --dicomweb (or MEDSERVE_DICOMWEB): {problem}", file=sys.stderr)
        return 2
    tokens = load_tokens(config.tokens_file)
    if not tokens and not is_loopback(config.host) and not config.insecure:
        print(f"error: refusing to listen on {config.host} without tokens (--tokens FILE or MEDSERVE_TOKENS); "
              "pass --insecure to do it anyway", file=sys.stderr)
        return 2
    if not config.store.exists():
        log.warning("store %s does not exist; it is created empty: drop bundle folders into it", config.store)
    # A data dir in use (the likelier reason for a port in use: a second server) or unusable is said first, and
    # only a lock taken and given back: nothing in it is touched before the port is known to be free.
    lock_data_dir(config.data_dir).close()
    try:  # uvicorn would say it after 'serving', and exit 3 with no error line
        _check_can_listen(config.host, config.port)
    except OSError as error:
        print(f"error: cannot listen on {config.host}:{config.port} ({error.strerror or error})", file=sys.stderr)
        return 2
    app = create_app(config)
    url = http_url(config.host, config.port)
    announce(log, f"medserve serving {config.store}/ on {url} (data in {config.data_dir}/)", url=url,
             store=str(config.store), data_dir=str(config.data_dir))
    # log_config=None: uvicorn's records go through our handler (one JSON object per line with
    # MEDSERVE_LOG_FORMAT=json) instead of the plain-text handlers uvicorn would install.
    server = Server(uvicorn.Config(app, host=config.host, port=config.port, log_level="warning", log_config=None,
                                   timeout_graceful_shutdown=5), app.state.services.uploads)
    # As uvicorn.run: after a clean stop on Ctrl-C uvicorn raises SIGINT again, for Python's default handler.
    with contextlib.suppress(KeyboardInterrupt):
        server.run()
    return 0 if server.started else STARTUP_FAILURE


def _check_can_listen(host: str, port: int) -> None:
    """Bind the address as uvicorn will (SO_REUSEADDR), and let it go: OSError when it is taken or not ours."""
    for family, kind, proto, _, address in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(address)
        return


# ---- client commands ----------------------------------------------------------------------------------
def infer_command(args: argparse.Namespace) -> int:
    from rich.console import Console

    from medserve.server.client import Client, ClientError

    console = Console(stderr=True)
    client = Client(args.url, args.token)
    if args.study_dir is None and not args.study:
        raise ClientError("give a STUDY_DIR or --study UID")
    store_flags = [flag for flag, value in (("--study", args.study), ("--series", args.series),
                                            ("--dicomweb", args.dicomweb), ("--writeback", args.writeback)) if value]
    if args.study_dir is not None and store_flags:
        raise ClientError(f"{', '.join(store_flags)}: for a study in the DICOM store (--study UID); with a "
                          "STUDY_DIR to upload, give none of them")
    if args.study_dir is not None and not args.study_dir.is_dir():
        raise ClientError(f"{args.study_dir} {'is not a folder' if args.study_dir.exists() else 'does not exist'}; "
                          "expected the folder of the study's DICOM files")
    target = args.output / RESULT_FILES[args.format or "seg"]
    created = _writable_output(args.output, target)  # before the upload and the job, which take minutes
    try:
        return _infer(args, client, console, target)
    except BaseException:
        for folder in created:
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise


def _writable_output(folder: Path, target: Path) -> list[Path]:
    """Make the output folder (the folders made are returned, deepest first) and check that the result can be
    written there; a ClientError or OutputError naming the folder otherwise."""
    from medserve.server.client import ClientError
    from medserve.writers.files import writable_folder

    if folder.exists() and not folder.is_dir():
        raise ClientError(f"output folder {folder} is a file; expected a folder")
    created = writable_folder(folder)
    if target.is_dir():
        raise ClientError(f"{target} is a folder; expected the result's file name to be free")
    return created


def _infer(args: argparse.Namespace, client: Any, console: Any, target: Path) -> int:
    from medserve.server.client import ClientError, study_zip

    client.check_model(args.name)  # before a study of many MB goes up
    archive = study_zip(args.study_dir) if args.study_dir is not None else None
    retired: set[str] = set()
    while True:
        body, key = _job_body(args, client, console, archive)
        job = _submit(client, args.name, body, key, retired)
        job = _wait(client, job, console)
        if job["state"] != "succeeded":
            raise ClientError(f"job {job['id']} {job['state']}: {job.get('error')}")
        fmt = args.format or ("seg" if "seg" in job["outputs"] else "nifti")
        target = target.with_name(RESULT_FILES[fmt])
        try:
            client.download(job["id"], target, fmt)
            break
        except ClientError as error:
            # A replayed job whose result the server no longer has (removed from its data dir): run it again,
            # once (uploading the study again if the server has dropped that too), rather than answer every
            # re-run with 410.
            if error.status != 410 or key is None or retired:
                raise
            console.print(f"job {job['id']}'s result is gone from the server; running the study again")
            retired.add(job["id"])
    console.print(f"[green]done[/green] job {job['id']} -> {target}")
    if job.get("segments"):
        console.print("segments: " + ", ".join(f"{k}={v}" for k, v in job["segments"].items()))
    if archive is not None:  # the result is here: the cached zip is no longer needed to resume anything
        archive.unlink(missing_ok=True)
    print(target)
    return 0


def _job_body(args: argparse.Namespace, client: Any, console: Any,
              archive: Path | None) -> tuple[dict[str, Any], str | None]:
    """The job request's body and its idempotency key: the upload of `archive` (resumed, or made again when the
    server has dropped it), or the study in the DICOM store."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    if archive is not None:
        columns = (TextColumn("upload"), BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn())
        with Progress(*columns, console=console, transient=False) as bar:
            task = bar.add_task("upload", total=archive.stat().st_size)
            upload_id = client.upload(archive, lambda done, total: bar.update(task, completed=done))
            bar.update(task, completed=archive.stat().st_size)
        return {"upload": upload_id}, f"{args.name}\0upload\0{upload_id}"
    body: dict[str, Any] = {"study": args.study}
    if args.series:
        body["series"] = args.series
    if args.dicomweb:
        body["store"] = args.dicomweb
    if args.writeback:
        body["writeback"] = True
    return body, None  # a second run on a store reference is a new request (the study may have changed)


def _wait(client: Any, job: dict[str, Any], console: Any) -> dict[str, Any]:
    """The job once it has ended, its progress shown meanwhile (the whole id: it is what `medserve job` takes)."""
    from rich.progress import BarColumn, Progress, TextColumn

    from medserve.server.client import ClientError

    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
                  console=console) as bar:
        task = bar.add_task(f"job {job['id']}", total=1.0)

        def show(update: dict[str, Any]) -> None:
            bar.update(task, completed=update["progress"],
                       description=f"job {update['id']} {update['state']}: {update.get('stage') or ''}")

        try:
            return client.wait(job["id"], show)
        except ClientError as error:
            if error.status != 404:
                raise
            raise ClientError(f"the server no longer knows job {job['id']} ({error}): was it restarted with another "
                              "--data-dir, or the job removed by its retention? Run the command again to submit the "
                              "study anew", 404) from error


def _submit(client: Any, model: str, body: dict[str, Any], key: str | None, retired: set[str]) -> dict[str, Any]:
    """Submit a job. With a `key` (an uploaded study), a re-run after a crash or ctrl-C finds the same job through
    its Idempotency-Key instead of running it again; but a job that ended failed or cancelled is not what a
    re-run wants (the bundle may have been fixed since), nor one in `retired`, so the next key of the sequence
    starts a new one."""
    attempt = 0
    while True:
        idempotency = hashlib.sha256(f"{key}\0{attempt}".encode()).hexdigest() if key is not None else None
        job = client.submit(model, body, idempotency)
        if key is None or (job["state"] not in ("failed", "cancelled") and job["id"] not in retired):
            return job
        attempt += 1


def _mb(value: int | None) -> str:
    return f"{value / 1024**2:.1f}" if value else "-"


def _table_console() -> Any:
    """A console for the listing commands' tables. Into a pipe or file, rich would cut the table to 80 columns,
    values shortened to 'suc…' that `grep succeeded` then misses: there it gets the width the rows need."""
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=10_000)


def models_command(args: argparse.Namespace) -> int:
    from rich.table import Table

    from medserve.server.client import Client

    models = Client(args.url, args.token).get("/v1/models")["models"]
    table = Table(title=f"models at {args.url}")
    for column in ("name", "version", "state", "loaded", "device", "memory MB", "description / error"):
        table.add_column(column)
    for m in models:
        table.add_row(m["name"], m["version"] or "-", m["state"], "yes" if m["loaded"] else "no",
                      m["device"] or "-", _mb(m["memory_bytes"]), m["error"] or m["description"] or "")
    _table_console().print(table)
    return 0


def jobs_command(args: argparse.Namespace) -> int:
    from rich.table import Table

    from medserve.server.client import Client

    params = {"limit": args.limit, **({"state": args.state} if args.state else {})}
    jobs = Client(args.url, args.token).get("/v1/jobs", **params)["jobs"]
    table = Table(title=f"jobs at {args.url}")
    table.add_column("id", no_wrap=True, min_width=32)  # whole: it is what `medserve job ID` takes
    for column in ("model", "state", "progress", "created", "total s", "error"):
        table.add_column(column)
    for j in jobs:
        total = j["timings"].get("total_s")
        table.add_row(j["id"], j["model"], j["state"], f"{j['progress'] * 100:.0f}%", j["created"] or "",
                      f"{total:.2f}" if total else "-", (j["error"] or "")[:60])
    _table_console().print(table)
    return 0


def job_command(args: argparse.Namespace) -> int:
    from rich.table import Table

    from medserve.server.client import Client, ClientError

    client = Client(args.url, args.token)
    if not args.job_id.strip():
        raise ClientError("empty job id; expected one that `medserve jobs` lists")
    path = f"/v1/jobs/{quote(args.job_id, safe='')}"  # '../models' stays one path segment
    job = client.delete(path) if args.cancel else client.get(path)
    table = Table(title=f"job {job['id']}", show_header=False)
    table.add_column("field")
    table.add_column("value")
    for key in ("model", "state", "stage", "progress", "input", "created", "started", "finished", "attempts",
                "outputs", "segments", "segmented", "error", "result_url", "writeback", "writeback_result"):
        value = job.get(key)
        table.add_row(key, "-" if value in (None, [], {}) else str(value))
    for key, value in job["timings"].items():
        table.add_row(f"timing {key}", f"{value:.3f} s")
    _table_console().print(table)
    return 0
