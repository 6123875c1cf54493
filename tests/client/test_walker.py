"""StateWalker: capture after capture, the same FlatState as a full walk, byte for byte, whatever changes."""

from __future__ import annotations

import collections
import gc
import random
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from snapshotd.client.copies import copy_into
from snapshotd.client.rng import RNGState
from snapshotd.client.staging import Stager
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


def test_moments_that_require_grad_are_detached_at_every_capture() -> None:
    """An optimizer-shaped state whose moments require grad (a differentiable optimizer's) is aliased without
    autograd capture after capture, also while the walker takes them as the very objects of last time; a moment
    replaced is read anew."""
    m = torch.zeros(2, requires_grad=True)
    sd = {"state": {0: {"m": m, "v": torch.ones(2)}}, "param_groups": [{"lr": 0.1, "params": [0]}]}
    state = {"x": _Stateful(sd)}
    walker = StateWalker()
    for _ in range(3):
        flat = walker.flatten(state)
        assert_same(flat, flatten(state))
        assert flat.tensors[0] is not m and not flat.tensors[0].requires_grad
        assert flat.tensors[1] is sd["state"][0]["v"]
    sd["state"][0]["m"] = plain = torch.zeros(2)  # a new object that does not: taken as it is
    for _ in range(2):
        flat = walker.flatten(state)
        assert_same(flat, flatten(state))
        assert flat.tensors[0] is plain
    sd["state"][0]["v"] = torch.ones(2, requires_grad=True)
    for _ in range(2):
        flat = walker.flatten(state)
        assert_same(flat, flatten(state))
        assert not any(t.requires_grad for t in flat.tensors)


def test_an_optimizer_shaped_state_is_read_in_full_at_every_capture() -> None:
    """Moments of a Stateful that is no torch optimizer are read for dtype, shape and requires_grad every time:
    one that an in-place op makes require grad is detached, one whose ``.data`` changes dtype and shape is
    packed as it is now."""
    m = torch.zeros(2)
    sd = {"state": {0: {"m": m}}, "param_groups": [{"lr": 0.1, "params": [0]}]}
    state = {"x": _Stateful(sd)}
    walker = StateWalker()
    for _ in range(2):
        assert walker.flatten(state).tensors[0] is m
    m.add_(torch.ones(2, requires_grad=True))  # now requires grad, the same object
    flat = walker.flatten(state)
    assert_same(flat, flatten(state))
    assert flat.tensors[0] is not m and not flat.tensors[0].requires_grad
    m.data = torch.zeros(5, dtype=torch.float64)
    assert_same(walker.flatten(state), flatten(state))


def _stepped_adamw() -> tuple[dict[str, Any], torch.optim.Optimizer, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 4)).square().mean().backward()
    opt.step()
    return {"model": model, "optim": opt}, opt, model.weight


