"""The one local cluster: a real multi-node Ray cluster on this machine, bound to 127.0.0.1.

`LocalCluster` is a `ray.cluster_utils.Cluster`: an on-demand head ({"on_demand": 1}, where the
driver, the queue and the on-demand workers run) and spot nodes ({"spot": 1}, one CPU each,
labelled with their name) added and removed by name. A removal is hard by default (SIGKILL to the
raylet and every process under it, `allow_graceful=False`): what a reclaimed spot instance looks
like. The GCS health check runs every second and declares a node dead after two misses, so a
killed node is seen in ~2-4 s instead of Ray's default ~15 s. Three nodes start in a few seconds.

Ray maps 127.0.0.1 to the machine's outward address unless RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 is
set before `ray` is first imported (`spot.localray.import_ray_on_loopback`), which this class
does; a user's cluster (`ray.init(address=...)`) is joined as it is.

Ray starts a node's processes from the thread that calls `add_node`, and installs a SIGTERM
handler there, which only a process's main thread may do: drive a cluster from the main thread
(`spot.replay` runs the replay of a trace in a process of its own for that reason).

    cluster = LocalCluster(num_spot_nodes=2)
    ray.init(address=cluster.address)
    cluster.add_node("spot-7")        # another spot node, labelled spot-trace-node=spot-7
    cluster.remove_node("spot-7")     # SIGKILL: a preemption without notice
    cluster.shutdown()
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator

from spot.localray import import_ray_on_loopback
from spotlight.core.cost import ON_DEMAND, SPOT

NODE_LABEL = "spot-trace-node"
"""Label carrying a spot node's name."""
IMDS_LABEL = "spot-imds-url"
"""Label naming a node's instance-metadata endpoint (a trace replay's fake one, `spot.replay`); the
runtime's workers on the node watch it for notices."""


# -- emulating separate machines on one host -------------------------------------------------------
# A local cluster's nodes are processes on the trainer's own CPUs: whatever a spot worker computes
# is taken from the trainer, which real spot nodes never do. Pinning the cluster's processes to CPUs
# of their own (they inherit the mask of the thread that starts them) and the trainer's threads to
# the rest restores that separation at the size this host has. Linux only (sched_setaffinity).


def split_cpus(cluster_cpus: int, *, field: str = "cluster_cpus") -> tuple[set[int], set[int]]:
    """(the trainer's CPUs, the cluster's): the last `cluster_cpus` of the CPUs this process may use
    for the cluster, the others for the trainer. `field` names the setting in the error."""
    cpus = sorted(os.sched_getaffinity(0))
    if not 0 < cluster_cpus < len(cpus):
        raise ValueError(
            f"{field}={cluster_cpus}: the cluster needs at least one of this process's {len(cpus)} CPUs "
            f"and must leave the trainer one (1..{len(cpus) - 1})"
        )
    return set(cpus[:-cluster_cpus]), set(cpus[-cluster_cpus:])


@contextlib.contextmanager
def children_on(cpus: set[int]) -> Iterator[None]:
    """Processes the calling thread starts inside the block (and theirs) run on `cpus`: the thread's
    own mask is set for the block, and a child inherits its parent thread's mask."""
    old = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, old)


def pin_process(cpus: set[int]) -> None:
    """Every thread of this process on `cpus` (threads started later inherit it from theirs)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:
            pass  # a thread that ended meanwhile


class LocalCluster:
    """A local multi-node Ray cluster whose spot nodes come and go by name.

    Args:
        num_spot_nodes: spot nodes to start with (named spot-0, spot-1, ...).
        head_cpus: CPUs of the on-demand head (the queue and on-demand workers take none).
        node_cpus: CPUs of each spot node.
        health_check_period_ms: GCS health-check period.
        health_check_failure_threshold: missed checks before a node is declared dead.
        object_store_mb: object store of each node.
    """

    def __init__(
        self,
        num_spot_nodes: int = 0,
        *,
        head_cpus: int = 1,
        node_cpus: int = 1,
        health_check_period_ms: int = 1000,
        health_check_failure_threshold: int = 2,
        object_store_mb: int = 100,
    ):
        import_ray_on_loopback()
        from ray.cluster_utils import Cluster

        if num_spot_nodes < 0:
            raise ValueError(f"num_spot_nodes must be >= 0, got {num_spot_nodes}")
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
                    # On a shared CPU the raylets' periodic wake-ups steal time from the trainer's
                    # threads: report resources once a second (default 100 ms) and check the disk
                    # every 10 s (default 1 s). benchmarks/spot_training.py's no-preemption ratio
                    # measured 1.22-1.23 with these against 1.25 with the defaults (2 cores).
                    "raylet_report_resources_period_milliseconds": 1000,
                    "local_fs_monitor_interval_ms": 10000,
                },
            },
        )
        self._nodes: dict = {}  # name -> ray._private.node.Node
        self._lock = threading.Lock()
        try:
            for i in range(num_spot_nodes):
                self.add_node(f"spot-{i}")
        except BaseException:
            self.shutdown()
            raise

    @property
    def address(self) -> str:
        return self.cluster.address

    def add_node(self, name: str, *, slots: int = 1, labels: dict[str, str] | None = None) -> str:
        """Start a spot node called `name` with `slots` units of the `spot` resource (a worker each:
        a multi-GPU instance) and more `labels`; returns its Ray node id (hex)."""
        with self._lock:
            if name in self._nodes:
                raise ValueError(f"node {name!r} is already up")
        # With Cluster's own wait (ray._private.services.wait_for_node, which sets up a new GCS
        # client each time) an add took ~2.1 s on 2 cores instead of ~1.1 s, and the later events
        # of a burst of adds were late by that much each. The cluster's connected node table
        # answers in milliseconds.
        node = self.cluster.add_node(
            wait=False, **self._node_args, resources={SPOT: slots}, labels={NODE_LABEL: name, **(labels or {})}
        )
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
        # A node Ray drained on a notice may have shut its raylet down already.
        raylets = node.all_processes.get(ray_constants.PROCESS_TYPE_RAYLET) or []
        if not graceful and raylets:
            try:
                children = psutil.Process(raylets[0].process.pid).children(recursive=True)
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
