"""Field specifications: the validation that runs on every value a peer sent before anything acts on it.

A spec checks one decoded msgpack value and returns it in its Python form (records become dataclasses, lists
become tuples). Every failure is a :class:`~snapshotd.proto.errors.ProtocolError` naming the field.

Two paths give the same answers. :meth:`Spec.check` checks one value and names the field on failure.
:meth:`Spec.check_column` checks many values of one spec at once with C-level passes (``set(map(type, ...))``,
``min``, ``max``), builds no field path and no per-item generator, and only says yes or no: a list of records is
checked column by column (every ``rank`` of the list together, then every ``step``), which is what keeps
decoding a heartbeat of 40 records in the tens of microseconds. When a column fails, :meth:`ListOf.check` runs the
per-value path, which raises the precise error (``field 'inventory[7].step': ...``).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
import operator
import types
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from .errors import LimitExceeded, MalformedMessage, ProtocolError

__all__ = ["Bool", "Bytes", "Enum", "Float", "Int", "ListOf", "Opt", "Record", "Spec", "Str", "spec_field"]

_INT = frozenset({int})
_FLOATISH = frozenset({int, float})
_FLOAT = frozenset({float})
_BOOL = frozenset({bool})
_STR = frozenset({str})
_BYTES = frozenset({bytes})
_LIST = frozenset({list})


_drain: Callable[[Iterable[Any]], None] = collections.deque(maxlen=0).extend  # runs an iterator out, keeps nothing


class Spec:
    """Checks one wire value. Subclasses implement :meth:`check` and :meth:`dump`."""

    def check(self, value: Any, name: str) -> Any:
        raise NotImplementedError

    def check_column(self, col: Sequence[Any]) -> Sequence[Any] | None:
        """The checked forms of every value of ``col`` (in order), or None when any of them fails.

        Never raises for bad values: on None the caller runs :meth:`check` per value for the precise error.
        This default runs :meth:`check` per value; scalar specs override it with whole-column passes.
        """
        try:
            return [self.check(v, "") for v in col]
        except ProtocolError:
            return None

    def dump(self, value: Any) -> Any:
        """The msgpack-ready form of a Python value of this spec."""
        return value


def _bad(name: str, what: str, value: Any) -> MalformedMessage:
    return MalformedMessage(f"field {name!r}: expected {what}, got {type(value).__name__}")


@dataclasses.dataclass(frozen=True, slots=True)
class Int(Spec):
    lo: int = 0
    hi: int = (1 << 63) - 1

    def check(self, value: Any, name: str) -> int:
        if type(value) is not int:
            raise _bad(name, "an integer", value)
        if not self.lo <= value <= self.hi:
            raise LimitExceeded(f"field {name!r}: {value} is outside [{self.lo}, {self.hi}]")
        return value

    def check_column(self, col: Sequence[Any]) -> Sequence[Any] | None:
        if col and (set(map(type, col)) != _INT or min(col) < self.lo or max(col) > self.hi):
            return None
        return col


@dataclasses.dataclass(frozen=True, slots=True)
class Float(Spec):
    lo: float = 0.0
    hi: float = 1e18

    def check(self, value: Any, name: str) -> float:
        if type(value) is int:
            value = float(value)
        if type(value) is not float or math.isnan(value):
            raise _bad(name, "a number", value)
        if not self.lo <= value <= self.hi:
            raise LimitExceeded(f"field {name!r}: {value} is outside [{self.lo}, {self.hi}]")
        return value

    def check_column(self, col: Sequence[Any]) -> Sequence[Any] | None:
        if not col:
            return col
        kinds = set(map(type, col))
        if not kinds <= _FLOATISH:
            return None
        if kinds != _FLOAT:
            col = list(map(float, col))
        if any(map(math.isnan, col)) or min(col) < self.lo or max(col) > self.hi:
            return None
        return col


@dataclasses.dataclass(frozen=True, slots=True)
class Bool(Spec):
    def check(self, value: Any, name: str) -> bool:
        if type(value) is not bool:
            raise _bad(name, "a boolean", value)
        return value

    def check_column(self, col: Sequence[Any]) -> Sequence[Any] | None:
        return col if not col or set(map(type, col)) == _BOOL else None


@dataclasses.dataclass(frozen=True, slots=True)
class Str(Spec):
    max_len: int

    def check(self, value: Any, name: str) -> str:
        if type(value) is not str:
            raise _bad(name, "a string", value)
        if len(value) > self.max_len:
            raise LimitExceeded(f"field {name!r}: {len(value)} characters, at most {self.max_len}")
        return value

    def check_column(self, col: Sequence[Any]) -> Sequence[Any] | None:
        if col and (set(map(type, col)) != _STR or max(map(len, col)) > self.max_len):
            return None
        return col


@dataclasses.dataclass(frozen=True, slots=True)
class Bytes(Spec):
    max_len: int

    def check(self, value: Any, name: str) -> bytes:
        if type(value) is not bytes:
            raise _bad(name, "bytes", value)
        if len(value) > self.max_len:
            raise LimitExceeded(f"field {name!r}: {len(value)} bytes, at most {self.max_len}")
        return value

    def check_column(self, col: Sequence[Any]) -> Sequence[Any] | None:
        if not col:
            return col
        return col if set(map(type, col)) == _BYTES and max(map(len, col)) <= self.max_len else None


@dataclasses.dataclass(frozen=True, slots=True)
class Enum(Spec):
    values: tuple[str, ...]

    def check(self, value: Any, name: str) -> str:
        if value not in self.values or type(value) is not str:
            raise MalformedMessage(f"field {name!r}: {value!r} is not one of {list(self.values)}")
        return value

    def check_column(self, col: Sequence[Any]) -> Sequence[Any] | None:
        if not col:
            return col
        return col if set(map(type, col)) == _STR and all(map(self.values.__contains__, col)) else None


@dataclasses.dataclass(frozen=True, slots=True)
class Opt(Spec):
    inner: Spec

    def check(self, value: Any, name: str) -> Any:
        return None if value is None else self.inner.check(value, name)

    def check_column(self, col: Sequence[Any]) -> Sequence[Any] | None:
        if not any(v is None for v in col):
            return self.inner.check_column(col)
        return Spec.check_column(self, col)

    def dump(self, value: Any) -> Any:
        return None if value is None else self.inner.dump(value)


@dataclasses.dataclass(frozen=True, slots=True)
class ListOf(Spec):
    item: Spec
    max_items: int

    def check(self, value: Any, name: str) -> tuple[Any, ...]:
        if type(value) is not list:
            raise _bad(name, "a list", value)
        if len(value) > self.max_items:
            raise LimitExceeded(f"field {name!r}: {len(value)} items, at most {self.max_items}")
        checked = self.item.check_column(value)
        if checked is not None:
            return tuple(checked)
        return tuple(self.item.check(v, f"{name}[{i}]") for i, v in enumerate(value))  # raises, naming the item

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

    def check(self, value: Any, name: str) -> Any:
        built = self.check_column([value])
        if built is not None:
            return built[0]
        if type(value) is not list or len(value) != len(self.fields):
            raise MalformedMessage(f"field {name!r}: expected a list of {len(self.fields)} values")
        return self.cls(*(spec.check(v, f"{name}.{fname}") for (fname, spec), v in zip(self.fields, value, strict=True)))

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

    def dump(self, value: Any) -> Any:
        return [spec.dump(getattr(value, fname)) for fname, spec in self.fields]

    def dump_many(self, values: Sequence[Any]) -> list[Any]:
        """``[self.dump(v) for v in values]``, without a Python call per value when every field dumps as is."""
        if self._plain and self._get is not None:
            return list(map(list, map(self._get, values)))
        return [self.dump(v) for v in values]


def spec_field(
    spec: Spec, default: Any = dataclasses.MISSING, factory: Callable[[], Any] | None = None, *, added: bool = False
) -> Any:
    """A dataclass field that carries its wire spec in its metadata.

    ``added`` marks a field added to a message after peers that do not know it were built: it needs a default,
    and is left out of the header whenever it holds that default, so such peers (which refuse unknown header
    fields) still read every message that does not use it.
    """
    if added and default is dataclasses.MISSING:
        raise TypeError("a field added later needs a default (its value when the header leaves it out)")
    metadata = {"spec": spec, "added": added}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)
