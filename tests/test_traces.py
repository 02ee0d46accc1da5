"""Spot traces: every shipped trace loads, four formats agree on one type, bad input names its line."""

from __future__ import annotations

import csv
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from spot.traces import Trace, TraceEvent, load_trace, synthetic_trace

ROOT = Path(__file__).resolve().parents[1]
# The traces the project ships (traces/, with their licences and sources in traces/README.md).
TRACE_DIR = ROOT / "traces"
TRACE_FILES = sorted(p for p in TRACE_DIR.iterdir() if p.suffix in (".csv", ".jsonl", ".json"))

# name -> (format, events, preemptions, peak nodes, duration s), counted from the files by hand.
KNOWN = {
    "parcae-p3-aws.csv": ("parcae-csv", 344, 167, 32, 40920.0),
    "parcae-aws-hh_55_65.jsonl": ("parcae-jsonl", 67, 19, 32, 3600.0),
    "bamboo-g4dn-us-east-1c.csv": ("bamboo-csv", 177, 85, 12, 88194.0),
}


@pytest.mark.parametrize("path", TRACE_FILES, ids=lambda p: p.name)
def test_every_shipped_trace_loads(path):
    trace = load_trace(path)
    print(trace.summary())
    assert trace.events and trace.num_preemptions > 0
    assert all(a.t_s <= b.t_s for a, b in zip(trace.events, trace.events[1:]))
    if path.name in KNOWN:
        fmt, num_events, num_preemptions, peak, duration = KNOWN[path.name]
        assert (trace.format, len(trace.events), trace.num_preemptions) == (fmt, num_events, num_preemptions)
        assert (trace.num_nodes_max, trace.duration_s) == (peak, duration)


def test_bamboo_availability_matches_the_file():
    path = TRACE_DIR / "bamboo-g4dn-us-east-1c.csv"
    last_count_at: dict[float, int] = {}
    for t, n in csv.reader(path.read_text().splitlines()):
        last_count_at[float(t)] = int(n)
    steps = dict(load_trace(path).availability())
    for t, n in last_count_at.items():
        assert steps.get(t, n) == n  # every change in the file is a step of the trace


def test_cli_prints_one_line_per_trace(tmp_path):
    a = tmp_path / "a.json"
    a.write_text(json.dumps({"metadata": {"gap_seconds": 60}, "data": [2, 1, 2]}))
    b = tmp_path / "b.csv"
    b.write_text("0,add,n1\n30000,remove,n1\n")
    out = subprocess.run(
        [sys.executable, "-m", "spot.traces", str(a), str(b)], capture_output=True, text=True, cwd=ROOT, check=True
    ).stdout.splitlines()
    assert out == [
        "a.json: skypilot-json, 4 events (3 adds, 1 preemptions), peak 2 nodes, duration 180 s (0.05 h)",
        "b.csv: parcae-csv, 2 events (1 adds, 1 preemptions), peak 1 nodes, duration 30 s (0.01 h)",
    ]


# -- the four formats ---------------------------------------------------------------------------


def _write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_formats_are_detected_from_content_and_agree(tmp_path):
    """The same capacity history (2 nodes, one lost at 60 s, back at 120 s) in all four formats."""
    files = {
        "parcae-csv": _write(tmp_path, "p.txt", "0,add,a\n0,add,b\n60000,remove,b\n120000,add,c\n"),
        "parcae-jsonl": _write(
            tmp_path,
            "p.log",
            '[0, "add", {"nodes": ["a", "b"], "duration": 60000}]\n'
            '[60000, "remove", {"nodes": ["b"], "duration": 60000}]\n'
            '[120000, "add", {"nodes": ["c"], "duration": 60000}]\n',
        ),
        "bamboo-csv": _write(tmp_path, "b.csv", "0,2\n60,2\n60,1\n120,1\n120,2\n180,2\n"),
        "skypilot-json": _write(tmp_path, "s.json", '{"metadata": {"gap_seconds": 60}, "data": [2, 1, 2]}'),
    }
    for fmt, path in files.items():
        trace = load_trace(path)
        assert trace.format == fmt
        assert trace.availability() == [(0.0, 2), (60.0, 1), (120.0, 2)], fmt
        assert trace.num_preemptions == 1 and trace.num_nodes_max == 2
    assert load_trace(files["parcae-jsonl"]).duration_s == 180.0
    assert load_trace(files["skypilot-json"]).duration_s == 180.0


