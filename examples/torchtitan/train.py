"""torchtitan's Llama 3 debug model trained by torchtitan's Trainer under torchrun, snapshotted by snapshotd.

Run it as any torchrun job (the multi-node commands are those of ``examples/torchrun_ddp/README.md``)::

    torchrun --nnodes 2 --nproc-per-node 2 --max-restarts 3 --rdzv-backend c10d \\
             --rdzv-endpoint store-host:29400 --rdzv-id run-42 train.py --steps 200 --out /tmp/run-42

The job is torchtitan's ``llama3_debugmodel`` config (FSDP2 over every rank, AdamW, warm-up then linear decay,
gradient clipping, torchtitan's stateful text data loader), with a word-level tokenizer and a text data set made
here (nothing is downloaded). snapshotd adds one line, the checkpoint manager::

    config.checkpoint = SnapshotdCheckpointManager.Config()

Without a GPU the script first applies ``cpu.py`` (torchtitan targets CUDA and a torch nightly; that file lists the
four patches and why).

With ``--out DIR`` each rank writes the files ``examples/torchrun_ddp/train.py`` writes (``losses-rank{R}.jsonl``
with the rank's own loss of every step, ``events-rank{R}.jsonl``, and ``final-rank{R}.json`` with the SHA-256 of
the rank's shards of the model and optimizer, ``digest``, and of those with the scheduler's state,
``state_digest``), so that a test compares a run that lost a node with one that did not.
"""

from __future__ import annotations

import time

T_START = time.time()  # before the heavy imports: when this process started

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

if not torch.cuda.is_available():
    import cpu

    cpu.apply()

from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torchtitan.models.llama3.config_registry import llama3_debugmodel  # noqa: E402

from snapshotd.client.integrations.torchtitan import SnapshotdCheckpointManager  # noqa: E402

WORDS = 200


def assets(seed: int) -> tuple[str, str]:
    """A word-level tokenizer folder and a JSON-lines text data set folder, made once per machine and seed (every
    rank writes the same bytes, each file by an atomic rename)."""
    root = os.path.join(tempfile.gettempdir(), f"snapshotd-torchtitan-example-{seed}")
    tokenizer, data = os.path.join(root, "tokenizer"), os.path.join(root, "data")
    rng = random.Random(seed)
    words = [f"w{i}" for i in range(WORDS)]
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(20, 80))) for _ in range(2000)]
    vocab = {token: i for i, token in enumerate(["<unk>", "<s>", "</s>", *words])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    files = {
        os.path.join(tokenizer, "tokenizer.json"): tok.to_str(),
        os.path.join(tokenizer, "tokenizer_config.json"): json.dumps(
            {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
        ),
        os.path.join(data, "train.json"): "".join(json.dumps({"text": t}) + "\n" for t in texts),
    }
    for path, text in files.items():
        if not os.path.exists(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(f"{path}.{os.getpid()}", "w") as f:
                f.write(text)
            os.replace(f"{path}.{os.getpid()}", path)
    return tokenizer, data


def digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        t = t.to_local() if isinstance(t, DTensor) else t
        h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200, help="optimizer steps in all (default %(default)s)")
    p.add_argument("--batch", type=int, default=2, help="sequences per rank per step (default %(default)s)")
    p.add_argument("--block", type=int, default=64, help="tokens per sequence (default %(default)s)")
    p.add_argument(
        "--layers", type=int, default=6, help="transformer blocks, at most 6 (default %(default)s)"
    )
    p.add_argument("--seed", type=int, default=0, help="model and data seed (default %(default)s)")
    p.add_argument("--step-delay", type=float, default=0.0, help="idle seconds after each step (default 0)")
    p.add_argument("--out", default=None, help="write losses, events and final digests here")
    return p.parse_args(argv)


def configure(a: argparse.Namespace) -> Any:
    """torchtitan's ``llama3_debugmodel`` config with the sizes of ``a``, this script's tokenizer and data, and
    snapshotd's checkpoint manager."""
    tokenizer, data = assets(a.seed)
    config = llama3_debugmodel()
    config.model_spec.model.layers = config.model_spec.model.layers[: a.layers]
    config.hf_assets_path = tokenizer
    config.dataloader.dataset_path = data
    config.training.steps = a.steps
    config.training.seq_len = a.block
    config.training.local_batch_size = a.batch
    config.training.mixed_precision_param = "float32"
    config.training.disable_cuda_graphs = not torch.cuda.is_available()
    config.parallelism.spmd_backend = "partial_dtensor"  # FSDP2 over plain parameters
    config.activation_checkpoint = None
    config.validator.enable = False
    config.debug.seed = a.seed
    config.dump_folder = os.path.join(a.out or tempfile.gettempdir(), "torchtitan")
    config.checkpoint = SnapshotdCheckpointManager.Config()  # snapshotd: a snapshot after every step
    return config


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    rank = int(os.environ.get("RANK", 0))
    config = configure(a)

    def record(kind: str, entry: dict[str, Any]) -> None:
        if a.out:
            os.makedirs(a.out, exist_ok=True)
            with open(os.path.join(a.out, f"{kind}-rank{rank}.jsonl"), "a") as f:
                f.write(json.dumps({"t": time.time(), "pid": os.getpid(), **entry}) + "\n")

    record("events", {"event": "start", "t": T_START})
    trainer = config.build()
    record("events", {"event": "built"})
    manager = trainer.checkpointer
    assert isinstance(manager, SnapshotdCheckpointManager)
    snapshotter = manager.snapshotter
    forward_backward, train_step = trainer.forward_backward_step, trainer.train_step

    def forward_backward_recorded(**kwargs: Any) -> torch.Tensor:
        loss = forward_backward(**kwargs)
        record("losses", {"step": trainer.step, "loss": loss.item(), "stride": snapshotter.stats.stride})
        return loss

    first = [True]

    def train_step_recorded(data_iterator: Any) -> None:
        if first[0]:
            first[0] = False
            record("events", {"event": "first_step", "step": trainer.step})
        train_step(data_iterator)
        if a.step_delay:
            time.sleep(a.step_delay)

    load = manager.load

    def load_recorded(step: int = -1) -> bool:
        resumed = load(step)
        restored = snapshotter.restored
        record(
            "events", {"event": "restored", "step": restored.get("step", 0), "source": restored.get("source")}
        )
        return resumed

    manager.load = load_recorded  # type: ignore[method-assign]
    trainer.forward_backward_step = forward_backward_recorded  # type: ignore[method-assign]
    trainer.train_step = train_step_recorded  # type: ignore[method-assign]
    try:
        trainer.train()
    except Exception:
        trainer.close()  # as torchtitan's own train.py does: snapshotd's arena stays for the restarted rank
        raise

    model = [t for part in trainer.model_parts for t in part.state_dict().values()]
    moments = [
        t for o in trainer.optimizers.optimizers for s in o.state_dict()["state"].values() for t in s.values()
    ]
    sched = json.dumps(trainer.lr_schedulers.state_dict(), sort_keys=True, default=str).encode()
    final = {
        "rank": rank,
        "steps": trainer.step,
        "digest": digest(model + moments),
        "state_digest": digest([*model, *moments, torch.frombuffer(bytearray(sched), dtype=torch.uint8)]),
    }
    if a.out:
        path = os.path.join(a.out, f"final-rank{rank}.json")
        with open(f"{path}.tmp", "w") as f:
            json.dump(final, f)
        os.replace(f"{path}.tmp", path)
    record("events", {"event": "done", "step": trainer.step})
    trainer.close()
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
