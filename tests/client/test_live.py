"""Live mode's contracts without processes: which errors are a peer's loss, the epoch protocol on a real
TCPStore, and the arguments refused. The whole story (real ranks, a node killed) is tests/integration/test_live.py."""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from snapshotd.client import PeerLost, Snapshotter, live
from snapshotd.client.group import LiveGroup
from snapshotd.client.peers import is_peer_failure
from snapshotd.client.watchdog import HANG_CHECK_S


def test_a_peer_failure_is_a_gloo_transport_error_or_a_dist_error_and_nothing_else() -> None:
    gloo = RuntimeError(
        "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
        "[127.0.0.1]:5305. This is typically caused by a remote worker crashing."
    )
    assert is_peer_failure(gloo)
    assert is_peer_failure(RuntimeError("Connection reset by peer"))
    assert is_peer_failure(dist.DistNetworkError("timed out"))
    assert not is_peer_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_peer_failure(ValueError("Connection closed by peer"))


@pytest.fixture
def store() -> Iterator[dist.TCPStore]:
    server = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=10)
    )
    yield server


def _group(store: dist.TCPStore, rank: int, world_size: int = 2, job: str = "j") -> LiveGroup:
    return LiveGroup(
        store,
        job=job,
        rank=rank,
        world_size=world_size,
        backend="gloo",
        timeout=5.0,
        join_timeout=5.0,
        attempts=2,
    )


def test_an_epoch_is_full_when_every_rank_arrived_and_a_second_arrival_abandons_an_undecided_one(
    store,
) -> None:
    a, b = _group(store, 0), _group(store, 1)
    assert a._arrive(0) and b._arrive(0)
    assert store.get("snapshotd/j/e0/decided") == b"full"
    again = _group(store, 1)  # rank 1's replacement, arriving where its old self did
    assert not again._arrive(0)
    assert store.get("snapshotd/j/e0/decided") == b"full", "the first decision holds"
    assert a._arrive(1) and not _group(store, 0)._arrive(1)
    assert store.get("snapshotd/j/e1/decided") == b"abandoned"
    assert b._arrive(1) and store.get("snapshotd/j/e1/decided") == b"abandoned", "an arrival never undoes it"


def test_the_next_epoch_is_opened_once_however_many_ranks_ask(store) -> None:
    a, b = _group(store, 0), _group(store, 1)
    assert int(a.store.compare_set("epoch", "", "0")) == 0
    assert a._open_after(0) == 1
    assert b._open_after(0) == 1, "the second survivor finds the epoch open"
    assert b._open_after(1) == 2
    assert a._open_after(0) == 2, "a slow survivor joins the newest"


def test_jobs_keep_their_membership_apart(store) -> None:
    assert _group(store, 0, job="one")._arrive(0)
    assert _group(store, 0, job="two")._arrive(0)
    assert (
        int(store.add("snapshotd/one/e0/arrived", 0)) == 1
        and int(store.add("snapshotd/two/e0/arrived", 0)) == 1
    )


def test_the_watchdogs_verdict_holds_until_the_next_group_forms_and_the_watchdog_stops(store) -> None:
    """``left_behind`` (set by the watchdog when it left a hung group) holds for every step of that group and
    is cleared when the next group forms; the watchdog thread starts once and stops on unwatch()."""
    group = _group(store, 0, world_size=1)
    group.join()
    try:
        group.left_behind = True
        with group.step():
            assert group.left_behind and group._step_since is not None
        assert group._step_since is None
        group.rejoin()
        assert not group.left_behind and group.epoch == 1
    finally:
        dist.destroy_process_group()
    group.watch()
    watchdog = group._watchdog
    group.watch()
    assert group._watchdog is watchdog and watchdog is not None and watchdog.thread.is_alive()
    group.unwatch()
    assert not watchdog.thread.is_alive() and group._watchdog is None


def test_the_watchdog_leaves_a_hung_step_once_the_job_opens_a_newer_epoch(store) -> None:
    """A step that runs past HANG_CHECK_S while the store says the job opened the next epoch (a replacement
    arrived): the watchdog, on a store connection of its own, sets ``left_behind`` and shuts the group's
    connections; a step shorter than HANG_CHECK_S is left alone."""
    group = _group(store, 0, world_size=1)
    group.join()
    group.watch()
    try:
        store.set("snapshotd/j/epoch", "1")  # the job moved on without this rank
        with group.step():
            pass  # a short step: over before the watchdog looks
        assert not group.left_behind
        deadline = time.monotonic() + 30
        with group.step():
            while not group.left_behind:  # the step "hangs" until the watchdog acts
                assert time.monotonic() < deadline, "the watchdog never left the group"
                time.sleep(0.05)
            assert time.monotonic() - group._step_since >= HANG_CHECK_S  # type: ignore[operator]
        assert group._links == {} and group.epoch == 0
    finally:
        group.unwatch()
        dist.destroy_process_group()


def test_bad_arguments_are_refused_by_name(store, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(live.STORE_ENV, raising=False)
    with pytest.raises(ValueError, match="host:port"):
        live.init_process_group(job="j", rank=0, world_size=2)
    with pytest.raises(ValueError, match="host:port"):
        live.init_process_group(store="no-port", job="j", rank=0, world_size=2)
    with pytest.raises(ValueError, match="timeout"):
        live.init_process_group(store="127.0.0.1:1", job="j", rank=0, world_size=2, timeout=0)
    with pytest.raises(ValueError, match="nodes= .* or rank= and world_size=, not both"):
        live.init_process_group(store="127.0.0.1:1", job="j", rank=0, nodes=2)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with pytest.raises(ValueError, match=r"nodes= needs \$LOCAL_RANK and \$LOCAL_WORLD_SIZE"):
        live.init_process_group(store="127.0.0.1:1", job="j", nodes=2)
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="nodes must be >= 1"):
        live.init_process_group(store="127.0.0.1:1", job="j", nodes=0)
    group = _group(store, 1)
    with pytest.raises(ValueError, match="not this Snapshotter"):
        Snapshotter(
            {"w": torch.zeros(2)}, job="j", rank=0, world_size=2, sidecar="/nonexistent.ipc", live=group
        )
    with pytest.raises(ValueError, match="replica_group"):
        Snapshotter(
            {"w": torch.zeros(2)},
            job="j",
            rank=1,
            world_size=2,
            sidecar="/nonexistent.ipc",
            live=group,
            replica_group=object(),
        )


