"""flatten / copy_into / restore_into: bit-identical round trips, in-place restore, types, errors, layouts."""

from __future__ import annotations

import collections
import contextlib
import datetime
import math
import os
import pickle
import struct
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from snapshotd.client.copies import copy_into
from snapshotd.client.load import restore_into
from snapshotd.client.rng import RNGState
from snapshotd.client.state import FlatState, flatten
from snapshotd.snapshot_format import ALIGN, FORMAT_VERSION, TensorRef, decode_meta


def snapshot(state: dict[str, Any]) -> tuple[FlatState, torch.Tensor]:
    flat = flatten(state)
    data = torch.full((flat.data_bytes,), 0xA5, dtype=torch.uint8)
    copy_into(flat, data)
    return flat, data


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_identical(a: Any, b: Any, where: str = "state") -> None:
    """Same types, same keys in the same order, same bytes (NaN payloads and -0.0 included)."""
    assert type(a) is type(b), f"{where}: {type(a)} vs {type(b)}"
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), where
        assert torch.equal(raw(a), raw(b)), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            assert_identical(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_identical(x, y, f"{where}[{i}]")
    elif isinstance(a, float):
        assert struct.pack("<d", a) == struct.pack("<d", b), where
    elif isinstance(a, np.ndarray | np.generic):
        assert (a.dtype, a.shape, a.tobytes()) == (b.dtype, b.shape, b.tobytes()), where
    else:
        assert a == b, where


def clone_tree(x: Any) -> Any:
    """An independent copy of a state dict (tensors cloned), keeping container types."""
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, dict):
        return type(x)((k, clone_tree(v)) for k, v in x.items())
    if isinstance(x, list | tuple) and type(x) in (list, tuple):
        return type(x)(clone_tree(v) for v in x)
    if isinstance(x, np.ndarray):
        return x.copy()
    return x


@pytest.fixture
def no_pickle(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make pickle's entry points fail loudly (its classes stay: torch subclasses them at import)."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("pickle used")

    for name in ("dumps", "loads", "dump", "load"):
        monkeypatch.setattr(pickle, name, refuse)


class Warmup:
    """A picklable-style LambdaLR callable: LambdaLR saves its __dict__."""

    def __init__(self, steps: int) -> None:
        self.steps = steps

    def __call__(self, epoch: int) -> float:
        return min(1.0, (epoch + 1) / self.steps)


SCHEDULERS = {
    "step": lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
    "cosine": lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=7),
    "lambda-object": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, Warmup(4)),
}


class Trainer:
    """A model with dropout and BatchNorm, AdamW, a scheduler and a GradScaler; data from the global RNG."""

    def __init__(self, seed: int, sched: str) -> None:
        torch.manual_seed(seed)
        self.model = nn.Sequential(
            nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 4)
        )
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
        self.sched = SCHEDULERS[sched](self.opt)
        self.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**seed)
        self.extra: dict[Any, Any] = {"epoch": seed, "history": [float(seed)], 7: (seed, "x")}

    def state(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "optim": self.opt,
            "sched": self.sched,
            "scaler": self.scaler,
            "rng": RNGState(),
            "extra": self.extra,
        }

    def train(self, steps: int) -> list[float]:
        losses = []
        for _ in range(steps):
            x = torch.randn(32, 8)
            self.opt.zero_grad()
            loss = self.model(x).pow(2).mean()
            loss.backward()
            self.opt.step()
            self.sched.step()
            self.extra["epoch"] += 1
            self.extra["history"].append(loss.item())
            losses.append(loss.item())
        return losses


