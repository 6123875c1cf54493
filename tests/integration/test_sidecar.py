"""Real sidecars on loopback: snapshots of every shape move between them, and faults never leave a lie behind.

Each test starts a coordinator and two or three ``snapshotd serve`` processes (:class:`~.conftest.Cluster`),
snapshots from Snapshotters in this process, and checks the buddies by pulling with the real data-plane
protocol. A :class:`StatusWatch` polls the coordinator throughout; whenever it reports a new durable step for
a job, the watch pulls that step from the live buddies and checks it byte for byte against what was staged, so
an incomplete (or wrong) snapshot reported complete at any moment fails the test. The cluster fixture then
checks that every process stopped cleanly and that no shared memory of the test is left in /dev/shm.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlsplit

import msgpack
import pytest
import torch

from snapshotd.client import Snapshotter
from snapshotd.client.copies import copy_into
from snapshotd.client.schedule import left_out
from snapshotd.client.state import flatten
from snapshotd.harness.ports import free_port
from snapshotd.proto import (
    PROTOCOL_VERSION,
    Announce,
    Chunk,
    ChunkAck,
    Error,
    PullManifest,
    RankRegistered,
    RegisterRank,
    SlotUpdate,
    StreamAbort,
    StreamAccept,
    StreamBegin,
    TensorEntry,
    UnregisterRank,
    blob_digest,
    checksum,
    encode_table,
)
from snapshotd.status import fetch_status
from tests.waits import wait_until

from .conftest import Cluster, DataPeer, Pulled, shm_leftovers
from .test_metrics import scrape

pytestmark = pytest.mark.integration

WAIT = 30.0  # seconds: the longest any single condition may take, even on a loaded 2-core machine


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ------------------------------------------------------------------------------------------ workloads


class Workload:
    """A rank's state whose value at each step is a pure function of the step, so any step can be recomputed.

    ``shapes`` maps a key to ``(shape, dtype)``; :meth:`reshape` changes them from a given step on. The state
    also carries plain data (msgpack meta).
    """

    def __init__(self, shapes: Mapping[str, tuple[tuple[int, ...], torch.dtype]], seed: int = 0) -> None:
        self.seed = seed
        self.versions: list[tuple[int, dict[str, torch.Tensor]]] = []
        self.reshape(0, shapes)
        self.state: dict[str, Any] = self.at(0)

    def reshape(self, from_step: int, shapes: Mapping[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
        gen = torch.Generator().manual_seed(self.seed + len(self.versions))
        base = {}
        for key, (shape, dtype) in shapes.items():
            if dtype.is_floating_point:
                base[key] = torch.randn(shape, generator=gen).to(dtype)
            else:
                base[key] = torch.randint(-(1 << 40), 1 << 40, shape, generator=gen, dtype=dtype)
        self.versions.append((from_step, base))

    def at(self, step: int) -> dict[str, Any]:
        base = next(b for first, b in reversed(self.versions) if first <= step)
        state: dict[str, Any] = {key: t + step for key, t in base.items()}
        state["info"] = {"step": step, "keys": len(base)}
        return state

    def advance(self, step: int) -> None:
        """Make the live state that of ``step`` (tensors updated in place while the keys stay the same)."""
        new = self.at(step)
        if new.keys() != self.state.keys():
            self.state.clear()
            self.state.update(new)
            return
        for key, value in new.items():
            if isinstance(value, torch.Tensor):
                self.state[key].copy_(value)
            else:
                self.state[key] = value

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
    return Workload(
        {"e0": ((0,), torch.float32), "e1": ((0, 7), torch.bfloat16), "e2": ((3, 0, 2), torch.int64)}
    )


def tiny_tensors(count: int = 3000) -> Workload:
    dtypes = (torch.float32, torch.int64, torch.bfloat16, torch.float16)
    # every fifth tensor has no elements
    shapes = {f"t{i:04d}": ((i % 5,), dtypes[i % len(dtypes)]) for i in range(count)}
    return Workload(shapes, seed=1)


def larger_than_a_chunk() -> Workload:
    """bf16 and int64 tensors of several 1 MiB chunks each, and one that ends inside a chunk."""
    return Workload(
        {
            "bf16": ((1_500_000,), torch.bfloat16),
            "ids": ((300_000,), torch.int64),
            "w": ((1000, 257), torch.float32),
        },
        seed=2,
    )


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
        """Advance the state to ``step`` and capture it (synchronous copy: there is no optimizer to fence)."""
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
def open_ranks(
    cluster: Cluster, job: str, placement: Sequence[tuple[str, Workload]], **kwargs: Any
) -> Iterator[list[Rank]]:
    """One Snapshotter per ``(node, workload)``, ranks in order, all restored (fresh), each with a buddy.

    Closed (arenas released) when the block ends.
    """
    world = len(placement)
    ranks = [
        Rank(
            Snapshotter(
                work.state,
                job=job,
                rank=i,
                world_size=world,
                sidecar=cluster.ipc(node),
                timeout=WAIT,
                **kwargs,
            ),
            work,
            node,
            cluster.node(node),
        )
        for i, (node, work) in enumerate(placement)
    ]
    try:
        with ThreadPoolExecutor(world) as pool:  # restore() answers once every rank of the job asked
            starts = list(pool.map(lambda r: r.snap.restore(timeout=WAIT), ranks, timeout=WAIT + 10))
        assert starts == [0] * world
        want = {r.rank: r.home for r in ranks}
        wait_until(lambda: rank_homes(cluster, job) == want, f"the coordinator to place job {job}", WAIT)
        yield ranks  # a stream waits for its rank's buddies to be assigned (the sidecar's own signal)
    finally:
        for r in ranks:
            r.snap.close()


# ------------------------------------------------------------------------------------------ the watch


class StatusWatch:
    """Polls the coordinator in a thread; checks every durable step it reports against the buddies' copies.

    ``track(job, ranks)`` enables the check for a job: when the reported durable step ``D`` changes to
    ``d >= 0``, each rank's ``(rank, d)`` must be served complete by a live sidecar other than the rank's home
    with exactly the bytes that were staged, and ``d`` must be a step the rank started. ``violations`` lists
    every failure.
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
                if seen and seen[-1] == (g, d):
                    continue
                if d > g:
                    self.violations.append(f"job {j['job']}: durable {d} > recoverable {g}")
                if d >= 0 and j["job"] in self._jobs and (not seen or seen[-1][1] != d):
                    self._check(j["job"], d)
                seen.append((g, d))

    def _check(self, job: str, step: int) -> None:
        """Each rank's ``step`` must be held by a live buddy, with the staged bytes, while reported durable.

        A buddy that was just killed may be counted until the coordinator declares it dead (its heartbeat
        timeout), so a step that no live buddy serves is a violation only if it is still reported well after.
        """
        self.checked.setdefault(job, []).append(step)
        for r in self._jobs[job]:
            if step not in r.started:
                self.violations.append(f"job {job}: durable step {step} was never captured by rank {r.rank}")
                continue
            deadline = time.monotonic() + self.cluster.heartbeat_timeout + 1.5
            while (verdict := self._held(job, r, step)) is None:
                if self.watermark_now(job) != step:
                    break  # the durable step moved on; its holders may have dropped it by now
                if time.monotonic() > deadline:
                    verdict = f"job {job}: durable step {step} reported; no live buddy holds rank {r.rank}'s"
                    break
                time.sleep(0.2)
            if isinstance(verdict, str):
                self.violations.append(verdict)

    def watermark_now(self, job: str) -> int:
        doc = self._fetch() or {}
        return next((j["durable"] for j in doc.get("jobs", []) if j["job"] == job), -1)

    def _held(self, job: str, r: Rank, step: int) -> bool | str | None:
        """True: a live buddy serves exactly the staged bytes; a string: one serves others; None: none."""
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
                    return f"job {job}: {name} serves rank {r.rank} step {step} with bytes other than staged"
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
    cluster.start("A")
    cluster.start("B")
    # rank 2's later steps go out as XOR deltas against the previous
    cluster.start("C", "--codec", "delta-lz4")
    job = cluster.job("shapes")
    works = [zero_bytes(), tiny_tensors(), larger_than_a_chunk()]
    assert works[0].data_bytes == 0 and works[2].data_bytes > 5 << 20
    buddy = {0: "B", 1: "C", 2: "A"}  # ring order of the node names
    with open_ranks(cluster, job, list(zip("ABC", works, strict=True))) as ranks:
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
        wait_until(lambda: watch.watermark(job) == (3, 3), "G = D = 3 at the coordinator", WAIT)
        for r in ranks:

            def dropped(r: Rank = r) -> bool:
                return isinstance(pull(cluster, buddy[r.rank], job, r.rank, 2), Error)

            wait_until(dropped, "the buddies to drop steps older than the durable one", WAIT)
            stats = r.snap.stats
            counts = (stats.started, stats.durable, stats.failed, stats.skipped, stats.last_durable_step)
            assert counts == (3, 3, 0, 0, 3), stats
        ranks_doc = {d["rank"]: d for d in watch.job(job)["ranks"]}
        assert all(ranks_doc[r]["newest_step"] == 3 and ranks_doc[r]["copies"] == 2 for r in range(3)), (
            ranks_doc
        )
    assert watch.checked[job][-1] == 3 and watch.durable_steps(job) <= {-1, 1, 2, 3}


