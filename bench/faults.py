"""Injected network faults, for the fault tests and the soak: messages dropped, duplicated, delayed, reordered.

A :class:`FaultyNetwork` wraps a daemon's real network (ZeroMQ or in-memory) and puts every message that a pipe
of the chosen planes sends through :class:`Faults`: dropped, sent twice, sent late (so later messages overtake
it), or held back until the next one has gone. The data plane is a sidecar's data socket and its connections to
other sidecars; the control plane is the coordinator's socket and the sidecars' connections to it. A training
rank's ipc channel is never touched (it is a local socket). Faults act where a message is sent; with every
daemon interposed both directions of each connection get them.

:func:`install` interposes every daemon started in this process from then on (in-process tests). To interpose a
daemon process, start it as ``python -m snapshotd.bench.faults PLAN_JSON snapshotd-args...``
(:func:`command`): it installs ``PLAN_JSON`` (a :class:`FaultPlan` as JSON), runs the ``snapshotd`` command,
and logs what it injected as it exits.

Test-only: nothing in the daemons knows of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import random
import sys
from collections.abc import Awaitable, Callable, Iterator

from snapshotd.transport import Frames, Network, Pipe, Role, Security, TransportError

__all__ = ["PLANES", "FaultPlan", "Faults", "FaultyNetwork", "FaultyPipe", "command", "install", "main"]

log = logging.getLogger(__name__)

PLANES: dict[str, frozenset[Role]] = {
    "data": frozenset({Role.DATA, Role.PEER}),
    "control": frozenset({Role.CONTROL, Role.COORDINATOR}),
}
"""The pipes of each plane, by role."""

LATE_SEND_TIMEOUT = 10.0
"""Seconds a delayed or held-back message may wait for room in its pipe before it is lost."""


@dataclasses.dataclass(frozen=True, slots=True)
class FaultPlan:
    """What happens to each message sent on ``planes``: each a probability, drawn independently per message."""

    drop: float = 0.0
    """The message is never sent."""
    duplicate: float = 0.0
    """It is sent twice (each copy with its own delay)."""
    delay: float = 0.0
    """It is sent after a uniform delay of up to ``max_delay`` seconds: messages sent meanwhile overtake it."""
    reorder: float = 0.0
    """It is held back until the pipe's next message has been sent (or ``max_delay`` has passed)."""
    max_delay: float = 0.05
    planes: tuple[str, ...] = ("data", "control")
    seed: int = 0
    """With the pipe's role and address, the seed of its random draws: a run repeats its faults."""

    def __post_init__(self) -> None:
        for name in ("drop", "duplicate", "delay", "reorder"):
            p = getattr(self, name)
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"{name} must be a probability in [0, 1], got {p!r}")
        if not 0.0 < self.max_delay <= 10.0:
            raise ValueError(f"max_delay must be in (0, 10] seconds, got {self.max_delay!r}")
        unknown = set(self.planes) - set(PLANES)
        if unknown:
            raise ValueError(f"unknown planes {sorted(unknown)}; known: {sorted(PLANES)}")

    @property
    def roles(self) -> frozenset[Role]:
        return frozenset().union(*(PLANES[p] for p in self.planes))

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> FaultPlan:
        fields = json.loads(text)
        fields["planes"] = tuple(fields.get("planes", ("data", "control")))
        return cls(**fields)


@dataclasses.dataclass(slots=True)
class Faults:
    """What one network injected so far (summed over its pipes)."""

    sent: int = 0
    dropped: int = 0
    duplicated: int = 0
    delayed: int = 0
    reordered: int = 0

    def injected(self) -> int:
        return self.dropped + self.duplicated + self.delayed + self.reordered


