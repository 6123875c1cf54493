"""What the sidecar's outgoing streams have sent each buddy and not yet seen acknowledged.

A stream (:func:`~.transfer.send_snapshot`) sends chunks under credit-based flow control, and the buddy
acknowledges them every few chunks; a pushed stream (:mod:`.push`) is acknowledged once, when the buddy holds the
snapshot complete. Each stream keeps a :class:`Flight` of its unacknowledged chunks while it runs; :class:`InFlight`
sums them per buddy for the metrics: the bytes in flight, and how long the oldest of them has waited for its
acknowledgement (a buddy or a link that stopped taking them shows a wait that grows).

It belongs to the sidecar's event loop: not thread-safe.
"""

from __future__ import annotations

import collections
import contextlib
import time
from collections.abc import Callable, Iterator

__all__ = ["Flight", "InFlight"]


class Flight:
    """The chunks of one stream sent and not yet acknowledged, oldest first.

    Args:
        clock: monotonic seconds.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic, data_bytes: int = 0) -> None:
        self._clock = clock
        self._chunks: collections.deque[tuple[int, float]] = collections.deque()  # (bytes, when sent)
        self.bytes = 0
        """Bytes of the chunks sent and not yet acknowledged (as they went on the wire)."""
        self.data_bytes = data_bytes
        """The bytes of the snapshot the stream sends (0: not known)."""
        self.data_sent = 0
        """Bytes of the snapshot sent so far, acknowledged or not, as they were before any compression."""

    def sent(self, nbytes: int, data_bytes: int | None = None) -> None:
        """One chunk of ``nbytes`` on the wire went out, carrying ``data_bytes`` of the snapshot (``nbytes`` if
        not given: a raw chunk)."""
        self._chunks.append((nbytes, self._clock()))
        self.bytes += nbytes
        self.data_sent += nbytes if data_bytes is None else data_bytes

    def acked(self, count: int) -> None:
        """The buddy acknowledged the ``count`` oldest chunks in flight (all of them, if fewer)."""
        for _ in range(min(count, len(self._chunks))):
            self.bytes -= self._chunks.popleft()[0]

    def oldest(self) -> float | None:
        """When the oldest chunk in flight was sent (None: none is)."""
        return self._chunks[0][1] if self._chunks else None


class InFlight:
    """The streams under way to each buddy (see the module docstring).

    A buddy streamed to once stays listed, with nothing in flight when no stream to it runs, as its byte counters
    do.

    Args:
        clock: monotonic seconds, for the flights and the waits.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._peers: dict[str, list[Flight]] = {}

    @contextlib.contextmanager
    def stream(self, addr: str, data_bytes: int = 0) -> Iterator[Flight]:
        """The flight of one stream of a snapshot of ``data_bytes`` to ``addr``, counted while the block runs."""
        flight = Flight(self._clock, data_bytes)
        flights = self._peers.setdefault(addr, [])
        flights.append(flight)
        try:
            yield flight
        finally:
            flights.remove(flight)

    def by_peer(self) -> list[tuple[str, int, float]]:
        """``(addr, bytes in flight, seconds the oldest chunk in flight has waited)`` per buddy, sorted by address;
        the wait is 0 when nothing is in flight to it."""
        now = self._clock()
        out = []
        for addr, flights in sorted(self._peers.items()):
            sent = [t for f in flights if (t := f.oldest()) is not None]
            out.append((addr, sum(f.bytes for f in flights), now - min(sent) if sent else 0.0))
        return out
