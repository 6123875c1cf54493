"""``snapshotd export``: a complete step from the sidecars' memory, as a DCP checkpoint loaded at another world size.

One cluster for the module (a coordinator and two sidecars, real processes). Four real gloo ranks train two jobs
on it, one after the other, snapshotting every step: a DDP job whose model, optimizer and scheduler are
``replicated=`` (each tensor kept by one rank only, so the export must pull the keepers) and an FSDP2 job
(``fully_shard``, uneven shards and empty ones: the export assembles global tensors). Each rank then leaves as a
crashed process would, its snapshots left with the sidecars; rank 0 records the state at the last step (full
tensors). Both jobs' last steps are exported (once with the real CLI in a subprocess) and loaded into two fresh gloo
ranks with ``dcp.load``; the tests check what each step of that produced.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from snapshotd.cli import main as cli_main
from snapshotd.client import Snapshotter
from snapshotd.export import ExportError, export_checkpoint
from snapshotd.status import fetch_status
from tests.waits import wait_until

from ..gloo_ranks import run_gloo_ranks
from .conftest import Cluster, shm_leftovers

pytestmark = pytest.mark.integration

STEPS = 4
WAIT = 30.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tag = uuid.uuid4().hex[:8]
    c = Cluster(
        str(tmp_path_factory.mktemp("cluster")),
        tag,
        replicas=1,
        heartbeat_interval=0.2,
        heartbeat_timeout=1.5,
    )
    try:
        c.start_coordinator()
        c.start("A")
        c.start("B")
        yield c
    finally:
        c.close()
    assert not shm_leftovers(tag)


def _ddp_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4), nn.Linear(4, 1))


def _fsdp_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 1))  # 10 rows over 4 ranks: 3, 3, 3, 1
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def _build(kind: str, seed: int) -> dict[str, Any]:
    """A job's state: model, AdamW, a step scheduler and the loop's own dict (DDP: the model inside its wrapper)."""
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = _ddp_model(seed)
        wrapped: nn.Module = DDP(model)
    else:
        model = wrapped = _fsdp_model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return {
        "model": model,
        "optim": opt,
        "sched": sched,
        "loop": {"step": 0, "note": f"{kind} run"},
        "wrapped": wrapped,
    }


def _full(state: dict[str, Any]) -> dict[str, Any]:
    """Every tensor of the state as a full plain tensor (DTensors gathered: a collective), and the rest as is."""
    from torch.distributed.tensor import DTensor

    def full(x: Any) -> Any:
        if isinstance(x, DTensor):
            return x.full_tensor()
        if isinstance(x, torch.Tensor):
            return x.detach().clone()
        if isinstance(x, dict):
            return {k: full(v) for k, v in x.items()}
        if isinstance(x, list):
            return [full(v) for v in x]
        return x

    return {
        "model": full(state["model"].state_dict()),
        "optim": full(state["optim"].state_dict()),
        "sched": state["sched"].state_dict(),
        "loop": dict(state["loop"]),
    }


def _train_rank(rank: int, *, ipcs: list[str], jobs: dict[str, str], out: str) -> dict[str, int]:
    """One rank of both jobs: train, snapshot every step, leave the snapshots with the sidecars; rank 0 saves the
    state of the last step."""
    from snapshotd.client import Snapshotter

    result = {}
    for kind, job in jobs.items():
        state = _build(kind, seed=0)
        wrapped = state.pop("wrapped")
        replicated = ("model", "optim", "sched") if kind == "ddp" else ()
        snap = Snapshotter(
            state, job=job, sidecar=ipcs[rank // 2], when_busy="block", timeout=WAIT, replicated=replicated
        )
        assert snap.restore(timeout=WAIT) == 0
        for step in range(STEPS):
            x = torch.randn(
                4, 8 if kind == "ddp" else 6, generator=torch.Generator().manual_seed(100 * step + rank)
            )
            wrapped(x).pow(2).mean().backward()
            state["optim"].step()
            state["optim"].zero_grad()
            state["sched"].step()
            state["loop"]["step"] = step + 1
            assert snap.capture(step + 1)
        assert snap.wait(WAIT), snap.stats
        full = _full(state)
        if rank == 0:
            torch.save(full, os.path.join(out, f"{kind}.pt"))
        snap.close(unregister=False)  # as a crashed process: its snapshots stay with the sidecars
        result[kind] = snap.stats.last_durable_step
        dist.barrier()
    return result


def _load_rank(rank: int, *, checkpoints: dict[str, str], out: str) -> dict[str, list[str]]:
    """For each job: build its state afresh (another seed) at this world size, load its checkpoint with DCP, and
    compare with what the training job saved: the names of what differs."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    result = {}
    for kind, checkpoint in checkpoints.items():
        state = _build(kind, seed=1)
        wrapped = state.pop("wrapped")
        # an optimizer that has not stepped gets its moments
        get_optimizer_state_dict(wrapped, state["optim"])
        dcp.load(state, checkpoint_id=checkpoint)
        got = _full(state)
        want = torch.load(os.path.join(out, f"{kind}.pt"), weights_only=False)
        result[kind] = _differences(got, want, kind)
    return result


