"""Who may talk to a snapshotd process.

Snapshots are the model itself, so every TCP socket of a job whose members share ``SNAPSHOTD_SECRET`` runs
CurveZMQ: the server and client key pairs are derived from the secret, and a ZAP handler admits only clients
whose long-term key is the one derived from the same secret. Without a secret, daemons bind loopback only
(with a warning) unless told ``--insecure``. ipc endpoints and shared-memory files are owner-only in every mode.

A sidecar's data plane may instead run in ``members`` mode (``--data-security members``): plaintext, for
private training fabrics where CURVE's one core per connection would cap the stream rate, behind
:class:`MembersGate`, which admits a connection only from the host of a live member's data address, as the
coordinator (over CURVE) says. It keeps out anyone on another host; it does not encrypt, and it does not tell
apart two processes on a member's host.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import ipaddress
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit

import zmq
import zmq.asyncio
import zmq.auth.asyncio
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

__all__ = [
    "DATA_SECURITY_MODES",
    "CurveKeys",
    "HandshakeWatch",
    "MembersGate",
    "check_bind",
    "curve_keys",
    "data_host",
    "members_source",
    "secret_from_env",
    "secure_client",
    "secure_server",
    "start_authenticator",
]

log = logging.getLogger(__name__)

DATA_SECURITY_MODES = ("curve", "members")
"""A sidecar's data-plane modes (``--data-security``); ``curve`` is the default whenever a secret is set."""
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


@dataclasses.dataclass(frozen=True, slots=True)
class CurveKeys:
    """Z85-encoded CurveZMQ key pairs derived from a job secret."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes


def secret_from_env() -> str | None:
    """``$SNAPSHOTD_SECRET``, or None when unset or empty."""
    return os.environ.get("SNAPSHOTD_SECRET") or None


def curve_keys(secret: str) -> CurveKeys:
    """The job's key pairs: ``zmq.curve_public`` of a SHA-256 of the secret, one pair per role."""

    def pair(role: bytes) -> tuple[bytes, bytes]:
        sk = z85.encode(hashlib.sha256(b"snapshotd/" + role + b"\0" + secret.encode()).digest())
        return zmq.curve_public(sk), sk

    server_public, server_secret = pair(b"server")
    client_public, client_secret = pair(b"client")
    return CurveKeys(server_public, server_secret, client_public, client_secret)


def secure_server(sock: zmq.Socket, secret: str | None) -> None:
    """Make a bound socket a CURVE server (before ``bind``). No-op without a secret."""
    if secret is None:
        return
    keys = curve_keys(secret)
    sock.curve_secretkey = keys.server_secret
    sock.curve_publickey = keys.server_public
    sock.curve_server = True


def secure_client(sock: zmq.Socket, secret: str | None) -> None:
    """Make a connecting socket a CURVE client of the job's servers (before ``connect``). No-op without one."""
    if secret is None:
        return
    keys = curve_keys(secret)
    sock.curve_secretkey = keys.client_secret
    sock.curve_publickey = keys.client_public
    sock.curve_serverkey = keys.server_public


class _JobMembers:
    """ZAP credentials provider: admit exactly the client key derived from the job secret."""

    def __init__(self, client_public: bytes) -> None:
        self.client_public = client_public

    def callback(self, domain: str, key: bytes) -> bool:
        ok = key == self.client_public
        if not ok:
            log.warning("refused a CURVE client whose key is not the job's (wrong SNAPSHOTD_SECRET?)")
        return ok


def start_authenticator(ctx: zmq.Context, secret: str | None) -> zmq.auth.asyncio.AsyncioAuthenticator | None:
    """Start the context's ZAP handler (on the running loop) that checks CURVE clients. None without a secret.

    The caller stops it with ``.stop()`` at shutdown.
    """
    if secret is None:
        return None
    auth = zmq.auth.asyncio.AsyncioAuthenticator(ctx, log=logging.getLogger("snapshotd.zap"))
    auth.start()
    auth.configure_curve_callback("*", credentials_provider=_JobMembers(curve_keys(secret).client_public))
    return auth


