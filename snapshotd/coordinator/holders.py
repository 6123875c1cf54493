"""Who holds a step: the answer to ``snapshotd export``'s :class:`~snapshotd.proto.HoldersQuery`.

Read from the job's inventory index (:mod:`.jobs`), which lists only live nodes; pure, like the rest of the state.
"""

from __future__ import annotations

from snapshotd.proto import Error, ErrorCode, HoldersQuery, HoldersReply

from .jobs import Jobs
from .membership import Membership

__all__ = ["holders"]


def holders(jobs: Jobs, membership: Membership, msg: HoldersQuery) -> HoldersReply | Error:
    """The live holders of ``msg.step`` of ``msg.job`` for the ranks the query names; for -1, of its D, or of G
    while no step is durable (after a node's loss, until re-replication makes a step durable again).

    A copy in a buddy store comes before a rank's own slot, each group in address order. A step the coordinator
    names stale (held when a plan round froze at an older step, so possibly the failed run's) is refused with
    ``not_found``, as is a job the coordinator does not know.
    """
    job = jobs.get(msg.job)
    if job is None:
        return Error(
            job=msg.job, code=ErrorCode.NOT_FOUND, message=f"the coordinator knows no job {msg.job!r}"
        )
    wm = job.publish()
    step = (wm.durable if wm.durable >= 0 else wm.recoverable) if msg.step < 0 else msg.step
    lo, hi = job.stale
    if lo < step <= hi:
        return Error(
            job=msg.job,
            code=ErrorCode.NOT_FOUND,
            step=step,
            message=f"step {step} of job {msg.job!r} is stale: it was held when a restore resumed from "
            f"step {lo}, so a copy of it may come from the run that failed",
        )
    nodes = membership.nodes
    sources: list[tuple[str, ...]] = []
    for rank in range(msg.first, min(msg.first + msg.count, job.world_size)) if step >= 0 else ():
        held = job.holders.get(rank, {}).get(step, {})
        ordered = sorted((local, nodes[n].data_addr) for n, local in held.items())
        sources.append(tuple(addr for _, addr in ordered[:64]))
    return HoldersReply(
        job=msg.job,
        step=step,
        world_size=job.world_size,
        recoverable=wm.recoverable,
        durable=wm.durable,
        first=msg.first,
        sources=tuple(sources),
    )
