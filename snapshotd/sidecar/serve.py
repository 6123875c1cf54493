"""The data endpoint's side of the sidecar: what other sidecars send and ask for.

- Incoming streams: a buddy offers a snapshot (StreamBegin: the store reserves its memory, or refuses past the
  memory limit), sends its chunks (each verified and acknowledged, in batches when the sender gave a window),
  or gives it up (StreamAbort).
- Pulls: a restoring or re-replicating peer asks for a complete copy held here (PullManifest, then PullRequests
  for ranges of chunks), from the buddy store or, failing that, a local rank's valid slot. A copy being read is
  pinned: never dropped or overwritten meanwhile. Chunks are the copy's seal's blocks, each checked against the
  checksum the seal carries before it goes out, and sent with that checksum, never one taken now of bytes that
  may have changed at rest. A copy that fails its check is dropped at once and the request is answered
  ``corrupt``: the puller takes those chunks from another holder.
- Tickets: a restoring sidecar asks (TicketRequest) for a copy held here to be served to its rank over this
  sidecar's bulk port (:mod:`.bulk`); answered with a Ticket, or ``unexpected`` where no bulk port is served.
"""

from __future__ import annotations

import dataclasses
import logging

from snapshotd import proto
from snapshotd.logs import fields
from snapshotd.proto import (
    Chunk,
    ChunkAck,
    Error,
    ErrorCode,
    Message,
    ProtocolError,
    PullManifest,
    PullRequest,
    StreamAbort,
    StreamAccept,
    StreamBegin,
    Ticket,
    TicketRequest,
)
from snapshotd.transport import TransportError

from .bulk import BulkServer, HeldCopy, Push
from .integrity import CorruptCopy
from .node import NodeState
from .outbox import Outbox
from .store import StoredSnapshot, UnknownSnapshot
from .tasks import TaskTree

__all__ = ["ServeService"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True)
class _AckBatch:
    """Acknowledgement of one incoming stream: every ``every`` chunks, and always at its ``last`` chunk index."""

    every: int
    last: int
    unacked: int = 0  # chunks received since the last ack


