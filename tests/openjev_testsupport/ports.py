"""Free TCP ports on a loopback address, for tests and benchmarks that start servers."""

from __future__ import annotations

import socket


def free_port(addr: str = "127.0.0.1") -> int:
    """A port free on addr now (the kernel's choice)."""
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def free_ports_on(addr: str = "127.0.0.1", count: int = 1) -> int:
    """A port P on addr such that P .. P+count-1 are all free there."""
    for _ in range(200):
        base = free_port(addr)
        if base + count > 65535:
            continue
        try:
            for k in range(1, count):
                with socket.socket() as s:
                    s.bind((addr, base + k))
        except OSError:
            continue
        return base
    raise RuntimeError(f"no {count} consecutive free ports on {addr}")
