"""``snapshotd-bench overhead --scenario ideal``: what the physical minimum's work costs beside the training step.

The headroom scenario's training (one rank of one thread, the same model and batch), in this process, in blocks of
``--steps`` steps that alternate ``none`` and ``ideal``, ``--rounds`` of each. After each ``ideal`` step the
rank copies its parameters and optimizer moments into a shared-memory arena (one ``torch._foreach_copy_``, as
``capture()`` does), and a sender process sends the arena whole over one loopback TCP connection to a receiver
process, which reads it into a buffer it reuses: the least work a snapshot's bytes can take off the rank to
another process's memory, with no checksums, no framing, no control messages and no pacing. A transfer still in
flight at the next step's end is waited for.

It prices the machine, not snapshotd: ``overhead``'s ``minimum_cpu_ms`` is measured alone, while the sidecars
work beside training, which makes every copy dearer (the caches and memory bandwidth are shared). Summary keys:
``ideal_step_ratio`` and ``ideal_mean_ratio`` (median and mean step time against ``none``),
``ideal_rank_cpu_ms_per_snapshot`` (the rank's CPU per step beyond ``none``'s: the copy, and the training's own
slowdown beside the transfer), ``ideal_pair_cpu_ms_per_snapshot`` (the sender's and receiver's CPU per
snapshot, user and system, beyond their idle rate), ``ideal_cpu_ms_per_snapshot`` (their sum),
``ideal_waited`` (steps that waited for the previous transfer), and beside them the run's ``minimum_cpu_ms``
and ``ideal_vs_minimum``.
"""

from __future__ import annotations

import argparse
import mmap
import multiprocessing
import os
import select
import socket
import time
from typing import Any

import numpy as np

from .baselines import process_cpu_times

__all__ = ["run_ideal"]

_TIMEOUT = 60.0


def _receive(ports: Any, nbytes: int) -> None:
    """The receiver: read ``nbytes`` at a time into one buffer, acknowledging each whole transfer."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        ports.put(server.getsockname()[1])
        conn, _ = server.accept()
    buf = memoryview(bytearray(nbytes))
    with conn:
        while True:
            got = 0
            while got < nbytes:
                n = conn.recv_into(buf[got:])
                if not n:
                    return
                got += n
            conn.sendall(b"k")


def _send(ports: Any, path: str, nbytes: int, port: int) -> None:
    """The sender: on each ``g`` from the rank, send the arena at ``path`` whole, then answer ``d``."""
    with open(path, "rb") as f:
        arena = mmap.mmap(f.fileno(), nbytes, prot=mmap.PROT_READ)
    with socket.create_connection(("127.0.0.1", port), timeout=_TIMEOUT) as data:
        with socket.create_server(("127.0.0.1", 0)) as server:
            ports.put(server.getsockname()[1])
            ctl, _ = server.accept()
        with ctl:
            while ctl.recv(1):
                data.sendall(memoryview(arena))
                if data.recv(1) != b"k":
                    return
                ctl.sendall(b"d")


def _sent(ctl: socket.socket) -> None:
    """Wait until the sender says the transfer in flight is whole at the receiver."""
    if ctl.recv(1) != b"d":
        raise RuntimeError("the ideal path's sender or receiver failed")


def _pair_cpu(pids: list[int]) -> float:
    times = [process_cpu_times(pid) or (0.0, 0.0) for pid in pids]
    return sum(user + system for user, system in times)


def run_ideal(args: argparse.Namespace, workdir: str) -> tuple[list[dict[str, Any]], dict[str, Any], int]:
    """Measure the ideal scenario (see the module docstring): its rows, its summary and the state's bytes.

    Raises:
        RuntimeError: the sender or receiver failed.
    """
    import torch

    from snapshotd.harness.workloads import GPT, config_for_params, make_batch, make_optimizer, train_step

    torch.set_num_threads(1)
    cfg = config_for_params(args.params)
    model = GPT(cfg, seed=0)
    opt = make_optimizer(model)
    batches = torch.Generator().manual_seed(1)
    train_step(model, opt, *make_batch(cfg, args.batch, batches))  # the optimizer's moments exist from here
    tensors: list[torch.Tensor] = [*model.parameters()]
    tensors += [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    path = os.path.join(workdir, "ideal-arena")
    with open(path, "wb") as f:
        f.truncate(nbytes)
    arena = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
    views, at = [], 0
    for t in tensors:
        n = t.numel() * t.element_size()
        views.append(arena[at : at + n].view(t.dtype).view(t.shape))
        at += n
    ctx = multiprocessing.get_context("spawn")
    ports = ctx.Queue()
    receiver = ctx.Process(target=_receive, args=(ports, nbytes), daemon=True)
    receiver.start()
    sender = ctx.Process(target=_send, args=(ports, path, nbytes, ports.get(timeout=_TIMEOUT)), daemon=True)
    sender.start()
    pids = [receiver.pid or 0, sender.pid or 0]
    per: dict[str, dict[str, list[float]]] = {
        v: {"step": [], "cpu": [], "pair": [], "wall": []} for v in ("none", "ideal")
    }
    waited = 0
    try:
        ctl = socket.create_connection(("127.0.0.1", ports.get(timeout=_TIMEOUT)), timeout=_TIMEOUT)
        with ctl:
            in_flight = False
            for _ in range(args.rounds):
                for variant in ("none", "ideal"):
                    for step in range(args.steps):
                        batch = make_batch(cfg, args.batch, batches)
                        c0, p0, t0 = time.process_time(), _pair_cpu(pids), time.perf_counter()
                        train_step(model, opt, *batch)
                        if variant == "ideal":
                            if in_flight:
                                waited += not select.select([ctl], [], [], 0)[0]
                                _sent(ctl)
                            torch._foreach_copy_(views, tensors)
                            ctl.sendall(b"g")
                            in_flight = True
                        if step >= args.warmup:
                            got = per[variant]
                            got["step"].append(time.perf_counter() - t0)
                            got["cpu"].append(time.process_time() - c0)
                            got["pair"].append(_pair_cpu(pids) - p0)
                    if in_flight:
                        _sent(ctl)
                    in_flight = False
    finally:
        for proc in (sender, receiver):
            proc.terminate()
            proc.join(10)
        os.unlink(path)
    none, ideal = per["none"], per["ideal"]
    idle = sum(none["pair"]) / sum(none["step"])  # the pair's CPU per second while no snapshot moves
    rank_ms = (np.mean(ideal["cpu"]) - np.mean(none["cpu"])) * 1e3
    pair_ms = (sum(ideal["pair"]) - idle * sum(ideal["step"])) / len(ideal["step"]) * 1e3
    rows = [
        {
            "scenario": "ideal",
            "variant": variant,
            "steps": len(got["step"]),
            "step_median_s": float(np.median(got["step"])),
            "step_mean_s": float(np.mean(got["step"])),
            "rank_cpu_ms": float(np.median(got["cpu"]) * 1e3),
        }
        for variant, got in per.items()
    ]
    summary = {
        "ideal_state_bytes": nbytes,
        "ideal_step_ratio": float(np.median(ideal["step"]) / np.median(none["step"])),
        "ideal_mean_ratio": float(np.mean(ideal["step"]) / np.mean(none["step"])),
        "ideal_rank_cpu_ms_per_snapshot": float(rank_ms),
        "ideal_pair_cpu_ms_per_snapshot": float(pair_ms),
        "ideal_cpu_ms_per_snapshot": float(rank_ms + pair_ms),
        "ideal_waited": waited,
    }
    return rows, summary, nbytes
