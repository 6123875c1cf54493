"""Emulated nodes of a torchrun job on one machine, and their loss.

A real multi-node job has, per node, one ``snapshotd serve`` sidecar and one ``torchrun`` agent whose workers
are the training ranks; one host of its own runs the c10d rendezvous store. Here each node is:

- a sidecar (:meth:`LocalCluster.start_sidecar`, with the node's own ``--node`` and ``--ipc``), and
- a torchrun agent (``python -m torch.distributed.run``) in a session of its own, with ``--local-addr`` an
  address of the loopback range that no other node uses (127.0.0.2, 127.0.0.3, ...): torchrun names a node by
  that address, ranks the nodes of a round in its order, and gives the workers the first node's address as
  ``MASTER_ADDR``. The workers find the node's sidecar through ``SNAPSHOTD_SIDECAR``.

:class:`RendezvousStore` runs ``snapshotd rdzv-store`` (a bare TCPStore server) on an address of its
own.

:meth:`EmulatedNode.kill` is the loss of a node: the agent, every worker and the sidecar are SIGKILLed
together, with the sidecar's shared memory. torchrun starts each worker in a session of its own, so the
process group of the agent does not hold them: the node's processes are the agent's descendants, and, to catch
a worker that the agent spawned as it died, every process whose environment carries the node's marker
(``SNAPSHOTD_TRIAL_NODE``). Every wait has a deadline; :meth:`EmulatedNode.stop` ends whatever is left
(SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

from snapshotd.harness.cluster import LocalCluster, ManagedProcess, held_interrupts
from snapshotd.shm import pid_alive

__all__ = [
    "MARKER",
    "AgentLine",
    "EmulatedNode",
    "RendezvousStore",
    "agent_lines",
    "marked_processes",
    "node_processes",
]

MARKER = "SNAPSHOTD_TRIAL_NODE"
"""The environment variable that marks every process of an emulated node (its value is unique per node)."""

_POLL = 0.05


def _wait_gone(pids: set[int], timeout: float) -> set[int]:
    """Wait until none of ``pids`` is alive (zombies count as gone); returns those alive at the deadline."""
    deadline = time.monotonic() + timeout
    alive = {p for p in pids if pid_alive(p)}
    while alive and time.monotonic() < deadline:
        time.sleep(_POLL)
        alive = {p for p in alive if pid_alive(p)}
    return alive


def _children() -> dict[int, list[int]]:
    """Parent pid -> child pids, of every process this user can see."""
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        kids.setdefault(ppid, []).append(int(entry))
    return kids


def marked_processes(fragment: str, *, exact: bool = False) -> set[int]:
    """The processes whose ``MARKER`` variable holds ``fragment`` (or equals it, with ``exact``)."""
    prefix = f"{MARKER}=".encode()
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
            values = [v[len(prefix) :].decode(errors="replace") for v in env if v.startswith(prefix)]
        except OSError:
            continue
        if any(v == fragment if exact else fragment in v for v in values):
            found.add(int(entry))
    return found


def node_processes(root: int | None, marker: str) -> set[int]:
    """``root`` and its descendants, and every process marked ``marker``: the live processes of a node."""
    found = marked_processes(marker, exact=True)
    if root is not None:
        kids = _children()
        todo = [root]
        while todo:
            pid = todo.pop()
            found.add(pid)
            todo.extend(kids.get(pid, ()))
    return {p for p in found if pid_alive(p)}


def _signal_all(pids: set[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


class RendezvousStore:
    """``snapshotd rdzv-store`` (a TCPStore server) on ``host``, a host of its own (a loopback address).

    Raises:
        RuntimeError: it did not print its ready line within ``timeout`` seconds (its output is in the
        message).
    """

    def __init__(self, workdir: str, *, host: str = "127.0.0.9", timeout: float = 30.0) -> None:
        self.log_path = os.path.join(workdir, "rdzv-store.log")
        with open(self.log_path, "wb") as log, held_interrupts():
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "snapshotd", "rdzv-store", "--bind", f"{host}:0"],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while (m := re.search(r"rendezvous store ready (\S+)", self._output())) is None:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(
                    f"the rendezvous store did not start (exit {self.proc.returncode}):\n{self._output()}"
                )
            time.sleep(_POLL)
        self.endpoint = m.group(1)
        """``HOST:PORT`` for ``--rdzv-endpoint``."""

    def _output(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def stop(self, timeout: float = 10.0) -> int:
        """SIGTERM, then SIGKILL after ``timeout``; returns the exit code (0 after a clean SIGTERM)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)
        return self.proc.returncode