class FaultyPipe(Pipe):
    """A pipe whose sends go through its plan (see the module docstring); everything else is the inner pipe's."""

    def __init__(self, inner: Pipe, plan: FaultPlan, rng: random.Random, faults: Faults) -> None:
        self.inner, self.plan, self._rng, self.faults = inner, plan, rng, faults
        self.address = inner.address
        self._held: Frames | None = None
        self._release: asyncio.TimerHandle | None = None
        self._late: set[asyncio.Task[None]] = set()  # messages on their way late
        self._closed = False

    @property
    def failure(self) -> str | None:
        return self.inner.failure

    async def recv(self, *, copy: bool = False) -> Frames:
        return await self.inner.recv(copy=copy)

    def recv_nowait(self, *, copy: bool = True) -> Frames | None:
        return self.inner.recv_nowait(copy=copy)

    async def poll(self, timeout: float) -> bool:
        return await self.inner.poll(timeout)

    async def watch(self) -> None:
        await self.inner.watch()

    def close(self) -> None:
        self._closed = True
        if self._release is not None:
            self._release.cancel()
        for task in self._late:
            task.cancel()
        self.inner.close()

    # -- sending

    def _fate(self) -> list[float] | None:
        """None to drop the message; otherwise the delay of each copy to send (0: now)."""
        plan, rng, f = self.plan, self._rng, self.faults
        f.sent += 1
        if rng.random() < plan.drop:
            f.dropped += 1
            return None
        copies = 1
        if rng.random() < plan.duplicate:
            f.duplicated += 1
            copies = 2
        delays = []
        for _ in range(copies):
            if rng.random() < plan.delay:
                f.delayed += 1
                delays.append(rng.uniform(0.0, plan.max_delay))
            else:
                delays.append(0.0)
        return delays

    def send_nowait(self, frames: Frames) -> bool:
        fate = self._fate()
        if fate is None:
            return True
        if self._held is None and fate == [0.0] and self._rng.random() < self.plan.reorder:
            self.faults.reordered += 1
            self._held = _own(frames)
            self._release = asyncio.get_running_loop().call_later(self.plan.max_delay, self._send_held)
            return True
        sent = True
        for i, delay in enumerate(fate):
            if delay > 0:
                self._send_late(_own(frames), delay)
            elif not self.inner.send_nowait(frames) and i == 0:
                sent = False  # the caller sees the pipe full, as without faults (a gone peer raises, as well)
        if sent:
            self._send_held()
        return sent

    async def send(self, frames: Frames) -> None:
        if not self.send_nowait(frames):
            await self.inner.send(frames)
            self._send_held()

    def _send_late(self, frames: Frames, delay: float = 0.0) -> None:
        """Send ``frames`` after ``delay`` seconds, waiting for room as the pipe's own sends do (at most
        :data:`LATE_SEND_TIMEOUT`): a message the caller has moved on from is lost only to a gone peer."""

        async def later() -> None:
            await asyncio.sleep(delay)
            if not self._closed:
                with contextlib.suppress(TransportError, TimeoutError):
                    async with asyncio.timeout(LATE_SEND_TIMEOUT):
                        await self.inner.send(frames)

        task = asyncio.get_running_loop().create_task(later())
        self._late.add(task)
        task.add_done_callback(self._late.discard)

    def _send_held(self) -> None:
        held, self._held = self._held, None
        if self._release is not None:
            self._release.cancel()
            self._release = None
        if held is not None:
            self._send_late(held)


def _own(frames: Frames) -> Frames:
    """The frames as bytes of their own: a message sent later must not see its buffers reused meanwhile."""
    return [f if isinstance(f, bytes) else bytes(f) for f in frames]


class FaultyNetwork(Network):
    """``inner`` with the pipes of ``plan``'s planes wrapped in :class:`FaultyPipe` (their injections summed in
    :attr:`faults`)."""

    def __init__(self, inner: Network, plan: FaultPlan) -> None:
        self.inner, self.plan = inner, plan
        self.faults = Faults()

    def _wrap(self, pipe: Pipe, role: Role, address: str) -> Pipe:
        if role not in self.plan.roles:
            return pipe
        return FaultyPipe(
            pipe, self.plan, random.Random(f"{self.plan.seed}:{role.value}:{address}"), self.faults
        )

    def serve(self, address: str, role: Role) -> Pipe:
        return self._wrap(self.inner.serve(address, role), role, address)

    def connect(self, address: str, role: Role, *, source: str | None = None) -> Pipe:
        return self._wrap(self.inner.connect(address, role, source=source), role, address)

    async def run(self) -> None:
        await self.inner.run()

    def close(self) -> None:
        self.inner.close()


_DAEMON_MODULES = ("snapshotd.sidecar.daemon", "snapshotd.coordinator.server")
"""Where the daemons look up ``open_network``."""


@contextlib.contextmanager
def install(plan: FaultPlan, networks: list[FaultyNetwork] | None = None) -> Iterator[None]:
    """Within the block, every daemon of this process that opens its network gets a :class:`FaultyNetwork` with
    ``plan`` (appended to ``networks`` when given, for the caller to read their :attr:`~FaultyNetwork.faults`)."""
    import importlib

    modules = [importlib.import_module(name) for name in _DAEMON_MODULES]
    originals = [m.open_network for m in modules]

    def make(real: Callable[..., Network]) -> Callable[..., Network]:
        def open_faulty(
            address: str, security: Security, is_member: Callable[[str], Awaitable[bool]] | None = None
        ) -> Network:
            net = FaultyNetwork(real(address, security, is_member), plan)
            if networks is not None:
                networks.append(net)
            return net

        return open_faulty

    for module, real in zip(modules, originals, strict=True):
        module.open_network = make(real)  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for module, real in zip(modules, originals, strict=True):
            module.open_network = real  # type: ignore[attr-defined]


def command(plan: FaultPlan) -> list[str]:
    """The argv prefix that runs a ``snapshotd`` command interposed by ``plan`` (the command's own args follow)."""
    return [sys.executable, "-m", "snapshotd.bench.faults", plan.to_json()]


def main(argv: list[str]) -> int:
    """``python -m snapshotd.bench.faults PLAN_JSON ARGS...``: ``snapshotd ARGS...`` interposed by the plan."""
    if not argv:
        print("usage: python -m snapshotd.bench.faults PLAN_JSON snapshotd-args...", file=sys.stderr)
        return 2
    from snapshotd import cli

    plan = FaultPlan.from_json(argv[0])
    networks: list[FaultyNetwork] = []
    with install(plan, networks):
        try:
            return cli.main(argv[1:])
        finally:
            total = Faults()
            for net in networks:
                for field in dataclasses.fields(Faults):
                    setattr(total, field.name, getattr(total, field.name) + getattr(net.faults, field.name))
            print(f"faults injected: {json.dumps(dataclasses.asdict(total))}", flush=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
