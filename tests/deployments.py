"""Deployments of a coordinator and sidecars for tests: real processes, or in this process on ``mem://``.

Both give a test the same few things (:class:`Deployment`): the coordinator's address, a sidecar started as a
node (its ipc address for ``Snapshotter(sidecar=...)``), and the loss of a node (its sidecar dies with
everything it held). :class:`InProcess` runs real :class:`~snapshotd.sidecar.daemon.Sidecar` and coordinator
code, each on an event loop of its own thread, over the in-memory transport; :class:`Processes` runs
``snapshotd`` processes over ZeroMQ (:class:`~snapshotd.harness.cluster.LocalCluster`).
"""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import contextlib
import os
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Coroutine, Iterator, Mapping
from typing import Any

from snapshotd.client import Snapshotter
from snapshotd.coordinator.config import CoordinatorConfig
from snapshotd.coordinator.server import run_coordinator
from snapshotd.harness.cluster import LocalCluster
from snapshotd.sidecar.config import SidecarConfig
from snapshotd.sidecar.daemon import Sidecar
from snapshotd.status import fetch_status

__all__ = [
    "Deployment",
    "InProcess",
    "LoopThread",
    "Processes",
    "in_process_sidecar",
    "restore_all",
    "snapshot_then_crash",
]

HEARTBEAT_INTERVAL = 0.2
HEARTBEAT_TIMEOUT = 1.5


class LoopThread:
    """``main(stop)`` run on an event loop of its own thread until :meth:`stop`; it reports readiness by calling
    the ``ready`` callback it is given.

    Raises:
        RuntimeError: it did not report ready within ``timeout`` seconds, failed, or did not stop in time.
    """

    def __init__(
        self,
        name: str,
        main: Callable[[asyncio.Event, Callable[..., None]], Coroutine[Any, Any, None]],
        timeout: float = 10.0,
    ) -> None:
        self.timeout = timeout
        self.fields: tuple[Any, ...] = ()
        self._ready = threading.Event()
        self._failure: list[BaseException] = []
        self._loop = asyncio.new_event_loop()
        self._stop = asyncio.Event()

        def ready(*fields: Any) -> None:
            self.fields = fields
            self._ready.set()

        def run() -> None:
            try:
                self._loop.run_until_complete(main(self._stop, ready))
            except BaseException as exc:  # noqa: BLE001 - reported to the test
                self._failure.append(exc)
            finally:
                self._ready.set()
                self._loop.close()

        self._thread = threading.Thread(target=run, name=name, daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout) or self._failure:
            self.stop()
            raise RuntimeError(f"{name} did not start: {self._failure or 'timeout'}")

    def stop(self) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed already
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(self.timeout)
        if self._thread.is_alive():
            raise RuntimeError(f"{self._thread.name} did not stop within {self.timeout:.0f} s")
        if self._failure:
            raise RuntimeError(f"{self._thread.name} failed") from self._failure[0]


@contextlib.contextmanager
def in_process_sidecar(cfg: SidecarConfig) -> Iterator[tuple[Sidecar, str, str]]:
    """A real Sidecar run in this process until the block ends: the object, its data address and ipc path."""
    sidecar = Sidecar(cfg)
    runner = LoopThread(f"sidecar-{cfg.node}", lambda stop, ready: sidecar.run(ready, stop))
    try:
        yield sidecar, runner.fields[0], runner.fields[1]
    finally:
        runner.stop()


