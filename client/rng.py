"""The random number generators of a training process, as one Stateful object."""

from __future__ import annotations

import ctypes
import functools
import logging
import random
import struct
import sys
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

__all__ = ["RNGState"]

logger = logging.getLogger(__name__)

_MT_WORDS = 624
_MT_BYTES = 4 * _MT_WORDS + 4
"""MT19937's ``mt19937_state`` (``uint32_t key[624]; int pos``), at ``bit_generator.ctypes.state_address``."""
_AUG = struct.Struct("<i4xd")
"""A legacy generator's cached Gaussian: ``int has_gauss`` (padded to 8 bytes), then ``double gauss``."""
_PROBES = ((1, 0.7853981633974483), (1, -1.4142135623730951e-3), (0, 0.0))


_PY_WORDS = struct.Struct(f"<i{_MT_WORDS}I")
"""CPython's ``random.Random`` object after its header: ``int index; uint32_t state[624]``."""


@functools.cache
def _python_offset() -> int | None:
    """Where a ``random.Random`` object holds its Mersenne Twister (index, then key; which only ``getstate()``
    tells), found on a private instance: set with ``setstate`` to known states, each must be read back at exactly
    one offset. None where it is not (another Python's layout): ``getstate()`` is then compared instead."""
    if sys.implementation.name != "cpython":  # an object's address is where its struct starts in CPython only
        return None
    probe = random.Random(0)
    size = type(probe).__basicsize__
    offset = None
    for seed in (1, 2):
        state = random.Random(seed).getstate()
        probe.setstate(state)
        words = state[1]
        packed = _PY_WORDS.pack(words[-1], *words[:-1])
        mem = ctypes.string_at(id(probe), size)
        if offset is None:
            if mem.count(packed) != 1:
                return None
            offset = mem.find(packed)
        elif mem[offset : offset + _PY_WORDS.size] != packed:
            return None
    return offset


class _PythonGlobal:
    """What ``random.getstate()`` returns: the same tuple object as the last read while the generator has not
    moved (its state words read from the generator object, where their place is known), else ``getstate()``."""

    __slots__ = ("_last", "_raw")

    def __init__(self) -> None:
        self._raw = b""
        self._last: tuple[Any, ...] = ()

    def state(self) -> tuple[Any, ...]:
        inst = getattr(random.getstate, "__self__", None)  # the generator random's functions draw from
        offset = _python_offset()
        if offset is None or type(inst) is not random.Random:
            state = random.getstate()
            last = self._last
            if not last or state[1] != last[1] or state[2] is not last[2]:  # gauss_next: 0.0 == -0.0
                self._raw, self._last = b"", state
            return self._last
        # the words before getstate(): a draw from another thread in between is then caught next time
        raw = ctypes.string_at(id(inst) + offset, _PY_WORDS.size)
        if raw != self._raw or inst.gauss_next is not self._last[2]:  # type: ignore[attr-defined]
            self._raw, self._last = raw, inst.getstate()
        return self._last


@functools.cache
def _gauss_offset() -> int | None:
    """Where a ``numpy.random.RandomState`` object holds its cached Gaussian (``has_gauss``, ``gauss``; which only
    ``get_state()`` tells), found on a private instance: set to known values with ``set_state``, it must be read
    back at exactly one offset, the key and position from ``state_address`` likewise. None where it is not (another
    NumPy build's layout): the state is then read with ``get_state()``."""
    rs = np.random.RandomState(0)
    if sys.implementation.name != "cpython" or type(rs._bit_generator) is not np.random.MT19937:
        return None
    base = id(rs)
    key, pos = rs.get_state(legacy=True)[1], 5  # type: ignore[index]
    offset = None
    for has_gauss, gauss in _PROBES:
        rs.set_state(("MT19937", key, pos, has_gauss, gauss))
        if offset is None:
            mem = ctypes.string_at(base, type(rs).__basicsize__)
            hits = [i for i in range(8, len(mem) - 15) if _AUG.unpack_from(mem, i) == (has_gauss, gauss)]
            if len(hits) != 1:
                return None
            offset = hits[0]
        raw = ctypes.string_at(rs._bit_generator.ctypes.state_address, _MT_BYTES)
        if _AUG.unpack(ctypes.string_at(base + offset, _AUG.size)) != (has_gauss, gauss):
            return None
        if raw[: 4 * _MT_WORDS] != key.tobytes() or int.from_bytes(raw[-4:], "little", signed=True) != pos:
            return None
    return offset


class _NumpyGlobal:
    """What ``np.random.get_state(legacy=True)`` returns, read from the generator's C structs (``get_state``
    copies the key one word at a time): the same tuple object as the last read while the generator has not moved,
    its key array read-only."""

    __slots__ = ("_last", "_raw")

    def __init__(self) -> None:
        self._raw = b""
        self._last: tuple[Any, ...] = ()

    def state(self) -> tuple[Any, ...]:
        rs = getattr(np.random.get_state, "__self__", None)  # the generator np.random's functions draw from
        offset = _gauss_offset()
        bg = getattr(rs, "_bit_generator", None)
        if offset is None or type(rs) is not np.random.RandomState or type(bg) is not np.random.MT19937:
            return np.random.get_state(legacy=True)  # type: ignore[return-value]
        raw = ctypes.string_at(bg.ctypes.state_address, _MT_BYTES) + ctypes.string_at(
            id(rs) + offset, _AUG.size
        )
        if raw != self._raw:
            key = np.frombuffer(raw, np.uint32, _MT_WORDS)  # a view of bytes: read-only for good
            pos = int.from_bytes(raw[4 * _MT_WORDS : _MT_BYTES], "little", signed=True)
            self._raw, self._last = raw, ("MT19937", key, pos, *_AUG.unpack_from(raw, _MT_BYTES))
        return self._last


class RNGState:
    """Captures and restores Python's ``random``, NumPy's global generator, torch's CPU generator and the
    generator of every CUDA device.

    Put it in the Snapshotter's state (``{"rng": RNGState()}``) so that a restored run draws the same random
    numbers (dropout masks, data shuffles) as one that never failed. Its state dict holds only tuples, ints,
    floats, str, a NumPy uint32 array and uint8 tensors, so it snapshots without pickle.
    """

    def __init__(self) -> None:
        self._python = _PythonGlobal()
        self._numpy = _NumpyGlobal()
        self._cuda: bool | None = None

    def state_dict(self) -> dict[str, Any]:
        """The current state of every generator. Tensors are fresh copies, never views of generator state. The
        ``python`` and ``numpy`` entries are tuples, immutable where their generator's state is read from its
        object (the NumPy key array read-only), and then the very objects of the last call while their generator
        has not moved, so that a capture can reuse what it made of them."""
        if self._cuda is None:
            self._cuda = torch.cuda.is_available()
        return {
            "python": self._python.state(),
            "numpy": self._numpy.state(),
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if self._cuda else [],
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
