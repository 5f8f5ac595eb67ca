"""`medserve push`: copy a MAP to any OCI registry with buildah (local store) or skopeo (Docker engine).

Credentials come from the environment and reach the tool through an in-memory auth file (memfd), so they are
never written to disk and never appear on a command line:
  MEDSERVE_REGISTRY_USER / MEDSERVE_REGISTRY_PASSWORD  any registry, or only MEDSERVE_REGISTRY_HOST when set
  GHCR_USER / GHCR_TOKEN (or GITHUB_ACTOR / GITHUB_TOKEN in GitHub Actions)  ghcr.io
A Docker engine's pull reads a config folder instead: it gets one in memory (/dev/shm), removed after the pull.
Loopback registries (localhost, 127.0.0.0/8) are spoken to over plain HTTP without extra flags; IPv6 addresses
are refused, as the container tools here cannot parse them in an image reference.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import re
import subprocess
import tempfile
from contextlib import contextmanager
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from medserve.errors import PackagingError
from medserve.packaging import engine

logger = logging.getLogger("medserve.packaging.registry")

_UNREACHABLE = re.compile(r"connection refused|no such host|i/o timeout|network is unreachable|"
                          r"connection reset|server gave HTTP response to HTTPS client|dial tcp", re.I)
_UNAUTHORIZED = re.compile(r"unauthorized|authentication required|\b401\b|invalid username/password|access.denied"
                           r"|requested access", re.I)


@dataclass(frozen=True)
class Credentials:
    username: str
    password: str
    source: str  # which environment variables they came from (for messages; never the values)


def credentials_from_env(host: str, env: dict[str, str] | None = None) -> Credentials | None:
    """GHCR_* (or GITHUB_*) for ghcr.io, which never receives MEDSERVE_REGISTRY_* when they are set; else
    MEDSERVE_REGISTRY_*, for the registry MEDSERVE_REGISTRY_HOST names (HOST or HOST:PORT) when it is set, so
    that pulling an image someone else named (`medserve run`, a served MAP) cannot hand them to their registry."""
    env = dict(os.environ) if env is None else env
    scope = env.get("MEDSERVE_REGISTRY_HOST", "").strip().lower()
    pairs = [("MEDSERVE_REGISTRY_USER", "MEDSERVE_REGISTRY_PASSWORD")] if not scope or host.lower() == scope else []
    if host == "ghcr.io":
        pairs = [("GHCR_USER", "GHCR_TOKEN"), ("GITHUB_ACTOR", "GITHUB_TOKEN"), *pairs]
    for user_var, token_var in pairs:
        if env.get(user_var) and env.get(token_var):
            return Credentials(env[user_var], env[token_var], f"{user_var}/{token_var}")
    return None


@contextmanager
def auth_file(host: str, credentials: Credentials | None) -> Iterator[tuple[list[str], tuple[int, ...]]]:
    """(extra argv, fds to pass): an auth.json that lives in an anonymous memory file, not on disk."""
    if credentials is None:
        yield [], ()
        return
    fd = os.memfd_create("medserve-auth", 0)
    try:
        os.write(fd, _auth_json(host, credentials).encode())
        os.lseek(fd, 0, os.SEEK_SET)
        yield ["--authfile", f"/proc/self/fd/{fd}"], (fd,)
    finally:
        os.close(fd)


@contextmanager
def docker_config(host: str, credentials: Credentials | None) -> Iterator[list[str]]:
    """`docker --config DIR` arguments whose config.json holds `credentials` for `host` (docker reads a config
    folder, not a file descriptor): a private folder in memory (/dev/shm) where there is one, removed at once.
    Without credentials, docker's own login applies."""
    if credentials is None:
        yield []
        return
    memory = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    with tempfile.TemporaryDirectory(prefix="medserve-docker-", dir=memory) as folder:
        config = Path(folder) / "config.json"
        config.touch(mode=0o600)
        config.write_text(_auth_json(host, credentials))
        yield ["--config", folder]


def _auth_json(host: str, credentials: Credentials) -> str:
    """The `auths` document that containers' auth.json and docker's config.json share."""
    token = base64.b64encode(f"{credentials.username}:{credentials.password}".encode()).decode()
    return json.dumps({"auths": {host: {"auth": token}}})


def _tls_args(host: str) -> list[str]:
    return ["--tls-verify=false"] if engine.is_loopback(host) else []


