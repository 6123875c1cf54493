"""The status document behind ``snapshotd status``, packed in parts.

The document lists every node and every rank: with thousands of nodes, long enough to pack that it would hold
up every request queued behind it. It is made in parts of at most :data:`STATUS_PART_ENTRIES` entries, so that
the server can answer other requests between parts (see :mod:`.loop`), and sends the document once complete. At
most :data:`STATUS_BUILDS` are built at once; a request beyond gets an ``Error`` with code ``busy``.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Iterator
from typing import Any

import msgpack

from snapshotd import __version__
from snapshotd.proto import Error, ErrorCode, Message, StatusReply
from snapshotd.proto.limits import MAX_TEXT_LEN

from .config import CoordinatorConfig
from .jobs import Jobs
from .membership import Membership

__all__ = ["STATUS_BUILDS", "STATUS_PART_ENTRIES", "StatusBuilds", "missing_ranges", "status_parts"]

STATUS_PART_ENTRIES = 256
"""Node or rank entries per part of a status document: a part is short next to a heartbeat's round trip."""


def status_parts(
    cfg: CoordinatorConfig,
    membership: Membership,
    jobs: Jobs,
    counters: dict[str, Any],
    started: float,
    now: float,
) -> Iterator[bytes]:
    """The status document packed with msgpack, in parts; the parts joined are the document.

    ``coordinator``: version (the coordinator's build), uptime_s, replicas, bad_messages, heartbeats and
    node_deaths (by cause, see :attr:`~.membership.Membership.deaths`) (from ``counters``), live_nodes,
    heartbeat_interval (the one given out now, seconds), heartbeat_timeout (the death timeout now, seconds).
    ``broken_paths``: the pairs of live nodes that cannot move snapshots to each other (see :mod:`.paths`), each
    with ``nodes`` and ``reported_by`` (node: why).
    ``nodes`` (dead ones too): node, rack, data_addr, incarnation, alive, last_seen_s, ranks ([job, rank, alive]),
    stored_bytes, out_Bps, in_Bps. ``jobs``: job, world_size, recoverable, durable (as published), durable_age_s
    (seconds since D was first published at its value; None while D is -1), and per rank
    that some node reported (its home, or a copy): rank, node (its home, or None), newest_step (-1: none),
    lag_steps (newest - recoverable; None while no step is recoverable), rpo_s (lag_steps times the job's recent
    time per step, from how fast G grew: the training a failure now would lose, up to its newest snapshot; None
    while either is unknown), copies (live holders of the recoverable step); ``missing``: the other ranks below
    the world size, as ``[first, last]`` ranges (a peer's world size alone never lengthens the document);
    ``round``: its last plan round (None before the first), see :meth:`~.plans.Round.status`; ``plan_rounds``
    and ``plan_round_s``: how many rounds had every rank answered, and their total seconds from the freeze to
    the last answer; ``plan_round_buckets``: ``[bound, rounds at or under it]`` for each bound of
    :data:`~snapshotd.tally.LATENCY_BUCKETS`.

    The state may change between parts: the document lists the nodes and jobs there were when the first part
    was made, and each job's ranks up to the world size it had when its own part began; each entry is read as it
    is packed, and times are as of ``now``.
    """
    packer = msgpack.Packer(use_bin_type=True)
    pack = packer.pack
    coordinator = {
        "version": __version__,
        "uptime_s": round(now - started, 3),
        "replicas": cfg.replicas,
        **counters,
        "live_nodes": membership.live,
        "heartbeat_interval": membership.heartbeat_interval(),
        "heartbeat_timeout": membership.death_timeout(now),
    }
    nodes = [membership.nodes[name] for name in sorted(membership.nodes)]
    listed = [jobs[name] for name in sorted(jobs)]
    yield (
        packer.pack_map_header(4)
        + pack("coordinator")
        + pack(coordinator)
        + pack("broken_paths")
        + pack(membership.paths.pairs())
        + pack("nodes")
        + packer.pack_array_header(len(nodes))
    )
    for i in range(0, len(nodes), STATUS_PART_ENTRIES):
        yield b"".join(
            [
                pack(
                    {
                        "node": n.name,
                        "rack": n.rack,
                        "data_addr": n.data_addr,
                        "incarnation": n.incarnation,
                        "alive": n.alive,
                        "leaving": n.leaving,
                        "last_seen_s": round(now - n.last_seen, 3),
                        "ranks": [[j, r, n.alive and info.alive] for (j, r), info in sorted(n.ranks.items())],
                        "stored_bytes": n.stored_bytes,
                        "out_Bps": n.out_bps,
                        "in_Bps": n.in_bps,
                        "pace_Bps": n.pacer[0],
                        "step_budget": n.pacer[1],
                        "step_slowdown": n.pacer[2],
                    }
                )
                for n in nodes[i : i + STATUS_PART_ENTRIES]
            ]
        )
    yield pack("jobs") + packer.pack_array_header(len(listed))
    for job in listed:
        wm = job.publish()
        g, ws = wm.recoverable, job.world_size
        known = sorted(r for r in job.homes.keys() | job.holders.keys() if r < ws)
        seconds = job.step_seconds()
        d, d_since = job.durable_seen
        yield (
            packer.pack_map_header(11)
            + pack("job")
            + pack(job.name)
            + pack("world_size")
            + pack(ws)
            + pack("recoverable")
            + pack(g)
            + pack("durable")
            + pack(wm.durable)
            + pack("durable_age_s")
            + pack(round(now - d_since, 3) if d >= 0 else None)
            + pack("plan_rounds")
            + pack(job.rounds.count)
            + pack("plan_round_s")
            + pack(job.rounds.total)
            + pack("plan_round_buckets")
            + pack(job.rounds.buckets())
            + pack("missing")
            + pack(missing_ranges(known, ws))
            + pack("ranks")
            + packer.pack_array_header(len(known))
        )
        for lo in range(0, len(known), STATUS_PART_ENTRIES):
            entries = []
            for r in known[lo : lo + STATUS_PART_ENTRIES]:
                steps = job.holders.get(r, {})
                newest = max(steps, default=-1)
                home = job.homes.get(r)
                lag = newest - g if g >= 0 else None
                rpo = round(lag * seconds, 3) if lag is not None and seconds is not None else None
                entries.append(
                    pack(
                        {
                            "rank": r,
                            "node": home,
                            "newest_step": newest,
                            "lag_steps": lag,
                            "rpo_s": rpo,
                            "copies": len(steps.get(g, ())),
                        }
                    )
                )
            yield b"".join(entries)
        yield pack("round") + pack(None if job.round is None else job.round.status(now))


