"""Network address helpers shared by the front ends."""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit, urlunsplit


def is_loopback(host: str) -> bool:
    """True for addresses only this machine can reach (`localhost`, 127.0.0.0/8, ::1); `host` has no port."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def http_url(host: str, port: int) -> str:
    """The URL of an HTTP server listening on `host` and `port`: an IPv6 address in brackets (RFC 3986)."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def without_credentials(url: str) -> str:
    """`url` without the user name and password it may carry (`http://user:secret@host/...`): the form answers
    and logs show; requests still use the URL as given."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
