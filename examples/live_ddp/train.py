"""A DDP job in snapshotd's live mode: when a node dies, the ranks on the other nodes keep their processes.

Run one torchrun per node (``--standalone --nnodes 1``); snapshotd gives each node a seat (a block of ranks), and
the job's ranks across nodes form one gloo group through the rendezvous store named by ``$SNAPSHOTD_STORE`` (see
README.md here).
The model is a small MLP on synthetic data; the batch of step ``s`` on rank ``r`` depends only on ``(r, s)``,
so the data position is the step itself.
"""

from __future__ import annotations

import argparse

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from snapshotd.client import PeerLost, RNGState, Snapshotter, live


def batch(rank: int, step: int, size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(rank * 1_000_003 + step)
    x = torch.randn(size, 64, generator=gen)
    return x, (x.sum(dim=1, keepdim=True) > 0).float()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, required=True, help="the job's nodes")
    p.add_argument("--steps", type=int, default=1000)
    args = p.parse_args()

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)

    # live mode: snapshotd seats this node (a replacement waits for a lost node's seat), the group comes from the
    # rendezvous store, and the Snapshotter is told about it
    group = live.init_process_group(nodes=args.nodes)
    rank = group.rank  # the rank in the whole job
    ddp = DDP(model)
    state = {"model": model, "optim": opt, "sched": sched, "rng": RNGState()}
    with Snapshotter(state, live=group) as snap:
        step = snap.restore()  # 0, or the step this (replacement) rank resumes from
        while step < args.steps:
            try:
                with snap.guard():  # a collective failing because a peer died raises PeerLost
                    x, y = batch(rank, step)
                    loss = torch.nn.functional.binary_cross_entropy_with_logits(ddp(x), y)
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()
                    sched.step()
                    snap.capture(
                        step + 1
                    )  # inside the guard: right after a recovery it runs a DDP collective
            except PeerLost:
                step = snap.recover()  # new group with the replacement, state rolled back in place
                print(f"rank {rank}: a peer was lost; resumed at step {step} ({snap.recovered['seconds']:.2f} s)",
                      flush=True)  # fmt: skip
                continue
            step += 1
            if rank == 0 and step % 100 == 0:
                print(f"step {step} loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main()
