"""A character-level GPT trained with DistributedDataParallel under torchrun, snapshotted by snapshotd.

Run it as any torchrun job (see README.md beside this file for the multi-node commands)::

    torchrun --nnodes 2 --nproc-per-node 2 --max-restarts 3 --rdzv-backend c10d \\
             --rdzv-endpoint store-host:29400 --rdzv-id run-42 train.py --steps 200 --out /tmp/run-42

The training loop is an ordinary one: gloo process group from torchrun's environment, a small transformer in
``DistributedDataParallel``, a ``DataLoader`` over a ``DistributedSampler``, AdamW, warm-up then cosine LR,
gradient clipping and dropout. snapshotd adds two lines: ``start = snap.restore()`` before the loop and
``snap.capture(step + 1)`` after each optimizer step. Job, rank, world size and the node's sidecar come from
the environment (``TORCHELASTIC_RUN_ID`` or ``SNAPSHOTD_JOB``, torch.distributed, ``SNAPSHOTD_SIDECAR``).

After a restore the job goes on exactly where the failure-free run would be:

- model, optimizer, scheduler and every RNG (dropout draws from torch's global generator) come from the
  snapshot;
- the data position is derived from the restored step: epoch ``step // batches_per_epoch`` and, within it, the
  batches already consumed are skipped by the sampler (:class:`ResumableSampler`), so no batch is seen twice
  or missed. The ``DataLoader`` gets a generator of its own, so creating its iterator never draws from the
  global generator that the snapshot restored.

With ``--out DIR`` each rank appends one JSON line per step to ``DIR/losses-rank{R}.jsonl`` (step, loss, wall
time, the Snapshotter's snapshot stride), one line per milestone to ``DIR/events-rank{R}.jsonl`` (process start,
process group ready, model built, restore begun and done with its step and source, first step, done; wall-clock
``time.time()``), and at the end writes ``DIR/final-rank{R}.json`` with the SHA-256 of every tensor's bytes of
model and optimizer (``digest``) and of the whole snapshotted state, scheduler and RNG included
(``state_digest``); rank 0 also writes ``DIR/digest.json``. A test compares these with a failure-free run.
"""

from __future__ import annotations

import time

T_START = time.time()  # before the heavy imports: when this process started, for the recovery timings

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402
from collections.abc import Iterator, Mapping  # noqa: E402
from typing import Any  # noqa: E402

import numpy  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torch.utils.data import DataLoader, Dataset, DistributedSampler  # noqa: E402

from snapshotd.client import RNGState, Snapshotter  # noqa: E402

CORPUS = """\
The keeper of the north light climbed the tower every evening at six. He wound the clockwork that turned the
lens, trimmed the wick, wiped the salt from the glass and wrote three lines in the log: the wind, the sea and
the ships he had counted. In forty years the log filled eleven books. Most lines were alike. Wind from the
west, sea moderate, two ships. Wind from the north, sea rough, no ships. Some nights were different. One
winter a schooner lost her mast off the point and the keeper rowed out with his daughter to take the crew off
before the tide turned. One summer the lens cracked in the heat and he kept the light with a ring of oil lamps
for nine nights until the new glass came by boat from the city. When the keeper grew old his daughter wound
the clock and trimmed the wick, and she wrote the lines in the log in a smaller hand. Wind from the south, sea
calm, four ships. The light never went out. Sailors on the long passage said that they could set their watches
by it, and that a ship which saw the north light at dusk would be in harbour by morning. Nobody now remembers
the name of the keeper, but the eleven books are kept in the museum by the harbour, and on a quiet afternoon
anyone may sit at the long table and read them, one line for every night, wind and sea and ships.
"""


class CharDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Every window of ``block + 1`` characters of ``text``: input ``x`` and the next characters ``y``."""

    def __init__(self, text: str, block: int) -> None:
        self.chars = sorted(set(text))
        index = {c: i for i, c in enumerate(self.chars)}
        self.data = torch.tensor([index[c] for c in text], dtype=torch.long)
        self.block = block
        if len(self.data) <= block + 1:
            raise ValueError(f"the corpus has {len(self.data)} characters, too few for --block {block}")

    @property
    def vocab(self) -> int:
        return len(self.chars)

    def __len__(self) -> int:
        return len(self.data) - self.block - 1

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[i : i + self.block + 1]
        return chunk[:-1], chunk[1:]


class ResumableSampler(DistributedSampler[int]):
    """A ``DistributedSampler`` that can start an epoch after its first ``skip_batches`` batches.

    Set ``skip_batches`` (with ``set_epoch``) before creating the loader's iterator; the epoch's shuffle is
    the sampler's own (seed + epoch), so the batches that follow are the ones a run that never stopped would
    see.
    """

    def __init__(self, dataset: Dataset[Any], *, batch_size: int, **kwargs: Any) -> None:
        super().__init__(dataset, drop_last=True, **kwargs)
        self.batch_size = batch_size
        self.skip_batches = 0

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        return iter(indices[self.skip_batches * self.batch_size :])

    def __len__(self) -> int:
        return super().__len__() - self.skip_batches * self.batch_size


class Block(nn.Module):
    """Pre-LN transformer block: causal self-attention and a GELU MLP, each with dropout on its residual."""

    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (
            z.view(b, t, self.heads, c // self.heads).transpose(1, 2)
            for z in self.qkv(self.ln1(x)).split(c, 2)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.drop(self.proj(y))
        return x + self.drop(self.mlp(self.ln2(x)))


class CharGPT(nn.Module):
    """Token and position embeddings, ``layers`` blocks, a final LayerNorm, a head tied to the embedding."""

    def __init__(
        self, vocab: int, *, block: int, width: int, layers: int, heads: int, dropout: float
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(block, width)
        self.blocks = nn.ModuleList(Block(width, heads, dropout) for _ in range(layers))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tok.weight
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * layers) if name.endswith("proj.weight") else 0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def lr_schedule(opt: torch.optim.Optimizer, warmup: int, steps: int) -> torch.optim.lr_scheduler.LRScheduler:
    """Linear warm-up over ``warmup`` steps, then cosine decay to 10% over the rest."""
    warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=max(warmup, 1))
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(
        opt, T_max=max(steps - warmup, 1), eta_min=0.1 * opt.defaults["lr"]
    )
    return torch.optim.lr_scheduler.SequentialLR(opt, [warm, cosine], milestones=[max(warmup, 1)])


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's global generators (the ones ``RNGState`` snapshots)."""
    random.seed(seed)
    numpy.random.seed(seed)
    torch.manual_seed(seed)


def tensor_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 over the names and the raw bytes of ``tensors``, in name order."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def model_optim_digest(model: nn.Module, opt: torch.optim.Optimizer) -> str:
    """The final-state digest: every tensor of the model's state dict and of the optimizer's state."""
    tensors = {f"model.{k}": v for k, v in model.state_dict().items()}
    for pid, per_param in opt.state_dict()["state"].items():
        tensors.update({f"optim.{pid}.{k}": v for k, v in per_param.items() if torch.is_tensor(v)})
    return tensor_digest(tensors)


