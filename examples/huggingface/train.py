"""A small GPT-2 trained with the Hugging Face Trainer under torchrun, snapshotted by snapshotd.

Run it as any torchrun job (the multi-node commands are those of ``examples/torchrun_ddp/README.md``)::

    torchrun --nnodes 2 --nproc-per-node 2 --max-restarts 3 --rdzv-backend c10d \\
             --rdzv-endpoint store-host:29400 --rdzv-id run-42 train.py --steps 200 --out /tmp/run-42

The script is an ordinary Trainer script: a GPT-2 built from a config (nothing is downloaded), a data set of token
sequences made here, AdamW, warm-up then cosine LR, gradient clipping, dropout, DDP through accelerate (gloo on
CPU). snapshotd adds two lines: ``SnapshotdCallback()`` among the Trainer's callbacks, and
``trainer.train(resume_from_checkpoint=snap.restore(trainer))``. The callback snapshots the model, optimizer,
scheduler, the Trainer's state and every RNG after each optimizer step; after a loss, ``restore`` turns the
newest step every rank holds into a checkpoint the Trainer resumes from by its own rules.

With ``--out DIR`` each rank writes the files ``examples/torchrun_ddp/train.py`` writes (``losses-rank{R}.jsonl``
with the rank's own loss of every step, ``events-rank{R}.jsonl``, and ``final-rank{R}.json`` with the
SHA-256 of the model's and optimizer's tensors, ``digest``, and of those with the scheduler's state,
``state_digest``), so that a test compares a run that lost a node with one that did not.
"""

from __future__ import annotations

import time

T_START = time.time()  # before the heavy imports: when this process started

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from transformers import (  # noqa: E402
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from snapshotd.client.integrations.huggingface import SnapshotdCallback  # noqa: E402


class TokenSequences(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """``count`` sequences of ``block`` tokens: a walk that mostly steps by a fixed stride (something to learn)."""

    def __init__(self, count: int, block: int, vocab: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, vocab, (count, 1), generator=g)
        steps = torch.where(
            torch.rand(count, block - 1, generator=g) < 0.8, 3, torch.randint(0, vocab, (1,), generator=g)
        )
        self.ids = torch.cat([start, steps], dim=1).cumsum(dim=1) % vocab

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Recorder(TrainerCallback):  # type: ignore[misc]
    """The ``--out`` files, and ``--step-delay`` idle seconds after each step (an accelerator's share of it)."""

    def __init__(self, out: str | None, rank: int, snap: SnapshotdCallback, step_delay: float) -> None:
        self.out, self.rank, self.snap, self.step_delay = out, rank, snap, step_delay
        self.first: int | None = None
        if out:
            os.makedirs(out, exist_ok=True)

    def append(self, kind: str, record: dict[str, Any]) -> None:
        if self.out:
            with open(os.path.join(self.out, f"{kind}-rank{self.rank}.jsonl"), "a") as f:
                f.write(json.dumps({"t": time.time(), "pid": os.getpid(), **record}) + "\n")

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.first is None:
            self.first = state.global_step
            self.append("events", {"event": "first_step", "step": state.global_step})
        if self.step_delay:
            time.sleep(self.step_delay)


class RecordingTrainer(Trainer):  # type: ignore[misc]
    """The Trainer, writing each rank's own loss of every step to ``--out`` as it is computed: the Trainer's logged
    loss is gathered from every rank after the step (a collective), so a peer's loss can leave a snapshotted step
    without it."""

    recorder: Recorder | None = None

    def compute_loss(
        self, model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        result = super().compute_loss(
            model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
        )
        if self.recorder is not None:
            snapshotter = self.recorder.snap.snapshotter
            stride = snapshotter.stats.stride if snapshotter is not None else 0
            loss = result[0] if return_outputs else result
            self.recorder.append(
                "losses", {"step": self.state.global_step + 1, "loss": loss.item(), "stride": stride}
            )
        return result


def digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200, help="optimizer steps in all (default %(default)s)")
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step (default %(default)s)")
    p.add_argument("--block", type=int, default=32, help="tokens per sequence (default %(default)s)")
    p.add_argument("--width", type=int, default=64, help="model width (default %(default)s)")
    p.add_argument("--layers", type=int, default=2, help="transformer blocks (default %(default)s)")
    p.add_argument("--heads", type=int, default=2, help="attention heads (default %(default)s)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="model, data and Trainer seed (default %(default)s)")
    p.add_argument("--step-delay", type=float, default=0.0, help="idle seconds after each step (default 0)")
    p.add_argument("--out", default=None, help="write losses, events and final digests here")
    a = p.parse_args(argv)

    rank = int(os.environ.get("RANK", 0))
    recorder_out = a.out
    vocab = 64
    data = TokenSequences(64 * int(os.environ.get("WORLD_SIZE", 1)), a.block, vocab, a.seed)
    args = TrainingArguments(
        output_dir=os.path.join(a.out or ".", "trainer"),
        per_device_train_batch_size=a.batch,
        max_steps=a.steps,
        learning_rate=a.lr,
        lr_scheduler_type="cosine",
        warmup_steps=max(1, a.steps // 10),
        weight_decay=0.1,
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=not torch.cuda.is_available(),
        disable_tqdm=True,
        seed=a.seed,
    )
    torch.manual_seed(a.seed)  # the same initial weights on every rank
    config = GPT2Config(vocab_size=vocab, n_positions=a.block, n_embd=a.width, n_layer=a.layers, n_head=a.heads,
                        bos_token_id=0, eos_token_id=0)  # fmt: skip
    snap = SnapshotdCallback()  # job, rank, world size and sidecar from torchrun's environment
    recorder = Recorder(recorder_out, rank, snap, a.step_delay)
    recorder.append("events", {"event": "start", "t": T_START})
    trainer = RecordingTrainer(
        model=GPT2LMHeadModel(config), args=args, train_dataset=data, callbacks=[snap, recorder]
    )
    trainer.recorder = recorder
    recorder.append("events", {"event": "built"})
    resume = snap.restore(trainer)
    assert snap.snapshotter is not None
    restored = snap.snapshotter.restored
    recorder.append(
        "events", {"event": "restored", "step": restored.get("step", 0), "source": restored.get("source")}
    )
    if (
        restored.get("step", 0) >= a.steps
    ):  # restarted after the last step (its teardown failed): nothing left
        return 0
    trainer.train(resume_from_checkpoint=resume)

    model = [t for t in trainer.model.state_dict().values()]
    moments = [t for s in trainer.optimizer.state_dict()["state"].values() for t in s.values()]
    sched = json.dumps(trainer.lr_scheduler.state_dict(), sort_keys=True, default=str).encode()
    final = {
        "rank": rank,
        "steps": trainer.state.global_step,
        "digest": digest(model + moments),
        "state_digest": digest([*model, *moments, torch.frombuffer(bytearray(sched), dtype=torch.uint8)]),
    }
    if recorder_out:
        path = os.path.join(recorder_out, f"final-rank{rank}.json")
        with open(f"{path}.tmp", "w") as f:
            json.dump(final, f)
        os.replace(f"{path}.tmp", path)
    recorder.append("events", {"event": "done", "step": trainer.state.global_step})
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
