"""StateWalker: capture after capture, the same FlatState as a full walk, byte for byte, whatever changes."""

from __future__ import annotations

import collections
import gc
import weakref
from typing import Any

import pytest
import torch
from torch import nn

from snapshotd.client.rng import RNGState
from snapshotd.client.state import FlatState, flatten
from snapshotd.client.walker import StateWalker


def assert_same(a: FlatState, b: FlatState) -> None:
    assert a.meta == b.meta
    assert a.layout == b.layout and a.entries == b.entries and a.data_bytes == b.data_bytes
    assert len(a.tensors) == len(b.tensors)
    for x, y in zip(a.tensors, b.tensors, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape and x.device == y.device
        assert torch.equal(x, y)


def training_state(momentum: bool = False) -> tuple[dict[str, Any], nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    opt: torch.optim.Optimizer = (
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        if momentum
        else torch.optim.AdamW(model.parameters())
    )
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    state = {
        "model": model,
        "optim": opt,
        "sched": sched,
        "rng": RNGState(),
        "extra": {"epoch": 1, "w": torch.ones(3)},
    }
    return state, model, opt


def step(model: nn.Module, opt: torch.optim.Optimizer, sched: Any) -> None:
    loss = model(torch.randn(5, 8)).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()


@pytest.mark.parametrize("momentum", [False, True])
def test_every_capture_of_a_training_loop_is_the_full_walk_byte_for_byte(momentum: bool) -> None:
    state, model, opt = training_state(momentum)
    walker = StateWalker()
    memos: dict[str, Any] = {}
    for n in range(6):
        assert_same(walker.flatten(state), flatten(state))
        # from the second step on every parameter has its optimizer state: both are reused, not walked
        if n >= 2:
            assert {k: id(m) for k, m in walker._memos.items()} == memos
        memos = {k: id(m) for k, m in walker._memos.items()}
        step(model, opt, state["sched"])
        state["extra"]["epoch"] = n
    assert set(memos) == {"model", "optim"}


def test_a_layout_that_changes_is_walked_again() -> None:
    state, model, opt = training_state()
    walker = StateWalker()
    step(model, opt, state["sched"])
    first = walker.flatten(state)
    model[0].weight.data = torch.zeros(16, 9)  # a shape changed in place of a parameter
    assert_same(walker.flatten(state), flatten(state))
    model[0].weight.data = torch.zeros(16, 8, dtype=torch.float64)  # a dtype
    assert_same(walker.flatten(state), flatten(state))
    model[0].weight.data = torch.zeros(16, 8)
    model.add_module("head", nn.Linear(4, 2))  # keys
    changed = walker.flatten(state)
    assert_same(changed, flatten(state))
    assert changed.layout != first.layout
    opt.state.clear()  # an optimizer that lost its moments, then gets them again
    assert_same(walker.flatten(state), flatten(state))
    step(model, opt, state["sched"])
    assert_same(walker.flatten(state), flatten(state))


def test_values_ahead_of_a_memo_that_change_their_tensor_count_move_its_indices() -> None:
    model = nn.Linear(3, 2)
    state: dict[str, Any] = {"first": {"t": [torch.zeros(1)]}, "model": model}
    walker = StateWalker()
    assert_same(walker.flatten(state), flatten(state))
    state["first"]["t"].append(torch.zeros(2))  # one more tensor before the model's
    assert_same(walker.flatten(state), flatten(state))


class _Stateful:
    def __init__(self, sd: Any) -> None:
        self.sd = sd

    def state_dict(self) -> Any:
        return self.sd

    def load_state_dict(self, sd: Any) -> None:
        self.sd = sd


@pytest.mark.parametrize(
    "sd",
    [
        {
            "a": torch.zeros(2),
            "b": torch.zeros(3, requires_grad=True),
        },  # detached by the walk: never remembered
        collections.OrderedDict(a=torch.zeros(2), b=torch.ones(1)),
        {"state": {0: {"m": torch.zeros(2), "step": 3}}, "param_groups": [{"lr": 0.1, "params": [0]}]},
        {"state": {0: [torch.zeros(2)]}, "param_groups": []},
        {"state": {}, "param_groups": [{"lr": torch.tensor(0.5), "params": []}]},
    ],
)
def test_state_dicts_of_other_shapes_are_walked_alike(sd: Any) -> None:
    state = {"x": _Stateful(sd)}
    walker = StateWalker()
    for _ in range(3):
        assert_same(walker.flatten(state), flatten(state))


def test_errors_are_the_full_walks() -> None:
    state = {"x": _Stateful({"a": torch.zeros(2)})}
    walker = StateWalker()
    walker.flatten(state)
    state["x"].sd = {"a": torch.zeros(2), "b": object()}
    with pytest.raises(TypeError, match=r"state\['x'\]\['b'\]: cannot snapshot a value of type object"):
        walker.flatten(state)


def test_a_module_tree_read_without_state_dict_is_the_full_walk_whatever_changes() -> None:
    state, model, opt = training_state()
    walker = StateWalker()
    calls = 0
    real = nn.Module.state_dict

    def counted(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        return real(self, *args, **kwargs)

    step(model, opt, state["sched"])
    assert_same(walker.flatten(state), flatten(state))  # remembers the tree
    changes = [
        lambda: None,
        lambda: setattr(model[0], "weight", nn.Parameter(torch.ones(16, 8))),  # a parameter replaced
        lambda: setattr(model[0].weight, "data", torch.zeros(16, 8)),  # its data
        lambda: setattr(model[1].running_mean, "data", model[1].running_mean.view(torch.int32)),  # a dtype
        lambda: model[1].running_var.resize_(8),  # same storage, a shape
        lambda: setattr(model[3], "bias", None),  # a parameter gone (None)
        lambda: model[1].register_buffer("extra", torch.ones(2)),  # a buffer added
        lambda: model[1].register_buffer("scratch", torch.ones(2), persistent=False),  # not in the state dict
        lambda: model[1]._non_persistent_buffers_set.discard("scratch"),  # now it is
        lambda: setattr(model, "2", nn.Tanh()),  # a submodule swapped
        lambda: model._modules.__setitem__("head", model._modules.pop("3")),  # a submodule renamed
        lambda: model[0].register_state_dict_post_hook(lambda m, sd, prefix, meta: None),  # a hook
    ]
    for n, change in enumerate(changes):
        change()
        assert_same(walker.flatten(state), flatten(state))
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(nn.Module, "state_dict", counted)
            before = calls
            again = walker.flatten(state)
            read_from_tree = calls == before
        assert_same(again, flatten(state))
        # after any change but a hook, the tree is read anew and then read without a state_dict() call
        assert read_from_tree == (n < len(changes) - 1)
    assert walker._memos["model"].tree is None


def _flattens_alike(walker: StateWalker, state: dict[str, Any]) -> None:
    assert_same(walker.flatten(state), flatten(state))
    assert_same(walker.flatten(state), flatten(state))


def test_a_module_tree_notices_a_submodule_moved_an_override_set_on_an_instance_and_a_module_replaced() -> (
    None
):
    root = nn.Module()
    root.a = nn.Module()
    root.a.b = nn.Linear(2, 2)
    state: dict[str, Any] = {"model": root}
    walker = StateWalker()
    _flattens_alike(walker, state)
    assert walker._memos["model"].tree is not None
    moved = root.a.b
    del root.a.b
    root.b = moved  # same modules in the same visiting order, under another parent
    _flattens_alike(walker, state)

    real = nn.Linear._save_to_state_dict

    def zeroed(destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        real(moved, destination, prefix, keep_vars)
        destination[prefix + "weight"] = torch.zeros(2, 2)

    moved._save_to_state_dict = zeroed  # type: ignore[method-assign]
    _flattens_alike(walker, state)
    assert walker._memos["model"].tree is None  # an override: state_dict() from now on

    state["model"] = nn.Linear(2, 2)  # the same keys, shapes and dtypes: reused, the old tree let go
    walker = StateWalker()
    _flattens_alike(walker, state)
    old = weakref.ref(state["model"])
    state["model"] = nn.Linear(2, 2)
    _flattens_alike(walker, state)
    gc.collect()
    assert old() is None and walker._memos["model"].tree is not None


@pytest.mark.parametrize(
    "value", [torch.zeros(4).to_sparse(), torch.zeros(4, device="meta")], ids=["sparse", "meta"]
)
def test_a_tensor_snapshots_cannot_carry_is_refused_as_by_the_full_walk(value: torch.Tensor) -> None:
    model = nn.Linear(4, 2)
    walker = StateWalker()
    walker.flatten({"model": model})
    model.bias = nn.Parameter(value, requires_grad=False)  # the same dtype and shape
    with pytest.raises(TypeError) as full:
        flatten({"model": model})
    with pytest.raises(TypeError) as walked:
        walker.flatten({"model": model})
    assert str(walked.value) == str(full.value)
