"""``snapshotd-bench codec``: what a chunk costs on the wire path, and when a codec pays.

Two measurements, both on this machine's CPU:

1. **Zero-copy framing.** ``encode(Chunk(payload=<chunk>))`` + ``decode(frames)`` against a plain copy of the
   same number of bytes (``np.copyto`` into a preallocated array). Framing must cost a small fraction of one
   copy, whatever the chunk size (summary ``encode_decode_vs_memcpy``; the goal is < 0.05). ``memcpy_us``
   copies chunks from a 64 MiB working set, so that each copy streams from memory as a snapshot's does;
   ``memcpy_cached_us`` copies one chunk over and over (cache-resident when it fits: the best case for a copy).
2. **Codecs on real training state.** A small GPT (:mod:`snapshotd.harness.workloads`) trains a few AdamW steps;
   its parameters and Adam moments (``exp_avg``, ``exp_avg_sq``), in fp32 and cast to bf16, are cut into
   chunks as a snapshot would be, and each codec encodes and decodes every chunk. ``delta-lz4`` encodes the
   last step against the one before (the base a buddy holds). Random fp32 is the incompressible reference.
   One row per (data, codec): ratio (encoded / raw bytes, chunks that do not shrink count as raw),
   throughputs in raw bytes per second, and the break-even link rate below which the codec delivers a chunk
   sooner than ``raw`` (:func:`snapshotd.proto.codec.breakeven_rate`). ``raw`` itself has no row: ratio 1,
   no work. Delta rows also give ``entropy_ratio``: the XOR delta's entropy over its raw bits, each bit position
   of an element taken as an independent coin with the frequency measured in the data. No coder of that model
   encodes the delta smaller, so ``1 / entropy_ratio`` bounds what delta streaming can gain on a link where
   coding is free; summary ``delta_speedup_bound_fp32`` is that bound over the three fp32 tensors together, and
   ``delta_speedup_fp32`` what ``delta-lz4``'s ratios give on the same link (raw bytes over encoded bytes).

Timings are the best of ``--repeat`` passes (least disturbed by other load).
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from snapshotd.harness.workloads import GPT, config_for_params, make_optimizer, train_steps
from snapshotd.proto import Chunk, decode, encode
from snapshotd.proto.codec import breakeven_rate, checksum, compress_chunk, decompress_chunk
from snapshotd.units import format_bytes, parse_bytes

from .report import Report, save_figure

__all__ = ["add_arguments", "plot", "run"]

log = logging.getLogger(__name__)

_TENSORS = ("params", "exp_avg", "exp_avg_sq")
_CONFIG_KEYS = (
    "chunk",
    "params",
    "steps",
    "lr",
    "batch",
    "seq_len",
    "vocab",
    "random_bytes",
    "repeat",
    "seed",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``codec`` subcommand's flags."""
    parser.add_argument("--chunk", type=parse_bytes, default=4 << 20, help="chunk size (default 4MiB)")
    parser.add_argument("--params", type=int, default=4_000_000, help="model parameters (default 4e6)")
    parser.add_argument("--steps", type=int, default=30, help="AdamW steps before measuring (default 30)")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    parser.add_argument("--batch", type=int, default=4, help="sequences per training step (default 4)")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default 128)")
    parser.add_argument("--vocab", type=int, default=4096, help="vocabulary size (default 4096)")
    parser.add_argument(
        "--random-bytes",
        type=parse_bytes,
        default=16 << 20,
        help="size of the random fp32 data (default 16MiB)",
    )
    parser.add_argument("--repeat", type=int, default=3, help="timed passes; the best counts (default 3)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the model, batches and random data")


