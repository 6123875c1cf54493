"""Python processes started ahead of need with torch imported, for harnesses that start many rank processes.

Starting a rank process costs seconds of CPU before the trainer runs a line: the interpreter, ``import torch``, its
distributed package and dynamo. The test suite's recovery stories start dozens of rank processes, many of them on
the critical path (a replacement that the survivors wait for). With ``SNAPSHOTD_WARM_STARTS=<n>`` in the
environment, :func:`start_module` hands each request to one of ``n`` interpreters started ahead, each waiting on
its stdin with :data:`PRELOAD` imported (at the lowest priority until then, where the caller may set it back), and
starts another in its place. The process it returns is a real child of the caller, running
``python -m <module> <args>`` from then on: its pid, signals, output and exit code are the rank's. Without the variable (the benchmarks, the demo, users) every process starts cold: a warm
start would hide the restart cost that the benchmarks measure.

Run as ``python -m snapshotd.bench.warm MODULE...``, this module is such a waiting interpreter: it imports the
modules named, reads one JSON line (``module``, ``args``, ``env``, ``output``, ``cwd``), points its stdout and
stderr at ``output`` and runs the module as ``__main__``; at end of input (the pool closed) it exits 0.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import importlib
import json
import os
import runpy
import subprocess
import sys
import threading
import traceback
from collections.abc import Mapping, Sequence

__all__ = ["PRELOAD", "WARM_ENV", "WarmPool", "start_module"]

WARM_ENV = "SNAPSHOTD_WARM_STARTS"
"""How many interpreters to keep started ahead (unset or 0: every process starts cold)."""

PRELOAD = ("torch", "torch.distributed", "torch.nn.parallel", "torch._dynamo", "snapshotd.client",
           "snapshotd.client.live", "snapshotd.bench.workloads")  # fmt: skip
"""What a waiting interpreter imports before it reads its request: what every rank program of this package needs."""

_WAITING_NICE = 19
"""The nice value of an interpreter while it imports and waits (its imports take idle CPU only), set back to the
caller's when it is handed its program. Only where the caller may set both (root): elsewhere the interpreters run
at the caller's priority throughout."""

_MAY_RENICE = os.geteuid() == 0


class WarmPool:
    """``size`` interpreters kept started ahead, each with ``preload`` imported (see the module docstring);
    thread-safe."""

    def __init__(self, size: int, preload: Sequence[str] = PRELOAD) -> None:
        if size < 1:
            raise ValueError(f"a warm pool needs at least one interpreter, got {size}")
        self.size, self.preload = size, tuple(preload)
        self._idle: collections.deque[subprocess.Popen[bytes]] = collections.deque()
        self._lock = threading.Lock()
        self._closed = False
        self._env = dict(os.environ)  # what the waiting interpreters started with
        with self._lock:
            self._fill()

    @property
    def pids(self) -> list[int]:
        """The pids of the interpreters waiting now."""
        with self._lock:
            return [p.pid for p in self._idle]

    def _fill(self) -> None:
        while len(self._idle) < self.size:
            proc = subprocess.Popen([sys.executable, "-m", __name__, *self.preload], stdin=subprocess.PIPE,
                                    stdout=subprocess.DEVNULL, env=self._env)  # fmt: skip
            self._idle.append(proc)
            if _MAY_RENICE:
                with contextlib.suppress(OSError):
                    os.setpriority(os.PRIO_PROCESS, proc.pid, _WAITING_NICE)

    def popen(self, module: str, args: Sequence[str], *, output: str, env: Mapping[str, str] | None = None,
              stdin: bool = False) -> subprocess.Popen[bytes]:  # fmt: skip
        """``python -m module args`` with stdout and stderr appended to ``output``, in ``env`` (default this
        process's) and this process's working directory; its stdin is the returned ``Popen``'s when ``stdin``,
        else at its end at once. Started cold where ``env`` differs from the pool's in a variable other than
        those a rank program reads as it runs (:func:`_read_late`): the others may be read as the interpreter or
        torch starts (``PYTHONPATH``, ``OMP_NUM_THREADS``, ``LD_PRELOAD``...)."""
        env = dict(os.environ if env is None else env)
        if any(env.get(k) != self._env.get(k) for k in {*env, *self._env} if not _read_late(k)):
            return _cold(module, args, output=output, env=env, stdin=stdin)  # may be read as the interpreter starts
        request = {"module": module, "args": list(args), "output": os.path.abspath(output), "cwd": os.getcwd(),
                   "env": env}  # fmt: skip
        with self._lock:
            if self._closed:
                raise RuntimeError("the warm pool is closed")
            proc = self._idle.popleft()
            self._fill()
        assert proc.stdin is not None
        try:
            if _MAY_RENICE:  # this process's priority, as a cold start would have
                os.setpriority(os.PRIO_PROCESS, proc.pid, os.getpriority(os.PRIO_PROCESS, 0))
            proc.stdin.write(json.dumps(request).encode() + b"\n")
            proc.stdin.flush()
        except OSError:  # it died waiting (its error went to this process's stderr): start this one cold
            with contextlib.suppress(OSError):
                proc.stdin.close()
            proc.wait()
            return _cold(module, args, output=output, env=env, stdin=stdin)
        if not stdin:
            proc.stdin.close()
            proc.stdin = None
        return proc

    def close(self, timeout: float = 10.0) -> None:
        """End the waiting interpreters (their input ends; killed after ``timeout``). Idempotent."""
        with self._lock:
            self._closed = True
            idle, self._idle = list(self._idle), collections.deque()
        for proc in idle:
            with contextlib.suppress(OSError):
                assert proc.stdin is not None
                proc.stdin.close()
        for proc in idle:
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout)