class ServeService:
    """Handles the data-plane requests of other sidecars (see the module docstring).

    Args:
        state: the node's state.
        outbox: the data endpoint's replies.
        tasks: the sidecar's task tree (a pull is served as its own task).
        bulk: the bulk port that tickets admit to (None: none is served).
    """

    def __init__(
        self, state: NodeState, outbox: Outbox, tasks: TaskTree, bulk: BulkServer | None = None
    ) -> None:
        self.state = state
        self.outbox = outbox
        self.tasks = tasks
        self.bulk = bulk
        self._acks: dict[tuple[str, int, int], _AckBatch] = {}  # incoming streams whose sender gave a window
        # incoming streams pushed over the bulk port: tokens
        self._pushes: dict[tuple[str, int, int], bytes] = {}
        self._tables = proto.CheckedTables()  # a rank's streams bring the same table, step after step

    def handle(self, ident: bytes, msg: Message) -> None:
        """Act on one request from the peer at ``ident``.

        Raises:
            ProtocolError: not a data-plane request, or a malformed one (a bad table, a chunk out of range).
            UnknownSnapshot: a pull or chunk of a snapshot not held here.
            MemoryLimitReached: a stream that does not fit under the memory limit.
        """
        store = self.state.store
        if isinstance(msg, Chunk):
            done = store.put_chunk(
                msg.job,
                msg.rank,
                msg.step,
                msg.index,
                codec_name=msg.codec,
                payload=msg.payload,
                raw_len=msg.raw_len,
                checksum=msg.checksum,
                base_step=msg.base_step,
                elem=msg.elem,
            )
            arriving = store.get(msg.job, msg.rank, msg.step, complete=False)
            self.state.counters.received(arriving.src_node, msg.payload.nbytes)
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
            complete = done or arriving.complete  # held already
            self.outbox.reply(
                ident,
                ChunkAck(
                    job=msg.job, rank=msg.rank, step=msg.step, index=msg.index, complete=complete, count=count
                ),
            )
        elif isinstance(msg, StreamBegin):
            self._tables.check(msg.table, msg.data_bytes)
            key = (msg.job, msg.rank, msg.step)
            # told twice of one stream: what arrived stays, and so does its ack count
            again = self._arriving(msg)
            if not again:
                self._end_push(key)  # a new stream of the step replaces the one arriving
            snap = store.begin(
                msg.job,
                msg.rank,
                msg.step,
                src_node=msg.src_node,
                data_bytes=msg.data_bytes,
                chunk_bytes=msg.chunk_bytes,
                table=msg.table,
                meta=msg.meta,
                digest=msg.digest,
                stream=msg.stream,
            )
            token = self._pushes.get(key, b"")
            if msg.upload and self.bulk is not None and not snap.complete and not token:
                token = self._expect_push(ident, snap)
            # acknowledge every quarter window: fewer messages
            if msg.window >= 4 and not again and not token:
                self._acks[key] = _AckBatch(every=msg.window // 4, last=msg.nchunks - 1)
            self.outbox.reply(
                ident,
                StreamAccept(
                    job=msg.job,
                    rank=msg.rank,
                    step=msg.step,
                    bases=tuple(store.steps(msg.job, msg.rank)[-8:]),
                    upload_port=self.bulk.port if token and self.bulk is not None else 0,
                    upload_token=token,
                ),
            )
        elif isinstance(msg, StreamAbort):
            store.abort(msg.job, msg.rank, msg.step)
            self._acks.pop((msg.job, msg.rank, msg.step), None)
            self._end_push((msg.job, msg.rank, msg.step))
        elif isinstance(msg, PullManifest):
            held = self._source(msg.job, msg.rank, msg.step)
            try:
                held.seal.check_blobs(held.table, held.meta, self._what(msg.job, msg.rank, msg.step))
            except CorruptCopy as exc:
                self._corrupt(ident, msg.job, msg.rank, msg.step, held, exc)
                return
            self.outbox.reply(
                ident,
                StreamBegin(
                    job=msg.job,
                    rank=msg.rank,
                    step=msg.step,
                    src_node=self.state.node,
                    data_bytes=held.nbytes,
                    chunk_bytes=held.seal.block_bytes,
                    digest=held.seal.digest,
                    table=held.table,
                    meta=held.meta,
                ),
            )
        elif isinstance(msg, PullRequest):
            self.tasks.spawn(
                self._serve_pull(ident, msg), f"pull of {msg.job} rank {msg.rank} step {msg.step}"
            )
        elif isinstance(msg, TicketRequest):
            self._ticket(ident, msg)
        else:
            raise ProtocolError(f"{msg.TYPE} is not a data-plane request")

    def _arriving(self, begin: StreamBegin) -> bool:
        """Whether ``begin``'s stream is the one already arriving here."""
        try:
            held = self.state.store.get(begin.job, begin.rank, begin.step, complete=False)
        except UnknownSnapshot:
            return False
        return begin.stream != 0 and held.stream == begin.stream and not held.complete

    def forget_vanished_streams(self) -> None:
        """Drop the acknowledgement state and pushes of incoming streams the store no longer holds (their sender
        vanished)."""
        self._acks = {k: v for k, v in self._acks.items() if self.state.store.holds(*k)}
        for key in [k for k in self._pushes if not self.state.store.holds(*k)]:
            self._end_push(key)

    def _expect_push(self, ident: bytes, snap: StoredSnapshot) -> bytes:
        """Have the bulk port take ``snap``'s chunks pushed by the sender at ``ident``; the push's token."""
        assert self.bulk is not None
        key = (snap.job, snap.rank, snap.step)
        what = f"job {snap.job!r} rank {snap.rank} step {snap.step}"
        buffers = self.state.store.prepare_push(*key)

        def landed(chunks: list[tuple[int, int]]) -> None:
            for index, checksum in chunks:
                if self._pushes.get(key) != token:  # ended meanwhile (aborted, replaced)
                    return
                try:
                    done = self.state.store.landed(*key, index, checksum)
                except UnknownSnapshot:
                    self._end_push(key)
                    return
                self.state.counters.received(snap.src_node, buffers[index].nbytes)
                if done:
                    self._end_push(key)
                    self.state.counters.pushes_in += 1
                    self.outbox.reply(
                        ident,
                        ChunkAck(job=snap.job, rank=snap.rank, step=snap.step, index=index, complete=True),
                    )

        def failed(why: str) -> None:
            if self._pushes.get(key) != token:
                return
            self._end_push(key)
            self.state.counters.errors += 1
            log.warning(
                "push of %s failed: %s",
                what,
                why,
                extra=fields(snap.job, snap.rank, snap.step, "push_failed"),
            )
            self.outbox.reply(
                ident,
                Error(job=snap.job, code=ErrorCode.BAD_CHUNK, message=why, rank=snap.rank, step=snap.step),
            )

        token = self.bulk.expect(Push(what, buffers, landed, failed))
        self._pushes[key] = token
        return token

    def _end_push(self, key: tuple[str, int, int]) -> None:
        token = self._pushes.pop(key, None)
        if token is not None and self.bulk is not None:
            self.bulk.end(token)

    def _source(self, job: str, rank: int, step: int) -> HeldCopy:
        """A complete copy of ``(job, rank, step)`` held here: the buddy store's, else a local rank's valid slot.

        Raises:
            UnknownSnapshot: neither holds it complete.
        """
        store = self.state.store
        try:
            snap = store.get(job, rank, step)

            def read(start: int, end: int) -> memoryview:
                snap.exported = True
                return snap.data.view(start, end)

            return HeldCopy(
                snap.table, snap.meta, snap.data_bytes, snap.seal, read, snap, lambda: store.discard(snap)
            )
        except UnknownSnapshot:
            lr = self.state.rank(job, rank)
            index = lr.find(step) if lr is not None else None
            if lr is None or index is None:
                raise
            s = lr.slots[index]
            assert s.seal is not None  # every valid slot has one
            slot = lr.arena.slot(index)[: s.data_bytes]

            def drop() -> None:
                if lr.slots[index] is s:
                    lr.invalidate(index)

            return HeldCopy(
                s.table, s.meta, s.data_bytes, s.seal, lambda start, end: slot[start:end], s, drop
            )

    @staticmethod
    def _what(job: str, rank: int, step: int) -> str:
        return f"the copy of job {job!r} rank {rank} step {step} held here"

    def _ticket(self, ident: bytes, req: TicketRequest) -> None:
        if self.bulk is None:
            self.outbox.reply(
                ident,
                Error(
                    job=req.job,
                    code=ErrorCode.UNEXPECTED,
                    rank=req.rank,
                    step=req.step,
                    message="this sidecar serves no bulk port",
                ),
            )
            return
        held = self._source(req.job, req.rank, req.step)
        token = self.bulk.grant(
            held,
            self._what(req.job, req.rank, req.step),
            lambda exc: self._dropped(req.job, req.rank, req.step, held, exc),
        )
        if token is None:
            self.outbox.reply(
                ident,
                Error(
                    job=req.job,
                    code=ErrorCode.BUSY,
                    rank=req.rank,
                    step=req.step,
                    message="too many bulk tickets outstanding here",
                ),
            )
            return
        self.outbox.reply(
            ident,
            Ticket(
                job=req.job,
                rank=req.rank,
                step=req.step,
                port=self.bulk.port,
                expires_s=self.bulk.ticket_ttl,
                token=token,
            ),
        )

    def _dropped(self, job: str, rank: int, step: int, held: HeldCopy, exc: CorruptCopy) -> None:
        """``held`` failed its check: drop it and count it."""
        held.drop()
        self.state.counters.corrupt += 1
        log.error("%s; the copy is dropped", exc, extra=fields(job, rank, step, "copy_corrupt"))

    def _corrupt(
        self, ident: bytes, job: str, rank: int, step: int, held: HeldCopy, exc: CorruptCopy
    ) -> None:
        """``held`` failed its check: drop it, count it, and answer the request ``corrupt``."""
        self._dropped(job, rank, step, held, exc)
        self.outbox.reply(
            ident,
            Error(
                job=job, code=ErrorCode.CORRUPT, message=f"{exc}; the copy is dropped", rank=rank, step=step
            ),
        )

    async def _serve_pull(self, ident: bytes, req: PullRequest) -> None:
        try:
            held = self._source(req.job, req.rank, req.step)
        except UnknownSnapshot as exc:  # never held, or dropped since the request came (D moved)
            self.state.counters.errors += 1
            self.outbox.reply(
                ident,
                Error(job=req.job, code=ErrorCode.NOT_FOUND, message=str(exc), rank=req.rank, step=req.step),
            )
            return
        what = self._what(req.job, req.rank, req.step)
        held.holder.pins += 1
        try:
            block = held.seal.block_bytes
            for index in range(req.first, min(req.first + req.count, -(-held.nbytes // block))):
                part = held.read(index * block, min((index + 1) * block, held.nbytes))
                try:
                    checksum = held.seal.check_block(index, part, what)
                except CorruptCopy as exc:
                    self._corrupt(ident, req.job, req.rank, req.step, held, exc)
                    return
                await self.outbox.put(
                    ident,
                    Chunk(
                        job=req.job,
                        rank=req.rank,
                        step=req.step,
                        index=index,
                        raw_len=part.nbytes,
                        checksum=checksum,
                        payload=part,
                    ),
                )
                self.state.counters.served(part.nbytes)
        except TransportError as exc:  # the puller stopped taking chunks: it asks another holder
            log.info("stopped serving a pull of %s: %s", what, exc)
        finally:
            held.holder.pins -= 1