def registry_reference(reference: str) -> tuple[str, str]:
    """(registry host, reference) of an image reference that names a registry, `docker://` dropped; a
    PackagingError otherwise (also checked before a build that would push)."""
    reference = reference.removeprefix("docker://")
    host = engine.registry_host(reference)
    if host is None:
        raise PackagingError(f"push destination {reference!r} must name a registry: HOST[:PORT]/REPO:TAG")
    return host, reference


# The distribution spec's reference grammar for what follows the registry: lowercase path components, then an
# optional tag (a digest names content that exists already: it cannot be a destination).
_PATH_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_PUSH_REPOSITORY = re.compile(rf"^{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*$")
_TAG = re.compile(r"^[\w][\w.-]{0,127}$")


def push_destination(reference: str) -> tuple[str, str]:
    """`registry_reference` of a push destination whose repository and tag the registry will take (checked before
    a build that would push, so that it fails at once rather than after the build)."""
    host, reference = registry_reference(reference)
    _check_name(reference, host, "push destination", "expected HOST[:PORT]/REPO[:TAG] with a lowercase REPO")
    return host, reference


def image_name(reference: str) -> str:
    """A name to tag a built image with, [HOST[:PORT]/]REPO[:TAG], checked before the build (the engine would
    refuse it only after minutes of building)."""
    _check_name(reference, engine.registry_host(reference), "image name",
                "expected [HOST[:PORT]/]REPO[:TAG] with a lowercase REPO, such as ghcr.io/org/app:1.0")
    return reference


_IMAGE_ID = re.compile(r"^(sha256:)?[a-f0-9]{12,64}$")
_DIGEST = re.compile(r"^[a-z0-9]+(?:[.+_-][a-z0-9]+)*:[a-f0-9]{32,}$")
_RUNNABLE = ("expected an image ID or [HOST[:PORT]/]REPO[:TAG][@DIGEST] with a lowercase REPO, such as "
             "ghcr.io/org/app:1.0")


def image_reference(reference: str) -> str:
    """An image to run or inspect, checked before the engine is asked, whose refusals name neither the reference
    nor the rule ("repository name must be lowercase", "at least one component")."""
    if _IMAGE_ID.match(reference):
        return reference
    if not reference.strip():
        raise PackagingError(f"the image reference is empty; {_RUNNABLE}")
    name, at, digest = reference.removeprefix("docker://").partition("@")
    if at and not _DIGEST.match(digest):
        raise PackagingError(f"image {reference!r}: digest {digest!r} is not ALGORITHM:HEX (sha256:...); {_RUNNABLE}")
    _check_name(name, engine.registry_host(name), "image", _RUNNABLE)
    return reference


def _check_name(reference: str, host: str | None, what: str, expected: str) -> None:
    scheme = re.match(r"^[a-z][a-z0-9+.-]*://", reference, re.IGNORECASE)
    if scheme:  # docker:// was dropped already; an image reference has no URL scheme
        raise PackagingError(f"{what} {reference!r} starts with {scheme.group(0)!r}: an image reference has no URL "
                             f"scheme; drop it ({reference[scheme.end():]!r}); {expected}")
    if host is not None and host.startswith("["):
        raise PackagingError(f"{what} {reference!r}: an IPv6 registry address is not an image reference buildah, "
                             f"podman and skopeo here can parse; name the registry by a host name or an IPv4 "
                             f"address (localhost, 127.0.0.1); {expected}")
    if "@" in reference:
        raise PackagingError(f"{what} {reference!r} names a digest, which cannot be pushed to or tagged; {expected}")
    repository, has_tag, tag = reference[len(host) + 1 if host else 0:].partition(":")
    if not _PUSH_REPOSITORY.match(repository):
        raise PackagingError(f"{what} {reference!r}: repository {repository!r} is not a valid name (lowercase "
                             f"letters, digits and . _ - separators, / between parts); {expected}")
    if has_tag and not _TAG.match(tag):
        raise PackagingError(f"{what} {reference!r}: tag {tag!r} is not valid (up to 128 letters, digits, '_', "
                             f"'.', '-', not starting with '.' or '-'); {expected}")


