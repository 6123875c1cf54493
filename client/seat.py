"""This node's seat in a live-mode job whose ranks snapshotd places (``init_process_group(nodes=)``).

The coordinator gives each node of such a job a seat, a block of ``$LOCAL_WORLD_SIZE`` ranks (its side is
:mod:`snapshotd.coordinator.seats`); :func:`request_seat` asks for it through the node's sidecar and turns it
into this process's rank, ``first + $LOCAL_RANK``. A spare node, started while every seat is held, waits until
one comes free. A rank asks in requests of at most :data:`SEAT_ASK_S`, again and again until its own deadline,
so a sidecar whose rank died stops asking soon after.
"""

from __future__ import annotations

import logging
import os
import time

from snapshotd.proto import SeatReply, SeatRequest

from .channel import Channel
from .errors import RecoveryFailed
from .identity import Identity

__all__ = ["SEAT_ASK_MIN_S", "SEAT_ASK_S", "request_seat"]

log = logging.getLogger(__name__)

SEAT_ASK_S = 10.0
"""How long the sidecar asks the coordinator for a seat on one request of a rank (which asks again until its own
deadline)."""

SEAT_ASK_MIN_S = 0.5
"""The shortest seat request a rank sends: with less time left before its deadline it stops asking (a request of a
few milliseconds would time out at the sidecar before the coordinator could answer it)."""


def request_seat(job: str | None, nodes: int, sidecar: str | None, timeout: float) -> tuple[int, int]:
    """This process's rank and the world size, from the seat the coordinator gives this node (see
    :func:`~snapshotd.client.live.init_process_group`).

    Raises:
        ValueError: ``nodes`` < 1, ``$LOCAL_RANK`` or ``$LOCAL_WORLD_SIZE`` missing or inconsistent.
        RecoveryFailed: every seat stayed held by a live node for ``timeout`` seconds; the seat this node had was
            given to another node (``taken``: this node was declared dead meanwhile).
        SnapshotdError: the sidecar or coordinator refused the request or did not answer.
    """
    local_rank, per_node = os.environ.get("LOCAL_RANK", ""), os.environ.get("LOCAL_WORLD_SIZE", "")
    if not local_rank.isdigit() or not per_node.isdigit() or not 0 <= int(local_rank) < int(per_node):
        raise ValueError(
            "nodes= needs $LOCAL_RANK and $LOCAL_WORLD_SIZE (torchrun sets them), got "
            f"{local_rank!r} and {per_node!r}"
        )
    if nodes < 1:
        raise ValueError(f"nodes must be >= 1, got {nodes}")
    world_size = nodes * int(per_node)
    me = Identity.resolve(
        job, 0, world_size, sidecar
    )  # the job's name and the sidecar; the rank comes from the seat
    deadline = time.monotonic() + timeout
    channel = Channel(me.sidecar, lambda msg: None)
    try:
        while True:  # short requests: a sidecar whose rank died stops asking within SEAT_ASK_S
            left = max(SEAT_ASK_MIN_S, min(SEAT_ASK_S, deadline - time.monotonic()))
            ask = SeatRequest(job=me.job, world_size=world_size, per_node=int(per_node), timeout_s=left)
            reply = channel.request(ask, SeatReply.TYPE, left + 10.0)
            assert isinstance(reply, SeatReply)
            if reply.status != "wait" or deadline - time.monotonic() < SEAT_ASK_MIN_S:
                break
    finally:
        channel.close()
    if reply.status == "taken":
        raise RecoveryFailed(f"job {me.job!r}: {reply.reason}")
    if reply.status != "given":
        raise RecoveryFailed(f"job {me.job!r}: no seat for this node within {timeout:.0f} s: {reply.reason}")
    rank = reply.first + int(local_rank)
    log.info(
        "[job %s] this node has seat %d: ranks %d-%d; this process is rank %d",
        me.job,
        reply.first // int(per_node),
        reply.first,
        reply.first + int(per_node) - 1,
        rank,
    )
    return rank, world_size
