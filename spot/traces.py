"""Spot-capacity traces: four public formats read into one type, plus a seeded synthetic generator.

A `Trace` is a time-ordered list of `TraceEvent`s, each a node being added or preempted. Formats
(docs/spot.md; the shipped files and their sources are described in the traces README):

    parcae-csv     rows `ms,add|remove,nodeN`, one event per row (Parcae, NSDI'24)
    parcae-jsonl   rows `[ms, "add"|"remove"|"no-op", {"nodes": [...], "duration": ms, ...}]`
    bamboo-csv     rows `seconds,instance_count`, a step function (Bamboo, NSDI'23)
    skypilot-json  `{"metadata": {"gap_seconds": N}, "data": [count, ...]}`, one count per tick
                   (skypilot-org/spot-traces, NSDI'24 "Can't Be Late")

The format is told from the content (a `{` means SkyPilot JSON, a `[` Parcae JSONL, a CSV row's
field count tells Parcae from Bamboo); `format=` overrides it. Count-based formats (Bamboo,
SkyPilot) carry no node identities: a rise adds fresh nodes `node-0, node-1, ...` and a fall
preempts the most recently added ones first (LIFO). That choice is arbitrary but deterministic.

Malformed input raises `ValueError("FILE:LINE: what is wrong")`.

A replayer drives a cluster from `timeline()`, which interleaves the synthesized notices::

    trace = load_trace(path).trimmed().compressed(60).with_notices(2.0)
    for ev in trace.timeline():               # sorted by ev.t_s
        sleep_until(start + ev.t_s)
        if ev.kind == "add":       add_node(ev.node_id)
        elif ev.kind == "notice":  fake_imds[ev.node_id].schedule_interruption(lead_s=ev.notice_lead_s)
        else:                      remove_node(ev.node_id)            # "preempt"

`python -m spot.traces FILE...` prints one summary line per trace.
"""

from __future__ import annotations

import argparse
import csv
import heapq
import json
import math
import random
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

FORMATS = ("parcae-csv", "parcae-jsonl", "bamboo-csv", "skypilot-json")

EventKind = Literal["add", "notice", "preempt"]


@dataclass(frozen=True)
class TraceEvent:
    """One change of capacity at time `t_s`."""

    t_s: float
    """Seconds from the start of the trace."""
    node_id: str
    """The node added, warned or preempted."""
    kind: EventKind
    """`add`, `preempt`, or (only in `Trace.timeline()`) the `notice` ahead of a preemption."""
    notice_lead_s: float | None = None
    """preempt: warning it got (None: none). notice: seconds until the preemption it announces."""


