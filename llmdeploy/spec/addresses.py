"""Listen addresses: `host:port` parsing, the loopback test the auth and TLS rules turn on, and a free port."""

from __future__ import annotations

import ipaddress
import re
import socket


def split_listen(listen: str) -> tuple[str, int]:
    """'host:port' or '[v6]:port' -> (host, port); raises ValueError with a message users can act on."""
    m = re.match(r"^\[([0-9A-Fa-f:.]+)\]:(\d+)$", listen) or re.match(r"^([^\s:\[\]]+):(\d+)$", listen)
    if not m:
        raise ValueError("must be host:port, e.g. 127.0.0.1:8000 (IPv6 as [::1]:8000)")
    host, port = m.group(1), int(m.group(2))
    if not 0 <= port <= 65535:
        raise ValueError(f"port {port} is out of range 0-65535")
    return host, port


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def free_port(host: str = "127.0.0.1") -> int:
    """A port no one listens on at `host` now (the OS's pick; another process may still take it before use)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