def test_malformed_input_gets_an_error_and_the_sidecar_keeps_serving(
    cluster: Cluster, watch: StatusWatch
) -> None:
    cluster.start("A")
    b = cluster.start("B")
    fake = cluster.job("fake")
    entries = [TensorEntry("x", "uint8", (2 * 4096 + 10,), 0, 2 * 4096 + 10)]
    data = bytes(range(256)) * 32 + b"0123456789"
    chunks = [memoryview(data)[i : i + 4096] for i in range(0, len(data), 4096)]

    def chunk(index: int, digest: int | None = None, step: int = 1) -> Chunk:
        part = chunks[index]
        return Chunk(
            job=fake,
            rank=0,
            step=step,
            index=index,
            raw_len=part.nbytes,
            checksum=checksum(part) if digest is None else digest,
            payload=part,
        )

    table, meta = encode_table(entries), msgpack.packb([1, {}])
    begin = StreamBegin(
        job=fake,
        rank=0,
        step=1,
        src_node="X",
        data_bytes=len(data),
        chunk_bytes=4096,
        digest=blob_digest(table, meta),
        table=table,
        meta=meta,
    )
    manifest = {"v": PROTOCOL_VERSION, "type": "pull_manifest", "job": fake, "rank": 0, "step": 0}
    with DataPeer(b.fields["data"]) as peer:
        garbage: list[tuple[Any, str]] = [
            ([b"\x00 not msgpack"], "bad_message"),
            ([msgpack.packb({"v": 99, "type": "chunk", "job": fake})], "bad_message"),
            ([msgpack.packb({"v": PROTOCOL_VERSION, "type": "no_such_type", "job": fake})], "bad_message"),
            ([msgpack.packb({**manifest, "rank": -1})], "bad_message"),
            ([msgpack.packb(manifest), b"an extra frame"], "bad_message"),
            ([b"\x81" + b"\xa1k" * (1 << 20)], "bad_message"),  # a header over the 1 MiB limit
            # ipc talk on the data plane
            (RegisterRank(job=fake, rank=0, world_size=1, pid=1, data_bytes=1), "bad_chunk"),
            (dataclasses.replace(begin, table=b"\xc1 not a table"), "bad_chunk"),
            (dataclasses.replace(begin, step=2, data_bytes=10), "bad_chunk"),  # the table runs past the data
            (chunk(0, step=7), "not_found"),  # a chunk of a stream never begun
        ]
        for frames, code in garbage:
            reply = peer.request(frames)
            assert isinstance(reply, Error) and reply.code == code, (frames, reply)
        # a stream driven by hand: a corrupt chunk is refused and never makes the snapshot complete
        assert isinstance(peer.request(begin), StreamAccept)
        bad = peer.request(chunk(0, digest=checksum(chunks[0]) ^ 1))
        assert isinstance(bad, Error) and bad.code == "bad_chunk" and "xxh3" in bad.message
        acks = [peer.request(chunk(i)) for i in (0, 1)]
        assert all(isinstance(a, ChunkAck) and not a.complete for a in acks)
        assert_not_held(cluster, "B", fake, 0, 1)  # 2 of 3 chunks: not served
        last = peer.request(chunk(2))
        assert isinstance(last, ChunkAck) and last.complete
        again = peer.request(begin)  # a repeated offer of a complete snapshot changes nothing
        assert isinstance(again, StreamAccept) and again.bases == (1,)
        peer.send(StreamAbort(job=fake, rank=0, step=1))  # nor does an abort of it (one-way: no reply)
        # a sender's window of 8: an ack per 2 chunks, and always for the chunk that completes the snapshot
        five = bytes(range(256)) * 80
        parts = [memoryview(five)[i : i + 4096] for i in range(0, len(five), 4096)]
        table = encode_table([TensorEntry("y", "uint8", (len(five),), 0, len(five))])
        windowed = StreamBegin(
            job=fake,
            rank=1,
            step=1,
            src_node="X",
            data_bytes=len(five),
            chunk_bytes=4096,
            window=8,
            digest=blob_digest(table, meta),
            table=table,
            meta=meta,
        )
        assert isinstance(peer.request(windowed), StreamAccept)
        for i, part in enumerate(parts):
            peer.send(
                Chunk(
                    job=fake,
                    rank=1,
                    step=1,
                    index=i,
                    raw_len=part.nbytes,
                    checksum=checksum(part),
                    payload=part,
                )
            )
        acks = [peer.recv() for _ in range(3)]
        assert [(a.index, a.count, a.complete) for a in acks if isinstance(a, ChunkAck)] == [
            (1, 2, False),
            (3, 2, False),
            (4, 1, True),
        ]
    with DataPeer(b.fields["data"]) as peer:
        got = peer.pull(fake, 0, 1)
    assert isinstance(got, Pulled) and got.data == data and got.table == encode_table(entries)

    with DataPeer(f"ipc://{cluster.ipc('A')}") as ipc:
        for frames in (
            [b"garbage"],
            Announce(job=fake, rank=0, step=1, slot=0, table_id=1),
            PullManifest(job=fake, rank=0, step=1),
        ):
            reply = ipc.request(frames)
            assert isinstance(reply, Error) and reply.code == "bad_message", reply
        registered = ipc.request(RegisterRank(job=fake, rank=3, world_size=4, pid=1, data_bytes=100))
        assert isinstance(registered, RankRegistered) and isinstance(ipc.recv(), SlotUpdate)
        assert [n for n in shm_leftovers(cluster.tag) if fake in n] == [os.path.basename(registered.arena)]
        for bad_announce in (
            Announce(job=fake, rank=3, step=1, slot=5, table_id=1, table=encode_table(entries)),
            Announce(job=fake, rank=3, step=1, slot=0, table_id=2),
        ):
            reply = ipc.request(bad_announce)
            assert isinstance(reply, Error) and reply.code == "bad_message", reply
        ipc.send(UnregisterRank(job=fake, rank=3))
        wait_until(
            lambda: not os.path.exists(registered.arena), "the unregistered rank's arena to be removed", WAIT
        )
    # the sidecars still do their job
    job = cluster.job("after")
    with open_ranks(cluster, job, [("A", larger_than_a_chunk())]) as [r]:
        watch.track(job, [r])
        for step in (1, 2):
            assert r.capture(step) and r.snap.wait(WAIT)
        assert_holds(cluster, "B", r, job, 2)
    assert all(p.alive() for p in cluster.sidecars.values())


