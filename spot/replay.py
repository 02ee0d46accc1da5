"""Replay a spot-capacity trace on a real local Ray cluster, in the same process or in a process of its own.

`TraceReplayer` drives a `spot.cluster.LocalCluster` from `Trace.timeline()` on the trace's clock
(compress the trace first), from the main thread while the workload runs elsewhere. With
`fake_imds=True` every node gets its own `FakeIMDS`, named in the node's `IMDS_LABEL` label (the
runtime's workers watch it), and a `notice` event publishes the interruption there its lead time
ahead. Adding a node blocks for ~1-2 s here, so an event right after an add is late by that much;
`applied` records when each event really happened (a replay behind its clock can apply a notice
and its preemption back to back). With `loop=True` a trace shorter than the run
starts again: at each wrap the nodes are brought back to the trace's initial set (the ones the pass
added are preempted at its end, warned like the trace's own preemptions when it has notices; the
missing initial ones are added).

Ray starts nodes only from a process's main thread, so a training run that replays a trace runs
the cluster in a process of its own: `python -m spot.replay serve ...` starts the cluster (head and
the trace's initial nodes), prints its address as one JSON line, starts the trace's clock when it
reads `go` on its standard input, and shuts the cluster down when its standard input closes (the
driver ended, however it ended). `ReplayProcess` is the driver's side of that.

Traces of 12-32 nodes do not fit 2 cores: `fit_trace` rescales the node count
(`Trace.rescaled(n)`), cuts a stretch of it (`window`; by default the one with the most preemptions,
`busiest_window`), compresses it and adds notices.

    replay = ReplayProcess(fit_trace("traces/parcae-p3-aws.csv", nodes=3, compress=40), fake_imds=True).start()
    ray.init(address=replay.address)
    ...                          # start the workload's workers on the initial nodes
    replay.go()                  # the trace's clock starts now
    ...
    replay.stop()                # the cluster is gone
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from spot.cluster import IMDS_LABEL, LocalCluster
from spot.fake_imds import FakeIMDS
from spot.traces import Trace, TraceEvent, load_trace

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AppliedEvent:
    """A trace event as replayed."""

    t_s: float
    """When the trace says (seconds after the clock started)."""
    at_s: float
    """When it was done."""
    kind: str
    """add, notice or preempt."""
    node: str
    """The node's name in the trace."""


