"""Members mode (``--data-security members``): a sidecar's data plane in plaintext, behind :class:`MembersGate`.

For private training fabrics where CURVE's one core per connection would cap the stream rate. The gate admits a
connection only from the host of a live member's data address, as the coordinator (over CURVE) says. It keeps out
anyone on another host; it does not encrypt, and it does not tell apart two processes on a member's host.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit

import zmq
import zmq.asyncio

__all__ = ["DATA_DOMAIN", "MembersGate", "data_host", "members_source"]

log = logging.getLogger(__name__)

DATA_DOMAIN = b"snapshotd-data"
"""The ZAP domain of a ``members`` mode data plane (a NULL-mechanism socket asks ZAP only when it has one)."""
MEMBER_TTL_S = 60.0
"""How long a host the coordinator called a member is admitted without asking again."""
REFUSED_TTL_S = 5.0
"""How long a refused host is refused without asking again (a host that keeps knocking costs one query per this)."""
FAILED_TTL_S = 1.0
"""How long a question that failed (the coordinator unreachable) stands before the next handshake asks again."""
MAX_QUESTIONS = 16
"""Questions to the coordinator in flight at once."""
_ZAP_ENDPOINT = "inproc://zeromq.zap.01"


def data_host(addr: str) -> str:
    """The host of ``tcp://HOST:PORT`` as ZAP reports a peer: an IPv4 address in dotted form; "" when it is
    anything else (a name, IPv6, not a TCP address). ``members`` mode compares addresses and never resolves names."""
    try:
        return str(ipaddress.IPv4Address(urlsplit(addr).hostname or ""))
    except ValueError:
        return ""


def members_source(addr: str) -> str:
    """The address a ``members`` mode sidecar advertising ``addr`` connects from, checked to be one of this host's.

    Raises:
        ValueError: the advertised host is not an IPv4 address, or not one this host has.
    """
    host = data_host(addr)
    if not host:
        raise ValueError(
            f"--data-security members needs an IPv4 address to advertise, got {addr}: pass --advertise "
            "with this node's address on the training network"
        )
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((host, 0))
    except OSError as exc:
        raise ValueError(
            f"--advertise {host} is not an address of this host ({exc.strerror}): in members mode "
            "peers admit this node by it, and its connections leave from it"
        ) from None
    return host


class MembersGate:
    """The ZAP handler of a ``members`` mode sidecar: admit a data-plane connection only from a member's host.

    Each handshake on a socket with :data:`DATA_DOMAIN` is answered from a cache of the coordinator's answers
    (``is_member(host)``; a member is remembered for :data:`MEMBER_TTL_S`, a refusal for :data:`REFUSED_TTL_S`),
    else after asking it: one question per host at a time (handshakes from a host already being asked about wait
    for that answer) and at most :data:`MAX_QUESTIONS` at once, so that a host that keeps knocking cannot flood
    the coordinator. Handshakes are answered concurrently, so a slow answer delays only its own connections. A
    question that fails (the coordinator unreachable) answers ZAP status 300, a temporary failure that ZeroMQ
    retries, and is remembered for :data:`FAILED_TTL_S`; a refusal answers 400. Anything but a NULL handshake in
    that domain, or from no address, is refused. Connections already admitted stay up.

    Args:
        ctx: the context whose sockets this gate serves (at most one ZAP handler per context).
        is_member: asks the coordinator; raises on failure.
        clock: seconds, monotonic (for tests).
    """

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        is_member: Callable[[str], Awaitable[bool]],
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ctx = ctx
        self.is_member = is_member
        self.clock = clock
        self.sock: zmq.asyncio.Socket | None = None
        self._known: dict[
            str, tuple[str, float]
        ] = {}  # host -> (verdict: "member" | "refused" | a failure, until)
        self._asking: dict[
            str, asyncio.Future[None]
        ] = {}  # host -> done when its question in flight is answered
        self._questions = asyncio.Semaphore(MAX_QUESTIONS)
        self._logged: dict[str, float] = {}  # host -> when its last refusal was logged

    async def run(self) -> None:
        """Bind the ZAP endpoint and answer handshakes until cancelled. Each handshake is answered by a task of
        this call's own TaskGroup (so a slow answer delays only its own connections); they end with it."""
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.linger = 0
        self.sock.bind(_ZAP_ENDPOINT)
        try:
            async with asyncio.TaskGroup() as group:
                while True:
                    frames = await self.sock.recv_multipart()
                    try:
                        split = frames.index(b"")
                    except ValueError:
                        continue  # not a ZAP request
                    envelope, request = frames[: split + 1], frames[split + 1 :]
                    if len(request) >= 6:
                        group.create_task(self._answer(envelope, request))
        finally:
            self.sock.close(linger=0)
            self.sock = None

    async def _answer(self, envelope: list[bytes], request: list[bytes]) -> None:
        try:
            _version, request_id, domain, address, _identity, mechanism = request[:6]
            host = address.decode("ascii", "replace").lower()
            if domain != DATA_DOMAIN or mechanism != b"NULL" or not host:
                code, why = (
                    b"400",
                    f"unexpected {mechanism.decode('ascii', 'replace')} handshake from {host or '?'}",
                )
            else:
                code, why = await self.decide(host)
            if code != b"200":
                self._log_refusal(host, why)
            if self.sock is not None:
                await self.sock.send_multipart(
                    [*envelope, b"1.0", request_id, code, why.encode()[:255] or b"OK", b"", b""]
                )
        except Exception:  # one handshake's answer: never the gate's end (ZeroMQ retries the connection)
            log.exception("answering a data-plane handshake failed")

    async def decide(self, host: str) -> tuple[bytes, str]:
        """The ZAP status for a connection from ``host``: 200 (a member), 400 (not one) or 300 (the coordinator
        could not be asked), and why not (empty for 200). The first handshake that needs the coordinator's word
        on ``host`` asks; the others of that host wait for its answer."""
        known = self._known.get(host)
        if known is None or known[1] <= self.clock():
            asking = self._asking.get(host)
            if asking is not None:
                await asyncio.shield(asking)
            else:
                asking = self._asking[host] = asyncio.get_running_loop().create_future()
                try:
                    await self._ask(host)
                finally:
                    del self._asking[host]
                    asking.set_result(None)
            known = self._known.get(host)
            if known is None:  # the handshake that asked was given up before the answer came
                return b"300", "the question to the coordinator was given up"
        verdict = known[0]
        if verdict == "member":
            return b"200", ""
        if verdict == "refused":
            return b"400", "not the host of any live sidecar registered with the coordinator"
        return b"300", f"cannot ask the coordinator whether it is a member: {verdict}"

    async def _ask(self, host: str) -> None:
        async with self._questions:
            try:
                verdict = "member" if await self.is_member(host) else "refused"
                ttl = MEMBER_TTL_S if verdict == "member" else REFUSED_TTL_S
            except Exception as exc:
                verdict, ttl = str(exc) or type(exc).__name__, FAILED_TTL_S
        now = self.clock()
        if len(self._known) > 100_000:
            self._known = {h: k for h, k in self._known.items() if k[1] > now}
        self._known[host] = (verdict, now + ttl)

    def _log_refusal(self, host: str, why: str) -> None:
        now = self.clock()
        last = self._logged.get(host)
        if last is not None and now - last < 60.0:
            return
        if len(self._logged) > 1024:
            self._logged = {h: t for h, t in self._logged.items() if now - t < 60.0}
        self._logged[host] = now
        log.warning(
            "refused a data-plane connection from %s: %s (logged at most once a minute per host)", host, why
        )