def test_guard_and_recover_are_for_live_mode_and_guard_passes_other_errors_through(store) -> None:
    plain = Snapshotter({"w": torch.zeros(2)}, job="j", rank=0, world_size=2, sidecar="/nonexistent.ipc")
    livesnap = Snapshotter(
        {"w": torch.zeros(2)},
        job="j",
        rank=1,
        world_size=2,
        sidecar="/nonexistent.ipc",
        live=_group(store, 1),
    )
    try:
        with pytest.raises(RuntimeError, match="live mode"), plain.guard():
            pass
        with pytest.raises(RuntimeError, match="live mode"):
            plain.recover()
        with pytest.raises(PeerLost, match="Connection closed by peer") as caught, livesnap.guard():
            raise RuntimeError("gloo/transport/tcp/pair.cc: Connection closed by peer")
        assert isinstance(caught.value.__cause__, RuntimeError)
        with pytest.raises(ZeroDivisionError), livesnap.guard():
            raise ZeroDivisionError
    finally:
        plain.close(unregister=False)
        livesnap.close(unregister=False)


def _blocked_on_a_survivor(rank: int, port: int, out: str) -> None:
    """Rank 2 dies; rank 1 fails on it and leaves; rank 0, waiting on rank 1 only, must fail when rank 1 leaves."""
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30))
    group = LiveGroup(
        store,
        job="blocked",
        rank=rank,
        world_size=3,
        backend="gloo",
        timeout=30.0,
        join_timeout=30.0,
        attempts=1,
    )
    group.join()
    t = torch.ones(8)
    dist.all_reduce(t)
    if rank == 2:
        os._exit(0)  # dies: its connections close
    t0 = time.monotonic()
    try:
        dist.recv(t, src=1 if rank == 0 else 2)
        outcome = "received"
    except Exception as exc:  # noqa: BLE001 - what it was is the result
        outcome = "peer failure" if is_peer_failure(exc) else repr(exc)
        if rank == 1:
            group.leave()
    Path(out, f"rank{rank}").write_text(f"{outcome} after {time.monotonic() - t0:.2f}")
    if rank == 0:
        store.set("rank 0 done", "1")
    else:  # alive, group not destroyed, until rank 0 is done: only leave() can have woken it
        store.wait(["rank 0 done"], datetime.timedelta(seconds=60))
    os._exit(0)


def _spawn(fn: Callable[..., None], args: tuple, nprocs: int, timeout: float = 100.0) -> None:
    """Run ``fn(rank, *args)`` in ``nprocs`` fresh processes and wait for them, at most ``timeout`` seconds (a
    process that failed fails the test); every process is gone when this returns."""
    ctx = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")
    try:
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=0.5):
            assert time.monotonic() < deadline, "the ranks did not finish"
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
            p.join(10)


def test_a_rank_that_leaves_wakes_the_peers_blocked_on_it_at_once(
    tmp_path: Path, store: dist.TCPStore
) -> None:
    _spawn(_blocked_on_a_survivor, (store.port, str(tmp_path)), nprocs=3)
    outcome = {r: Path(tmp_path, f"rank{r}").read_text().split(" after ") for r in (0, 1)}
    assert outcome[1][0] == "peer failure" and outcome[0][0] == "peer failure", outcome
    assert float(outcome[0][1]) < 15.0, (
        f"rank 0 waited {outcome[0][1]} s: for its 30 s timeout, not rank 1's leaving"
    )


def _group_outlives_ddp(rank: int, port: int, out: str, via_live: bool) -> None:
    """Form a one-rank group (through live mode, or torch's own call), build DDP on it and train a step, destroy
    the group and release DDP's hold as ``recover()`` does; write whether the group object still lives."""
    import gc
    import weakref

    from snapshotd.client.ddp import DDPBuckets

    if via_live:
        live.init_process_group(store=f"127.0.0.1:{port}", job="outlives", rank=0, world_size=1, timeout=10)
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    model = torch.nn.Linear(4, 4)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ddp(torch.randn(2, 4)).sum().backward()
    buckets = DDPBuckets({"model": model})
    assert buckets.state_dict() == {"model": [[1, 0]]}  # the reducer was read (and cached)
    group = weakref.ref(dist.group.WORLD)
    dist.destroy_process_group()
    buckets.release()
    gc.collect()
    Path(out).write_text("alive" if group() is not None else "gone")


@pytest.mark.parametrize("via_live", [True, False], ids=["live", "torch"])
def test_a_released_group_is_destroyed_only_if_formed_after_dynamo_was_imported(
    tmp_path: Path, store: dist.TCPStore, via_live: bool
) -> None:
    """A survivor's broken group must go (its gloo loop spins on connections shut with bytes unread while it
    lives): live mode imports ``torch._dynamo`` before forming its first group, because DDP's constructor
    imports it and the import keeps the group of that moment alive for good, as the control shows."""
    out = tmp_path / "outcome"
    _spawn(_group_outlives_ddp, (store.port, str(out), via_live), nprocs=1)
    assert out.read_text() == ("gone" if via_live else "alive")
