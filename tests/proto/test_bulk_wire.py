"""The bulk wire's checked transfers over a real socket pair: the checksum taken piece by piece on either side is
the checksum of the whole payload, whatever its length against a piece."""

from __future__ import annotations

import os
import socket
import threading

import pytest

from snapshotd.proto import checksum
from snapshotd.proto.bulk import (
    PIECE_BYTES,
    PUSH_CHUNK,
    PUSH_SUM,
    Status,
    recv_checked,
    recv_exact,
    send_checked,
)


@pytest.mark.parametrize("nbytes", [0, 1, PIECE_BYTES, 2 * PIECE_BYTES + 12_345])
def test_a_payload_sent_and_received_piece_by_piece_carries_its_whole_checksum(nbytes: int) -> None:
    payload = os.urandom(nbytes)
    header = PUSH_CHUNK.pack(7, nbytes, Status.OK)
    a, b = socket.socketpair()
    with a, b:
        a.settimeout(10)
        b.settimeout(10)
        sent: list[int] = []
        sender = threading.Thread(target=lambda: sent.append(send_checked(a, header, memoryview(payload))))
        sender.start()
        assert PUSH_CHUNK.unpack(recv_exact(b, PUSH_CHUNK.size)) == (7, nbytes, Status.OK)
        buf = memoryview(bytearray(nbytes))
        received = recv_checked(b, buf)
        (trailer,) = PUSH_SUM.unpack(recv_exact(b, PUSH_SUM.size))
        sender.join(10)
    assert sent == [checksum(payload)] and received == trailer == checksum(payload)
    assert bytes(buf) == payload