def arenas_of(cluster: Cluster, node: str) -> list[str]:
    return [n for n in shm_leftovers(cluster.tag) if f"-{cluster.node(node)}." in n]


def stored_bytes(cluster: Cluster, node: str) -> int:
    doc = fetch_status(cluster.coordinator_addr, secret=None)
    return next(n["stored_bytes"] for n in doc["nodes"] if n["node"] == cluster.node(node))


def heard_since(cluster: Cluster, node: str, since: float) -> bool:
    """Whether the coordinator had a heartbeat of ``node`` after ``since`` (time.monotonic() of this process)."""
    asked = time.monotonic()
    doc = fetch_status(cluster.coordinator_addr, secret=None)
    seen_ago = next(n["last_seen_s"] for n in doc["nodes"] if n["node"] == cluster.node(node))
    return asked - seen_ago > since


@pytest.mark.parametrize("how", ["sigterm", "sigkill"])
def test_receiver_restarted_mid_stream(cluster: Cluster, watch: StatusWatch, how: str) -> None:
    cluster.start("A", "--max-rate", "16MB/s")  # 24 MB take 1.5 s: long enough to interrupt
    b = cluster.start("B")
    port = urlsplit(b.fields["data"]).port
    job, job_b = cluster.job("restart"), cluster.job("onb")
    work = big(24 << 20)
    # rank 1 first snapshots at step 2, so step 1 never becomes recoverable and re-replication cannot copy it
    # to the new B: whatever B holds of step 1 can only have come from the interrupted stream
    with (
        open_ranks(cluster, job, [("A", work), ("A", tiny_tensors(10))]) as ranks,
        open_ranks(cluster, job_b, [("B", zero_bytes())]),
    ):
        watch.track(job, ranks)
        r0 = ranks[0]
        assert arenas_of(cluster, "B")  # B holds the arena of its own local rank
        assert r0.capture(1)
        wait_until(
            lambda: stored_bytes(cluster, "B") >= work.data_bytes, "the stream of step 1 to begin on B", WAIT
        )
        begun = time.monotonic()
        wait_until(lambda: heard_since(cluster, "B", begun), "a heartbeat of B after the stream began", WAIT)
        assert_not_held(cluster, "B", job, 0, 1)  # partly there: neither served nor reported
        if how == "sigterm":
            assert cluster.stop(b) == 0
            assert not arenas_of(cluster, "B")  # a clean exit removes the arenas at once
        else:
            cluster.crash(b)
            assert arenas_of(cluster, "B")  # a killed sidecar leaves its arenas ...
        cluster.start("B", data_bind=f"tcp://127.0.0.1:{port}")  # same node, same address: A reconnects to it
        assert not arenas_of(cluster, "B")  # ... and the next sidecar of the node removes them
        wait_until(lambda: r0.snap.stats.failed >= 1, "the interrupted stream to fail", WAIT)
        stats = r0.snap.stats
        assert stats.last_durable_step == -1 and "did not take step 1" in stats.last_error, stats
        assert_not_held(cluster, "B", job, 0, 1)
        for r in ranks:
            assert r.capture(2)
        for r in ranks:
            assert r.snap.wait(WAIT), r.snap.stats
            assert_holds(cluster, "B", r, job, 2)
        wait_until(lambda: watch.watermark(job) == (2, 2), "G = D = 2", WAIT)
        assert_not_held(cluster, "B", job, 0, 1)
        assert r0.snap.stats.durable == 1 and r0.snap.stats.errors >= 1
    assert watch.durable_steps(job) <= {-1, 2} and watch.checked[job] == [2]


