"""Fixtures for tests with real snapshotd processes on loopback.

``cluster`` is a started :class:`~snapshotd.harness.cluster.LocalCluster` (a coordinator; the test starts
sidecars with :meth:`Cluster.start`) under ``tmp_path``, closed when the test ends. Every node and job name of
a test carries its ``tag``, so that the check made after the cluster closed (no ``/dev/shm`` file of this test
is left behind) cannot be confused by other tests or other users of the machine.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import os
import signal
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import zmq

from snapshotd.bench.nodes import RendezvousStore
from snapshotd.bench.torchrun_trial import TrialConfig, TrialResult, run_trial
from snapshotd.harness.cluster import LocalCluster, ManagedProcess
from snapshotd.proto import (
    Chunk,
    Error,
    Message,
    PullManifest,
    PullRequest,
    StreamBegin,
    codec,
    decode,
    encode,
)
from snapshotd.shm import SHM_DIR


def shm_leftovers(tag: str) -> list[str]:
    """Files under ``/dev/shm`` that snapshotd created for names carrying ``tag``."""
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith("snapshotd-") and tag in n)


class Cluster(LocalCluster):
    """A LocalCluster whose node and job names carry the test's ``tag``; it remembers what it killed."""

    def __init__(self, workdir: str, tag: str, **kwargs: Any) -> None:
        super().__init__(workdir, **kwargs)
        self.tag = tag
        self.started: list[ManagedProcess] = []
        self.killed: list[ManagedProcess] = []

    def node(self, name: str) -> str:
        return f"{name}-{self.tag}"

    def job(self, name: str) -> str:
        return f"{name}-{self.tag}"

    def start(self, name: str, *extra: str, data_bind: str = "tcp://127.0.0.1:0") -> ManagedProcess:
        """Start the sidecar of node ``name`` (tagged), replacing the entry of an earlier one of that name."""
        proc = self.start_sidecar(self.node(name), *extra, data_bind=data_bind)
        self.started.append(proc)
        return proc

    def sidecar(self, name: str) -> ManagedProcess:
        return self.sidecars[self.node(name)]

    def ipc(self, name: str) -> str:
        return self.ipc_path(self.node(name))

    def kill(self, p: ManagedProcess) -> None:
        """SIGKILL, as the loss of the node would (its shared memory is removed with it)."""
        self.killed.append(p)
        super().kill(p)

    def crash(self, p: ManagedProcess) -> None:
        """SIGKILL the process only: the node lives on, and so does whatever it left in /dev/shm."""
        self.killed.append(p)
        p.proc.send_signal(signal.SIGKILL)
        p.proc.wait(10)


@pytest.fixture
def tag() -> str:
    """A name fragment unique to this test (node names, job names, and so shared-memory file names)."""
    return uuid.uuid4().hex[:8]


@pytest.fixture
def no_shm_leak(tag: str) -> Iterator[None]:
    """After the test and every fixture depending on this one ended: no /dev/shm file of the test is left."""
    yield
    left = shm_leftovers(tag)
    assert not left, f"shared memory left behind in {SHM_DIR}: {left}"


@contextlib.contextmanager
def started_cluster(workdir: str, tag: str, heartbeat_timeout: float = 1.5) -> Iterator[Cluster]:
    """A coordinator (replicas 1, heartbeats every 0.2 s, dead after ``heartbeat_timeout``) and room for
    sidecars, under ``workdir``. On exit every process is stopped (SIGTERM, then SIGKILL); each one the test did
    not kill must have exited cleanly."""
    c = Cluster(workdir, tag, replicas=1, heartbeat_interval=0.2, heartbeat_timeout=heartbeat_timeout)
    try:
        c.start_coordinator()
        yield c
    finally:
        c.close()
    assert c.coordinator is not None
    for p in [c.coordinator, *c.started]:
        assert not p.alive(), f"{p.name} still runs after close()"
        if p not in c.killed:
            assert p.proc.returncode == 0, f"{p.name} exited with {p.proc.returncode}; log:\n{c.tail(p)}"


