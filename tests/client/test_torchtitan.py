"""torchtitan's Trainer with :class:`~snapshotd.client.integrations.torchtitan.SnapshotdCheckpointManager`: a run
that dies after step 3 and a new Trainer that restores from the snapshot end bit-identical to a run never stopped
(``examples/torchtitan/train.py``'s config: the Llama 3 debug model cut to one block, FSDP2, AdamW, warm-up then
linear decay, torchtitan's stateful text loader; one rank of gloo in this process, real sidecars and coordinator
over the in-memory transport). The same story under torchrun, four ranks on two nodes with one lost, is
tests/integration/test_frameworks_torchrun.py."""

from __future__ import annotations

import contextlib
import gc
import hashlib
import importlib.util
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

pytest.importorskip("torchtitan")

from snapshotd.client.integrations.torchtitan import SnapshotdCheckpointManager  # noqa: E402
from snapshotd.harness.ports import free_port  # noqa: E402

from ..deployments import InProcess  # noqa: E402
from ..waits import wait_until  # noqa: E402

# torchtitan 0.3.0 on torch 2.13 without a GPU warns of what it cannot use (deprecated torch APIs, devices)
pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

STEPS, DIES_AFTER = 6, 3
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "torchtitan"


@pytest.fixture(scope="module")
def example() -> Iterator[ModuleType]:
    """``examples/torchtitan/train.py`` as a module (its ``cpu.py`` applied on a machine without a GPU)."""
    sys.path.insert(0, str(EXAMPLE))
    try:
        spec = importlib.util.spec_from_file_location("snapshotd_torchtitan_example", EXAMPLE / "train.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(EXAMPLE))


class _Run:
    """One process's Trainer (made in the rank's environment), its losses by step."""

    def __init__(self, example: ModuleType, monkeypatch: pytest.MonkeyPatch, job: str, sidecar: str) -> None:
        for name, value in {
            "RANK": "0",
            "LOCAL_RANK": "0",
            "WORLD_SIZE": "1",
            "LOCAL_WORLD_SIZE": "1",
        }.items():
            monkeypatch.setenv(name, value)
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(free_port("127.0.0.1")))
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", job)
        config = example.configure(example.parse(["--steps", str(STEPS), "--layers", "1", "--block", "32"]))
        config.checkpoint.sidecar = sidecar
        config.checkpoint.snapshot_timeout = 60.0
        self.trainer = config.build()
        self.closed = False
        self.losses: dict[int, float] = {}
        forward_backward = self.trainer.forward_backward_step

        def recorded(**kwargs: Any) -> torch.Tensor:
            loss = forward_backward(**kwargs)
            self.losses[self.trainer.step] = loss.item()
            return loss

        self.trainer.forward_backward_step = recorded

    @property
    def manager(self) -> SnapshotdCheckpointManager:
        manager = self.trainer.checkpointer
        assert isinstance(manager, SnapshotdCheckpointManager)
        return manager

    def digest(self) -> str:
        h = hashlib.sha256()
        tensors = [t for p in self.trainer.model_parts for t in p.state_dict().values()]
        for optimizer in self.trainer.optimizers.optimizers:
            tensors += [t for s in optimizer.state_dict()["state"].values() for t in s.values()]
        for t in tensors:
            t = t.to_local() if hasattr(t, "to_local") else t
            h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

    def close(self) -> None:
        """The Trainer's ``close()``, once."""
        if not self.closed:
            self.closed = True
            self.trainer.close()


class _NoSleep:
    """The ``time`` module, with ``sleep`` a no-op."""

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)

    @staticmethod
    def sleep(seconds: float) -> None:
        return None


@contextlib.contextmanager
def _running(example: ModuleType, monkeypatch: pytest.MonkeyPatch, job: str, sidecar: str) -> Iterator[_Run]:
    """A :class:`_Run`, closed at the end (if not already), and what the Trainer did to this process undone, even
    when building it failed: its process group, and torchtitan turning automatic garbage collection off."""
    import torchtitan.trainer

    # train() sleeps 2 s on rank 0 at its end for the other ranks to finish; here there is one rank
    monkeypatch.setattr(torchtitan.trainer, "time", _NoSleep())
    run = None
    try:
        run = _Run(example, monkeypatch, job, sidecar)
        yield run
    finally:
        if run is not None:
            run.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        gc.enable()


def test_a_trainer_restored_from_the_snapshot_ends_bit_identical_to_one_never_stopped(
    example: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    with InProcess() as dep:
        ipc = dep.start_sidecar("a")
        dep.start_sidecar("b")  # the buddy: the snapshots become durable
        ranks = dep.sidecars["a"].state.ranks
        with _running(example, monkeypatch, "titan-reference", ipc) as never_stopped:
            never_stopped.trainer.train()
            assert never_stopped.manager.snapshotter.restored["step"] == 0  # a fresh job
            reference = never_stopped.digest()
        # closed after a clean run: the rank's arena is freed
        wait_until(lambda: ("titan-reference", 0) not in ranks, "the finished rank's arena freed")

        with _running(example, monkeypatch, "titan", ipc) as dying:
            train_step = dying.trainer.train_step

            def dies(data_iterator: Any) -> None:
                if dying.trainer.step > DIES_AFTER:
                    raise KeyboardInterrupt(f"died after step {DIES_AFTER}")
                train_step(data_iterator)

            dying.trainer.train_step = dies
            try:
                dying.trainer.train()
            except KeyboardInterrupt:
                assert dying.manager.snapshotter.wait(30)
                dying.close()  # in the except clause, as torchtitan's train.py closes a Trainer that raised
            else:
                pytest.fail("the Trainer did not die")
        assert ("titan", 0) in ranks  # its arena stays for the restarted rank

        with _running(example, monkeypatch, "titan", ipc) as resumed:
            resumed.trainer.train()
            restored = resumed.manager.snapshotter.restored
            assert restored["step"] == DIES_AFTER and restored["source"] == "local", restored
            assert resumed.trainer.step == STEPS
            assert sorted(resumed.losses) == list(range(DIES_AFTER + 1, STEPS + 1))
            assert resumed.losses == {s: loss for s, loss in never_stopped.losses.items() if s > DIES_AFTER}
            assert resumed.digest() == reference


def test_load_with_no_snapshot_and_no_checkpoint_starts_fresh(
    example: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    with InProcess() as dep, _running(example, monkeypatch, "titan-fresh", dep.start_sidecar("a")) as run:
        assert run.manager.load() is False
        assert run.trainer.step == 0
        assert run.manager.save_future is None  # DCP checkpoints are off: no save in flight, ever