def _left_out(step: int) -> int:
    """The steps up to ``step`` an ``every=1`` Snapshotter leaves out for the pacer's clean steps."""
    return sum(left_out(s, 1) for s in range(1, step + 1))


def test_peer_killed_mid_stream(cluster: Cluster, watch: StatusWatch) -> None:
    cluster.start("A", "--max-rate", "12MB/s")
    b = cluster.start("B")
    cluster.start("C")
    job = cluster.job("killed")
    work = big(12 << 20)
    with open_ranks(cluster, job, [("A", work)]) as [r]:
        watch.track(job, [r])
        assert r.capture(1) and r.snap.wait(WAIT)
        assert_holds(cluster, "B", r, job, 1)
        assert r.capture(2)
        wait_until(
            lambda: stored_bytes(cluster, "B") >= 2 * work.data_bytes, "step 2 to begin streaming to B", WAIT
        )
        cluster.kill(b)
        step = 2
        deadline = time.monotonic() + 45
        while r.snap.stats.last_durable_step <= 2:  # training goes on; capture() neither raises nor blocks
            assert time.monotonic() < deadline, r.snap.stats
            step += 1
            t0 = time.monotonic()
            r.capture(step)
            assert time.monotonic() - t0 < 1.0
            time.sleep(0.05)
        assert r.snap.wait(WAIT)
        final = max(r.started)
        stats = r.snap.stats
        assert stats.last_durable_step == final and stats.failed == 1, stats
        assert "did not take step" in stats.last_error  # step 2, or a later one staged as step 2 failed
        # the coordinator's reassignment cut the dead buddy's stream off; it did not wait for a send to time out
        assert "reassigned by the coordinator" in stats.last_error, stats.last_error
        assert stats.skipped > 0 and stats.started + stats.skipped + _left_out(step) == step
        assert_holds(cluster, "C", r, job, final)
        wait_until(lambda: watch.watermark(job) == (final, final), f"G = D = {final}", WAIT)
        assert not watch.node("B")["alive"] and watch.node("C")["alive"]
    assert 1 in watch.checked[job] and watch.checked[job][-1] == final