class TraceReplayer:
    """Apply a trace's adds, notices and preemptions to a `LocalCluster` on the trace's clock.

    Args:
        cluster: the cluster to drive.
        trace: the trace, already compressed to wall-clock seconds.
        fake_imds: give every node a fake metadata endpoint and publish notices on it.
    """

    def __init__(self, cluster: LocalCluster, trace: Trace, *, fake_imds: bool = False):
        self.cluster = cluster
        self.trace = trace
        self.fake_imds = fake_imds
        self._timeline = trace.timeline()
        self._next = 0
        self._imds: dict[str, FakeIMDS] = {}
        self._t0: float | None = None
        self._up: set[str] = set()  # nodes this replay added and has not removed
        self.applied: list[AppliedEvent] = []

    # -- what workers ask --------------------------------------------------------------------

    def imds_url(self, name: str) -> str | None:
        """The metadata endpoint of node `name` (None without fake_imds)."""
        imds = self._imds.get(name)
        return imds.url if imds is not None else None

    @property
    def num_preemptions(self) -> int:
        """Preemptions replayed so far."""
        return sum(ev.kind == "preempt" for ev in self.applied)

    # -- replay ------------------------------------------------------------------------------

    def add_initial(self) -> list[str]:
        """Add the nodes present when the trace starts (its adds at t = 0), before the clock runs."""
        names = []
        while self._next < len(self._timeline) and self._timeline[self._next].t_s <= 0:
            ev = self._timeline[self._next]
            self._apply(ev, 0.0)
            if ev.kind == "add":
                names.append(ev.node_id)
            self._next += 1
        return names

    def run(self, stop: threading.Event | None = None, *, loop: bool = False) -> None:
        """Start the trace's clock now and apply the remaining events on time; return at the end of
        the trace (with `loop`, never) or as soon as `stop` is set.

        Call it from the main thread (run the workload elsewhere): Ray installs a SIGTERM handler
        when it starts a node, which only the main thread may do.
        """
        assert self._t0 is None, "already replayed"
        stop = stop or threading.Event()
        self._t0 = time.monotonic()
        initial = [ev.node_id for ev in self._timeline if ev.t_s <= 0 and ev.kind == "add"]
        offset = 0.0
        # Looping, the nodes still up at the end that were not there at the start are preempted at
        # the wrap, warned like the trace's own preemptions (`_with_wrap_preemptions`).
        timeline = self._with_wrap_preemptions(self.trace) if loop else self._timeline
        while True:
            for ev in timeline[self._next :]:
                if stop.wait(max(0.0, self._t0 + offset + ev.t_s - time.monotonic())):
                    return
                self._apply_logged(ev, offset)
                self._next += 1
            if stop.wait(max(0.0, self._t0 + offset + self.trace.duration_s - time.monotonic())) or not loop:
                return
            # Wrap: back to the initial nodes, then the events after t = 0 again.
            offset += self.trace.duration_s
            for name in sorted(self._up - set(initial)):  # none unless a wrap preemption failed
                self._apply_logged(TraceEvent(0.0, name, "preempt"), offset)
            for name in initial:
                if name not in self._up:
                    self._apply_logged(TraceEvent(0.0, name, "add"), offset)
            self._next = next((i for i, ev in enumerate(timeline) if ev.t_s > 0), len(timeline))

    @staticmethod
    def _with_wrap_preemptions(trace: Trace) -> list[TraceEvent]:
        """The timeline of one pass of a looped replay: the trace's, plus a preemption at its end of
        every node then up that was not up at its start (the next pass starts from the initial
        nodes again), with the notice lead the trace's preemptions have (cut to the node's life)."""
        up: dict[str, float] = {}
        initial = set()
        for ev in trace.events:
            if ev.kind == "add":
                up[ev.node_id] = ev.t_s
                if ev.t_s <= 0:
                    initial.add(ev.node_id)
            else:
                up.pop(ev.node_id, None)
        leads = [ev.notice_lead_s for ev in trace.events if ev.kind == "preempt" and ev.notice_lead_s is not None]
        lead = max(leads) if leads else None
        end = trace.duration_s
        wrap = [
            TraceEvent(end, name, "preempt", None if lead is None else min(lead, end - added))
            for name, added in sorted(up.items())
            if name not in initial
        ]
        return replace(trace, events=(*trace.events, *wrap)).timeline() if wrap else trace.timeline()

    def _apply_logged(self, ev: TraceEvent, offset: float) -> None:
        try:
            self._apply(TraceEvent(ev.t_s + offset, ev.node_id, ev.kind, ev.notice_lead_s), self.elapsed_s())
        except Exception:
            logger.exception("replaying %s of %s at %.1f s failed", ev.kind, ev.node_id, ev.t_s + offset)

    @property
    def started_at(self) -> float | None:
        """`time.monotonic()` when the trace's clock started (None before `run`)."""
        return self._t0

    def elapsed_s(self) -> float:
        return 0.0 if self._t0 is None else time.monotonic() - self._t0

    def _apply(self, ev, at_s: float) -> None:
        if ev.kind == "add":
            labels = {}
            if self.fake_imds:
                self._imds[ev.node_id] = FakeIMDS(instance_id=f"i-{ev.node_id}").start()
                labels[IMDS_LABEL] = self._imds[ev.node_id].url
            self.cluster.add_node(ev.node_id, labels=labels)
            self._up.add(ev.node_id)
        elif ev.kind == "notice":
            if self.fake_imds:
                self._imds[ev.node_id].schedule_interruption(lead_s=ev.notice_lead_s)
        else:
            self._up.discard(ev.node_id)
            self.cluster.remove_node(ev.node_id)
            imds = self._imds.pop(ev.node_id, None)
            if imds is not None:
                imds.stop()
        self.applied.append(AppliedEvent(ev.t_s, at_s, ev.kind, ev.node_id))
        logger.info("t=%.1f s (trace %.1f s): %s %s", at_s, ev.t_s, ev.kind, ev.node_id)

    def remove_all(self) -> None:
        """Remove the nodes it added that are still up (the cluster is ready for another replay)."""
        for name in sorted(self._up):
            self.cluster.remove_node(name)
        self._up.clear()
        for imds in self._imds.values():
            imds.stop()
        self._imds.clear()


