"""Ports for the daemons and stores a harness starts: :func:`free_port`."""

from __future__ import annotations

import random
import socket
from pathlib import Path

__all__ = ["free_port"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port of ``host`` free now and below the kernel's ephemeral range, so that no bind to port 0 (a daemon's
    data plane, say) can take it before the process it is given to binds it.

    Raises:
        RuntimeError: no free port was found in 200 tries.
    """
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(200):
        port = random.randrange(10_000, low)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port of {host} below {low}")
