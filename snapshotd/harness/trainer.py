"""A real data-parallel training job for the demo, the integration tests and the benchmarks.

Each rank is a process (``python -m snapshotd.harness.trainer ...``) in a gloo process group, training the GPT of
:mod:`.workloads` wrapped in ``DistributedDataParallel`` (or, with ``--parallel fsdp2``, sharded with FSDP2's
``fully_shard``) with AdamW and a cosine LR schedule. Under DDP the Snapshotter is given the unwrapped model
(``ddp.module``), as many training scripts keep it, and finds the DDP wrapper itself. The
batch of step ``s`` on rank ``r`` depends only on ``(seed, r, s)``, so the data-loader position is the step
itself and a restored run sees exactly the batches a failure-free run sees. With ``--job`` the rank snapshots
every step through :class:`~snapshotd.client.Snapshotter` and restores on start, as a user's loop would.
``--device cuda`` trains on the GPU (gloo all-reduces the CUDA gradients).

For ``snapshotd-bench overhead``, ``--plan`` runs the steps in blocks, each block one variant: ``none``,
``snapshotd`` (capture after every ``--every``-th step; needs ``--job``) or a disk checkpoint every N steps the
way users take one today (``torch_save``, ``dcp_async``: :class:`~.baselines.DiskCheckpointer`, in
``--ckpt-dir``). After each block, untimed, the rank waits for that block's snapshot or save in flight, for the
kernel to write a disk checkpoint's dirty pages out (``os.sync``), and for the other ranks, so no block's work
spills into the next. Each block records when it began and when that wait ended (``began``, ``ended``: wall
clock), so that a harness can tell what other processes did during it.

Step times run from the top of one loop iteration to the end of the step, snapshot or checkpoint call and loss
read-out included (on CUDA the read-out waits for the step's kernels). ``blocked_times`` is, per step, the time
the training thread spent in the snapshot or checkpoint machinery: ``capture()`` plus the optimizer fence
(``capture_times``, ``fence_times``), or the checkpoint call. ``cpu_times`` is the CPU time of the whole process
(all its threads) per step.

:func:`run_ranks` starts the ranks of one job as processes and collects their results.

The rank writes a JSON result (losses per step, step times, a SHA-256 over its whole final state, the
snapshotter's stats, one record per block with its counters) and keeps a progress file holding the last completed
step and its snapshot stride (:func:`read_progress`).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import random
import select
import sys
import time
from typing import Any

import numpy
import torch
import torch.distributed as dist

from .checkpoints import CHECKPOINT_KINDS, DiskCheckpointer
from .ranks import every_arg, plan_interval
from .workloads import GPT, config_for_params, make_batch, make_optimizer

LINGER_SECONDS = 600.0
"""The longest ``--linger`` keeps a finished rank waiting for its stdin to close."""

__all__ = [
    "VARIANTS",
    "batch_for",
    "build_state",
    "main",
    "PARALLEL",
    "state_digest",
]

VARIANTS = ("none", "snapshotd", *CHECKPOINT_KINDS)
"""What a ``--plan`` block does after each step: nothing, a snapshot, or a disk checkpoint."""


def batch_for(cfg: Any, batch: int, seed: int, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of ``step`` (0-based) on ``rank``: a pure function of its arguments."""
    gen = torch.Generator().manual_seed((seed * 1_000_003 + rank) * 1_000_003 + step)
    return make_batch(cfg, batch, gen)


PARALLEL = ("ddp", "fsdp2")
"""How the model is wrapped: ``DistributedDataParallel``, or FSDP2's ``fully_shard`` per block and on the whole."""


def build_state(
    params: int,
    steps: int,
    seed: int,
    device: str = "cpu",
    *,
    parallel: str | None = None,
    bucket_mb: float = 1.0,
) -> tuple[Any, dict[str, Any], torch.nn.Module]:
    """The model, optimizer, scheduler and RNG of one rank, as the Snapshotter's state mapping, and the module
    that trains (the model itself, or its DDP wrapper).

    The model is initialised on the CPU (the same weights on every device) and then moved to ``device``. With
    ``parallel`` (a process group must be initialised) it is wrapped before its optimizer is made, so that under
    FSDP2 the optimizer holds the sharded parameters; under DDP the state holds the unwrapped model.
    """
    from snapshotd.client import RNGState

    if parallel not in (None, *PARALLEL):
        raise ValueError(f"parallel must be one of {PARALLEL} or None, got {parallel!r}")
    cfg = config_for_params(params)
    random.seed(seed)
    numpy.random.seed(seed)
    torch.manual_seed(seed)
    model = GPT(cfg, seed=seed).to(device)
    trained: torch.nn.Module = model
    if parallel == "ddp":
        trained = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_mb)
    elif parallel == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    opt = make_optimizer(model)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(steps, 1))
    return cfg, {"model": model, "optim": opt, "sched": sched, "rng": RNGState()}, trained


