"""Field specs: the whole-column fast path, and the sending side's check, give exactly the answers (and errors) of
the per-value path.

The oracle below is the per-value validation as it stood before the fast path: every list item and record
field checked on its own, naming its path. Every spec, on valid rows, rows with one field broken and arbitrary
values, must accept the same values, build equal records and raise the same error type with the same message.
"""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from snapshotd.proto import limits as L
from snapshotd.proto.compound import ListOf, Record
from snapshotd.proto.errors import LimitExceeded, MalformedMessage, ProtocolError
from snapshotd.proto.records import Assignment, InventoryItem, RankInfo, ReplicateTask, Watermark
from snapshotd.proto.schema import Bool, Bytes, Enum, Float, Int, Opt, Spec, Str, spec_field

PROPS = settings(
    max_examples=300,
    deadline=timedelta(milliseconds=500),
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@dataclasses.dataclass(frozen=True)
class _Plain:
    """Not slotted: built through its constructor, not its slots."""

    name: str = spec_field(Str(8))
    ratio: float = spec_field(Float(0.0, 1.0))
    blob: bytes = spec_field(Bytes(4))
    mode: str = spec_field(Enum(("a", "b")))
    maybe: int | None = spec_field(Opt(Int(0, 9)))


SPECS: dict[str, Spec] = {
    "inventory": ListOf(Record(InventoryItem), 64),
    "ranks": ListOf(Record(RankInfo), 64),
    "assignments": ListOf(Record(Assignment), 64),  # a list inside each record
    "tasks": ListOf(Record(ReplicateTask), 4),
    "watermarks": ListOf(Record(Watermark), 8),
    "plain": ListOf(Record(_Plain), 8),
    "floats": ListOf(Float(-1.0, 1.0), 16),
    "enums": ListOf(Enum(("raw", "lz4")), 16),
    "optional": ListOf(Opt(Int(0, 100)), 16),
    "nested": ListOf(ListOf(Int(0, 100), 3), 16),
    "bytes": ListOf(Bytes(3), 16),
}


def oracle(spec: Spec, value: Any, name: str) -> Any:
    """The per-value validation: each item and field on its own, in order, naming its path."""
    if isinstance(spec, ListOf):
        if type(value) is not list:
            raise MalformedMessage(f"field {name!r}: expected a list, got {type(value).__name__}")
        if len(value) > spec.max_items:
            raise LimitExceeded(f"field {name!r}: {len(value)} items, at most {spec.max_items}")
        return tuple(oracle(spec.item, v, f"{name}[{i}]") for i, v in enumerate(value))
    if isinstance(spec, Record):
        if type(value) is not list or len(value) != len(spec.fields):
            raise MalformedMessage(f"field {name!r}: expected a list of {len(spec.fields)} values")
        return spec.cls(*(oracle(s, v, f"{name}.{f}") for (f, s), v in zip(spec.fields, value, strict=True)))
    if isinstance(spec, Opt):
        return None if value is None else oracle(spec.inner, value, name)
    return spec.check(value, name)


def outcome(fn: Any) -> tuple[Any, ...]:
    try:
        result = fn()
    except ProtocolError as exc:
        return ("error", type(exc), str(exc))
    return ("ok", result, tuple(map(type, result)))


def same(spec: Spec, value: Any) -> None:
    expected = outcome(lambda: oracle(spec, value, "f"))
    assert outcome(lambda: spec.check(value, "f")) == expected
    column = spec.check_column([value])
    assert (column is None) == (expected[0] == "error")
    assert spec.valid_column([value]) == (expected[0] == "ok")  # the sending side's check agrees
    if column is not None:
        assert tuple(column) == (expected[1],)


_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(1 << 63), (1 << 64) - 1),
    st.sampled_from([0, -1, 1, 100, 101, L.MAX_RANKS - 1, L.MAX_RANKS, (1 << 63) - 1, 1 << 63]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=10),
    st.binary(max_size=5),
    st.sampled_from(["j", "raw", "lz4", "a", "b", "x" * (L.MAX_NAME_LEN + 1), "tcp://h:1"]),
)
_VALUES = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=5), max_leaves=16)

