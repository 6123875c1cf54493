"""MembersGate's decisions: the coordinator's answers remembered for their time, a failed question refusing."""

from __future__ import annotations

import asyncio

import pytest
import zmq.asyncio

from snapshotd import security
from snapshotd.security import MembersGate


class _Coordinator:
    """Answers member questions from a set of hosts, counting them; ``down`` makes it fail."""

    def __init__(self, *members: str) -> None:
        self.members = set(members)
        self.asked: list[str] = []
        self.down = False

    async def is_member(self, host: str) -> bool:
        self.asked.append(host)
        if self.down:
            raise TimeoutError("coordinator tcp://10.0.0.1:7070 did not answer within 10.0 s")
        return host in self.members


def test_answers_are_remembered_and_a_failure_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario() -> None:
        clock = [100.0]
        monkeypatch.setattr(security.time, "monotonic", lambda: clock[0])
        coord = _Coordinator("10.0.0.5")
        ctx = zmq.asyncio.Context()
        try:
            gate = MembersGate(ctx, coord.is_member)
            assert await gate.admits("10.0.0.5") == (True, "")
            assert await gate.admits("10.0.0.9") == (False, "not the host of any live member of this job")
            assert await gate.admits("10.0.0.5") == (True, "")
            assert coord.asked == ["10.0.0.5", "10.0.0.9"]  # the second question about .5 was not asked
            clock[0] += security.REFUSED_TTL_S + 0.1
            coord.members.add("10.0.0.9")  # joined since
            assert (await gate.admits("10.0.0.9"))[0] is True
            coord.down = True
            clock[0] += security.MEMBER_TTL_S + 0.1
            ok, why = await gate.admits("10.0.0.5")
            assert not ok and "cannot ask the coordinator" in why and "did not answer" in why
            coord.down = False
            assert (await gate.admits("10.0.0.5"))[0] is True  # the failure was not remembered
        finally:
            ctx.destroy(linger=0)

    asyncio.run(scenario())
