"""The exact reduction's cost against DDP's all-reduce, side by side in one job: ``snapshotd-bench live``'s
``exact_reduction_cost_ratio``.

``world`` processes (spawned, one gloo group, one intra-op thread each) train the GPT of
:mod:`snapshotd.harness.workloads` with one virtual rank each and alternate, step by step, between a DDP step
(``DistributedDataParallel``, its buckets' all-reduce overlapping the backward) and an exact-mode step (the same
forward and backward inside the virtual rank's random streams, then
:class:`~snapshotd.client.reducers.ExactReducer`), in the order ABBA so that neither is always first. Each step
is timed from its batch to the end of the optimizer step, after a barrier; the figures are the medians over the
steps after the first few, of the slowest process's time.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import statistics
import tempfile
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

log = logging.getLogger(__name__)

__all__ = ["measure_reduction_cost"]

WARMUP = 4
"""Steps of each kind left out of the medians."""


def _entry(rank: int, world: int, params: int, steps: int, out_dir: str) -> None:
    import time

    from snapshotd.client.reducers import ExactReducer
    from snapshotd.client.virtual import Layout, VirtualRank
    from snapshotd.harness.trainer import batch_for, build_state

    store = dist.FileStore(os.path.join(out_dir, "store"), world)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
    )
    torch.set_num_threads(1)
    cfg, state, _ = build_state(params, steps, 0)
    model, opt = state["model"], state["optim"]
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.25)
    exact = ExactReducer(model.parameters(), Layout.failure_free(world, rank))
    vrank = VirtualRank(rank)

    def loss_of(net: torch.nn.Module, step: int) -> torch.Tensor:
        x, y = batch_for(cfg, 4, 0, rank, step)
        return F.cross_entropy(net(x).reshape(-1, cfg.vocab), y.reshape(-1))

    def ddp_step(step: int) -> None:
        opt.zero_grad(set_to_none=True)
        loss_of(ddp, step).backward()
        opt.step()

    def exact_step(step: int) -> None:
        opt.zero_grad(set_to_none=True)
        with vrank.active():
            loss_of(model, step).backward()
        exact.collect(rank)
        exact.reduce()
        opt.step()

    times: dict[str, list[float]] = {"ddp": [], "exact": []}
    for step in range(steps):
        order = [("ddp", ddp_step), ("exact", exact_step)]
        for name, fn in order if step % 2 == 0 else order[::-1]:
            dist.barrier()
            t0 = time.perf_counter()
            fn(step)
            took = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the step ends when its slowest process's does
            times[name].append(float(took))
    if rank == 0:
        with open(os.path.join(out_dir, "times.json"), "w") as f:
            json.dump(times, f)
    open(os.path.join(out_dir, f"done-{rank}"), "w").close()
    dist.destroy_process_group()


def measure_reduction_cost(
    world: int, params: int, steps: int = 40, timeout: float = 300.0
) -> dict[str, Any]:
    """Median seconds of a DDP step and of an exact-mode step, side by side on ``world`` processes, and their
    ratio (``exact_reduction_cost_ratio``).

    Raises:
        RuntimeError: a process failed, or the job ran past ``timeout`` (every process is killed first).
    """
    if world < 2 or steps <= WARMUP:
        raise ValueError(f"needs world >= 2 and steps > {WARMUP}, got {world} and {steps}")
    with tempfile.TemporaryDirectory(prefix="snapshotd-reduction-") as out_dir:
        ctx = mp.start_processes(
            _entry, args=(world, params, steps, out_dir), nprocs=world, join=False, start_method="spawn"
        )
        try:
            deadline = timeout
            while not ctx.join(timeout=1.0):
                deadline -= 1.0
                if deadline <= 0:
                    raise RuntimeError(f"the reduction cost job did not finish within {timeout:.0f} s")
        except mp.ProcessExitedException as exc:
            # gloo's teardown at exit can abort a process (torch 2.13) after every process measured: not a failure
            if not all(os.path.exists(os.path.join(out_dir, f"done-{r}")) for r in range(world)):
                raise RuntimeError(f"the reduction cost job failed: {exc}") from exc
            log.warning("a process of the reduction cost job died after the measurement: %s", exc)
        except mp.ProcessRaisedException as exc:
            raise RuntimeError(f"the reduction cost job failed: {exc}") from exc
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                p.join(10)
        with open(os.path.join(out_dir, "times.json")) as f:
            times = json.load(f)
    ddp, exact = (statistics.median(times[k][WARMUP:]) for k in ("ddp", "exact"))
    return {"ddp_step_seconds": ddp, "exact_step_seconds": exact, "exact_reduction_cost_ratio": exact / ddp}
