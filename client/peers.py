"""A live group's connections to its peers, as gloo makes them: telling a peer's loss from other errors, and
shutting this process's connections so that the peers blocked on it fail at once.

:func:`is_peer_failure` is what ``guard()`` turns into :class:`~snapshotd.client.PeerLost`.
:func:`open_sockets` and :func:`shut_connection` are how
:meth:`LiveGroup.leave <snapshotd.client.live.LiveGroup.leave>` shuts the TCP connections the process opened
while its group formed (found in Linux ``/proc``; elsewhere nothing is found, and nothing shut).
"""

from __future__ import annotations

import contextlib
import os
import socket

import torch.distributed as dist

__all__ = ["is_peer_failure", "open_sockets", "shut_connection"]

_TRANSPORT_MARKERS = (
    "gloo/transport",
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
)


def is_peer_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective failing because a peer is gone or hung: a ``torch.distributed.DistError``,
    or the ``RuntimeError`` gloo raises from its transport (a connection closed or reset, a wait timed out).

    gloo (torch 2.13) raises a plain ``RuntimeError`` for a peer's loss, whose text names its transport's source
    file (``gloo/transport/tcp/pair.cc: ... Connection reset by peer``, ``.../unbound_buffer.cc: Timed out
    waiting ...``); no exception type sets it apart from a bug in the step, so the text is what is matched."""
    if isinstance(exc, dist.DistError):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in _TRANSPORT_MARKERS)


def open_sockets() -> dict[int, str]:
    """This process's sockets: fd -> its ``/proc/self/fd`` link (``socket:[inode]``); empty without ``/proc``."""
    out: dict[int, str] = {}
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for fd in fds:
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/self/fd/{fd}")
            if link.startswith("socket:["):
                out[int(fd)] = link
    return out


def shut_connection(fd: int, link: str) -> None:
    """``shutdown()`` the TCP connection at ``fd`` if it is still the socket ``link`` names and not a listener."""
    with contextlib.suppress(OSError):
        dup = os.dup(fd)
        try:
            if f"socket:[{os.fstat(dup).st_ino}]" != link:
                return  # closed, and the number reused
            sock = socket.socket(fileno=dup)
            dup = -1  # the socket owns it now
        finally:
            if dup >= 0:
                os.close(dup)
        with sock:
            inet = sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM
            if inet and not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                sock.shutdown(socket.SHUT_RDWR)
