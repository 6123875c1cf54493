"""A data-parallel job with zero-wait recovery: when a node dies, the survivors carry its work at once.

The job is ``W`` virtual ranks (``W = --nodes x $LOCAL_WORLD_SIZE``), each with its own data loader and random
streams, reduced in exact mode: every step consumes the same ``W`` micro-batches whichever processes carry them,
and the result is bit-identical to a run that never failed. Run one torchrun per node, as live mode does
(README.md here). The model is a small MLP on synthetic data, read by a ``StatefulDataLoader`` per virtual rank
(``pip install torchdata``).
"""

from __future__ import annotations

import argparse
import os

import torch
from torch.utils.data import DistributedSampler, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from snapshotd.client import PeerLost, live
from snapshotd.client.elastic import ElasticJob


def make_loader(vrank: int, world: int) -> StatefulDataLoader:
    """Virtual rank ``vrank``'s share of the data: what rank ``vrank`` of a ``world``-rank DDP job would read."""
    x = torch.randn(8192, 64, generator=torch.Generator().manual_seed(0))
    data = TensorDataset(x, (x.sum(dim=1, keepdim=True) > 0).float())
    sampler = DistributedSampler(data, num_replicas=world, rank=vrank, shuffle=True, seed=0)
    return StatefulDataLoader(data, batch_size=32, sampler=sampler)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, required=True, help="the job's nodes")
    p.add_argument(
        "--node-index", type=int, required=True, help="this node's index (a replacement takes the lost one's)"
    )
    p.add_argument("--steps", type=int, default=1000)
    args = p.parse_args()
    per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    world = args.nodes * per_node

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(256, 1)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    # an elastic live group: after a loss the survivors form a group of whoever arrived (within `settle` seconds)
    group = live.init_process_group(
        rank=args.node_index * per_node + int(os.environ["LOCAL_RANK"]), world_size=world, settle=0.5
    )
    state = {
        "model": model,
        "optim": opt,
    }  # what every virtual rank shares; each one's loader and RNG are its own
    with ElasticJob(group, state, model.parameters(), data=lambda v: make_loader(v, world)) as job:
        step = job.restore()  # 0, or the step this (replacement) process joins at
        while step < args.steps:
            try:
                with job.guard():
                    opt.zero_grad(set_to_none=True)
                    for vr in job.carried:  # one virtual rank normally; more while the job is shrunk
                        with vr.active():  # its random streams (dropout) are the process's in here
                            x, y = vr.next_batch()
                            loss = torch.nn.functional.binary_cross_entropy_with_logits(model(x), y)
                            loss.backward()
                        job.collect(vr)
                    job.reduce()  # the exact mean over all W virtual ranks
                    opt.step()
                    job.capture(step + 1)  # snapshots every virtual rank carried; lets a replacement in
            except PeerLost:
                step = job.recover()  # the survivors carry the lost virtual ranks, from step G
                print(
                    f"rank {group.rank}: carrying virtual ranks {list(job.layout.mine)} from step {step}",
                    flush=True,
                )
                continue
            step += 1
            if group.rank == 0 and step % 100 == 0:
                print(f"step {step} loss {loss.item():.4f} on {job.layout.processes} processes", flush=True)


if __name__ == "__main__":
    main()
