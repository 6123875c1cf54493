"""``snapshotd status``: ask a coordinator for its view and print it as tables or JSON."""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import msgpack
from rich.console import RenderableType
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from snapshotd.proto import Error, StatusReply, StatusRequest, decode, encode
from snapshotd.terminal import console, is_terminal, to_text
from snapshotd.transport import connect_blocking
from snapshotd.units import format_bytes, format_rate, format_seconds

__all__ = ["fetch_status", "render_status", "status_main", "status_renderables"]

_RANK_ROWS = 32  # a job with more ranks shows its worst ones (fewest copies, then largest RPO)


def fetch_status(coordinator: str, *, secret: str | None, timeout: float = 5.0) -> dict:
    """Ask the coordinator at ``coordinator`` for its status document (see ``CoordinatorState.status``).

    One blocking client pipe (a CURVE client when ``secret`` is set), closed before returning.

    Raises:
        TimeoutError: no answer within ``timeout`` seconds: the coordinator is down or unreachable, or the
            secret is wrong (a failed CURVE handshake is silent by design).
        ValueError: ``coordinator`` is not a valid endpoint, or the answer is not a status document.
        RuntimeError: the coordinator answered with an error.
    """
    try:
        pipe = connect_blocking(coordinator, secret=secret)
    except ValueError as exc:
        raise ValueError(f"cannot reach coordinator at {coordinator!r}: {exc}") from exc
    try:
        if not pipe.send_nowait(encode(StatusRequest())) or not pipe.wait(timeout):
            raise TimeoutError(f"no answer from coordinator at {coordinator} within {timeout:g} s")
        frames = pipe.recv_nowait(copy=True)
    finally:
        pipe.close()
    if frames is None:
        raise TimeoutError(f"no answer from coordinator at {coordinator} within {timeout:g} s")
    msg = decode(frames)
    if isinstance(msg, Error):
        raise RuntimeError(f"coordinator at {coordinator} refused: {msg.code}: {msg.message}")
    if not isinstance(msg, StatusReply):
        raise ValueError(f"coordinator at {coordinator} answered {msg.TYPE!r}, not a status reply")
    try:
        doc = msgpack.unpackb(msg.body, raw=False)
    except Exception as exc:  # msgpack raises several types for bad input
        raise ValueError(f"coordinator at {coordinator} sent an unreadable status document: {exc}") from exc
    if not isinstance(doc, dict):
        raise ValueError(f"coordinator at {coordinator} sent a status document that is not a map")
    return doc


def status_main(
    coordinator: str, *, watch: bool, as_json: bool, secret: str | None, timeout: float = 5.0
) -> int:
    """Print the status once, or every second with ``watch`` until Ctrl-C; ``timeout`` bounds each fetch.

    Returns:
        0 on success (and when a watch is interrupted); 1, with the reason on stderr, when a single fetch fails.
        While watching, a failed fetch is shown in place of the tables and the watch goes on.
    """
    tty = not as_json and is_terminal(sys.stdout)
    out = console(sys.stdout) if tty else None
    try:
        while True:
            shown: list[RenderableType]
            try:
                doc = fetch_status(coordinator, secret=secret, timeout=timeout)
            except (TimeoutError, ValueError, RuntimeError) as exc:
                if not watch:
                    print(f"snapshotd status: {exc}", file=sys.stderr)
                    return 1
                shown = [Text(f"snapshotd status: {exc}")]
            else:
                shown = status_renderables(doc) if tty else []
                text = (
                    ""
                    if tty
                    else json.dumps(doc, indent=None if watch else 2)
                    if as_json
                    else render_status(doc)
                )
            if out is not None:  # a terminal: in colour, cleared between refreshes
                if watch:
                    out.clear()
                out.print(*shown)
            else:
                print(text if not shown else to_text(*shown), flush=True)
            if not watch:
                return 0
            time.sleep(1.0)
    except KeyboardInterrupt:
        return 0


def render_status(doc: dict[str, Any]) -> str:
    """The status document as plain-text tables: the coordinator, its nodes, and each job with G and RPO."""
    return to_text(*status_renderables(doc))


def _table(*headers: str) -> Table:
    """A frameless table: a header row, then the rows, columns two spaces apart."""
    table = Table(box=None, show_edge=False, pad_edge=False, padding=(0, 2, 0, 0), header_style="bold")
    for h in headers:
        table.add_column(h, no_wrap=True)
    return table


def _pace(node: dict[str, Any]) -> str:
    """The PACE cell: the pacer's limit, and the step slowdown it measures against its budget."""
    rate = node.get("pace_Bps", 0)
    budget = node.get("step_budget", 0.0)
    limit = format_rate(rate) if rate else "unpaced"
    return f"{limit}, steps {node.get('step_slowdown', 0.0):+.1%} of {budget:.1%}" if budget else limit


