"""The random number generators of a training process, as one Stateful object."""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

__all__ = ["RNGState"]

logger = logging.getLogger(__name__)


class RNGState:
    """Captures and restores Python's ``random``, NumPy's global generator, torch's CPU generator and the
    generator of every CUDA device.

    Put it in the Snapshotter's state (``{"rng": RNGState()}``) so that a restored run draws the same random
    numbers (dropout masks, data shuffles) as one that never failed. Its state dict holds only tuples, ints,
    floats, str, a NumPy uint32 array and uint8 tensors, so it snapshots without pickle.
    """

    def state_dict(self) -> dict[str, Any]:
        """The current state of every generator. Tensors are fresh copies, never views of generator state."""
        return {
            "python": random.getstate(),
            "numpy": np.random.get_state(legacy=True),
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Set every generator to ``state_dict`` (from :meth:`state_dict`, possibly via a snapshot).

        CUDA states are set for the devices that exist both in the snapshot and here; a different device count
        is logged as a warning, since draws on the missing or extra devices will differ from the original run.

        Raises:
            KeyError: a generator's state is missing.
            TypeError, ValueError: a state of the wrong form (from ``random``, NumPy or torch).
        """
        random.setstate(state_dict["python"])
        np.random.set_state(state_dict["numpy"])
        torch.set_rng_state(state_dict["torch"])
        cuda = list(state_dict["cuda"])
        here = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if len(cuda) != here:
            logger.warning(
                "RNG snapshot has %d CUDA generator states, this process sees %d devices", len(cuda), here
            )
        for device, state in enumerate(cuda[:here]):
            torch.cuda.set_rng_state(state, device)
