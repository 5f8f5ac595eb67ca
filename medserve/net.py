"""Network address helpers shared by the front ends."""

from __future__ import annotations

import ipaddress


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
