"""Scenarios for the coordinator's state tests: a state, nodes that register and heartbeat, plan requests."""

from __future__ import annotations

from snapshotd.coordinator import CoordinatorConfig, CoordinatorState
from snapshotd.proto import (
    Heartbeat,
    HeartbeatReply,
    InventoryItem,
    PlanReply,
    PlanRequest,
    RankInfo,
    RegisterSidecar,
)

T0 = 1000.0
LATER = T0 + 10.0  # past the rebuild window (heartbeat_timeout 3 s)


def make(replicas: int = 1) -> CoordinatorState:
    return CoordinatorState(CoordinatorConfig(replicas=replicas, heartbeat_timeout=3.0), now=T0)


def addr(node: str) -> str:
    return f"tcp://{node}:9000"


def register(st: CoordinatorState, node: str, now: float = T0, rack: str = "", inc: str = "i1") -> None:
    reply = st.register(RegisterSidecar(node=node, rack=rack, data_addr=addr(node), incarnation=inc), now)
    assert reply.heartbeat_interval == 0.5


def ranks(job: str, world: int, *rs: int, alive: bool = True) -> tuple[RankInfo, ...]:
    return tuple(RankInfo(job=job, rank=r, world_size=world, pid=100 + r, alive=alive) for r in rs)


def inv(job: str, rank: int, *steps: int, local: bool = False) -> tuple[InventoryItem, ...]:
    return tuple(InventoryItem(job=job, rank=rank, step=s, local=local) for s in steps)


def beat(st: CoordinatorState, node: str, now: float, ranks=(), inventory=(), changed=True, inc="i1", **kw):
    msg = Heartbeat(
        node=node, incarnation=inc, changed=changed, ranks=tuple(ranks), inventory=tuple(inventory), **kw
    )
    return st.heartbeat(msg, now)


def keep_alive(st: CoordinatorState, now: float, *nodes: str) -> dict[str, HeartbeatReply]:
    """Run the expiry timer at ``now`` (tasks it issues go out with the replies), then heartbeat ``nodes``."""
    st.expire(now)
    return {n: beat(st, n, now, changed=False) for n in nodes}


def watermark(reply: HeartbeatReply, job: str = "j") -> tuple[int, int]:
    (wm,) = [w for w in reply.watermarks if w.job == job]
    return wm.recoverable, wm.durable


def plan(
    st: CoordinatorState, rank: int, node: str, now: float = LATER, world: int = 2, job: str = "j"
) -> PlanReply:
    return st.plans.plan(PlanRequest(job=job, rank=rank, world_size=world, node=node), now).reply()


def two_node_job(st: CoordinatorState) -> None:
    """Job j, world 2: rank 0 on a, rank 1 on b, each backing up the other; steps 5 and 6 local, 5 on buddies."""
    for n in "ab":
        register(st, n)
    beat(st, "a", T0, ranks("j", 2, 0), inv("j", 0, 5, 6, local=True) + inv("j", 1, 5))
    beat(st, "b", T0, ranks("j", 2, 1), inv("j", 1, 5, 6, local=True) + inv("j", 0, 5))


def register_any(st: CoordinatorState, node: str, now: float = T0) -> None:
    st.register(RegisterSidecar(node=node, data_addr=addr(node), incarnation="i1"), now)
