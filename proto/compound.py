"""The compound specs: :class:`ListOf` (a list of values of one spec) and :class:`Record` (a nested record).

Both check the values under them column by column (:meth:`~snapshotd.proto.schema.Spec.check_column`): a list of
records is checked every ``rank`` of the list together, then every ``step``, so that the cost of a list grows
with its length at C speed rather than by a Python call per value. When a column fails, :meth:`ListOf.check`
runs the per-value path, which raises the precise error (``field 'inventory[7].step': ...``); the sending side's
:meth:`~snapshotd.proto.schema.Spec.verify` runs the column checks only, building nothing.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import operator
import types
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from .errors import LimitExceeded, MalformedMessage
from .schema import Spec, mistyped

__all__ = ["ListOf", "Record"]

_LIST = frozenset({list})
_SEQ = frozenset({list, tuple})  # what a sender may give as a msgpack array


_drain: Callable[[Iterable[Any]], None] = collections.deque(
    maxlen=0
).extend  # runs an iterator out, keeps nothing


def _as_lists(value: Any) -> Any:
    """``value`` with every tuple in it a list, as a peer's msgpack would give it (for the checks that read it)."""
    if type(value) in _SEQ:
        return [_as_lists(v) for v in value]
    return value


@dataclasses.dataclass(frozen=True, slots=True)
class ListOf(Spec):
    item: Spec
    max_items: int

    def check(self, value: Any, name: str) -> tuple[Any, ...]:
        if type(value) is not list:
            raise mistyped(name, "a list", value)
        if len(value) > self.max_items:
            raise LimitExceeded(f"field {name!r}: {len(value)} items, at most {self.max_items}")
        checked = self.item.check_column(value)
        if checked is not None:
            return tuple(checked)
        return tuple(
            self.item.check(v, f"{name}[{i}]") for i, v in enumerate(value)
        )  # raises, naming the item

    def check_column(self, col: Sequence[Any]) -> Sequence[Any] | None:
        if not col:
            return col
        if set(map(type, col)) != _LIST or max(map(len, col)) > self.max_items:
            return None
        items = self.item.check_column(list(itertools.chain.from_iterable(col)))
        if items is None:
            return None
        it = iter(items)
        return [tuple(itertools.islice(it, n)) for n in map(len, col)]

    def valid_column(self, col: Sequence[Any]) -> bool:
        if not col:
            return True
        if not set(map(type, col)) <= _SEQ or max(map(len, col)) > self.max_items:
            return False
        return self.item.valid_column(list(itertools.chain.from_iterable(col)))

    def verify(self, value: Any, name: str) -> None:
        if not self.valid_column((value,)):
            self.check(_as_lists(value), name)  # raises, naming the item

    def dump(self, value: Any) -> Any:
        item = self.item
        if isinstance(item, Record):
            return item.dump_many(value)
        if type(item).dump is Spec.dump:
            return list(value)
        return [item.dump(v) for v in value]


class Record(Spec):
    """A nested record: a dataclass whose fields carry specs, sent as a msgpack list in field order.

    ``cls`` must take its fields positionally in field order. A frozen slotted dataclass without
    ``__post_init__`` is built column by column through its slot descriptors (what its generated ``__init__``
    does one ``object.__setattr__`` call at a time); any other class through its constructor.
    """

    def __init__(self, cls: type) -> None:
        self.cls = cls
        self.fields: list[tuple[str, Spec]] = [(f.name, f.metadata["spec"]) for f in dataclasses.fields(cls)]
        self._names = tuple(name for name, _ in self.fields)
        self._specs = tuple(spec for _, spec in self.fields)
        self._nfields = len(self.fields)
        direct = not hasattr(cls, "__post_init__") and all(
            isinstance(getattr(cls, name, None), types.MemberDescriptorType) for name in self._names
        )
        self._setters: tuple[Callable[[Any, Any], None], ...] | None = (
            tuple(getattr(cls, name).__set__ for name in self._names) if direct else None
        )
        self._get = operator.attrgetter(*self._names) if len(self._names) > 1 else None
        self._plain = all(type(spec).dump is Spec.dump for spec in self._specs)
        self._valid = tuple(spec.valid_column for spec in self._specs)

    def check(self, value: Any, name: str) -> Any:
        built = self.check_column([value])
        if built is not None:
            return built[0]
        if type(value) is not list or len(value) != len(self.fields):
            raise MalformedMessage(f"field {name!r}: expected a list of {len(self.fields)} values")
        return self.cls(
            *(spec.check(v, f"{name}.{fname}") for (fname, spec), v in zip(self.fields, value, strict=True))
        )

    def check_column(self, col: Sequence[Any]) -> Sequence[Any] | None:
        if not col:
            return []
        if set(map(type, col)) != _LIST:
            return None
        try:
            columns: list[Sequence[Any]] = list(zip(*col, strict=True))
        except ValueError:  # rows of different lengths
            return None
        if len(columns) != self._nfields:
            return None
        for i, spec in enumerate(self._specs):
            checked = spec.check_column(columns[i])
            if checked is None:
                return None
            columns[i] = checked
        setters = self._setters
        if setters is None:
            return list(map(self.cls, *columns))
        objs: list[Any] = list(map(object.__new__, itertools.repeat(self.cls, len(col))))
        for setter, column in zip(setters, columns, strict=True):
            _drain(map(setter, objs, column))
        return objs

    def valid_column(self, col: Sequence[Any]) -> bool:
        if not col:
            return True
        if not set(map(type, col)) <= _SEQ:
            return False
        try:
            columns = list(zip(*col, strict=True))
        except ValueError:  # rows of different lengths
            return False
        if len(columns) != self._nfields:
            return False
        return all(valid(column) for valid, column in zip(self._valid, columns, strict=True))

    def verify(self, value: Any, name: str) -> None:
        if not self.valid_column((value,)):
            self.check(_as_lists(value), name)  # raises, naming the field

    def dump(self, value: Any) -> Any:
        """The record's field values as a list; a list or tuple is taken as the record in that form already."""
        if type(value) in _SEQ:
            return value
        return [spec.dump(getattr(value, fname)) for fname, spec in self.fields]

    def dump_many(self, values: Sequence[Any]) -> list[Any]:
        """``[self.dump(v) for v in values]``, without a Python call per value when every field dumps as is or
        the records are in their wire form already (judged by the first: a mix fails the check that follows)."""
        if values and type(values[0]) in _SEQ:
            return list(values)
        if self._plain and self._get is not None:
            return list(map(list, map(self._get, values)))
        return [self.dump(v) for v in values]