# -- fitting a trace to a small cluster (pure) -------------------------------------------------


def window(trace: Trace, start_s: float, length_s: float) -> Trace:
    """The stretch [start_s, start_s + length_s) of a trace, starting at 0 with the nodes alive then.

    Rebuilt from the availability counts (`Trace.from_counts`): node identities and notices are not
    kept (rescaled traces have none to keep); add notices afterwards with `with_notices`.
    """
    if start_s < 0 or length_s <= 0:
        raise ValueError(f"need start_s >= 0 and length_s > 0, got {start_s}, {length_s}")
    steps = trace.availability()
    alive_at_start = 0
    times, counts = [0.0], [0]
    for t, n in steps:
        if t <= start_s:
            alive_at_start = n
        elif t < start_s + length_s:
            times.append(t - start_s)
            counts.append(n)
    counts[0] = alive_at_start
    source = f"{trace.source} window [{start_s:g}, {start_s + length_s:g}) s"
    return Trace.from_counts(times, counts, duration_s=length_s, source=source, format="window")


def preemptions_of_working_nodes(trace: Trace, min_age_s: float = 0.0) -> int:
    """Preemptions of nodes that had been up at least `min_age_s` when preempted.

    A node added later than t = 0 needs time to start and load its model before it can hold work
    (8 s of wall time on this machine, 320 trace seconds at 40x); one preempted sooner ends no work
    under any scheduler. Nodes present at t = 0 count as up: a replay starts once they are ready.
    """
    born: dict[str, float] = {}
    n = 0
    for ev in trace.events:
        if ev.kind == "add":
            born[ev.node_id] = ev.t_s if ev.t_s > 0 else float("-inf")
        elif ev.kind == "preempt" and ev.t_s - born.get(ev.node_id, float("-inf")) >= min_age_s:
            n += 1
    return n


def busiest_window(trace: Trace, length_s: float, *, min_age_s: float = 0.0) -> float:
    """Start of the `length_s` stretch with the most preemptions that has nodes at its start and end.

    Stretches rank by their preemptions of nodes up at least `min_age_s`
    (`preemptions_of_working_nodes`), then by all their preemptions. Candidate starts lie a tenth of
    the length before each preemption (so it falls inside, not at t = 0); the earliest wins a tie.
    Nodes at the end matter to a replay that runs on past the window until its work is done. 0 when
    no stretch qualifies.
    """
    return _busiest(trace, length_s, min_age_s)[0]


def _busiest(trace: Trace, length_s: float, min_age_s: float) -> tuple[float, tuple[int, int]]:
    best, best_rank = 0.0, (-1, -1)
    for ev in trace.events:
        if ev.kind != "preempt":
            continue
        start = max(0.0, ev.t_s - 0.1 * length_s)
        w = window(trace, start, length_s)
        steps = w.availability()
        if steps[0][1] == 0 or steps[-1][1] == 0:
            continue
        rank = (preemptions_of_working_nodes(w, min_age_s), w.num_preemptions)
        if rank > best_rank:
            best, best_rank = start, rank
    return best, best_rank


