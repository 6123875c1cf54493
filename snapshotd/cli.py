"""The ``snapshotd`` command: ``coordinator``, ``serve``, ``status``, ``export``, ``rdzv-store`` and ``demo``.

The CLI only maps flags onto the config dataclasses that own validation; a bad value is one clear line on stderr
and exit code 2. Every flag of every subcommand may also come from the environment, as ``SNAPSHOTD_<FLAG>``
(:mod:`snapshotd.flags`); a flag given on the command line wins, and ``--help`` names each variable.
"""

from __future__ import annotations

import argparse
import sys

from snapshotd import __version__
from snapshotd.flags import endpoint, from_environment, read_secret
from snapshotd.logs import LOG_FORMATS, setup_logging
from snapshotd.rdzv_store import DEFAULT_STORE_BIND
from snapshotd.security import DATA_SECURITY_MODES
from snapshotd.units import parse_bytes, parse_duration, parse_fraction, parse_rate

__all__ = ["main"]

DEFAULT_COORDINATOR = "tcp://127.0.0.1:7070"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="snapshotd", description="In-memory, every-step snapshots for PyTorch training."
    )
    p.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    p.add_argument("--version", action="version", version=f"snapshotd {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("coordinator", help="run the job's recovery coordinator")
    c.add_argument(
        "--bind",
        type=endpoint,
        default=DEFAULT_COORDINATOR,
        help="control-plane endpoint: tcp://HOST:PORT, HOST:PORT or a port (default %(default)s)",
    )
    c.add_argument("--replicas", type=int, default=1, help="buddy copies per rank (default %(default)s)")
    c.add_argument(
        "--heartbeat-timeout", default="3s", help="silence after which a node is dead (default %(default)s)"
    )
    c.add_argument(
        "--heartbeat-interval", default="0.5s", help="sidecar heartbeat period (default %(default)s)"
    )
    c.add_argument("--insecure", action="store_true", help="allow a routable bind without SNAPSHOTD_SECRET")
    c.add_argument(
        "--metrics-bind",
        default=None,
        metavar="HOST:PORT",
        help="serve Prometheus metrics at http://HOST:PORT/metrics (default: none)",
    )
    c.add_argument(
        "--log-format",
        default="text",
        choices=LOG_FORMATS,
        help="text lines, or one JSON object per line (default %(default)s)",
    )

    s = sub.add_parser("serve", help="run this node's sidecar")
    s.add_argument(
        "--coordinator",
        default=DEFAULT_COORDINATOR,
        type=endpoint,
        help="the coordinator (default %(default)s)",
    )
    s.add_argument("--node", default=None, help="node name (default: the host name)")
    s.add_argument("--rack", default="", help="failure-domain label; buddies are never in the same rack")
    s.add_argument("--ipc", default=None, help="ipc socket path for local ranks (default: per-user path)")
    s.add_argument(
        "--data-bind",
        type=endpoint,
        default="tcp://127.0.0.1:0",
        help="data-plane endpoint (default %(default)s)",
    )
    s.add_argument("--advertise", default=None, help="host name peers use to reach --data-bind")
    s.add_argument(
        "--memory-limit", default="64GiB", help="host memory for buddy copies (default %(default)s)"
    )
    s.add_argument("--max-rate", default="auto", help="outgoing snapshot rate, e.g. 10Gbit, or auto")
    s.add_argument(
        "--step-budget",
        default="1%",
        help="with --max-rate auto: the step-time slowdown snapshots may cost, e.g. 1%% or 0.01 (default 1%%)",
    )
    s.add_argument("--chunk", default="4MiB", help="data-plane chunk size (default %(default)s)")
    s.add_argument("--codec", default="auto", choices=("auto", "raw", "delta-lz4"))
    s.add_argument(
        "--nice",
        type=int,
        default=10,
        help="CPU priority increment: snapshots use idle CPU (default %(default)s)",
    )
    s.add_argument("--peer-timeout", default="10s", help="wait for any one peer reply (default %(default)s)")
    s.add_argument(
        "--drain-timeout",
        default="20s",
        help="on SIGTERM, serve on at most this long while what only this node holds is copied "
        "elsewhere; 0 stops at once (default %(default)s)",
    )
    s.add_argument(
        "--data-security",
        default="curve",
        choices=DATA_SECURITY_MODES,
        help="with a secret: curve encrypts the data plane; members leaves it plaintext and admits only "
        "the hosts of the job's members (default %(default)s)",
    )
    s.add_argument("--insecure", action="store_true", help="allow a routable bind without SNAPSHOTD_SECRET")
    s.add_argument(
        "--bulk-port",
        default="0",
        metavar="PORT|off",
        help="TCP port on the data bind's host where restoring ranks fetch copies held here directly, on "
        "a plaintext data plane only; 0 picks a free one, off restores through the sidecars "
        "(default %(default)s)",
    )
    s.add_argument(
        "--push-connections",
        type=int,
        default=4,
        metavar="N",
        help="connections that carry one stream to a buddy's bulk port (plaintext data plane, raw chunks); "
        "0 streams over the data plane's messages (default %(default)s)",
    )
    s.add_argument(
        "--metrics-bind",
        default=None,
        metavar="HOST:PORT",
        help="serve Prometheus metrics at http://HOST:PORT/metrics (default: none)",
    )
    s.add_argument(
        "--log-format",
        default="text",
        choices=LOG_FORMATS,
        help="text lines, or one JSON object per line (default %(default)s)",
    )

    st = sub.add_parser("status", help="show nodes, ranks, recoverable step and lag")
    st.add_argument(
        "--coordinator",
        default=DEFAULT_COORDINATOR,
        type=endpoint,
        help="the coordinator (default %(default)s)",
    )
    st.add_argument("--watch", action="store_true", help="refresh every second")
    st.add_argument("--json", action="store_true", help="print the raw status document as JSON")

    e = sub.add_parser("export", help="write a complete step from the sidecars' memory as a DCP checkpoint")
    e.add_argument(
        "--coordinator",
        default=DEFAULT_COORDINATOR,
        type=endpoint,
        help="the coordinator (default %(default)s)",
    )
    e.add_argument("--job", required=True, help="the job to export")
    e.add_argument(
        "--step",
        type=int,
        default=None,
        help="the step (default: the newest durable step D, else the recoverable step G)",
    )
    e.add_argument("--out", required=True, help="the checkpoint directory (must not exist, or be empty)")
    e.add_argument("--timeout", default="10s", help="wait for any one reply (default %(default)s)")

    r = sub.add_parser(
        "rdzv-store", help="run the rendezvous store (torchrun's c10d, live mode) off the training nodes"
    )
    r.add_argument(
        "--bind",
        type=endpoint,
        default=DEFAULT_STORE_BIND,
        help="tcp://HOST:PORT, HOST:PORT or a port; port 0 picks a free one (default %(default)s)",
    )
    r.add_argument(
        "--insecure",
        action="store_true",
        help="allow a routable bind: the store authenticates nobody (the job's private network only)",
    )

    d = sub.add_parser(
        "demo", help="the whole story on one machine: train, lose a node, recover bit-identically"
    )
    d.add_argument("--steps", type=int, default=24, help="training steps (default %(default)s)")
    d.add_argument(
        "--kill-at", type=int, default=12, help="step after which node B dies (default %(default)s)"
    )
    d.add_argument("--params", default="2M", help="model size in parameters (default %(default)s)")
    for command in (c, s, st, e, r, d):
        _verbose_here(command)
    for command in (c, s, st, e):
        command.add_argument(
            "--secret-file",
            default=None,
            help="read the job's secret from this file (instead of $SNAPSHOTD_SECRET, which it overrides)",
        )
    for command in (c, s, st, e, r, d):
        from_environment(command)
    return p


def _verbose_here(parser: argparse.ArgumentParser) -> None:
    """Let ``-v`` follow the subcommand too (``snapshotd serve -v``), adding to one before it."""
    parser.add_argument(
        "-v", "--verbose", dest="verbose_here", action="count", default=0, help="more logging (-vv for debug)"
    )


def main(argv: list[str] | None = None) -> int:
    try:
        parser = _parser()
    except ValueError as exc:  # an environment variable no flag takes
        print(f"snapshotd: {exc}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    args.verbose += getattr(args, "verbose_here", 0)
    setup_logging(args.verbose, getattr(args, "log_format", "text"))
    try:
        secret = read_secret(getattr(args, "secret_file", None))
        if args.command == "coordinator":
            return _coordinator(args, secret)
        if args.command == "serve":
            return _serve(args, secret)
        if args.command == "status":
            from snapshotd.status import status_main

            return status_main(args.coordinator, watch=args.watch, as_json=args.json, secret=secret)
        if args.command == "export":
            return _export(args, secret)
        if args.command == "rdzv-store":
            from snapshotd.rdzv_store import serve_store

            return serve_store(
                args.bind, args.insecure, lambda at: print(f"rendezvous store ready {at}", flush=True)
            )
        if args.command == "demo":
            from snapshotd.harness.cluster import sigterm_as_interrupt
            from snapshotd.harness.demo import run_demo

            with sigterm_as_interrupt():
                return run_demo(steps=args.steps, kill_at=args.kill_at, params=int(parse_bytes(args.params)))
    except ValueError as exc:
        print(f"snapshotd {args.command}: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a port in use, an address this host does not have: one line, not a traceback
        print(f"snapshotd {args.command}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 2


def _coordinator(args: argparse.Namespace, secret: str | None) -> int:
    import uvloop

    from snapshotd.coordinator.config import CoordinatorConfig
    from snapshotd.coordinator.server import run_coordinator

    cfg = CoordinatorConfig(
        bind=args.bind,
        replicas=args.replicas,
        heartbeat_interval=parse_duration(args.heartbeat_interval),
        heartbeat_timeout=parse_duration(args.heartbeat_timeout),
        secret=secret,
        insecure=args.insecure,
        metrics_bind=args.metrics_bind,
    )
    uvloop.run(run_coordinator(cfg, ready=lambda ep: print(f"snapshotd coordinator ready {ep}", flush=True)))
    return 0


def _export(args: argparse.Namespace, secret: str | None) -> int:
    from snapshotd.export import ExportError, export_checkpoint

    timeout = parse_duration(args.timeout)
    try:
        done = export_checkpoint(
            args.coordinator, args.job, args.out, step=args.step, secret=secret, timeout=timeout
        )
    except ExportError as exc:
        print(f"snapshotd export: {exc}", file=sys.stderr)
        return 1
    print(
        f"snapshotd export: job {done.job} step {done.step} ({done.world_size} ranks; pulled ranks "
        f"{done.pulled}, {done.pulled_bytes} bytes) -> {done.out}",
        flush=True,
    )
    return 0


def _bulk_port(text: str) -> int | None:
    """``--bulk-port``: a port number, or None for ``off``."""
    if text == "off":
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"--bulk-port must be a port number or off, got {text!r}") from None


def _serve(args: argparse.Namespace, secret: str | None) -> int:
    import uvloop

    from snapshotd.sidecar.config import SidecarConfig
    from snapshotd.sidecar.daemon import run_sidecar
    from snapshotd.sidecar.tasks import ServiceDied

    extra = {}
    if args.node:
        extra["node"] = args.node
    if args.ipc:
        extra["ipc"] = args.ipc
    cfg = SidecarConfig(
        coordinator=args.coordinator,
        rack=args.rack,
        data_bind=args.data_bind,
        advertise=args.advertise,
        memory_limit=parse_bytes(args.memory_limit),
        max_rate=None if args.max_rate == "auto" else parse_rate(args.max_rate),
        step_budget=parse_fraction(args.step_budget),
        chunk_bytes=parse_bytes(args.chunk),
        codec=args.codec,
        nice=args.nice,
        request_timeout=parse_duration(args.peer_timeout),
        drain_timeout=parse_duration(args.drain_timeout),
        secret=secret,
        data_security=args.data_security,
        insecure=args.insecure,
        bulk_port=_bulk_port(args.bulk_port),
        push_connections=args.push_connections,
        metrics_bind=args.metrics_bind,
        **extra,
    )

    setup_logging(args.verbose, args.log_format, cfg.node)

    def ready(data_addr: str, ipc: str) -> None:
        print(f"snapshotd serve ready node={cfg.node} data={data_addr} ipc={ipc}", flush=True)

    try:
        uvloop.run(run_sidecar(cfg, ready=ready))
    except ServiceDied as exc:
        print(f"snapshotd serve: {exc}; the sidecar stopped", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
