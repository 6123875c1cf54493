"""Data loaders resume at exactly the batch the uninterrupted run would have drawn next (a real sidecar).

Each case runs a training loop's data side twice: uninterrupted, and crashed after step ``CRASH`` (the process
"dies": its Snapshotter exits on an exception, keeping its arena) and restarted (a new loader, a new
Snapshotter, ``restore()``). The restarted run must draw the same batches and the same random numbers from the
global RNG (standing in for dropout) as the uninterrupted one, step for step.

The loops are the patterns the README documents:

- torchdata's ``StatefulDataLoader`` as a state value (0 and 2 workers), with a random sampler or a
  ``StatefulDistributedSampler``, and with the next batch prefetched before the step trains (held in a dict in
  the state, so the snapshot always sees the batch the loop holds now).
- A plain ``DataLoader`` with a ``DistributedSampler``: the loop keeps the epoch and the batch index in the
  state and, on restore, starts the epoch's sampler that many batches in (without loading the batches skipped).
  The loader has a generator of its own: otherwise each new iterator draws its workers' base seed from the
  global RNG, and the restarted process makes one more iterator than the uninterrupted one did.

Random transforms that run inside loader workers draw from each worker's own RNG, which no loader state carries;
these datasets seed them per sample, as the README says to.
"""

from __future__ import annotations

import contextlib
import itertools
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from snapshotd.client import RNGState, Snapshotter
from snapshotd.harness.cluster import LocalCluster

pytest.importorskip("torchdata")
from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

STEPS = 14  # more than one epoch of every loader below
CRASH = 9  # the first run dies after this step (in the second epoch)


class Augmented(Dataset):
    """Samples ``[index, noise]``, the noise drawn from a generator seeded by the index and the epoch: the same
    in any worker, on any resume."""

    def __init__(self, n: int = 24) -> None:
        self.n = n
        self.epoch = 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(i * 1_000 + self.epoch)
        return torch.tensor([float(i), torch.rand(1, generator=gen).item()])


