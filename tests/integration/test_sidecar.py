"""Real sidecars on loopback: snapshots of every shape move between them, and faults never leave a lie behind.

Each test starts a coordinator and two or three ``snapshotd serve`` processes (:class:`~.conftest.Cluster`),
snapshots from Snapshotters in this process, and checks the buddies by pulling with the real data-plane
protocol. A :class:`StatusWatch` polls the coordinator throughout; whenever it reports a new durable step for a
job, the watch pulls that step from the live buddies and checks it byte for byte against what was staged, so an
incomplete (or wrong) snapshot reported complete at any moment fails the test. The cluster fixture then checks
that every process stopped cleanly and that no shared memory of the test is left in /dev/shm.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlsplit

import msgpack
import pytest
import torch
from snapshotd.proto import (
    Announce,
    Chunk,
    ChunkAck,
    Error,
    PullManifest,
    RegisterRank,
    StreamAccept,
    StreamBegin,
    TensorEntry,
    checksum,
    encode_table,
)

from snapshotd.client import Snapshotter
from snapshotd.client.state import copy_into, flatten
from snapshotd.status import fetch_status

from .conftest import Cluster, DataPeer, Pulled, shm_leftovers

pytestmark = pytest.mark.integration

WAIT = 30.0  # seconds: the longest any single condition may take, even on a loaded 2-core machine


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def wait_for(cond: Callable[[], Any], what: str, timeout: float = WAIT, every: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)


# ------------------------------------------------------------------------------------------ workloads


class Workload:
    """A rank's state whose value at each step is a pure function of the step, so any step can be recomputed.

    ``shapes`` maps a key to ``(shape, dtype)``; the state also carries plain data (msgpack meta).
    """

    def __init__(self, shapes: dict[str, tuple[tuple[int, ...], torch.dtype]], seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.base = {}
        for key, (shape, dtype) in shapes.items():
            if dtype.is_floating_point:
                self.base[key] = torch.randn(shape, generator=gen).to(dtype)
            else:
                self.base[key] = torch.randint(-(1 << 40), 1 << 40, shape, generator=gen, dtype=dtype)
        self.state: dict[str, Any] = self.at(0)

    def at(self, step: int) -> dict[str, Any]:
        state: dict[str, Any] = {key: t + step for key, t in self.base.items()}
        state["info"] = {"step": step, "keys": len(self.base)}
        return state

    def advance(self, step: int) -> None:
        """Make the live state the state of ``step`` (tensors updated in place)."""
        new = self.at(step)
        for key in self.base:
            self.state[key].copy_(new[key])
        self.state["info"] = new["info"]

    def expected(self, step: int) -> Pulled:
        """The table, meta and data bytes a Snapshotter stages for ``step``."""
        flat = flatten(self.at(step))
        data = torch.zeros(flat.data_bytes, dtype=torch.uint8)
        copy_into(flat, data)
        return Pulled(encode_table(flat.entries), flat.meta, data.numpy().tobytes())

    @property
    def data_bytes(self) -> int:
        return flatten(self.state).data_bytes


def zero_bytes() -> Workload:
    """Only tensors without elements: a snapshot of zero data bytes (and a table and meta all the same)."""
    return Workload({"e0": ((0,), torch.float32), "e1": ((0, 7), torch.bfloat16), "e2": ((3, 0, 2), torch.int64)})


def tiny_tensors(count: int = 3000) -> Workload:
    dtypes = (torch.float32, torch.int64, torch.bfloat16, torch.float16)
    shapes = {f"t{i:04d}": ((i % 5,), dtypes[i % len(dtypes)]) for i in range(count)}  # every fifth has 0 elements
    return Workload(shapes, seed=1)


def larger_than_a_chunk() -> Workload:
    """bf16 and int64 tensors of several 1 MiB chunks each, and one that ends inside a chunk."""
    return Workload({"bf16": ((1_500_000,), torch.bfloat16), "ids": ((300_000,), torch.int64),
                     "w": ((1000, 257), torch.float32)}, seed=2)  # fmt: skip


def big(nbytes: int) -> Workload:
    return Workload({"w": ((nbytes // 4,), torch.float32)}, seed=3)


# ------------------------------------------------------------------------------------------ ranks


@dataclasses.dataclass(eq=False)
class Rank:
    """One Snapshotter of the test, its workload and home node, and the steps it started."""

    snap: Snapshotter
    work: Workload
    node: str  # the home node's short name ("A")
    home: str  # its full (tagged) name
    started: set[int] = dataclasses.field(default_factory=set)

    @property
    def rank(self) -> int:
        return self.snap.rank

    def capture(self, step: int) -> bool:
        """Advance the state to ``step`` and capture it (copies are synchronous: no optimizer in the state)."""
        self.work.advance(step)
        ok = self.snap.capture(step)
        if ok:
            self.started.add(step)
        return ok


def rank_homes(cluster: Cluster, job: str) -> dict[int, str | None]:
    doc = fetch_status(cluster.coordinator_addr, secret=None)
    for j in doc["jobs"]:
        if j["job"] == job:
            return {r["rank"]: r["node"] for r in j["ranks"]}
    return {}


@contextlib.contextmanager
def open_ranks(cluster: Cluster, job: str, placement: Sequence[tuple[str, Workload]], **kwargs: Any) -> Iterator[list[Rank]]:
    """One Snapshotter per ``(node, workload)``, ranks in order, all restored (fresh) and with a buddy assigned.

    Closed (arenas released) when the block ends.
    """
    world = len(placement)
    ranks = [
        Rank(Snapshotter(work.state, job=job, rank=i, world_size=world, sidecar=cluster.ipc(node), timeout=10.0,
                         **kwargs), work, node, cluster.node(node))  # fmt: skip
        for i, (node, work) in enumerate(placement)
    ]
    try:
        with ThreadPoolExecutor(world) as pool:  # restore() answers once every rank of the job asked
            starts = list(pool.map(lambda r: r.snap.restore(timeout=WAIT), ranks, timeout=WAIT + 10))
        assert starts == [0] * world
        want = {r.rank: r.home for r in ranks}
        wait_for(lambda: rank_homes(cluster, job) == want, f"the coordinator to place job {job}")
        time.sleep(0.3)  # the heartbeat reply that placed them carries the buddies; let the sidecars apply it
        yield ranks
    finally:
        for r in ranks:
            r.snap.close()


# ------------------------------------------------------------------------------------------ the watch


class StatusWatch:
    """Polls the coordinator in a thread; checks every durable step it reports against the buddies' copies.

    ``track(job, ranks)`` enables the check for a job: when the reported durable step ``D`` changes to ``d >= 0``,
    each rank's ``(rank, d)`` must be served complete by a live sidecar other than the rank's home with exactly
    the bytes that were staged, and ``d`` must be a step the rank started. ``violations`` lists every failure.
    """

    def __init__(self, cluster: Cluster, every: float = 0.1) -> None:
        self.cluster = cluster
        self.every = every
        self.doc: dict[str, Any] = {}
        self.seen: dict[str, list[tuple[int, int]]] = {}  # job -> distinct (recoverable, durable) in order
        self.violations: list[str] = []
        self.checked: dict[str, list[int]] = {}
        self._jobs: dict[str, list[Rank]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="status-watch", daemon=True)

    def track(self, job: str, ranks: list[Rank]) -> None:
        self._jobs[job] = ranks

    def job(self, job: str) -> dict[str, Any]:
        return next((j for j in self.doc.get("jobs", []) if j["job"] == job), {})

    def node(self, name: str) -> dict[str, Any]:
        full = self.cluster.node(name)
        return next((n for n in self.doc.get("nodes", []) if n["node"] == full), {})

    def watermark(self, job: str) -> tuple[int, int]:
        j = self.job(job)
        return j.get("recoverable", -1), j.get("durable", -1)

    def durable_steps(self, job: str) -> set[int]:
        return {d for _, d in self.seen.get(job, [])}

    def _fetch(self) -> dict[str, Any] | None:
        try:
            return fetch_status(self.cluster.coordinator_addr, secret=None, timeout=2.0)
        except (TimeoutError, ValueError, RuntimeError):
            return None

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            doc = self._fetch()
            if doc is None:
                continue
            self.doc = doc
            for j in doc.get("jobs", []):
                g, d = j["recoverable"], j["durable"]
                seen = self.seen.setdefault(j["job"], [])
                if not seen or seen[-1] != (g, d):
                    seen.append((g, d))
                    if d > g:
                        self.violations.append(f"job {j['job']}: durable {d} > recoverable {g}")
                    if d >= 0 and j["job"] in self._jobs:
                        self._check(j["job"], d)

    def _check(self, job: str, step: int) -> None:
        self.checked.setdefault(job, []).append(step)
        for r in self._jobs[job]:
            if step not in r.started:
                self.violations.append(f"job {job}: durable step {step} was never captured by rank {r.rank}")
                continue
            for attempt in range(2):  # a buddy that restarted a moment ago may not be known as such yet
                verdict = self._held(job, r, step)
                if verdict is True:
                    break
                if verdict is not None:
                    self.violations.append(verdict)
                    break
                time.sleep(0.5)
                if self.watermark_now(job) != step:
                    break  # the durable step moved on; the buddy may have dropped it by now
            else:
                self.violations.append(f"job {job}: durable step {step} reported, but no live buddy of rank "
                                       f"{r.rank} holds it complete")  # fmt: skip

    def watermark_now(self, job: str) -> int:
        doc = self._fetch() or {}
        return next((j["durable"] for j in doc.get("jobs", []) if j["job"] == job), -1)

    def _held(self, job: str, r: Rank, step: int) -> bool | str | None:
        """True: a live buddy serves exactly the staged bytes. A string: it served something else. None: no one."""
        for name, proc in list(self.cluster.sidecars.items()):
            if name == r.home or not proc.alive():
                continue
            try:
                with DataPeer(proc.fields["data"], timeout=5.0) as peer:
                    got = peer.pull(job, r.rank, step)
            except TimeoutError:
                continue
            if isinstance(got, Pulled):
                if got != r.work.expected(step):
                    return f"job {job}: {name} serves rank {r.rank} step {step} with other bytes than were staged"
                return True
        return None

    def __enter__(self) -> StatusWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)
        assert not self._thread.is_alive(), "status watch did not stop"


@pytest.fixture
def watch(cluster: Cluster) -> Iterator[StatusWatch]:
    with StatusWatch(cluster) as w:
        yield w
    assert not w.violations, "\n".join(w.violations)


def pull(cluster: Cluster, node: str, job: str, rank: int, step: int) -> Pulled | Error:
    with DataPeer(cluster.sidecar(node).fields["data"]) as peer:
        return peer.pull(job, rank, step)


def assert_holds(cluster: Cluster, node: str, r: Rank, job: str, step: int) -> None:
    got = pull(cluster, node, job, r.rank, step)
    assert isinstance(got, Pulled), f"{node} does not serve rank {r.rank} step {step}: {got}"
    want = r.work.expected(step)
    assert (got.table, got.meta) == (want.table, want.meta)
    assert got.data == want.data


def assert_not_held(cluster: Cluster, node: str, job: str, rank: int, step: int) -> None:
    got = pull(cluster, node, job, rank, step)
    assert isinstance(got, Error) and got.code == "not_found", got


# ------------------------------------------------------------------------------------------ tests


def test_three_sidecars_exchange_snapshots_of_every_shape(cluster: Cluster, watch: StatusWatch) -> None:
    for name in "ABC":
        cluster.start(name)
    job = cluster.job("shapes")
    works = [zero_bytes(), tiny_tensors(), larger_than_a_chunk()]
    assert works[0].data_bytes == 0 and works[2].data_bytes > 5 << 20
    buddy = {0: "B", 1: "C", 2: "A"}  # ring order of the node names
    with open_ranks(cluster, job, list(zip("ABC", works))) as ranks:
        watch.track(job, ranks)
        for step in (1, 2, 3):
            for r in ranks:
                assert r.capture(step)
            for r in ranks:
                assert r.snap.wait(WAIT), (r.rank, r.snap.stats)
            for r in ranks:
                assert_holds(cluster, buddy[r.rank], r, job, step)
                (other,) = set("ABC") - {r.node, buddy[r.rank]}
                assert_not_held(cluster, other, job, r.rank, step)
        wait_for(lambda: watch.watermark(job) == (3, 3), "G = D = 3 at the coordinator")
        for r in ranks:
            wait_for(lambda r=r: isinstance(pull(cluster, buddy[r.rank], job, r.rank, 2), Error),
                     "buddies to drop steps older than the durable one")  # fmt: skip
            stats = r.snap.stats
            assert (stats.started, stats.durable, stats.failed, stats.skipped, stats.last_durable_step) == (3, 3, 0, 0, 3)
        ranks_doc = {d["rank"]: d for d in watch.job(job)["ranks"]}
        assert all(ranks_doc[r]["newest_step"] == 3 and ranks_doc[r]["copies"] == 2 for r in range(3)), ranks_doc
    assert watch.checked[job][-1] == 3 and watch.durable_steps(job) <= {-1, 1, 2, 3}