_VALID_ROWS = {
    "inventory": st.lists(
        st.tuples(st.just("job"), st.integers(0, 99), st.integers(0, 9), st.booleans()).map(list)
    ),
    "ranks": st.lists(
        st.tuples(
            st.just("job"), st.integers(0, 9), st.integers(10, 20), st.integers(0, 1 << 31), st.booleans()
        ).map(list)
    ),
    "assignments": st.lists(
        st.tuples(st.just("job"), st.integers(0, 9), st.lists(st.just("tcp://h:1"), max_size=3)).map(list)
    ),
    "plain": st.lists(
        st.tuples(
            st.text(max_size=8),
            st.one_of(st.floats(0.0, 1.0), st.integers(0, 1)),
            st.binary(max_size=4),
            st.sampled_from(["a", "b"]),
            st.one_of(st.none(), st.integers(0, 9)),
        ).map(list),
        max_size=8,
    ),
}


@PROPS
@given(st.sampled_from(sorted(SPECS)), st.lists(_VALUES, max_size=6))
def test_arbitrary_values_get_the_per_value_answer(key: str, value: list[Any]) -> None:
    same(SPECS[key], value)


@PROPS
@given(st.sampled_from(sorted(SPECS)), _VALUES)
def test_arbitrary_non_lists_get_the_per_value_answer(key: str, value: Any) -> None:
    same(SPECS[key], value)


@PROPS
@given(st.sampled_from(sorted(_VALID_ROWS)), st.data())
def test_valid_rows_with_one_field_broken_get_the_per_value_answer(key: str, data: st.DataObject) -> None:
    rows = data.draw(_VALID_ROWS[key])
    same(SPECS[key], rows)  # as drawn: valid (unless over max_items)
    if rows:
        row = data.draw(st.integers(0, len(rows) - 1))
        field = data.draw(st.integers(0, len(rows[row]) - 1))
        rows[row][field] = data.draw(_SCALARS)
        same(SPECS[key], rows)


def test_records_built_column_by_column_are_real_frozen_records() -> None:
    rows = [["job", r, s, r % 2 == 0] for r in range(4) for s in (7, 8)]
    items = SPECS["inventory"].check(rows, "inventory")
    assert items == tuple(InventoryItem(*row) for row in rows)
    assert all(type(it) is InventoryItem for it in items)
    assert len(set(items)) == 8 and hash(items[0]) == hash(InventoryItem("job", 0, 7, True))
    with pytest.raises(dataclasses.FrozenInstanceError):
        items[0].step = 9  # type: ignore[misc]
    (plain,) = SPECS["plain"].check([["n", 1, b"ab", "a", None]], "plain")
    assert plain == _Plain("n", 1.0, b"ab", "a", None) and type(plain.ratio) is float


def test_failures_name_the_first_bad_item_and_field() -> None:
    rows = [["job", 1, 2, True], ["job", 1, -3, True], ["job", True, 2, True]]
    with pytest.raises(LimitExceeded, match=r"field 'inventory\[1\]\.step': -3 is outside"):
        SPECS["inventory"].check(rows, "inventory")
    with pytest.raises(
        MalformedMessage, match=r"field 'inventory\[1\]\.rank': expected an integer, got bool"
    ):
        SPECS["inventory"].check([rows[0], rows[2]], "inventory")
    with pytest.raises(MalformedMessage, match=r"field 'inventory\[1\]': expected a list of 4 values"):
        SPECS["inventory"].check([rows[0], rows[0][:3]], "inventory")
    with pytest.raises(
        MalformedMessage, match=r"assignments\[0\]\.buddies\[1\]': expected a string, got int"
    ):
        SPECS["assignments"].check([["job", 0, ["tcp://h:1", 5]]], "assignments")


def test_dump_is_the_wire_form_check_reads_back() -> None:
    assignments = (Assignment("j", 1, ("tcp://a:1", "tcp://b:1")), Assignment("j", 2, ()))
    dumped = SPECS["assignments"].dump(assignments)
    assert dumped == [["j", 1, ["tcp://a:1", "tcp://b:1"]], ["j", 2, []]]
    assert SPECS["assignments"].check(dumped, "a") == assignments
    items = (InventoryItem("j", 1, 2, False),)
    assert SPECS["inventory"].dump(items) == [["j", 1, 2, False]]
    assert SPECS["floats"].dump((0.5, -1.0)) == [0.5, -1.0]
    assert Bool().check_column([]) == [] and Int().check_column(()) == ()
