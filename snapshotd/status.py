"""``snapshotd status``: ask a coordinator for its view and print it as tables or JSON."""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import msgpack

from snapshotd.proto import Error, StatusReply, StatusRequest, decode, encode
from snapshotd.transport import connect_blocking
from snapshotd.units import format_bytes, format_rate, format_seconds

__all__ = ["fetch_status", "render_status", "status_main"]

_RANK_ROWS = 32  # a job with more ranks shows its worst ones (fewest copies, then largest lag)


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


def status_main(coordinator: str, *, watch: bool, as_json: bool, secret: str | None, timeout: float = 5.0) -> int:
    """Print the status once, or every second with ``watch`` until Ctrl-C; ``timeout`` bounds each fetch.

    Returns:
        0 on success (and when a watch is interrupted); 1, with the reason on stderr, when a single fetch fails.
        While watching, a failed fetch is shown in place of the tables and the watch goes on.
    """
    try:
        while True:
            try:
                doc = fetch_status(coordinator, secret=secret, timeout=timeout)
            except (TimeoutError, ValueError, RuntimeError) as exc:
                if not watch:
                    print(f"snapshotd status: {exc}", file=sys.stderr)
                    return 1
                text = f"snapshotd status: {exc}"
            else:
                text = json.dumps(doc, indent=None if watch else 2) if as_json else render_status(doc)
            if watch and not as_json:
                sys.stdout.write("\x1b[H\x1b[2J")  # clear the terminal
            print(text, flush=True)
            if not watch:
                return 0
            time.sleep(1.0)
    except KeyboardInterrupt:
        return 0


def render_status(doc: dict[str, Any]) -> str:
    """The status document as plain-text tables: the coordinator, its nodes, and each job with G and lag."""
    c = doc.get("coordinator", {})
    lines = [
        f"coordinator: up {format_seconds(c.get('uptime_s', 0))}, replicas {c.get('replicas')}, "
        f"{c.get('heartbeats', 0)} heartbeats, {c.get('bad_messages', 0)} bad messages",
        "",
    ]
    rows = []
    for n in doc.get("nodes", []):
        dead = sum(1 for _, _, alive in n.get("ranks", []) if not alive)
        ranks = f"{len(n.get('ranks', []))}" + (f" ({dead} dead)" if dead else "")
        rows.append([n["node"], n.get("rack") or "-", "live" if n.get("alive") else "DEAD",
                     format_seconds(n.get("last_seen_s", 0)) + " ago", ranks,
                     format_bytes(n.get("stored_bytes", 0)), format_rate(n.get("out_Bps", 0.0)),
                     format_rate(n.get("in_Bps", 0.0)), n.get("data_addr", "")])  # fmt: skip
    lines += _table(["NODE", "RACK", "STATE", "SEEN", "RANKS", "STORED", "OUT", "IN", "DATA"], rows)
    if not rows:
        lines.append("(no sidecar registered)")
    for j in doc.get("jobs", []):
        g, d = j.get("recoverable", -1), j.get("durable", -1)
        lines += ["", f"job {j['job']}: world size {j.get('world_size')}, recoverable step G = {_step(g)}, "
                      f"newest durable step = {_step(d)}"]  # fmt: skip
        if j.get("round"):
            lines.append("  " + _round(j["round"], j.get("world_size")))
        ranks = j.get("ranks", [])
        shown = ranks
        if len(ranks) > _RANK_ROWS:
            shown = sorted(ranks, key=lambda r: (r.get("copies", 0), -(r.get("lag_steps") or 0), r["rank"]))
            shown = sorted(shown[:_RANK_ROWS], key=lambda r: r["rank"])
        rows = [[r["rank"], r.get("node") or "-", _step(r.get("newest_step", -1)),
                 "-" if r.get("lag_steps") is None else r["lag_steps"], r.get("copies", 0)] for r in shown]  # fmt: skip
        lines += ["  " + line for line in _table(["RANK", "NODE", "NEWEST", "LAG", "COPIES"], rows)]
        if len(shown) < len(ranks):
            lines.append(f"  ... {len(ranks) - len(shown)} more ranks (worst shown; --json lists all)")
        missing = j.get("missing", [])
        if missing:
            spans = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in missing[:8])
            more = f" and {len(missing) - 8} more ranges" if len(missing) > 8 else ""
            lines.append(f"  ranks no node reported (no home, no copy): {spans}{more}")
    return "\n".join(lines)


def _round(rnd: dict[str, Any], world_size: int | None) -> str:
    """One line on a job's last plan round: still asking, or its outcome and how its answers went."""
    if rnd.get("age_s") is None:
        return f"plan round open: {rnd.get('asked')} of {world_size} ranks asked"
    what = f"ready at step {rnd['step']}" if rnd.get("outcome") == "ready" else rnd.get("outcome")
    answered = f"{rnd.get('answered')} of {world_size} ranks answered"
    if rnd.get("answer_s") is not None:
        answered += f", the last {format_seconds(rnd['answer_s'])} after the last rank asked"
    return f"last plan round: {what}, {format_seconds(rnd['age_s'])} ago; {answered}"


def _step(step: int) -> str:
    return "none" if step is None or step < 0 else str(step)


def _table(headers: list[str], rows: list[list[Any]]) -> list[str]:
    cells = [headers] + [[str(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip() for row in cells]
