"""Rank processes forked from one interpreter that imported torch once, for harnesses that start many of them.

Starting a rank process costs seconds of CPU before the trainer runs a line: the interpreter, ``import torch``, its
distributed package and dynamo. The test suite's recovery stories start dozens of rank processes on two cores,
where those imports were most of the CPU the stories used. With ``SNAPSHOTD_WARM_STARTS=1`` in the environment,
:func:`start_module` asks a fork server for each process instead: one interpreter that imported :data:`PRELOAD`
once (at the lowest priority while it did, where it may set its priority back) and forks a child per request.
The child runs ``python -m <module> <args>`` from then on, with the request's arguments, environment, working
directory, output and input; its pid, signals and exit code are the rank's. It is the server's child, not the
caller's, so the caller holds a :class:`ForkedProcess`, which has the parts of ``Popen`` a harness uses
(:class:`RankProcess`) and learns the exit status from the server.

Without the variable (the benchmarks, the demo, users) every process starts cold: a warm start would hide the
restart cost that the benchmarks measure. A request whose environment differs from the server's in a variable
read as the interpreter or torch starts (:func:`_read_late`) starts cold too.

The server is the program :mod:`.forkserver` (``python -m snapshotd.harness.forkserver FD MODULE...``).
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import IO, Any, Protocol

from .forkserver import MAX_MESSAGE

__all__ = ["PRELOAD", "WARM_ENV", "ForkServer", "ForkedProcess", "RankProcess", "start_module"]

WARM_ENV = "SNAPSHOTD_WARM_STARTS"
"""``1``: start rank processes from the fork server; unset or ``0``: every process starts cold."""

PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.nn.parallel",
    "torch._dynamo",
    "snapshotd.client",
    "snapshotd.client.live",
    "snapshotd.harness.workloads",
)
"""What the server imports before it forks: what every rank program of this package needs."""

_REPLY_TIMEOUT = 300.0
"""How long a request waits for its pid: the server answers once its imports are done, which on a loaded
machine takes a minute or more."""


class RankProcess(Protocol):
    """What a harness uses of a started rank process: ``subprocess.Popen``'s names, with its meanings."""

    pid: int
    returncode: int | Any
    stdin: IO[bytes] | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...

    def kill(self) -> None: ...

    def terminate(self) -> None: ...


class ForkedProcess:
    """A process the fork server started (see the module docstring): ``Popen``'s ``pid``, ``returncode``,
    ``stdin``, ``poll``, ``wait``, ``send_signal``, ``kill`` and ``terminate``. Its exit status comes from the
    server; if the server ends first, :meth:`poll` and :meth:`wait` raise ``RuntimeError`` (the status is lost)."""

    def __init__(self, pid: int, args: list[str]) -> None:
        self.pid, self.args = pid, args
        self.returncode: int | None = None
        self.stdin: IO[bytes] | None = None
        self._ended = threading.Event()
        self._lost = False

    def _exited(self, status: int) -> None:
        self.returncode = os.waitstatus_to_exitcode(status)
        self._ended.set()

    def _server_gone(self) -> None:
        if not self._ended.is_set():
            self._lost = True
            self._ended.set()

    def _status(self) -> int | None:
        if self._lost:
            raise RuntimeError(
                f"the fork server ended before process {self.pid} did: its exit status is lost"
            )
        return self.returncode

    def poll(self) -> int | None:
        return self._status()

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        code = self._status()
        assert code is not None
        return code

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:  # reaped by the server and not yet told here: gone, as Popen's would be
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def __repr__(self) -> str:
        return f"<ForkedProcess pid={self.pid} returncode={self.returncode} args={self.args}>"


class _Request:
    """A start request waiting for the server's answer: its process, or why there is none."""

    def __init__(self, argv: list[str]) -> None:
        self.argv = argv
        self.reply: ForkedProcess | str | None = None
        self.answered = threading.Event()

    def answer(self, reply: ForkedProcess | str) -> None:
        self.reply = reply
        self.answered.set()