@dataclass(frozen=True)
class Trace:
    """Adds and preemptions of spot nodes over time, in time order."""

    events: tuple[TraceEvent, ...]
    """Only `add` and `preempt` events, sorted by time (file order among equal times)."""
    duration_s: float
    """Length of the trace; no event lies after it."""
    source: str
    """Where it came from: a file path or a description of the generator."""
    format: str
    """One of `FORMATS`, or `synthetic` / `rescaled` for generated ones."""

    def __post_init__(self):
        alive: set[str] = set()
        prev_t = -math.inf
        for i, ev in enumerate(self.events):
            if ev.kind not in ("add", "preempt"):
                raise ValueError(f"{self.source}: event {i} has kind {ev.kind!r}; a trace holds only add and preempt")
            if ev.t_s < prev_t:
                raise ValueError(f"{self.source}: event {i} at {ev.t_s} s comes before the previous one ({prev_t} s)")
            prev_t = ev.t_s
            _apply(alive, ev.kind, ev.node_id, lambda msg, i=i: ValueError(f"{self.source}: event {i}: {msg}"))
        if self.events and self.duration_s < self.events[-1].t_s:
            raise ValueError(f"{self.source}: duration {self.duration_s} s ends before the last event")

    # -- facts -------------------------------------------------------------------------------

    @property
    def num_preemptions(self) -> int:
        return sum(ev.kind == "preempt" for ev in self.events)

    @property
    def num_adds(self) -> int:
        return sum(ev.kind == "add" for ev in self.events)

    @property
    def num_nodes_max(self) -> int:
        return max((n for _, n in self.availability()), default=0)

    def availability(self) -> list[tuple[float, int]]:
        """The step function `[(t_s, num_nodes), ...]`: nodes alive from each t_s on (starts at 0)."""
        steps = [(0.0, 0)]
        alive = 0
        for ev in self.events:
            alive += 1 if ev.kind == "add" else -1
            if steps[-1][0] == ev.t_s:
                steps[-1] = (ev.t_s, alive)
            else:
                steps.append((ev.t_s, alive))
        return steps

    def summary(self) -> str:
        """One line: name, format, events, preemptions, peak nodes, duration."""
        name = Path(self.source).name if self.format in FORMATS else self.source
        return (
            f"{name}: {self.format}, {len(self.events)} events ({self.num_adds} adds, "
            f"{self.num_preemptions} preemptions), peak {self.num_nodes_max} nodes, "
            f"duration {self.duration_s:.0f} s ({self.duration_s / 3600:.2f} h)"
        )

    # -- transformations (each returns a new Trace) ------------------------------------------

    def compressed(self, factor: float) -> Trace:
        """Time runs `factor` times faster: every time, duration and notice lead is divided by it."""
        if not factor > 0:
            raise ValueError(f"compression factor must be > 0, got {factor}")
        events = tuple(
            replace(
                ev,
                t_s=ev.t_s / factor,
                notice_lead_s=None if ev.notice_lead_s is None else ev.notice_lead_s / factor,
            )
            for ev in self.events
        )
        return replace(self, events=events, duration_s=self.duration_s / factor)

    def trimmed(self) -> Trace:
        """Drop the idle time before the first event, so the trace starts with its first change.

        Bamboo's file, for instance, holds 0 instances for its first 21,529 s.
        """
        if not self.events:
            return self
        t0 = self.events[0].t_s
        events = tuple(replace(ev, t_s=ev.t_s - t0) for ev in self.events)
        return replace(self, events=events, duration_s=self.duration_s - t0)

    def with_notices(self, lead_s: float, *, fraction: float = 1.0, seed: int = 0) -> Trace:
        """Give preemptions a notice `lead_s` seconds ahead (in this trace's time units).

        A notice never comes before its node was added: the lead is cut to the node's lifetime.
        With `fraction < 1`, a seeded random subset of preemptions gets a notice and the rest none.
        """
        if lead_s < 0 or not 0.0 <= fraction <= 1.0:
            raise ValueError(f"need lead_s >= 0 and 0 <= fraction <= 1, got {lead_s}, {fraction}")
        rng = random.Random(seed)
        added_at: dict[str, float] = {}
        events = []
        for ev in self.events:
            if ev.kind == "add":
                added_at[ev.node_id] = ev.t_s
                events.append(ev)
            else:
                warned = rng.random() < fraction
                lead = min(lead_s, ev.t_s - added_at[ev.node_id]) if warned else None
                events.append(replace(ev, notice_lead_s=lead))
        return replace(self, events=tuple(events))

    def rescaled(self, num_nodes_max: int) -> Trace:
        """Scale the node count so the peak is `num_nodes_max` (e.g. 32 nodes onto 3 local raylets).

        Counts are scaled and rounded, then rebuilt as in a count-based format: node identities
        and notices are not kept. A count above zero stays at least 1: a pool that still had
        instances keeps one node, rather than rounding into an empty cluster (Bamboo's group
        holds 2 of its 12 instances for long stretches: onto 3 nodes that is 0.5).
        """
        if num_nodes_max < 1:
            raise ValueError(f"num_nodes_max must be >= 1, got {num_nodes_max}")
        peak = self.num_nodes_max
        steps = self.availability()
        counts = [max(1, round(n * num_nodes_max / peak)) if n > 0 else 0 for _, n in steps]
        source = f"{self.source} rescaled to {num_nodes_max} nodes"
        return Trace.from_counts(
            [t for t, _ in steps], counts, duration_s=self.duration_s, source=source, format="rescaled"
        )

    def timeline(self) -> list[TraceEvent]:
        """Adds, notices and preemptions sorted by time: what a replayer acts on, in order.

        Each preemption with `notice_lead_s` set is preceded by a `notice` event at
        `t_s - notice_lead_s` whose `notice_lead_s` is the time left until the preemption.
        """
        keyed = []
        for i, ev in enumerate(self.events):
            keyed.append((ev.t_s, 2 * i, ev))
            if ev.kind == "preempt" and ev.notice_lead_s is not None:
                # At equal times a notice goes right before its preemption, hence after its add.
                notice = TraceEvent(ev.t_s - ev.notice_lead_s, ev.node_id, "notice", ev.notice_lead_s)
                keyed.append((notice.t_s, 2 * i - 1, notice))
        keyed.sort(key=lambda k: k[:2])
        return [k[2] for k in keyed]

    # -- construction ------------------------------------------------------------------------

    @staticmethod
    def from_counts(times_s: list[float], counts: list[int], *, duration_s: float, source: str, format: str) -> Trace:
        """Events from an availability step function (`counts[i]` nodes from `times_s[i]` on)."""
        events: list[TraceEvent] = []
        alive: list[str] = []
        next_id = 0
        for t, n in zip(times_s, counts, strict=True):
            while len(alive) < n:
                alive.append(f"node-{next_id}")
                next_id += 1
                events.append(TraceEvent(t, alive[-1], "add"))
            while len(alive) > n:  # LIFO: the newest node goes first
                events.append(TraceEvent(t, alive.pop(), "preempt"))
        return Trace(tuple(events), duration_s=duration_s, source=source, format=format)