def test_a_nodes_death_mid_stream_leaves_every_rank_a_common_step(
    cluster: Cluster, watch: StatusWatch
) -> None:
    """Node B is rank 1's home and rank 0's only buddy. Rank 0's step 2 reached B; rank 1's step 2 was still
    streaming from B to C when B died. Rank 0's step 2 is then only on A and rank 1's only step is 1 (on C): A
    must still hold rank 0's step 1, which only D (1 here) moving past it may free, not the newer copy."""
    cluster.start("A")
    b = cluster.start("B", "--max-rate", "12MB/s")  # rank 1's 24 MB stream to C takes 2 s
    cluster.start("C")
    job = cluster.job("common")
    small, large = big(1 << 20), big(24 << 20)
    with open_ranks(cluster, job, [("A", small), ("B", large)]) as [r0, r1]:
        watch.track(job, [r0, r1])
        assert r0.capture(1) and r1.capture(1)
        assert r0.snap.wait(WAIT) and r1.snap.wait(WAIT)
        wait_until(lambda: watch.watermark(job) == (1, 1), "G = D = 1", WAIT)
        assert r1.capture(2)
        wait_until(
            lambda: stored_bytes(cluster, "C") >= 2 * large.data_bytes,
            "rank 1's step 2 to begin streaming",
            WAIT,
        )
        assert r0.capture(2) and r0.snap.wait(WAIT)  # on B now
        cluster.kill(b)
        assert_not_held(cluster, "C", job, 1, 2)  # B died before rank 1's step 2 was complete anywhere
        wait_until(lambda: not watch.node("B")["alive"], "B to be declared dead", WAIT)
        r1.snap.close(unregister=False)  # rank 1's process went down with its node
        with (
            Snapshotter(
                large.at(0), job=job, rank=1, world_size=2, sidecar=cluster.ipc("C"), timeout=WAIT
            ) as new1,
            ThreadPoolExecutor(2) as pool,
        ):
            steps = list(
                pool.map(lambda snap: snap.restore(timeout=WAIT), [r0.snap, new1], timeout=WAIT + 10)
            )
            assert steps == [1, 1]
            assert (r0.snap.restored["source"], new1.restored["source"]) == ("local", "replica")
            assert torch.equal(r0.work.state["w"], small.at(1)["w"]) and torch.equal(
                new1.state["w"], large.at(1)["w"]
            )