class ForkServer:
    """A fork server with ``preload`` imported (see the module docstring) and the client of it; thread-safe."""

    def __init__(self, preload: Sequence[str] = PRELOAD) -> None:
        self.preload = tuple(preload)
        self._env = dict(os.environ)  # what the server started with
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs:
            self._server = subprocess.Popen(
                [sys.executable, "-m", "snapshotd.harness.forkserver", str(theirs.fileno()), *self.preload],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                env=self._env,
            )
        self._sock = ours
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._waiting: dict[int, _Request] = {}  # request id -> the request waiting for its pid
        self._running: dict[int, ForkedProcess] = {}
        self._closed = False
        self._reader = threading.Thread(target=self._read, name="fork-server-reader", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        """The server's pid (the parent of every process it started)."""
        return self._server.pid

    def popen(
        self,
        module: str,
        args: Sequence[str],
        *,
        output: str,
        env: Mapping[str, str] | None = None,
        stdin: bool = False,
    ) -> RankProcess:
        """``python -m module args`` with stdout and stderr appended to ``output``, in ``env`` (default this
        process's) and this process's working directory; its stdin is the returned process's ``stdin`` when
        ``stdin``, else at its end at once. Started cold (a ``Popen``) where ``env`` differs from the server's in a
        variable other than those a rank program reads as it runs (:func:`_read_late`).

        A request that gives up (an exception while it waits; no answer within a timeout that allows for the
        server's imports) leaves nothing behind: a process the server starts for it later is killed."""
        env = dict(os.environ if env is None else env)
        if any(env.get(k) != self._env.get(k) for k in {*env, *self._env} if not _read_late(k)):
            # may be read as the interpreter starts
            return _cold(module, args, output=output, env=env, stdin=stdin)
        rid = next(self._ids)
        request = _Request([sys.executable, "-m", module, *args])
        body = json.dumps(
            {"id": rid, "module": module, "args": list(args), "cwd": os.getcwd(), "env": env}
        ).encode()
        fds: list[int] = []
        try:
            fds.append(os.open(output, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644))
            read_end, write_end = os.pipe() if stdin else (os.open(os.devnull, os.O_RDONLY), -1)
            fds += [read_end] if write_end < 0 else [read_end, write_end]
            with self._lock:
                if self._closed:
                    raise RuntimeError("the fork server is closed")
                self._waiting[rid] = request
            try:
                socket.send_fds(self._sock, [body], fds[:2])
                request.answered.wait(_REPLY_TIMEOUT)
            except BaseException:
                self._give_up(rid, request)
                raise
            self._give_up(rid, request)
            if not request.answered.is_set():
                raise RuntimeError(
                    f"the fork server (pid {self.pid}) did not start {module} within {_REPLY_TIMEOUT:.0f} s"
                )
            if isinstance(request.reply, str):
                raise RuntimeError(f"the fork server could not start {module}: {request.reply}")
            assert request.reply is not None
            if write_end >= 0:
                request.reply.stdin = open(write_end, "wb")  # noqa: SIM115 (the process's stdin, its holder closes it)
                fds.remove(write_end)
            return request.reply
        finally:
            for fd in fds:
                os.close(fd)

    def _give_up(self, rid: int, request: _Request) -> None:
        """Stop waiting for request ``rid``: a process started for it from now on is killed by the reader; one
        started already is left to the caller, unless it is leaving with an exception (then it is killed here)."""
        with self._lock:
            self._waiting.pop(rid, None)
        if sys.exc_info()[0] is not None and isinstance(request.reply, ForkedProcess):
            request.reply.kill()

    def _read(self) -> None:
        """The reader thread: each pid (or error) the server sends answers the request it names, and a pid that
        no request waits for any more is killed; each exit status ends the process it names. At the server's
        end, every request still waiting is told, and every process still running loses its status."""
        try:
            while data := self._recv():
                message = json.loads(data)
                with self._lock:
                    if "exited" in message:
                        done = self._running.pop(message["exited"], None)
                        if done is not None:
                            done._exited(message["status"])
                        continue
                    request = self._waiting.pop(message["id"], None)
                    if "error" in message:
                        if request is not None:
                            request.answer(message["error"])
                        continue
                    proc = ForkedProcess(message["pid"], request.argv if request is not None else [])
                    self._running[proc.pid] = proc
                if request is None:  # it gave up: nobody holds this process
                    proc.kill()
                else:
                    request.answer(proc)
        finally:
            with self._lock:
                self._closed = True
                waiting, self._waiting = list(self._waiting.values()), {}
                running, self._running = list(self._running.values()), {}
            for request in waiting:
                request.answer("the fork server ended")
            for proc in running:
                proc._server_gone()

    def _recv(self) -> bytes:
        try:
            return self._sock.recv(MAX_MESSAGE)
        except OSError:
            return b""

    def close(self, timeout: float = 10.0) -> None:
        """End the server (its socket closes; killed after ``timeout``); the processes it started run on.
        Idempotent."""
        with self._lock:
            self._closed = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        try:
            self._server.wait(timeout)
        except subprocess.TimeoutExpired:
            self._server.kill()
            self._server.wait(timeout)
        self._reader.join(timeout)
        self._sock.close()


_LATE_PREFIXES = ("SNAPSHOTD_", "LOCAL_", "MASTER_", "TORCHELASTIC_", "PYTEST_")
_LATE_NAMES = frozenset({"RANK", "WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE"})


def _read_late(name: str) -> bool:
    """Whether a rank program reads environment variable ``name`` only as it runs (its place in the job, the
    snapshotd settings; pytest's note of the test running), never as the interpreter or its imports start."""
    return name in _LATE_NAMES or name.startswith(_LATE_PREFIXES)


_server: ForkServer | None = None
_server_lock = threading.Lock()


def _shared_server() -> ForkServer | None:
    """The process's fork server, started at the first call if ``$SNAPSHOTD_WARM_STARTS`` asks for one."""
    global _server
    if int(os.environ.get(WARM_ENV) or 0) <= 0:
        return None
    with _server_lock:
        if _server is None:
            _server = ForkServer()
            atexit.register(_server.close)
        return _server


def start_module(
    module: str,
    args: Sequence[str],
    *,
    output: str,
    env: Mapping[str, str] | None = None,
    stdin: bool = False,
    prefix: Sequence[str] = (),
) -> RankProcess:
    """Start ``python -m module args`` (output appended to ``output``; ``env``, ``stdin`` as in
    :meth:`ForkServer.popen`): forked where ``$SNAPSHOTD_WARM_STARTS`` asks for it, else cold; always cold with a
    ``prefix`` (e.g. ``ip netns exec NS``, which a fork cannot take). Call it inside
    :func:`~snapshotd.harness.cluster.held_interrupts` where an interrupt must not come between the start and the
    caller recording the process."""
    server = _shared_server() if not prefix else None
    if server is not None:
        return server.popen(module, args, output=output, env=env, stdin=stdin)
    return _cold(module, args, output=output, env=env, stdin=stdin, prefix=prefix)


def _cold(
    module: str,
    args: Sequence[str],
    *,
    output: str,
    env: Mapping[str, str] | None,
    stdin: bool,
    prefix: Sequence[str] = (),
) -> subprocess.Popen[bytes]:
    with open(output, "ab") as log:
        return subprocess.Popen(
            [*prefix, sys.executable, "-m", module, *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            env=env,
        )
