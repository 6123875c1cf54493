"""The output every ``snapshotd-bench`` subcommand shares: a table, a summary, JSON and a PNG.

A subcommand's ``run(args)`` returns a :class:`Report`; :func:`emit` prints it for people, writes it as JSON
for machines (``{"bench", "machine", "config", "results", "summary"}``) and draws it. Column and summary names
carry their unit in a suffix, which both the table and the default plot read:

``_bytes`` (sizes), ``_Bps`` (bytes per second), ``_seconds`` / ``_s`` (seconds), ``_ms`` (milliseconds).
``_per_s`` (``heartbeats_per_s``) is a plain rate, a count per second, never a duration.

:func:`progress` is the progress display of long runs (rich's, see :mod:`snapshotd.terminal`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import platform
import socket
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TextIO

from rich.box import Box
from rich.table import Table

from snapshotd.terminal import console, is_terminal, progress, to_text
from snapshotd.units import format_bytes, format_rate, format_seconds

__all__ = ["Report", "emit", "machine_info", "progress"]

log = logging.getLogger(__name__)

_MAX_PLOT_PANELS = 6


def machine_info() -> dict[str, Any]:
    """Where a result was measured: host, CPU, memory, Python, torch, CUDA device, kernel.

    Imports torch lazily (only here); ``torch`` and ``cuda_device`` are None when torch is missing or no CUDA
    device is visible.
    """
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        memory = None
    torch_version = cuda_device = None
    try:
        import torch
    except ImportError:
        pass
    else:
        torch_version = torch.__version__
        if torch.cuda.is_available():
            cuda_device = torch.cuda.get_device_name(0)
    return {
        "hostname": socket.gethostname(),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_bytes": memory,
        "python": platform.python_version(),
        "torch": torch_version,
        "cuda_device": cuda_device,
        "kernel": platform.release(),
    }


@dataclasses.dataclass(slots=True)
class Report:
    """One benchmark's outcome.

    Attributes:
        bench: subcommand name (``"transport"``).
        config: the parameters the run used (plain JSON-able values).
        results: one dict per measured configuration; keys are table columns.
        summary: headline numbers (``{"speedup": 1.9, "best_Bps": 1.1e9}``).
        columns: table column order; None means the union of the rows' keys in first-seen order.
        machine: where it ran; :func:`machine_info` by default.
        passed: for a run that checks as well as measures (the live fuzz), whether every check held; False
            makes ``snapshotd-bench`` exit 1. None for a run that only measures.
    """

    bench: str
    config: dict[str, Any]
    results: list[dict[str, Any]]
    summary: dict[str, Any]
    columns: list[str] | None = None
    machine: dict[str, Any] = dataclasses.field(default_factory=machine_info)
    passed: bool | None = None

    def table_columns(self) -> list[str]:
        """``columns``, or every key of ``results`` in first-seen order."""
        if self.columns is not None:
            return list(self.columns)
        return list(dict.fromkeys(key for row in self.results for key in row))


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def format_value(name: str, value: Any) -> str:
    """``value`` for a person, in the unit that ``name``'s suffix says (see the module docstring)."""
    if value is None:
        return "-"
    if not _is_number(value):
        return str(value)
    if not math.isfinite(value):
        return str(value)
    if name.endswith("_bytes"):
        return format_bytes(value)
    if name.endswith("_Bps"):
        return format_rate(value)
    if name.endswith("_per_s"):
        return f"{value:.1f}" if isinstance(value, float) else str(value)
    if name.endswith(("_seconds", "_s")):
        return format_seconds(value)
    if name.endswith("_ms"):
        return format_seconds(value / 1e3)
    return str(value) if isinstance(value, int) else f"{value:.4g}"


_RULED = Box("    \n    \n -  \n    \n    \n    \n    \n    \n", ascii=True)
"""No frame: only a line of dashes under the header, one run per column."""


def results_table(report: Report) -> Table | None:
    """``report.results`` as a rich table, values in their units (numeric columns right-aligned), or None when
    there are no rows."""
    columns = report.table_columns()
    if not report.results or not columns:
        return None
    table = Table(box=_RULED, show_edge=False, pad_edge=False, header_style="bold")
    for c in columns:
        numeric = all(_is_number(row.get(c)) or row.get(c) is None for row in report.results)
        table.add_column(c, justify="right" if numeric else "left", no_wrap=True)
    for row in report.results:
        table.add_row(*(format_value(c, row[c]) if c in row else "" for c in columns))
    return table


