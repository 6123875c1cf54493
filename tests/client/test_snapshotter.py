"""The Snapshotter's contract with a training loop: bad state fails loudly at once, sidecar trouble never does."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
import uuid
from collections.abc import Callable, Iterator

import pytest
import torch

from snapshotd.client import RNGState, SidecarUnavailable, Snapshotter
from snapshotd.client.stats import ProblemLog
from snapshotd.harness.cluster import LocalCluster


@contextlib.contextmanager
def _cluster(tmp_path, *nodes: str) -> Iterator[LocalCluster]:
    """A coordinator and one sidecar per node name, torn down after the block."""
    with LocalCluster(str(tmp_path)) as cluster:
        cluster.start_coordinator()
        for node in nodes:
            cluster.start_sidecar(node)
        yield cluster


def _nowhere(tmp_path) -> str:
    return os.path.join(str(tmp_path), "no-sidecar.ipc")


class _Opaque:
    def state_dict(self) -> dict:
        return {"fn": lambda: 1}

    def load_state_dict(self, sd: dict) -> None:
        pass


def test_unsnapshottable_value_is_a_type_error_naming_its_path(tmp_path) -> None:
    with (
        Snapshotter(
            {"w": torch.zeros(3), "bad": _Opaque()},
            job="j",
            rank=0,
            world_size=1,
            sidecar=_nowhere(tmp_path),
            timeout=1,
        ) as snap,
        pytest.raises(TypeError, match=r"state\['bad'\]\['fn'\].*never pickle"),
    ):
        snap.capture(1)


def test_missing_identity_is_a_clear_value_error(monkeypatch) -> None:
    for var in (*IDENTITY_ENV, "SLURM_JOB_ID", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match="SNAPSHOTD_JOB"):
        Snapshotter({}, rank=0, world_size=1)
    with pytest.raises(ValueError, match="RANK/WORLD_SIZE"):
        Snapshotter({}, job="j")
    with pytest.raises(ValueError, match="when_busy"):
        Snapshotter({}, job="j", rank=0, world_size=1, when_busy="sometimes")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun without --rdzv-id
    with pytest.raises(ValueError, match="torchrun's default run id 'none'.*--rdzv-id"):
        Snapshotter({}, rank=0, world_size=1)


IDENTITY_ENV = ("SNAPSHOTD_JOB", "TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE")


def test_under_srun_without_torchrun_the_identity_comes_from_slurm(monkeypatch) -> None:
    from snapshotd.client.identity import Identity

    for var in IDENTITY_ENV:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_PROCID", "5")
    monkeypatch.setenv("SLURM_NTASKS", "8")
    me = Identity.resolve(None, None, None, None)
    assert (me.job, me.rank, me.world_size) == ("slurm-4242", 5, 8)
    monkeypatch.setenv("RANK", "2")  # torchrun's (or the user's) variables come first
    monkeypatch.setenv("SNAPSHOTD_JOB", "run-1")
    me = Identity.resolve(None, None, None, None)
    assert (me.job, me.rank, me.world_size) == ("run-1", 2, 8)
    monkeypatch.setenv("SLURM_NTASKS", "eight")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match=r"\$SLURM_NTASKS='eight' is not an integer"):
        Identity.resolve(None, None, None, None)


def test_defaults_come_from_the_environment(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "elastic-7")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("SNAPSHOTD_SIDECAR", _nowhere(tmp_path))
    with Snapshotter({}, timeout=1) as snap:
        assert (snap.job, snap.rank, snap.world_size, snap.sidecar) == ("elastic-7", 3, 4, _nowhere(tmp_path))


def test_restore_without_a_sidecar_fails_clearly_and_promptly(tmp_path) -> None:
    with Snapshotter(
        {"w": torch.zeros(3)}, job="j", rank=0, world_size=1, sidecar=_nowhere(tmp_path), timeout=1
    ) as snap:
        t0 = time.monotonic()
        with pytest.raises(SidecarUnavailable, match="snapshotd serve"):
            snap.restore(timeout=1)
        assert time.monotonic() - t0 < 5


def test_capture_never_raises_or_stalls_when_the_sidecar_is_down(tmp_path) -> None:
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Snapshotter(
        {"model": model, "optim": opt}, job="j", rank=0, world_size=1, sidecar=_nowhere(tmp_path), timeout=1
    ) as snap:
        t0 = time.monotonic()
        started = [snap.capture(step) for step in range(1, 21)]
        elapsed = time.monotonic() - t0
    assert started == [False] * 20
    assert snap.stats.skipped == 20 and snap.stats.errors >= 1 and "sidecar" in snap.stats.last_error
    assert elapsed < 4  # one bounded attempt, then background retries


def test_steps_must_grow_and_every_skips_off_steps(tmp_path) -> None:
    with Snapshotter(
        {"w": torch.zeros(3)}, job="j", rank=0, world_size=1, sidecar=_nowhere(tmp_path), timeout=1, every=2
    ) as snap:
        assert snap.capture(1) is False
        with pytest.raises(ValueError, match="steps only grow"):
            snap.capture(1)
        assert snap.stats.skipped == 0  # an off step is not a skipped snapshot


def test_every_is_a_positive_int_or_auto(tmp_path) -> None:
    for bad in (0, -1, "sometimes", 1.5):
        with pytest.raises(ValueError, match="every must be"):
            Snapshotter({}, job="j", rank=0, world_size=1, sidecar=_nowhere(tmp_path), every=bad)  # type: ignore[arg-type]


@pytest.mark.integration
def test_every_auto_snapshots_the_first_step_then_on_its_interval(tmp_path) -> None:
    job = f"auto-{uuid.uuid4().hex[:6]}"
    with _cluster(tmp_path, "A", "B") as cluster:
        w = torch.zeros(1024)
        with Snapshotter(
            {"w": w},
            job=job,
            rank=0,
            world_size=1,
            sidecar=cluster.ipc_path("A"),
            timeout=20,
            every="auto",
            when_busy="block",
        ) as snap:
            assert snap.restore(timeout=20) == 0
            started = []
            for step in range(1, 17):
                w += 1
                if snap.capture(step):
                    started.append(step)
                    assert snap.wait(20), snap.stats
            # 1, then the start interval: the steps here take microseconds, and the wait for durability after each
            # snapshot is thousands of steps long, a pause of the loop that is charged to nothing
            assert started == [1, 8, 16]
            assert snap.stats.auto_interval == 8 and snap.stats.durable == 3 and snap.stats.skipped == 0
            # the staging rate's parts
            assert snap.stats.bytes == 3 * w.nbytes and snap.stats.copy_seconds > 0


def _durable_past(
    snap: Snapshotter, capture: Callable[[], bool], step: int, *, seconds: float, pause: float
) -> None:
    """Call ``capture()`` (one step and its snapshot), waiting up to ``pause`` after each, until a step after
    ``step`` is durable; at most ``seconds``."""
    deadline = time.monotonic() + seconds
    while snap.stats.last_durable_step <= step:
        capture()
        snap.wait(pause)
        assert time.monotonic() < deadline, snap.stats


@pytest.mark.integration
def test_snapshots_resume_after_the_sidecar_restarts(tmp_path) -> None:
    """A sidecar restart during training degrades snapshots for a moment; capture() never raises."""
    job = f"restart-{uuid.uuid4().hex[:6]}"
    with _cluster(tmp_path, "A", "B") as cluster:
        node_a = cluster.sidecars["A"]
        model = torch.nn.Linear(64, 64)
        opt = torch.optim.AdamW(model.parameters())
        state = {"model": model, "optim": opt, "rng": RNGState()}
        with Snapshotter(
            state, job=job, rank=0, world_size=1, sidecar=cluster.ipc_path("A"), timeout=2
        ) as snap:
            assert snap.restore(timeout=20) == 0
            step = 0

            def train_and_capture() -> bool:
                nonlocal step
                model(torch.randn(8, 64)).sum().backward()
                opt.step()
                step += 1
                return snap.capture(step)

            _durable_past(snap, train_and_capture, 2, seconds=20, pause=2)
            assert cluster.stop(node_a) == 0
            cluster.start_sidecar("A")
            _durable_past(snap, train_and_capture, step, seconds=30, pause=0.5)
            assert snap.stats.errors >= 1


@pytest.mark.integration
def test_snapshots_resume_after_the_sidecar_restarts_while_the_rank_waits_for_every_slot(tmp_path) -> None:
    """The sidecar restarts while it holds every slot of the rank (its buddy is stopped, so no step becomes
    durable and each copy is kept): the rank sees the sidecar's process gone at its next capture, long before its
    30 s timeout, and registers again; the restarted sidecar frees the slots in its first update, which knows none
    of the steps the rank had announced, and snapshots resume."""
    job = f"full-{uuid.uuid4().hex[:6]}"
    with _cluster(tmp_path, "A", "B") as cluster:
        node_a, node_b = cluster.sidecars["A"], cluster.sidecars["B"]
        w = torch.zeros(1 << 12)
        with Snapshotter({"w": w}, job=job, rank=0, world_size=1, sidecar=cluster.ipc_path("A")) as snap:
            assert snap.restore(timeout=20) == 0
            step = 0

            def capture() -> bool:
                nonlocal step
                step += 1
                w.fill_(step)
                return snap.capture(step)

            _durable_past(snap, capture, 0, seconds=20, pause=2)
            os.kill(node_b.pid, signal.SIGSTOP)
            try:
                deadline = time.monotonic() + 20
                while capture() or capture():  # until two in a row start nothing: every slot held
                    assert time.monotonic() < deadline, snap.stats
                    time.sleep(0.05)
                assert cluster.stop(node_a) == 0
            finally:
                os.kill(node_b.pid, signal.SIGCONT)
            cluster.start_sidecar("A")
            _durable_past(snap, capture, step, seconds=30, pause=0.1)


@pytest.mark.integration
def test_block_mode_waits_and_a_new_node_pulls(tmp_path) -> None:
    job = f"block-{uuid.uuid4().hex[:6]}"
    with _cluster(tmp_path, "A", "B", "C") as cluster:
        w = torch.zeros(1 << 16)
        with Snapshotter(
            {"w": w},
            job=job,
            rank=0,
            world_size=1,
            sidecar=cluster.ipc_path("A"),
            timeout=10,
            when_busy="block",
        ) as snap:
            assert snap.restore(timeout=20) == 0
            for step in range(1, 6):
                w.fill_(step)
                assert snap.capture(step)  # "block" waits for a slot instead of skipping
            assert snap.wait(10)
            assert snap.stats.skipped == 0 and snap.stats.last_durable_step == 5
            snap.close(unregister=False)  # as a crash would: A keeps its local copy, B its buddy copy
        # the rank restarts on a third node, which holds nothing: it pulls from A and B
        w2 = torch.zeros(1 << 16)
        with Snapshotter(
            {"w": w2}, job=job, rank=0, world_size=1, sidecar=cluster.ipc_path("C"), timeout=10
        ) as snap:
            assert snap.restore(timeout=20) == 5
            assert torch.equal(w2, torch.full((1 << 16,), 5.0))
            assert snap.restored["source"] == "pull" and snap.restored["bytes_pulled"] == w2.numel() * 4
            assert snap.restored["direct"]  # pulled straight into w2 (this kernel allows process_vm_writev)


def test_a_problem_met_step_after_step_is_warned_once_and_remembered_in_bounded_memory(
    caplog: pytest.LogCaptureFixture,
) -> None:
    snap = Snapshotter({"w": torch.zeros(4)}, job="j", rank=0, world_size=1, sidecar="mem://no-sidecar-here")
    try:
        with caplog.at_level(logging.WARNING, logger="snapshotd.client.session"):
            for step in range(1000):
                snap._session.problem(f"2 of 2 buddies did not take step {step}: memory_limit")
            for kind in range(200):
                snap._session.problem(f"problem kind {'x' * kind}")
        warned = [r for r in caplog.records if "did not take step" in r.getMessage()]
        assert len(warned) == 1 and "step 0" in warned[0].getMessage()
        assert snap.stats.errors == 1200 and snap.stats.last_error == f"problem kind {'x' * 199}"
        assert len(snap._session._problems) == ProblemLog.KINDS
    finally:
        snap.close(unregister=False)
