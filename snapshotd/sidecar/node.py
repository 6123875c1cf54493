"""One sidecar's state, and the signals that tell its services when it changed.

:class:`NodeState` holds what the node knows: its local ranks (:class:`~.local.LocalRank`, with their arenas
and slots), the copies it keeps for other nodes (:class:`~.store.SnapshotStore`), the buddies the coordinator
assigned to its ranks, and its counters. The services read it freely. What they change goes through its methods
or through the rank and store objects it owns, which report their changes to it, so that:

- :attr:`NodeState.changed` fires whenever what the coordinator must hear of changes (the ranks, their liveness,
  the complete copies held here, the broken paths to peers): the heartbeat goes out at once rather than at its
  next tick;
- :attr:`NodeState.assigned` fires whenever the buddy assignments change: a stream waiting for its rank's
  buddies starts at once.

It belongs to the sidecar's event loop: not thread-safe.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import uuid
from collections.abc import Callable, Iterator

from snapshotd.proto import HeldSeat, InventoryItem, RankInfo
from snapshotd.tally import Tally

from .config import SidecarConfig
from .inflight import InFlight
from .local import LocalRank
from .paths import PeerPaths
from .store import BuddyStore, SnapshotStore

__all__ = ["Counters", "NodeState", "RankKey", "Signal"]

RankKey = tuple[str, int]


class Signal:
    """A broadcast wake-up: each :meth:`fire` sets the event of every current subscriber.

    A subscriber clears its event before it looks at the state, so that a change made while it works wakes it
    again: nothing fired between two looks is lost.
    """

    def __init__(self) -> None:
        self._events: set[asyncio.Event] = set()

    def fire(self) -> None:
        for event in self._events:
            event.set()

    @contextlib.contextmanager
    def subscribe(self) -> Iterator[asyncio.Event]:
        """An event set at every fire while the block runs (it starts cleared)."""
        event = asyncio.Event()
        self._events.add(event)
        try:
            yield event
        finally:
            self._events.discard(event)

    async def wait_until(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """Wait until ``predicate()`` holds, looking again at each fire; False if ``timeout`` seconds passed."""
        with self.subscribe() as event:
            try:
                async with asyncio.timeout(timeout):
                    while not predicate():
                        await event.wait()
                        event.clear()
            except TimeoutError:
                return predicate()
        return True


@dataclasses.dataclass(slots=True)
class Counters:
    """What the sidecar did, for heartbeats and status."""

    bytes_out: int = 0
    """Snapshot bytes sent to other sidecars (streams and pulls served), as they went on the wire."""
    bytes_in: int = 0
    """Snapshot bytes received from other sidecars."""
    errors: int = 0
    """Requests refused or failed, and handler failures."""
    corrupt: int = 0
    """Copies held here (buddy copies and the ranks' own slots) that failed their end-to-end check and were
    dropped."""
    sent_to: dict[str, int] = dataclasses.field(default_factory=dict)
    """Stream bytes sent, as they went on the wire, by buddy data address."""
    received_from: dict[str, int] = dataclasses.field(default_factory=dict)
    """Stream bytes received, as they came on the wire, by the sending node's name."""
    pull_bytes_in: int = 0
    """Bytes pulled from holders (restores and re-replication)."""
    pull_bytes_out: int = 0
    """Bytes served to pullers."""
    chunks_sent: dict[str, int] = dataclasses.field(default_factory=dict)
    """Stream chunks sent, by codec."""
    pushes_in: int = 0
    """Buddy copies that arrived complete pushed over this sidecar's bulk port (not as data-plane messages)."""
    heartbeat_rtt: Tally = dataclasses.field(default_factory=Tally)
    """Heartbeat round trips to the coordinator, in seconds."""
    restores: dict[str, Tally] = dataclasses.field(default_factory=dict)
    """Restores served, by source (``fresh``, ``local``, ``replica``, ``pull``): their seconds."""
    restore_bytes: dict[str, int] = dataclasses.field(default_factory=dict)
    """Bytes the restores brought here over the network, by source."""

    def streamed(self, buddy: str, wire_bytes: int, chunks: int, delta_chunks: int) -> None:
        """Count one stream a buddy took whole."""
        self.bytes_out += wire_bytes
        self.sent_to[buddy] = self.sent_to.get(buddy, 0) + wire_bytes
        self.chunks_sent["raw"] = self.chunks_sent.get("raw", 0) + chunks - delta_chunks
        self.chunks_sent["delta-lz4"] = self.chunks_sent.get("delta-lz4", 0) + delta_chunks

    def received(self, source_node: str, wire_bytes: int) -> None:
        """Count one stream chunk that arrived from ``source_node``."""
        self.bytes_in += wire_bytes
        self.received_from[source_node] = self.received_from.get(source_node, 0) + wire_bytes

    def pulled(self, nbytes: int) -> None:
        self.bytes_in += nbytes
        self.pull_bytes_in += nbytes

    def served(self, nbytes: int) -> None:
        self.bytes_out += nbytes
        self.pull_bytes_out += nbytes

    def restored(self, source: str, seconds: float, nbytes: int) -> None:
        """Count one restore served from ``source`` in ``seconds``, ``nbytes`` of it over the network."""
        self.restores.setdefault(source, Tally()).add(seconds)
        self.restore_bytes[source] = self.restore_bytes.get(source, 0) + nbytes


class NodeState:
    """What one sidecar knows (see the module docstring).

    Args:
        cfg: the sidecar's configuration (its node name and memory limit are used here).
    """

    def __init__(self, cfg: SidecarConfig) -> None:
        self.node = cfg.node
        self.incarnation = uuid.uuid4().hex[:16]
        """Tells the coordinator a restarted sidecar from the one it knew under the same node name."""
        self.data_addr = ""
        """The data-plane address other sidecars reach this one at (set once bound)."""
        self.seats: dict[str, HeldSeat] = {}
        """Per job, the seat the coordinator gave this node (see :class:`~snapshotd.proto.SeatRequest`); heartbeats
        that report the ranks tell them too."""
        self.changed = Signal()
        self.assigned = Signal()
        self.store: BuddyStore = SnapshotStore(
            cfg.memory_limit, on_change=self.changed.fire, idle_after=2 * cfg.request_timeout
        )
        self.ranks: dict[RankKey, LocalRank] = {}
        self.assignments: dict[RankKey, tuple[str, ...]] = {}
        self.counters = Counters()
        self.paths = PeerPaths(cfg.node, cfg.request_timeout, self.changed.fire)
        """The paths to the other sidecars: which are broken (heartbeats tell the coordinator)."""
        self.in_flight = InFlight()
        """Per buddy, the stream bytes sent to it and not yet acknowledged."""

    def rank(self, job: str, rank: int) -> LocalRank | None:
        return self.ranks.get((job, rank))

    def add_rank(self, lr: LocalRank) -> None:
        """Take ``lr`` in (replacing none: drop an older one of the same key first)."""
        lr.on_change = self.changed.fire
        self.ranks[(lr.job, lr.rank)] = lr
        self.changed.fire()

    def drop_rank(self, lr: LocalRank) -> None:
        """Forget ``lr``: stop its stream and remove its arena (its shared memory is gone with it)."""
        if lr.stream_task is not None:
            lr.stream_task.cancel()
        lr.arena.close(unlink=True)
        if self.ranks.get((lr.job, lr.rank)) is lr:
            del self.ranks[(lr.job, lr.rank)]
        self.changed.fire()

    def set_assignments(self, assignments: dict[RankKey, tuple[str, ...]]) -> None:
        if assignments != self.assignments:
            self.assignments = assignments
            self.assigned.fire()

    async def buddies(self, job: str, rank: int, timeout: float) -> tuple[str, ...]:
        """The other sidecars ``(job, rank)`` streams to, waiting up to ``timeout`` seconds for the coordinator to
        assign some (a rank that just registered gets them with the next heartbeat reply); empty if none came."""
        key = (job, rank)
        await self.assigned.wait_until(lambda: bool(self.assignments.get(key)), timeout)
        return tuple(a for a in self.assignments.get(key, ()) if a != self.data_addr)

    def report(self) -> tuple[tuple[RankInfo, ...], tuple[InventoryItem, ...]]:
        """What a heartbeat tells the coordinator: the local ranks, and every complete copy held here (buddy
        copies and the ranks' own valid slots)."""
        ranks = tuple(
            RankInfo(lr.job, lr.rank, lr.world_size, lr.pid, lr.alive) for lr in self.ranks.values()
        )
        items = [InventoryItem(job, rank, step, False) for job, rank, step in self.store.complete_keys()]
        for lr in self.ranks.values():
            items.extend(InventoryItem(lr.job, lr.rank, step, True) for step in lr.valid_steps())
        return ranks, tuple(items)