def _differences(got: Any, want: Any, where: str) -> list[str]:
    if isinstance(want, torch.Tensor):
        ok = isinstance(got, torch.Tensor) and got.dtype == want.dtype and torch.equal(got, want)
        return [] if ok else [where]
    if isinstance(want, dict):
        if not isinstance(got, dict) or set(got) != set(want):
            return [f"{where}: keys {sorted(map(str, got))} != {sorted(map(str, want))}"]
        return [d for k in want for d in _differences(got[k], want[k], f"{where}.{k}")]
    if isinstance(want, list):
        if not isinstance(got, list) or len(got) != len(want):
            return [f"{where}: {got!r} != {want!r}"]
        return [
            d
            for i, (g, w) in enumerate(zip(got, want, strict=True))
            for d in _differences(g, w, f"{where}.{i}")
        ]
    return [] if got == want else [f"{where}: {got!r} != {want!r}"]


def _durable(cluster: Cluster, job: str) -> int:
    jobs = fetch_status(cluster.coordinator_addr, secret=None, timeout=5)["jobs"]
    return next((j["durable"] for j in jobs if j["job"] == job), -1)


@pytest.fixture(scope="module")
def trained(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Both jobs trained to STEPS and durable there; kind -> job name. The reference states are in ``out``."""
    out = tmp_path_factory.mktemp("reference")
    jobs = {"ddp": cluster.job("ddp"), "fsdp": cluster.job("fsdp")}
    body = functools.partial(_train_rank, ipcs=[cluster.ipc("A"), cluster.ipc("B")], jobs=jobs, out=str(out))
    assert (
        run_gloo_ranks(body, 4, tmp_path_factory.mktemp("train"), timeout=120)
        == [{"ddp": STEPS, "fsdp": STEPS}] * 4
    )
    deadline = time.monotonic() + WAIT
    while not all(_durable(cluster, job) == STEPS for job in jobs.values()):  # the last heartbeats are in
        assert time.monotonic() < deadline, {job: _durable(cluster, job) for job in jobs.values()}
        time.sleep(0.05)
    return {**jobs, "out": str(out)}


@pytest.fixture(scope="module")
def exported(
    cluster: Cluster, trained: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """Both jobs exported: DDP by the CLI (a subprocess), FSDP2 through the Python API; then loaded by two fresh
    gloo ranks (one session for both, to spare a second start of the ranks)."""
    root = tmp_path_factory.mktemp("export")
    cli = subprocess.run(
        [
            sys.executable,
            "-m",
            "snapshotd.cli",
            "export",
            "--coordinator",
            cluster.coordinator_addr,
            "--job",
            trained["ddp"],
            "--out",
            str(root / "ddp"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert cli.returncode == 0, cli.stderr
    fsdp = export_checkpoint(cluster.coordinator_addr, trained["fsdp"], str(root / "fsdp"), step=STEPS)
    checkpoints = {kind: str(root / kind) for kind in ("ddp", "fsdp")}
    body = functools.partial(_load_rank, checkpoints=checkpoints, out=trained["out"])
    loaded = run_gloo_ranks(body, 2, tmp_path_factory.mktemp("load"), timeout=120)
    return {"cli": cli, "fsdp": fsdp, "root": root, "loaded": loaded}


def test_ddp_with_replicated_state_exports_and_loads_at_two_ranks(
    trained: dict[str, str], exported: dict[str, Any]
) -> None:
    # every rank kept a part of the replicated model, optimizer and scheduler, so every rank's snapshot was pulled
    assert f"job {trained['ddp']} step {STEPS} (4 ranks; pulled ranks [0, 1, 2, 3]" in exported["cli"].stdout
    assert (exported["root"] / "ddp" / ".metadata").is_file()
    assert [r["ddp"] for r in exported["loaded"]] == [[], []]  # every tensor and value equal, on both ranks


def test_fsdp2_exports_global_tensors_and_reshards_to_two_ranks(exported: dict[str, Any]) -> None:
    done = exported["fsdp"]
    assert (done.step, done.world_size, done.pulled) == (STEPS, 4, [0, 1, 2, 3])
    import torch.distributed.checkpoint as dcp

    meta = dcp.FileSystemReader(done.out).read_metadata().state_dict_metadata
    assert list(meta["model.0.weight"].size) == [10, 6] and list(meta["optim.state.2.exp_avg"].size) == [
        1,
        10,
    ]
    assert {k.split(".")[0] for k in meta} == {"model", "optim", "sched", "loop"}  # not snapshotd's own keys
    # full tensors equal after resharding to 2 ranks
    assert [r["fsdp"] for r in exported["loaded"]] == [
        [],
        [],
    ]


def test_errors_name_the_problem(
    cluster: Cluster, trained: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "ckpt"
    root, ours = logging.getLogger(), logging.getLogger("snapshotd")
    saved = root.handlers[:], root.level, ours.level
    try:
        assert (
            cli_main(
                [
                    "export",
                    "--coordinator",
                    cluster.coordinator_addr,
                    "--job",
                    cluster.job("nope"),
                    "--out",
                    str(out),
                ]
            )
            == 1
        )
    finally:  # the CLI set up logging to this test's captured stderr: later tests must not log there
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
        ours.setLevel(saved[2])
    assert (
        capsys.readouterr().err == f"snapshotd export: the coordinator knows no job {cluster.job('nope')!r}\n"
    )
    with pytest.raises(
        ExportError,
        match=rf"step 0 of job '{trained['ddp']}' is not held for rank\(s\) 0, 1, 2, 3 "
        rf"\(newest durable step: {STEPS}, recoverable: {STEPS}\)",
    ):
        export_checkpoint(cluster.coordinator_addr, trained["ddp"], str(out), step=0)
    out.mkdir()
    (out / "x").write_text("")
    with pytest.raises(ExportError, match="exists and is not an empty directory"):
        export_checkpoint(cluster.coordinator_addr, trained["ddp"], str(out))
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # nothing half-written beside it


# dcp.load in one process says so
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_a_dead_nodes_ranks_export_from_their_buddies(tmp_path: Path) -> None:
    """No spare node: after a node's loss (no step durable for its buddies' ranks until re-replication), the
    export takes the recoverable step G, each rank from a live holder: what the README's fallback relies on."""
    tag = uuid.uuid4().hex[:8]
    c = Cluster(str(tmp_path / "cluster"), tag, replicas=1, heartbeat_interval=0.2, heartbeat_timeout=1.5)
    try:
        c.start_coordinator()
        sidecars = {n: c.start(n) for n in ("A", "B", "C")}
        job = c.job("lost")
        states = [{"w": torch.zeros(4096), "loop": {"step": 0}} for _ in range(2)]
        # rank 0, whose values the export writes, on B
        snaps = [
            Snapshotter(states[r], job=job, rank=r, world_size=2, sidecar=c.ipc(n), timeout=WAIT)
            for r, n in enumerate(("B", "A"))
        ]
        try:
            with concurrent.futures.ThreadPoolExecutor(2) as pool:  # restore() answers once every rank asked
                assert list(pool.map(lambda s: s.restore(timeout=WAIT), snaps, timeout=WAIT + 10)) == [0, 0]
            for step in (1, 2, 3):
                for r, (s, st) in enumerate(zip(snaps, states, strict=True)):
                    st["w"] += r + 1
                    st["loop"]["step"] = step
                    s.capture(step)
                for s in snaps:
                    assert s.wait(WAIT)
        finally:
            for s in snaps:
                # as crashed processes would: their snapshots stay with the sidecars
                s.close(unregister=False)
        c.lose_node(sidecars["B"])

        def b_dead() -> bool:
            doc = fetch_status(c.coordinator_addr, secret=None)
            return not next(n for n in doc["nodes"] if n["node"] == c.node("B"))["alive"]

        wait_until(b_dead, "the coordinator to declare node B dead", WAIT)
        done = export_checkpoint(c.coordinator_addr, job, str(tmp_path / "out"))
        assert done.step == 3 and 0 in done.pulled  # rank 0's step 3, from its buddy: its own node is gone
        target = {"w": torch.empty(4096), "loop": {"step": -1}}
        dcp.load(target, checkpoint_id=str(tmp_path / "out"))  # one process: a world size of 1
        assert torch.equal(target["w"], torch.full((4096,), 3.0)) and target["loop"] == {"step": 3}
    finally:
        c.close()
    assert not shm_leftovers(tag)
