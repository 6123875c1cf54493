"""The data endpoint's side of the sidecar: what other sidecars send and ask for.

- Incoming streams: a buddy offers a snapshot (StreamBegin: the store reserves its memory, or refuses past the
  memory limit), sends its chunks (each verified and acknowledged, in batches when the sender gave a window),
  or gives it up (StreamAbort).
- Pulls: a restoring or re-replicating peer asks for a complete copy held here (PullManifest, then PullRequests
  for ranges of chunks), from the buddy store or, failing that, a local rank's valid slot. A copy being read is
  pinned: never dropped or overwritten meanwhile.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

from snapshotd import proto
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
    codec,
)

from .local import SlotState
from .node import NodeState
from .outbox import Outbox
from .store import StoredSnapshot, UnknownSnapshot
from .tasks import TaskTree

__all__ = ["ServeService"]

log = logging.getLogger(__name__)

_Read = Callable[[int, int], memoryview]  # read(start, end): bytes of a held copy


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
        pull_chunk_bytes: the chunk size of served pulls (bulk reads: bigger messages cost less per byte).
    """

    def __init__(self, state: NodeState, outbox: Outbox, tasks: TaskTree, pull_chunk_bytes: int) -> None:
        self.state = state
        self.outbox = outbox
        self.tasks = tasks
        self.pull_chunk_bytes = pull_chunk_bytes
        self._acks: dict[tuple[str, int, int], _AckBatch] = {}  # incoming streams whose sender gave a window

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
                msg.job, msg.rank, msg.step, msg.index, codec_name=msg.codec, payload=msg.payload,
                raw_len=msg.raw_len, checksum=msg.checksum, base_step=msg.base_step, elem=msg.elem,
            )  # fmt: skip
            self.state.counters.bytes_in += msg.payload.nbytes
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
            self.outbox.reply(ident, ChunkAck(job=msg.job, rank=msg.rank, step=msg.step, index=msg.index,
                                              complete=done, count=count))  # fmt: skip
        elif isinstance(msg, StreamBegin):
            proto.decode_table(msg.table, msg.data_bytes)
            store.begin(msg.job, msg.rank, msg.step, src_node=msg.src_node, data_bytes=msg.data_bytes,
                        chunk_bytes=msg.chunk_bytes, table=msg.table, meta=msg.meta)  # fmt: skip
            if msg.window >= 4:  # acknowledge every quarter window: fewer messages, the sender never starved
                self._acks[(msg.job, msg.rank, msg.step)] = _AckBatch(every=msg.window // 4, last=msg.nchunks - 1)
            self.outbox.reply(ident, StreamAccept(job=msg.job, rank=msg.rank, step=msg.step,
                                                  bases=tuple(store.steps(msg.job, msg.rank)[-8:])))  # fmt: skip
        elif isinstance(msg, StreamAbort):
            store.abort(msg.job, msg.rank, msg.step)
            self._acks.pop((msg.job, msg.rank, msg.step), None)
        elif isinstance(msg, PullManifest):
            table, meta, nbytes, _, _ = self._source(msg.job, msg.rank, msg.step)
            self.outbox.reply(ident, StreamBegin(
                job=msg.job, rank=msg.rank, step=msg.step, src_node=self.state.node, data_bytes=nbytes,
                chunk_bytes=self.pull_chunk_bytes, table=table, meta=meta,
            ))  # fmt: skip
        elif isinstance(msg, PullRequest):
            self.tasks.spawn(self._serve_pull(ident, msg), f"pull of {msg.job} rank {msg.rank} step {msg.step}")
        else:
            raise ProtocolError(f"{msg.TYPE} is not a data-plane request")

    def forget_vanished_streams(self) -> None:
        """Drop the acknowledgement state of incoming streams the store no longer holds (their sender vanished)."""
        self._acks = {k: v for k, v in self._acks.items() if self.state.store.holds(*k)}

    def _source(self, job: str, rank: int, step: int) -> tuple[bytes, bytes, int, _Read, StoredSnapshot | SlotState]:
        """A complete copy of ``(job, rank, step)`` held here, buddy store first, else a local slot: its table, meta,
        length, ``read(start, end)``, which returns those bytes (zero-copy where they are contiguous here), and the
        holder to pin while reading (a pinned copy is never dropped or overwritten).

        Raises:
            UnknownSnapshot: neither holds it complete.
        """
        try:
            snap = self.state.store.get(job, rank, step)

            def read(start: int, end: int) -> memoryview:
                snap.exported = True
                return snap.data.view(start, end)

            return snap.table, snap.meta, snap.data_bytes, read, snap
        except UnknownSnapshot:
            lr = self.state.rank(job, rank)
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
            self.state.counters.errors += 1
            self.outbox.reply(ident, Error(job=req.job, code=ErrorCode.NOT_FOUND, message=str(exc), rank=req.rank,
                                           step=req.step))  # fmt: skip
            return
        holder.pins += 1
        try:
            chunk = self.pull_chunk_bytes
            for index in range(req.first, min(req.first + req.count, -(-nbytes // chunk))):
                part = read(index * chunk, min((index + 1) * chunk, nbytes))
                await self.outbox.put(ident, Chunk(
                    job=req.job, rank=req.rank, step=req.step, index=index, raw_len=part.nbytes,
                    checksum=codec.checksum(part), payload=part,
                ))  # fmt: skip
                self.state.counters.bytes_out += part.nbytes
        finally:
            holder.pins -= 1
