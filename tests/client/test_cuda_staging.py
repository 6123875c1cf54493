"""The CUDA staging path (client/staging.py): parameters, optimizer state and buffers on a GPU, copied on a side
stream into the page-locked arena while the training thread goes on.

Needs CUDA, and skipped without it: no machine this project has run on so far had a GPU. A session lent one runs
these first (``pytest -m gpu``), then ``snapshotd-bench overhead --device cuda``.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator

import pytest
import torch

from snapshotd.client import Snapshotter
from snapshotd.harness.cluster import LocalCluster
from snapshotd.status import fetch_status
from tests.waits import wait_until

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(autouse=True)
def deterministic_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """cuDNN's deterministic kernels: a step run twice from the same state gives the same bits."""
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)


LONG_SLEEP = 2_000_000_000
"""GPU cycles for ``torch.cuda._sleep``: about a second on current GPUs, far longer than a capture."""


@contextlib.contextmanager
def _cluster(tmp_path) -> Iterator[LocalCluster]:
    """A coordinator and two sidecars (A, where the rank runs, and its buddy B)."""
    with LocalCluster(str(tmp_path)) as cluster:
        cluster.start_coordinator()
        for node in ("A", "B"):
            cluster.start_sidecar(node)
        yield cluster


def _job_state(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict]:
    """A small CNN with batch norm (buffers that every forward changes) and Adam, all on the GPU."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3),
        torch.nn.BatchNorm2d(8),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(8 * 14 * 14, 10),
    ).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    return model, opt, {"model": model, "optim": opt}


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(step)
    x = torch.randn(16, 3, 16, 16, device="cuda", generator=g)
    y = torch.randint(0, 10, (16,), device="cuda", generator=g)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


def _snapshotter(cluster: LocalCluster, job: str, state: dict) -> Snapshotter:
    return Snapshotter(state, job=job, rank=0, world_size=1, sidecar=cluster.ipc_path("A"), timeout=30)


def _restarted(seed: int = 1) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict]:
    """The state of a restarted process: other initial values, and its optimizer state already made."""
    model, opt, state = _job_state(seed)
    _train_step(model, opt, 0)
    return model, opt, state


def _first_snapshot(
    snap: Snapshotter, model: torch.nn.Module, opt: torch.optim.Optimizer
) -> torch.cuda.Stream:
    """A fresh job's step 1, snapshotted and durable; the Snapshotter's copy stream, which that capture made."""
    assert snap.restore(timeout=30) == 0
    _train_step(model, opt, 1)
    snap.capture(1)
    assert snap.wait(30)
    side = snap._session.stager._side_stream
    assert side is not None
    return side


def _cpu_copy(state: dict) -> dict:
    """Every tensor of the model's and optimizer's state dicts, copied to the CPU."""
    return {
        "model": {k: v.detach().cpu().clone() for k, v in state["model"].state_dict().items()},
        "optim": {
            i: {k: v.cpu().clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
            for i, s in state["optim"].state_dict()["state"].items()
        },
    }


def _assert_same(a: dict, b: dict) -> None:
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    assert a["optim"].keys() == b["optim"].keys()
    for i in a["optim"]:
        for k, v in a["optim"][i].items():
            assert (
                torch.equal(v, b["optim"][i][k]) if isinstance(v, torch.Tensor) else v == b["optim"][i][k]
            ), (i, k)


def test_a_gpu_job_restores_bit_identically_and_trains_on_identically(tmp_path) -> None:
    job = f"cuda-{uuid.uuid4().hex[:6]}"
    with _cluster(tmp_path) as cluster:
        model, opt, state = _job_state(seed=0)
        with _snapshotter(cluster, job, state) as snap:
            assert snap.restore(timeout=30) == 0
            for step in range(1, 4):
                _train_step(model, opt, step)
                snap.capture(step)
            assert snap.wait(30) and snap.stats.last_durable_step == 3
            # the side stream's device-to-host copies, timed by CUDA events
            assert snap.stats.copy_seconds > 0
            at_3 = _cpu_copy(state)
            snap.close(unregister=False)  # as a crash would
        _train_step(model, opt, 4)
        after_4 = _cpu_copy(state)

        model2, opt2, state2 = _restarted()
        with _snapshotter(cluster, job, state2) as snap:
            assert snap.restore(timeout=30) == 3
            assert snap.restored["source"] == "local"
            _assert_same(_cpu_copy(state2), at_3)
            _train_step(model2, opt2, 4)
            _assert_same(_cpu_copy(state2), after_4)


def test_capture_returns_while_the_gpu_is_still_busy(tmp_path) -> None:
    job = f"cuda-{uuid.uuid4().hex[:6]}"
    with _cluster(tmp_path) as cluster:
        model, opt, state = _job_state(seed=0)
        with _snapshotter(cluster, job, state) as snap:
            _first_snapshot(snap, model, opt)
            _train_step(model, opt, 2)
            torch.cuda._sleep(LONG_SLEEP)  # the training stream is busy for about a second
            t0 = time.perf_counter()
            snap.capture(2)
            blocked = time.perf_counter() - t0
            busy = not torch.cuda.current_stream().query()
            assert busy, "the sleep ended before capture() returned: the GPU is too fast for LONG_SLEEP"
            assert blocked < 0.05, f"capture() blocked the training thread {blocked * 1e3:.1f} ms"
            assert snap.wait(30) and snap.stats.last_durable_step == 2


def test_buffers_changed_right_after_capture_are_snapshotted_as_they_were(tmp_path) -> None:
    # A tensor that any kernel may change (a plain tensor, like batch norm's running statistics) is written on
    # the training stream right after capture(), while the side stream's copy is held back: the snapshot must
    # still hold the value it had at capture().
    job = f"cuda-{uuid.uuid4().hex[:6]}"
    with _cluster(tmp_path) as cluster:
        model, opt, state = _job_state(seed=0)
        counter = torch.zeros(1 << 20, device="cuda")
        state["counter"] = counter
        with _snapshotter(cluster, job, state) as snap:
            side = _first_snapshot(snap, model, opt)
            _train_step(model, opt, 2)
            counter.fill_(2.0)
            with torch.cuda.stream(side):
                torch.cuda._sleep(LONG_SLEEP)  # the next copy waits behind this
            snap.capture(2)
            counter.fill_(99.0)  # the next step's work, queued at once on the training stream
            assert snap.wait(30) and snap.stats.last_durable_step == 2
            snap.close(unregister=False)
        state2 = {**_restarted()[2], "counter": torch.zeros(1 << 20, device="cuda")}
        with _snapshotter(cluster, job, state2) as snap:
            assert snap.restore(timeout=30) == 2
            assert torch.equal(state2["counter"].cpu(), torch.full((1 << 20,), 2.0))


def test_close_right_after_capture_waits_for_the_copy_into_the_arena(tmp_path) -> None:
    # close() unregisters the page-locked arena and unmaps it: a copy still running into it must end first
    job = f"cuda-{uuid.uuid4().hex[:6]}"
    with _cluster(tmp_path) as cluster:
        model, opt, state = _job_state(seed=0)
        with _snapshotter(cluster, job, state) as snap:
            side = _first_snapshot(snap, model, opt)
            _train_step(model, opt, 2)
            expected = _cpu_copy(state)
            with torch.cuda.stream(side):
                torch.cuda._sleep(LONG_SLEEP)  # the copy of step 2 waits behind this
            snap.capture(2)
            snap.close(unregister=False)  # at once, as a job that ends right after its last step
            assert side.query()  # the copy was done before the arena went

        def durable() -> int:
            jobs = fetch_status(cluster.coordinator_addr, secret=None, timeout=10)["jobs"]
            return max((j["durable"] for j in jobs if j["job"] == job), default=0)

        # announced once the copy was done
        wait_until(lambda: durable() >= 2, "step 2 durable on the buddy", 30)
        state2 = _restarted()[2]
        with _snapshotter(cluster, job, state2) as snap:
            assert snap.restore(timeout=30) == 2
            _assert_same(_cpu_copy(state2), expected)