_LATE_PREFIXES = ("SNAPSHOTD_", "LOCAL_", "MASTER_", "TORCHELASTIC_", "PYTEST_")
_LATE_NAMES = frozenset({"RANK", "WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE"})


def _read_late(name: str) -> bool:
    """Whether a rank program reads environment variable ``name`` only as it runs (its place in the job, the
    snapshotd settings; pytest's note of the test running), never as the interpreter or its imports start."""
    return name in _LATE_NAMES or name.startswith(_LATE_PREFIXES)


_pool: WarmPool | None = None
_pool_lock = threading.Lock()


def _shared_pool() -> WarmPool | None:
    """The process's pool, made at the first call if ``$SNAPSHOTD_WARM_STARTS`` asks for one."""
    global _pool
    size = int(os.environ.get(WARM_ENV) or 0)
    if size <= 0:
        return None
    with _pool_lock:
        if _pool is None:
            _pool = WarmPool(size)
            atexit.register(_pool.close)
        return _pool


def start_module(module: str, args: Sequence[str], *, output: str, env: Mapping[str, str] | None = None,
                 stdin: bool = False) -> subprocess.Popen[bytes]:  # fmt: skip
    """Start ``python -m module args`` (output appended to ``output``; ``env``, ``stdin`` as in
    :meth:`WarmPool.popen`): warm where ``$SNAPSHOTD_WARM_STARTS`` asks for it, else cold. Call it inside
    :func:`~snapshotd.local_cluster.held_interrupts` where an interrupt must not come between the start and the
    caller recording the process."""
    pool = _shared_pool()
    if pool is not None:
        return pool.popen(module, args, output=output, env=env, stdin=stdin)
    return _cold(module, args, output=output, env=env, stdin=stdin)


def _cold(module: str, args: Sequence[str], *, output: str, env: Mapping[str, str] | None,
          stdin: bool) -> subprocess.Popen[bytes]:  # fmt: skip
    with open(output, "ab") as log:
        return subprocess.Popen([sys.executable, "-m", module, *args], stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.PIPE if stdin else subprocess.DEVNULL, env=env)  # fmt: skip


def _serve(preload: Sequence[str]) -> int:
    """A waiting interpreter's life: import ``preload``, read the request, become the program."""
    failed = ""
    try:
        for name in preload:
            importlib.import_module(name)
    except Exception:  # told in the program's output below; the program imports what it needs itself
        failed = traceback.format_exc()
    line = sys.stdin.buffer.readline()
    if not line:
        return 0
    request = json.loads(line)
    fd = os.open(request["output"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    if failed:
        print(f"snapshotd.bench.warm: a preload failed:\n{failed}", file=sys.stderr, flush=True)
    os.chdir(request["cwd"])
    sys.path[0] = request["cwd"]  # as ``-m`` puts it there
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = [request["module"], *request["args"]]
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(_serve(sys.argv[1:]))
