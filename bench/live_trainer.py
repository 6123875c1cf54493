"""A DDP training job in live mode, for the live-recovery test and ``snapshotd-bench live``.

Each rank is a process (``python -m snapshotd.bench.live_trainer ...``, or a worker of a per-node ``torchrun``
with ``--node-index``, or with ``--nodes``: snapshotd gives the node its seat) that forms its gloo group with :func:`snapshotd.client.live.init_process_group` (the
rendezvous store of ``--store``), trains the GPT of :mod:`.workloads` wrapped in ``DistributedDataParallel``
exactly as :mod:`.trainer` does (the batch of step ``s`` on rank ``r`` depends only on ``(seed, r, s)``), and
snapshots every step. Its loop is the one the README shows for live mode::

    while step < steps:
        try:
            with snap.guard():
                train one step
                snap.capture(step + 1)
        except PeerLost:
            step = snap.recover()   # (--on-loss exit: the process exits 3 instead, for its launcher to restart)
            continue
        step += 1

A rank that exits with ``--on-loss exit`` first writes when the failure surfaced to ``<result path>.lost``.
The rank writes a JSON result when done (losses, a SHA-256 over its final state, its pid, and one record per
recovery: when the failure surfaced, the last step completed then, the step recovered and the phases' seconds) and keeps a progress file
(``--progress``: the last completed step, when it completed (``time.time()``) and the pid); given a folder as
``--progress``, it also writes ``built.<pid>`` there once its model is built, before it asks for its group.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from snapshotd.harness.trainer import _train_step, _write_atomic, batch_for, build_state, state_digest

from .rank_args import add_rank_arguments, join_group, placed_rank, start_rank_process

__all__ = ["EXIT_PEER_LOST", "main"]

EXIT_PEER_LOST = 3
"""The exit code of a rank that met a peer's loss with ``--on-loss exit``."""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_rank_arguments(p)
    p.add_argument(
        "--nodes",
        type=int,
        default=None,
        help="the job's nodes: snapshotd gives this node a seat, rank = its first + $LOCAL_RANK",
    )
    p.add_argument("--world", type=int, default=None, help="the job's ranks (with --rank or --node-index)")
    p.add_argument("--bucket-mb", type=float, default=0.25)
    p.add_argument("--step-delay", type=float, default=0.0, help="extra seconds per step")
    p.add_argument(
        "--replicated",
        default="",
        help="state keys snapshotted once across the ranks (replicated=), comma-separated",
    )
    p.add_argument(
        "--die-in-rollback",
        action="store_true",
        help="a survivor dying during its rollback: 0.2 s into its first recovery's restore, SIGKILL itself",
    )
    p.add_argument(
        "--die-before-restore",
        action="store_true",
        help="a replacement dying after its group formed: SIGKILL itself after DDP's constructor, before "
        "restore()",
    )
    p.add_argument(
        "--on-loss",
        choices=("recover", "exit"),
        default="recover",
        help="recover in place (live mode), or exit for the launcher to restart every rank",
    )
    p.add_argument(
        "--out", required=True, help="result JSON path (a folder under torchrun: rank{R}.json in it)"
    )
    p.add_argument(
        "--progress", default=None, help="progress file (a folder under torchrun: rank{R}.progress)"
    )
    args = p.parse_args(argv)
    if sum(x is not None for x in (args.rank, args.node_index, args.nodes)) != 1:
        p.error("give exactly one of --rank, --node-index and --nodes")
    if (args.world is None) != (args.nodes is not None):
        p.error("--world goes with --rank and --node-index, not with --nodes")
    rank = placed_rank(args)

    from snapshotd.client import PeerLost, Snapshotter

    start_rank_process()
    t_start = time.time()
    # the model first, the group after: a spare started ahead waits for its seat and group with its model built
    cfg, state, _ = build_state(args.params, args.steps, args.seed)
    opt, sched = state["optim"], state["sched"]
    if args.progress is not None and os.path.isdir(args.progress):  # the model is built (a spare is now warm)
        _write_atomic(os.path.join(args.progress, f"built.{os.getpid()}"), json.dumps({"time": time.time()}))
    if args.nodes is not None:
        group = join_group(args, nodes=args.nodes)
    else:
        group = join_group(args, rank=rank, world_size=args.world)
    rank, world = group.rank, group.world_size
    t_group = time.time()
    out = os.path.join(args.out, f"rank{rank}.json") if os.path.isdir(args.out) else args.out
    progress = args.progress
    if progress is not None and os.path.isdir(progress):
        progress = os.path.join(progress, f"rank{rank}.progress")
    trained = torch.nn.parallel.DistributedDataParallel(state["model"], bucket_cap_mb=args.bucket_mb)
    losses: dict[int, float] = {}
    done_at: dict[int, float] = {}  # step -> when this rank completed it (time.time())
    recoveries: list[dict[str, Any]] = []
    replicated = [key for key in args.replicated.split(",") if key]
    snap = (
        Snapshotter(
            state,
            job=args.job,
            rank=rank,
            world_size=world,
            sidecar=args.sidecar,
            live=group,
            replicated=replicated,
        )
        if args.snapshot
        else None
    )
    guard = snap.guard if snap is not None else contextlib.nullcontext
    recovering = False  # inside recover(): --die-in-rollback's restore dies
    if args.die_in_rollback and snap is not None:
        restorer = snap._restorer  # the part whose restore recover() runs
        restore = restorer.restore

        def restore_and_die(timeout: float) -> int:
            if recovering:
                threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGKILL)).start()
            return restore(timeout)

        restorer.restore = restore_and_die  # type: ignore[method-assign]
    if args.die_before_restore:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        t_restore = time.time()
        step = start = snap.restore() if snap is not None else 0
        started = {
            "process_start": t_start,
            "group_formed": t_group,
            "restore_start": t_restore,
            "restored": time.time(),
            "step": start,
            "epoch": group.epoch,
        }
        while step < args.steps:
            try:
                with guard():  # capture() too: its first call after DDP rebuilt its buckets runs a collective
                    x, y = batch_for(cfg, args.batch, args.seed, rank, step)
                    loss = _train_step(trained, opt, sched, x, y)
                    if snap is not None:
                        snap.capture(step + 1)
            except PeerLost as exc:
                assert snap is not None
                failed_at = time.time()
                if args.on_loss == "exit":
                    print(f"rank {rank}: {exc}; exiting for the launcher to restart the job", flush=True)
                    _write_atomic(out + ".lost", json.dumps({"failed_at": failed_at, "pid": os.getpid()}))
                    snap.close(unregister=False)  # a crash's exit: the arena stays for the restarted rank
                    return EXIT_PEER_LOST
                recovering = True
                cpu = time.process_time()
                reached, step = step, snap.recover()
                recovering = False
                recoveries.append(
                    {
                        "failed_at": failed_at,
                        "recovered_at": time.time(),
                        "reached": reached,
                        "step": step,
                        "epoch": group.epoch,
                        "cpu_s": time.process_time() - cpu,
                        **snap.recovered,
                    }
                )
                continue
            losses[step + 1] = float(loss.detach())
            step += 1
            done_at[step] = time.time()
            if progress:
                _write_atomic(progress, json.dumps({"step": step, "time": time.time(), "pid": os.getpid()}))
            if args.step_delay:
                time.sleep(args.step_delay)
        if snap is not None:
            snap.wait(timeout=30)
        result = {
            "rank": rank,
            "pid": os.getpid(),
            "start_step": start,
            "started": started,
            "losses": losses,
            "done_at": done_at,
            "recoveries": recoveries,
            "digest": state_digest(state),
            "epoch": group.epoch,
            "restored": snap.restored if snap is not None else {},
        }
    except BaseException:
        if snap is not None:
            snap.close(unregister=False)  # as a crash leaves it: the arena stays for the restarted rank
        raise
    if snap is not None:
        snap.close()
    _write_atomic(out, json.dumps(result))
    dist.destroy_process_group()  # no barrier first: every collective is done, and ranks finish far apart here
    return 0


if __name__ == "__main__":
    sys.exit(main())