@pytest.mark.parametrize("sched", sorted(SCHEDULERS))
def test_training_state_round_trip(sched: str, no_pickle: None) -> None:
    run = Trainer(0, sched)
    run.train(3)
    state = run.state()
    expected = {k: clone_tree(v.state_dict() if hasattr(v, "state_dict") else v) for k, v in state.items()}
    flat, data = snapshot(state)
    reference = run.train(4)

    # Restore into the same objects: nothing is reallocated, and training continues bit-identically.
    params = [(id(p), p.data_ptr()) for p in run.model.parameters()]
    buffers = [(id(b), b.data_ptr()) for b in run.model.buffers()]
    restore_into(state, flat.entries, flat.meta, data)
    assert [(id(p), p.data_ptr()) for p in run.model.parameters()] == params
    assert [(id(b), b.data_ptr()) for b in run.model.buffers()] == buffers
    assert run.extra is state["extra"]
    for k, v in state.items():
        assert_identical(v.state_dict() if hasattr(v, "state_dict") else v, expected[k], f"state[{k!r}]")
    assert run.train(4) == reference

    # Restore into freshly built objects of another seed: same state, same trajectory as a run never restored.
    fresh = Trainer(1, sched)
    fresh_state = fresh.state()
    restore_into(fresh_state, flat.entries, flat.meta, data)
    data.zero_()  # the restored state must not be a view of the buffer
    for k, v in fresh_state.items():
        assert_identical(v.state_dict() if hasattr(v, "state_dict") else v, expected[k], f"state[{k!r}]")
    assert fresh.train(4) == reference


