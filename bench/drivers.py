"""Training-rank stand-ins that benchmarks run as separate processes, each holding a real Snapshotter.

A driver registers with its node's sidecar as rank 0 of a one-rank job, ``restore()``s (a fresh job), then
snapshots step after step with ``when_busy="block"`` and times each step from ``capture()`` until the sidecar
reports it durable (every buddy acknowledged every chunk). Before timing, it captures until one step is
durable: the sidecar learns the rank's buddy from the coordinator's next heartbeat reply, so the very first
capture may find no buddy yet, and a delta codec needs a base that the buddy holds complete; then it takes
``--settle`` untimed snapshots (see :data:`SETTLE`), so that what is timed is the steady state of a long job.

::

    python -m snapshotd.bench.drivers transport --job J --sidecar IPC --size BYTES [--repeat N] [--timeout S]
    python -m snapshotd.bench.drivers train --job J --sidecar IPC [--params P] [--repeat N] [--timeout S]

``transport`` snapshots a few big fp32 tensors totalling ``--size`` and changes one element per step (a new
step with the same bytes to move); its state holds no optimizer, so ``capture()`` copies into shared memory
synchronously and returns only when the copy is done. ``train`` snapshots the GPT of :mod:`.workloads` with
AdamW (parameters and both moments) after every real optimizer step; its copy runs in the background.

Each prints one JSON line on stdout: ``state_bytes`` (tensor bytes per snapshot), ``seconds`` (per timed step,
capture() called -> durable), ``stage_seconds`` (inside capture()), ``warmup_captures`` and the Snapshotter's
``stats``. A stream that fails or a step that is not durable within ``--timeout`` exits non-zero.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from snapshotd.client import Snapshotter
from snapshotd.units import parse_bytes

__all__ = ["UNPACED", "main", "train_driver", "transport_driver"]

_POLL = 0.05
UNPACED = "1000GB/s"
"""A sidecar ``--max-rate`` no link reaches, for harnesses that measure what a stream can move: ``auto`` spreads
each stream over two thirds of its rank's step on purpose, and a driver's step here is its stream."""
SETTLE = 4
"""Untimed snapshots after the first durable one. The buddy's memory for its first few snapshots is fresh (it
holds up to three per rank until the durable watermark passes them, plus the arriving one), and its allocator
reuses that memory from then on; on this project's VM the first touch of fresh memory costs about 2 s per GiB
(measured: writing a fresh 256 MiB buffer 566 ms, the same after a free 25 ms), which a long job pays once."""


def _wait_durable(snap: Snapshotter, deadline: float) -> None:
    """Return once the last started snapshot is durable.

    Raises:
        RuntimeError: the sidecar reported that the stream failed.
        TimeoutError: not durable by ``deadline`` (``time.monotonic``).
    """
    failed = snap.stats.failed
    while not snap.wait(timeout=_POLL):
        if snap.stats.failed > failed:
            raise RuntimeError(f"snapshot not durable: {snap.stats.last_error}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"snapshot not durable in time ({snap.stats})")


def _first_durable(snap: Snapshotter, advance: Callable[[int], None], deadline: float) -> int:
    """Capture steps 1, 2, ... (``advance(step)`` makes the state that step's) until one is durable.

    Returns the number of captures it took. A capture that found no buddy assigned yet fails quickly; the next
    step is then tried.

    Raises:
        TimeoutError: no step durable by ``deadline``.
    """
    step = 0
    while True:
        step += 1
        advance(step)
        failed = snap.stats.failed
        if snap.capture(step):
            while time.monotonic() < deadline:
                if snap.wait(timeout=_POLL):
                    return step
                if snap.stats.failed > failed:
                    break
        if time.monotonic() > deadline:
            raise TimeoutError(f"no snapshot became durable in time ({snap.stats.last_error or snap.stats})")


def _timed_steps(
    snap: Snapshotter, advance: Callable[[int], None], first: int, repeat: int, deadline: float
) -> tuple[list[float], list[float]]:
    """Steps ``first .. first + repeat - 1``: per step, (capture -> durable, inside capture) seconds.

    Raises:
        RuntimeError: a capture was skipped or its stream failed.
        TimeoutError: a step was not durable by ``deadline``.
    """
    total, stage = [], []
    for step in range(first, first + repeat):
        advance(step)
        t0 = time.perf_counter()
        if not snap.capture(step):
            raise RuntimeError(f"capture({step}) was skipped: {snap.stats.last_error or 'no free slot'}")
        t1 = time.perf_counter()
        _wait_durable(snap, deadline)
        total.append(time.perf_counter() - t0)
        stage.append(t1 - t0)
    return total, stage


def _measure(
    snap: Snapshotter, advance: Callable[[int], None], repeat: int, settle: int, timeout: float
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    t0 = time.perf_counter()
    restored = snap.restore(timeout=min(timeout, 60.0))
    if restored != 0:
        raise RuntimeError(f"job already has step {restored}: use a fresh job name")
    t1 = time.perf_counter()
    warmup = _first_durable(snap, advance, deadline)
    _timed_steps(snap, advance, warmup + 1, settle, deadline)
    warmup += settle
    t2 = time.perf_counter()
    seconds, stage = _timed_steps(snap, advance, warmup + 1, repeat, deadline)
    stats = dataclasses.asdict(snap.stats)
    return {
        "state_bytes": stats["bytes"] // max(1, stats["started"]),
        "seconds": seconds,
        "stage_seconds": stage,
        "warmup_captures": warmup,
        "restore_seconds": t1 - t0,
        "warmup_seconds": t2 - t1,
        "stats": stats,
    }


def transport_driver(
    *, job: str, sidecar: str, size: int, repeat: int, settle: int, timeout: float
) -> dict[str, Any]:
    """Snapshot ``size`` bytes of fp32 (up to four tensors) ``repeat`` timed times; see the module docstring.

    Raises:
        ValueError: ``size`` is not a positive multiple of 4, or ``repeat < 1``.
    """
    if size < 4 or size % 4 or repeat < 1 or settle < 0:
        raise ValueError(
            f"need a positive size that is a multiple of 4, repeat >= 1 and settle >= 0, got {size}, {repeat}, {settle}"
        )
    torch.set_num_threads(1)
    n = size // 4
    parts = min(4, n)
    # Every page written: the copies read real memory, not the shared zero page.
    tensors = [torch.full((n // parts + (i < n % parts),), float(i + 1)) for i in range(parts)]

    def advance(step: int) -> None:
        t = tensors[step % parts]
        t[step % t.numel()] += 1.0

    return _measure_state({"tensors": tensors}, advance, job, sidecar, repeat, settle, timeout)


def _measure_state(
    state: dict[str, Any],
    advance: Callable[[int], None],
    job: str,
    sidecar: str,
    repeat: int,
    settle: int,
    timeout: float,
) -> dict[str, Any]:
    """:func:`_measure` with a Snapshotter of ``state`` (rank 0 of 1, waiting for a slot when none is free)."""
    with Snapshotter(
        state, job=job, rank=0, world_size=1, sidecar=sidecar, when_busy="block", timeout=timeout
    ) as snap:
        return _measure(snap, advance, repeat, settle, timeout)


def train_driver(
    *,
    job: str,
    sidecar: str,
    params: int,
    repeat: int,
    settle: int,
    timeout: float,
    batch: int = 2,
    seq_len: int = 64,
    lr: float = 1e-3,
    seed: int = 0,
) -> dict[str, Any]:
    """Train the GPT of :mod:`.workloads` (about ``params`` parameters) with AdamW, snapshotting every step.

    Only snapshots are timed; each training step runs before its capture, outside the timing. Two runs with
    the same arguments train bit-identically (one torch thread, seeded), so they stream the same states.
    """
    from snapshotd.harness.workloads import GPT, config_for_params, make_batch, make_optimizer, train_step

    torch.set_num_threads(1)
    cfg = config_for_params(params, seq_len=seq_len)
    model = GPT(cfg, seed=seed)
    opt = make_optimizer(model, lr=lr)
    gen = torch.Generator().manual_seed(seed + 1)

    def advance(step: int) -> None:
        x, y = make_batch(cfg, batch, gen)
        train_step(model, opt, x, y)

    out = _measure_state({"model": model, "optim": opt}, advance, job, sidecar, repeat, settle, timeout)
    out["n_params"] = cfg.n_params
    return out


def main(argv: list[str] | None = None) -> int:
    """Run one driver (``sys.argv[1:]`` when ``argv`` is None) and print its JSON line."""
    p = argparse.ArgumentParser(prog="python -m snapshotd.bench.drivers")
    sub = p.add_subparsers(dest="driver", required=True)
    for name in ("transport", "train"):
        s = sub.add_parser(name)
        s.add_argument("--job", required=True)
        s.add_argument("--sidecar", required=True, help="the sidecar's ipc path")
        s.add_argument("--repeat", type=int, default=5, help="timed snapshots (default %(default)s)")
        s.add_argument(
            "--settle",
            type=int,
            default=SETTLE,
            help="untimed snapshots before the timed ones (default %(default)s)",
        )
        s.add_argument("--timeout", type=float, default=300.0, help="seconds for the whole run")
        if name == "transport":
            s.add_argument("--size", type=parse_bytes, required=True, help="state bytes (multiple of 4)")
        else:
            s.add_argument("--params", type=int, default=20_000_000, help="GPT parameters")
            s.add_argument("--batch", type=int, default=2)
            s.add_argument("--seq-len", type=int, default=64)
            s.add_argument("--lr", type=float, default=1e-3)
            s.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    common = {
        "job": args.job,
        "sidecar": args.sidecar,
        "repeat": args.repeat,
        "settle": args.settle,
        "timeout": args.timeout,
    }
    if args.driver == "transport":
        result = transport_driver(size=args.size, **common)
    else:
        result = train_driver(
            params=args.params, batch=args.batch, seq_len=args.seq_len, lr=args.lr, seed=args.seed, **common
        )
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
