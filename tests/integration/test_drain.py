"""A sidecar stopped with SIGTERM drains (see ``snapshotd serve --drain-timeout``), and is never held up by it: a
coordinator that does not answer, or one that predates draining, is not waited for, and a second SIGTERM stops
it at once. The drain itself, end to end, is ``test_recovery.py``'s
``test_a_node_stopped_cleanly_first_places_its_copies_on_nodes_that_stay``."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from snapshotd.harness.cluster import ManagedProcess
from snapshotd.proto import Error, ErrorCode, ProtocolError, decode, encode
from snapshotd.sidecar.daemon import DRAIN_REQUEST_TIMEOUT
from tests.waits import wait_until

from .conftest import Cluster

pytestmark = pytest.mark.integration


def _wait_for_line(cluster: Cluster, p: ManagedProcess, text: str, timeout: float = 20.0) -> None:
    wait_until(lambda: text in cluster.tail(p, 200), f"{p.name} to log {text!r}", timeout, every=0.02)


def _stop_timed(p: ManagedProcess) -> float:
    """SIGTERM ``p`` and wait for it to exit 0; the seconds it took."""
    t0 = time.monotonic()
    p.proc.send_signal(signal.SIGTERM)
    assert p.proc.wait(30) == 0
    return time.monotonic() - t0


def test_a_coordinator_that_does_not_answer_is_not_waited_for_and_a_second_sigterm_stops_at_once(
    cluster: Cluster,
) -> None:
    x, y = cluster.start("X"), cluster.start("Y")
    assert cluster.coordinator is not None
    coordinator = cluster.coordinator.proc.pid
    os.kill(coordinator, signal.SIGSTOP)
    try:
        took = _stop_timed(x)
        assert DRAIN_REQUEST_TIMEOUT - 0.5 < took < DRAIN_REQUEST_TIMEOUT + 5, took
        assert "stopping without draining" in cluster.tail(x) and "did not answer" in cluster.tail(x)

        y.proc.send_signal(signal.SIGTERM)
        _wait_for_line(cluster, y, "draining for at most")
        took = _stop_timed(y)  # the second SIGTERM
        assert took < DRAIN_REQUEST_TIMEOUT - 1, took
        assert "stopped before it drained" in cluster.tail(y)
    finally:
        os.kill(coordinator, signal.SIGCONT)


@contextlib.contextmanager
def _refusing_coordinator() -> Iterator[str]:
    """A coordinator of an earlier build, as far as draining goes: it refuses every message it gets as one of a
    type it does not know. Its endpoint."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.linger = 0
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    done = threading.Event()

    def serve() -> None:
        while not done.is_set():
            if not sock.poll(50):
                continue
            peer, *body = sock.recv_multipart()
            try:
                kind = decode(body).TYPE
            except ProtocolError as exc:
                kind = str(exc)
            sock.send_multipart(
                [peer, *encode(Error(code=ErrorCode.BAD_MESSAGE, message=f"unknown message type {kind!r}"))]
            )

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"tcp://127.0.0.1:{port}"
    finally:
        done.set()
        thread.join(10)
        sock.close()
        ctx.term()


def test_a_coordinator_that_predates_draining_is_not_waited_for(tmp_path: Path, tag: str) -> None:
    with _refusing_coordinator() as endpoint:
        cmd = [
            sys.executable,
            "-m",
            "snapshotd.cli",
            "serve",
            "--coordinator",
            endpoint,
            "--node",
            f"old-{tag}",
            "--ipc",
            str(tmp_path / "old.ipc"),
            "--drain-timeout",
            "20s",
        ]
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
            assert proc.stdout is not None
            lines = []
            for line in proc.stdout:  # up to its ready line
                lines.append(line)
                if line.startswith("snapshotd serve ready"):
                    break
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            out, _ = proc.communicate(timeout=30)
            took = time.monotonic() - t0
    assert proc.returncode == 0, "".join(lines) + out
    assert took < DRAIN_REQUEST_TIMEOUT, (took, out)
    assert "stopping without draining: coordinator refused drain: unknown message type 'drain'" in out, out