def test_a_restore_never_mixes_the_failed_runs_copy_of_a_step_with_the_resumed_runs(
    cluster: Cluster, watch: StatusWatch
) -> None:
    """Rank 0 had snapshotted step 6 and rank 1 had not when both restarted, so the job resumed from 5. The
    resumed run's step 6 comes out differently (as with nondeterministic kernels) under the same name. When both
    ranks restart again before a later step is durable, the job must resume from 5 again: at 6, rank 0 could get
    the failed run's copy and rank 1 the resumed run's. Once step 7 is durable, 7 is the plan."""
    cluster.start("A")
    cluster.start("B")
    job = cluster.job("fork")
    shape = {"w": ((1 << 18,), torch.float32)}
    homes = ("A", "B")

    def restart(previous: Sequence[Rank], resumed_from: int | None) -> list[Rank]:
        """Every rank's process restarts on its node and restores; the restored step must be ``resumed_from``."""
        for r in previous:
            r.snap.close(unregister=False)
        ranks = []
        for i, node in enumerate(homes):
            work = Workload(shape, seed=10 + i)
            work.reshape(6, shape)  # the resumed run: steps from 6 on differ from the failed run's
            snap = Snapshotter(
                work.state, job=job, rank=i, world_size=2, sidecar=cluster.ipc(node), timeout=WAIT
            )
            ranks.append(Rank(snap, work, node, cluster.node(node)))
        with ThreadPoolExecutor(2) as pool:
            steps = list(pool.map(lambda r: r.snap.restore(timeout=WAIT), ranks, timeout=WAIT + 10))
        assert steps == [resumed_from] * 2
        for r in ranks:
            assert torch.equal(r.work.state["w"], r.work.at(resumed_from)["w"])
        return ranks

    # "block": five steps back to back on three slots; a capture waits for D to free a slot instead of skipping
    with open_ranks(
        cluster,
        job,
        [(node, Workload(shape, seed=10 + i)) for i, node in enumerate(homes)],
        when_busy="block",
    ) as failed:
        for step in range(1, 6):
            assert all(r.capture(step) for r in failed) and all(r.snap.wait(WAIT) for r in failed)
        wait_until(lambda: watch.watermark(job) == (5, 5), "G = D = 5", WAIT)
        assert failed[0].capture(6) and failed[0].snap.wait(WAIT)  # rank 1 died before its step 6
        assert_holds(cluster, "B", failed[0], job, 6)
        resumed = restart(failed, 5)
        try:
            assert all(r.capture(6) for r in resumed)
            for r in resumed:  # taken, or refused: a buddy may drop a copy of a stale step as it lands
                r.snap.wait(WAIT)
            again = restart(resumed, 5)
        finally:
            for r in resumed:
                r.snap.close()
        try:
            assert all(r.capture(6) for r in again)
            for r in again:
                r.snap.wait(WAIT)
            assert all(r.capture(7) for r in again) and all(r.snap.wait(WAIT) for r in again)
            wait_until(lambda: watch.watermark(job) == (7, 7), "G = D = 7", WAIT)
            restart(again, 7)[0].snap.close()
        finally:
            for r in again:
                r.snap.close()