class Deployment(abc.ABC):
    """A coordinator (started) and room for sidecars; closing it stops everything still running."""

    coordinator: str
    """The coordinator's address."""

    @abc.abstractmethod
    def start_sidecar(self, node: str) -> str:
        """Start node ``node``'s sidecar; its ipc address, for ``Snapshotter(sidecar=...)``."""

    @abc.abstractmethod
    def lose_node(self, node: str) -> None:
        """Node ``node`` dies: its sidecar stops with everything it held (its shared memory too)."""

    @abc.abstractmethod
    def close(self) -> None: ...

    def replace_node(self, lost: str, new: str) -> str:
        """Node ``lost`` dies; once the coordinator has declared it dead, node ``new`` starts: its ipc address."""
        self.lose_node(lost)
        self.wait_dead(lost)
        return self.start_sidecar(new)

    def wait_dead(self, node: str, timeout: float = 15.0) -> None:
        """Wait until the coordinator has declared ``node`` dead (a status request that goes unanswered, as one
        whose message a fault dropped, is asked again)."""
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(TimeoutError):
                nodes = fetch_status(self.coordinator, secret=None, timeout=1.0)["nodes"]
                if any(n["node"] == node and not n["alive"] for n in nodes):
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"the coordinator did not declare {node} dead within {timeout:.0f} s")
            time.sleep(0.05)

    def __enter__(self) -> Deployment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class InProcess(Deployment):
    """Coordinator and sidecars as threads of this process, over ``mem://`` (see the module docstring); with
    ``tcp``, over ZeroMQ on loopback TCP and ipc sockets instead (the sidecars' bulk ports with them, ``bulk_port``
    as :class:`~snapshotd.sidecar.config.SidecarConfig` takes it). ``max_rate`` is the sidecars' ``--max-rate`` in
    bytes per second (None: auto), ``push_connections`` their ``--push-connections``."""

    def __init__(
        self,
        *,
        replicas: int = 1,
        chunk_bytes: int = 1 << 20,
        request_timeout: float = 10.0,
        tcp: bool = False,
        bulk_port: int | None = 0,
        max_rate: float | None = None,
        push_connections: int = 4,
    ) -> None:
        self.tag = uuid.uuid4().hex[:8]
        self.push_connections = push_connections
        self.chunk_bytes = chunk_bytes
        self.request_timeout = request_timeout
        self.tcp = tcp
        self.bulk_port = bulk_port
        self.max_rate = max_rate
        self._ipc_dir = tempfile.TemporaryDirectory(prefix="snapshotd-ipc-") if tcp else None
        cfg = CoordinatorConfig(
            bind="tcp://127.0.0.1:0" if tcp else f"mem://coordinator-{self.tag}",
            replicas=replicas,
            heartbeat_interval=HEARTBEAT_INTERVAL,
            heartbeat_timeout=HEARTBEAT_TIMEOUT,
        )
        self._coordinator = LoopThread(
            "coordinator", lambda stop, ready: run_coordinator(cfg, ready=ready, stop=stop)
        )
        self.coordinator = self._coordinator.fields[0]
        self._sidecars: dict[str, contextlib.ExitStack] = {}
        self.sidecars: dict[str, Sidecar] = {}
        """The running sidecars by node, for tests that look inside them (their loops run in other threads)."""

    def start_sidecar(self, node: str) -> str:
        ipc = (
            f"mem://{node}-{self.tag}-ipc"
            if self._ipc_dir is None
            else os.path.join(self._ipc_dir.name, node)
        )
        cfg = SidecarConfig(
            coordinator=self.coordinator,
            node=f"{node}-{self.tag}",
            ipc=ipc,
            data_bind="tcp://127.0.0.1:0" if self.tcp else f"mem://{node}-{self.tag}-data",
            nice=0,
            chunk_bytes=self.chunk_bytes,
            request_timeout=self.request_timeout,
            bulk_port=self.bulk_port,
            max_rate=self.max_rate,
            push_connections=self.push_connections,
        )
        stack = contextlib.ExitStack()
        self.sidecars[node], _, ipc = stack.enter_context(in_process_sidecar(cfg))
        self._sidecars[node] = stack
        return ipc

    def lose_node(self, node: str) -> None:
        self.sidecars.pop(node)
        self._sidecars.pop(node).close()

    def wait_dead(self, node: str, timeout: float = 15.0) -> None:
        super().wait_dead(f"{node}-{self.tag}", timeout)

    def close(self) -> None:
        for stack in self._sidecars.values():
            stack.close()
        self._sidecars.clear()
        self.sidecars.clear()
        self._coordinator.stop()
        if self._ipc_dir is not None:
            self._ipc_dir.cleanup()


class Processes(Deployment):
    """``snapshotd`` processes on loopback (see the module docstring)."""

    def __init__(self, workdir: str) -> None:
        self.tag = uuid.uuid4().hex[:8]
        self.cluster = LocalCluster(
            workdir, replicas=1, heartbeat_interval=HEARTBEAT_INTERVAL, heartbeat_timeout=HEARTBEAT_TIMEOUT
        )
        self.cluster.start_coordinator()
        self.coordinator = self.cluster.coordinator_addr

    def start_sidecar(self, node: str) -> str:
        self.cluster.start_sidecar(f"{node}-{self.tag}")
        return self.cluster.ipc_path(f"{node}-{self.tag}")

    def lose_node(self, node: str) -> None:
        self.cluster.kill(self.cluster.sidecars[f"{node}-{self.tag}"])

    def wait_dead(self, node: str, timeout: float = 15.0) -> None:
        super().wait_dead(f"{node}-{self.tag}", timeout)

    def close(self) -> None:
        self.cluster.close()


def restore_all(snaps: list[Snapshotter], timeout: float = 60.0) -> list[int | BaseException]:
    """Every rank restores at once, as a restarted job's ranks do (the plan answers when all have asked): each
    rank's step, or what its ``restore()`` raised."""

    def one(snap: Snapshotter) -> int | BaseException:
        try:
            return snap.restore(timeout=timeout)
        except Exception as exc:  # noqa: BLE001 - returned to the test
            return exc

    with concurrent.futures.ThreadPoolExecutor(len(snaps)) as pool:
        return list(pool.map(one, snaps))


def snapshot_then_crash(
    ipcs: Mapping[int, str], job: str, steps: int, state: Callable[[int, int], dict]
) -> None:
    """Ranks 0 and 1 of ``job`` (on the sidecars at ``ipcs[rank]``) start fresh and snapshot steps 1..``steps``,
    each complete on its buddies, then crash: their sidecars keep everything. ``state(rank, step)`` is the
    rank's state after ``step``: tensors (``w``, and any others) and a dict ``loop``."""
    states = [state(r, 0) for r in (0, 1)]
    snaps = [
        Snapshotter(states[r], job=job, rank=r, world_size=2, sidecar=ipcs[r], timeout=10, when_busy="block")
        for r in (0, 1)
    ]
    assert restore_all(snaps) == [0, 0]  # a fresh job
    for step in range(1, steps + 1):
        for r in (0, 1):
            now = state(r, step)
            for key, value in now.items():
                if key == "loop":
                    states[r]["loop"].update(value)
                else:
                    states[r][key].copy_(value)
            assert snaps[r].capture(step)
        assert all(s.wait(30) for s in snaps), [s.stats for s in snaps]
    for s in snaps:
        s.close(unregister=False)
