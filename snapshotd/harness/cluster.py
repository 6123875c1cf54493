"""A snapshotd deployment on one machine: a coordinator and several sidecars as real processes.

Used by ``snapshotd demo``, the integration tests and the benchmarks. Every process is started with its output
captured to a log file, waited for with a deadline until it prints its ready line, and stopped (SIGTERM, then
SIGKILL) by :meth:`LocalCluster.close`, so nothing outlives its user.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

from snapshotd.shm import sweep_stale_arenas

from .processes import RankProcess

__all__ = ["LocalCluster", "ManagedProcess", "held_interrupts", "sigterm_as_interrupt"]

log = logging.getLogger(__name__)


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM raises KeyboardInterrupt in the main thread, so that a command killed with it
    tears its clusters down as on Ctrl-C instead of leaving their processes behind (no-op in other threads)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def held_interrupts() -> Iterator[None]:
    """Within the block, SIGINT and SIGTERM wait: each one that arrives is raised again as the block ends, when its
    previous handler acts on it (e.g. with KeyboardInterrupt). Start a child process and record it inside one, so
    that no interrupt comes between the two: the child would be left running, with nothing to stop it. A no-op
    outside the main thread, where Python runs no signal handler."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    arrived: list[int] = []

    def hold(signum: int, frame: Any) -> None:
        arrived.append(signum)

    previous = {sig: signal.signal(sig, hold) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        for signum in arrived:
            signal.raise_signal(signum)


@dataclasses.dataclass(slots=True)
class ManagedProcess:
    """A started snapshotd process and what its ready line said."""

    name: str
    proc: subprocess.Popen[bytes]
    log_path: str
    fields: dict[str, str]
    pumper: threading.Thread

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None


class LocalCluster:
    """Start and stop snapshotd processes under ``workdir`` (logs and ipc sockets live there).

    Args:
        workdir: a directory for logs and ipc paths.
        replicas: the coordinator's ``--replicas``.
        heartbeat_interval / heartbeat_timeout: seconds, passed to the coordinator.
        env: extra environment for every process (e.g. SNAPSHOTD_SECRET).
        launcher: the argv that runs the ``snapshotd`` command, before its own arguments (default: this Python's
            ``-m snapshotd.cli``; e.g. a wrapper that interposes faults, as the benchmarks' soak does).
        drain_timeout: every sidecar's ``--drain-timeout``: shorter than the default, so that a sidecar stopped
            (SIGTERM) ends within :meth:`stop`'s wait even when it cannot drain.
    """

    READY_TIMEOUT = 30.0

    def __init__(
        self,
        workdir: str,
        *,
        replicas: int = 1,
        heartbeat_interval: float = 0.2,
        heartbeat_timeout: float = 1.5,
        env: dict[str, str] | None = None,
        launcher: Sequence[str] | None = None,
        drain_timeout: float = 5.0,
    ) -> None:
        self.workdir = workdir
        self.launcher = list(launcher) if launcher is not None else [sys.executable, "-m", "snapshotd.cli"]
        os.makedirs(workdir, exist_ok=True)
        self.replicas = replicas
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_timeout = heartbeat_timeout
        self.drain_timeout = drain_timeout
        self.env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
        self.coordinator: ManagedProcess | None = None
        self.sidecars: dict[str, ManagedProcess] = {}
        self._all: list[ManagedProcess] = []

    @property
    def coordinator_addr(self) -> str:
        assert self.coordinator is not None, "start_coordinator() first"
        return self.coordinator.fields["endpoint"]

    def start_coordinator(self, bind: str = "tcp://127.0.0.1:0", *extra: str) -> ManagedProcess:
        argv = [
            "coordinator",
            "--bind",
            bind,
            "--replicas",
            str(self.replicas),
            "--heartbeat-interval",
            f"{self.heartbeat_interval}s",
            "--heartbeat-timeout",
            f"{self.heartbeat_timeout}s",
            *extra,
        ]
        self.coordinator = self._start(
            "coordinator", argv, re.compile(r"snapshotd coordinator ready (?P<endpoint>\S+)")
        )
        return self.coordinator

    def ipc_path(self, node: str) -> str:
        return os.path.join(self.workdir, f"{node}.ipc")

    def start_sidecar(
        self, node: str, *extra: str, prefix: Sequence[str] = (), data_bind: str = "tcp://127.0.0.1:0"
    ) -> ManagedProcess:
        """Start ``snapshotd serve`` as node ``node`` (``prefix`` e.g. ``ip netns exec NS``)."""
        argv = [
            "serve",
            "--coordinator",
            self.coordinator_addr,
            "--node",
            node,
            "--ipc",
            self.ipc_path(node),
            "--data-bind",
            data_bind,
            "--drain-timeout",
            f"{self.drain_timeout}s",
            *extra,
        ]
        proc = self._start(
            f"sidecar-{node}",
            argv,
            re.compile(r"snapshotd serve ready node=(?P<node>\S+) data=(?P<data>\S+) ipc=(?P<ipc>\S+)"),
            prefix=prefix,
        )
        self.sidecars[node] = proc
        return proc

    def _start(
        self, name: str, argv: list[str], ready: re.Pattern[str], prefix: Sequence[str] = ()
    ) -> ManagedProcess:
        log_path = os.path.join(self.workdir, f"{name}-{len(self._all)}.log")
        cmd = [*prefix, *self.launcher, *argv]
        found: dict[str, str] = {}
        got = threading.Event()

        def pump(proc: subprocess.Popen[bytes]) -> None:
            assert proc.stdout is not None
            with proc.stdout, open(log_path, "ab") as out:
                for line in proc.stdout:
                    out.write(line)
                    out.flush()
                    if not got.is_set():
                        m = ready.search(line.decode(errors="replace"))
                        if m:
                            found.update(m.groupdict())
                            got.set()

        with held_interrupts():  # close() stops what ``_all`` holds
            proc = subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=self.env, stdin=subprocess.DEVNULL
            )
            pumper = threading.Thread(target=pump, args=(proc,), name=f"log-{name}", daemon=True)
            pumper.start()
            managed = ManagedProcess(name, proc, log_path, found, pumper)
            self._all.append(managed)
        deadline = time.monotonic() + self.READY_TIMEOUT
        while not got.wait(0.05):
            if proc.poll() is not None or time.monotonic() > deadline:
                self.stop(managed)
                raise RuntimeError(
                    f"{name} did not start (exit {proc.returncode}); log:\n{self.tail(managed)}"
                )
        return managed

    def tail(self, p: ManagedProcess, lines: int = 40) -> str:
        with contextlib.suppress(OSError), open(p.log_path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
        return ""

    def kill(self, p: ManagedProcess) -> None:
        """SIGKILL, as a node failure would: no cleanup runs in the process.

        A killed sidecar's shared memory is removed too, as the death of its node would lose it.
        """
        with contextlib.suppress(ProcessLookupError):
            p.proc.send_signal(signal.SIGKILL)
        p.proc.wait(10)
        p.pumper.join(10)
        node = p.fields.get("node")
        if node is not None:
            sweep_stale_arenas(node)

    def lose_node(self, sidecar: ManagedProcess, others: Sequence[RankProcess] = ()) -> None:
        """The loss of a whole node: its sidecar and ``others`` (its training processes) SIGKILLed at the same
        moment (every signal is sent before any wait), then its shared memory removed, as in :meth:`kill`."""
        for proc in (sidecar.proc, *others):
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGKILL)
        for proc in others:
            proc.wait(10)
        self.kill(sidecar)

    def stop(self, p: ManagedProcess, timeout: float = 10.0) -> int:
        """SIGTERM and wait (SIGKILL after ``timeout``). Returns the exit code. A sidecar drains first (see
        ``snapshotd serve --drain-timeout``)."""
        self._terminate(p)
        return self._reap(p, timeout)

    def _terminate(self, p: ManagedProcess) -> None:
        if p.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.proc.send_signal(signal.SIGTERM)

    def _reap(self, p: ManagedProcess, timeout: float) -> int:
        if p.proc.poll() is None:
            try:
                p.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("%s ignored SIGTERM for %.0f s; killing it", p.name, timeout)
                p.proc.kill()
                p.proc.wait(10)
        p.pumper.join(10)
        return p.proc.returncode

    def close(self) -> None:
        """Stop every process: the sidecars first, all told at once, so that they drain together (none places
        what it holds on another that is stopping too), then the rest, the newest first."""
        sidecars = [p for p in reversed(self._all) if p is not self.coordinator]
        for p in sidecars:
            self._terminate(p)
        for p in sidecars:
            self._reap(p, 10.0)
        if self.coordinator is not None:
            self.stop(self.coordinator)

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