def run(args: argparse.Namespace) -> Report:
    """Measure framing and codecs as the module docstring says; see :func:`add_arguments` for ``args``."""
    if args.chunk < 1 or args.steps < 2 or args.repeat < 1:
        raise ValueError("need --chunk >= 1, --steps >= 2 and --repeat >= 1")
    summary: dict[str, Any] = {}
    summary.update(_zero_copy(args.chunk, args.repeat))

    data = _datasets(args)
    results = []
    for name, buf, elem, base in data:
        for codec in ("delta-lz4",) if base is not None else ("lz4", "shuffle-lz4"):
            row = _measure(name, codec, buf, elem, base, args.chunk, args.repeat)
            log.info("%s", row)
            results.append(row)

    raw_bytes = entropy_bytes = encoded_bytes = 0.0
    for row in results:
        kind, _, dtype = row["data"].rpartition("-")
        if row["codec"] == "delta-lz4" and kind in _TENSORS:
            summary[f"delta_ratio_{dtype}_{kind}"] = row["ratio"]
            summary[f"delta_breakeven_Gbit_{dtype}_{kind}"] = row["breakeven_Gbit"]
            if dtype == "fp32":
                raw_bytes += row["raw_bytes"]
                entropy_bytes += row["raw_bytes"] * row["entropy_ratio"]
                encoded_bytes += row["raw_bytes"] * row["ratio"]
        if row["codec"] == "shuffle-lz4" and kind == "params":
            summary[f"shuffle_ratio_{dtype}_params"] = row["ratio"]
    if entropy_bytes:
        summary["delta_speedup_fp32"] = raw_bytes / encoded_bytes
        summary["delta_speedup_bound_fp32"] = raw_bytes / entropy_bytes
    summary["best_breakeven_Gbit"] = max((r["breakeven_Gbit"] for r in results), default=0.0)
    summary["checksum_Bps"] = _checksum_rate(data[0][1], args.repeat)

    config: dict[str, Any] = {k: getattr(args, k) for k in _CONFIG_KEYS}
    cfg = config_for_params(args.params, vocab=args.vocab, seq_len=args.seq_len)
    config["model"] = {
        "d_model": cfg.d_model,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "n_params": cfg.n_params,
    }
    columns = [
        "data",
        "codec",
        "elem",
        "raw_bytes",
        "ratio",
        "compress_Bps",
        "decompress_Bps",
        "breakeven_Gbit",
        "entropy_ratio",
    ]
    return Report(bench="codec", config=config, results=results, summary=summary, columns=columns)


# ------------------------------------------------------------------------------------------- measurements


def _best_mean(fn: Callable[[], object], inner: int, repeat: int) -> float:
    """Seconds per call of ``fn``: the best over ``repeat`` batches of the mean over ``inner`` calls."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - start) / inner)
    return best


_COPY_WORKING_SET = 64 << 20
"""Bytes the cold-copy measurement cycles through: twice a typical last-level cache, so each copy streams from
memory as a snapshot's copy does (a snapshot is far larger than any cache)."""