class AgentLine:
    """One line of a torchrun agent's log (``LOGLEVEL=INFO``): wall time, level and message."""

    __slots__ = ("level", "message", "t")

    _GLOG = re.compile(r"^([IWEF])(\d\d)(\d\d) (\d\d):(\d\d):(\d\d)\.(\d{6}) +\d+ \S+\] ?(.*)$")

    def __init__(self, t: float, level: str, message: str) -> None:
        self.t, self.level, self.message = t, level, message

    @classmethod
    def parse(cls, line: str, year: int) -> AgentLine | None:
        """The line's fields, or None for a line not in torch's log format (a worker's output, a traceback).

        torch writes the local time without a year: ``year`` completes it.
        """
        m = cls._GLOG.match(line)
        if m is None:
            return None
        month, day, hour, minute, second, micro = (int(v) for v in m.groups()[1:7])
        # local time, as torch
        t = datetime.datetime(year, month, day, hour, minute, second, micro).timestamp()
        return cls(t, m.group(1), m.group(8))


def agent_lines(path: str, year: int) -> list[AgentLine]:
    """The torch log lines of the agent log at ``path``, in order."""
    with open(path, errors="replace") as f:
        return [a for line in f if (a := AgentLine.parse(line.rstrip("\n"), year)) is not None]


class EmulatedNode:
    """One node: its sidecar and its torchrun agent (see the module docstring).

    Args:
        cluster: starts the sidecar (its coordinator must be running).
        name: the node's name (the sidecar's ``--node``, the marker, log names).
        addr: the node's own loopback address (``--local-addr``).
        torchrun_args: torchrun's flags, without ``--local-addr``.
        script, script_args: the training script and its flags.
        env: extra environment for the agent and its workers.
        workdir: where the agent's log goes (``agent-{name}.log``), and the node's temporary folder
            (``tmp-{name}``, its ``TMPDIR``: torchrun makes a folder there that a killed agent cannot remove).
        cwd: the agent's (and so its workers') working directory; None: the caller's.
    """

    def __init__(
        self,
        cluster: LocalCluster,
        name: str,
        addr: str,
        *,
        torchrun_args: Sequence[str],
        script: str,
        script_args: Sequence[str],
        env: dict[str, str],
        workdir: str,
        cwd: str | None = None,
    ) -> None:
        self.cluster, self.name, self.addr = cluster, name, addr
        self.marker = f"{name}.{os.getpid()}.{time.monotonic_ns()}"
        self.log_path = os.path.join(workdir, f"agent-{name}.log")
        self.killed_at: float | None = None
        self.sidecar: ManagedProcess = cluster.start_sidecar(name)
        tmpdir = os.path.join(workdir, f"tmp-{name}")
        os.makedirs(tmpdir, exist_ok=True)
        agent_env = {
            **os.environ,
            **env,
            "SNAPSHOTD_SIDECAR": cluster.ipc_path(name),
            MARKER: self.marker,
            "PYTHONUNBUFFERED": "1",
            "TMPDIR": tmpdir,
        }
        argv = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            *torchrun_args,
            "--local-addr",
            addr,
            script,
            *script_args,
        ]
        with open(self.log_path, "wb") as log, held_interrupts():  # stop() ends what ``agent`` holds
            self.agent = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=agent_env,
                cwd=cwd,
                start_new_session=True,
            )

    def processes(self) -> set[int]:
        """The node's live processes: its agent, workers, any process with its marker (not the sidecar)."""
        return node_processes(self.agent.pid if self.agent.poll() is None else None, self.marker)

    def kill(self, timeout: float = 10.0) -> float:
        """Lose the node: SIGKILL the sidecar, the agent and every worker at once; remove the sidecar's shared
        memory. Returns the wall time (``time.time()``) just before the first signal.

        Raises:
            RuntimeError: a process of the node outlived ``timeout`` seconds.
        """
        victims = self.processes()
        self.killed_at = time.time()
        with contextlib.suppress(ProcessLookupError):
            self.sidecar.proc.send_signal(signal.SIGKILL)
        _signal_all(victims, signal.SIGKILL)
        self.cluster.kill(self.sidecar)  # waits for it and sweeps its arenas
        self.agent.wait(timeout)
        deadline = time.monotonic() + timeout
        while left := self.processes():  # a worker the agent spawned as it died
            if time.monotonic() >= deadline:
                raise RuntimeError(f"node {self.name}: processes {sorted(left)} outlived SIGKILL")
            _signal_all(left, signal.SIGKILL)
            _wait_gone(left, min(1.0, deadline - time.monotonic()))
        return self.killed_at

    def wait(self, timeout: float) -> int | None:
        """The agent's exit code, waiting up to ``timeout`` seconds (None if it still runs)."""
        try:
            return self.agent.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, timeout: float = 10.0) -> None:
        """End the node: SIGTERM the agent (torchrun stops its workers), SIGKILL whatever remains after
        ``timeout``, then stop the sidecar (SIGTERM, so that it removes its shared memory).

        Raises:
            RuntimeError: a process of the node outlived SIGKILL.
        """
        if self.agent.poll() is None:
            self.agent.send_signal(signal.SIGTERM)
        left = _wait_gone(self.processes(), timeout)
        if left:
            _signal_all(left, signal.SIGKILL)
            if _wait_gone(left, timeout):
                raise RuntimeError(f"node {self.name}: processes {sorted(left)} outlived SIGKILL")
        self.agent.wait(timeout)
        if self.sidecar.alive():
            self.cluster.stop(self.sidecar, timeout)
