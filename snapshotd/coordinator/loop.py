"""The coordinator's request loop (:class:`Server`): one ROUTER socket in front of :class:`~.state.CoordinatorState`.

This module does socket I/O and the expiry timer; every decision lives in the state. Requests are handled in
batches: each wake-up of the loop drains the socket without blocking (up to ``_BATCH`` messages), answers each
one at once, then yields, so the ZAP handler runs between batches and a plan request waits behind at most one
small batch of heartbeats. Peers are DEALER sockets; a REQ peer (an empty delimiter frame before the message)
is answered with the same envelope.

Plan requests that must wait are held (long-polling, see :mod:`.held`, which says how they are drafted and
answered when their round freezes); woken ones are answered for up to ``_HELD_SLICE_S`` at a time between
batches of new requests, so that a whole fleet getting its plans at once does not stop heartbeats. Seat
requests and drains are held too (:mod:`.asks`).

Status documents are built in parts (:mod:`.status`), for up to ``_STATUS_SLICE_S`` per pass of the loop.

Failure detection runs in the same loop: the probes of nodes suspected dead (:mod:`.probes`) at every pass,
and expiry only once the loop has caught up: after a batch that emptied the socket, never after a full one. A
loop that is behind still has heartbeats queued, and a node whose heartbeat waits in the queue is not silent:
expiring it against the time the loop got to it would declare live nodes dead exactly when the coordinator is
busiest, and their re-registrations would make it busier still.

Nothing a peer sends can crash or wedge the loop: undecodable frames get an ``Error`` with code
``bad_message``, a well-formed request that makes no sense (a rank outside its world size) the same, a message
the coordinator does not serve ``unexpected``, an ``Error`` sent to us is counted and dropped, and a bug while
handling one request answers ``internal`` and the loop goes on (see :class:`~snapshotd.proto.ErrorCode`); an
error answering a plan request names the request's rank outside its world size (else its first rank), so that
a sidecar asking for several ranks at once knows which one was refused. Each problem is logged at most once
per peer per minute.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import time
from typing import Any

from snapshotd.proto import (
    Drain,
    Error,
    ErrorCode,
    Heartbeat,
    HeartbeatReply,
    HoldersQuery,
    MemberQuery,
    Message,
    PeerLostReport,
    PlanRequest,
    ProtocolError,
    RegisterSidecar,
    SeatRequest,
    StatusRequest,
    decode,
    encode,
)
from snapshotd.proto.limits import clip_text
from snapshotd.transport import Pipe, TransportError

from .asks import HeldAsks
from .gc_policy import GcPolicy
from .held import MAX_HELD, Held, HeldPlans
from .holders import holders
from .plans import PlanAnswer
from .probes import Prober
from .replies import HeartbeatReplies, PlanReplies
from .state import CoordinatorState
from .status import StatusBuilds

__all__ = ["Server"]

log = logging.getLogger(__name__)

_BATCH = 256
"""Requests handled per wake-up before the loop gets a turn (a plan request waits behind at most this many)."""
_HELD_SLICE_S = 0.02
"""Seconds spent answering woken held plan requests before new requests get a turn."""
_REANSWER_BATCH = 64
"""Woken held requests without a draft that holds, asked again of the state and encoded together."""
_STATUS_SLICE_S = 0.005
"""Seconds spent building status documents per pass of the loop."""
_IDLE_POLL_S = 0.1
"""How long an idle socket wait lasts before ``stop`` is checked again."""
_COMPLAIN_EVERY_S = 60.0


class Server:
    def __init__(self, pipe: Pipe, state: CoordinatorState, held: HeldPlans) -> None:
        self.pipe = pipe
        self.state = state
        self.held = held
        self._complaints: dict[Any, float] = {}
        self.replies = HeartbeatReplies()
        self.plan_replies = PlanReplies()
        self.undrafted: collections.deque[Held] = collections.deque(maxlen=MAX_HELD)  # to draft when idle
        self.statuses = StatusBuilds()
        self._rebuilding = True
        self.prober = Prober(state, held.wake_all, clock=time.monotonic)
        self.asks = HeldAsks(state, state.cfg.plan_hold)

    async def serve(self, stop: asyncio.Event, expire_every: float) -> None:
        """Answer requests in batches until ``stop``; then answer what already arrived and return.

        Expiry runs every ``expire_every`` seconds, but only after a batch that emptied the socket (see the
        module docstring), and with it the garbage-collection policy's tick (see :mod:`.gc_policy`).
        """
        gc_policy = GcPolicy(time.monotonic() + expire_every)
        try:
            async with self.prober:
                await self._passes(stop, expire_every, gc_policy)
        finally:
            gc_policy.close()
        self.handle_batch()
        self.build_statuses(math.inf)
        now = time.monotonic()
        # their sidecars ask the next coordinator at once
        self.reanswer(self.held.take_all(), now, final=True)
        self.answer_asks(now, final=True)

    def answer_asks(self, now: float, *, final: bool = False, expired_only: bool = False) -> None:
        """Answer the held seat requests and drains whose answer changed or whose hold is over (see
        :mod:`.asks`); with ``expired_only``, those whose hold is over; with ``final``, every one."""
        if not self.asks:
            return
        try:
            for envelope, reply in self.asks.due(now, final=final, expired_only=expired_only):
                self.send(envelope, reply)
        except Exception:  # a bug must not stop the loop: the sidecars ask again
            self.complain("asks", "answering held asks failed", exc_info=True)

    async def _passes(self, stop: asyncio.Event, expire_every: float, gc_policy: GcPolicy) -> None:
        """The passes of :meth:`serve`, until ``stop``."""
        next_expiry = time.monotonic() + expire_every
        turn, waited = time.monotonic(), 0.0
        while not stop.is_set():
            now = time.monotonic()
            lost = now - turn - waited  # the last pass's time beyond the wait it chose: it could not listen
            if lost > self.state.membership.death_timeout(now) / 4:
                self.complain(
                    "stall",
                    f"the coordinator did not run for {lost:.1f} s (stopped or starved);"
                    " no node's silence counts for that time",
                )
                self.state.membership.pardon(lost, now)
            turn = now
            caught_up = True
            busy = self.held.due or self.undrafted or self.statuses
            waited = 0.0 if busy else _IDLE_POLL_S
            if await self.pipe.poll(waited):
                caught_up = self.handle_batch()
            now = time.monotonic()
            self.answer_held(now, caught_up=caught_up)
            if caught_up:
                self.draft_some()
            if self.statuses:
                self.build_statuses(time.monotonic() + _STATUS_SLICE_S)
            if caught_up and now >= next_expiry:
                self.expire(now)
                self.answer_asks(now)
                gc_policy.tick(now, busy=len(self.held) > 0)
                next_expiry = now + expire_every
            else:  # a loop that never catches up still answers an ask before its asker gives up
                self.answer_asks(now, expired_only=True)
            self.prober.start()
            await asyncio.sleep(0)

    def expire(self, now: float) -> None:
        try:
            live = self.state.membership.live
            self.state.expire(now)
            if self.state.membership.live < live:  # a held request may have waited for a node's death
                self.held.wake_all()
        except Exception:  # a bug must not stop failure detection for every other node
            self.complain("expiry", "expiry failed", exc_info=True)

    def handle_batch(self) -> bool:
        """Handle up to ``_BATCH`` waiting requests; True when the socket was emptied (the loop caught up).

        A request that decides a round ends the batch early, so that the held requests it woke are answered next.
        """
        woken = bool(self.held.due)
        for _ in range(_BATCH):
            frames = self.pipe.recv_nowait()
            if frames is None:
                return True
            self.handle(frames, time.monotonic())
            if not woken and self.held.due:
                break
        return False

    def answer_held(self, now: float, *, caught_up: bool = True) -> None:
        """Ask the state again for held requests that something woke (for up to ``_HELD_SLICE_S``), and once
        the loop has ``caught_up`` (nothing queued), answer those held too long."""
        plans = self.state.plans
        if self._rebuilding and not plans.rebuilding(now):
            self._rebuilding = False
            self.held.wake_all()  # requests held in the rebuild window were not recorded yet
        changes = self.state.jobs.plan_changes
        while changes:
            self.held.wake(changes.pop())
        due, end = self.held.due, now + _HELD_SLICE_S
        confirm, send, clock = plans.confirm, self.send_frames, time.monotonic
        t = now  # one clock read per answer: it ends the slice and times the next answer
        undrafted: list[Held] = []  # asked again of the state, up to _REANSWER_BATCH at a time
        while due:
            held = due.popleft()
            if held.token is not None and confirm(held.msg, held.token, t):  # its draft holds: send it
                send(held.envelope, [held.frame])
            else:
                undrafted.append(held)
                if len(undrafted) == _REANSWER_BATCH:
                    self.reanswer(undrafted, t, final=False)
                    undrafted = []
            t = clock()
            if t >= end:
                break
        if undrafted:
            self.reanswer(undrafted, t, final=False)
        if caught_up:  # else a request still queued may decide the round: no ``wait`` for its ranks yet
            expired = self.held.take_expired(now, _BATCH)
            if expired:
                self.reanswer(expired, now, final=True)

    def reanswer(self, batch: list[Held], now: float, *, final: bool) -> None:
        """Answer held requests now, their replies encoded together; unless ``final``, hold on to those whose
        answer is still ``wait``."""
        plans = self.state.plans
        decided: list[tuple[Held, PlanAnswer]] = []
        for held in batch:
            # its draft holds: send it
            if held.token is not None and plans.confirm(held.msg, held.token, now):
                self.held.wake(held.msg.job)
                self.send_frames(held.envelope, [held.frame])
                continue
            try:
                answer = plans.plan(held.msg, now, held=True)
            except Exception as exc:  # it was answerable when it came: a bug
                self.complain("held", "failed to answer a held plan request", exc_info=True)
                self.send(
                    held.envelope,
                    Error(
                        job=held.msg.job,
                        code=ErrorCode.INTERNAL,
                        rank=held.msg.rank,
                        message=clip_text(f"{type(exc).__name__}: {exc}"),
                    ),
                )
                continue
            if not answer.waiting:
                self.held.wake(held.msg.job)
                decided.append((held, answer))
            elif final:
                self.send_plan(held.envelope, held.msg, answer)
            else:
                self.held.keep(held)
                self.undrafted.append(held)
        frames = self.plan_replies.frames([answer for _, answer in decided])
        for (held, _), frame in zip(decided, frames, strict=True):
            self._send_plan_frame(held.envelope, held.msg, frame)

    def handle(self, frames: list[bytes], now: float) -> None:
        peer = frames[0]
        split = 2 if len(frames) > 2 and not frames[1] else 1  # a REQ peer's empty delimiter
        envelope, body = frames[:split], frames[split:]
        try:
            msg = decode(body)
        except ProtocolError as exc:
            self.state.bad_messages += 1
            self.complain(peer, "bad message from peer %s: %s", peer.hex(), exc)
            self.send(envelope, Error(code=ErrorCode.BAD_MESSAGE, message=clip_text(str(exc))))
            return
        rank = -1
        if isinstance(msg, PlanRequest):
            rank = next((r for r in msg.all_ranks if r >= msg.world_size), msg.rank)
        try:
            reply = self.dispatch(msg, envelope, now)
        except ValueError as exc:
            self.state.bad_messages += 1
            self.complain(peer, "refused %s from peer %s: %s", msg.TYPE, peer.hex(), exc)
            reply = Error(job=msg.job, code=ErrorCode.BAD_MESSAGE, rank=rank, message=clip_text(str(exc)))
        except Exception as exc:
            self.complain(peer, "failed to handle %s from peer %s", msg.TYPE, peer.hex(), exc_info=True)
            reply = Error(
                job=msg.job,
                code=ErrorCode.INTERNAL,
                rank=rank,
                message=clip_text(f"{type(exc).__name__}: {exc}"),
            )
        if reply is not None:
            self.send(envelope, reply, msg.node if isinstance(msg, Heartbeat) else None)

    def dispatch(self, msg: Message, envelope: list[bytes], now: float) -> Message | None:
        """The answer to ``msg``; None for none now (an error sent to us, a plan request held)."""
        if isinstance(msg, Heartbeat):
            return self.state.heartbeat(msg, now)
        if isinstance(msg, PlanRequest):
            answer = self.state.plans.plan(msg, now)
            if answer.waiting:
                held = self.held.hold(envelope, msg, now)
                if held is not None:
                    self.undrafted.append(held)
                    return None
            else:
                self.held.wake(msg.job)  # the round is decided: answer every rank held for it
            self.send_plan(envelope, msg, answer)
            return None
        if isinstance(msg, RegisterSidecar):
            return self.state.register(msg, now)
        if isinstance(msg, MemberQuery):
            return self.state.membership.member(msg)
        if isinstance(msg, HoldersQuery):
            return holders(self.state.jobs, self.state.membership, msg)
        if isinstance(msg, SeatRequest | Drain):
            return self.asks.answer(envelope, msg, now)
        if isinstance(msg, PeerLostReport):
            return self.state.peer_lost(msg, now)
        if isinstance(msg, StatusRequest):
            return self.statuses.add(envelope, self.state.status_parts(now))
        self.state.bad_messages += 1
        if isinstance(msg, Error):  # never answer an error with an error
            return None
        return Error(
            job=msg.job, code=ErrorCode.UNEXPECTED, message=f"the coordinator does not serve {msg.TYPE!r}"
        )

    def draft_some(self) -> None:
        """Draft and encode (up to ``_BATCH``) answers that held requests get when their round freezes, if the
        state sees one (see the module docstring); encoded together, which costs less than one by one."""
        drafted: list[tuple[Held, object, PlanAnswer]] = []
        for _ in range(min(_BATCH, len(self.undrafted))):
            held = self.undrafted.popleft()
            held.token = None
            draft = self.state.plans.draft(held.msg)
            if draft is not None:
                drafted.append((held, *draft))
        frames = self.plan_replies.frames([answer for _, _, answer in drafted])
        for (held, token, _), frame in zip(drafted, frames, strict=True):
            # too big for one reply: answered the slow way, which says so
            if isinstance(frame, ProtocolError):
                self.complain("draft", "cannot encode a plan reply: %s", frame)
            else:
                held.frame, held.token = frame, token

    def build_statuses(self, until: float) -> None:
        """Build the oldest status documents part by part until the clock reads ``until`` (at least one part),
        sending each one complete (an ``internal`` error in its place where building it failed)."""
        for envelope, reply in self.statuses.build(until):
            if isinstance(reply, Error):
                self.complain("status", "failed to build a status document: %s", reply.message)
            self.send(envelope, reply)

    def send(self, envelope: list[bytes], reply: Message, node: str | None = None) -> None:
        """Encode and send ``reply``; a heartbeat reply to ``node`` is joined from cached pieces (see replies.py)."""
        try:
            head = self.replies.frame(node, reply) if node and isinstance(reply, HeartbeatReply) else None
            frames = encode(reply) if head is None else [head]
        except ProtocolError as exc:  # our answer broke a limit (e.g. a status document over 64 MiB)
            self.complain("encode", "cannot encode %s: %s", reply.TYPE, exc)
            frames = encode(
                Error(code=ErrorCode.INTERNAL, message=clip_text(f"the {reply.TYPE} broke a limit: {exc}"))
            )
        self.send_frames(envelope, frames)

    def send_plan(self, envelope: list[bytes], msg: PlanRequest, answer: PlanAnswer) -> None:
        """Send ``answer`` to ``msg`` (see :meth:`~.plans.Plans.plan`)."""
        try:
            frame: bytes | ProtocolError = self.plan_replies.frame(answer)
        except ProtocolError as exc:
            frame = exc
        self._send_plan_frame(envelope, msg, frame)

    def _send_plan_frame(self, envelope: list[bytes], msg: PlanRequest, frame: bytes | ProtocolError) -> None:
        """Send the encoded reply to ``msg``, or the error saying why it could not be encoded."""
        if isinstance(frame, ProtocolError):
            self.complain("encode", "cannot encode a plan reply: %s", frame)
            text = clip_text(f"the plan reply broke a limit: {frame}")
            self.send(envelope, Error(job=msg.job, code=ErrorCode.INTERNAL, rank=msg.rank, message=text))
            return
        self.send_frames(envelope, [frame])

    def send_frames(self, envelope: list[bytes], frames: list[Any]) -> None:
        """Send a message already encoded, without blocking (a reply finding no room is dropped, as a ROUTER
        drops on a full pipe; its sidecar asks again)."""
        try:
            if not self.pipe.send_nowait([*envelope, *frames]):
                self.complain("send", "send failed: the peer's queue is full")
        except TransportError as exc:
            self.complain("send", "send failed: %s", exc)

    def complain(self, key: Any, fmt: str, *args: Any, exc_info: bool = False) -> None:
        """Log a problem, at most once a minute per ``key`` (a peer's routing id, or a name)."""
        now = time.monotonic()
        last = self._complaints.get(key)
        if last is not None and now - last < _COMPLAIN_EVERY_S:
            return
        if len(self._complaints) > 10_000:
            self._complaints = {k: t for k, t in self._complaints.items() if now - t < _COMPLAIN_EVERY_S}
        self._complaints[key] = now
        log.warning(fmt + " (logged at most once a minute)", *args, exc_info=exc_info)
