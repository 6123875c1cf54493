"""The fork server of :mod:`.processes`: one interpreter that imports the modules named once, then forks a child per
request, which runs ``python -m <module> <args>`` from then on.

Run as ``python -m snapshotd.harness.forkserver FD MODULE...``: it imports the modules named and serves the
``AF_UNIX`` ``SOCK_SEQPACKET`` socket ``FD`` until its peer closes it (see :func:`serve`).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import runpy
import selectors
import signal
import socket
import sys
import traceback
from collections.abc import Sequence
from typing import Any

__all__ = ["become", "serve"]

IMPORTING_NICE = 19
"""The server's nice value while it imports (its imports take idle CPU only), set back to what it started with
before it forks its first child. Only where the server may set it back (root): elsewhere it runs at the caller's
priority throughout, as its children must."""
MAY_RENICE = os.geteuid() == 0
MAX_MESSAGE = 1 << 20


def serve(fd: int, preload: Sequence[str]) -> tuple[dict[str, Any], list[int], str] | None:
    """The server's life: import ``preload``, then fork a child per request on socket ``fd`` (a JSON object
    with ``id``, ``module``, ``args``, ``cwd`` and ``env``, and two descriptors: output and input) and answer
    ``{"id": ..., "pid": ...}`` (or ``{"id": ..., "error": ...}``); report each child's end as
    ``{"exited": pid, "status": ...}``.
    Returns ``None`` in the server once its peer closed the socket; in a child, returns its request, descriptors
    and the preload's failure (empty if none), for :func:`become`."""
    started_nice = os.getpriority(os.PRIO_PROCESS, 0)
    if MAY_RENICE:
        os.setpriority(os.PRIO_PROCESS, 0, IMPORTING_NICE)
    failed = ""
    try:
        for name in preload:
            importlib.import_module(name)
    except Exception:  # told in each program's output; the program imports what it needs itself
        failed = traceback.format_exc()
    if MAY_RENICE:
        os.setpriority(os.PRIO_PROCESS, 0, started_nice)
    sock = socket.socket(fileno=fd)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    # a handler, so that the wakeup fd hears of each child's end
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)

    def send(message: dict[str, Any]) -> None:
        with contextlib.suppress(OSError):  # the peer is gone: the loop sees it next
            sock.send(json.dumps(message).encode())

    while True:
        for key, _ in sel.select():
            if key.fileobj == wake_r:
                os.read(wake_r, 4096)
                continue
            data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 2)
            if not data:
                return None
            sys.stdout.flush()
            sys.stderr.flush()
            rid = json.loads(data)["id"]
            try:
                pid = os.fork()
            except OSError as e:
                send({"id": rid, "error": str(e)})
            else:
                if pid == 0:
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    sel.close()
                    sock.close()
                    os.close(wake_r)
                    os.close(wake_w)
                    return json.loads(data), fds, failed
                send({"id": rid, "pid": pid})
            for f in fds:
                os.close(f)
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            send({"exited": pid, "status": status})


def become(request: dict[str, Any], fds: list[int], failed: str) -> None:
    """A forked child's life: take its output and input, working directory, environment and arguments, and run
    its module as ``__main__``."""
    out, inp = fds
    os.dup2(inp, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    os.close(inp)
    if failed:
        print(f"snapshotd.harness.forkserver: a preload failed:\n{failed}", file=sys.stderr, flush=True)
    os.chdir(request["cwd"])
    sys.path[0] = request["cwd"]  # as ``-m`` puts it there
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = [request["module"], *request["args"]]
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    _child = serve(int(sys.argv[1]), sys.argv[2:])
    if _child is not None:
        become(*_child)
