"""Replay a spot-capacity trace on a real local Ray cluster (issue 4 item 2(c)).

`ReplayCluster` is a `ray.cluster_utils.Cluster` on 127.0.0.1: an on-demand head ({"on_demand": 1})
and spot nodes added and removed by name ({"spot": 1}, one CPU, label `spot-trace-node=<name>`).
A removal is hard (SIGKILL, `allow_graceful=False`): what a reclaimed spot instance looks like.
The GCS health check runs every second and declares a node dead after two misses, so a killed node
is seen in ~2-4 s instead of Ray's default ~15 s (design.md §4).

`TraceReplayer` drives the cluster from `Trace.timeline()` on the trace's clock (compress the
trace first), from the main thread while the workload runs on another. With `fake_imds=True` every node gets its own `FakeIMDS`, and a
`notice` event publishes the interruption there its lead time ahead; workers on the node watch it
with `MetadataWatcher` (`imds_url`). Adding a node blocks for ~2-4 s here, so an event right after
an add is late by that much; `applied` records when each event really happened.

Traces of 12-32 nodes do not fit 2 cores: `Trace.rescaled(n)` scales the node count, `window()`
cuts a stretch of it, `busiest_window()` picks the stretch with the most preemptions.

    cluster = ReplayCluster()
    trace = window(load_trace(f).trimmed().rescaled(3), start_s, 1800).compressed(30).with_notices(4.0)
    replayer = TraceReplayer(cluster, trace, fake_imds=True)
    replayer.add_initial()      # the nodes present at t = 0
    done = threading.Event()
    threading.Thread(target=lambda: (workload(), done.set())).start()
    replayer.run(stop=done)     # the trace's clock starts now; returns at its end or when done is set
    replayer.remove_all()       # the spot nodes still up
    cluster.shutdown()
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass

from spot.fake_imds import FakeIMDS
from spot.localray import ON_DEMAND, SPOT, import_ray_on_loopback
from spot.traces import Trace

logger = logging.getLogger(__name__)

NODE_LABEL = "spot-trace-node"
"""Label carrying a spot node's name in the trace."""


