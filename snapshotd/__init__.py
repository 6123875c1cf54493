"""snapshotd: in-memory, every-step snapshots for PyTorch training (see the README)."""

from __future__ import annotations

import importlib.metadata

__all__ = ["__version__"]

try:
    __version__ = importlib.metadata.version("snapshotd")
except importlib.metadata.PackageNotFoundError:  # run from a checkout that was never installed
    __version__ = "0+unknown"
