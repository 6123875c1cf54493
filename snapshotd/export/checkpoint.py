"""Writing the assembled state dict as a DCP checkpoint.

The state goes through DCP's own planner and storage writer with no process group
(``dcp.save(..., no_dist=True)``), into a sibling directory of ``out`` that is renamed to ``out`` when complete:
``out`` holds a whole checkpoint or nothing.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import warnings
from typing import Any

from .result import ExportError

__all__ = ["check_out", "write_checkpoint"]


def check_out(out: str) -> str:
    """``out`` as an absolute path, checked to be a place for the checkpoint: absent or an empty directory, in a
    directory that exists.

    Raises:
        ExportError: it is not.
    """
    out = os.path.abspath(out)
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise ExportError(f"{out} exists and is not an empty directory")
    parent = os.path.dirname(out)
    if not os.path.isdir(parent):
        raise ExportError(f"{parent} is not a directory")
    return out


def write_checkpoint(state: dict[str, Any], out: str) -> None:
    """Write ``state`` as a DCP checkpoint in ``out`` (as :func:`check_out` returned it); on failure nothing is
    left behind."""
    import torch.distributed.checkpoint as dcp

    partial = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.partial-", dir=os.path.dirname(out))
    try:
        with warnings.catch_warnings():  # that no process group is needed is the point
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save(
                state,
                storage_writer=dcp.FileSystemWriter(partial),
                planner=dcp.DefaultSavePlanner(),
                no_dist=True,
            )
        if os.path.isdir(out):
            os.rmdir(out)  # empty, checked by check_out
        os.rename(partial, out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
