"""The base of every message, and the payload frame field (see :mod:`.messages`)."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from .fields import (
    JOB,
)
from .schema import Frame, spec_field

__all__ = ["Message", "payload"]


def payload(max_len: int) -> Any:
    """A payload frame field (not part of the header) of at most ``max_len`` bytes, empty by default."""
    return dataclasses.field(default=b"", metadata={"spec": Frame(max_len)})


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Message:
    """Base of every message. ``job`` is empty for messages that concern no single job."""

    TYPE: ClassVar[str] = ""
    job: str = spec_field(JOB, default="")
