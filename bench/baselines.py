"""What snapshotd is measured against: the plain ways of moving the same bytes.

:func:`raw_socket_transfer` is the ceiling for the transport: one TCP connection between two real processes,
a preallocated buffer on each side, ``sendall`` and ``recv_into``, nothing else. By default each side reuses one
``chunk``-sized buffer, which stays in the CPU's caches: the kernel's copies alone. With ``whole`` each side
holds all ``nbytes`` (every page written first, as live tensors' are) and moves them from and into that memory,
as a restore moves a state: the kernel's copies and the memory traffic of the state.

This module is also the program those processes run::

    python -m snapshotd.bench.baselines recv --host H --nbytes N [--repeat R] [--chunk C] [--timeout T] [--whole]
    python -m snapshotd.bench.baselines send --host H --port P --nbytes N [--repeat R] [--chunk C]
        [--timeout T] [--whole]

The receiver prints ``port <P>`` once it listens, and at the end one JSON line ``{"rates": [...]}``. The disk
checkpoints snapshotd's per-step cost is measured against are :mod:`snapshotd.harness.checkpoints`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import select
import socket
import statistics
import subprocess
import sys
import time

from .links import Link

__all__ = ["process_cpu_seconds", "process_cpu_times", "raw_socket_transfer"]

log = logging.getLogger(__name__)

_GO = b"g"


def _buffer(nbytes: int, chunk: int, whole: bool) -> memoryview:
    """A side's buffer: ``chunk`` bytes of random data, or with ``whole`` ``nbytes`` of them, every page written (a
    fresh allocation's pages are not backed yet, and reading them reads one shared zero page)."""
    pattern = os.urandom(chunk)
    if not whole:
        return memoryview(bytearray(pattern))
    buf = memoryview(bytearray(nbytes))
    for off in range(0, nbytes, chunk):
        n = min(chunk, nbytes - off)
        buf[off : off + n] = pattern[:n]
    return buf


def _receive(host: str, nbytes: int, repeat: int, chunk: int, timeout: float, whole: bool) -> None:
    """Receiver process: listen, then per repeat ask for ``nbytes`` and time them; print the rates."""
    buf = _buffer(nbytes, chunk, whole)
    rates = []
    with socket.create_server((host, 0)) as server:
        server.settimeout(timeout)
        print(f"port {server.getsockname()[1]}", flush=True)
        conn, _ = server.accept()
    with conn:
        conn.settimeout(timeout)
        for _ in range(repeat):
            conn.sendall(_GO)
            first = conn.recv_into(buf, min(chunk, nbytes))
            start = time.perf_counter()
            got = first
            while got < nbytes:
                k = conn.recv_into(buf[got:] if whole else buf, min(chunk, nbytes - got))
                if k == 0:
                    raise ConnectionError(f"sender closed after {got} of {nbytes} bytes")
                got += k
            elapsed = time.perf_counter() - start
            # Bytes after the first recv over the time since it returned: the first recv's own arrival
            # time is unknown, so its bytes are left out rather than counted as instantaneous.
            rates.append((nbytes - first) / elapsed if elapsed > 0 else float("inf"))
        conn.shutdown(socket.SHUT_WR)
    print(json.dumps({"rates": rates}), flush=True)


def _send(host: str, port: int, nbytes: int, repeat: int, chunk: int, timeout: float, whole: bool) -> None:
    """Sender process: connect, then per go-byte send ``nbytes`` from one preallocated buffer."""
    buf = _buffer(nbytes, chunk, whole)
    with socket.create_connection((host, port), timeout=timeout) as conn:
        for _ in range(repeat):
            if conn.recv(1) != _GO:
                raise ConnectionError("receiver closed before asking for data")
            sent = 0
            while sent < nbytes:
                n = min(chunk, nbytes - sent)
                conn.sendall(buf[sent : sent + n] if whole else buf[:n])
                sent += n
        conn.shutdown(socket.SHUT_WR)
        if conn.recv(1):
            raise ConnectionError("receiver sent unexpected data")


def _read_line(proc: subprocess.Popen[bytes], deadline: float) -> str:
    """One line of ``proc``'s stdout, waiting until ``deadline`` (``time.monotonic``) at most.

    Raises:
        TimeoutError: when no full line came in time.
        ConnectionError: when the process closed its stdout first.
    """
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    data = b""
    while not data.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise TimeoutError(f"no line from receiver within the deadline (got {data!r})")
        piece = os.read(fd, 1)
        if not piece:
            raise ConnectionError(f"receiver exited before writing a line (got {data!r})")
        data += piece
    return data.decode()


def process_cpu_seconds(pid: int) -> float | None:
    """CPU time (user + system, every thread) that process ``pid`` has used so far; None where /proc cannot
    tell (the process is gone, or this is not Linux)."""
    times = process_cpu_times(pid)
    return None if times is None else sum(times)