def _zero_copy(chunk: int, repeat: int) -> dict[str, float]:
    """Framing one chunk (encode + decode) against copying it once, from memory and from cache."""
    nbuf = max(2, _COPY_WORKING_SET // chunk)
    src = np.full((nbuf, chunk), 0x5A, dtype=np.uint8)  # the contents do not matter to a copy or to framing
    dst = np.zeros_like(src)
    dst[:] = src  # fault the pages in before timing
    payload = memoryview(src[0])
    csum = checksum(payload)

    def frame() -> None:
        msg = decode(
            encode(Chunk(job="bench", rank=0, step=1, index=0, raw_len=chunk, checksum=csum, payload=payload))
        )
        assert isinstance(msg, Chunk) and msg.payload.nbytes == chunk

    def copy_cold() -> None:
        for i in range(nbuf):
            np.copyto(dst[i], src[i])

    passes = max(repeat, 5)
    framing = _best_mean(frame, 200, passes)
    cold = _best_mean(copy_cold, 1, passes) / nbuf
    hot = _best_mean(lambda: np.copyto(dst[0], src[0]), nbuf, passes)
    return {
        "encode_decode_us": framing * 1e6,
        "memcpy_us": cold * 1e6,
        "memcpy_cached_us": hot * 1e6,
        "encode_decode_vs_memcpy": framing / cold,
        "encode_decode_vs_cached_memcpy": framing / hot,
    }


def _checksum_rate(buf: memoryview, repeat: int) -> float:
    return buf.nbytes / _best_mean(lambda: checksum(buf), 3, repeat)


def _measure(
    name: str, codec: str, buf: memoryview, elem: int, base: memoryview | None, chunk: int, repeat: int
) -> dict[str, Any]:
    """Encode and decode every chunk of ``buf`` with ``codec``; one result row."""
    n = buf.nbytes
    spans = [(lo, min(lo + chunk, n)) for lo in range(0, n, chunk)]
    out = np.empty(n, dtype=np.uint8)
    encoded: list[tuple[str, Any]] = []

    def compress_all() -> None:
        encoded.clear()
        for lo, hi in spans:
            encoded.append(
                compress_chunk(codec, buf[lo:hi], base=None if base is None else base[lo:hi], elem=elem)
            )

    def decompress_all() -> None:
        for (used, payload), (lo, hi) in zip(encoded, spans, strict=True):
            b = None if base is None else base[lo:hi]
            decompress_chunk(used, payload, hi - lo, base=b, elem=elem, out=out[lo:hi].data)

    t_c = _best_mean(compress_all, 1, repeat)
    t_d = _best_mean(decompress_all, 1, repeat)
    if out.tobytes() != buf.tobytes():
        raise AssertionError(f"{codec} on {name} did not round-trip")
    ratio = sum(memoryview(p).nbytes for _, p in encoded) / n
    c_bps, d_bps = n / t_c, n / t_d
    entropy_ratio = None if base is None else _bit_entropy_ratio(buf, base, elem)
    return {
        "data": name,
        "codec": codec,
        "elem": elem,
        "raw_bytes": n,
        "ratio": ratio,
        "compress_Bps": c_bps,
        "decompress_Bps": d_bps,
        "breakeven_Gbit": breakeven_rate(ratio, c_bps, d_bps) * 8 / 1e9,
        "encoded_chunks": sum(used == codec for used, _ in encoded),
        "chunks": len(spans),
        "entropy_ratio": entropy_ratio,
    }


def _bit_entropy_ratio(buf: memoryview, base: memoryview, elem: int) -> float:
    """Entropy of ``buf XOR base`` over its raw bits, bit position ``i`` of every ``elem``-byte element being an
    independent coin whose frequency of ones is measured here (the ``entropy_ratio`` column)."""
    whole = buf.nbytes // elem * elem
    x = np.bitwise_xor(np.frombuffer(buf, np.uint8, whole), np.frombuffer(base, np.uint8, whole)).reshape(
        -1, elem
    )
    if not x.size:
        return 1.0
    bits = 0.0
    for j in range(elem):
        column = x[:, j]
        for b in range(8):
            p = float(np.count_nonzero(column & (1 << b))) / len(column)
            if 0.0 < p < 1.0:
                bits -= p * np.log2(p) + (1 - p) * np.log2(1 - p)
    return bits / (8 * elem)


# ----------------------------------------------------------------------------------------------- the data


def _datasets(args: argparse.Namespace) -> list[tuple[str, memoryview, int, memoryview | None]]:
    """``(name, bytes, element size, delta base or None)`` for every row group, plain data first."""
    rng = np.random.default_rng(args.seed)
    random_fp32 = rng.standard_normal(args.random_bytes // 4, dtype=np.float32)
    cfg = config_for_params(args.params, vocab=args.vocab, seq_len=args.seq_len)
    model = GPT(cfg, seed=args.seed)
    opt = make_optimizer(model, lr=args.lr)
    states: dict[int, dict[str, torch.Tensor]] = {}

    def keep(step: int) -> None:
        if step >= args.steps - 1:
            states[step] = _flat_state(model, opt)

    start = time.perf_counter()
    losses = train_steps(model, opt, cfg, args.steps, args.batch, args.seed + 1, on_step=keep)
    log.info(
        "trained %s params for %d steps in %.1f s (loss %.3f -> %.3f)",
        f"{cfg.n_params:,}",
        args.steps,
        time.perf_counter() - start,
        losses[0],
        losses[-1],
    )
    prev, last = states[args.steps - 1], states[args.steps]
    plain: list[tuple[str, memoryview, int, memoryview | None]] = [
        ("random-fp32", _bytes(random_fp32), 4, None)
    ]
    delta: list[tuple[str, memoryview, int, memoryview | None]] = []
    for kind in _TENSORS:
        for dtype, elem, cast in (("fp32", 4, _fp32), ("bf16", 2, _bf16)):
            cur = _bytes(cast(last[kind]).numpy())
            plain.append((f"{kind}-{dtype}", cur, elem, None))
            delta.append((f"{kind}-{dtype}", cur, elem, _bytes(cast(prev[kind]).numpy())))
    return plain + delta


def _flat_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Parameters and Adam moments, each concatenated flat (fp32) in parameter order, as a snapshot lays them."""
    params = list(model.parameters())
    return {
        "params": torch.cat([p.detach().reshape(-1) for p in params]),
        "exp_avg": torch.cat([opt.state[p]["exp_avg"].reshape(-1) for p in params]),
        "exp_avg_sq": torch.cat([opt.state[p]["exp_avg_sq"].reshape(-1) for p in params]),
    }


def _fp32(t: torch.Tensor) -> torch.Tensor:
    return t


def _bf16(t: torch.Tensor) -> torch.Tensor:
    """``t`` cast to bf16, as int16 so that numpy can hold its bytes."""
    return t.to(torch.bfloat16).view(torch.int16)


def _bytes(arr: np.ndarray) -> memoryview:
    return np.ascontiguousarray(arr).data.cast("B")


# ------------------------------------------------------------------------------------------------- plot


def plot(report: Report, path: str) -> None:
    """Bars of ratio and of compress/decompress throughput per (data, codec), to a PNG at ``path`` (Agg)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = report.results
    labels = [f"{r['data']}\n{r['codec']}" for r in rows]
    xs = np.arange(len(rows))
    fig = Figure(figsize=(max(8.0, 0.55 * len(rows)), 7.5), dpi=100)
    FigureCanvasAgg(fig)
    fig.suptitle(
        f"snapshotd-bench codec: chunk {format_bytes(report.config.get('chunk', 0))}; "
        f"framing/memcpy {report.summary.get('encode_decode_vs_memcpy', float('nan')):.3f}"
    )
    ax_ratio, ax_speed = fig.subplots(2, 1, sharex=True)
    ax_ratio.bar(xs, [r["ratio"] for r in rows], color="tab:blue")
    ax_ratio.axhline(1.0, color="gray", linewidth=0.8)
    ax_ratio.set_ylabel("ratio (encoded / raw)")
    ax_ratio.grid(True, axis="y", alpha=0.3)
    width = 0.4
    ax_speed.bar(xs - width / 2, [r["compress_Bps"] / 1e9 for r in rows], width, label="compress")
    ax_speed.bar(xs + width / 2, [r["decompress_Bps"] / 1e9 for r in rows], width, label="decompress")
    ax_speed.set_yscale("log")  # lz4 that gains nothing falls back to raw and runs 10x faster than the rest
    ax_speed.set_ylabel("GB/s (raw bytes, log)")
    ax_speed.legend()
    ax_speed.grid(True, axis="y", alpha=0.3)
    ax_speed.set_xticks(xs, labels, rotation=60, ha="right", fontsize=7)
    fig.tight_layout()
    save_figure(fig, path)
