"""Code we did not write: karpathy's nanoGPT ``train.py`` with only the README's lines added, under torchrun.

``tests/third_party/nanogpt/`` holds nanoGPT unchanged and ``snapshotd.patch``: the hook as the README shows
it for a script that keeps its loop state in plain variables, and the two edits a CPU run needs (its README
says which). The patch is applied to a copy, and the script trains a small GPT on random tokens (dropout on,
so every step draws from the RNG; gradient accumulation, so DDP skips its all-reduce on some backward passes)
as two emulated nodes of one DDP rank each, every node with its own sidecar and torchrun agent. Node B (agent,
worker, sidecar) is SIGKILLed part-way, once a step is durable, and a replacement node starts; the surviving
agent restarts its worker. Against a failure-free run beside it: every loss nanoGPT prints, the evaluation and the
checkpoint it writes at the end (model, optimizer, iteration, best validation loss) are the same.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import os
import pickle
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from snapshotd.bench.nodes import EmulatedNode, RendezvousStore, marked_processes
from snapshotd.bench.torchrun_trial import TORCHRUN_ENV, TrialConfig
from snapshotd.status import fetch_status

from .conftest import Cluster, started_cluster

pytestmark = pytest.mark.integration

NANOGPT = Path(__file__).resolve().parents[1] / "third_party" / "nanogpt"
VOCAB = 64
ITERS = 40
HOLD_AT = 4
"""Once nanoGPT printed this iteration, node A's worker is held (SIGSTOP) until a step is durable (on every
rank's buddy); then node B dies and A's worker goes on. Without the hold, a run on a busy machine could end
before its sidecars made any step durable."""
CONFIG = (
    "--device=cpu",
    "--compile=False",
    "--dtype=float32",
    "--backend=gloo",
    "--dataset=synthetic",
    f"--max_iters={ITERS}",
    f"--eval_interval={ITERS}",
    "--eval_iters=2",
    "--log_interval=1",
    "--batch_size=4",
    "--block_size=32",
    "--n_layer=2",
    "--n_head=2",
    "--n_embd=32",
    "--dropout=0.1",
    "--gradient_accumulation_steps=4",
    "--warmup_iters=4",
    f"--lr_decay_iters={ITERS}",
)
"""nanoGPT's own flags: CPU and gloo, a 30k-parameter model, two micro-steps per rank and iteration (nanoGPT
divides the accumulation steps by the world size), an evaluation and a checkpoint at the end."""

ENV = {**TORCHRUN_ENV, "OMP_NUM_THREADS": "1"}
"""The agents' environment: the trial's torchrun settings, one thread per worker (two runs share two cores)."""

_ITER = re.compile(r"^iter (\d+): loss (\S+),", re.M)
_EVAL = re.compile(r"^step (\d+): train loss (\S+), val loss (\S+)", re.M)
_START = "tokens per iteration will be"  # every worker prints it as it starts


def _assemble(dest: Path) -> None:
    """nanoGPT with the patch applied in ``dest``, and a dataset of random tokens in its format."""
    dest.mkdir()
    for name in ("train.py", "model.py", "configurator.py"):
        shutil.copy(NANOGPT / name, dest / name)
    subprocess.run(["git", "apply", str(NANOGPT / "snapshotd.patch")], cwd=dest, check=True, timeout=30)
    data = dest / "data" / "synthetic"
    data.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for split, size in (("train", 20_000), ("val", 4_000)):
        rng.integers(0, VOCAB, size, dtype=np.uint16).tofile(data / f"{split}.bin")
    with open(data / "meta.pkl", "wb") as f:  # nanoGPT reads its vocabulary size from here
        pickle.dump({"vocab_size": VOCAB}, f)


@dataclasses.dataclass
class Run:
    """What one run printed on node A (rank 0, nanoGPT's master process), per worker process, and wrote."""

    processes: list[str]
    """Node A's worker output, one string per process (a restart starts a new one)."""
    checkpoint: dict
    durable_at_loss: int = 0
    """With a node lost: the job's durable step when it died."""

    def iters(self, process: int) -> dict[int, str]:
        return {int(i): loss for i, loss in _ITER.findall(self.processes[process])}

    def evals(self) -> dict[int, tuple[str, str]]:
        return {int(i): (t, v) for p in self.processes for i, t, v in _EVAL.findall(p)}


def _durable(cluster: Cluster, job: str) -> int:
    """``job``'s durable step, as the coordinator's status says (0 if it cannot tell now)."""
    with contextlib.suppress(TimeoutError, ValueError, RuntimeError):
        jobs = fetch_status(cluster.coordinator_addr, secret=None, timeout=1.0)["jobs"]
        return max((j["durable"] for j in jobs if j["job"] == job), default=0)
    return 0


def _signal(pids: set[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _run(cluster: Cluster, code: Path, workdir: Path, *, name: str, fail: bool) -> Run:
    """nanoGPT under two torchrun agents (nodes A and B); with ``fail``, B is lost (see HOLD_AT) and C replaces
    it. Every process started here has ended on return.

    The failure-free run and the trial run at once, so their nodes have addresses of their own (the trial's from
    127.0.0.2, the reference's from 127.0.0.12): two torchrun agents on one address can pick the same free port
    for their workers' group at the same moment, and the two jobs' workers then meet in one group."""
    workdir.mkdir()
    cfg = TrialConfig()
    first = 2 if fail else 12
    store = RendezvousStore(str(workdir), host=cfg.store_host)
    nodes: list[EmulatedNode] = []
    job = cluster.job(name)
    out = f"out-{name}"

    def start(index: int) -> EmulatedNode:
        torchrun_args = [
            "--nnodes",
            "2",
            "--nproc-per-node",
            "1",
            "--max-restarts",
            "3",
            "--monitor-interval",
            "0.1",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            store.endpoint,
            "--rdzv-id",
            job,
            "--rdzv-conf",
            cfg.rdzv_conf,
        ]
        node = EmulatedNode(
            cluster,
            cluster.node(f"{'ABC'[index]}-{name}"),
            f"127.0.0.{first + index}",
            torchrun_args=torchrun_args,
            script="train.py",
            script_args=[*CONFIG, f"--out_dir={out}"],
            env=ENV,
            workdir=str(workdir),
            cwd=str(code),
        )
        nodes.append(node)
        return node

    deadline = time.monotonic() + 120
    durable = 0
    with contextlib.ExitStack() as stack:  # every stop runs, even if one raises
        stack.callback(store.stop)
        a = start(0)
        stack.callback(a.stop)
        b = start(1)
        stack.callback(b.stop)
        if fail:
            while not re.search(rf"^iter {HOLD_AT}: ", Path(a.log_path).read_text(errors="replace"), re.M):
                assert all(n.agent.poll() is None for n in nodes), f"an agent exited early; see {workdir}"
                assert time.monotonic() < deadline, f"iteration {HOLD_AT} never came; see {workdir}"
                time.sleep(0.05)
            held = a.processes() - {a.agent.pid}
            _signal(held, signal.SIGSTOP)
            try:
                while (durable := _durable(cluster, job)) < 1:
                    assert time.monotonic() < deadline, f"no step became durable; see {workdir}"
                    time.sleep(0.05)
                b.kill()
            finally:
                _signal(held, signal.SIGCONT)
            stack.callback(start(2).stop)
        running = [n for n in nodes if n is not b or not fail]
        while any(n.agent.poll() is None for n in running):
            assert all(n.agent.poll() in (None, 0) for n in running), f"an agent failed; see {workdir}"
            assert time.monotonic() < deadline, f"the job did not finish in time; see {workdir}"
            time.sleep(0.05)
    text = Path(a.log_path).read_text(errors="replace")
    checkpoint = torch.load(code / out / "ckpt.pt", weights_only=True)
    return Run(text.split(_START)[1:], checkpoint, durable)


def _same(a: object, b: object) -> bool:
    """Bit for bit: tensors by value, dtype and shape; containers item by item."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


@pytest.mark.timeout(240)
def test_nanogpt_with_the_readme_lines_loses_a_node_and_ends_bit_identical(cluster, tag, tmp_path) -> None:
    code = tmp_path / "nanogpt"
    _assemble(code)
    # the reference has a coordinator of its own: one shared would place the trial's copies on the reference's
    # nodes too, which stop when the reference ends, maybe before the trial's node B is lost
    with (
        started_cluster(str(tmp_path / "rc"), tag) as alone,
        concurrent.futures.ThreadPoolExecutor(2) as pool,
    ):
        runs = {
            name: pool.submit(_run, c, code, tmp_path / name, name=name, fail=name == "trial")
            for name, c in (("reference", alone), ("trial", cluster))
        }
        reference, trial = (runs[name].result() for name in ("reference", "trial"))

    assert len(reference.processes) == 1 and sorted(reference.iters(0)) == list(range(ITERS + 1))
    assert len(trial.processes) >= 2, "the survivor's worker restarts"
    before, after = trial.iters(0), trial.iters(len(trial.processes) - 1)
    assert before and after, trial.processes
    # "iter N" is printed once iteration N has stepped: N + 1 steps are done
    reached, restored = max(before) + 1, min(after)
    # the step durable when B died is recoverable; how many steps after it are lost depends on how far the
    # sidecars were behind (the README's bound, tested in tests/bench/test_soak.py, needs the Snapshotter's stride)
    assert 1 <= trial.durable_at_loss <= restored <= reached < ITERS, (
        trial.durable_at_loss,
        restored,
        reached,
    )
    # every printed loss, the ones run again included, is the failure-free run's
    for process in range(len(trial.processes)):
        printed = trial.iters(process)
        assert {i: reference.iters(0)[i] for i in printed} == printed, f"worker process {process}"
    assert max(after) == ITERS
    assert trial.evals() == reference.evals() and ITERS in reference.evals()
    ref, got = reference.checkpoint, trial.checkpoint
    assert got["iter_num"] == ref["iter_num"] == ITERS
    assert _same(got["model"], ref["model"]), "model differs"
    assert _same(got["optimizer"], ref["optimizer"]), "optimizer differs"
    assert _same(got["best_val_loss"], ref["best_val_loss"])
    assert not marked_processes(tag)  # every agent and worker of both runs has ended
    print(
        f"nanoGPT: node lost after {reached} steps ({trial.durable_at_loss} durable), restored step {restored}"
    )
