"""Field specifications: the validation that runs on every value a peer sent before anything acts on it.

A spec checks one decoded msgpack value and returns it in its Python form (records become dataclasses, lists
become tuples). Every failure is a :class:`~snapshotd.proto.errors.ProtocolError` naming the field.

Two paths give the same answers. :meth:`Spec.check` checks one value and names the field on failure.
:meth:`Spec.check_column` checks many values of one spec at once with C-level passes (``set(map(type, ...))``,
``min``, ``max``), builds no field path and no per-item generator, and only says yes or no: a list of records is
checked column by column (every ``rank`` of the list together, then every ``step``), so that the cost of a list
grows with its length at C speed rather than by a Python call per value. When a column fails,
:meth:`~snapshotd.proto.compound.ListOf.check` runs the per-value path, which raises the precise error
(``field 'inventory[7].step': ...``).

The sending side runs the same checks through :meth:`Spec.verify`, which builds nothing: what a process sends
passes exactly the checks its peer runs on receipt.

This module holds :class:`Spec`, the specs of single values (and :class:`Frame`, a payload frame) and
:func:`spec_field`; the specs of lists and records, :class:`~snapshotd.proto.compound.ListOf` and
:class:`~snapshotd.proto.compound.Record`, are in :mod:`snapshotd.proto.compound`.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable, Sequence
from typing import Any

from .errors import LimitExceeded, MalformedMessage, ProtocolError

__all__ = [
    "Bool",
    "Bytes",
    "Enum",
    "Float",
    "Frame",
    "Int",
    "Opt",
    "Spec",
    "Str",
    "spec_field",
]

_INT = frozenset({int})
_FLOATISH = frozenset({int, float})
_FLOAT = frozenset({float})
_BOOL = frozenset({bool})
_STR = frozenset({str})
_BYTES = frozenset({bytes})


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

    def valid_column(self, col: Sequence[Any]) -> bool:
        """Whether every value of ``col`` passes :meth:`check`, a tuple standing for a list (both pack as a msgpack
        array); builds nothing and never raises. The sending side's check."""
        return self.check_column(col) is not None

    def verify(self, value: Any, name: str) -> None:
        """Raise what :meth:`check` raises for ``value``, if anything; the sending side's check.

        Raises:
            ProtocolError: ``value`` breaks this spec (named as field ``name``).
        """
        self.check(value, name)

    def dump(self, value: Any) -> Any:
        """The msgpack-ready form of a Python value of this spec."""
        return value


def mistyped(name: str, what: str, value: Any) -> MalformedMessage:
    """The error for a field ``name`` whose value is not ``what`` (``"an integer"``, ``"a list"``...)."""
    return MalformedMessage(f"field {name!r}: expected {what}, got {type(value).__name__}")


@dataclasses.dataclass(frozen=True, slots=True)
class Int(Spec):
    lo: int = 0
    hi: int = (1 << 63) - 1

    def check(self, value: Any, name: str) -> int:
        if type(value) is not int:
            raise mistyped(name, "an integer", value)
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
            raise mistyped(name, "a number", value)
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
            raise mistyped(name, "a boolean", value)
        return value

    def check_column(self, col: Sequence[Any]) -> Sequence[Any] | None:
        return col if not col or set(map(type, col)) == _BOOL else None


@dataclasses.dataclass(frozen=True, slots=True)
class Str(Spec):
    max_len: int

    def check(self, value: Any, name: str) -> str:
        if type(value) is not str:
            raise mistyped(name, "a string", value)
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
            raise mistyped(name, "bytes", value)
        if len(value) > self.max_len:
            raise LimitExceeded(f"field {name!r}: {len(value)} bytes, at most {self.max_len}")
        return value

    def check_column(self, col: Sequence[Any]) -> Sequence[Any] | None:
        if not col:
            return col
        return col if set(map(type, col)) == _BYTES and max(map(len, col)) <= self.max_len else None


@dataclasses.dataclass(frozen=True, slots=True)
class Enum(Spec):
    """One of ``values``, a string; with ``kind`` (a ``StrEnum`` of those values) read as that enum's member."""

    values: tuple[str, ...]
    kind: type[enum.StrEnum] | None = None

    @classmethod
    def of(cls, kind: type[enum.StrEnum]) -> Enum:
        """The spec of ``kind``'s values, read as its members."""
        return cls(tuple(member.value for member in kind), kind)

    def check(self, value: Any, name: str) -> str:
        if value not in self.values or type(value) is not str:
            raise MalformedMessage(f"field {name!r}: {value!r} is not one of {list(self.values)}")
        return value if self.kind is None else self.kind(value)

    def check_column(self, col: Sequence[Any]) -> Sequence[Any] | None:
        if not col:
            return col
        if set(map(type, col)) != _STR or not all(map(self.values.__contains__, col)):
            return None
        return col if self.kind is None else list(map(self.kind, col))

    def dump(self, value: Any) -> Any:
        return str(value) if self.kind is not None and isinstance(value, str) else value


@dataclasses.dataclass(frozen=True, slots=True)
class Opt(Spec):
    inner: Spec

    def check(self, value: Any, name: str) -> Any:
        return None if value is None else self.inner.check(value, name)

    def check_column(self, col: Sequence[Any]) -> Sequence[Any] | None:
        if not any(v is None for v in col):
            return self.inner.check_column(col)
        return Spec.check_column(self, col)

    def valid_column(self, col: Sequence[Any]) -> bool:
        return self.inner.valid_column([v for v in col if v is not None])

    def dump(self, value: Any) -> Any:
        return None if value is None else self.inner.dump(value)


class Frame(Spec):
    """A payload frame (not part of the header): any buffer up to ``max_len`` bytes, read as a memoryview."""

    def __init__(self, max_len: int) -> None:
        self.max_len = max_len

    def check(self, value: Any, name: str) -> memoryview:
        view = value if isinstance(value, memoryview) else memoryview(value)
        if view.nbytes > self.max_len:
            raise LimitExceeded(f"frame {name!r}: {view.nbytes} bytes, at most {self.max_len}")
        return view


def spec_field(
    spec: Spec, default: Any = dataclasses.MISSING, factory: Callable[[], Any] | None = None
) -> Any:
    """A dataclass field that carries its wire spec in its metadata.

    A field with a default (or ``factory``) may be left out of a header a peer sends: it then takes that default.
    """
    metadata = {"spec": spec}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)
