"""What the live-mode trainers (:mod:`.live_trainer`, :mod:`.elastic_trainer`) share: the flags that place a rank
and describe its job, and the set-up of a rank process."""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

import torch

__all__ = ["add_rank_arguments", "join_group", "placed_rank", "start_rank_process"]


def add_rank_arguments(p: argparse.ArgumentParser) -> None:
    """``--rank``, ``--node-index``, the job (``--store``, ``--job``, ``--sidecar``), its size and length
    (``--steps``, ``--params``, ``--batch``, ``--seed``), its group's timeouts and ``--snapshot``."""
    p.add_argument("--rank", type=int, default=None, help="rank in the job (or --node-index)")
    p.add_argument(
        "--node-index",
        type=int,
        default=None,
        help="this node's index: rank = index * $LOCAL_WORLD_SIZE + $LOCAL_RANK (under torchrun)",
    )
    p.add_argument("--store", required=True, help="the rendezvous store, host:port")
    p.add_argument("--job", required=True, help="the job (snapshotd's, and the live group's in the store)")
    p.add_argument("--sidecar", default=None, help="the node sidecar's ipc path")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--params", type=int, default=200_000)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--pg-timeout", type=float, default=30.0, help="the group's collective timeout (a hung peer)"
    )
    p.add_argument(
        "--join-timeout",
        type=float,
        default=600.0,
        help="seconds to wait for the whole membership (a spare started ahead waits this long)",
    )
    p.add_argument(
        "--snapshot",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="snapshot every step (--no-snapshot: the failure-free reference, snapshotd left out)",
    )


def placed_rank(args: argparse.Namespace) -> int | None:
    """The rank ``--rank`` or ``--node-index`` places this process at (None with neither)."""
    if args.node_index is not None:
        return int(args.node_index * int(os.environ["LOCAL_WORLD_SIZE"]) + int(os.environ["LOCAL_RANK"]))
    return args.rank


def start_rank_process() -> None:
    """A rank process's logging (its pid on every line) and one intra-op thread."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s pid {os.getpid()} %(name)s: %(message)s")
    torch.set_num_threads(1)


def join_group(args: argparse.Namespace, **place: Any) -> Any:
    """The job's live group (:func:`snapshotd.client.live.init_process_group`) on the store, job, sidecar and
    timeouts of ``args``; ``place``: ``nodes=``, or ``rank=`` and ``world_size=`` (and ``settle=``)."""
    from snapshotd.client import live

    return live.init_process_group(
        store=args.store,
        job=args.job,
        sidecar=args.sidecar,
        timeout=args.pg_timeout,
        join_timeout=args.join_timeout,
        **place,
    )
