"""Virtual ranks and exact mode: the same job on 1, 2, 3 or 4 processes, and moved between them mid-run, is
bit-identical (gloo ranks in spawned processes, a real ``StatefulDataLoader`` per virtual rank)."""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DistributedSampler, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from snapshotd.client.elastic import MODES
from snapshotd.client.virtual import Layout, VirtualRank, spread

from ..gloo_ranks import run_gloo_ranks

# the gloo stories share their failure-free run (a module fixture): on one xdist worker (make test's --dist loadgroup)
GLOO = pytest.mark.xdist_group("virtual_ranks")

WORLD = 4  # virtual ranks
STEPS = 6


def test_spread_keeps_homes_and_balances_the_orphans() -> None:
    assert spread(4, [0, 1, 2, 3]) == [[0], [1], [2], [3]]
    assert spread(4, [0, 1]) == [[0, 2], [1, 3]]
    assert spread(8, [5, 0, 3]) == [[1, 5, 6], [0, 2, 7], [3, 4]]
    for p in range(1, 9):
        assert max(len(c) for c in spread(8, list(range(p)))) == -(-8 // p)


@pytest.mark.parametrize(
    ("homes", "error"), [([], "no process"), ([0, 4], "not virtual ranks"), ([1, 1], "home to two")]
)
def test_spread_refuses_bad_homes(homes: list[int], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        spread(4, homes)


def test_layout_names_carriers_and_refuses_gaps() -> None:
    layout = Layout.of(4, [3, 1], me=1)
    assert layout.carried == ((0, 3), (1, 2)) and layout.mine == (1, 2) and layout.carrier(0) == 0
    with pytest.raises(ValueError, match="every virtual rank"):
        Layout(4, ((0,), (1, 2)), me=0)
    with pytest.raises(ValueError, match="not one of"):
        Layout(2, ((0,), (1,)), me=2)


def test_a_virtual_ranks_streams_are_its_own_and_leave_the_process_alone() -> None:
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a, b = VirtualRank(0), VirtualRank(1)
    with a.active():
        a1 = torch.rand(3)
    with b.active():
        b1 = torch.rand(3)
    with a.active():
        a2 = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), before)
    fresh = VirtualRank(0)
    with fresh.active():
        assert torch.equal(torch.rand(3), a1) and torch.equal(torch.rand(3), a2)
    assert not torch.equal(a1, b1)
    moved = VirtualRank(0)
    moved.load_state_dict(a.state_dict())
    with moved.active(), a.active():
        pass  # nesting two virtual ranks is allowed; one inside itself is not
    with pytest.raises(ValueError, match="virtual rank 1's state"):
        moved.load_state_dict(b.state_dict())
    with pytest.raises(RuntimeError, match="already active"), a.active(), a.active():
        pass


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(64, 1)
    )


def _loader(vrank: int) -> StatefulDataLoader:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(256, 16, generator=gen)
    data = TensorDataset(x, x.sum(dim=1, keepdim=True))
    sampler = DistributedSampler(data, num_replicas=WORLD, rank=vrank, shuffle=True, seed=0)
    return StatefulDataLoader(data, batch_size=8, sampler=sampler)


def _digest(*tensors: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _train(
    rank: int,
    *,
    processes: int,
    start: int,
    stop: int,
    saved: str | None,
    save: str | None,
    mode: str = "exact",
) -> Any:
    """Steps ``start`` to ``stop`` on ``processes`` processes (homes ``0..processes-1``), from ``saved`` if given
    (each virtual rank's state and the model's, as a restore gives them), writing the end state to ``save``."""
    layout = Layout.of(WORLD, list(range(processes)), rank)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    vranks = {v: VirtualRank(v, seed=1, data=_loader(v)) for v in layout.mine}
    if saved is not None:
        shared = torch.load(Path(saved, "shared.pt"), weights_only=False)
        model.load_state_dict(shared["model"])
        opt.load_state_dict(shared["optim"])
        for v, vr in vranks.items():
            vr.load_state_dict(torch.load(Path(saved, f"v{v}.pt"), weights_only=False))
    iters = {v: iter(vr.data) for v, vr in vranks.items()}
    reducer = MODES[mode](model.parameters(), layout)
    losses = {}
    for step in range(start, stop):
        opt.zero_grad(set_to_none=True)
        for v in layout.mine:
            with vranks[v].active():
                x, y = next(iters[v])
                x = x + 0.01 * torch.randn_like(x)  # the virtual rank's own stream
                loss = torch.nn.functional.mse_loss(model(x), y)
                loss.backward()
            reducer.collect(v)
            losses[(step, v)] = loss.item().hex()
        reducer.reduce()
        opt.step()
    if save is not None:
        if rank == 0:
            torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, Path(save, "shared.pt"))
        for v, vr in vranks.items():
            torch.save(vr.state_dict(), Path(save, f"v{v}.pt"))
    moments = [s[k] for s in opt.state_dict()["state"].values() for k in ("exp_avg", "exp_avg_sq")]
    return losses, _digest(*model.parameters(), *moments)


def _run(tmp: Path, processes: int, **kw: Any) -> tuple[dict[Any, str], str]:
    tmp.mkdir()
    results = run_gloo_ranks(functools.partial(_train, processes=processes, **kw), processes, tmp)
    losses = {k: v for r in results for k, v in r[0].items()}
    digests = {r[1] for r in results}
    assert len(digests) == 1, "the processes disagree on the model"
    return losses, digests.pop()