def test_a_torch_optimizers_moments_are_taken_as_read_and_checked_in_full_every_so_often(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A torch optimizer's very moments of the last capture are taken as read then (see StateWalker); code that
    changes one in place outside the optimizer is seen at the next full check."""
    monkeypatch.setattr("snapshotd.client.walker.FULL_CHECK_EVERY", 4)
    state, opt, weight = _stepped_adamw()
    walker = StateWalker()
    flats = [walker.flatten(state) for _ in range(2)]
    moment = opt.state[weight]["exp_avg"]
    assert any(t is moment for t in flats[-1].tensors)
    moment.add_(torch.ones_like(moment, requires_grad=True))  # outside the optimizer, with grad enabled
    taken = walker.flatten(state)  # capture 3 of 4: trusted
    assert any(t is moment for t in taken.tensors)
    checked = walker.flatten(state)  # capture 4: the full check
    assert_same(checked, flatten(state))
    assert not any(t.requires_grad for t in checked.tensors)


class _OwnStep(torch.optim.AdamW):
    """A step of its own: it may update its state with grad enabled."""

    def step(self, closure: Any = None) -> Any:
        return super().step(closure)


@pytest.mark.parametrize("how", ["defaults", "group", "own step"])
def test_moments_are_read_every_capture_unless_torch_steps_them_under_no_grad(how: str) -> None:
    """A differentiable optimizer (torch reads the flag from ``defaults``; a group may carry it too) and one whose
    step is not torch's own may update their moments with grad enabled: those are read every capture."""
    state, opt, weight = _stepped_adamw()
    if how == "defaults":
        opt.defaults["differentiable"] = True
    elif how == "group":
        opt.param_groups[0]["differentiable"] = True
    else:
        opt.__class__ = _OwnStep
    walker = StateWalker()
    for _ in range(2):
        walker.flatten(state)
    opt.state[weight]["exp_avg"].add_(torch.ones(2, 4, requires_grad=True))
    flat = walker.flatten(state)
    assert_same(flat, flatten(state))
    assert not any(t.requires_grad for t in flat.tensors)


def test_memos_of_keys_gone_from_the_state_are_let_go_of() -> None:
    state, model, opt = training_state()
    walker = StateWalker()
    walker.flatten(state)
    ref = weakref.ref(model)
    del state["model"], model
    walker.flatten(state)
    gc.collect()
    assert "model" not in walker._memos and "rng" in walker._rng
    del state["rng"]
    walker.flatten(state)
    assert "rng" not in walker._rng
    assert_same(walker.flatten(state), flatten(state))
    assert ref() is None


def test_a_tensor_that_starts_requiring_grad_in_place_is_detached() -> None:
    """A Stateful's own tensors are read for requires_grad at every capture: set in place, it is detached."""
    w = torch.zeros(3)
    state = {"x": _Stateful({"w": w})}
    walker = StateWalker()
    for _ in range(2):
        assert walker.flatten(state).tensors[0] is w
    w.requires_grad_(True)
    flat = walker.flatten(state)
    assert_same(flat, flatten(state))
    assert flat.tensors[0] is not w and not flat.tensors[0].requires_grad


def test_errors_are_the_full_walks() -> None:
    state = {"x": _Stateful({"a": torch.zeros(2)})}
    walker = StateWalker()
    walker.flatten(state)
    state["x"].sd = {"a": torch.zeros(2), "b": object()}
    with pytest.raises(TypeError, match=r"state\['x'\]\['b'\]: cannot snapshot a value of type object"):
        walker.flatten(state)


def _read_alike_after_each(
    walker: StateWalker, state: dict[str, Any], owner: type[Any], changes: list[Callable[[], Any]]
) -> None:
    """After each of ``changes``, ``walker`` flattens ``state`` as a full walk does, twice; the second time without
    calling ``owner.state_dict`` but after the last change (a hook)."""
    calls = 0
    real = owner.state_dict

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        return real(self, *args, **kwargs)

    for n, change in enumerate(changes):
        change()
        assert_same(walker.flatten(state), flatten(state))
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(owner, "state_dict", counted)
            before = calls
            again = walker.flatten(state)
            read_without_state_dict = calls == before
        assert_same(again, flatten(state))
        assert read_without_state_dict == (n < len(changes) - 1)


def test_a_module_tree_read_without_state_dict_is_the_full_walk_whatever_changes() -> None:
    state, model, opt = training_state()
    walker = StateWalker()
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
    _read_alike_after_each(walker, state, nn.Module, changes)
    assert walker._memos["model"].tree is None


def test_an_optimizer_read_without_state_dict_is_the_full_walk_whatever_changes() -> None:
    state, model, opt = training_state(momentum=True)
    walker = StateWalker()
    step(model, opt, state["sched"])
    assert_same(walker.flatten(state), flatten(state))  # remembers the optimizer
    extra = nn.Parameter(torch.ones(3))
    changes = [
        lambda: None,
        lambda: opt.param_groups[0].__setitem__("lr", 0.5),  # a group's value
        lambda: opt.param_groups[0].__setitem__("betas_like", (0.9, 0.99)),  # a key added to a group
        lambda: opt.add_param_group({"params": [extra], "lr": 0.01}),  # a group added
        lambda: opt.param_groups[1]["params"].insert(
            0, opt.param_groups[0]["params"].pop()
        ),  # moved between them
        lambda: opt.state[extra].__setitem__("momentum_buffer", torch.zeros(3)),  # a parameter's state added
        lambda: opt.state.pop(model[0].bias),  # one taken away
        lambda: opt.param_groups[0]["params"].reverse(),  # the parameters' order (their indices)
        lambda: opt.state.update(reversed(list(opt.state.items()))),  # the state's order
        lambda: setattr(opt, "state", collections.defaultdict(dict, opt.state)),  # the state replaced alike
        lambda: opt.param_groups[0].__setitem__("betas_like", (0.8, 0.99)),  # a tuple replaced
        lambda: opt.param_groups[0].__setitem__("milestones", [1, 2]),  # a list
        lambda: opt.param_groups[0]["milestones"].append(3),  # changed in place: the same object
        lambda: opt.param_groups[0].__setitem__("lr", torch.tensor(0.1)),  # a tensor (in the table)
        lambda: opt.param_groups[0]["lr"].fill_(0.2),  # changed in place
        lambda: opt.param_groups[1].__setitem__(7, "an int key"),  # a group the full walk packs
        lambda: opt.param_groups[1].pop(7),
        lambda: opt.register_state_dict_post_hook(lambda o, sd: None),  # a hook
    ]
    _read_alike_after_each(walker, state, torch.optim.Optimizer, changes)
    assert walker._memos["optim"].optimizer is None


def test_generators_that_did_not_move_are_packed_as_before_and_every_move_is_the_full_walk() -> None:
    state = {"rng": RNGState(), "after": torch.ones(2)}
    walker = StateWalker()
    assert_same(walker.flatten(state), flatten(state))
    changes: list[tuple[Callable[[], Any], set[str]]] = [
        (lambda: None, set()),
        (lambda: random.random(), {"python"}),
        (lambda: random.gauss(0.0, 1.0), {"python"}),
        (lambda: np.random.standard_normal(), {"numpy"}),
        (lambda: np.random.standard_normal(), {"numpy"}),  # the cached Gaussian taken: the key stays
        (lambda: np.random.seed(11), {"numpy"}),
        (lambda: torch.rand(1), set()),  # a tensor: in the table, walked every time
    ]
    for change, moved in changes:
        before = {name: blob for name, (_, blob) in walker._rng["rng"]._last.items()}
        assert set(before) == {"python", "numpy"}
        change()
        assert_same(walker.flatten(state), flatten(state))
        reused = {name for name, (_, blob) in walker._rng["rng"]._last.items() if blob is before[name]}
        assert reused == {"python", "numpy"} - moved


def test_generator_states_are_owned_and_copied_in_the_background_and_a_buffer_in_capture() -> None:
    state, model, opt = training_state()
    step(model, opt, state["sched"])
    walker = StateWalker()
    for _ in range(2):  # walked, then reused
        flat = walker.flatten(state)
        rng = [i for i, t in enumerate(flat.tensors) if t.dtype == torch.uint8]
        # the torch generator's state (and CUDA's, where there is one)
        assert rng and flat.owned == tuple(rng)
        assert flatten(state).owned == ()  # the full walk claims nothing
        stager = Stager(state, stats=None)
        groups = stager._plan(flat)
        stager.remove_hooks()
        # batch norm's statistics and a plain tensor: they may change at any time
        mutable = [*model.buffers(), state["extra"]["w"]]
        ptrs = {t.data_ptr() for t in mutable}
        assert set(rng) <= set(groups.cpu_async)
        assert sorted(groups.sync) == [i for i, t in enumerate(flat.tensors) if t.data_ptr() in ptrs]
        assert len(groups.sync) == len(mutable)


def test_an_index_list_from_an_optimizers_own_state_dict_is_packed_anew_every_time() -> None:
    class Cached(torch.optim.SGD):
        """Hands out the same "params" list from every state_dict(): no optimizer tree, the list not the tree's."""

        indices: list[int] | None = None

        def state_dict(self) -> dict[str, Any]:
            sd = super().state_dict()
            if self.indices is None:
                self.indices = sd["param_groups"][0]["params"]
            sd["param_groups"][0]["params"] = self.indices
            return sd

    model = nn.Linear(3, 2)
    opt = Cached(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    state = {"optim": opt}
    walker = StateWalker()
    for n in range(3):
        assert_same(walker.flatten(state), flatten(state))
        assert opt.indices is not None
        opt.indices.append(n + 7)  # changed in place: the same object


def test_a_parameter_whose_data_is_replaced_after_capture_is_copied_as_it_was() -> None:
    state, model, opt = training_state()
    walker = StateWalker()
    walker.flatten(state)
    weight = model[0].weight
    for walk in (walker.flatten, flatten):  # read from the module tree, and from state_dict()
        flat = walk(state)
        before = weight.detach().clone()
        weight.data = torch.full_like(
            before, 7.0
        )  # after capture(), before the background copy (an EMA swap)
        dst = torch.zeros(flat.data_bytes, dtype=torch.uint8)
        copy_into(flat, dst)
        assert not dst.requires_grad and dst.grad_fn is None
        entry = next(e for e in flat.entries if e.path == "model/0.weight")
        assert torch.equal(
            dst[entry.offset : entry.offset + entry.nbytes].view(torch.float32).view(entry.shape), before
        )


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
