"""A data-parallel job over virtual ranks in exact mode, with zero-wait recovery: for the elastic test and
``snapshotd-bench live --modes shrink``.

Each process (``python -m snapshotd.bench.elastic_trainer ...``, placed by index: ``--rank`` or ``--node-index``)
forms an elastic live group (``--settle``) and trains the GPT of :mod:`snapshotd.harness.workloads` over the
virtual ranks it carries (:class:`~snapshotd.client.elastic.ElasticJob`): each virtual rank reads its own token
stream (:class:`TokenStream`, position in its state) and replaces a few tokens with random ones drawn from its own
random streams, so that its data and its randomness both move with it. With ``--no-snapshot`` the same loop runs
without snapshotd, one virtual rank per process (the failure-free reference, same reduction).

The process writes a JSON result when done: the loss of every (step, virtual rank) it computed, a SHA-256 over
the shared state (model, optimizer, scheduler) and one over each virtual rank's state it carries at the end, its
pid, its recoveries and growths; and a progress file (its home rank's: last completed step, time, pid, the
virtual ranks it carries).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from snapshotd.harness.trainer import _write_atomic, build_state, state_digest
from snapshotd.harness.workloads import GPTConfig, make_batch

from .rank_args import add_rank_arguments, join_group, placed_rank, start_rank_process

__all__ = ["TokenStream", "main"]

NOISE = 0.05
"""The share of tokens each virtual rank replaces with random ones from its own streams."""


class TokenStream:
    """Virtual rank ``vrank``'s batches: batch ``n`` is a pure function of ``(seed, vrank, n)``; ``n`` is its
    state (a data loader's position)."""

    def __init__(self, cfg: GPTConfig, batch: int, seed: int, vrank: int) -> None:
        self.cfg, self.batch, self.seed, self.vrank = cfg, batch, seed, vrank
        self.position = 0

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            gen = torch.Generator().manual_seed(
                (self.seed * 1_000_003 + self.vrank) * 1_000_003 + self.position
            )
            self.position += 1
            yield make_batch(self.cfg, self.batch, gen)

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.position = int(state_dict["position"])


class _Reference:
    """The failure-free reference without snapshotd: one virtual rank per process, the same reduction."""

    def __init__(self, world: int, rank: int, params: Any, data: Any, seed: int, mode: str) -> None:
        from snapshotd.client.elastic import MODES
        from snapshotd.client.virtual import Layout, VirtualRank

        self.layout = Layout.failure_free(world, rank)
        self.reducer = MODES[mode](params, self.layout)
        self.carried = [VirtualRank(rank, seed=seed, data=data(rank))]
        self.recovered: dict[str, Any] = {}
        self.grown: dict[str, Any] = {}

    def guard(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def collect(self, vr: Any) -> None:
        self.reducer.collect(vr.index)

    def reduce(self) -> None:
        self.reducer.reduce()

    def capture(self, step: int) -> None:
        pass


def _step(job: Any, model: torch.nn.Module, opt: Any, sched: Any, vocab: int) -> dict[int, float]:
    """One optimizer step over the virtual ranks ``job`` carries; each one's loss."""
    opt.zero_grad(set_to_none=True)
    losses = {}
    for vr in job.carried:
        with vr.active():
            x, y = vr.next_batch()
            noisy = torch.rand(x.shape) < NOISE
            x = torch.where(noisy, torch.randint(0, vocab, x.shape), x)
            logits = model(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
            loss.backward()
        job.collect(vr)
        losses[vr.index] = float(loss.detach())
    job.reduce()
    opt.step()
    sched.step()
    return losses


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_rank_arguments(p)  # --rank: the home rank
    p.add_argument("--world", type=int, required=True, help="the job's virtual ranks")
    p.add_argument("--mode", choices=("exact", "equivalent"), default="exact", help="the gradient reduction")
    p.add_argument(
        "--step-delay", type=float, default=0.0, help="idle seconds per virtual rank carried, per step"
    )
    p.add_argument(
        "--settle", type=float, default=0.5, help="the longest survivors wait for each other after a loss"
    )
    p.add_argument(
        "--until-grown",
        action="store_true",
        help="train past --steps while the job is shrunk, until a replacement joins (a benchmark's job must "
        "outlast the replacement's start)",
    )
    p.add_argument("--out", required=True, help="result folder: rank{R}.json by home rank")
    p.add_argument("--progress", default=None, help="progress folder: rank{R}.progress by home rank")
    args = p.parse_args(argv)
    if (args.rank is None) == (args.node_index is None):
        p.error("give --rank or --node-index")
    rank = placed_rank(args)

    from snapshotd.client import PeerLost
    from snapshotd.client.elastic import ElasticJob

    start_rank_process()
    t_start = time.time()
    cfg, state, _ = build_state(args.params, args.steps, args.seed)
    model, opt, sched = state["model"], state["optim"], state["sched"]
    shared = {"model": model, "optim": opt, "sched": sched}
    group = join_group(args, settle=args.settle, rank=rank, world_size=args.world)
    home, world = group.rank, group.world_size
    t_group = time.time()

    def data(v: int) -> TokenStream:
        return TokenStream(cfg, args.batch, args.seed, v)

    job: Any = (
        ElasticJob(
            group, shared, model.parameters(), data=data, seed=args.seed, mode=args.mode, sidecar=args.sidecar
        )
        if args.snapshot
        else _Reference(world, home, model.parameters(), data, args.seed, args.mode)
    )
    progress = os.path.join(args.progress, f"rank{home}.progress") if args.progress else None
    losses: dict[str, dict[str, float]] = {}
    done_at: dict[str, float] = {}  # step -> when this process completed it (time.time())
    recoveries, growths = [], []
    try:
        step = start = job.restore() if args.snapshot else 0
        started = {"process_start": t_start, "group_formed": t_group, "restored": time.time(), "step": start}
        while step < args.steps or (args.until_grown and args.snapshot and job.shrunk):
            try:
                with job.guard():
                    done = _step(job, model, opt, sched, cfg.vocab)
                    grown = job.grown
                    job.capture(step + 1)
            except PeerLost:
                failed_at, reached = time.time(), step
                step = job.recover()
                recoveries.append(
                    {"failed_at": failed_at, "recovered_at": time.time(), "reached": reached, **job.recovered}
                )
                continue
            if job.grown is not grown:
                growths.append({"at": time.time(), **job.grown})
            step += 1
            losses[str(step)] = {str(v): loss for v, loss in done.items()}
            done_at[str(step)] = time.time()
            if progress:
                record = {
                    "step": step,
                    "time": time.time(),
                    "pid": os.getpid(),
                    "carried": list(job.layout.mine),
                }
                _write_atomic(progress, json.dumps(record))
            if args.step_delay:  # the accelerator's share of each micro-batch
                time.sleep(args.step_delay * len(job.carried))
        result = {
            "rank": home,
            "pid": os.getpid(),
            "start_step": start,
            "started": started,
            "losses": losses,
            "done_at": done_at,
            "recoveries": recoveries,
            "growths": growths,
            "digest": state_digest(shared),
            "vranks": {str(vr.index): state_digest({"v": vr}) for vr in job.carried},
            "epoch": group.epoch,
        }
    except BaseException:
        if args.snapshot:
            job.__exit__(RuntimeError, None, None)  # as a crash leaves it: the arenas stay
        raise
    if args.snapshot:
        job.wait(timeout=30)
        job.close()
    _write_atomic(os.path.join(args.out, f"rank{home}.json"), json.dumps(result))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