@pytest.fixture(scope="module")
def whole(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[Any, str], str]:
    """The failure-free run: four processes, one virtual rank each, every step."""
    return _run(tmp_path_factory.mktemp("whole") / "p4", 4, start=0, stop=STEPS, saved=None, save=None)


@GLOO
def test_the_job_is_bit_identical_on_any_number_of_processes(
    tmp_path: Path, whole: tuple[dict[Any, str], str]
) -> None:
    assert len(whole[0]) == WORLD * STEPS
    for p in (3, 1):
        assert _run(tmp_path / f"p{p}", p, start=0, stop=STEPS, saved=None, save=None) == whole, p


@GLOO
def test_a_job_moved_to_fewer_processes_mid_run_stays_bit_identical(
    tmp_path: Path, whole: tuple[dict[Any, str], str]
) -> None:
    """Four processes, then two carrying two virtual ranks each from the state the four left (as a shrink
    restores it), against four processes throughout."""
    state = tmp_path / "state"
    state.mkdir()
    before = _run(tmp_path / "before", 4, start=0, stop=3, saved=None, save=str(state))
    after = _run(tmp_path / "after", 2, start=3, stop=STEPS, saved=str(state), save=None)
    assert {**before[0], **after[0]} == whole[0]
    assert after[1] == whole[1]


@GLOO
def test_equivalent_mode_takes_the_same_samples_and_stays_within_rounding(tmp_path: Path) -> None:
    """The backend's all-reduce: on two processes the losses drift from four processes' by rounding only."""
    four = _run(tmp_path / "four", 4, start=0, stop=STEPS, saved=None, save=None, mode="equivalent")
    two = _run(tmp_path / "two", 2, start=0, stop=STEPS, saved=None, save=None, mode="equivalent")
    assert set(two[0]) == set(four[0])
    first = {k: v for k, v in four[0].items() if k[0] == 0}
    assert {k: two[0][k] for k in first} == first  # the same model and samples before any reduction
    drift = max(
        abs(float.fromhex(v) - float.fromhex(four[0][k])) / abs(float.fromhex(v)) for k, v in two[0].items()
    )
    assert drift < 1e-4


def test_a_reducer_refuses_what_the_layout_does_not_say() -> None:
    model = _model()
    reducer = MODES["exact"](model.parameters(), Layout.of(WORLD, [0], me=0))  # one process carries all four
    with pytest.raises(ValueError, match="not collected"):
        reducer.reduce()
    model(torch.randn(2, 16)).sum().backward()
    reducer.collect(1)
    with pytest.raises(ValueError, match="collected twice"):
        reducer.collect(1)
    with pytest.raises(ValueError, match="layout has 2 processes"):
        reducer.relayout(Layout.of(WORLD, [0, 1], me=0))
    with pytest.raises(ValueError, match="no parameter"):
        MODES["equivalent"]([], Layout.of(WORLD, [0], me=0))


def test_an_elastic_job_refuses_a_group_it_cannot_shrink_and_bad_arguments() -> None:
    import datetime

    import torch.distributed as dist

    from snapshotd.client.elastic import ElasticJob
    from snapshotd.client.group import LiveGroup

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=5))
    model = _model()

    def group(**kw: Any) -> LiveGroup:
        return LiveGroup(
            store, job="j", rank=0, world_size=2, backend="gloo", timeout=5, join_timeout=5, attempts=1, **kw
        )

    with pytest.raises(ValueError, match="elastic live group"):
        ElasticJob(group(), {"model": model}, model.parameters())
    with pytest.raises(ValueError, match="placed by index"):
        ElasticJob(group(settle=0.5, seat=(2, None)), {"model": model}, model.parameters())
    with pytest.raises(ValueError, match="mode must be"):
        ElasticJob(group(settle=0.5), {"model": model}, model.parameters(), mode="fast")
    with pytest.raises(ValueError, match="'vrank' is the virtual rank's own"):
        ElasticJob(group(settle=0.5), {"vrank": model}, model.parameters())
    with pytest.raises(ValueError, match="settle must be > 0"):
        group(settle=0)


def test_an_elastic_epoch_waits_for_the_ranks_it_expects_and_a_late_survivor_is_refused() -> None:
    import datetime
    import time

    import torch.distributed as dist

    from snapshotd.client import RecoveryFailed
    from snapshotd.client.epochs import settle, wait_decision
    from snapshotd.client.group import LiveGroup

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=5))
    store = dist.PrefixStore("snapshotd/j", server)
    store.add("e1/rank0", 1)
    store.add("e1/arrived", 1)
    t0 = time.monotonic()
    settle(
        store, 1, 2, until=t0 + 0.6, expect=(0, 1)
    )  # rank 1 never comes: decided at `until`, not when quiet
    assert time.monotonic() - t0 >= 0.55
    assert wait_decision(store, 1, 2, time.monotonic() + 1, "test") == (0,)

    def group() -> LiveGroup:
        return LiveGroup(
            server,
            job="j",
            rank=1,
            world_size=2,
            backend="gloo",
            timeout=5,
            join_timeout=1,
            attempts=1,
            settle=0.5,
        )

    with pytest.raises(RecoveryFailed, match="formed without this process"):
        group()._form(1, settling=True)  # a survivor arriving after the others decided: no group of its own
    store.set("epoch", "1")
    with pytest.raises(RecoveryFailed, match="only 1 of 2 ranks joined epoch 2"):
        group()._form(1)  # a fresh process moves on to the next epoch and waits there for the members
