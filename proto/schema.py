"""Field specifications: the validation that runs on every value a peer sent before anything acts on it.

A spec checks one decoded msgpack value and returns it in its Python form (records become dataclasses, lists
become tuples). Every failure is a :class:`~snapshotd.proto.errors.ProtocolError` naming the field.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from .errors import LimitExceeded, MalformedMessage

__all__ = ["Bool", "Bytes", "Enum", "Float", "Int", "ListOf", "Opt", "Record", "Spec", "Str", "spec_field"]


class Spec:
    """Checks one wire value. Subclasses implement :meth:`check` and :meth:`dump`."""

    def check(self, value: Any, name: str) -> Any:
        raise NotImplementedError

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


@dataclasses.dataclass(frozen=True, slots=True)
class Bool(Spec):
    def check(self, value: Any, name: str) -> bool:
        if type(value) is not bool:
            raise _bad(name, "a boolean", value)
        return value


@dataclasses.dataclass(frozen=True, slots=True)
class Str(Spec):
    max_len: int

    def check(self, value: Any, name: str) -> str:
        if type(value) is not str:
            raise _bad(name, "a string", value)
        if len(value) > self.max_len:
            raise LimitExceeded(f"field {name!r}: {len(value)} characters, at most {self.max_len}")
        return value


@dataclasses.dataclass(frozen=True, slots=True)
class Bytes(Spec):
    max_len: int

    def check(self, value: Any, name: str) -> bytes:
        if type(value) is not bytes:
            raise _bad(name, "bytes", value)
        if len(value) > self.max_len:
            raise LimitExceeded(f"field {name!r}: {len(value)} bytes, at most {self.max_len}")
        return value


@dataclasses.dataclass(frozen=True, slots=True)
class Enum(Spec):
    values: tuple[str, ...]

    def check(self, value: Any, name: str) -> str:
        if value not in self.values or type(value) is not str:
            raise MalformedMessage(f"field {name!r}: {value!r} is not one of {list(self.values)}")
        return value


@dataclasses.dataclass(frozen=True, slots=True)
class Opt(Spec):
    inner: Spec

    def check(self, value: Any, name: str) -> Any:
        return None if value is None else self.inner.check(value, name)

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
        return tuple(self.item.check(v, f"{name}[{i}]") for i, v in enumerate(value))

    def dump(self, value: Any) -> Any:
        return [self.item.dump(v) for v in value]


class Record(Spec):
    """A nested record: a dataclass whose fields carry specs, sent as a msgpack list in field order."""

    def __init__(self, cls: type) -> None:
        self.cls = cls
        self.fields: list[tuple[str, Spec]] = [(f.name, f.metadata["spec"]) for f in dataclasses.fields(cls)]

    def check(self, value: Any, name: str) -> Any:
        if type(value) is not list or len(value) != len(self.fields):
            raise MalformedMessage(f"field {name!r}: expected a list of {len(self.fields)} values")
        return self.cls(*(spec.check(v, f"{name}.{fname}") for (fname, spec), v in zip(self.fields, value, strict=True)))

    def dump(self, value: Any) -> Any:
        return [spec.dump(getattr(value, fname)) for fname, spec in self.fields]


def spec_field(spec: Spec, default: Any = dataclasses.MISSING, factory: Callable[[], Any] | None = None) -> Any:
    """A dataclass field that carries its wire spec in its metadata."""
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata={"spec": spec})
    return dataclasses.field(default=default, metadata={"spec": spec})

