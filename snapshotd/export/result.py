"""What an export gives back: :class:`Exported` when it is written, :class:`ExportError` when it cannot be."""

from __future__ import annotations

import dataclasses

__all__ = ["ExportError", "Exported"]


class ExportError(RuntimeError):
    """The export cannot be done; the message says why in one line."""


@dataclasses.dataclass(frozen=True, slots=True)
class Exported:
    """What :func:`~snapshotd.export.export_checkpoint` wrote."""

    job: str
    step: int
    world_size: int
    pulled: list[int]
    """The ranks whose snapshots were pulled (rank 0 first)."""
    pulled_bytes: int
    """Tensor bytes of those snapshots."""
    out: str