class _Crash(Exception):
    """The process dies here (the Snapshotter keeps its arena, as after SIGKILL)."""


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The ipc path of node A's sidecar (node B is its buddy), shared by this module's tests (one job each)."""
    with LocalCluster(str(tmp_path_factory.mktemp("loaders"))) as cluster:
        cluster.start_coordinator()
        cluster.start_sidecar("A")
        cluster.start_sidecar("B")
        yield cluster.ipc_path("A")


def _stateful_loop(workers: int, distributed: bool, prefetch: bool) -> Callable[..., dict[int, Any]]:
    """The data side of a training loop over a StatefulDataLoader; returns the batch and noise of each step."""

    def run(ipc: str, job: str, crash_after: int | None) -> dict[int, Any]:
        data = Augmented()
        sampler = (
            StatefulDistributedSampler(data, num_replicas=2, rank=1, shuffle=True, seed=7)
            if distributed
            else None
        )
        loader = StatefulDataLoader(
            data,
            batch_size=3,
            shuffle=None if distributed else True,
            sampler=sampler,
            num_workers=workers,
            generator=torch.Generator().manual_seed(3),
        )
        loop: dict[str, Any] = {"epoch": 0, "next": None}
        state = {"loader": loader, "loop": loop, "rng": RNGState()}
        seen: dict[int, Any] = {}

        def batches() -> Iterator[torch.Tensor]:
            while True:
                if sampler is not None:
                    sampler.set_epoch(loop["epoch"])
                yield from loader
                loop["epoch"] += 1

        # closing it stops the loader's workers
        with (
            Snapshotter(
                state, job=job, rank=0, world_size=1, sidecar=ipc, timeout=10, when_busy="block"
            ) as snap,
            contextlib.closing(batches()) as it,
        ):
            start = snap.restore(timeout=30)
            if prefetch and loop["next"] is None:
                loop["next"] = next(it)
            for step in range(start, STEPS):
                if prefetch:  # the next batch is fetched before this one trains
                    batch, loop["next"] = loop["next"], next(it)
                else:
                    batch = next(it)
                seen[step + 1] = (batch.tolist(), torch.rand(1).item())
                assert snap.capture(step + 1) and snap.wait(10)
                if step + 1 == crash_after:
                    raise _Crash
        return seen

    return run


class ResumableDistributedSampler(DistributedSampler):
    """A DistributedSampler whose next epoch starts ``start`` samples in (the README's plain-DataLoader pattern)."""

    start = 0

    def __iter__(self) -> Iterator[int]:
        start, self.start = self.start, 0
        return itertools.islice(super().__iter__(), start, None)

    def __len__(self) -> int:
        return super().__len__() - self.start


def _plain_loop(ipc: str, job: str, crash_after: int | None) -> dict[int, Any]:
    """The data side of a loop over a plain DataLoader + DistributedSampler, resumed from the loop's counters."""
    data = Augmented()
    sampler = ResumableDistributedSampler(data, num_replicas=2, rank=0, shuffle=True, seed=7)
    # its own generator: creating an iterator (each epoch, and once more on resume) then never draws from the
    # global RNG that RNGState restores
    loader = DataLoader(data, batch_size=3, sampler=sampler, num_workers=2, generator=torch.Generator())
    loop = {"epoch": 0, "batch": 0}  # the next batch to draw
    state = {"loop": loop, "rng": RNGState()}
    seen: dict[int, Any] = {}
    with Snapshotter(
        state, job=job, rank=0, world_size=1, sidecar=ipc, timeout=10, when_busy="block"
    ) as snap:
        step = snap.restore(timeout=30)
        while step < STEPS:
            sampler.set_epoch(loop["epoch"])
            data.epoch = loop["epoch"]
            sampler.start = loop["batch"] * loader.batch_size  # type: ignore[operator]
            for batch in (epoch := iter(loader)):
                loop["batch"] += 1
                seen[step + 1] = (batch.tolist(), torch.rand(1).item())
                step += 1
                assert snap.capture(step) and snap.wait(10)
                if step == crash_after:
                    del epoch  # its workers stop now, not when the test's traceback is dropped
                    raise _Crash
                if step == STEPS:
                    break
            else:
                loop["epoch"], loop["batch"] = loop["epoch"] + 1, 0
    return seen


def _finished(run: Callable[..., dict[int, Any]], *args: Any) -> dict[int, Any] | None:
    """``run(*args)``, or None if it crashed. Either way its loader and the loader's workers are gone when this
    returns: nothing holds them (the crash's traceback is dropped here, and a closed Snapshotter lets go of its
    state), so they are freed at once rather than by the garbage collector, which finalizes a loader's queues
    before its iterator and so leaves its workers waiting for a stop message until their join times out."""
    try:
        return run(*args)
    except _Crash:
        return None


CASES = {
    "stateful, 0 workers": _stateful_loop(0, distributed=False, prefetch=False),
    "stateful, 2 workers, prefetched batch": _stateful_loop(2, distributed=False, prefetch=True),
    "stateful distributed sampler, 2 workers, prefetched batch": _stateful_loop(
        2, distributed=True, prefetch=True
    ),
    "plain DataLoader + DistributedSampler, 2 workers": _plain_loop,
}


@pytest.mark.parametrize("case", list(CASES))
def test_resumed_loader_draws_the_uninterrupted_runs_batches(sidecar: str, case: str) -> None:
    run = CASES[case]
    torch.manual_seed(0)
    reference = _finished(run, sidecar, f"ref-{uuid.uuid4().hex[:6]}", None)
    job = f"crash-{uuid.uuid4().hex[:6]}"
    torch.manual_seed(0)
    assert _finished(run, sidecar, job, CRASH) is None, "the first run did not crash"
    torch.manual_seed(123)  # the restarted process's RNG starts elsewhere; restore() puts it back
    resumed = _finished(run, sidecar, job, None)
    assert resumed is not None and reference is not None
    assert sorted(reference) == list(range(1, STEPS + 1))
    assert sorted(resumed) == list(range(CRASH + 1, STEPS + 1)), "the restart resumed at the wrong step"
    for step in resumed:
        assert resumed[step] == reference[step], f"step {step}: {resumed[step]} != {reference[step]}"
    assert len({tuple(map(tuple, reference[s][0])) for s in reference}) > STEPS // 2  # real, varied batches