def format_table(report: Report) -> str:
    """``report.results`` as an aligned plain-text table (empty string when there are no rows)."""
    table = results_table(report)
    return "" if table is None else to_text(table)


def _jsonable(value: Any) -> Any:
    """Plain JSON values: non-finite floats become None, numpy scalars and arrays become Python values."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, str | int | bool):
        return value
    if hasattr(value, "tolist"):  # numpy scalar or array, torch tensor
        return _jsonable(value.tolist())
    return str(value)


def write_json(report: Report, path: str) -> None:
    """Write the report atomically (temp file in the same folder, fsync, rename)."""
    doc = {
        "bench": report.bench,
        "machine": report.machine,
        "config": report.config,
        "results": report.results,
        "summary": report.summary,
    }
    text = json.dumps(_jsonable(doc), indent=2, allow_nan=False) + "\n"
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".report-", suffix=".json.tmp", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _axis(name: str, values: Sequence[float]) -> tuple[float, str]:
    """(scale, label) that put ``values`` of column ``name`` in a readable unit on an axis."""
    top = max((abs(v) for v in values), default=0.0)
    if name.endswith("_bytes"):
        return (1 / (1 << 30), f"{name} (GiB)") if top >= 1 << 30 else (1 / (1 << 20), f"{name} (MiB)")
    if name.endswith("_Bps"):
        return (1e-9, f"{name} (GB/s)") if top >= 1e9 else (1e-6, f"{name} (MB/s)")
    if name.endswith("_per_s"):
        return 1.0, f"{name} (/s)"
    if name.endswith(("_seconds", "_s")):
        return (1e3, f"{name} (ms)") if top < 1 else (1.0, f"{name} (s)")
    if name.endswith("_ms"):
        return 1.0, f"{name} (ms)"
    return 1.0, name


def _plot_results(fig: Any, rows: list[dict[str, Any]], xcol: str, ycols: list[str]) -> None:
    """One panel per column of ``ycols`` against ``xcol``: lines for a numeric x, bars for labels."""
    numeric_x = all(_is_number(r[xcol]) for r in rows)
    if numeric_x:
        xscale, xlabel = _axis(xcol, [float(r[xcol]) for r in rows])
        xs: list[Any] = [r[xcol] * xscale for r in rows]
    else:
        xlabel, xs = xcol, [str(r[xcol]) for r in rows]
    axes = fig.subplots(len(ycols), 1, squeeze=False, sharex=True)[:, 0]
    for ax, col in zip(axes, ycols, strict=True):
        ys = [float(r[col]) if _is_number(r.get(col)) else math.nan for r in rows]
        scale, label = _axis(col, [y for y in ys if math.isfinite(y)])
        ys = [y * scale for y in ys]
        if numeric_x:
            ax.plot(xs, ys, marker="o")
        else:
            ax.bar(range(len(xs)), ys)
            ax.set_xticks(range(len(xs)), xs, rotation=30, ha="right")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    axes[-1].set_xlabel(xlabel)


def _plot_summary(fig: Any, summary: dict[str, float]) -> None:
    """One horizontal bar per summary value, each on its own axis in its own unit, labelled with its value."""
    axes = fig.subplots(len(summary), 1, squeeze=False)[:, 0]
    for ax, (key, value) in zip(axes, summary.items(), strict=True):
        scale, label = _axis(key, [value])
        ax.barh([0], [value * scale], height=0.6)
        ax.set_yticks([0], [key])
        ax.set_xlabel(label)
        ax.set_xlim(min(0.0, value * scale * 1.25), max(0.0, value * scale * 1.25) or 1.0)
        ax.text(value * scale, 0, f" {format_value(key, value)}", va="center")
        ax.grid(True, axis="x", alpha=0.3)


PLOT_FORMATS = ("png", "svg", "pdf")
"""The picture formats ``--plot`` writes, chosen by the file name's suffix."""


def plot_format(path: str) -> str:
    """The format of a picture written to ``path``, from its suffix.

    Raises:
        ValueError: a suffix that names none of :data:`PLOT_FORMATS`.
    """
    suffix = os.path.splitext(path)[1].lstrip(".").lower()
    if suffix not in PLOT_FORMATS:
        raise ValueError(f"--plot {path}: name a .png, .svg or .pdf file (the suffix chooses the format)")
    return suffix


def save_figure(fig: Any, path: str) -> None:
    """Write ``fig`` to ``path`` in the format its suffix names (:func:`plot_format`)."""
    fig.savefig(path, format=plot_format(path))