def check_bind(endpoint: str, secret: str | None, insecure: bool) -> None:
    """Refuse a routable TCP bind without a secret unless ``insecure``; warn on loopback without one.

    Raises:
        ValueError: a routable bind with no secret and no ``--insecure``.
    """
    if secret is not None or not endpoint.startswith("tcp://"):
        return
    host = urlsplit(endpoint).hostname or ""
    loopback = host in ("localhost",) or _is_loopback(host)
    if loopback:
        log.warning("no SNAPSHOTD_SECRET: %s is unauthenticated (loopback only)", endpoint)
        return
    if not insecure:
        raise ValueError(
            f"refusing to bind {endpoint} without SNAPSHOTD_SECRET: anyone who can reach it could read or "
            "overwrite model state. Set SNAPSHOTD_SECRET on every member of the job, or pass --insecure."
        )
    log.warning("--insecure: %s accepts anyone who can reach it", endpoint)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


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


_HANDSHAKE_EVENTS = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)


class HandshakeWatch:
    """Follow the handshakes of a connecting socket, so that a peer refusing us is named instead of timing out.

    ZeroMQ hides a failed handshake: messages just wait. This reads the socket's monitor and keeps
    :attr:`failure`, a sentence saying why handshakes fail (None once one succeeds), for the owner to put in its
    timeout errors; each new reason is logged once. A failure ZeroMQ gives no detail for never replaces a named
    one seen since the last success: with a security mismatch the two alternate as ZeroMQ reconnects, depending
    on which side notices first. A refusal by the peer's member check (ZAP status
    400), after which ZeroMQ would never connect again, is retried every ``retry_s``: the peer may simply not
    have heard of this node yet (ZeroMQ retries a temporary failure, status 300, by itself). :meth:`run` is the
    watching task (start it beside the socket's reader); :meth:`close` before closing the socket.

    Args:
        sock: a connecting socket, before or after ``connect``.
        endpoint: what it connects to, exactly as passed to ``connect``.
        peer: how to name the peer in messages.
    """

    def __init__(self, sock: zmq.asyncio.Socket, endpoint: str, peer: str, *, retry_s: float = 1.0) -> None:
        self.sock = sock
        self.endpoint = endpoint
        self.peer = peer
        self.retry_s = retry_s
        self.failure: str | None = None
        self._monitor: zmq.asyncio.Socket | None = sock.get_monitor_socket(_HANDSHAKE_EVENTS)
        self._logged: set[str] = set()

    async def run(self) -> None:
        """Read handshake events until cancelled (or :meth:`close`)."""
        while self._monitor is not None:
            event = parse_monitor_message(await self._monitor.recv_multipart())
            if self.note(
                event["event"], event["value"]
            ):  # ZeroMQ gives up on this connection: ask again later
                await asyncio.sleep(self.retry_s)
                self.sock.disconnect(self.endpoint)
                self.sock.connect(self.endpoint)

    def note(self, kind: int, value: int) -> bool:
        """Record one handshake event (a monitor event and its value); True when the peer's member check refused
        this node, after which ZeroMQ never connects again by itself."""
        if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.failure = None
            return False
        reason, named = self._explain(kind, value)
        if named or self.failure is None:
            self.failure = reason
        if reason not in self._logged:
            self._logged.add(reason)
            log.warning("%s", reason)
        return kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH and value == 400

    def _explain(self, kind: int, value: int) -> tuple[str, bool]:
        """Why a handshake failed, and whether ZeroMQ said (False: a guess)."""
        if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH and value == 300:
            return (
                f"{self.peer} cannot check this node's membership now (its coordinator does not answer)",
                True,
            )
        if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            return (
                f"{self.peer} refused this node (status {value}): it does not know this host as a member of the "
                "job (--data-security members; check --advertise) or this node's key is not the job's"
            ), True
        if (
            kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH
        ):
            return (
                f"security mismatch with {self.peer}: one side uses CURVE and the other does not (is "
                "SNAPSHOTD_SECRET set on both, with the same --data-security?)"
            ), True
        return (
            f"handshake with {self.peer} failed, with no detail from ZeroMQ: SNAPSHOTD_SECRET differs between the "
            "two sides, or one side uses CURVE and the other does not (--data-security)?"
        ), False

    def close(self) -> None:
        if self._monitor is not None:
            with contextlib.suppress(zmq.ZMQError):
                self.sock.disable_monitor()
            self._monitor.close(linger=0)
            self._monitor = None
