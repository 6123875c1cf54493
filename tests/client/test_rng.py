"""RNGState: every generator comes back exactly, through a real snapshot round trip and without pickle."""

from __future__ import annotations

import logging
import random
from typing import Any

import numpy as np
import pytest
import torch

from snapshotd.client.copies import copy_into
from snapshotd.client.load import restore_into
from snapshotd.client.rng import RNGState
from snapshotd.client.state import flatten


def draws() -> tuple[list[Any], ...]:
    """Draws from every generator, including the cached-Gaussian paths of random and NumPy."""
    py = [random.random(), random.gauss(0.0, 1.0), random.getrandbits(64)]
    npy = [float(np.random.rand()), float(np.random.standard_normal()), float(np.random.randint(1 << 30))]
    cpu = torch.rand(3).tolist() + torch.randn(2).tolist()
    cuda = [float(torch.rand(1, device=f"cuda:{i}")) for i in range(torch.cuda.device_count())]
    return py, npy, cpu, cuda


def test_round_trip_through_a_snapshot() -> None:
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    random.gauss(0.0, 1.0)  # leave a cached second Gaussian in random's state
    np.random.standard_normal()  # and in NumPy's
    state = {"rng": RNGState()}
    flat = flatten(state)
    data = torch.empty(flat.data_bytes, dtype=torch.uint8)
    copy_into(flat, data)
    expected = draws()
    assert draws() != expected  # the generators did move on

    restore_into(state, flat.entries, flat.meta, data)
    assert draws() == expected


def test_state_dict_round_trip_and_contents() -> None:
    rng = RNGState()
    sd = rng.state_dict()
    assert set(sd) == {"python", "numpy", "torch", "cuda"}
    assert type(sd["python"]) is tuple and type(sd["numpy"]) is tuple
    assert sd["torch"].dtype == torch.uint8
    assert len(sd["cuda"]) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    expected = draws()
    rng.load_state_dict(sd)
    assert draws() == expected


def test_state_dict_is_a_copy() -> None:
    sd = RNGState().state_dict()
    before = sd["torch"].clone()
    torch.rand(10)
    assert torch.equal(sd["torch"], before)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_cuda_states_without_cuda_are_skipped_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    sd = RNGState().state_dict()
    sd["cuda"] = [torch.zeros(16, dtype=torch.uint8)]
    expected = draws()
    with caplog.at_level(logging.WARNING, logger="snapshotd.client.rng"):
        RNGState().load_state_dict(sd)
    assert "1 CUDA generator states, this process sees 0 devices" in caplog.text
    assert draws() == expected  # the CPU generators were still restored


def test_missing_generator_is_a_key_error() -> None:
    sd = RNGState().state_dict()
    del sd["numpy"]
    with pytest.raises(KeyError):
        RNGState().load_state_dict(sd)