def _apply(alive: set[str], kind: str, node_id: str, error) -> None:
    """Update the live set for one event; `error(msg)` builds the exception for an inconsistency."""
    if kind == "add":
        if node_id in alive:
            raise error(f"node {node_id!r} is added while it is already present")
        alive.add(node_id)
    else:
        if node_id not in alive:
            raise error(f"node {node_id!r} is removed but is not present")
        alive.remove(node_id)


# -- readers ---------------------------------------------------------------------------------


def load_trace(path: str | Path, *, format: str | None = None) -> Trace:
    """Read a trace file in any of `FORMATS` (told from the content unless `format` is given)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{path}: not a text file (byte {e.start} is not UTF-8); a trace is CSV, JSON lines or JSON"
        ) from None
    except FileNotFoundError:
        raise ValueError(f"{path}: no such trace file") from None
    except OSError as e:
        raise ValueError(f"{path}: cannot read the trace ({e.strerror})") from None
    if format is None:
        format = _detect_format(path, text)
    elif format not in FORMATS:
        raise ValueError(f"unknown trace format {format!r}; choose one of {', '.join(FORMATS)}")
    return _READERS[format](path, text)


def _detect_format(path: Path, text: str) -> str:
    for lineno, line in enumerate(text.splitlines(), 1):
        s = line.strip()
        if not s:
            continue
        if s.startswith("{"):
            return "skypilot-json"
        if s.startswith("["):
            return "parcae-jsonl"
        num_fields = len(next(csv.reader([s])))
        if num_fields == 3:
            return "parcae-csv"
        if num_fields == 2:
            return "bamboo-csv"
        raise ValueError(
            f"{path}:{lineno}: cannot tell the trace format from {s[:60]!r} (a CSV row with "
            f"{num_fields} fields); pass format= one of {', '.join(FORMATS)}"
        )
    raise ValueError(f"{path}: empty trace file")


def _number(path: Path, lineno: int, field: str, raw, *, integer: bool = False) -> float:
    """Parse a finite, non-negative number; fail naming the file, line and field."""
    try:
        if isinstance(raw, bool):
            raise ValueError
        value = float(raw) if not isinstance(raw, (int, float)) else raw
        if integer and value != int(value):
            raise ValueError
    except (TypeError, ValueError):
        kind = "an integer" if integer else "a number"
        raise ValueError(f"{path}:{lineno}: {field} is not {kind}: {raw!r}") from None
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{path}:{lineno}: {field} must be finite and >= 0, got {raw!r}")
    return int(value) if integer else float(value)


def _check_time(path: Path, lineno: int, t: float, prev_t: float, unit: str) -> None:
    if t < prev_t:
        raise ValueError(f"{path}:{lineno}: time {t:g} {unit} goes backwards (previous row: {prev_t:g} {unit})")


def _csv_rows(path: Path, text: str, num_fields: int, names: str):
    """Yield (line number, fields) for each non-blank CSV row, checking the field count."""
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        row = next(csv.reader([line]))
        if len(row) != num_fields:
            raise ValueError(f"{path}:{lineno}: expected {num_fields} fields ({names}), got {len(row)}: {line!r}")
        yield lineno, [f.strip() for f in row]


def _read_parcae_csv(path: Path, text: str) -> Trace:
    events, alive, prev_t = [], set(), 0.0
    for lineno, (ms, kind, node) in _csv_rows(path, text, 3, "ms,add|remove,node"):
        t = _number(path, lineno, "field 1 (time, ms)", ms) / 1000.0
        _check_time(path, lineno, t, prev_t, "s")
        prev_t = t
        if kind not in ("add", "remove"):
            raise ValueError(f"{path}:{lineno}: field 2 (event) must be 'add' or 'remove', got {kind!r}")
        if not node:
            raise ValueError(f"{path}:{lineno}: field 3 (node id) is empty")
        _apply(alive, kind, node, lambda msg: ValueError(f"{path}:{lineno}: {msg}"))  # noqa: B023 - called in the loop
        events.append(TraceEvent(t, node, "add" if kind == "add" else "preempt"))
    if not events:
        raise ValueError(f"{path}: no events")
    return Trace(tuple(events), duration_s=prev_t, source=str(path), format="parcae-csv")


def _read_parcae_jsonl(path: Path, text: str) -> Trace:
    events, alive, prev_t, end_t = [], set(), 0.0, 0.0
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: column {e.colno}: not JSON: {e.msg}") from None
        if not (isinstance(row, list) and len(row) >= 3 and isinstance(row[2], dict)):
            raise ValueError(f'{path}:{lineno}: expected [ms, kind, {{"nodes": [...]}}], got {line.strip()[:80]!r}')
        ms, kind, info = row[0], row[1], row[2]
        t = _number(path, lineno, "element 0 (time, ms)", ms) / 1000.0
        _check_time(path, lineno, t, prev_t, "s")
        prev_t = t
        if kind not in ("add", "remove", "no-op"):
            raise ValueError(f"{path}:{lineno}: element 1 (event) must be 'add', 'remove' or 'no-op', got {kind!r}")
        nodes = info.get("nodes")
        if not isinstance(nodes, list) or not all(isinstance(n, str) and n for n in nodes):
            raise ValueError(f"{path}:{lineno}: field 'nodes' must be a list of node ids, got {nodes!r}")
        if kind == "no-op" and nodes:
            raise ValueError(f"{path}:{lineno}: a 'no-op' row lists nodes {nodes}")
        duration = _number(path, lineno, "field 'duration' (ms)", info.get("duration", 0)) / 1000.0
        end_t = max(end_t, t + duration)
        for node in nodes:
            _apply(alive, kind, node, lambda msg: ValueError(f"{path}:{lineno}: {msg}"))  # noqa: B023 - called here
            events.append(TraceEvent(t, node, "add" if kind == "add" else "preempt"))
    return Trace(tuple(events), duration_s=max(end_t, prev_t), source=str(path), format="parcae-jsonl")


def _read_bamboo_csv(path: Path, text: str) -> Trace:
    times, counts, prev_t = [], [], 0.0
    for lineno, (sec, count) in _csv_rows(path, text, 2, "seconds,instance_count"):
        t = _number(path, lineno, "field 1 (time, s)", sec)
        _check_time(path, lineno, t, prev_t, "s")
        prev_t = t
        times.append(t)
        counts.append(_number(path, lineno, "field 2 (instance count)", count, integer=True))
    if not times:
        raise ValueError(f"{path}: no rows")
    return Trace.from_counts(times, counts, duration_s=prev_t, source=str(path), format="bamboo-csv")


def _read_skypilot_json(path: Path, text: str) -> Trace:
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{e.lineno}: column {e.colno}: not JSON: {e.msg}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("data"), list):
        raise ValueError(f"{path}:1: expected an object with a 'data' list of instance counts")
    metadata = doc.get("metadata")
    gap = metadata.get("gap_seconds") if isinstance(metadata, dict) else None
    if gap is None:
        raise ValueError(f"{path}:1: missing metadata.gap_seconds")
    gap = _number(path, 1, "metadata.gap_seconds", gap)
    if gap == 0:
        raise ValueError(f"{path}:1: metadata.gap_seconds must be > 0")
    counts = []
    for i, raw in enumerate(doc["data"]):
        if not isinstance(raw, int) or isinstance(raw, bool) or raw < 0:
            lineno, col = _locate_array_element(text, i)
            raise ValueError(f"{path}:{lineno}: column {col}: data[{i}] must be a count >= 0, got {raw!r}")
        counts.append(raw)
    times = [i * gap for i in range(len(counts))]
    return Trace.from_counts(times, counts, duration_s=len(counts) * gap, source=str(path), format="skypilot-json")


def _locate_array_element(text: str, index: int) -> tuple[int, int]:
    """Line and column of `data[index]` in a SkyPilot JSON text (which is often a single line)."""
    decoder = json.JSONDecoder()
    pos = text.index("[", text.index('"data"'))
    pos += 1
    for i in range(index + 1):
        while text[pos] in " \t\r\n,":
            pos += 1
        if i == index:
            break
        _, pos = decoder.raw_decode(text, pos)
    line = text.count("\n", 0, pos) + 1
    return line, pos - (text.rfind("\n", 0, pos) + 1) + 1


_READERS = {
    "parcae-csv": _read_parcae_csv,
    "parcae-jsonl": _read_parcae_jsonl,
    "bamboo-csv": _read_bamboo_csv,
    "skypilot-json": _read_skypilot_json,
}


# -- synthetic -------------------------------------------------------------------------------


def synthetic_trace(
    *,
    num_nodes: int,
    duration_s: float,
    preemptions_per_node_hour: float,
    replacement_delay_s: float,
    seed: int,
) -> Trace:
    """A seeded trace: `num_nodes` nodes at t=0, each preempted as a Poisson process.

    Each node lives an exponential time with mean `3600 / preemptions_per_node_hour` s; its
    replacement (a fresh node id) joins `replacement_delay_s` later. So the cluster sees about
    `num_nodes * preemptions_per_node_hour * duration_s / 3600` preemptions while it is full.

    Args:
        num_nodes: nodes at full capacity.
        duration_s: length of the trace.
        preemptions_per_node_hour: mean preemption rate of one node.
        replacement_delay_s: time from a preemption to its replacement joining.
        seed: seed of the random generator; the same arguments give the same trace.
    """
    if num_nodes < 1 or duration_s <= 0 or preemptions_per_node_hour < 0 or replacement_delay_s < 0:
        raise ValueError(
            "need num_nodes >= 1, duration_s > 0, preemptions_per_node_hour >= 0, replacement_delay_s >= 0"
        )
    rng = random.Random(seed)
    rate_per_s = preemptions_per_node_hour / 3600.0
    events: list[TraceEvent] = []
    joins = [(0.0, i) for i in range(num_nodes)]  # heap of (time a node joins, tie-break)
    next_id = 0
    while joins:
        t_add, _ = heapq.heappop(joins)
        node_id = f"node-{next_id}"
        next_id += 1
        events.append(TraceEvent(t_add, node_id, "add"))
        t_preempt = t_add + rng.expovariate(rate_per_s) if rate_per_s > 0 else math.inf
        if t_preempt < duration_s:
            events.append(TraceEvent(t_preempt, node_id, "preempt"))
            if t_preempt + replacement_delay_s < duration_s:
                heapq.heappush(joins, (t_preempt + replacement_delay_s, next_id))
    events.sort(key=lambda ev: ev.t_s)  # stable: an add keeps its place before its own preempt
    source = (
        f"synthetic(num_nodes={num_nodes}, duration_s={duration_s:g}, "
        f"preemptions_per_node_hour={preemptions_per_node_hour:g}, "
        f"replacement_delay_s={replacement_delay_s:g}, seed={seed})"
    )
    return Trace(tuple(events), duration_s=duration_s, source=source, format="synthetic")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m spot.traces", description="Summarize spot-preemption traces.")
    parser.add_argument("files", nargs="+", type=Path, help="trace files")
    parser.add_argument("--format", choices=FORMATS, help="skip format detection")
    args = parser.parse_args(argv)
    status = 0
    for f in args.files:
        try:
            print(load_trace(f, format=args.format).summary())
        except (OSError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
