"""``snapshotd rdzv-store``: a rendezvous store off the training nodes, a ``torch.distributed.TCPStore`` server.

torchrun's c10d rendezvous keeps its state in a TCPStore, and by default the agent whose host matches
``--rdzv-endpoint`` hosts it inside its own process, so losing that node takes every other node's agent down with
it. Live mode and zero-wait recovery keep their epochs in such a store too (``$SNAPSHOTD_STORE``). Run it on a host
that training does not run on (a login or head node, a small VM), and start every agent with
``--rdzv-conf is_host=false``.

A TCPStore authenticates nobody: whoever reaches its port can read and rewrite the job's membership. So it binds
loopback unless told otherwise, and a routable bind needs ``--insecure``: expose it only on the job's private
network, behind a firewall that admits the training nodes.
"""

from __future__ import annotations

import datetime
import ipaddress
import signal
import socket
from collections.abc import Callable
from urllib.parse import urlsplit

__all__ = ["DEFAULT_STORE_BIND", "serve_store"]

DEFAULT_STORE_BIND = "tcp://127.0.0.1:29400"


def serve_store(endpoint: str, insecure: bool, ready: Callable[[str], None]) -> int:
    """Serve a TCPStore on ``endpoint`` (``tcp://HOST:PORT``; port 0: a free one) until SIGTERM or SIGINT; 0.

    ``ready("HOST:PORT")`` is called once it accepts connections.

    Raises:
        ValueError: not a ``tcp://`` endpoint, or a routable one without ``insecure``.
        OSError: the address cannot be bound (in use, not this host's).
    """
    parts = urlsplit(endpoint)
    if parts.scheme != "tcp" or parts.hostname is None or parts.port is None:
        raise ValueError(f"the rendezvous store binds tcp://HOST:PORT, got {endpoint!r}")
    host = parts.hostname
    if not insecure and not _loopback(host):
        raise ValueError(
            f"refusing to bind {endpoint}: the rendezvous store authenticates nobody, and anyone who reaches it "
            "can rewrite the job's membership. Bind it on the job's private network and pass --insecure."
        )
    import torch.distributed as dist

    stop = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop)  # before the store's thread starts, so that it inherits it
    try:
        # TCPStore binds every interface when it opens the port itself; a socket of our own limits it to the host
        listener = socket.create_server((host, parts.port), backlog=1024)
        bound_host, port = listener.getsockname()[:2]
        store = dist.TCPStore(
            bound_host,
            port,
            is_master=True,
            wait_for_workers=False,
            master_listen_fd=listener.detach(),
            timeout=datetime.timedelta(seconds=30),
        )
        ready(f"{bound_host}:{port}")
        signal.sigwait(stop)
        del store
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, stop)
    return 0


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
