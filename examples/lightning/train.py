"""A small language model trained with Lightning (DDP) under torchrun, snapshotted by snapshotd.

Run it as any torchrun job (the multi-node commands are those of ``examples/torchrun_ddp/README.md``)::

    torchrun --nnodes 2 --nproc-per-node 2 --max-restarts 3 --rdzv-backend c10d \\
             --rdzv-endpoint store-host:29400 --rdzv-id run-42 train.py --steps 200 --out /tmp/run-42

The script is an ordinary Lightning script: a ``LightningModule`` (embedding, a transformer encoder layer with
dropout, a head) over token sequences made here, AdamW with a cosine schedule, gradient clipping, the DDP
strategy (gloo on CPU), a ``StatefulDataLoader`` over a ``DistributedSampler`` of its own so that a resume
continues the epoch where it was. snapshotd adds
two lines: ``SnapshotdCallback()`` among the Trainer's callbacks, and ``trainer.fit(..., ckpt_path=snap.restore(
trainer))``.

With ``--out DIR`` each rank writes the files ``examples/torchrun_ddp/train.py`` writes (``losses-rank{R}.jsonl``,
``events-rank{R}.jsonl``, ``final-rank{R}.json`` with the SHA-256 of the model's and optimizer's tensors), so that
a test compares a run that lost a node with one that did not.
"""

from __future__ import annotations

import time

T_START = time.time()  # before the heavy imports: when this process started

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from typing import Any  # noqa: E402

import lightning.pytorch as L  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DistributedSampler  # noqa: E402
from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402

from snapshotd.client.integrations.lightning import SnapshotdCallback  # noqa: E402

VOCAB = 64


def token_sequences(count: int, block: int, seed: int) -> torch.Tensor:
    """``count`` sequences of ``block + 1`` tokens: a walk that mostly steps by a fixed stride (something to learn)."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, VOCAB, (count, 1), generator=g)
    jumps = torch.randint(0, VOCAB, (count, block), generator=g)
    steps = torch.where(torch.rand(count, block, generator=g) < 0.8, 3, jumps)
    return torch.cat([start, steps], dim=1).cumsum(dim=1) % VOCAB


class TinyLM(L.LightningModule):
    def __init__(self, width: int, heads: int, lr: float, steps: int, out: str | None) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, width)
        self.block = torch.nn.TransformerEncoderLayer(width, heads, 2 * width, dropout=0.1, batch_first=True)
        self.head = torch.nn.Linear(width, VOCAB)
        self.lr, self.steps, self.out = lr, steps, out

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        logits = self.head(self.block(self.embed(ids[:, :-1])))
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        record(self.out, "losses", {"step": self.global_step + 1, "loss": loss.item()})
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.1)
        return [opt], [torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=self.steps)]


def record(out: str | None, kind: str, fields: dict[str, Any]) -> None:
    """One JSON line in ``out/{kind}-rank{R}.jsonl`` (nothing without ``out``)."""
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, f"{kind}-rank{os.environ.get('RANK', 0)}.jsonl"), "a") as f:
            f.write(json.dumps({"t": time.time(), "pid": os.getpid(), **fields}) + "\n")


class StepDelay(L.Callback):
    """``--step-delay`` idle seconds after each step (an accelerator's share of it), and the first step's event."""

    def __init__(self, seconds: float, out: str | None) -> None:
        self.seconds, self.out, self.first = seconds, out, True

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if self.first:
            self.first = False
            record(self.out, "events", {"event": "first_step", "step": trainer.global_step})
        if self.seconds:
            time.sleep(self.seconds)


def digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200, help="optimizer steps in all (default %(default)s)")
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step (default %(default)s)")
    p.add_argument("--block", type=int, default=32, help="tokens per sequence (default %(default)s)")
    p.add_argument("--width", type=int, default=64, help="model width (default %(default)s)")
    p.add_argument("--heads", type=int, default=2, help="attention heads (default %(default)s)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="model, data and shuffle seed (default %(default)s)")
    p.add_argument("--step-delay", type=float, default=0.0, help="idle seconds after each step (default 0)")
    p.add_argument("--out", default=None, help="write losses, events and final digests here")
    a = p.parse_args(argv)
    record(a.out, "events", {"event": "start", "t": T_START})

    L.seed_everything(a.seed, verbose=False)
    world, local = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    data = torch.utils.data.TensorDataset(token_sequences(64 * world, a.block, a.seed))
    # the loader's own DistributedSampler: Lightning's injected one (use_distributed_sampler=True) resumes a
    # StatefulDataLoader mid-epoch at other samples than the run that was snapshotted (Lightning 2.6)
    sampler = DistributedSampler(data, num_replicas=world, rank=int(os.environ.get("RANK", 0)), seed=a.seed)
    loader = StatefulDataLoader(data, batch_size=a.batch, sampler=sampler, drop_last=True)
    model = TinyLM(a.width, a.heads, a.lr, a.steps, a.out)
    snap = SnapshotdCallback()  # job, rank, world size and sidecar from torchrun's environment
    trainer = L.Trainer(
        max_steps=a.steps,
        accelerator="cuda" if torch.cuda.is_available() else "cpu",
        devices=local,
        num_nodes=world // local,
        strategy="ddp" if world > 1 else "auto",
        use_distributed_sampler=False,
        gradient_clip_val=1.0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=os.path.join(a.out or ".", "lightning"),
        callbacks=[snap, StepDelay(a.step_delay, a.out)],
    )
    record(a.out, "events", {"event": "built"})
    ckpt = snap.restore(trainer)
    assert snap.snapshotter is not None
    restored = snap.snapshotter.restored
    record(
        a.out,
        "events",
        {"event": "restored", "step": restored.get("step", 0), "source": restored.get("source")},
    )
    trainer.fit(model, train_dataloaders=loader, ckpt_path=ckpt)

    weights = list(model.state_dict().values())
    moments = [t for s in trainer.optimizers[0].state_dict()["state"].values() for t in s.values()]
    sched = json.dumps(trainer.lr_scheduler_configs[0].scheduler.state_dict(), sort_keys=True, default=str)
    final = {
        "rank": int(os.environ.get("RANK", 0)),
        "steps": trainer.global_step,
        "digest": digest(weights + moments),
        "state_digest": digest(
            [*weights, *moments, torch.frombuffer(bytearray(sched.encode()), dtype=torch.uint8)]
        ),
    }
    if a.out:
        path = os.path.join(a.out, f"final-rank{final['rank']}.json")
        with open(f"{path}.tmp", "w") as f:
            json.dump(final, f)
        os.replace(f"{path}.tmp", path)
    record(a.out, "events", {"event": "done", "step": trainer.global_step})
    return 0


if __name__ == "__main__":
    sys.exit(main())
