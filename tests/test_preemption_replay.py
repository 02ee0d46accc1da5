"""benchmarks/preemption_replay.py end to end, at a size that fits a test: a real local Ray cluster
replays a two-node trace whose slower node is preempted while both are busy, under pull and under
each baseline (Ray tasks with Ray's own retries; the least-loaded push). Every job is delivered
once, bit for bit as its uninterrupted sampling, and the preemption is counted as hitting work."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Parcae's CSV format (milliseconds): two nodes, the second preempted 100 trace-seconds in (2.5 s of
# wall time at 40x, inside the one wave of 16 jobs, about 6 s of work), a replacement 60 s later.
TRACE = "0,add,node1\n0,add,node2\n100000,remove,node2\n160000,add,node3\n400000,remove,node3\n"


@pytest.mark.parametrize("baseline", ["ray-retries", "push"])
def test_pull_against_a_baseline_on_a_replayed_preemption(tmp_path, baseline):
    trace = tmp_path / "trace.csv"
    trace.write_text(TRACE)
    cmd = [
        sys.executable,
        str(REPO / "benchmarks/preemption_replay.py"),
        "--trace",
        str(trace),
        "--nodes",
        "2",
        "--window-s",
        "400",
        "--start-s",
        "0",
        "--jobs",
        "16",
        "--wave-jobs",
        "16",
        "--baseline",
        baseline,
        "--timeout-s",
        "120",
        "--json",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stdout[-2000:]
    r = json.loads(lines[0])
    assert r["baseline"].startswith("Ray tasks" if baseline == "ray-retries" else "push: each job")
    assert r["jobs"] == 16 and r["lost"] == 0 and r["duplicated"] == 0 and r["bit_exact"] is True
    # The paper-scale job by default: 10 steps of 2.1 s on Qwen-Image 1280x1280, compressed 40x.
    assert (
        r["job"] == "qwen-image-1280"
        and r["job_trace_s"] == pytest.approx(21.0)
        and r["job_wall_s"] == pytest.approx(0.525)
    )
    assert r["preemptions"] == 1
    assert r["preemptions_hitting_work"] == {"pull": 1, baseline: 1}
    other = r[baseline]
    assert other["preemptions"] == 1 and other["lost"] == 0
    if baseline == "ray-retries":
        # The killed attempt lost every step it had done (and the one in flight), Ray reran it from
        # step 0, and each node's worker process loaded the model once.
        assert other["attempts"] == 17 and 1 <= other["recomputed_steps"] <= 10
        assert 2 <= other["model_loads"] <= 3  # node3 may join after the work ran out
    else:
        assert other["revoked"] == 1 and other["repushed"] >= 1
    # Pull loses at most the steps after its last commit (every 4) and the one in flight.
    assert 1 <= r["pull"]["recomputed_steps"] <= 5 and r["pull"]["revoked"] == 1
    assert r["throughput_ratio_pull_vs_baseline"] > 0
