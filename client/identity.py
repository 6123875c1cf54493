"""Who a Snapshotter is: its job, rank and world size, and where its node's sidecar listens.

Each comes from the argument when given, else from the environment a launcher sets up: the job from
``$SNAPSHOTD_JOB``, else torchrun's ``$TORCHELASTIC_RUN_ID``, else Slurm's ``slurm-$SLURM_JOB_ID`` (a requeued job
keeps its id); rank and world size from ``torch.distributed`` when it is initialised, else torchrun's ``$RANK`` and
``$WORLD_SIZE``, else Slurm's ``$SLURM_PROCID`` and ``$SLURM_NTASKS`` (one task per rank, ``srun`` without
torchrun); the sidecar's ipc path from ``$SNAPSHOTD_SIDECAR``, else the node's per-user default, which
``snapshotd serve`` also binds by default.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from snapshotd.shm import default_ipc_path

__all__ = ["TORCHRUN_DEFAULT_RUN_ID", "Identity"]

TORCHRUN_DEFAULT_RUN_ID = "none"
"""``$TORCHELASTIC_RUN_ID`` when torchrun is given no ``--rdzv-id``: refused as a job name."""


def _env_int(*names: str) -> int | None:
    """The first of ``names`` set in the environment, as an int (None when none is).

    Raises:
        ValueError: its value is not an int.
    """
    for name in names:
        value = os.environ.get(name)
        if value not in (None, ""):
            try:
                return int(value)  # type: ignore[arg-type]
            except ValueError:
                raise ValueError(f"${name}={value!r} is not an integer") from None
    return None


def _slurm_job() -> str:
    job_id = os.environ.get("SLURM_JOB_ID", "")
    return f"slurm-{job_id}" if job_id else ""


@dataclasses.dataclass(frozen=True, slots=True)
class Identity:
    job: str
    rank: int
    world_size: int
    sidecar: str
    """The sidecar's ipc path."""

    @classmethod
    def resolve(
        cls, job: str | None, rank: int | None, world_size: int | None, sidecar: str | None
    ) -> Identity:
        """The identity from the arguments given and the environment (see the module docstring).

        Raises:
            ValueError: no job name, no rank or world size, or a rank outside the world size.
        """
        dist_ready = torch.distributed.is_available() and torch.distributed.is_initialized()
        job = job or os.environ.get("SNAPSHOTD_JOB") or os.environ.get("TORCHELASTIC_RUN_ID") or _slurm_job()
        if rank is None:
            rank = torch.distributed.get_rank() if dist_ready else _env_int("RANK", "SLURM_PROCID")
        if world_size is None:
            world_size = (
                torch.distributed.get_world_size() if dist_ready else _env_int("WORLD_SIZE", "SLURM_NTASKS")
            )
        if not job:
            raise ValueError(
                "no job name: pass job= or set SNAPSHOTD_JOB (torchrun sets TORCHELASTIC_RUN_ID, Slurm SLURM_JOB_ID)"
            )
        if job == TORCHRUN_DEFAULT_RUN_ID:
            raise ValueError(
                f"the job name is torchrun's default run id {job!r} (no --rdzv-id was given): every job launched "
                "without one would share its snapshots. Give torchrun --rdzv-id, or pass job= or SNAPSHOTD_JOB"
            )
        if rank is None or world_size is None:
            raise ValueError(
                "rank/world_size unknown: pass them, initialise torch.distributed, or set RANK/WORLD_SIZE "
                "(or run under srun: SLURM_PROCID/SLURM_NTASKS)"
            )
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        return cls(
            job, rank, world_size, sidecar or os.environ.get("SNAPSHOTD_SIDECAR") or default_ipc_path()
        )
