"""Running the training program's ranks (:mod:`.trainer`) as processes, and reading what they report.

:func:`run_ranks` starts ``world`` ranks of ``python -m snapshotd.harness.trainer`` and waits for them;
:func:`read_progress` reads the progress file rank 0 keeps (its last completed step); :func:`every_arg` and
:func:`plan_interval` read and interpret ``--every``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from .cluster import held_interrupts

__all__ = ["every_arg", "plan_interval", "read_progress", "run_ranks"]


def _tail(path: str, lines: int = 20) -> str:
    with contextlib.suppress(OSError), open(path, errors="replace") as f:
        return "".join(f.readlines()[-lines:])
    return ""


def read_progress(path: str) -> dict[str, int]:
    """A rank's progress file: ``step`` (the last step completed), and with snapshots the Snapshotter's
    ``stride`` and ``skipped`` at that step; zeros before the first step."""
    with contextlib.suppress(OSError, ValueError), open(path) as f:
        record = json.load(f)
        return {k: int(record.get(k, 0)) for k in ("step", "stride", "skipped")}
    return {"step": 0, "stride": 0, "skipped": 0}


def run_ranks(
    workdir: str,
    world: int,
    flags: list[str],
    *,
    timeout: float,
    on_progress: Callable[[int], None] | None = None,
) -> list[dict[str, Any]]:
    """Run ``world`` ranks of this program (``flags`` besides rank, world, init and out) and return their results.

    Each rank's output goes to ``workdir/train-rank{R}.log``, its result to ``train-rank{R}.json``. While they run,
    ``on_progress`` is called about four times a second with the steps rank 0 completed.

    Raises:
        RuntimeError: a rank exited non-zero, or the ranks ran past ``timeout`` seconds; every rank is killed
            first, and the failing rank's log tail is in the message.
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    logs = {r: os.path.join(workdir, f"train-rank{r}.log") for r in range(world)}
    outs = {r: os.path.join(workdir, f"train-rank{r}.json") for r in range(world)}
    progress = os.path.join(workdir, "train.progress")
    procs: dict[int, subprocess.Popen[bytes]] = {}
    try:
        for r in range(world):
            argv = [
                sys.executable,
                "-m",
                "snapshotd.harness.trainer",
                "--rank",
                str(r),
                "--world",
                str(world),
                "--init",
                f"tcp://127.0.0.1:{port}",
                "--out",
                outs[r],
                *flags,
            ]
            if r == 0:
                argv += ["--progress", progress]
            # the finally below stops what ``procs`` holds
            with (
                open(logs[r], "wb") as log,
                held_interrupts(),
            ):
                procs[r] = subprocess.Popen(
                    argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
                )
        deadline = time.monotonic() + timeout
        while True:
            codes = {r: proc.poll() for r, proc in procs.items()}
            failed = [r for r, code in codes.items() if code not in (None, 0)]
            if failed:
                raise RuntimeError(
                    f"rank {failed[0]} exited with {codes[failed[0]]}:\n{_tail(logs[failed[0]])}"
                )
            if on_progress is not None:
                on_progress(read_progress(progress)["step"])
            if all(code == 0 for code in codes.values()):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the ranks did not finish within {timeout:.0f} s:\n{_tail(logs[0])}")
            time.sleep(0.25)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)
    results = []
    for r in range(world):
        with open(outs[r]) as f:
            results.append(json.load(f))
    return results


def every_arg(text: str) -> int | str:
    """``--every``: a positive int, or ``auto``."""
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"--every must be a positive integer or auto, got {text!r}")
    return value


def plan_interval(every: int | str) -> int:
    """A snapshotd block's interval in ``--plan`` for ``--every`` (auto chooses its own: 1)."""
    return 1 if every == "auto" else int(every)
