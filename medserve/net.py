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
