"""RNGState: every generator comes back exactly, through a real snapshot round trip and without pickle."""

from __future__ import annotations

import logging
import random
from typing import Any

import numpy as np
import pytest
import torch

from snapshotd.client import rng as rng_module
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


def packed(state: Any) -> bytes:
    """``state`` as a snapshot carries it (so that 0.0 and -0.0, or 1 and True, differ)."""
    return flatten({"s": state}).meta


def assert_numpy_state(read: tuple[Any, ...]) -> None:
    """``read`` is what ``np.random.get_state()`` returns now: the same values of the same types."""
    expected = np.random.get_state(legacy=True)
    assert [type(v) for v in read] == [type(v) for v in expected]
    assert packed(read) == packed(expected)


def test_numpys_state_is_read_without_get_state_and_kept_while_the_generator_stays() -> None:
    assert (
        rng_module._gauss_offset() is not None
    )  # this NumPy's layout was found: the fast read is the one tested
    rng = RNGState()
    np.random.seed(7)
    first = rng.state_dict()
    assert_numpy_state(first["numpy"])
    assert not first["numpy"][1].flags.writeable
    assert rng.state_dict()["numpy"] is first["numpy"]
    assert rng.state_dict()["python"] is first["python"]
    changes = [
        lambda: np.random.standard_normal(),  # draws a pair, caches the second: has_gauss 1
        lambda: np.random.standard_normal(),  # takes the cached one: only has_gauss and gauss change
        lambda: np.random.rand(3),
        lambda: np.random.seed(7),
    ]
    last = first["numpy"]
    for change in changes:
        change()
        read = rng.state_dict()["numpy"]
        assert read is not last
        assert_numpy_state(read)
        last = read
    random.random()
    assert rng.state_dict()["python"] is not first["python"]


def test_numpys_state_set_back_to_the_same_key_with_a_cached_gaussian_is_read_anew() -> None:
    rng = RNGState()
    np.random.seed(3)
    saved = np.random.get_state()
    np.random.standard_normal()
    cached = np.random.get_state()  # has_gauss 1
    assert cached[3] == 1
    np.random.standard_normal()  # the key stays, has_gauss 0
    read = rng.state_dict()["numpy"]
    assert read[3] == 0
    np.random.set_state(cached)
    assert_numpy_state(rng.state_dict()["numpy"])
    np.random.set_state(saved)
    assert_numpy_state(rng.state_dict()["numpy"])


def test_numpys_state_from_get_state_where_the_layout_is_not_found(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rng_module, "_gauss_offset", lambda: None)
    rng = RNGState()
    np.random.standard_normal()
    sd = rng.state_dict()
    assert_numpy_state(sd["numpy"])
    expected = draws()
    rng.load_state_dict(sd)
    assert draws() == expected


def test_pythons_state_is_read_anew_whenever_the_generator_moved_and_kept_while_it_stays() -> None:
    assert rng_module._python_offset() is not None  # this Python's layout was found: the fast read is tested
    rng = RNGState()
    random.seed(5)
    last = rng.state_dict()["python"]
    assert last == random.getstate() and rng.state_dict()["python"] is last
    changes = [
        lambda: random.random(),
        lambda: random.gauss(0.0, 1.0),  # draws a pair, keeps the second in gauss_next
        lambda: random.gauss(0.0, 1.0),  # takes it: the words stay, gauss_next goes back to None
        lambda: random.setstate((3, random.getstate()[1], 0.25)),  # the same words with a cached Gaussian
        lambda: random.seed(5),
    ]
    for change in changes:
        change()
        read = rng.state_dict()["python"]
        assert read is not last and packed(read) == packed(random.getstate())
        assert rng.state_dict()["python"] is read
        last = read


def test_pythons_state_from_getstate_where_the_layout_is_not_found(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rng_module, "_python_offset", lambda: None)
    rng = RNGState()
    first = rng.state_dict()["python"]
    assert first == random.getstate() and rng.state_dict()["python"] is first
    for gauss in (0.0, -0.0):  # equal, but not the same state
        random.setstate((3, first[1], gauss))
        assert packed(rng.state_dict()["python"]) == packed(random.getstate())
    random.random()
    sd = rng.state_dict()
    assert sd["python"] == random.getstate() and sd["python"] is not first
    expected = draws()
    rng.load_state_dict(sd)
    assert draws() == expected


def test_the_generators_read_are_those_the_modules_functions_draw_from(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rng = RNGState()
    monkeypatch.setattr(random, "_inst", random.Random(1))  # not what random.random() draws from
    monkeypatch.setattr(np.random.mtrand, "_rand", np.random.RandomState(1))
    first = rng.state_dict()
    random.random()
    np.random.rand()
    sd = rng.state_dict()
    assert packed(sd["python"]) == packed(random.getstate()) != packed(first["python"])
    assert_numpy_state(sd["numpy"])