@pytest.fixture
def cluster(
    request: pytest.FixtureRequest, tmp_path: os.PathLike[str], tag: str, no_shm_leak: None
) -> Iterator[Cluster]:
    """:func:`started_cluster` under ``tmp_path``.

    A test that must tell a death declared otherwise from the heartbeat timeout sets another timeout with
    ``@pytest.mark.parametrize("cluster", [SECONDS], indirect=True)``.
    """
    with started_cluster(str(tmp_path), tag, getattr(request, "param", 1.5)) as c:
        yield c


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A rendezvous store (``snapshotd rdzv-store``) on a host of its own, for a module's live-mode jobs; its
    ``host:port``."""
    server = RendezvousStore(str(tmp_path_factory.mktemp("store")))
    try:
        yield server.endpoint
    finally:
        assert server.stop() == 0


@dataclasses.dataclass(frozen=True, slots=True)
class Pulled:
    """A complete snapshot as a holder served it: its table and meta blobs and the reassembled data bytes."""

    table: bytes
    meta: bytes
    data: bytes


class DataPeer:
    """A raw DEALER on a sidecar's data plane (or ipc endpoint): the real protocol, driven by hand.

    Every receive has a deadline; :meth:`close` closes the socket with linger 0 and terminates its context.
    """

    def __init__(self, endpoint: str, timeout: float = 10.0) -> None:
        self.timeout = timeout
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def send_frames(self, frames: Sequence[bytes | memoryview]) -> None:
        self.sock.send_multipart(list(frames), copy=True)

    def send(self, msg: Message) -> None:
        self.send_frames(encode(msg))

    def recv(self, timeout: float | None = None) -> Message:
        """The next message. Raises TimeoutError when none arrives in time."""
        if not self.sock.poll(int(1000 * (self.timeout if timeout is None else timeout)), zmq.POLLIN):
            raise TimeoutError("no reply from the sidecar")
        return decode(self.sock.recv_multipart())

    def request(self, msg: Message | Sequence[bytes]) -> Message:
        if isinstance(msg, Message):
            self.send(msg)
        else:
            self.send_frames(msg)
        return self.recv()

    def pull(self, job: str, rank: int, step: int) -> Pulled | Error:
        """Fetch ``(job, rank, step)`` with PullManifest + PullRequest, checking every chunk's checksum.

        Returns the holder's Error when it refuses (not held, not complete, dropped meanwhile).

        Raises:
            AssertionError: a chunk is out of range, duplicated, of the wrong size, or fails its checksum.
        """
        reply = self.request(PullManifest(job=job, rank=rank, step=step))
        if isinstance(reply, Error):
            return reply
        assert isinstance(reply, StreamBegin), reply
        assert (reply.rank, reply.step) == (rank, step)
        data = bytearray(reply.data_bytes)
        view = memoryview(data)
        seen: set[int] = set()
        nchunks = reply.nchunks
        for first in range(0, nchunks, 4096):
            count = min(4096, nchunks - first)
            self.send(PullRequest(job=job, rank=rank, step=step, first=first, count=count))
            for _ in range(count):
                msg = self.recv()
                if isinstance(msg, Error):
                    return msg
                assert isinstance(msg, Chunk), msg
                assert first <= msg.index < first + count and msg.index not in seen, msg.index
                seen.add(msg.index)
                start = msg.index * reply.chunk_bytes
                end = min(start + reply.chunk_bytes, reply.data_bytes)
                assert msg.raw_len == end - start
                out = view[start:end]
                codec.decompress_chunk(msg.codec, msg.payload, msg.raw_len, elem=msg.elem, out=out)
                codec.verify(out, msg.checksum)
        assert len(seen) == nchunks
        return Pulled(bytes(reply.table), bytes(reply.meta), bytes(data))

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()

    def __enter__(self) -> DataPeer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def reference_and_trial(cluster: Cluster, workdir: str, cfg: TrialConfig) -> tuple[TrialResult, TrialResult]:
    """The torchrun job of ``cfg`` run twice at the same time, each on nodes of its own as on a shared cluster:
    failure-free, and losing node ``cfg.lose`` after ``cfg.kill_after`` to a replacement; (reference, trial)."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        runs = []
        for i, name in enumerate(("reference", "trial")):
            os.makedirs(os.path.join(workdir, name))
            runs.append(
                pool.submit(
                    run_trial,
                    cluster,
                    os.path.join(workdir, name),
                    cfg,
                    job=cluster.job(name),
                    fail=name == "trial",
                    node_names=[cluster.node(f"{x}{i}") for x in "ABC"],
                )
            )
        reference, trial = (run.result() for run in runs)
    return reference, trial