def test_count_formats_preempt_the_newest_node_first(tmp_path):
    trace = load_trace(_write(tmp_path, "s.json", '{"metadata": {"gap_seconds": 10}, "data": [3, 1, 2]}'))
    assert [(ev.t_s, ev.kind, ev.node_id) for ev in trace.events] == [
        (0.0, "add", "node-0"),
        (0.0, "add", "node-1"),
        (0.0, "add", "node-2"),
        (10.0, "preempt", "node-2"),
        (10.0, "preempt", "node-1"),
        (20.0, "add", "node-3"),
    ]


def test_format_override_and_unknown_format(tmp_path):
    path = _write(tmp_path, "x.csv", "0,add,a\n")
    with pytest.raises(ValueError, match=r"x\.csv:1: expected 2 fields"):
        load_trace(path, format="bamboo-csv")
    with pytest.raises(ValueError, match="unknown trace format 'excel'"):
        load_trace(path, format="excel")
    odd = _write(tmp_path, "odd.csv", "\n0,1,2,3\n")
    with pytest.raises(ValueError, match=r"odd\.csv:2: cannot tell the trace format .* 4 fields"):
        load_trace(odd)
    with pytest.raises(ValueError, match="empty trace file"):
        load_trace(_write(tmp_path, "empty.csv", "\n\n"))


# -- malformed input: ValueError with FILE:LINE -------------------------------------------------

CORRUPTIONS = [
    # (format, file name, text, expected message, as a regex after "FILE:")
    ("parcae-csv", "p.csv", "0,add,a\n1x0,add,b\n", r"2: field 1 \(time, ms\) is not a number: '1x0'"),
    ("parcae-csv", "p.csv", "0,add,a\n10,add\n", r"2: expected 3 fields"),
    ("parcae-csv", "p.csv", "0,add,a\n10,kill,a\n", r"2: field 2 \(event\) must be 'add' or 'remove', got 'kill'"),
    ("parcae-csv", "p.csv", "0,add,a\n20,add,b\n\n10,remove,a\n", r"4: time 0.01 s goes backwards"),
    ("parcae-csv", "p.csv", "0,add,a\n10,remove,b\n", r"2: node 'b' is removed but is not present"),
    ("parcae-csv", "p.csv", "0,add,a\n10,add,a\n", r"2: node 'a' is added while it is already present"),
    ("parcae-csv", "p.csv", "-5,add,a\n", r"1: field 1 \(time, ms\) must be finite and >= 0"),
    (
        "parcae-jsonl",
        "p.jsonl",
        '[0, "add", {"nodes": ["a"]}]\n[10, "add", {"nodes": ["b"]]\n',
        r"2: column \d+: not JSON",
    ),
    (
        "parcae-jsonl",
        "p.jsonl",
        '[0, "add", {"nodes": ["a"]}]\n["x", "add", {"nodes": ["b"]}]\n',
        r"2: element 0 \(time, ms\) is not a number",
    ),
    (
        "parcae-jsonl",
        "p.jsonl",
        '[0, "add", {"nodes": ["a"]}]\n[10, "add", {"duration": 5}]\n',
        r"2: field 'nodes' must be a list",
    ),
    ("parcae-jsonl", "p.jsonl", '[0, "add", {"nodes": ["a"]}]\n[10, "add"]\n', r"2: expected \[ms, kind"),
    (
        "parcae-jsonl",
        "p.jsonl",
        '[50, "add", {"nodes": ["a"]}]\n[10, "no-op", {"nodes": []}]\n',
        r"2: time 0.01 s goes backwards",
    ),
    ("parcae-jsonl", "p.jsonl", '[0, "evict", {"nodes": ["a"]}]\n', r"1: element 1 \(event\) must be"),
    ("bamboo-csv", "b.csv", "0,2\n10,two\n", r"2: field 2 \(instance count\) is not an integer: 'two'"),
    ("bamboo-csv", "b.csv", "0,2\n10,1.5\n", r"2: field 2 \(instance count\) is not an integer"),
    ("bamboo-csv", "b.csv", "0,2\n10,-1\n", r"2: field 2 \(instance count\) must be finite and >= 0"),
    ("bamboo-csv", "b.csv", "0,2\n10\n", r"2: expected 2 fields"),
    ("bamboo-csv", "b.csv", "0,2\n10,3\n5,3\n", r"3: time 5 s goes backwards"),
    ("bamboo-csv", "b.csv", "0,2\nnan,3\n", r"2: field 1 \(time, s\) must be finite"),
    ("skypilot-json", "s.json", '{"metadata": {"gap_seconds": 300},\n "data": [1, 2,, 3]}', r"2: column 16: not JSON"),
    ("skypilot-json", "s.json", '{"metadata": {}, "data": [1, 2]}', r"1: missing metadata.gap_seconds"),
    ("skypilot-json", "s.json", '{"metadata": {"gap_seconds": 300}}', r"1: expected an object with a 'data' list"),
    (
        "skypilot-json",
        "s.json",
        '{"metadata": {"gap_seconds": 300},\n "data": [1, 2, "3", 4]}',
        r"2: column 17: data\[2\] must be a count >= 0, got '3'",
    ),
    (
        "skypilot-json",
        "s.json",
        '{"metadata": {"gap_seconds": 300}, "data": [1, -2]}',
        r"1: column 48: data\[1\] must be a count",
    ),
    (
        "skypilot-json",
        "s.json",
        '{"metadata": {"gap_seconds": 0}, "data": [1]}',
        r"1: metadata.gap_seconds must be > 0",
    ),
]