def state_digest(state: dict[str, Any]) -> str:
    """SHA-256 over every tensor byte and every non-tensor value of ``state`` (bit-identity check)."""
    from snapshotd.client.copies import copy_into
    from snapshotd.client.state import flatten

    flat = flatten(state)
    buf = torch.zeros(flat.data_bytes, dtype=torch.uint8)
    copy_into(flat, buf)
    h = hashlib.sha256(buf.numpy().tobytes())
    h.update(flat.meta)
    return h.hexdigest()


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _parse_plan(text: str) -> list[tuple[str, int, int]]:
    """``--plan``: a JSON list of ``[variant, interval, steps]`` blocks."""
    try:
        blocks = [(str(v), int(n), int(k)) for v, n, k in json.loads(text)]
    except (ValueError, TypeError) as exc:
        raise argparse.ArgumentTypeError(
            f"--plan must be a JSON list of [variant, interval, steps]: {exc}"
        ) from exc
    for variant, interval, steps in blocks:
        if variant not in VARIANTS or interval < 1 or steps < 1:
            raise argparse.ArgumentTypeError(
                f"bad --plan block {[variant, interval, steps]}: variants are {VARIANTS}"
            )
    return blocks


def _train_step(trained: Any, opt: Any, sched: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Forward, backward (DDP or FSDP2 reduces the gradients), optimizer and scheduler step; returns the loss."""
    logits = trained(x)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    sched.step()
    return loss


REPLICATED = ("model", "optim", "sched")
"""The state every data-parallel rank holds alike (``--replicated``); the RNG is each rank's own."""
_SNAP_COUNTERS = ("started", "skipped", "durable", "failed", "bytes", "copy_seconds")


def _wait_for_eof(fd: int, timeout: float) -> None:
    """Read and discard ``fd`` until it reaches end of file or ``timeout`` seconds pass, whichever is first."""
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        if select.select([fd], [], [], left)[0] and not os.read(fd, 65536):
            return


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m snapshotd.harness.trainer")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--init", required=True, help="torch.distributed init_method, e.g. tcp://127.0.0.1:29500")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--params", type=int, default=2_000_000)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--job", default=None, help="snapshot every step under this job name (default: no snapshots)"
    )
    p.add_argument("--sidecar", default=None, help="the node sidecar's ipc path")
    p.add_argument(
        "--every", type=every_arg, default=1, help="snapshot every K-th step, or auto (see Snapshotter)"
    )
    p.add_argument(
        "--replicated",
        action="store_true",
        help="snapshot the model, optimizer and scheduler once across the ranks (Snapshotter replicated=)",
    )
    p.add_argument("--out", required=True, help="result JSON path")
    p.add_argument("--progress", default=None, help="file holding the last completed step")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--parallel", choices=PARALLEL, default="ddp", help="DDP, or FSDP2 (fully_shard)")
    p.add_argument(
        "--bucket-mb",
        type=float,
        default=1.0,
        help="DDP's bucket_cap_mb (small: several gradient buckets even for the small models here)",
    )
    p.add_argument("--step-delay", type=float, default=0.0, help="extra seconds per step (pace the demo)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument(
        "--plan",
        type=_parse_plan,
        default=None,
        help='blocks of variants, e.g. \'[["none",1,8],["torch_save",1,8]]\' (see the module docstring)',
    )
    p.add_argument("--ckpt-dir", default=None, help="folder for the plan's disk checkpoints")
    p.add_argument(
        "--linger",
        action="store_true",
        help="after the last step, keep the process (and its snapshots) until stdin closes, at most "
        f"{LINGER_SECONDS:.0f} s: a harness injecting a fault near the end never races the job's end",
    )
    p.add_argument(
        "--digest",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="hash the final state into the result (--no-digest: digests are null)",
    )
    args = p.parse_args(argv)
    if args.plan is not None:
        variants = {v for v, _, _ in args.plan}
        if sum(k for _, _, k in args.plan) != args.steps:
            p.error("--plan's blocks must add up to --steps")
        if "snapshotd" in variants and (
            not args.job or any(n != plan_interval(args.every) for v, n, _ in args.plan if v == "snapshotd")
        ):
            p.error("--plan's snapshotd blocks need --job and their interval equal to --every (1 for auto)")
        if variants & set(CHECKPOINT_KINDS) and not args.ckpt_dir:
            p.error("--plan's disk checkpoints need --ckpt-dir")

    torch.set_num_threads(args.threads)
    if args.device == "cuda":
        torch.cuda.set_device(args.rank % torch.cuda.device_count())
    dist.init_process_group(
        "gloo",
        init_method=args.init,
        rank=args.rank,
        world_size=args.world,
        timeout=__import__("datetime").timedelta(seconds=60),
    )
    cfg, state, trained = build_state(
        args.params, args.steps, args.seed, args.device, parallel=args.parallel, bucket_mb=args.bucket_mb
    )
    model, opt, sched = state["model"], state["optim"], state["sched"]
    snap = None
    start = 0
    restore_seconds = 0.0
    if args.job:
        from snapshotd.client import Snapshotter

        snap = Snapshotter(
            state,
            job=args.job,
            rank=args.rank,
            world_size=args.world,
            sidecar=args.sidecar,
            every=args.every,
            replicated=REPLICATED if args.replicated else (),
        )
        t0 = time.perf_counter()
        start = snap.restore()
        restore_seconds = time.perf_counter() - t0
    if args.plan is not None and start:
        raise RuntimeError(f"--plan needs a fresh job, but job {args.job!r} restored step {start}")
    plan = args.plan or [
        ("snapshotd" if snap is not None else "none", plan_interval(args.every), args.steps - start)
    ]
    dcp_group = dist.new_group(backend="gloo") if any(v == "dcp_async" for v, _, _ in plan) else None
    checkpointers: dict[tuple[str, int], DiskCheckpointer] = {}
    losses: dict[int, float] = {}
    step_times: list[float] = []
    capture_times: list[float] = []
    fence_times: list[float] = []
    blocked_times: list[float] = []
    cpu_times: list[float] = []
    blocks: list[dict[str, Any]] = []
    step = start
    for variant, interval, nsteps in plan:
        ckpt = None
        if variant in CHECKPOINT_KINDS:
            if (variant, interval) not in checkpointers:
                folder = os.path.join(args.ckpt_dir, f"{variant}-{interval}")
                os.makedirs(folder, exist_ok=True)
                checkpointers[variant, interval] = DiskCheckpointer(
                    variant, state, folder, interval=interval, rank=args.rank, process_group=dcp_group
                )
            ckpt = checkpointers[variant, interval]
        capturing = snap if variant == "snapshotd" else None
        first = len(step_times)
        began = time.time()
        snap0 = {k: getattr(snap.stats, k) for k in _SNAP_COUNTERS} if snap is not None else {}
        saves0 = (ckpt.started, ckpt.completed) if ckpt is not None else (0, 0)
        for _ in range(nsteps):
            t0 = time.perf_counter()
            cpu0 = time.process_time()
            before = (
                (snap.stats.capture_seconds, snap.stats.fence_seconds) if snap is not None else (0.0, 0.0)
            )
            x, y = (t.to(args.device) for t in batch_for(cfg, args.batch, args.seed, args.rank, step))
            loss = _train_step(trained, opt, sched, x, y)
            blocked = 0.0
            if capturing is not None:
                capturing.capture(step + 1)
            if ckpt is not None:
                blocked = ckpt.after_step(step + 1)
            if snap is not None:
                capture_times.append(snap.stats.capture_seconds - before[0])
                fence_times.append(snap.stats.fence_seconds - before[1])
                blocked += capture_times[-1] + fence_times[-1]
            losses[step + 1] = float(loss.detach())
            step_times.append(time.perf_counter() - t0)
            blocked_times.append(blocked)
            cpu_times.append(time.process_time() - cpu0)
            step += 1
            if args.progress:
                record = {"step": step}
                if snap is not None:
                    record.update(stride=snap.stats.stride, skipped=snap.stats.skipped)
                _write_atomic(args.progress, json.dumps(record))
            if args.step_delay:
                time.sleep(args.step_delay)
        if args.plan is not None:  # drain, untimed, so that no block's work spills into the next one
            if capturing is not None:
                capturing.wait(timeout=30)
            if ckpt is not None:
                ckpt.finish()
                os.sync()  # the page cache's writeback of the saves would otherwise slow the next block
            dist.barrier()
        block: dict[str, Any] = {
            "variant": variant,
            "interval": interval,
            "first": first,
            "steps": nsteps,
            "began": began,
            "ended": time.time(),
        }
        if capturing is not None:
            block.update({k: getattr(capturing.stats, k) - v for k, v in snap0.items()})
        if ckpt is not None:
            block.update(
                saves_started=ckpt.started - saves0[0],
                saves_completed=ckpt.completed - saves0[1],
                bytes_written=ckpt.bytes_written,
            )
        blocks.append(block)
    stats: dict[str, Any] = {}
    if snap is not None:
        snap.wait(timeout=30)
        stats = dataclasses.asdict(snap.stats)
    for ckpt in checkpointers.values():
        ckpt.finish()
    result = {
        "rank": args.rank,
        "start_step": start,
        "losses": losses,
        "step_times": step_times,
        "digest": state_digest(state) if args.digest else None,
        "digests": {k: state_digest({k: v}) for k, v in state.items()} if args.digest else {},
        "stats": stats,
        "restore_seconds": restore_seconds,
        "restored": snap.restored if snap is not None else {},
        "capture_times": capture_times,
        "fence_times": fence_times,
        "blocked_times": blocked_times,
        "cpu_times": cpu_times,
        "blocks": blocks,
        "device": args.device,
        "state_bytes": sum(t.numel() * t.element_size() for t in model.state_dict().values())
        + sum(
            t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if torch.is_tensor(t)
        ),
    }
    _write_atomic(args.out, json.dumps(result))
    if args.linger:
        _wait_for_eof(sys.stdin.fileno(), LINGER_SECONDS)
    if snap is not None:
        snap.close()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