def test_slow_stream_skips_steps_and_the_lag_stays_bounded(cluster: Cluster, watch: StatusWatch) -> None:
    cluster.start("A", "--max-rate", "10MB/s")
    cluster.start("B")
    job = cluster.job("slow")
    work = big(4 << 20)
    stream_s = work.data_bytes / 10e6  # 0.4 s per snapshot, against 20 ms training steps
    with open_ranks(cluster, job, [("A", work)]) as [r]:
        watch.track(job, [r])
        assert r.capture(1) and r.snap.wait(WAIT)
        captured_at = {1: time.monotonic()}
        staleness = 0.0  # how old the newest durable snapshot is, at worst
        step = 1
        end = time.monotonic() + 4.0
        while time.monotonic() < end:
            step += 1
            now = time.monotonic()
            if r.capture(step):
                captured_at[step] = now
            staleness = max(staleness, now - captured_at[r.snap.stats.last_durable_step])
            time.sleep(0.02)
        assert r.snap.wait(WAIT)
        stats = r.snap.stats
        assert stats.failed == 0 and stats.started + stats.skipped + _left_out(step) == step
        assert stats.skipped > step / 2 and stats.started >= 4, stats
        # the skip policy widened the stride: the loss bound a node loss would have
        assert stats.stride >= 2, stats
        assert stats.last_durable_step == max(r.started)
        # a snapshot waits for at most the stream in flight, then streams itself: the lag does not grow
        assert staleness < 3 * stream_s + 1.0, (staleness, stream_s)
        assert_holds(cluster, "B", r, job, max(r.started))
        wait_until(lambda: watch.watermark(job) == (max(r.started),) * 2, "G = D = the last step", WAIT)


def test_superseded_stream_is_aborted_and_the_newer_step_completes(
    cluster: Cluster, watch: StatusWatch
) -> None:
    cluster.start("A", "--max-rate", "16MB/s")
    cluster.start("B")
    job = cluster.job("superseded")
    work = big(16 << 20)  # 1 s per stream: step 2 comes before step 1 is half sent
    with open_ranks(cluster, job, [("A", work)], slots=3) as [r]:
        watch.track(job, [r])
        assert r.capture(1)
        wait_until(
            lambda: stored_bytes(cluster, "B") >= work.data_bytes, "the stream of step 1 to begin on B", WAIT
        )
        assert r.capture(2)  # a third slot is free: step 2 is announced while step 1 streams

        def one_snapshot_while_step_2_streams() -> bool:
            stored = stored_bytes(cluster, "B")
            streaming = isinstance(pull(cluster, "B", job, 0, 2), Error)
            assert streaming, "step 2 completed before B was seen to drop step 1"
            return stored < 2 * work.data_bytes

        wait_until(one_snapshot_while_step_2_streams, "B to drop the incomplete step 1", WAIT, every=0.1)
        assert r.snap.wait(WAIT)
        assert_holds(cluster, "B", r, job, 2)
        assert_not_held(cluster, "B", job, 0, 1)
        stats = r.snap.stats
        assert (stats.started, stats.durable, stats.last_durable_step) == (2, 1, 2)
        wait_until(lambda: watch.watermark(job) == (2, 2), "G = D = 2", WAIT)
    assert 1 not in watch.durable_steps(job)