class Recorder:
    """Appends JSON lines to the rank's files under ``out`` (nothing without ``out``)."""

    def __init__(self, out: str | None, rank: int) -> None:
        self.out, self.rank = out, rank
        if out:
            os.makedirs(out, exist_ok=True)

    def _append(self, kind: str, record: dict[str, Any]) -> None:
        if self.out:
            with open(os.path.join(self.out, f"{kind}-rank{self.rank}.jsonl"), "a") as f:
                f.write(json.dumps(record) + "\n")

    def event(self, name: str, t: float | None = None, **fields: Any) -> None:
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
        now = time.time() if t is None else t
        self._append("events", {"event": name, "t": now, "pid": os.getpid(), "restart": restart, **fields})

    def loss(self, step: int, loss: float, **fields: Any) -> None:
        self._append("losses", {"step": step, "loss": loss, "t": time.time(), "pid": os.getpid(), **fields})

    def final(self, name: str, record: dict[str, Any]) -> None:
        if self.out:
            path = os.path.join(self.out, name)
            with open(f"{path}.tmp", "w") as f:
                json.dump(record, f)
            os.replace(f"{path}.tmp", path)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200, help="optimizer steps in all (default %(default)s)")
    p.add_argument("--batch", type=int, default=16, help="sequences per rank per step (default %(default)s)")
    p.add_argument("--block", type=int, default=64, help="characters per sequence (default %(default)s)")
    p.add_argument("--width", type=int, default=128, help="model width (default %(default)s)")
    p.add_argument("--layers", type=int, default=4, help="transformer blocks (default %(default)s)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (default %(default)s)")
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=10, help="warm-up steps (default %(default)s)")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0,
                   help="DDP's gradient bucket size in MiB (default %(default)s, DDP's own)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default %(default)s)")
    p.add_argument("--step-delay", type=float, default=0.0,
                   help="idle seconds after each step, standing in for the accelerator's share of a step "
                        "on a CPU-only test machine")  # fmt: skip
    p.add_argument("--out", default=None, help="folder for per-step losses, events and the final digest")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    rec = Recorder(args.out, int(os.environ.get("RANK", 0)))
    rec.event("start", t=T_START, node=os.environ.get("SNAPSHOTD_SIDECAR", ""))
    dist.init_process_group("gloo")  # MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE from torchrun
    rank, world = dist.get_rank(), dist.get_world_size()
    rec.event("pg_ready")

    dataset = CharDataset(CORPUS, args.block)
    sampler = ResumableSampler(dataset, batch_size=args.batch, num_replicas=world, rank=rank, shuffle=True,
                               seed=args.seed)  # fmt: skip
    loader = DataLoader(dataset, batch_size=args.batch, sampler=sampler, drop_last=True,
                        generator=torch.Generator().manual_seed(args.seed))  # fmt: skip
    per_epoch = len(sampler) // args.batch
    if per_epoch < 1:
        raise SystemExit(
            f"--batch {args.batch} is more than the {len(sampler)} sequences of each rank's epoch"
        )
    torch.manual_seed(args.seed)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
    gpt = CharGPT(dataset.vocab, block=args.block, width=args.width, layers=args.layers, heads=args.heads,
                  dropout=args.dropout)  # fmt: skip
    model = DDP(gpt, bucket_cap_mb=args.bucket_cap_mb)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    sched = lr_schedule(opt, args.warmup, args.steps)
    seed_everything(args.seed * 1000 + rank + 1)  # each rank its own dropout masks
    rec.event("built")

    state = {"model": model, "optim": opt, "sched": sched, "rng": RNGState()}
    with Snapshotter(state) as snap:  # job, rank, world size and sidecar from torchrun's environment
        rec.event("restore_begin")
        start = snap.restore()
        rec.event("restored", step=start, source=snap.restored.get("source"))
        step = start
        while step < args.steps:
            epoch, skip = divmod(step, per_epoch)
            sampler.set_epoch(epoch)
            sampler.skip_batches = skip
            for x, y in loader:
                logits = model(x)
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
                opt.zero_grad(set_to_none=True)
                try:
                    loss.backward()  # DDP all-reduces the gradients: a lost peer shows here first
                except RuntimeError as exc:
                    rec.event("failed", step=step, error=str(exc)[:200])
                    raise
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                snap.capture(step + 1)
                step += 1
                rec.loss(step, loss.item(), stride=snap.stats.stride)
                if step == start + 1:
                    rec.event("first_step", step=step)
                if args.step_delay:
                    time.sleep(args.step_delay)
                if step == args.steps:
                    break
    parts = {key: tensor_digest(_state_tensors({key: obj})) for key, obj in state.items()}
    digest = model_optim_digest(model, opt)
    everything = tensor_digest(_state_tensors(state))
    final = {"rank": rank, "steps": step, "digest": digest, "state_digest": everything, "parts": parts}
    rec.final(f"final-rank{rank}.json", final)
    if rank == 0:
        rec.final("digest.json", {"steps": step, "digest": digest})
    rec.event("done", step=step)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _state_tensors(state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Every tensor (and NumPy array) in the state dicts of ``state`` by key path; any other value as JSON."""
    out: dict[str, torch.Tensor] = {}

    def walk(prefix: str, value: Any) -> None:
        if torch.is_tensor(value):
            out[prefix] = value
        elif isinstance(value, numpy.ndarray):
            out[prefix] = torch.from_numpy(numpy.ascontiguousarray(value))
        elif isinstance(value, Mapping):
            for k, v in value.items():
                walk(f"{prefix}.{k}", v)
        elif isinstance(value, list | tuple):
            for i, v in enumerate(value):
                walk(f"{prefix}.{i}", v)
        else:
            out[prefix] = torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8)

    for key, obj in state.items():
        walk(key, obj.state_dict())
    return out


if __name__ == "__main__":
    sys.exit(main())