def status_renderables(doc: dict[str, Any]) -> list[RenderableType]:
    """The status document as rich renderables (DEAD nodes, lagging ranks and missing copies stand out in
    colour on a terminal): what :func:`render_status` prints as plain text."""
    c = doc.get("coordinator", {})
    out: list[RenderableType] = [
        Text(
            f"coordinator: up {format_seconds(c.get('uptime_s', 0))}, version {c.get('version', '?')}, "
            f"replicas {c.get('replicas')}, "
            f"{c.get('heartbeats', 0)} heartbeats, {c.get('bad_messages', 0)} bad messages\n"
        ),
    ]
    nodes = _table("NODE", "RACK", "STATE", "SEEN", "RANKS", "STORED", "OUT", "IN", "PACE", "DATA")
    for n in doc.get("nodes", []):
        dead = sum(1 for _, _, alive in n.get("ranks", []) if not alive)
        ranks = f"{len(n.get('ranks', []))}" + (f" ({dead} dead)" if dead else "")
        if not n.get("alive"):
            state = Text("DEAD", style="bold red")
        else:
            state = Text("leaving", style="yellow") if n.get("leaving") else Text("live")
        nodes.add_row(
            n["node"],
            n.get("rack") or "-",
            state,
            format_seconds(n.get("last_seen_s", 0)) + " ago",
            ranks,
            format_bytes(n.get("stored_bytes", 0)),
            format_rate(n.get("out_Bps", 0.0)),
            format_rate(n.get("in_Bps", 0.0)),
            _pace(n),
            n.get("data_addr", ""),
        )
    out.append(nodes)
    if not nodes.row_count:
        out.append(Text("(no sidecar registered)"))
    broken = doc.get("broken_paths", [])
    if broken:
        text = Text(
            f"\n{len(broken)} broken snapshot path(s): no copy goes across one while another node can take it",
            style="bold yellow",
        )
        for b in broken:
            said = "; ".join(f"{node}: {why}" for node, why in b.get("reported_by", {}).items())
            text.append(f"\n  {' <-> '.join(b.get('nodes', []))}  ({said})", style="none")
        out.append(text)
    replicas = c.get("replicas")
    for j in doc.get("jobs", []):
        g, d = j.get("recoverable", -1), j.get("durable", -1)
        lines = [
            f"\njob {j['job']}: world size {j.get('world_size')}, recoverable step G = {_step(g)}, "
            f"newest durable step = {_step(d)}"
        ]
        if j.get("round"):
            lines.append("  " + _round(j["round"], j.get("world_size")))
        out.append(Text("\n".join(lines)))
        ranks = j.get("ranks", [])
        shown = ranks
        if len(ranks) > _RANK_ROWS:
            shown = sorted(ranks, key=lambda r: (r.get("copies", 0), -(r.get("lag_steps") or 0), r["rank"]))
            shown = sorted(shown[:_RANK_ROWS], key=lambda r: r["rank"])
        table = _table("RANK", "NODE", "NEWEST", "RPO", "COPIES")
        for r in shown:
            copies = r.get("copies", 0)
            few = isinstance(replicas, int) and copies < 1 + replicas
            table.add_row(
                str(r["rank"]),
                r.get("node") or "-",
                _step(r.get("newest_step", -1)),
                _rpo(r),
                Text(str(copies), style="yellow" if few else ""),
            )
        out.append(Padding(table, (0, 0, 0, 2)))
        notes = []
        if len(shown) < len(ranks):
            notes.append(f"  ... {len(ranks) - len(shown)} more ranks (worst shown; --json lists all)")
        missing = j.get("missing", [])
        if missing:
            spans = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in missing[:8])
            more = f" and {len(missing) - 8} more ranges" if len(missing) > 8 else ""
            notes.append(f"  ranks no node reported (no home, no copy): {spans}{more}")
        if notes:
            out.append(Text("\n".join(notes)))
    return out


def _round(rnd: dict[str, Any], world_size: int | None) -> str:
    """One line on a job's last plan round: still asking, or its outcome and how its answers went."""
    if rnd.get("age_s") is None:
        return f"plan round open: {rnd.get('asked')} of {world_size} ranks asked"
    what = f"ready at step {rnd['step']}" if rnd.get("outcome") == "ready" else rnd.get("outcome")
    answered = f"{rnd.get('answered')} of {world_size} ranks answered"
    if rnd.get("answer_s") is not None:
        answered += f", the last {format_seconds(rnd['answer_s'])} after the last rank asked"
    return f"last plan round: {what}, {format_seconds(rnd['age_s'])} ago; {answered}"


def _rpo(rank: dict[str, Any]) -> str:
    """What a failure now would cost the rank: ``3 steps (1.2 s)``; ``-`` while no step is recoverable."""
    steps, seconds = rank.get("lag_steps"), rank.get("rpo_s")
    if steps is None:
        return "-"
    text = f"{steps} step" + ("" if steps == 1 else "s")
    return text if seconds is None else f"{text} ({format_seconds(seconds)})"


def _step(step: int) -> str:
    return "none" if step is None or step < 0 else str(step)