def phases_plot(
    report: Report, path: str, phases: Sequence[str], label: Callable[[dict[str, Any]], str]
) -> None:
    """One stacked horizontal bar per result row: the row's ``phases`` (seconds) in turn, its total written at the
    end (the sum of the phases; a row missing one is drawn without it), labelled ``label(row)``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = [r for r in report.results if any(_is_number(r.get(p)) for p in phases)]
    fig = Figure(figsize=(8.0, 1.2 + 0.45 * max(1, len(rows))), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    starts = [0.0] * len(rows)
    for phase in phases:
        widths = [
            float(r[phase]) if _is_number(r.get(phase)) and math.isfinite(r[phase]) else 0.0 for r in rows
        ]
        ax.barh(range(len(rows)), widths, left=starts, label=phase.removesuffix("_seconds").replace("_", " "))
        starts = [a + b for a, b in zip(starts, widths, strict=True)]
    for i, total in enumerate(starts):
        ax.text(total, i, f" {total:.2f} s", va="center", fontsize="small")
    ax.set_yticks(range(len(rows)), [label(r) for r in rows])
    ax.invert_yaxis()
    ax.set_xlim(0, max(starts, default=1.0) * 1.15 or 1.0)
    ax.set_xlabel("seconds from the node's loss")
    ax.grid(True, axis="x", alpha=0.3)
    ax.legend(fontsize="small", loc="lower right")
    ax.set_title(f"snapshotd-bench {report.bench}: recovery phases")
    fig.tight_layout()
    save_figure(fig, path)


def default_plot(report: Report, path: str) -> None:
    """Draw ``report`` to ``path`` (a PNG, SVG or PDF by its suffix) with matplotlib's Agg canvas (no display, no
    pyplot state).

    With at least one numeric result column besides the first column, draws one panel per numeric column
    (up to six) against the first column; otherwise one bar per numeric summary value (up to twelve);
    otherwise a figure that says there is nothing numeric to draw.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    columns = report.table_columns()
    xcol = columns[0] if columns else ""
    rows = [r for r in report.results if xcol in r]
    ycols = [c for c in columns[1:] if any(_is_number(r.get(c)) for r in rows)][:_MAX_PLOT_PANELS]
    summary = {k: float(v) for k, v in report.summary.items() if _is_number(v) and math.isfinite(v)}
    summary = dict(list(summary.items())[: 2 * _MAX_PLOT_PANELS])

    height = 2.6 * len(ycols) if ycols else 1.3 * len(summary)
    fig = Figure(figsize=(7.0, max(3.0, height + 0.8)), dpi=100)
    FigureCanvasAgg(fig)
    fig.suptitle(f"snapshotd-bench {report.bench}")
    if ycols:
        _plot_results(fig, rows, xcol, ycols)
    elif summary:
        _plot_summary(fig, summary)
    else:
        ax = fig.subplots()
        ax.text(0.5, 0.5, "no numeric results", ha="center", va="center")
        ax.set_xlabel("-")
        ax.set_ylabel("-")
    fig.tight_layout()
    save_figure(fig, path)


def emit(
    report: Report,
    *,
    json_path: str | None,
    plot_path: str | None,
    plot_fn: Callable[[Report, str], None] | None = None,
    out: TextIO | None = None,
) -> None:
    """Print ``report`` (table, then ``key: value`` summary lines); optionally write JSON and a picture.

    Args:
        report: what to show.
        json_path: where to write the JSON document (atomically), or None.
        plot_path: where to write a picture (PNG, SVG or PDF, by its suffix), or None.
        plot_fn: draws it (``plot_fn(report, plot_path)``); :func:`default_plot` when None.
        out: text stream for the printout; ``sys.stdout`` when None.

    Raises:
        OSError: when a file cannot be written.
    """
    out = out if out is not None else sys.stdout
    print(f"== snapshotd-bench {report.bench} ==", file=out, flush=True)
    table = results_table(report)
    if table is not None and is_terminal(out):
        console(out).print(table)
    elif table is not None:
        print(to_text(table), file=out)
    if report.summary:
        print(file=out)
        for key, value in report.summary.items():
            print(f"{key}: {format_value(key, value)}", file=out)
    if json_path:
        write_json(report, json_path)
        log.info("wrote %s", json_path)
    if plot_path:
        (plot_fn or default_plot)(report, plot_path)
        log.info("wrote %s", plot_path)


@contextlib.contextmanager
def scratch_dir(path: str | None, *, prefix: str) -> Iterator[str]:
    """``path`` (created if needed, kept afterwards), or a temporary folder removed at the end."""
    if path:
        os.makedirs(path, exist_ok=True)
        yield path
    else:
        with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
            yield tmp