def missing_ranges(known: list[int], world_size: int) -> list[list[int]]:
    """The ranks below ``world_size`` not in ``known`` (sorted), as ``[first, last]`` ranges."""
    out: list[list[int]] = []
    start = 0
    for r in [*known, world_size]:
        if r > start:
            out.append([start, r - 1])
        start = r + 1
    return out


STATUS_BUILDS = 4
"""Status documents built at once at most (a request beyond is answered ``busy``)."""


@dataclasses.dataclass(slots=True, eq=False)
class _Build:
    """A status document being built: where it goes, its parts still to make, and those made."""

    envelope: list[bytes]
    parts: Iterator[bytes]
    done: list[bytes] = dataclasses.field(default_factory=list)


class StatusBuilds:
    """The status documents being built, oldest first, a part at a time between the loop's other work."""

    def __init__(self) -> None:
        self._builds: collections.deque[_Build] = collections.deque()

    def __len__(self) -> int:
        return len(self._builds)

    def add(self, envelope: list[bytes], parts: Iterator[bytes]) -> Error | None:
        """Start building the document made of ``parts`` for ``envelope``; an ``Error`` with code ``busy`` instead
        when :data:`STATUS_BUILDS` are being built already."""
        if len(self._builds) >= STATUS_BUILDS:
            return Error(
                code=ErrorCode.BUSY,
                message=f"{len(self._builds)} status documents are being built; ask again in a second",
            )
        self._builds.append(_Build(envelope, parts))
        return None

    def build(self, until: float) -> list[tuple[list[bytes], Message]]:
        """Build part by part until the clock reads ``until`` (at least one part); the documents completed (a
        :class:`~snapshotd.proto.StatusReply` each, or an ``internal`` error where building one failed)."""
        out: list[tuple[list[bytes], Message]] = []
        while self._builds:
            build = self._builds[0]
            try:
                part = next(build.parts, None)
            except Exception as exc:  # a bug must not stop the loop
                self._builds.popleft()
                text = f"{type(exc).__name__}: {exc}"
                out.append((build.envelope, Error(code=ErrorCode.INTERNAL, message=text[:MAX_TEXT_LEN])))
                continue
            if part is None:
                self._builds.popleft()
                out.append((build.envelope, StatusReply(body=b"".join(build.done))))
            else:
                build.done.append(part)
            if time.monotonic() >= until:
                break
        return out
