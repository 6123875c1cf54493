"""The bulk wire's checked transfers over a real loopback TCP connection, the sender's socket blocking under the
kernel's send timeout as a push lane's is: the checksum taken piece by piece on either side is the checksum of
the whole payload, whatever its length against a piece."""

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
    block_sends,
    recv_checked,
    recv_exact,
    send_checked,
)


@pytest.mark.parametrize("nbytes", [0, 1, PIECE_BYTES, 2 * PIECE_BYTES + 12_345])
def test_a_payload_sent_and_received_piece_by_piece_carries_its_whole_checksum(nbytes: int) -> None:
    payload = os.urandom(nbytes)
    header = PUSH_CHUNK.pack(7, nbytes, Status.OK)
    with socket.create_server(("127.0.0.1", 0)) as listener:
        a = socket.create_connection(listener.getsockname(), timeout=10)
        b, _ = listener.accept()
    with a, b:
        block_sends(a, 10)
        b.settimeout(10)
        outcome: list[object] = []

        def send() -> None:
            try:
                outcome.append(send_checked(a, header, memoryview(payload)))
            except BaseException as exc:  # surfaced below, not lost in the thread
                outcome.append(exc)

        sender = threading.Thread(target=send)
        sender.start()
        assert PUSH_CHUNK.unpack(recv_exact(b, PUSH_CHUNK.size)) == (7, nbytes, Status.OK)
        buf = memoryview(bytearray(nbytes))
        received = recv_checked(b, buf)
        (trailer,) = PUSH_SUM.unpack(recv_exact(b, PUSH_SUM.size))
        sender.join(10)
    assert not sender.is_alive() and outcome == [checksum(payload)]
    assert received == trailer == checksum(payload) and bytes(buf) == payload


def test_a_send_timeout_must_be_positive() -> None:
    a, b = socket.socketpair()
    with a, b, pytest.raises(ValueError, match="must be positive"):
        block_sends(a, 0)