def shortest_busy_window(
    trace: Trace, *, min_preemptions: int, min_age_s: float = 0.0, first_s: float = 2400.0, step_s: float = 1200.0
) -> float:
    """The shortest stretch length (`first_s`, `first_s + step_s`, ...) whose busiest stretch holds at
    least `min_preemptions` preemptions of nodes up `min_age_s`; the whole trace when none does.

    A replay that compares schedulers needs preemptions that end work; this sizes the stretch for
    them on each trace rather than one length for all (Bamboo's busiest 4,800 s at 3 nodes holds 7
    preemptions, but most end a node minutes after it joined).
    """
    length = first_s
    while length < trace.duration_s:
        if _busiest(trace, length, min_age_s)[1][0] >= min_preemptions:
            return length
        length += step_s
    return trace.duration_s


def fit_trace(
    path: str | Path,
    *,
    nodes: int = 3,
    window_s: float | None = 2400.0,
    start_s: float | None = None,
    compress: float = 40.0,
    notice_s: float = 0.0,
    min_age_s: float = 0.0,
    min_preemptions: int = 4,
) -> tuple[Trace, float]:
    """A shipped trace fitted to a small local cluster; returns it and the start of the stretch.

    Trimmed, rescaled to a peak of `nodes` spot nodes, cut to `window_s` trace seconds (None: the
    shortest length whose busiest stretch holds `min_preemptions` preemptions of nodes up
    `min_age_s`, `shortest_busy_window`) from `start_s` (default: the stretch with the most
    preemptions, of nodes up `min_age_s` first, `busiest_window`), compressed `compress` times, and
    with `notice_s` > 0 every preemption warned that many trace seconds ahead (AWS gives 120). The
    length chosen is the returned trace's `duration_s` times `compress`.
    """
    full = load_trace(path).trimmed().rescaled(nodes)
    if window_s is None:
        window_s = shortest_busy_window(full, min_preemptions=min_preemptions, min_age_s=min_age_s)
        if window_s >= full.duration_s and start_s is None:
            start_s = 0.0
    start = busiest_window(full, window_s, min_age_s=min_age_s) if start_s is None else start_s
    trace = window(full, start, window_s).compressed(compress)
    if notice_s > 0:
        trace = trace.with_notices(notice_s / compress)
    return trace, start


def _trace_to_dict(trace: Trace) -> dict:
    return {
        "events": [asdict(ev) for ev in trace.events],
        "duration_s": trace.duration_s,
        "source": trace.source,
        "format": trace.format,
    }


def _trace_from_dict(d: dict) -> Trace:
    return Trace(tuple(TraceEvent(**ev) for ev in d["events"]), d["duration_s"], d["source"], d["format"])


# -- the replay in a process of its own --------------------------------------------------------------