def test_a_stream_more_than_half_sent_finishes_and_the_newer_step_follows(
    cluster: Cluster, watch: StatusWatch
) -> None:
    """A newer step superseded a stream with every byte sent, throwing away a step about to be durable: a rank's
    first snapshots, landing in a buddy's fresh memory, each took longer than a step and none became durable."""
    port = free_port()
    cluster.start("A", "--max-rate", "16MB/s", "--metrics-bind", f"127.0.0.1:{port}")
    cluster.start("B")
    job = cluster.job("finish-first")
    work = big(48 << 20)  # 3 s per stream, in 12 chunks

    def sent() -> float:  # a push's bytes count as unacknowledged until the buddy holds the snapshot
        return sum(v for (name, _), v in scrape(port).items() if name == "snapshotd_peer_unacked_bytes")

    with open_ranks(cluster, job, [("A", work)], slots=3) as [r]:
        watch.track(job, [r])
        assert r.capture(1)
        # the step between the two captures is as long as step 1's stream so far (2.4 s): the rest (0.8 s) takes
        # less than the half step that step 2 waits at most
        wait_until(
            lambda: sent() >= 0.7 * work.data_bytes, "step 1 to be more than half sent", WAIT, every=0.05
        )
        assert r.snap.stats.durable == 0  # step 1 still streams
        assert r.capture(2)  # a third slot is free: step 2 is announced while step 1 finishes
        assert r.snap.wait(WAIT)
        stats = r.snap.stats
        assert (stats.started, stats.durable, stats.failed, stats.last_durable_step) == (2, 2, 0, 2), stats
        assert_holds(cluster, "B", r, job, 2)
        wait_until(lambda: watch.watermark(job) == (2, 2), "G = D = 2", WAIT)
    assert 1 in watch.durable_steps(job)


def test_memory_limit_refuses_a_bigger_stream_and_keeps_what_is_held(
    cluster: Cluster, watch: StatusWatch
) -> None:
    a = cluster.start("A")
    cluster.start("B", "--memory-limit", "1MiB")
    job = cluster.job("memory")
    work = Workload({"w": ((50_000,), torch.float32)})
    work.reshape(2, {"w": ((50_000,), torch.float32), "grown": ((500_000,), torch.float32)})  # + 2 MB
    work.reshape(3, {"w": ((50_000,), torch.float32)})
    with open_ranks(cluster, job, [("A", work)]) as [r]:
        watch.track(job, [r])
        assert r.capture(1) and r.snap.wait(WAIT)
        assert r.capture(2)  # the client registers a bigger arena; the buddy refuses the stream
        wait_until(lambda: r.snap.stats.failed >= 1, "the refusal to reach the client", WAIT)
        stats = r.snap.stats
        assert (stats.failed, stats.last_durable_step) == (1, 1), stats
        wait_until(
            lambda: "memory limit 1048576 B reached" in cluster.tail(a, 400), "the sender to log why", WAIT
        )
        assert_holds(cluster, "B", r, job, 1)  # nothing held was dropped to make room
        assert r.capture(3) and r.snap.wait(WAIT)  # a snapshot that fits streams again
        assert_holds(cluster, "B", r, job, 3)
        wait_until(lambda: watch.watermark(job) == (3, 3), "G = D = 3", WAIT)
    assert watch.durable_steps(job) <= {-1, 1, 3}


def test_memory_limit_refusal_is_named_to_the_client_and_ends_its_wait(cluster: Cluster) -> None:
    cluster.start("A")
    cluster.start("B", "--memory-limit", "1MiB")
    job = cluster.job("memory-named")
    with open_ranks(cluster, job, [("A", big(2 << 20))]) as [r]:
        assert r.capture(1)
        wait_until(lambda: r.snap.stats.failed >= 1, "the refusal to reach the client", WAIT)
        assert "memory limit" in r.snap.stats.last_error, r.snap.stats.last_error
        t0 = time.monotonic()
        assert not r.snap.wait(10)
        # at once, not after the timeout (a wide margin for a loaded machine)
        assert time.monotonic() - t0 < 5
