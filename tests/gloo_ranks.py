"""Run a test body on several spawned processes joined in a gloo process group, and collect their results."""

from __future__ import annotations

import datetime
import multiprocessing
import os
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["run_gloo_ranks"]

# the ranks fork from one server process that imported torch once, instead of each importing it
multiprocessing.set_forkserver_preload(["torch", "torch.distributed", __name__])


def _entry(rank: int, body: Callable[[int], Any], world: int, out_dir: str) -> None:
    try:
        store = dist.FileStore(os.path.join(out_dir, "store"), world)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
        )
        torch.set_num_threads(1)
        result = body(rank)
        Path(out_dir, f"rank{rank}.txt").write_text(repr(result))
        dist.destroy_process_group()
    except BaseException:
        Path(out_dir, f"rank{rank}.err").write_text(traceback.format_exc())
        raise


def run_gloo_ranks(
    body: Callable[[int], Any], world: int, tmp_path: Path, timeout: float = 120.0
) -> list[Any]:
    """``body(rank)`` on ``world`` spawned ranks of a gloo group (one intra-op thread each); their results.

    ``body`` must be a module-level function (it is pickled), and its result a ``repr`` that ``eval`` reads back
    (plain data). Fails the test, with the first rank's traceback, when a rank raises, gives no result, or the
    ranks run past ``timeout``; every rank is killed before this returns.
    """
    out_dir = os.fspath(tmp_path)
    ctx = mp.start_processes(
        _entry, args=(body, world, out_dir), nprocs=world, join=False, start_method="forkserver"
    )
    exited: Exception | None = None
    try:
        for _ in range(int(timeout / 0.5)):
            try:
                if ctx.join(timeout=0.5):
                    break
            except (mp.ProcessExitedException, mp.ProcessRaisedException) as exc:  # reported below
                exited = exc
                break
        else:
            pytest.fail(f"the ranks did not finish within {timeout:.0f} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
            p.join(10)
    errors = sorted(tmp_path.glob("rank*.err"))
    assert not errors, errors[0].read_text()
    missing = [r for r in range(world) if not (tmp_path / f"rank{r}.txt").exists()]
    assert not missing, f"ranks {missing} wrote no results ({exited})"
    return [eval((tmp_path / f"rank{r}.txt").read_text()) for r in range(world)]  # noqa: S307 - our own repr