def process_cpu_times(pid: int) -> tuple[float, float] | None:
    """(user, system) CPU seconds, every thread, that process ``pid`` has used so far: its own code, and the
    kernel's work for it (socket copies, page faults); None where /proc cannot tell."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def raw_socket_transfer(
    nbytes: int,
    *,
    chunk: int = 1 << 20,
    repeat: int = 1,
    link: Link | None = None,
    timeout: float = 120,
    whole: bool = False,
) -> float:
    """Move ``nbytes`` over one plain TCP connection between two fresh processes; return bytes per second.

    The receiver (in ``link.ns_b``, listening on ``link.addr_b``; or on 127.0.0.1 without a link) and the
    sender (in ``link.ns_a``) are real Python processes. One connection carries all repeats; before each, the
    receiver sends one byte and the sender answers with ``nbytes`` from a preallocated ``chunk``-sized buffer
    (``sendall``), which the receiver reads with ``recv_into`` into its own preallocated buffer. With ``whole``
    the buffers on both sides are ``nbytes`` long, written through before the first repeat, and the bytes go
    from the sender's whole buffer into the receiver's, ``chunk`` at a time (see the module docstring).

    The rate of one repeat is measured at the receiver: the bytes after its first ``recv`` divided by the time
    from that ``recv``'s return to the last byte, so connection setup and process start-up are excluded.
    Returns the **median** over repeats.

    Args:
        nbytes: bytes per repeat (at least 2 * ``chunk`` for a meaningful time).
        chunk: size of each ``sendall`` / ``recv_into``.
        repeat: how many times to move ``nbytes``.
        link: an emulated link from :func:`snapshotd.bench.links.shaped_link`, or None for loopback.
        timeout: seconds for the whole transfer; also each socket operation's timeout.

    Raises:
        ValueError: on non-positive sizes or counts.
        TimeoutError: when the transfer does not finish within ``timeout`` (both processes are killed).
        RuntimeError: when a process fails (its exit code and stderr are in the message).
    """
    if nbytes <= 0 or chunk <= 0 or repeat <= 0:
        raise ValueError(f"nbytes, chunk and repeat must be positive (got {nbytes}, {chunk}, {repeat})")
    deadline = time.monotonic() + timeout
    host = link.addr_b if link else "127.0.0.1"
    common = [
        f"--nbytes={nbytes}",
        f"--repeat={repeat}",
        f"--chunk={chunk}",
        f"--timeout={timeout}",
        *(["--whole"] if whole else []),
    ]
    base = [sys.executable, "-m", __name__]
    recv_argv = [*base, "recv", "--host", host, *common]
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        procs["receiver"] = recv = subprocess.Popen(
            link.exec_argv(link.ns_b, recv_argv) if link else recv_argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        port = int(_read_line(recv, deadline).split()[1])
        send_argv = [*base, "send", "--host", host, "--port", str(port), *common]
        procs["sender"] = send = subprocess.Popen(
            link.exec_argv(link.ns_a, send_argv) if link else send_argv,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        _, send_err = send.communicate(timeout=max(0.1, deadline - time.monotonic()))
        out, recv_err = recv.communicate(timeout=max(0.1, deadline - time.monotonic()))
    except BaseException as exc:
        for name, p in procs.items():
            if p.poll() is None:
                p.kill()
            err = p.communicate(timeout=10)[1] or b""
            exc.add_note(f"{name} (exit {p.returncode}) stderr: {err.decode(errors='replace').strip()}")
        if isinstance(exc, subprocess.TimeoutExpired):
            raise TimeoutError(f"raw socket transfer of {nbytes} B x {repeat} took over {timeout} s") from exc
        raise
    for name, p, err in (("sender", send, send_err), ("receiver", recv, recv_err)):
        if p.returncode != 0:
            raise RuntimeError(f"{name} exited with {p.returncode}: {err.decode(errors='replace').strip()}")
    rates = json.loads(out.decode())["rates"]
    log.debug("raw socket rates (B/s): %s", rates)
    return float(statistics.median(rates))


def _main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m snapshotd.bench.baselines")
    parser.add_argument("role", choices=("recv", "send"))
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--nbytes", type=int, required=True)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--chunk", type=int, default=1 << 20)
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--whole", action="store_true")
    args = parser.parse_args(argv)
    if args.role == "recv":
        _receive(args.host, args.nbytes, args.repeat, args.chunk, args.timeout, args.whole)
    else:
        _send(args.host, args.port, args.nbytes, args.repeat, args.chunk, args.timeout, args.whole)
    return 0


if __name__ == "__main__":
    sys.exit(_main())
