"""``snapshotd-bench``: one console script, one subcommand per benchmark.

Subcommand ``NAME`` lives in module ``snapshotd.bench.NAME``, imported only when chosen. The module defines
``add_arguments(parser)`` and ``run(args) -> Report``, and optionally ``plot(report, path)`` (the default
plot of :mod:`snapshotd.bench.report` is used otherwise). Every subcommand also takes ``--json PATH``,
``--plot PATH`` (``.png``, ``.svg`` or ``.pdf``) and ``-v/--verbose``. The one-line help of each subcommand is kept here so that ``--help``
needs no imports.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from types import ModuleType

from snapshotd.harness.cluster import sigterm_as_interrupt

from .report import Report, emit, plot_format

__all__ = ["SUBCOMMANDS", "main"]

log = logging.getLogger(__name__)

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "codec": ("snapshotd.bench.codec", "speed and ratio of each chunk codec on real training state"),
    "transport": ("snapshotd.bench.transport", "sidecar-to-sidecar streaming rate against a raw TCP socket"),
    "overhead": ("snapshotd.bench.overhead", "training step time with snapshots every step against none"),
    "recovery": ("snapshotd.bench.recovery", "time from a failure to a restored rank (local and pull path)"),
    "goodput": ("snapshotd.bench.goodput", "useful training time under failures, against disk checkpoints"),
    "scale": ("snapshotd.bench.scale", "one coordinator against thousands of simulated sidecars"),
    "torchrun": (
        "snapshotd.bench.torchrun_trial",
        "a real torchrun job losing a node: the recovery time, phase by phase",
    ),
    "live": ("snapshotd.bench.live", "live recovery (survivors keep their processes) against a full restart"),
    "fuzz": (
        "snapshotd.bench.fuzz",
        "random and mutated messages at every live socket; the daemons must live on",
    ),
    "soak": (
        "snapshotd.bench.soak",
        "trials of a training job meeting random faults, each checked bit-identical",
    ),
}
"""Subcommand name -> (module, one-line help)."""


def _common_flags() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    group = common.add_argument_group("output")
    group.add_argument("--json", metavar="PATH", help="also write the report as JSON to PATH")
    group.add_argument(
        "--plot", metavar="PATH", help="also draw the report to PATH (.png, .svg or .pdf: the suffix chooses)"
    )
    group.add_argument("-v", "--verbose", action="count", default=0, help="log more (-v info, -vv debug)")
    return common


def _chosen(argv: list[str]) -> str | None:
    """The subcommand named in ``argv`` (its first positional word), or None."""
    return next((a for a in argv if not a.startswith("-")), None)


def _load(name: str) -> ModuleType | None:
    """Import subcommand ``name``'s module; None when that module does not exist yet.

    Raises:
        ImportError: when the module exists but something it imports is missing.
    """
    modname = SUBCOMMANDS[name][0]
    try:
        return importlib.import_module(modname)
    except ModuleNotFoundError as exc:
        if exc.name == modname:
            return None
        raise


def main(argv: list[str] | None = None) -> int:
    """Run ``snapshotd-bench`` with ``argv`` (``sys.argv[1:]`` when None) and return the exit status.

    Returns 0 on success (and for ``--help``), 1 when a run that checks found a check failed, 2 for a usage
    error or a subcommand that is not built yet, 130 when interrupted (Ctrl-C, or SIGTERM: the benchmark's
    processes are stopped either way).
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(
        prog="snapshotd-bench",
        description="Benchmarks of snapshotd, each printing a table and a summary.",
        epilog="benchmarks (snapshotd-bench BENCH --help for its flags):\n"
        + "\n".join(f"  {name:<10} {help_}" for name, (_, help_) in SUBCOMMANDS.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="bench", metavar="BENCH", help="one of the benchmarks below")
    sub.required = True
    common = _common_flags()
    subparsers = {
        name: sub.add_parser(name, description=help_, parents=[common])
        for name, (_, help_) in SUBCOMMANDS.items()
    }
    name = _chosen(argv)
    module = None
    if name in SUBCOMMANDS:
        module = _load(name)
        if module is None:
            print(f"snapshotd-bench {name}: not built yet", file=sys.stderr)
            return 2
        module.add_arguments(subparsers[name])
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, or a usage error argparse already printed
        return exc.code if isinstance(exc.code, int) else 2
    assert module is not None  # parse_args succeeded, so argv named a known subcommand
    if args.plot:
        try:
            plot_format(args.plot)  # before the run: a benchmark takes minutes
        except ValueError as exc:
            print(f"snapshotd-bench {args.bench}: {exc}", file=sys.stderr)
            return 2
    if args.verbose:
        logging.basicConfig(
            level=logging.DEBUG if args.verbose > 1 else logging.INFO,
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        )
    try:
        with sigterm_as_interrupt():
            report = module.run(args)
    except KeyboardInterrupt:
        print(f"snapshotd-bench {args.bench}: interrupted", file=sys.stderr)
        return 130
    if not isinstance(report, Report):
        raise TypeError(f"{module.__name__}.run() returned {type(report).__name__}, not a Report")
    emit(report, json_path=args.json, plot_path=args.plot, plot_fn=getattr(module, "plot", None))
    if report.passed is False:
        print(f"snapshotd-bench {args.bench}: FAILED (see the summary)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
