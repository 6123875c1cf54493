"""``snapshotd serve``: the node's sidecar.

Three sockets, one event loop (uvloop), one TaskGroup:

- **ipc** (ROUTER, owner-only): local training ranks register, announce staged slots, ask to restore.
- **data** (ROUTER, TCP): buddies stream snapshots in; peers pull complete snapshots out.
- **control** (DEALER to the coordinator): registration, heartbeats with inventory, recovery plans.

Outgoing streams and pulls use one :class:`PeerLink` per remote sidecar. Nothing here raises into a training
process: every failure becomes an ``Error`` reply, a log line and a counter.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable, Coroutine
from typing import Any
from urllib.parse import urlsplit

import zmq
import zmq.asyncio
from zmq.auth.asyncio import AsyncioAuthenticator

from snapshotd import proto
from snapshotd.progress import Progress
from snapshotd.proto import (
    Announce,
    Chunk,
    ChunkAck,
    Error,
    ErrorCode,
    Heartbeat,
    HeartbeatReply,
    InventoryItem,
    Message,
    PlanRequest,
    ProtocolError,
    PullManifest,
    PullRequest,
    RankInfo,
    RankRegistered,
    RegisterRank,
    RegisterSidecar,
    ReplicateTask,
    RestoreReply,
    RestoreRequest,
    SlotUpdate,
    StreamAbort,
    StreamAccept,
    StreamBegin,
    UnregisterRank,
    codec,
)
from snapshotd.security import (
    DATA_DOMAIN,
    MembersGate,
    check_bind,
    members_source,
    secure_server,
    start_authenticator,
)
from snapshotd.shm import Arena, create_arena, pid_alive, sweep_stale_arenas

from .config import SidecarConfig
from .control import CoordinatorClient, CoordinatorUnavailable
from .local import LocalRank, SlotState
from .pacer import Pacer
from .peers import PeerError, PeerLink
from .placement import DirectSink, Lander, PlacementError, arena_sink
from .store import MemoryLimitReached, SnapshotStore, StoredSnapshot, UnknownSnapshot
from .transfer import CodecPolicy, PullFailed, pull_snapshot, send_snapshot

__all__ = ["Sidecar", "run_sidecar"]

log = logging.getLogger(__name__)

RankKey = tuple[str, int]
_Read = Callable[[int, int], memoryview]  # read(start, end): bytes of a held copy


class Sidecar:
    """One node's sidecar. Create, then ``await run(ready, stop)``; everything is closed when it returns."""

    def __init__(self, cfg: SidecarConfig) -> None:
        self.cfg = cfg
        self.ctx = zmq.asyncio.Context()
        self.store = SnapshotStore(cfg.memory_limit)
        self._acks: dict[tuple[str, int, int], _AckBatch] = {}  # incoming streams whose sender gave a window
        self.pacer = Pacer(cfg.max_rate)
        self.ranks: dict[RankKey, LocalRank] = {}
        self.links: dict[str, PeerLink] = {}
        self._from_ip: str | None = None  # members mode: the IP address outgoing data connections come from
        self.policies: dict[str, CodecPolicy] = {}
        self.assignments: dict[RankKey, tuple[str, ...]] = {}
        self.incarnation = uuid.uuid4().hex[:16]
        self.data_addr = ""
        # pulls are bulk reads of a complete snapshot with no pacing: bigger messages cost less per byte
        self.pull_chunk_bytes = max(cfg.chunk_bytes, 4 << 20)
        self.version = 0  # bumps when ranks or the local inventory change
        self.bytes_out = 0
        self.bytes_in = 0
        self.errors = 0
        self._replicating: set[tuple[str, int, int]] = set()
        self._ipc_out: asyncio.Queue[tuple[bytes, Message]] = asyncio.Queue(maxsize=4096)
        self._data_out: asyncio.Queue[tuple[bytes, Message]] = asyncio.Queue(maxsize=4096)
        self._tg: asyncio.TaskGroup | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._wake = asyncio.Event()

    # ------------------------------------------------------------------------------------------ lifecycle

    async def run(self, ready: Callable[[str, str], None] | None = None, stop: asyncio.Event | None = None) -> None:
        """Bind, register, serve until ``stop`` is set (or SIGTERM/SIGINT in the main thread), then clean up."""
        cfg = self.cfg
        stop = stop or asyncio.Event()
        check_bind(cfg.data_bind, cfg.secret, cfg.insecure)
        sweep_stale_arenas(cfg.node)
        _keep_malloc_arenas()
        if cfg.nice:
            os.nice(cfg.nice)
        self.control = CoordinatorClient(self.ctx, cfg.coordinator, secret=cfg.secret)
        members = cfg.data_security == "members"
        auth: MembersGate | AsyncioAuthenticator | None
        if members:
            auth = MembersGate(self.ctx, lambda host: self.control.is_member(host, min(5.0, cfg.request_timeout)))
            auth.start()
        else:
            auth = start_authenticator(self.ctx, cfg.secret)
        ipc = self.ctx.socket(zmq.ROUTER)
        data = self.ctx.socket(zmq.ROUTER)
        installed: list[signal.Signals] = []
        try:
            for sock in (ipc, data):
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
                sock.setsockopt(zmq.RCVHWM, 4096)
                sock.setsockopt(zmq.SNDHWM, 4096)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(cfg.ipc)
            old_umask = os.umask(0o177)
            try:
                ipc.bind(f"ipc://{cfg.ipc}")
            finally:
                os.umask(old_umask)
            os.chmod(cfg.ipc, 0o600)
            if members:
                data.zap_domain = DATA_DOMAIN
                data.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)  # no ZAP handler answering: refuse, never admit
            else:
                secure_server(data, cfg.secret)
            data.bind(cfg.data_bind)
            self.data_addr = self._advertised(data.getsockopt_string(zmq.LAST_ENDPOINT))
            self._from_ip = members_source(self.data_addr) if members else None
            log.info("sidecar %s: ipc ipc://%s, data %s (bound %s), coordinator %s", cfg.node, cfg.ipc,
                     self.data_addr, data.getsockopt_string(zmq.LAST_ENDPOINT), cfg.coordinator)  # fmt: skip
            if ready is not None:
                ready(self.data_addr, cfg.ipc)
            loop = asyncio.get_running_loop()
            if _in_main_thread():
                for sig in (signal.SIGTERM, signal.SIGINT):
                    loop.add_signal_handler(sig, stop.set)
                    installed.append(sig)
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                tasks = [
                    tg.create_task(self._ipc_loop(ipc)),
                    tg.create_task(self._writer(ipc, self._ipc_out)),
                    tg.create_task(self._data_loop(data)),
                    tg.create_task(self._writer(data, self._data_out)),
                    tg.create_task(self._control_loop()),
                    tg.create_task(self.control.watch()),
                ]
                await stop.wait()
                log.info("sidecar %s: stopping", cfg.node)
                for lr in self.ranks.values():
                    if lr.stream_task is not None:
                        lr.stream_task.cancel()
                for task in tasks:
                    task.cancel()
                for task in list(self._tasks):  # streams, pulls, replications and peer readers
                    task.cancel()
        finally:
            for sig in installed:
                asyncio.get_running_loop().remove_signal_handler(sig)
            for link in self.links.values():
                link.close()
            self.control.close()
            ipc.close(linger=0)
            data.close(linger=0)
            if auth is not None:
                auth.stop()
            self.ctx.destroy(linger=0)
            for lr in self.ranks.values():
                lr.arena.close(unlink=True)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(cfg.ipc)

    def _advertised(self, bound: str) -> str:
        parts = urlsplit(bound)
        host = self.cfg.advertise or parts.hostname or socket.gethostname()
        if host in ("0.0.0.0", "::", "*"):
            host = socket.gethostname()
        return f"tcp://{host}:{parts.port}"

    def _spawn(self, coro: Coroutine[Any, Any, None], what: str) -> asyncio.Task[None]:
        """Run a handler task in the sidecar's TaskGroup; its failure is logged and counted, never fatal."""

        async def guarded() -> None:
            try:
                await coro
            except asyncio.CancelledError:
                raise
            except Exception:
                self.errors += 1
                log.exception("%s failed", what)

        assert self._tg is not None
        task = self._tg.create_task(guarded())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def link(self, addr: str) -> PeerLink:
        link = self.links.get(addr)
        if link is None:
            members = self._from_ip is not None  # plaintext, from the address members are known by
            link = self.links[addr] = PeerLink(self.ctx, addr, secret=None if members else self.cfg.secret,
                                               timeout=self.cfg.request_timeout, source=self._from_ip)  # fmt: skip
            self._spawn(link.run(), f"peer link {addr}")
        return link

    async def _writer(self, sock: zmq.asyncio.Socket, queue: asyncio.Queue[tuple[bytes, Message]]) -> None:
        """The one place that sends replies on a ROUTER; a vanished peer is logged, not fatal."""
        while True:
            ident, msg = await queue.get()
            try:
                async with asyncio.timeout(self.cfg.request_timeout):
                    await sock.send_multipart([ident, *proto.encode(msg)], copy=False)
            except (zmq.ZMQError, TimeoutError) as exc:
                log.debug("could not send %s to a peer that left: %s", msg.TYPE, exc)

    def _reply(self, queue: asyncio.Queue[tuple[bytes, Message]], ident: bytes, msg: Message) -> None:
        try:
            queue.put_nowait((ident, msg))
        except asyncio.QueueFull:
            self.errors += 1
            log.warning("reply queue full; dropped %s", msg.TYPE)

    # ---------------------------------------------------------------------------------------------- ipc

    async def _ipc_loop(self, ipc: zmq.asyncio.Socket) -> None:
        while True:
            frames = await ipc.recv_multipart(copy=False)
            ident = frames[0].bytes
            try:
                msg = proto.decode(frames[1:])
                if isinstance(msg, RegisterRank):
                    self._register_rank(ident, msg)
                elif isinstance(msg, Announce):
                    self._announce(ident, msg)
                elif isinstance(msg, RestoreRequest):
                    self._spawn(self._restore(ident, msg), f"restore of {msg.job} rank {msg.rank}")
                elif isinstance(msg, UnregisterRank):
                    self._unregister(msg.job, msg.rank)
                else:
                    raise ProtocolError(f"{msg.TYPE} is not an ipc request")
            except ProtocolError as exc:
                self.errors += 1
                log.warning("ipc: %s", exc)
                self._reply(self._ipc_out, ident, Error(code=ErrorCode.BAD_MESSAGE, message=str(exc)))

    def _register_rank(self, ident: bytes, msg: RegisterRank) -> None:
        key = (msg.job, msg.rank)
        lr = self.ranks.get(key)
        need = max(4096, -(-msg.data_bytes // 4096) * 4096)
        if lr is not None and lr.arena.slot_bytes >= msg.data_bytes and lr.arena.slots == msg.slots:
            lr.awaiting_restore = lr.awaiting_restore or lr.pid != msg.pid
            lr.pid, lr.identity, lr.alive, lr.world_size = msg.pid, ident, True, msg.world_size
            lr.seen_step = max(lr.valid_steps(), default=-1)
        else:
            if lr is not None:
                self._drop_rank(lr)
            arena = self._new_arena(msg.job, msg.rank, need, msg.slots)
            lr = LocalRank(msg.job, msg.rank, msg.world_size, msg.pid, ident, arena, [SlotState() for _ in range(msg.slots)])
            self.ranks[key] = lr
            log.info("rank %d of job %s (pid %d) registered: arena %s, %d x %d B", msg.rank, msg.job, msg.pid,
                     arena.path, msg.slots, need)  # fmt: skip
        lr.table_id = -1  # a new process numbers its tables afresh
        self.version += 1
        self._wake.set()  # tell the coordinator now, so that buddies are placed before the first snapshot
        self._reply(self._ipc_out, ident, RankRegistered(
            job=msg.job, rank=msg.rank, arena=lr.arena.path, slot_bytes=lr.arena.slot_bytes, slots=lr.arena.slots,
            pid=os.getpid(),
        ))  # fmt: skip
        self._send_slots(lr)

    def _new_arena(self, job: str, rank: int, slot_bytes: int, slots: int) -> Arena:
        return create_arena(job, rank, slot_bytes, slots, node=self.cfg.node)

    def _drop_rank(self, lr: LocalRank) -> None:
        if lr.stream_task is not None:
            lr.stream_task.cancel()
        lr.arena.close(unlink=True)
        self.ranks.pop((lr.job, lr.rank), None)
        self.version += 1

    def _unregister(self, job: str, rank: int) -> None:
        lr = self.ranks.get((job, rank))
        if lr is not None:
            log.info("rank %d of job %s closed its snapshotter", rank, job)
            self._drop_rank(lr)

    def _send_slots(self, lr: LocalRank, note: str = "", failed_step: int = -1) -> None:
        held = sum(s.valid for s in lr.slots)
        free = lr.release_free()
        self.version += 1
        if sum(s.valid for s in lr.slots) != held:  # a copy is gone: the coordinator must not plan a restore from it
            self._wake.set()
        self._reply(self._ipc_out, lr.identity, SlotUpdate(
            job=lr.job, rank=lr.rank, free_slots=tuple(free), seen_step=lr.seen_step,
            durable_step=lr.durable_step, failed_step=failed_step, note=note,
        ))  # fmt: skip

    def _announce(self, ident: bytes, msg: Announce) -> None:
        lr = self.ranks.get((msg.job, msg.rank))
        if lr is None:
            raise ProtocolError(f"rank {msg.rank} of job {msg.job!r} announced before registering")
        if msg.table.nbytes:
            lr.set_table(msg.table_id, msg.table)
        elif msg.table_id != lr.table_id:
            raise ProtocolError(f"unknown tensor table {msg.table_id}; send the table again")
        if not 0 <= msg.slot < lr.arena.slots:
            raise ProtocolError(f"slot {msg.slot} is outside the arena's {lr.arena.slots} slots")
        slot = lr.slots[msg.slot]
        if slot.valid or slot.streaming or slot.pins:
            raise ProtocolError(f"slot {msg.slot} was not free (it holds step {slot.step})")
        newest = max(lr.valid_steps(), default=-1)
        if msg.step <= newest:
            raise ProtocolError(f"step {msg.step} is not newer than the newest snapshot {newest}; steps only grow")
        lr.identity = ident
        lr.seen_step = msg.step
        self.pacer.report_step(msg.step_seconds, streaming=lr.stream_task is not None)
        lr.slots[msg.slot] = SlotState(
            step=msg.step, valid=True, table=lr.table, meta=bytes(msg.meta), data_bytes=lr.data_bytes, elem=lr.elem
        )
        if lr.stream_task is not None:  # superseded: the newer step wins, the older stream stops
            lr.stream_task.cancel()
        self.version += 1
        self._wake.set()
        lr.stream_task = self._spawn(self._stream_slot(lr, msg.slot), f"stream of {msg.job} rank {msg.rank}")

    async def _stream_slot(self, lr: LocalRank, index: int) -> None:
        """Stream one announced slot to every buddy of its rank; then hand the free slots back to the client."""
        s = lr.slots[index]
        s.streaming = True
        buddies: list[str] = []
        ok = 0
        mine: dict[str, asyncio.Future[None]] = {}
        try:
            deadline = time.monotonic() + 4 * self.cfg.heartbeat_interval + 1.0
            while not self.assignments.get((lr.job, lr.rank)) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)  # a rank that just registered gets its buddies with the next heartbeat reply
            buddies = [a for a in self.assignments.get((lr.job, lr.rank), ()) if a != self.data_addr]
            data = lr.arena.slot(index)[: s.data_bytes]
            prev = lr.previous(index)
            base = None
            if prev is not None and lr.slots[prev].table == s.table:
                base = (lr.slots[prev].step, lr.arena.slot(prev)[: s.data_bytes])

            errors: list[str] = []
            checksums: dict[int, int] = {}  # shared by the buddies: the slot does not change while it streams

            async def one(addr: str) -> None:
                try:
                    res = await send_snapshot(
                        self.link(addr), job=lr.job, rank=lr.rank, step=s.step, src_node=self.cfg.node, data=data,
                        table=s.table, meta=s.meta, chunk_bytes=self.cfg.chunk_bytes, window=self.cfg.window,
                        pacer=self.pacer, policy=self.policies.setdefault(addr, CodecPolicy(self.cfg.codec)),
                        base=base, elem=s.elem, checksums=checksums,
                    )  # fmt: skip
                except PeerError as exc:
                    log.warning("stream of %s rank %d step %d to %s failed: %s", lr.job, lr.rank, s.step, addr, exc)
                    errors.append(f"{addr}: {exc}"[:300])
                    raise
                self.bytes_out += res.wire_bytes
                log.debug("step %d of %s rank %d -> %s: %d B (%d on the wire) in %.3f s", s.step, lr.job,
                          lr.rank, addr, res.data_bytes, res.wire_bytes, res.seconds)  # fmt: skip

            # one task per buddy, so that a buddy the coordinator stops assigning (it died) can be cut off alone
            mine = lr.buddy_streams = {addr: asyncio.ensure_future(one(addr)) for addr in buddies}
            results = await asyncio.gather(*mine.values(), return_exceptions=True)
            ok = sum(r is None for r in results)
            if any(isinstance(r, asyncio.CancelledError) for r in results) and len(errors) < len(buddies) - ok:
                errors.append("a buddy was reassigned by the coordinator (it died)")
        finally:
            for task in mine.values():
                task.cancel()
            if lr.buddy_streams is mine:
                lr.buddy_streams = {}
            s.streaming = False
            if buddies and ok == len(buddies):
                lr.durable_step = max(lr.durable_step, s.step)
            superseded = lr.stream_task is not None and lr.stream_task is not asyncio.current_task()
            if lr.stream_task is asyncio.current_task():
                lr.stream_task = None
            if self.ranks.get((lr.job, lr.rank)) is lr and lr.alive:
                if superseded:  # a newer step took over: this one is skipped, not failed
                    self._send_slots(lr)
                elif not buddies:
                    self._send_slots(lr, "no buddy assigned yet", failed_step=s.step)
                elif ok < len(buddies):
                    note = f"{len(buddies) - ok} of {len(buddies)} buddies did not take step {s.step}"
                    if errors:
                        note += ": " + "; ".join(errors)
                    self._send_slots(lr, note[:4000], failed_step=s.step)
                else:
                    self._send_slots(lr)

    # -------------------------------------------------------------------------------------------- restore

    async def _restore(self, ident: bytes, req: RestoreRequest) -> None:
        lr = self.ranks.get((req.job, req.rank))
        if lr is None:
            self._reply(self._ipc_out, ident, Error(job=req.job, code=ErrorCode.NOT_REGISTERED, rank=req.rank,
                                                    message="register the rank before restoring"))  # fmt: skip
            return
        lr.awaiting_restore = True
        try:
            await self._restore_rank(ident, req, lr)
        finally:
            lr.awaiting_restore = False
            if self.ranks.get((lr.job, lr.rank)) is lr:
                self._send_slots(lr)

    async def _restore_rank(self, ident: bytes, req: RestoreRequest, lr: LocalRank) -> None:
        t0 = time.monotonic()
        try:
            plan = await self.control.plan(
                PlanRequest(job=req.job, rank=req.rank, world_size=req.world_size, node=self.cfg.node),
                t0 + req.timeout_s,
            )
        except (CoordinatorUnavailable, ProtocolError) as exc:
            self._reply(self._ipc_out, ident, Error(job=req.job, code=ErrorCode.PLAN_TIMEOUT, rank=req.rank, message=str(exc)))
            return
        if plan.status == "fresh":
            self._reply(self._ipc_out, ident, RestoreReply(job=req.job, rank=req.rank, step=0, source="fresh",
                                                           arena=lr.arena.path, slot_bytes=lr.arena.slot_bytes))  # fmt: skip
            return
        if plan.status != "ready":
            self._reply(self._ipc_out, ident, Error(job=req.job, code=ErrorCode.NOT_RECOVERABLE, rank=req.rank,
                                                    message=plan.reason))  # fmt: skip
            return
        step = plan.step
        index = lr.find(step)
        source, pulled, direct = "local", 0, False
        if index is None:
            try:
                index, pulled, direct = await self._fetch_into_arena(lr, step, plan.sources, req)
            except (PullFailed, PeerError, ProtocolError, PlacementError) as exc:
                self._reply(self._ipc_out, ident, Error(job=req.job, code=ErrorCode.PULL_FAILED, rank=req.rank, step=step,
                                                        message=str(exc)))  # fmt: skip
                return
            source = "pull" if pulled else "replica"
        for i, other in enumerate(lr.slots):  # steps past the restored one never happened for the new process
            if i != index and other.step > step and not other.streaming:
                lr.slots[i] = SlotState()
        lr.seen_step = step
        s = lr.slots[index]
        seconds = time.monotonic() - t0
        log.info("rank %d of job %s restores step %d (%s%s, %d B pulled, %.2f s)", req.rank, req.job, step, source,
                 ", into its tensors" if direct else "", pulled, seconds)  # fmt: skip
        self.version += 1
        self._reply(self._ipc_out, ident, RestoreReply(
            job=req.job, rank=req.rank, step=step, source=source, arena=lr.arena.path, slot_bytes=lr.arena.slot_bytes,
            slot=index, bytes_pulled=pulled, seconds=seconds, direct=direct, table=s.table, meta=s.meta,
        ))  # fmt: skip

    def _restore_slot(self, lr: LocalRank, data_bytes: int) -> int:
        """Make slot 0 of ``lr`` ready to receive ``data_bytes`` (growing the arena if needed)."""
        if data_bytes > lr.arena.slot_bytes:
            old = lr.arena
            lr.arena = self._new_arena(lr.job, lr.rank, -(-data_bytes // 4096) * 4096, old.slots)
            old.close(unlink=True)
        lr.slots = [SlotState() for _ in lr.slots]
        return 0

    async def _fetch_into_arena(
        self, lr: LocalRank, step: int, sources: tuple[str, ...], req: RestoreRequest
    ) -> tuple[int, int, bool]:
        """Bring ``(job, rank, step)`` to the restoring process: from this node's buddy store if held, else pulled;
        into a slot, or, where ``req`` names live tensors, straight into them (:mod:`.placement`).

        Returns the slot, the bytes pulled, and whether tensors were written directly (the slot then lacks their
        bytes, so it is not a valid copy of the step: it is never served or kept as the local fast path).

        Raises:
            PullFailed, PeerError, ProtocolError, PlacementError: the state could not be brought here.
        """
        try:
            snap = self.store.get(lr.job, lr.rank, step)
        except UnknownSnapshot:
            snap = None
        if snap is not None:
            index = self._restore_slot(lr, snap.data_bytes)
            slot = lr.arena.slot(index)[: snap.data_bytes]
            sink = self._direct_sink(lr, req, snap.table, slot)
            land = sink.land if sink is not None else arena_sink(slot)
            for start, part in snap.data.parts():
                land(start, part)
            lr.slots[index] = SlotState(step=step, valid=sink is None, table=snap.table, meta=snap.meta,
                                        data_bytes=snap.data_bytes)  # fmt: skip
            return index, 0, sink is not None
        links = [self.link(a) for a in sources if a != self.data_addr]
        index = 0
        direct = False
        with Progress(None, desc=f"restore {lr.job} rank {lr.rank} step {step}", unit="bytes") as bar:

            def allocate(m: StreamBegin) -> Lander:
                nonlocal direct
                bar.total = m.data_bytes
                self._restore_slot(lr, m.data_bytes)
                lr.slots[index].pins += 1
                slot = lr.arena.slot(index)[: m.data_bytes]
                sink = self._direct_sink(lr, req, m.table, slot)
                direct = sink is not None
                return sink.land if sink is not None else arena_sink(slot)

            try:
                manifest, pulled = await pull_snapshot(links, job=lr.job, rank=lr.rank, step=step, allocate=allocate,
                                                       on_progress=bar.update)  # fmt: skip
            except BaseException:
                lr.slots[index] = SlotState()
                raise
        proto.decode_table(manifest.table, manifest.data_bytes)
        lr.slots[index] = SlotState(step=step, valid=not direct, table=bytes(manifest.table),
                                    meta=bytes(manifest.meta), data_bytes=manifest.data_bytes)  # fmt: skip
        self.bytes_in += pulled
        return index, pulled, direct

    def _direct_sink(
        self, lr: LocalRank, req: RestoreRequest, table: bytes | memoryview, slot: memoryview
    ) -> DirectSink | None:
        """A sink into the restoring process's tensors, if it named any that match and the kernel lets us."""
        if not memoryview(req.targets).nbytes:
            return None
        live = proto.decode_table(req.table)
        sink = DirectSink(lr.pid, proto.decode_table(table, slot.nbytes), live, req.targets, slot)
        return sink if sink.direct_bytes and sink.probe() else None

    # --------------------------------------------------------------------------------------- data plane

    async def _data_loop(self, data: zmq.asyncio.Socket) -> None:
        while True:
            frames = await data.recv_multipart(copy=False)
            ident = frames[0].bytes
            try:
                msg = proto.decode(frames[1:])
            except ProtocolError as exc:
                self.errors += 1
                log.warning("data plane: %s", exc)
                self._reply(self._data_out, ident, Error(code=ErrorCode.BAD_MESSAGE, message=str(exc)))
                continue
            try:
                self._handle_data(ident, msg)
            except (ProtocolError, UnknownSnapshot, MemoryLimitReached) as exc:
                code = {MemoryLimitReached: ErrorCode.MEMORY_LIMIT, UnknownSnapshot: ErrorCode.NOT_FOUND}.get(
                    type(exc), ErrorCode.BAD_CHUNK)
                self.errors += 1
                rank, step = getattr(msg, "rank", -1), getattr(msg, "step", -1)
                self._reply(self._data_out, ident, Error(job=msg.job, code=code, message=str(exc), rank=rank, step=step))

    def _handle_data(self, ident: bytes, msg: Message) -> None:
        if isinstance(msg, Chunk):
            done = self.store.put_chunk(
                msg.job, msg.rank, msg.step, msg.index, codec_name=msg.codec, payload=msg.payload,
                raw_len=msg.raw_len, checksum=msg.checksum, base_step=msg.base_step, elem=msg.elem,
            )  # fmt: skip
            self.bytes_in += msg.payload.nbytes
            if done:
                self.version += 1
                self._wake.set()  # the job's watermarks may move: tell the coordinator now
            key = (msg.job, msg.rank, msg.step)
            batch = self._acks.get(key)
            count = 1
            if batch is not None:
                batch.unacked += 1
                if not (done or batch.unacked >= batch.every or msg.index >= batch.last):
                    return
                count, batch.unacked = batch.unacked, 0
                if done:
                    del self._acks[key]
            self._reply(self._data_out, ident, ChunkAck(job=msg.job, rank=msg.rank, step=msg.step, index=msg.index,
                                                        complete=done, count=count))  # fmt: skip
        elif isinstance(msg, StreamBegin):
            proto.decode_table(msg.table, msg.data_bytes)
            self.store.begin(msg.job, msg.rank, msg.step, src_node=msg.src_node, data_bytes=msg.data_bytes,
                             chunk_bytes=msg.chunk_bytes, table=msg.table, meta=msg.meta)  # fmt: skip
            if msg.window >= 4:  # acknowledge every quarter window: fewer messages, the sender never starved
                self._acks[(msg.job, msg.rank, msg.step)] = _AckBatch(every=msg.window // 4, last=msg.nchunks - 1)
            self._reply(self._data_out, ident, StreamAccept(job=msg.job, rank=msg.rank, step=msg.step,
                                                            bases=tuple(self.store.steps(msg.job, msg.rank)[-8:])))  # fmt: skip
        elif isinstance(msg, StreamAbort):
            self.store.abort(msg.job, msg.rank, msg.step)
            self._acks.pop((msg.job, msg.rank, msg.step), None)
        elif isinstance(msg, PullManifest):
            table, meta, nbytes, _, _ = self._source(msg.job, msg.rank, msg.step)
            self._reply(self._data_out, ident, StreamBegin(
                job=msg.job, rank=msg.rank, step=msg.step, src_node=self.cfg.node, data_bytes=nbytes,
                chunk_bytes=self.pull_chunk_bytes, table=table, meta=meta,
            ))  # fmt: skip
        elif isinstance(msg, PullRequest):
            self._spawn(self._serve_pull(ident, msg), f"pull of {msg.job} rank {msg.rank} step {msg.step}")
        else:
            raise ProtocolError(f"{msg.TYPE} is not a data-plane request")

    def _source(self, job: str, rank: int, step: int) -> tuple[bytes, bytes, int, _Read, StoredSnapshot | SlotState]:
        """A complete copy of ``(job, rank, step)`` held here, buddy store first, else a local slot: its table, meta,
        length, ``read(start, end)``, which returns those bytes (zero-copy where they are contiguous here), and the
        holder to pin while reading (a pinned copy is never dropped or overwritten).

        Raises:
            UnknownSnapshot: neither holds it complete.
        """
        try:
            snap = self.store.get(job, rank, step)

            def read(start: int, end: int) -> memoryview:
                snap.exported = True
                return snap.data.view(start, end)

            return snap.table, snap.meta, snap.data_bytes, read, snap
        except UnknownSnapshot:
            lr = self.ranks.get((job, rank))
            index = lr.find(step) if lr is not None else None
            if lr is None or index is None:
                raise
            s = lr.slots[index]
            slot = lr.arena.slot(index)[: s.data_bytes]
            return s.table, s.meta, s.data_bytes, lambda start, end: slot[start:end], s

    async def _serve_pull(self, ident: bytes, req: PullRequest) -> None:
        try:
            _, _, nbytes, read, holder = self._source(req.job, req.rank, req.step)
        except UnknownSnapshot as exc:  # never held, or dropped since the request came (D moved)
            self.errors += 1
            self._reply(self._data_out, ident, Error(job=req.job, code=ErrorCode.NOT_FOUND, message=str(exc), rank=req.rank,
                                                     step=req.step))  # fmt: skip
            return
        holder.pins += 1
        try:
            chunk = self.pull_chunk_bytes
            for index in range(req.first, min(req.first + req.count, -(-nbytes // chunk))):
                part = read(index * chunk, min((index + 1) * chunk, nbytes))
                await self._data_out.put((ident, Chunk(
                    job=req.job, rank=req.rank, step=req.step, index=index, raw_len=part.nbytes,
                    checksum=codec.checksum(part), payload=part,
                )))  # fmt: skip
                self.bytes_out += part.nbytes
        finally:
            holder.pins -= 1

    async def _replicate(self, task: ReplicateTask) -> None:
        """Pull a copy of a snapshot that lost a replica (coordinator's re-replication) into the buddy store."""
        key = (task.job, task.rank, task.step)
        if key in self._replicating or self.store.holds(*key):
            return  # held, or arriving by a stream right now: a pull would only fight it
        self._replicating.add(key)
        try:
            links = [self.link(a) for a in task.sources if a != self.data_addr]

            def allocate(m: StreamBegin) -> Lander:
                snap = self.store.begin(task.job, task.rank, task.step, src_node=m.src_node, data_bytes=m.data_bytes,
                                        chunk_bytes=m.chunk_bytes, table=m.table, meta=m.meta)  # fmt: skip
                return snap.data.land

            try:
                _, pulled = await pull_snapshot(links, job=task.job, rank=task.rank, step=task.step, allocate=allocate)
            except BaseException:
                self.store.abort(*key)
                raise
            self.store.mark_complete(*key)
            self.bytes_in += pulled
            self.version += 1
            log.info("re-replicated %s rank %d step %d (%d B)", task.job, task.rank, task.step, pulled)
        finally:
            self._replicating.discard(key)

    # ------------------------------------------------------------------------------------ control plane

    def _inventory(self) -> tuple[InventoryItem, ...]:
        items = [InventoryItem(job, rank, step, False) for job, rank, step in self.store.complete_keys()]
        for lr in self.ranks.values():
            items.extend(InventoryItem(lr.job, lr.rank, step, True) for step in lr.valid_steps())
        return tuple(items)

    def _check_ranks(self) -> None:
        for lr in self.ranks.values():
            if lr.alive and not pid_alive(lr.pid):
                lr.alive = False
                self.version += 1
                log.warning("rank %d of job %s (pid %d) died; its last snapshot stays in shared memory",
                            lr.rank, lr.job, lr.pid)  # fmt: skip

    async def _control_loop(self) -> None:
        interval = self.cfg.heartbeat_interval
        registered = False
        sent_version = -1
        while True:
            try:
                if not registered:
                    reply = await self.control.register(RegisterSidecar(
                        node=self.cfg.node, rack=self.cfg.rack, data_addr=self.data_addr, incarnation=self.incarnation,
                    ), timeout=max(1.0, 4 * interval))  # fmt: skip
                    interval = reply.heartbeat_interval
                    registered, sent_version = True, -1
                    log.info("registered with coordinator %s as %s", self.cfg.coordinator, self.cfg.node)
                self._check_ranks()
                self._wake.clear()  # a change from here on wakes the next heartbeat, even one made while this one waits
                version = self.version
                changed = version != sent_version
                hb = Heartbeat(
                    node=self.cfg.node, incarnation=self.incarnation, changed=changed,
                    ranks=tuple(RankInfo(lr.job, lr.rank, lr.world_size, lr.pid, lr.alive) for lr in self.ranks.values())
                    if changed else (),
                    inventory=self._inventory() if changed else (),
                    bytes_out=self.bytes_out, bytes_in=self.bytes_in, stored_bytes=self.store.used_bytes,
                )  # fmt: skip
                hb_reply = await self.control.heartbeat(hb, timeout=max(1.0, 4 * interval))
                if not hb_reply.known:
                    registered = False
                    continue
                sent_version = version
                interval = hb_reply.heartbeat_interval or interval  # the coordinator stretches it as the fleet grows
                self._apply(hb_reply)
            except (CoordinatorUnavailable, ProtocolError) as exc:
                log.debug("control plane: %s", exc)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval):
                    await self._wake.wait()

    def _apply(self, reply: HeartbeatReply) -> None:
        self.assignments = {(a.job, a.rank): a.buddies for a in reply.assignments}
        for lr in self.ranks.values():
            assigned = self.assignments.get((lr.job, lr.rank), ())
            for addr, task in lr.buddy_streams.items():
                if addr not in assigned and not task.done():
                    log.info("%s is no longer a buddy of %s rank %d: its stream stops", addr, lr.job, lr.rank)
                    task.cancel()
        for w in reply.watermarks:
            unusable = frozenset(w.unusable)
            if self.store.drop_unneeded(w.job, w.durable, unusable):
                self.version += 1
            for lr in self.ranks.values():
                if lr.job == w.job and (lr.job_durable, lr.job_unusable) != (w.durable, unusable):
                    before = lr.free_slots()
                    lr.job_durable, lr.job_unusable = w.durable, unusable
                    if lr.free_slots() != before:  # a held copy is no longer needed: the client may have its slot
                        self._send_slots(lr)
        self._acks = {k: v for k, v in self._acks.items() if self.store.holds(*k)}  # streams whose sender vanished
        for task in reply.tasks:
            self._spawn(self._replicate(task), f"re-replication of {task.job} rank {task.rank} step {task.step}")


@dataclasses.dataclass(slots=True)
class _AckBatch:
    """Acknowledgement of one incoming stream: every ``every`` chunks, and always at its ``last`` chunk index."""

    every: int
    last: int
    unacked: int = 0  # chunks received since the last ack


def _keep_malloc_arenas() -> None:
    """Stop glibc from returning chunk-sized buffers to the OS after each message.

    zmq allocates every received 1-4 MiB message; above glibc's default mmap threshold each one is a fresh
    mapping whose pages fault in on first touch (measured: 2.2M faults per GiB received, 11k with this).
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name is None:
        return
    try:
        libc = ctypes.CDLL(name)
        libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        log.debug("mallopt is not available; leaving the allocator alone")


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


async def run_sidecar(
    cfg: SidecarConfig, *, ready: Callable[[str, str], None] | None = None, stop: asyncio.Event | None = None
) -> None:
    """Run one sidecar until stopped (the ``snapshotd serve`` entry point, under ``uvloop.run``)."""
    await Sidecar(cfg).run(ready, stop)
