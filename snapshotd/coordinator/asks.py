"""Seat requests and drains held unanswered (long-polling) while their answer would only say "not yet".

A :class:`~snapshotd.proto.SeatRequest` answered ``wait`` (every seat of the job is held by a live node) and a
:class:`~snapshotd.proto.Drain` whose node still holds snapshots to place elsewhere are held, as plan requests
are (:mod:`.held`): answered, the sidecar would ask again and again, and learn that a seat came free, or that its
copies landed, only at its next ask. At each expiry pass (every tenth of a second at most) the server asks the
state again for every held one and answers it as soon as its answer changes, or with the answer of the moment
once it was held for ``hold`` seconds, or for less than the ask's own ``timeout_s`` by :data:`ANSWER_MARGIN_S`,
whichever is shorter, so that its sidecar knows the coordinator is there and asks again. Each ask comes on a
socket of its own (its envelope differs), so asks never replace one another; beyond :data:`MAX_ASKS` held, an
ask is answered at once. An ask the state refuses when asked again (``ValueError``) is answered with that error
and dropped, as :meth:`~snapshotd.coordinator.loop.Server.handle` answers one refused when it arrives.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TypeAlias

from snapshotd.proto import Drain, DrainReply, Error, ErrorCode, Message, SeatReply, SeatRequest
from snapshotd.proto.limits import clip_text

from .state import CoordinatorState

__all__ = ["ANSWER_MARGIN_S", "MAX_ASKS", "HeldAsks"]

MAX_ASKS = 4096
"""Asks held at most; beyond, an ask is answered at once."""
ANSWER_MARGIN_S = 0.25
"""A held ask is answered this long before its asker stops waiting (its ``timeout_s``) at the latest."""

Ask: TypeAlias = SeatRequest | Drain


@dataclasses.dataclass(slots=True, eq=False)
class _Held:
    envelope: list[bytes]
    msg: Ask
    deadline: float


class HeldAsks:
    """The seat requests and drains held (see the module docstring).

    Args:
        state: the coordinator's state, which answers them.
        hold: the longest an ask is held, seconds (0: none is).
    """

    def __init__(self, state: CoordinatorState, hold: float) -> None:
        self.state = state
        self.hold = hold
        self._held: dict[tuple[bytes, ...], _Held] = {}
        self._first_deadline = math.inf  # no held ask's hold ends before this

    def __len__(self) -> int:
        return len(self._held)

    def answer(self, envelope: list[bytes], msg: Ask, now: float) -> Message | None:
        """The answer to send ``msg`` now, or None when it is held."""
        reply = self._ask(msg, now)
        if not _waits(reply) or self.hold <= 0 or len(self._held) >= MAX_ASKS:
            return reply
        hold = self.hold
        if msg.timeout_s > 0:
            hold = min(hold, msg.timeout_s - ANSWER_MARGIN_S)
            if hold <= 0:
                return reply
        key = (*envelope, msg.TYPE.encode(), msg.job.encode(), msg.node.encode())
        self._held[key] = _Held(envelope, msg, now + hold)
        self._first_deadline = min(self._first_deadline, now + hold)
        return None

    def due(
        self, now: float, *, final: bool = False, expired_only: bool = False
    ) -> list[tuple[list[bytes], Message]]:
        """The held asks to answer now, with their answers: those whose answer changed, those whose hold is over,
        and with ``final`` (the coordinator stops) all of them. With ``expired_only``, only those whose hold is
        over: O(1) while none is, so cheap enough for every pass of a busy loop."""
        out: list[tuple[list[bytes], Message]] = []
        if expired_only and not final and now < self._first_deadline:
            return out  # O(1) on a busy pass while no hold is over
        for key, held in list(self._held.items()):
            if expired_only and not final and now < held.deadline:
                continue
            try:
                reply = self._ask(held.msg, now)
            except ValueError as exc:  # the state changed under it (a job's size): refused as on arrival
                del self._held[key]
                out.append((held.envelope, _refused(held.msg, exc)))
                continue
            if final or not _waits(reply) or now >= held.deadline:
                del self._held[key]
                out.append((held.envelope, reply))
        self._first_deadline = min((h.deadline for h in self._held.values()), default=math.inf)
        return out

    def _ask(self, msg: Ask, now: float) -> Message:
        if isinstance(msg, SeatRequest):
            return self.state.seats.ask(msg, now)
        return self.state.drain(msg)


def _refused(msg: Ask, exc: ValueError) -> Error:
    """The error a refused ``msg`` is answered with."""
    request_id = msg.request_id if isinstance(msg, SeatRequest) else 0
    return Error(
        job=msg.job,
        code=ErrorCode.BAD_MESSAGE,
        message=clip_text(str(exc)),
        request_id=request_id,
    )


def _waits(reply: Message) -> bool:
    """Whether ``reply`` only says "not yet"."""
    if isinstance(reply, SeatReply):
        return reply.status == "wait"
    return isinstance(reply, DrainReply) and reply.remaining > 0
