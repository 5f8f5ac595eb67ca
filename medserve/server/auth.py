"""Bearer tokens with `infer` and `admin` scopes (admin implies infer).

Sources, merged: a tokens file (one `TOKEN SCOPE[,SCOPE...]` per line, `#` comments) and the environment
variable MEDSERVE_TOKENS (`TOKEN:SCOPE[,SCOPE];TOKEN:SCOPE`). No tokens at all means no auth, which the CLI
allows only on a loopback address unless `--insecure` is given.
"""

from __future__ import annotations

import hmac
import os
from pathlib import Path

from starlette.requests import Request

from medserve.errors import ConfigurationError
from medserve.server.errors import ApiError
from medserve.server.services import services

SCOPES = ("infer", "admin")


def _scopes(text: str, origin: str) -> frozenset[str]:
    scopes = frozenset(s.strip() for s in text.split(",") if s.strip())
    unknown = scopes - set(SCOPES)
    if not scopes or unknown:
        raise ConfigurationError(f"{origin}: scopes must be among {SCOPES}, got {text!r}")
    return scopes


def load_tokens(tokens_file: Path | None) -> dict[str, frozenset[str]]:
    """Tokens and their scopes; ConfigurationError naming the file and line (or MEDSERVE_TOKENS) when a source is
    unreadable or malformed. An empty token is refused: `$UNSET:admin` would otherwise grant admin to a blank one."""
    tokens: dict[str, frozenset[str]] = {}
    if tokens_file is not None:
        try:
            text = Path(tokens_file).read_text()
        except (OSError, UnicodeDecodeError) as error:
            reason = error.strerror if isinstance(error, OSError) and error.strerror else error
            raise ConfigurationError(f"tokens file {tokens_file}: cannot be read ({reason})") from error
        for number, line in enumerate(text.splitlines(), 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split()
            if len(parts) != 2:
                raise ConfigurationError(f"{tokens_file}:{number}: expected 'TOKEN SCOPE[,SCOPE]'")
            tokens[parts[0]] = _scopes(parts[1], f"{tokens_file}:{number}")
    env = os.environ.get("MEDSERVE_TOKENS", "")
    for item in filter(None, (part.strip() for part in env.split(";"))):
        token, _, scopes = item.partition(":")
        if not token.strip():
            raise ConfigurationError(f"MEDSERVE_TOKENS: an entry has an empty token ({item!r}); expected "
                                     f"'TOKEN:SCOPE[,SCOPE]' entries separated by ';'")
        tokens[token.strip()] = _scopes(scopes or "infer", "MEDSERVE_TOKENS")
    return tokens


class Authenticator:
    """Checks `Authorization: Bearer TOKEN` against the configured tokens."""

    def __init__(self, tokens: dict[str, frozenset[str]]) -> None:
        self.tokens = tokens

    @property
    def enabled(self) -> bool:
        return bool(self.tokens)

    def check(self, request: Request, scope: str) -> None:
        if not self.enabled:
            return
        header = request.headers.get("authorization", "")
        kind, _, token = header.partition(" ")
        token = token.strip()
        if kind.lower() != "bearer" or not token:
            raise ApiError(401, "unauthorized", "missing bearer token", {"WWW-Authenticate": "Bearer"})
        granted: frozenset[str] | None = None
        for known, scopes in self.tokens.items():  # constant-time compare against each token
            if hmac.compare_digest(known.encode(), token.encode()):
                granted = scopes
        if granted is None:
            raise ApiError(401, "unauthorized", "unknown bearer token", {"WWW-Authenticate": "Bearer"})
        if scope not in granted and "admin" not in granted:
            raise ApiError(403, "forbidden", f"this token lacks the {scope!r} scope")


def require(scope: str):  # noqa: ANN201 - a FastAPI dependency factory
    """FastAPI dependency: `dependencies=[Depends(require("admin"))]`."""

    async def dependency(request: Request) -> None:  # async: a sync dependency would take a pool thread
        services(request).auth.check(request, scope)

    return dependency