def _missing_credentials() -> str:
    """What to set, naming the half of a pair that is missing (a user without a password is no credentials)."""
    for user_var, token_var in (("MEDSERVE_REGISTRY_USER", "MEDSERVE_REGISTRY_PASSWORD"), ("GHCR_USER", "GHCR_TOKEN")):
        if bool(os.environ.get(user_var)) != bool(os.environ.get(token_var)):
            missing = token_var if os.environ.get(user_var) else user_var
            return f"{missing} is not set, so {user_var}/{token_var} are not used"
    scope = os.environ.get("MEDSERVE_REGISTRY_HOST")
    if scope and os.environ.get("MEDSERVE_REGISTRY_USER"):
        return f"MEDSERVE_REGISTRY_HOST={scope} keeps MEDSERVE_REGISTRY_* for that registry"
    return "set MEDSERVE_REGISTRY_USER/_PASSWORD"


def _classify(error: subprocess.CompletedProcess, host: str, action: str,
              credentials: Credentials | None) -> PackagingError:
    text = (error.stderr or "") + (error.stdout or "")
    last = engine.last_words(text)
    # Unreachable first: its messages carry host:port, whose digits must not read as an HTTP 401.
    if _UNREACHABLE.search(text):
        return PackagingError(f"{action}: registry {host} is unreachable: {last}")
    if _UNAUTHORIZED.search(text):
        who = f"credentials from {credentials.source}" if credentials else f"no credentials ({_missing_credentials()})"
        return PackagingError(f"{action}: registry {host} rejected {who}: {last}")
    return PackagingError(f"{action} failed: {last}")


def push(image: str, destination: str, engine_choice: str = "auto", timeout: float = 1800) -> str:
    """Push `image` to `destination`; returns the manifest digest the registry now serves."""
    host, reference = push_destination(destination)
    tool = engine.pick(engine_choice, "buildah")
    credentials = credentials_from_env(host)
    with tempfile.TemporaryDirectory(prefix="medserve-push-") as temp, auth_file(host, credentials) as (auth, fds):
        digest_file = Path(temp) / "digest"
        if tool == "docker":
            # skopeo reads the engine's image directly; `docker login` would store the token on disk.
            dest = [f"--dest-{flag.lstrip('-')}" if flag.startswith("--") else flag
                    for flag in (*auth, *_tls_args(host))]
            argv = ["skopeo", "copy", *dest, "--digestfile", str(digest_file),
                    f"docker-daemon:{image}", f"docker://{reference}"]
        else:
            argv = [*engine.base_command("buildah"), "push", *auth, *_tls_args(host), "--digestfile",
                    str(digest_file), image, f"docker://{reference}"]
        logger.info("pushing %s to %s", image, reference)
        try:
            result = subprocess.run(argv, capture_output=True, text=True, pass_fds=fds, timeout=timeout)
        except subprocess.TimeoutExpired as error:
            raise PackagingError(f"pushing to {host}: no answer within {timeout:.0f} s") from error
        if result.returncode != 0:
            raise _classify(result, host, f"pushing {image} to {reference}", credentials)
        digest = digest_file.read_text().strip()
    logger.info("pushed %s@%s", reference, digest)
    return digest


def remote_digest(reference: str) -> str:
    """The digest the registry serves for `reference` (skopeo inspect, no pull)."""
    host, reference = registry_reference(reference)
    credentials = credentials_from_env(host)
    with auth_file(host, credentials) as (auth, fds):
        argv = ["skopeo", "inspect", *auth, *_tls_args(host), "--format", "{{.Digest}}", f"docker://{reference}"]
        result = subprocess.run(argv, capture_output=True, text=True, pass_fds=fds, timeout=300)
    if result.returncode != 0:
        raise _classify(result, host, f"inspecting {reference}", credentials)
    return result.stdout.strip()


def pull(reference: str, engine_choice: str = "auto") -> str:
    """Pull into the local store (podman's, or the Docker engine's); returns the local image id."""
    host, reference = registry_reference(reference)
    tool = engine.pick(engine_choice, "podman")
    credentials = credentials_from_env(host)
    with auth_file(host, credentials) as (auth, fds), \
            docker_config(host, credentials if tool == "docker" else None) as config:
        if tool == "docker":
            argv = ["docker", *config, "pull", reference]
            fds = ()
        else:
            argv = [*engine.base_command("podman"), "pull", "-q", *auth, *_tls_args(host), reference]
        result = subprocess.run(argv, capture_output=True, text=True, pass_fds=fds, timeout=1800)
    if result.returncode != 0:
        raise _classify(result, host, f"pulling {reference}", credentials)
    return result.stdout.strip().splitlines()[-1]
