"""The exception tree a training process sees, and the wire codes mapped onto it."""

from __future__ import annotations

import pytest
import torch

from snapshotd.client import (
    ConfigMismatch,
    IntegrityError,
    NotRecoverable,
    ReplicaGroupError,
    RestoreFailed,
    SidecarRefused,
    SidecarUnavailable,
    SnapshotdError,
)
from snapshotd.client.copies import copy_into
from snapshotd.client.errors import from_reply
from snapshotd.client.load import restore_into
from snapshotd.client.state import flatten
from snapshotd.proto import Error, ErrorCode


def test_every_error_is_a_snapshotd_error_and_keeps_its_python_kind() -> None:
    for cls in (
        SidecarUnavailable,
        NotRecoverable,
        RestoreFailed,
        ConfigMismatch,
        ReplicaGroupError,
        SidecarRefused,
    ):
        assert issubclass(cls, SnapshotdError)
    assert issubclass(SidecarUnavailable, TimeoutError)
    assert issubclass(ConfigMismatch, ValueError)
    assert issubclass(ReplicaGroupError, RuntimeError)
    assert issubclass(IntegrityError, RestoreFailed)


@pytest.mark.parametrize("code", list(ErrorCode))
def test_every_wire_code_maps_onto_the_tree_with_its_message(code: ErrorCode) -> None:
    expected = {
        ErrorCode.PLAN_TIMEOUT: SidecarUnavailable,
        ErrorCode.NOT_RECOVERABLE: NotRecoverable,
        ErrorCode.PULL_FAILED: RestoreFailed,
        ErrorCode.CORRUPT: IntegrityError,
    }.get(code, SidecarRefused)
    exc = from_reply(Error(job="j", code=code, message="rank 3 has no complete snapshot"), "restore_request")
    assert type(exc) is expected and exc.code is code
    assert str(exc) == f"sidecar answered restore_request with {code}: rank 3 has no complete snapshot"


def test_a_snapshot_that_does_not_fit_the_state_is_a_config_mismatch() -> None:
    flat = flatten({"w": torch.zeros(3)})
    data = torch.zeros(flat.data_bytes, dtype=torch.uint8)
    copy_into(flat, data)
    with pytest.raises(
        ConfigMismatch, match=r"state\['w'\]: snapshot holds float32 \[3\], the live value is"
    ):
        restore_into({"w": torch.zeros(4)}, flat.entries, flat.meta, data)
    with pytest.raises(ConfigMismatch, match="state keys missing"):
        restore_into({"v": torch.zeros(3)}, flat.entries, flat.meta, data)