@pytest.mark.parametrize("fmt,name,text,message", CORRUPTIONS, ids=[f"{c[0]}-{i}" for i, c in enumerate(CORRUPTIONS)])
def test_malformed_trace_names_file_and_line(tmp_path, fmt, name, text, message):
    path = _write(tmp_path, name, text)
    for kwargs in ({}, {"format": fmt}):  # the same error whether detected or named
        with pytest.raises(ValueError) as err:
            load_trace(path, **kwargs)
        assert str(err.value).startswith(f"{path}:"), str(err.value)
        assert re.search(message, str(err.value)[len(str(path)) + 1 :]), str(err.value)


def test_malformed_trace_in_cli_exits_nonzero(tmp_path):
    bad = _write(tmp_path, "bad.csv", "0,add,a\nzero,add,b\n")
    proc = subprocess.run([sys.executable, "-m", "spot.traces", str(bad)], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 1
    assert f"{bad}:2: field 1 (time, ms) is not a number: 'zero'" in proc.stderr


# -- transformations -----------------------------------------------------------------------------


def _toy() -> Trace:
    events = [
        TraceEvent(0.0, "a", "add"),
        TraceEvent(0.0, "b", "add"),
        TraceEvent(100.0, "a", "preempt"),
        TraceEvent(150.0, "c", "add"),
        TraceEvent(160.0, "c", "preempt"),
        TraceEvent(300.0, "b", "preempt"),
    ]
    return Trace(tuple(events), duration_s=400.0, source="toy", format="synthetic")


def test_trace_rejects_inconsistent_events():
    with pytest.raises(ValueError, match="'x' is removed but is not present"):
        Trace((TraceEvent(0.0, "x", "preempt"),), duration_s=1.0, source="t", format="synthetic")
    with pytest.raises(ValueError, match="comes before the previous one"):
        events = (TraceEvent(5.0, "x", "add"), TraceEvent(1.0, "y", "add"))
        Trace(events, duration_s=9.0, source="t", format="synthetic")


def test_compressed_scales_times_and_leads():
    trace = _toy().with_notices(30.0).compressed(10.0)
    assert [ev.t_s for ev in trace.events] == [0.0, 0.0, 10.0, 15.0, 16.0, 30.0]
    assert trace.duration_s == 40.0
    assert [ev.notice_lead_s for ev in trace.events if ev.kind == "preempt"] == [3.0, 1.0, 3.0]
    with pytest.raises(ValueError):
        _toy().compressed(0)


def test_notices_are_cut_to_the_node_lifetime_and_ordered_before_their_preemption():
    timeline = _toy().with_notices(30.0).timeline()
    assert [(ev.t_s, ev.kind, ev.node_id, ev.notice_lead_s) for ev in timeline] == [
        (0.0, "add", "a", None),
        (0.0, "add", "b", None),
        (70.0, "notice", "a", 30.0),
        (100.0, "preempt", "a", 30.0),
        (150.0, "add", "c", None),
        (150.0, "notice", "c", 10.0),  # c lived 10 s: its notice comes when it joins
        (160.0, "preempt", "c", 10.0),
        (270.0, "notice", "b", 30.0),
        (300.0, "preempt", "b", 30.0),
    ]
    assert [ev.kind for ev in _toy().timeline()].count("notice") == 0


def test_notice_fraction_is_seeded():
    trace = synthetic_trace(num_nodes=4, duration_s=36_000, preemptions_per_node_hour=1, replacement_delay_s=60, seed=1)

    def warned(seed):
        events = trace.with_notices(120, fraction=0.5, seed=seed).events
        return [ev.notice_lead_s is not None for ev in events if ev.kind == "preempt"]

    assert 0 < sum(warned(7)) < len(warned(7))
    assert warned(7) == warned(7) != warned(8)


def test_trimmed_and_rescaled():
    trace = Trace.from_counts([0, 500, 600, 700], [0, 8, 4, 8], duration_s=800, source="t", format="bamboo-csv")
    assert trace.trimmed().availability() == [(0.0, 8), (100.0, 4), (200.0, 8)]
    assert trace.trimmed().duration_s == 300
    small = trace.rescaled(2)
    assert small.num_nodes_max == 2 and small.availability() == [(0.0, 0), (500.0, 2), (600.0, 1), (700.0, 2)]
    # A pool that still has instances keeps a node: 2 of 12 onto 3 nodes is 0.5, and round() gives 0.
    # (Regression: Bamboo's busiest stretch replayed with no spot node for half of it.)
    bamboo = Trace.from_counts([0, 100, 200, 300], [12, 2, 0, 12], duration_s=400, source="t", format="bamboo-csv")
    assert bamboo.rescaled(3).availability() == [(0.0, 3), (100.0, 1), (200.0, 0), (300.0, 3)]


# -- synthetic -----------------------------------------------------------------------------------


def test_synthetic_is_seeded_and_consistent():
    kw = dict(num_nodes=6, duration_s=20 * 3600, preemptions_per_node_hour=0.5, replacement_delay_s=90)
    a, b, c = synthetic_trace(seed=3, **kw), synthetic_trace(seed=3, **kw), synthetic_trace(seed=4, **kw)
    assert a == b and a != c
    assert a.num_nodes_max == 6 and a.availability()[0] == (0.0, 6)
    preempted_at = {ev.node_id: ev.t_s for ev in a.events if ev.kind == "preempt"}
    later_adds = sorted(ev.t_s for ev in a.events if ev.kind == "add" and ev.t_s > 0)
    assert later_adds == sorted(t + 90 for t in preempted_at.values() if t + 90 < kw["duration_s"])


def test_synthetic_rate_matches_poisson_mean():
    kw = dict(num_nodes=10, duration_s=100 * 3600, replacement_delay_s=0, seed=0)
    trace = synthetic_trace(preemptions_per_node_hour=0.4, **kw)
    expected = 10 * 0.4 * 100  # 400; the Poisson standard deviation is 20
    assert abs(trace.num_preemptions - expected) < 5 * 20
    assert synthetic_trace(preemptions_per_node_hour=0, **kw).num_preemptions == 0


# -- replaying a trace on a cluster's clock (spot.replay) --------------------------------------------


def test_a_looped_replay_warns_the_nodes_it_ends_at_the_wrap():
    """Looping, the nodes added during the trace and still up at its end are preempted at the wrap
    (the next pass starts from the initial nodes): with notices, they are warned like the trace's own."""
    from spot.replay import TraceReplayer

    trace = Trace(
        (
            TraceEvent(0, "a", "add"),
            TraceEvent(1, "b", "add"),
            TraceEvent(3, "a", "preempt"),
            TraceEvent(4, "c", "add"),
            TraceEvent(6, "c", "preempt"),
        ),
        10.0,
        "t",
        "test",
    )
    timeline = TraceReplayer._with_wrap_preemptions(trace.with_notices(2.5))
    assert [(ev.t_s, ev.node_id, ev.kind, ev.notice_lead_s) for ev in timeline if ev.t_s >= 6] == [
        (6, "c", "preempt", 2),
        (7.5, "b", "notice", 2.5),
        (10.0, "b", "preempt", 2.5),
    ]
    assert [ev.kind for ev in TraceReplayer._with_wrap_preemptions(trace) if ev.node_id == "b"] == ["add", "preempt"]
