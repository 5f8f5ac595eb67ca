"""Which container tools exist, and running them with errors that say what failed."""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Callable, Sequence

from medserve import net
from medserve.errors import PackagingError

logger = logging.getLogger("medserve.packaging.engine")

# overlay is ~8x faster than vfs at container start for a 2 GB image; MEDSERVE_STORAGE_DRIVER=vfs where the
# kernel refuses overlay mounts.
def storage_args() -> list[str]:
    return ["--storage-driver", os.environ.get("MEDSERVE_STORAGE_DRIVER", "overlay")]


def have(tool: str) -> bool:
    return shutil.which(tool) is not None


def docker_engine_available() -> bool:
    """A docker CLI alone is not enough: `docker info` must reach a running engine."""
    if not have("docker"):
        return False
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=15).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def pick(choice: str, daemonless: str) -> str:
    """Resolve --builder/--engine auto|docker|<daemonless tool> to a tool that can work here."""
    if choice == "auto":
        if docker_engine_available():
            return "docker"
        if have(daemonless):
            return daemonless
        raise PackagingError(f"no container tool found: install {daemonless} (daemonless) or start a Docker engine")
    if choice == "docker":
        if not docker_engine_available():
            raise PackagingError("--builder/--engine docker: no Docker engine answers `docker info`")
        return "docker"
    if not have(choice):
        raise PackagingError(f"{choice} is not installed (apt-get install {choice})")
    return choice


def base_command(tool: str) -> list[str]:
    return [tool, *storage_args()] if tool in {"buildah", "podman"} else [tool]


# A tool's chatter around its error: progress lines, and retries' warnings that only repeat the final error.
_CHATTER = re.compile(r"^(Copying (blob|config)|Writing manifest|Storing signatures|Getting image source signatures|"
                      r"Trying to pull|Writing blob)|level=(warning|info|debug)")


# A line that states the failure: podman's and buildah's `Error: ...`, skopeo's `level=fatal`, apt's `E: `.
_ERROR_LINE = re.compile(r"^(error\b|E: )|level=(error|fatal)\b", re.IGNORECASE)


def last_words(output: str, lines: int = 3) -> str:
    """What a failed tool said of its failure, on one line: its last `lines` lines without progress and retry
    chatter, or only the last of them that states the error when one does (the others repeat it or lead up to it).
    Its plain last lines when all of them are chatter."""
    every = [line.strip() for line in output.strip().splitlines() if line.strip()]
    tail = [line for line in every if not _CHATTER.search(line)][-lines:] or every[-lines:]
    errors = [line for line in tail if _ERROR_LINE.search(line)]
    return " | ".join(errors[-1:] or tail)


def run(argv: Sequence[str], what: str, timeout: float | None = None, **kwargs) -> subprocess.CompletedProcess:
    """Run a tool to completion; a failure raises PackagingError naming `what` and the tool's last words."""
    logger.debug("run: %s", " ".join(argv))
    try:
        result = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, **kwargs)
    except FileNotFoundError as error:
        raise PackagingError(f"{what}: {argv[0]} is not installed") from error
    except subprocess.TimeoutExpired as error:
        raise PackagingError(f"{what}: {argv[0]} did not finish within {timeout:.0f} s") from error
    if result.returncode != 0:
        raise PackagingError(f"{what} failed ({argv[0]} exit {result.returncode}): "
                             + last_words(result.stderr or result.stdout, 5))
    return result


def stream(argv: Sequence[str], what: str, on_line: Callable[[str], None], env: dict[str, str] | None = None) -> None:
    """Run a long tool (a build), handing each output line to `on_line` (progress, logs)."""
    logger.debug("stream: %s", " ".join(argv))
    tail: list[str] = []
    with subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                          bufsize=1) as process:
        assert process.stdout is not None
        try:
            for line in process.stdout:
                line = line.rstrip("\n")
                tail = (tail + [line])[-15:]
                on_line(line)
        except BaseException as error:
            # Ctrl-C in a terminal reached the tool too, which then cleans up on its own (a second SIGINT could cut
            # that short); SIGTERM/SIGHUP reached us alone, and any other failure here signalled nothing.
            _interrupt(process, on_its_own=10.0 if type(error) is KeyboardInterrupt else 0.0)
            raise
        code = process.wait()
    if code != 0:  # the tool's last lines, on the error's one line; the whole output is in the debug log
        shown = [line if len(line) <= 240 else line[:240] + "..." for line in tail[-6:] if line.strip()]
        raise PackagingError(f"{what} failed ({argv[0]} exit {code}): " + " | ".join(shown))


def _interrupt(process: subprocess.Popen, on_its_own: float, cleaning_up: float = 30.0) -> None:
    """End a tool we were interrupted in, as Ctrl-C in a terminal ends it, so that it removes its working
    containers: a SIGTERM to us alone left buildah running pip, orphaned, and its containers behind. It is given
    `on_its_own` seconds to end without our signal first."""
    try:  # communicate, not wait: a tool that writes while it cleans up must not block on a full pipe
        process.communicate(timeout=on_its_own)
        return
    except subprocess.TimeoutExpired:
        pass
    process.send_signal(signal.SIGINT)
    try:
        process.communicate(timeout=cleaning_up)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()


def registry_host(reference: str) -> str | None:
    """The registry part of an image reference (`host[:port]/repo:tag`), None for a bare name."""
    reference = reference.removeprefix("docker://")
    first = reference.split("/", 1)[0]
    # As Docker's reference grammar: a first part with a dot, a port or a capital letter, or localhost, is a host.
    if "/" in reference and ("." in first or ":" in first or first == "localhost" or first != first.lower()):
        return first
    return None


def is_loopback(host: str | None) -> bool:
    """Loopback registries are plain HTTP in the tests and on build machines: no TLS flags needed there."""
    if host is None:
        return False
    name = host.rsplit(":", 1)[0] if not host.startswith("[") else host[1:].split("]", 1)[0]
    return net.is_loopback(name)