class ReplayProcess:
    """A local cluster replaying `trace` in a child process (`python -m spot.replay serve`).

    Args:
        trace: the trace, already fitted and compressed (`fit_trace`).
        fake_imds: a fake metadata endpoint per node, with the trace's notices.
        loop: replay the trace again and again until stopped.
        events_path: the child appends each applied event there as a JSON line.
        log_path: the child's log (stderr); None: this process's stderr.
        startup_timeout_s: how long to wait for the cluster and its initial nodes.
    """

    def __init__(
        self,
        trace: Trace,
        *,
        fake_imds: bool = False,
        loop: bool = False,
        events_path: str | Path | None = None,
        log_path: str | Path | None = None,
        startup_timeout_s: float = 120.0,
    ):
        self.trace = trace
        self.fake_imds = fake_imds
        self.loop = loop
        self.events_path = Path(events_path) if events_path else None
        self.log_path = Path(log_path) if log_path else None
        self.startup_timeout_s = startup_timeout_s
        self.address: str | None = None
        self.initial_nodes: list[str] = []
        self._proc: subprocess.Popen | None = None
        self._log = None

    def start(self) -> ReplayProcess:
        """Start the child; return once its cluster and the trace's initial nodes are up."""
        import select
        import tempfile

        spec = tempfile.NamedTemporaryFile("w", suffix=".json", prefix="spot-trace-", delete=False)
        with spec:
            json.dump(_trace_to_dict(self.trace), spec)
        cmd = [sys.executable, "-m", "spot.replay", "serve", spec.name]
        cmd += ["--fake-imds"] * self.fake_imds + ["--loop"] * self.loop
        cmd += ["--events", str(self.events_path)] if self.events_path else []
        self._log = open(self.log_path, "a") if self.log_path else None
        self._proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True, start_new_session=True
        )
        ready, _, _ = select.select([self._proc.stdout], [], [], self.startup_timeout_s)
        line = self._proc.stdout.readline() if ready else ""
        os.unlink(spec.name)
        if not line:
            self.stop()
            where = f"; see {self.log_path}" if self.log_path else ""
            raise RuntimeError(f"the trace replay's cluster did not start within {self.startup_timeout_s:g} s{where}")
        hello = json.loads(line)
        self.address, self.initial_nodes = hello["address"], hello["initial_nodes"]
        return self

    def go(self) -> None:
        """Start the trace's clock."""
        self._proc.stdin.write("go\n")
        self._proc.stdin.flush()

    def applied(self) -> list[AppliedEvent]:
        """The events the child applied so far (from its events file)."""
        if self.events_path is None or not self.events_path.exists():
            return []
        rows = []
        for line in self.events_path.read_text().splitlines():
            try:
                rows.append(AppliedEvent(**json.loads(line)))
            except (json.JSONDecodeError, TypeError):
                break  # a line being written
        return rows

    def stop(self, timeout_s: float = 60.0) -> None:
        """Close the child's input: it stops replaying and shuts its cluster down; wait for it."""
        proc, self._proc = self._proc, None
        if proc is not None:
            try:
                proc.stdin.close()
            except OSError:
                pass
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning("the trace replay did not stop within %g s: killing it", timeout_s)
                proc.kill()
                proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None


def serve(trace: Trace, *, fake_imds: bool, loop: bool, events_path: Path | None) -> None:
    """The child's side: cluster up, address out, clock on `go`, everything down when stdin closes."""
    cluster = LocalCluster()
    replayer = TraceReplayer(cluster, trace, fake_imds=fake_imds)
    stop = threading.Event()
    go = threading.Event()
    written = 0

    def listen() -> None:
        for line in sys.stdin:
            if line.strip() == "go":
                go.set()
        stop.set()  # the driver closed our input: it is done (or gone)
        go.set()

    def log_events() -> None:
        nonlocal written
        if events_path is None:
            return
        with events_path.open("a") as f:
            for ev in replayer.applied[written:]:
                f.write(json.dumps(asdict(ev)) + "\n")
            written = len(replayer.applied)

    try:
        initial = replayer.add_initial()
        log_events()
        print(json.dumps({"address": cluster.address, "initial_nodes": initial}), flush=True)
        threading.Thread(target=listen, name="stdin", daemon=True).start()
        go.wait()
        if not stop.is_set():
            writer_stop = threading.Event()

            def write_events() -> None:
                while not writer_stop.wait(0.2):
                    log_events()

            writer = threading.Thread(target=write_events, name="events", daemon=True)
            writer.start()
            replayer.run(stop=stop, loop=loop)
            stop.wait()  # after the trace: keep the cluster as it left it until the driver is done
            writer_stop.set()
            writer.join()
            log_events()
    finally:
        replayer.remove_all()
        cluster.shutdown()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m spot.replay", description="Replay a spot trace on a local Ray cluster."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    srv = sub.add_parser("serve", help="run a cluster that replays a fitted trace (JSON) until stdin closes")
    srv.add_argument("trace_json", type=Path)
    srv.add_argument("--fake-imds", action="store_true")
    srv.add_argument("--loop", action="store_true")
    srv.add_argument("--events", type=Path, default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="replay: %(message)s")
    trace = _trace_from_dict(json.loads(args.trace_json.read_text()))
    serve(trace, fake_imds=args.fake_imds, loop=args.loop, events_path=args.events)


if __name__ == "__main__":
    main()