def test_lambda_scheduler() -> None:
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # torch's LambdaLR.state_dict() stores None for a plain function, so that is snapshotable...
    plain = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 0.9**epoch)
    flat, data = snapshot({"sched": plain})
    restore_into({"sched": plain}, flat.entries, flat.meta, data)
    assert plain.lr_lambdas[0](2) == pytest.approx(0.81)

    # ...but a callable object is saved by its __dict__, and a function inside it cannot be carried.
    class Holder:
        def __init__(self) -> None:
            self.fn = lambda epoch: 1.0

        def __call__(self, epoch: int) -> float:
            return self.fn(epoch)

    held = torch.optim.lr_scheduler.LambdaLR(opt, Holder())
    with pytest.raises(TypeError) as info:
        flatten({"sched": held})
    assert str(info.value).startswith(
        "state['sched']['lr_lambdas'][0]['fn']: cannot snapshot a value of type function"
    )
    assert "never pickle" in str(info.value)


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Arbitrary bit patterns (NaN payloads, infinities, -0.0 included) of ``dtype``."""
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    size = torch.empty((), dtype=dtype).element_size()
    bits = torch.randint(0, 256, (math.prod(shape) * size,), dtype=torch.uint8, generator=gen)
    return bits.view(dtype).reshape(shape)


DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int8,
    torch.bool,
    torch.uint8,
    torch.complex64,
    torch.complex128,
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dtypes_and_shapes_bit_identical(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    shapes = [(), (0,), (3, 0, 2), (1,), (5,), (3, 7), (2, 3, 4)]
    live = {str(s): random_tensor(dtype, s, gen) for s in shapes}
    expected = clone_tree(live)
    flat, data = snapshot({"t": live})
    assert [e.dtype for e in flat.entries] == [str(dtype).removeprefix("torch.")] * len(shapes)
    target = {str(s): torch.zeros(s, dtype=dtype) for s in shapes}
    originals = dict(target)
    restore_into({"t": target}, flat.entries, flat.meta, data)
    assert_identical(target, expected)
    assert all(target[k] is originals[k] for k in target)


def test_many_tiny_tensors_are_aligned() -> None:
    gen = torch.Generator().manual_seed(2)
    live = {f"p{i}": torch.randn(i % 5 + 1, generator=gen) for i in range(3000)}
    flat, data = snapshot({"m": live})
    assert len(flat.entries) == 3000
    assert all(e.offset % ALIGN == 0 for e in flat.entries)
    ends = [e.offset + e.nbytes for e in flat.entries]
    assert all(end <= nxt.offset for end, nxt in zip(ends, flat.entries[1:], strict=False))
    assert flat.data_bytes == ends[-1]
    target = {k: torch.empty_like(v) for k, v in live.items()}
    restore_into({"m": target}, flat.entries, flat.meta, data)
    assert_identical(target, live)


def test_non_contiguous_tensors() -> None:
    base = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    live = {
        "t": base.t(),
        "step": base[::2, 1::3],
        "expanded": torch.tensor([1.0, 2.0]).expand(3, 2),
        "conj": torch.complex(base[0], base[1]).conj(),
        "param": nn.Parameter(torch.randn(4, 3)).t(),
    }
    flat, data = snapshot({"x": live})
    for e, t in zip(flat.entries, live.values(), strict=True):
        stored = data[e.offset : e.offset + e.nbytes].view(t.dtype).view(e.shape)
        assert torch.equal(stored, t.resolve_conj())
    # Restoring into non-contiguous live tensors writes through their strides.
    target = {
        k: torch.zeros_like(v.contiguous()).t().contiguous().t() for k, v in live.items() if k != "conj"
    }
    target["conj"] = torch.zeros(10, dtype=torch.complex64)
    restore_into({"x": target}, flat.entries, flat.meta, data)
    for k, v in live.items():
        assert torch.equal(target[k], v.detach().resolve_conj()), k


def test_plain_data_types_survive() -> None:
    nan = struct.unpack("<d", b"\x01\x00\x00\x00\x00\x00\xf8\x7f")[0]  # a NaN with a payload
    plain = {
        "floats": [0.1, -0.0, math.inf, -math.inf, nan, 1e-310],
        "ints": {0: -(2**63), 1: 2**64 - 1, -5: 0},
        "tuple": (1, (2.5, "a"), [3, (4,)]),
        "list": [1, [2, 3]],
        "size": torch.Size([2, 3]),
        "od": collections.OrderedDict([("b", 1), ("a", 2)]),
        "mixed_keys": {"1": "str", 1: "int", 1.5: "float", None: "none", b"k": "bytes"},
        "scalars": [None, True, False, "text", b"\x00bytes", ""],
        "numpy": {
            "f32": np.arange(6, dtype=np.float32).reshape(2, 3),
            "fortran": np.asfortranarray(np.arange(6, dtype=np.int16).reshape(2, 3)),
            "u32": np.array([1, 2**32 - 1], dtype=np.uint32),
            "empty": np.zeros((0, 4), dtype=np.float64),
            "zero_d": np.array(3.5),
            "bool": np.array([True, False]),
            "text": np.array(["ab", "c"]),
            "scalar_f64": np.float64(2.5),
            "scalar_i8": np.int8(-3),
            "scalar_bool": np.bool_(True),
        },
    }
    expected = clone_tree(plain)
    target: dict[str, Any] = {"data": {"stale": 1}}
    flat, data = snapshot({"data": plain})
    assert flat.entries == [] and flat.data_bytes == 0
    restore_into(target, flat.entries, flat.meta, data)
    assert_identical(target["data"], expected)
    assert "stale" not in target["data"]


def test_plain_values_restore_in_place() -> None:
    arr = np.zeros(3, dtype=np.float32)
    tensor = torch.zeros(2, 2)
    nested = {"a": [torch.zeros(3)], "arr": arr}
    live = {
        "tensor": torch.ones(2, 2) * 3,
        "nested": {"a": [torch.arange(3.0)], "arr": np.arange(3.0, dtype=np.float32)},
    }
    flat, data = snapshot({**live, "count": 5})
    inner_list = nested["a"]
    inner_tensor = nested["a"][0]
    state: dict[str, Any] = {"tensor": tensor, "nested": nested, "count": 0}
    restore_into(state, flat.entries, flat.meta, data)
    assert state["tensor"] is tensor and torch.equal(tensor, live["tensor"])
    assert state["nested"] is nested and nested["a"] is inner_list and nested["a"][0] is inner_tensor
    assert torch.equal(inner_tensor, torch.arange(3.0))
    assert nested["arr"] is arr and arr.tolist() == [0.0, 1.0, 2.0]
    assert state["count"] == 5


def test_paths_and_int_keys() -> None:
    model = nn.Sequential(nn.Linear(2, 3))
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    flat = flatten({"model": model, "optim": opt})
    paths = [e.path for e in flat.entries]
    assert paths[:2] == ["model/0.weight", "model/0.bias"]
    assert "optim/state/0/exp_avg" in paths and "optim/state/1/exp_avg_sq" in paths
    decoded = msgpack.unpackb(flat.meta, strict_map_key=False)  # plain msgpack, no custom hooks needed
    assert decoded[0] == FORMAT_VERSION and set(decoded[1]) == {"model", "optim"}


UNSUPPORTED = [
    ({"a": [1, lambda: 0]}, "state['x']['a'][1]: cannot snapshot a value of type function"),
    ({"dtype": torch.float32}, "state['x']['dtype']: cannot snapshot a value of type dtype"),
    ({"obj": object()}, "state['x']['obj']: cannot snapshot a value of type object"),
    ({"s": {1, 2}}, "state['x']['s']: cannot snapshot a value of type set"),
    ({"big": 2**64}, "state['x']['big']: cannot snapshot an int outside 64 bits"),
    ({"neg": [-(2**63) - 1]}, "state['x']['neg'][0]: cannot snapshot an int outside 64 bits"),
    ({"tup": (1, 2, 2**64)}, "state['x']['tup'][2]: cannot snapshot an int outside 64 bits"),
    ({"ba": bytearray(b"x")}, "state['x']['ba']: cannot snapshot a value of type bytearray"),
    ({"t": (1, datetime.date(2024, 1, 1))}, "state['x']['t'][1]: cannot snapshot a value of type date"),
    (
        {"sp": torch.eye(2).to_sparse()},
        "state['x']['sp']: cannot snapshot a tensor with layout torch.sparse_coo",
    ),
    (
        {"c": torch.zeros(2, dtype=torch.float8_e8m0fnu)},
        "state['x']['c']: cannot snapshot a tensor of dtype torch.float8_e8m0fnu",
    ),
    (
        {"meta": torch.empty(2, device="meta")},
        "state['x']['meta']: cannot snapshot a tensor on the meta device",
    ),
    ({"np": np.array([object()])}, "state['x']['np']: cannot snapshot a value of type ndarray"),
    ({"dd": collections.defaultdict(int)}, "state['x']['dd']: cannot snapshot a value of type defaultdict"),
    ({(1, 2): 0}, "state['x']: cannot snapshot a dict key (1, 2) of type tuple"),
    ({1 << 70: 0}, "state['x']: cannot snapshot a dict key"),
]


@pytest.mark.parametrize(("value", "message"), UNSUPPORTED)
def test_unsupported_values_name_their_path(value: dict[Any, Any], message: str) -> None:
    with pytest.raises(TypeError) as info:
        flatten({"x": value})
    assert str(info.value).startswith(message)


def test_cycles_and_non_str_top_keys_are_type_errors() -> None:
    loop: list[Any] = []
    loop.append(loop)
    with pytest.raises(TypeError, match="deeper than"):
        flatten({"loop": loop})
    with pytest.raises(TypeError, match="state keys must be str"):
        flatten({1: torch.zeros(1)})  # type: ignore[dict-item]


def test_layout_equality() -> None:
    state = {"a": torch.zeros(3, 4), "b": {"c": torch.zeros(2, dtype=torch.int64)}}
    first, second = flatten(state), flatten(state)
    assert first.layout == second.layout and hash(first.layout) == hash(second.layout)
    assert first.entries == second.entries and first.entries is not second.entries
    state["a"].add_(1)  # values do not matter
    assert flatten(state).layout == first.layout
    state["a"] = torch.zeros(4, 3)
    assert flatten(state).layout != first.layout
    state["a"] = torch.zeros(3, 4, dtype=torch.float64)
    assert flatten(state).layout != first.layout
    assert flatten({"a2": torch.zeros(3, 4), "b": state["b"]}).layout != first.layout


def test_copy_into_reused_and_alternating_buffers() -> None:
    state = {"a": torch.arange(10.0), "b": torch.arange(4, dtype=torch.int64)}
    slots = [torch.zeros(256, dtype=torch.uint8), torch.zeros(256, dtype=torch.uint8)]
    for step in range(6):
        if step == 3:
            state["a"] = torch.arange(20.0)  # layout change while the slots are reused
        state["a"].add_(1)
        flat = flatten(state)
        copy_into(flat, slots[step % 2])
        target = {k: torch.zeros_like(v) for k, v in state.items()}
        restore_into(target, flat.entries, flat.meta, slots[step % 2])
        assert_identical(target, state)


def test_copy_into_only_some_tensors() -> None:
    state = {"a": torch.full((4,), 1.0), "b": torch.full((4,), 2.0), "c": torch.full((4,), 3.0)}
    flat = flatten(state)
    dst = torch.zeros(flat.data_bytes, dtype=torch.uint8)
    copy_into(flat, dst, only=[2, 0])
    stored = [dst[e.offset : e.offset + e.nbytes].view(torch.float32).tolist() for e in flat.entries]
    assert stored == [[1.0] * 4, [0.0] * 4, [3.0] * 4]
    copy_into(flat, dst, only=[1], non_blocking=True)  # a no-op hint for CPU sources
    assert dst[flat.entries[1].offset : flat.entries[1].offset + 16].view(torch.float32).tolist() == [2.0] * 4


def test_copy_into_rejects_bad_destinations() -> None:
    flat = flatten({"a": torch.zeros(8)})
    with pytest.raises(ValueError, match="uint8"):
        copy_into(flat, torch.zeros(32, dtype=torch.float32))
    with pytest.raises(ValueError, match="holds 16 bytes"):
        copy_into(flat, torch.zeros(16, dtype=torch.uint8))
    with pytest.raises(ValueError, match="multiple of 16"):
        copy_into(flat, torch.zeros(64, dtype=torch.uint8)[1:])


def test_restore_errors_name_what_is_wrong() -> None:
    flat, data = snapshot({"a": torch.zeros(2, 3), "b": {"c": 1}})
    with pytest.raises(ValueError, match=r"missing \['z'\], extra keys \['b'\]"):
        restore_into({"a": torch.zeros(2, 3), "z": 1}, flat.entries, flat.meta, data)
    with pytest.raises(ValueError, match=r"state\['a'\]: snapshot holds float32 \[2, 3\]"):
        restore_into({"a": torch.zeros(3, 2), "b": {}}, flat.entries, flat.meta, data)
    with pytest.raises(ValueError, match=r"state\['a'\]: snapshot holds float32"):
        restore_into({"a": torch.zeros(2, 3, dtype=torch.float64), "b": {}}, flat.entries, flat.meta, data)
    with pytest.raises(ValueError, match="Stateful"):
        restore_into({"a": torch.zeros(2, 3), "b": nn.Linear(1, 1)}, flat.entries, flat.meta, data)
    with pytest.raises(ValueError, match="outside the data"):
        restore_into({"a": torch.zeros(2, 3), "b": {}}, flat.entries, flat.meta, data[:8])
    other = flatten({"b": {"c": torch.zeros(2, 3)}, "a": 1})  # same keys and tensor count, other paths
    with pytest.raises(ValueError, match=r"state\['b'\]\['c'\]: the table names 'a' here"):
        restore_into({"b": {}, "a": 1}, flat.entries, other.meta, data)


@pytest.mark.parametrize(
    "meta",
    [
        b"",
        b"\xc1",
        msgpack.packb([2, {}]),
        msgpack.packb({"a": 1}),
        msgpack.packb([1, {"a": [5, None]}]),
        msgpack.packb([1, {"a": [1, msgpack.ExtType(1, (99).to_bytes(4, "big"))]}]),
        msgpack.packb([1, {"a": [1, msgpack.ExtType(42, b"")]}]),
        msgpack.packb([1, {"a": [1, msgpack.ExtType(6, msgpack.packb(["|O", [1], b"x" * 8]))]}]),
        msgpack.packb([1, {"a": [1, msgpack.ExtType(6, msgpack.packb(["<f4", [3], b"x" * 8]))]}]),
        msgpack.packb([1, {"a": [1, msgpack.ExtType(7, msgpack.packb(["not a dtype", b""]))]}]),
    ],
)
def test_malformed_meta_is_a_value_error(meta: bytes) -> None:
    with pytest.raises(ValueError):
        restore_into({"a": {}}, [], meta, torch.zeros(0, dtype=torch.uint8))


def test_deeply_nested_meta_is_a_value_error() -> None:
    deep: Any = 0
    for _ in range(500):
        deep = msgpack.ExtType(3, msgpack.packb([deep]))
    with pytest.raises(ValueError):
        restore_into({"a": {}}, [], msgpack.packb([1, {"a": [1, deep]}]), torch.zeros(0, dtype=torch.uint8))
    nested: Any = 0
    for _ in range(200):
        nested = [nested]
    with pytest.raises(ValueError, match="deeper"):
        restore_into({"a": {}}, [], msgpack.packb([1, {"a": [1, nested]}]), torch.zeros(0, dtype=torch.uint8))


_VALID = flatten(
    {
        "a": torch.arange(4.0),
        "b": {"c": (1, 2.0, "x"), "d": np.arange(3), 5: [torch.zeros(2, dtype=torch.int64)]},
    }
)


@settings(
    max_examples=300,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(st.data())
def test_mutated_meta_never_escapes_value_error(data: st.DataObject) -> None:
    meta = bytearray(_VALID.meta)
    for _ in range(data.draw(st.integers(1, 4))):
        meta[data.draw(st.integers(0, len(meta) - 1))] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        meta = meta[: data.draw(st.integers(0, len(meta)))]
    buf = torch.zeros(_VALID.data_bytes, dtype=torch.uint8)
    state = {"a": torch.zeros(4), "b": {}}
    with contextlib.suppress(ValueError):  # anything else fails the test
        restore_into(state, _VALID.entries, bytes(meta), buf)


def test_restore_accepts_memoryview_meta() -> None:
    flat, data = snapshot({"a": torch.arange(3.0)})
    target = {"a": torch.zeros(3)}
    restore_into(target, flat.entries, memoryview(flat.meta), data)
    assert torch.equal(target["a"], torch.arange(3.0))


def _refs(tree: Any) -> list[TensorRef]:
    """The tensor placeholders of decoded meta, in walk order."""
    if isinstance(tree, TensorRef):
        return [tree]
    if isinstance(tree, dict):
        return [r for v in tree.values() for r in _refs(v)]
    if isinstance(tree, list | tuple):
        return [r for v in tree for r in _refs(v)]
    return []


def test_meta_of_an_unknown_format_is_refused() -> None:
    flat, data = snapshot({"a": torch.arange(3.0)})
    assert msgpack.unpackb(flat.meta)[0] == 2
    newer = msgpack.packb([3, msgpack.unpackb(flat.meta)[1]])
    with pytest.raises(ValueError, match=r"format 3: this build reads formats \[1, 2\]"):
        restore_into({"a": torch.zeros(3)}, flat.entries, newer, data)
    # no DTensor: the same bytes
    older = msgpack.packb([1, msgpack.unpackb(flat.meta, strict_map_key=False)[1]])
    target = {"a": torch.zeros(3)}
    restore_into(target, flat.entries, older, data)
    assert torch.equal(target["a"], torch.arange(3.0))


@pytest.fixture
def gloo_world(tmp_path: Any) -> Any:
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this build")
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    store = dist.FileStore(os.fspath(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=30))
    try:
        yield dist
    finally:
        dist.destroy_process_group()


def test_dtensor_fsdp2_round_trip(gloo_world: Any) -> None:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
        fully_shard(model)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    x = torch.randn(16, 8)

    def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> list[float]:
        losses = []
        for _ in range(steps):
            opt.zero_grad()
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    model, opt = build(0)
    train(model, opt, 3)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    state = {"model": model, "optim": opt}
    flat, data = snapshot(state)
    refs = _refs(decode_meta(flat.meta, len(flat.entries))[1])
    shards = [r for r in refs if r.dtensor]
    # 4 parameter shards + 8 moment shards, marked as DTensor with their global layout
    assert len(shards) == 12
    shapes = [tuple(p.shape) for p in model.parameters()]
    assert [r.place for r in shards] == [
        (s, (0,) * len(s)) for s in shapes + [s for s in shapes for _ in (0, 1)]
    ]
    reference = train(model, opt, 3)

    locals_before = [(id(p), p.to_local().data_ptr()) for p in model.parameters()]
    restore_into(state, flat.entries, flat.meta, data)
    assert [(id(p), p.to_local().data_ptr()) for p in model.parameters()] == locals_before
    assert train(model, opt, 3) == reference

    # Another model whose optimizer has stepped once has DTensor moments to restore into.
    other, other_opt = build(1)
    train(other, other_opt, 1)
    restore_into({"model": other, "optim": other_opt}, flat.entries, flat.meta, data)
    assert train(other, other_opt, 3) == reference

    # A never-stepped optimizer has no moments yet: they are rebuilt as DTensors laid out like their parameters.
    fresh, fresh_opt = build(2)
    assert not fresh_opt.state
    restore_into({"model": fresh, "optim": fresh_opt}, flat.entries, flat.meta, data)
    moments = [t for s in fresh_opt.state.values() for t in s.values() if isinstance(t, DTensor)]
    assert len(moments) == 8 and all(
        m.placements == p.placements
        for m, p in zip(moments, [p for p in fresh.parameters() for _ in range(2)], strict=True)
    )
    assert train(fresh, fresh_opt, 3) == reference

    # A snapshot of format 1 (DTensor placeholders without their global layout) still restores.
    def strip(code: int, data: bytes) -> msgpack.ExtType:
        if code in (3, 5):  # a tuple's or an OrderedDict's items
            data = msgpack.packb(msgpack.unpackb(data, ext_hook=strip, strict_map_key=False))
        return msgpack.ExtType(code, data[:4] if code == 2 else data)

    v1 = msgpack.packb([1, msgpack.unpackb(flat.meta, ext_hook=strip, strict_map_key=False)[1]])
    assert _refs(decode_meta(v1, len(flat.entries))[1])[0].place is None
    fresh, fresh_opt = build(3)
    restore_into({"model": fresh, "optim": fresh_opt}, flat.entries, v1, data)
    assert train(fresh, fresh_opt, 3) == reference
    with pytest.raises(ValueError, match="a DTensor placeholder of another format than 2"):
        decode_meta(
            msgpack.packb([2, msgpack.unpackb(v1, ext_hook=strip, strict_map_key=False)[1]]),
            len(flat.entries),
        )

    # A DTensor shard anywhere else needs a live DTensor to go into: a clear error, not a plain tensor.
    shard = {"w": next(model.parameters())}
    taken, taken_data = snapshot(shard)
    with pytest.raises(ValueError, match=r"state\['w'\]: the snapshot holds a DTensor shard"):
        restore_into({"w": torch.zeros(4)}, taken.entries, taken.meta, taken_data)