class ReplayCluster:
    """A local multi-node Ray cluster whose spot nodes come and go by name.

    Args:
        head_cpus: CPUs of the on-demand head (the queue needs none; the driver runs beside it).
        node_cpus: CPUs of each spot node.
        health_check_period_ms: GCS health-check period.
        health_check_failure_threshold: missed checks before a node is declared dead.
        object_store_mb: object store of each node.
    """

    def __init__(
        self,
        *,
        head_cpus: int = 1,
        node_cpus: int = 1,
        health_check_period_ms: int = 1000,
        health_check_failure_threshold: int = 2,
        object_store_mb: int = 100,
    ):
        import_ray_on_loopback()
        from ray.cluster_utils import Cluster

        self._node_args = {
            "node_ip_address": "127.0.0.1",
            "num_cpus": node_cpus,
            "object_store_memory": object_store_mb << 20,
        }
        self.cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "node_ip_address": "127.0.0.1",
                "num_cpus": head_cpus,
                "resources": {ON_DEMAND: 1},
                "object_store_memory": object_store_mb << 20,
                "include_dashboard": False,
                "_system_config": {
                    "health_check_period_ms": health_check_period_ms,
                    "health_check_failure_threshold": health_check_failure_threshold,
                },
            },
        )
        self._nodes: dict = {}  # name -> ray._private.node.Node
        self._lock = threading.Lock()

    @property
    def address(self) -> str:
        return self.cluster.address

    def add_node(self, name: str) -> str:
        """Start a spot node called `name`; returns its Ray node id (hex)."""
        with self._lock:
            if name in self._nodes:
                raise ValueError(f"node {name!r} is already up")
        # With Cluster's own wait (ray._private.services.wait_for_node, which sets up a new GCS
        # client each time) an add took ~2.1 s on 2 cores instead of ~1.1 s, and the later events
        # of a burst of adds were late by that much each. The cluster's connected node table
        # answers in milliseconds.
        node = self.cluster.add_node(wait=False, **self._node_args, resources={SPOT: 1}, labels={NODE_LABEL: name})
        self._wait_registered(name, node.node_id)
        with self._lock:
            self._nodes[name] = node
        return node.node_id

    def _wait_registered(self, name: str, node_id: str, timeout_s: float = 30.0) -> None:
        """Return once node `node_id` is alive in the GCS node table."""
        deadline = time.monotonic() + timeout_s
        while not any(n["NodeID"] == node_id and n["Alive"] for n in self.cluster.global_state.node_table()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"spot node {name!r} ({node_id[:8]}) did not register within {timeout_s} s")
            time.sleep(0.02)

    def remove_node(self, name: str, *, graceful: bool = False) -> None:
        """Kill spot node `name`: SIGKILL to its raylet and every process under it, unless `graceful`.

        The worker processes go first, together: a reclaimed instance vanishes whole, while a lone
        SIGKILLed raylet leaves its workers running (and committing) for a moment.
        """
        import psutil
        from ray._private import ray_constants

        with self._lock:
            node = self._nodes.pop(name)
        if not graceful:
            raylet = node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process
            try:
                children = psutil.Process(raylet.pid).children(recursive=True)
            except psutil.NoSuchProcess:
                children = []
            for proc in children:
                try:
                    proc.kill()
                except psutil.NoSuchProcess:
                    pass
        self.cluster.remove_node(node, allow_graceful=graceful)

    def node_names(self) -> list[str]:
        with self._lock:
            return list(self._nodes)

    def node_id(self, name: str) -> str:
        with self._lock:
            return self._nodes[name].node_id

    def shutdown(self) -> None:
        """Stop every node and the head (disconnects this process from Ray first)."""
        import ray

        if ray.is_initialized():
            ray.shutdown()
        self.cluster.shutdown()
        self._nodes.clear()
        os.environ.pop("RAY_ADDRESS", None)  # set by Cluster; would leak into later ray.init() calls


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
    """Apply a trace's adds, notices and preemptions to a `ReplayCluster` on the trace's clock.

    Args:
        cluster: the cluster to drive.
        trace: the trace, already compressed to wall-clock seconds.
        fake_imds: give every node a fake metadata endpoint and publish notices on it.
    """

    def __init__(self, cluster: ReplayCluster, trace: Trace, *, fake_imds: bool = False):
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

    def run(self, stop: threading.Event | None = None) -> None:
        """Start the trace's clock now and apply the remaining events on time; return at the end of
        the trace or as soon as `stop` is set.

        Call it from the main thread (run the workload on another): Ray installs a SIGTERM handler
        when it starts a node, which only the main thread may do.
        """
        assert self._t0 is None, "already replayed"
        stop = stop or threading.Event()
        self._t0 = time.monotonic()
        for ev in self._timeline[self._next :]:
            if stop.wait(max(0.0, self._t0 + ev.t_s - time.monotonic())):
                return
            try:
                self._apply(ev, self.elapsed_s())
            except Exception:  # noqa: BLE001 - log and keep replaying: one bad event must not freeze capacity
                logger.exception("replaying %s of %s at %.1f s failed", ev.kind, ev.node_id, ev.t_s)
            self._next += 1
        stop.wait(max(0.0, self._t0 + self.trace.duration_s - time.monotonic()))

    @property
    def started_at(self) -> float | None:
        """`time.monotonic()` when the trace's clock started (None before `run`)."""
        return self._t0

    def elapsed_s(self) -> float:
        return 0.0 if self._t0 is None else time.monotonic() - self._t0

    def _apply(self, ev, at_s: float) -> None:
        if ev.kind == "add":
            if self.fake_imds:
                self._imds[ev.node_id] = FakeIMDS(instance_id=f"i-{ev.node_id}").start()
            self.cluster.add_node(ev.node_id)
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


def busiest_window(trace: Trace, length_s: float) -> float:
    """Start of the `length_s` stretch with the most preemptions that has nodes at its start and end.

    Candidate starts lie a tenth of the length before each preemption (so it falls inside, not at
    t = 0); the earliest wins a tie. Nodes at the end matter to a replay that runs on past the
    window until its work is done. 0 when no stretch qualifies.
    """
    best, best_count = 0.0, -1
    for ev in trace.events:
        if ev.kind != "preempt":
            continue
        start = max(0.0, ev.t_s - 0.1 * length_s)
        w = window(trace, start, length_s)
        steps = w.availability()
        if steps[0][1] == 0 or steps[-1][1] == 0:
            continue
        if w.num_preemptions > best_count:
            best, best_count = start, w.num_preemptions
    return best
