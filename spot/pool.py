"""The runtime's one pool: workers on every node of the cluster, and the SP groups among them.

    WorkerPool    the workers (`spot.worker.Worker`, one Ray actor per device slot, runner built
                  once) on the cluster's nodes: one per unit of the `spot` resource of every alive
                  spot node, started as nodes join, and `on_demand_workers` on the driver's own
                  (on-demand) node; and the groups among them. `form` starts a generation: a fresh
                  torch.distributed world of the chosen members on a new prefix of one long-lived
                  TCPStore hosted here; `poll` reports groups whose run ended and which members died.
    plan_groups   which free workers form which groups (pure)

The driver that feeds them from the queue is `spot.runtime.Runtime`.

A group (of one worker, or of several for sequence parallelism) pulls from the queue under its own
id, a fresh one per generation. When a group's run ends the queue fences that id and requeues its
job from the last commit (a group that released its job on a notice has none); the survivors are
free at once and re-form into the largest groups the model's head count allows, from the state
they hold (3 survivors at degree 4 of 4 heads: degrees 2 and 1).

Death detection, in the order it happens: the survivors' collectives fail within ~10 ms of a
member's process dying (`spot.worker`) and their `run` calls return `broken`; Ray reports the dead
member's `run` as `ActorDiedError` (~15 ms for a killed process; ~2-4 s for a lost node with
`spot.cluster.LocalCluster`'s health check); a worker whose node leaves `ray.nodes()` is dead too.
`poll` waits up to `settle_s` for every member of a group that ended; a member still silent then is
told to `abort` (its process group closes, so its blocked collective fails) and, if it stays silent,
is counted lost. A worker that stops reporting loses its lease after the queue's lease timeout anyway.

Preemptions are accounted per spot node: a node lost (gone from `ray.nodes()`) is a preemption; it
*hit work* if a lease ended because of it: a lease revoked when its worker died there, or a job
committed and handed back on its notice (`nodes_hit`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from spot.cluster import IMDS_LABEL
from spot.localray import kill_actor
from spot.runner import RunnerFactory
from spot.weights import WeightsMismatchError
from spot.worker import RunReport, Worker
from spotlight.core.cost import ON_DEMAND, SPOT

logger = logging.getLogger(__name__)


class GroupFormError(RuntimeError):
    """A generation did not form (a member died before or during the rendezvous); the live ones are free."""


def plan_groups(workers: Sequence[tuple[str, str]], max_degree: int, num_heads: int | None) -> list[list[str]]:
    """Split workers into SP groups: greedily the largest degree <= max_degree that divides num_heads.

    Args:
        workers: (worker_id, node_id) of the free workers; a group keeps to as few nodes as it can
            (workers are taken node by node).
        max_degree: the largest group wanted.
        num_heads: attention heads of the model (Ulysses splits heads over the ranks); None: the
            runner has no SP steps, every group has one worker.

    Returns:
        Groups as lists of worker ids, largest first; every worker is in one group.
    """
    if max_degree < 1:
        raise ValueError(f"max_degree must be >= 1, got {max_degree}")
    ordered = [w for w, _ in sorted(workers, key=lambda wn: (wn[1], wn[0]))]
    groups = []
    while ordered:
        fits = [d for d in range(2, min(max_degree, len(ordered)) + 1) if num_heads and num_heads % d == 0]
        degree = max(fits, default=1)
        groups.append(ordered[:degree])
        ordered = ordered[degree:]
    return groups


@dataclass(eq=False)
class _Member:
    worker_id: str
    actor: Any
    pool: str
    node_id: str
    ready_ref: Any = None
    pid: int = 0
    version: int | None = None
    state: str = "loading"  # loading -> free <-> busy; -> dead | retired
    group: str | None = None
    spawned_at: float = 0.0
    """time.monotonic() of the start request."""
    loaded_at: float = 0.0
    """time.monotonic() when its runner was built (its `info` answered)."""
    load_s: float = 0.0
    """Seconds its constructor took (the runner, without the process start)."""


@dataclass(eq=False)
class Group:
    """One generation: a fresh process group among `members` (rank = position)."""

    group_id: str
    generation: int
    members: list[str]
    pool: str
    rendezvous_s: float = 0.0
    """The slowest member's `join` (destroy the old world, initialise the new one)."""
    run_refs: dict[str, Any] = field(default_factory=dict)

    @property
    def degree(self) -> int:
        return len(self.members)


@dataclass
class GroupOutcome:
    """How a group's run ended."""

    group_id: str
    reports: dict[str, RunReport]
    """Per surviving member."""
    dead: list[str]
    """Members whose process is gone (or that stayed silent past `settle_s` after an abort)."""
    ended_at: float
    """time.monotonic() when `poll` first saw the group end."""

    @property
    def broken(self) -> bool:
        return bool(self.dead) or any(r.broken for r in self.reports.values())

    @property
    def released(self) -> bool:
        return any(r.released for r in self.reports.values())

    @property
    def noticed(self) -> list[str]:
        """Members that had a notice (their node is going away)."""
        return [w for w, r in self.reports.items() if r.noticed]


class WorkerPool:
    """Workers on the cluster's nodes and the SP groups among them.

    Args:
        make_runner: builds each worker's `JobRunner` (picklable; it runs in the worker's process).
        sp_degree: the largest group to form (groups are the largest that divide the runner's heads).
        on_demand_workers: workers on the driver's own node (pool "on_demand"); they take no Ray
            resources: they use the devices the driver (the trainer) leaves idle while it waits.
        worker_kwargs: more `Worker` arguments, for every worker.
        on_demand_kwargs: more `Worker` arguments for the on-demand workers (over `worker_kwargs`).
        node_kwargs: more arguments per spot node, from its `ray.nodes()` entry:
            `node_kwargs(node) -> dict` (a speed, the node's metadata endpoint).
        imds_endpoint: instance-metadata endpoint spot workers watch for notices, unless their node
            carries `IMDS_LABEL` (None: no watcher; AWS's is `spot.metadata.DEFAULT_ENDPOINT`).
        gpu: each worker takes one GPU (CUDA runners: groups use NCCL).
        worker_cls: the actor class (tests pass a subclass that injects faults).
        store_host: address of the rendezvous TCPStore this process hosts (reachable by every node).
        timeout_s: rendezvous and collective timeout of each generation (the last-resort detector).
        settle_s: how long `poll` waits for the other members of a group that ended.
        suspect_s: after a worker became unreachable (`ActorUnavailableError`), wait this long
            before starting another on its node, which is likely dying but not yet declared dead.
        respawn_delay_s: after a worker died on a node that lives on (a crash, a kill), wait this
            long before starting another in its slot.
    """

    def __init__(
        self,
        make_runner: RunnerFactory,
        *,
        sp_degree: int = 1,
        on_demand_workers: int = 0,
        worker_kwargs: dict | None = None,
        on_demand_kwargs: dict | None = None,
        node_kwargs: Callable[[dict], dict] | None = None,
        imds_endpoint: str | None = None,
        gpu: bool = False,
        worker_cls: type = Worker,
        store_host: str = "127.0.0.1",
        timeout_s: float = 30.0,
        settle_s: float = 2.0,
        suspect_s: float = 15.0,
        respawn_delay_s: float = 0.0,
    ):
        import ray
        import torch.distributed as dist

        if sp_degree < 1 or on_demand_workers < 0:
            raise ValueError(f"need sp_degree >= 1 and on_demand_workers >= 0, got {sp_degree}, {on_demand_workers}")
        self._ray = ray
        self.make_runner = make_runner
        self.sp_degree = sp_degree
        self.on_demand_workers = on_demand_workers
        self.worker_kwargs = dict(worker_kwargs or {})
        self.on_demand_kwargs = dict(on_demand_kwargs or {})
        self.node_kwargs = node_kwargs
        self.imds_endpoint = imds_endpoint
        self.gpu = gpu
        self.timeout_s = timeout_s
        self.settle_s = settle_s
        self.suspect_s = suspect_s
        self.respawn_delay_s = respawn_delay_s
        self._cls = ray.remote(worker_cls)
        self.here = ray.get_runtime_context().get_node_id()
        # One long-lived store for every generation; each generation uses its own key prefix.
        self._tcp = dist.TCPStore(store_host, 0, is_master=True, wait_for_workers=False) if sp_degree > 1 else None
        self.store_host = store_host
        self.workers: dict[str, _Member] = {}
        self.groups: dict[str, Group] = {}
        self.generation = 0
        self.num_heads: int | None = None
        self._next_id = 0
        self._retired_nodes: set[str] = set()
        self._deaths: dict[str, tuple[float, bool]] = {}  # live node -> (when a worker died there, unreachable)
        self._spot_nodes: dict[str, dict] = {}  # alive spot node id -> its ray.nodes() entry
        self._news: list[tuple[str, str]] = []  # (worker_id, event) since the last `maintain`
        self.nodes_lost: list[str] = []
        """Spot nodes seen alive and then gone, in order (the preemptions)."""
        self.nodes_hit: set[str] = set()
        """Of those (or of nodes with a notice), the ones where a lease ended: work was hit."""
        self.events: list[tuple[float, str, str]] = []
        """(time.monotonic(), worker, group or node id, event)."""

    # -- membership ---------------------------------------------------------------------------

    def maintain(self) -> list[tuple[str, str]]:
        """Start workers on new spot nodes (and the on-demand ones), promote those whose runner is
        built, mark those whose node is gone dead; returns [(worker_id, event)] since the last call."""
        ray = self._ray
        now = time.monotonic()
        nodes = {n["NodeID"]: n for n in ray.nodes() if n["Alive"]}
        spot = {nid: n for nid, n in nodes.items() if n["Resources"].get(SPOT, 0) > 0}
        for nid in self._spot_nodes.keys() - spot.keys():
            self.nodes_lost.append(nid)
            self._note(nid, "node lost")
        for nid in spot.keys() - self._spot_nodes.keys():
            self._note(nid, "node joined")
        self._spot_nodes = spot
        for m in self.workers.values():
            if m.state in ("dead", "retired"):
                continue
            if m.node_id not in nodes:
                self._retire(m, "dead", f"its node {m.node_id[:8]} is gone")
            elif m.state == "loading" and ray.wait([m.ready_ref], timeout=0)[0]:
                try:
                    info = ray.get(m.ready_ref)
                except ray.exceptions.RayError as err:
                    self._retire(m, "dead", f"failed to start: {err}")
                    continue
                m.pid, m.load_s, m.loaded_at, m.version = info["pid"], info["load_s"], now, info["version"]
                self.num_heads = info["num_heads"]
                m.state = "free"
                self._note(m.worker_id, "ready")
        # Spot slots: one worker per unit of the node's spot resource.
        suspect = {
            n
            for n, (t, unreachable) in self._deaths.items()
            if now - t < (self.suspect_s if unreachable else self.respawn_delay_s)
        }
        for nid, node in sorted(spot.items()):
            if nid in self._retired_nodes or nid in suspect:
                continue
            have = sum(1 for m in self.workers.values() if m.node_id == nid and m.state not in ("dead", "retired"))
            for _ in range(int(node["Resources"][SPOT]) - have):
                self._spawn(SPOT, node)
        # The on-demand workers on this node.
        have = sum(1 for m in self.workers.values() if m.pool == ON_DEMAND and m.state not in ("dead", "retired"))
        for _ in range(self.on_demand_workers - have):
            self._spawn(ON_DEMAND, nodes.get(self.here, {"NodeID": self.here, "Labels": {}}))
        news, self._news = self._news, []
        return news

    def _note(self, who: str, event: str) -> None:
        self.events.append((time.monotonic(), who, event))
        self._news.append((who, event))

    def _spawn(self, pool: str, node: dict) -> str:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        node_id = node["NodeID"]
        worker_id = f"w{self._next_id}"
        self._next_id += 1
        kwargs = dict(self.worker_kwargs)
        if pool == SPOT:
            imds = node.get("Labels", {}).get(IMDS_LABEL) or self.imds_endpoint
            kwargs.update({"imds_endpoint": imds} if imds else {})
            kwargs.update(self.node_kwargs(node) if self.node_kwargs else {})
            resources = {"num_cpus": 0 if self.gpu else 1, "num_gpus": int(self.gpu), "resources": {SPOT: 1}}
        else:
            resources = {"num_cpus": 0, "num_gpus": 0}  # the driver's devices, idle while it waits
            kwargs.update(self.on_demand_kwargs)
        kwargs.setdefault("backend", "nccl" if self.gpu else "gloo")
        actor = self._cls.options(
            **resources,
            max_concurrency=4,
            max_restarts=0,
            max_task_retries=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        ).remote(worker_id, self.make_runner, pool=pool, **kwargs)
        self.workers[worker_id] = _Member(
            worker_id, actor, pool, node_id, actor.info.remote(), spawned_at=time.monotonic()
        )
        self._note(worker_id, f"started on {node_id[:8]} ({pool})")
        return worker_id

    def spawn(self, n: int, node_id: str, pool: str = SPOT) -> list[str]:
        """Start `n` more workers on node `node_id` now (beyond its slots; for tests and benchmarks)."""
        node = next(n_ for n_ in self._ray.nodes() if n_["NodeID"] == node_id)
        return [self._spawn(pool, node) for _ in range(n)]

    def _retire(self, m: _Member, state: str, why: str) -> None:
        """A worker is gone ("dead") or leaves for good after a notice ("retired")."""
        if m.state in ("dead", "retired"):
            return
        if state == "dead":
            logger.info("worker %s on node %s lost: %s", m.worker_id, m.node_id[:8], why)
            kill_actor(self._ray, m.actor)
        m.state = state
        self._note(m.worker_id, "died" if state == "dead" else "left")

    def wait_ready(self, num_workers: int, timeout_s: float) -> None:
        """Maintain until `num_workers` workers have their runner built."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.maintain()
            if len(self.alive()) >= num_workers:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(self.alive())} of {num_workers} workers ready after {timeout_s} s")
            time.sleep(0.1)

    def load_weights(
        self, ids: Sequence[str], version: int, *, source: str = "auto", store_url: str = ""
    ) -> dict[str, dict]:
        """Bring free workers `ids` to weights `version`: copied from a sibling on their node that
        holds it ("auto"; the first on a node without one fetches from `store_url`, the others then
        copy from it), or always from the store ("store"). A sibling copy refused
        (`WeightsMismatchError`: the sibling moved on meanwhile) falls back to the store."""
        if source not in ("auto", "store"):
            raise ValueError(f"source must be 'auto' or 'store', got {source!r}")
        ray = self._ray
        pending = list(ids)
        done: dict[str, dict] = {}
        while pending:
            calls, fetching_nodes = {}, set()
            for w in pending:
                m = self.workers[w]
                sibling = self.sibling(m.node_id, version, exclude=w) if source == "auto" else None
                if sibling is not None:
                    calls[w] = m.actor.copy_weights_from.remote(self.workers[sibling].actor, version)
                elif m.node_id not in fetching_nodes or source == "store":
                    fetching_nodes.add(m.node_id)
                    calls[w] = m.actor.fetch_weights.remote(store_url, version)
            for w, ref in calls.items():
                m = self.workers[w]
                try:
                    done[w] = ray.get(ref)
                except WeightsMismatchError as err:
                    logger.warning("worker %s: sibling copy refused (%s); fetching from the store", w, err)
                    done[w] = {**ray.get(m.actor.fetch_weights.remote(store_url, version)), "refused": str(err)}
                done[w]["start_and_load_s"] = m.loaded_at - m.spawned_at
                done[w]["load_s"] = m.load_s
                m.version = version
                self._note(w, f"weights from {done[w]['source']}")
            pending = [w for w in pending if w not in done]
        return done

    def sibling(self, node_id: str, version: int, *, exclude: str | None = None) -> str | None:
        """A live worker on `node_id` that holds weights `version`, or None."""
        for m in self.workers.values():
            if m.worker_id != exclude and m.node_id == node_id and m.version == version and m.state in ("free", "busy"):
                return m.worker_id
        return None

    def free(self, pool: str | None = None) -> list[str]:
        """Workers with a built runner, in no running group."""
        return [w for w, m in self.workers.items() if m.state == "free" and pool in (None, m.pool)]

    def alive(self, pool: str | None = None) -> list[str]:
        return [w for w, m in self.workers.items() if m.state in ("free", "busy") and pool in (None, m.pool)]

    def actor(self, worker_id: str):
        return self.workers[worker_id].actor

    def pid(self, worker_id: str) -> int:
        return self.workers[worker_id].pid

    def node_of(self, worker_id: str) -> str:
        return self.workers[worker_id].node_id

    def spot_nodes(self) -> list[str]:
        """Spot nodes alive at the last `maintain`."""
        return list(self._spot_nodes)

    def wake(self) -> None:
        """Tell every running worker to pull now (new jobs)."""
        for g in self.running():
            for w in g.members:
                self.workers[w].actor.wake.remote()

    # -- groups --------------------------------------------------------------------------------

    def form(self, worker_ids: Sequence[str]) -> Group:
        """A new generation among free workers `worker_ids` (rank = position); returns once all joined."""
        members = [self.workers[w] for w in worker_ids]
        bad = [m.worker_id for m in members if m.state != "free"]
        if bad:
            raise ValueError(f"workers {bad} are not free to join a group")
        pools = {m.pool for m in members}
        if len(pools) != 1:
            raise ValueError(f"workers {list(worker_ids)} belong to different pools {sorted(pools)}")
        self.generation += 1
        gen = self.generation
        port = self._tcp.port if self._tcp is not None else 0
        refs = [
            m.actor.join.remote(gen, rank, len(members), self.store_host, port, self.timeout_s)
            for rank, m in enumerate(members)
        ]
        seconds, failed = [], []
        for m, ref in zip(members, refs):
            try:
                seconds.append(self._ray.get(ref))
            except self._ray.exceptions.RayActorError:
                self._retire(m, "dead", "died while free")  # noticed only now
                failed.append(m.worker_id)
            except self._ray.exceptions.RayTaskError as err:  # its rendezvous timed out: a member was missing
                failed.append(f"{m.worker_id} ({type(err.cause).__name__})")
        if failed:
            raise GroupFormError(f"generation {gen} of {list(worker_ids)} did not form: {failed}")
        group = Group(f"g{gen}", gen, list(worker_ids), pools.pop(), rendezvous_s=max(seconds))
        for m in members:
            m.group = group.group_id
        self.groups[group.group_id] = group
        self._note(group.group_id, f"formed degree {group.degree}")
        return group

    def start(self, group: Group, queue) -> None:
        """Every member of `group` starts serving `queue`."""
        for w in group.members:
            m = self.workers[w]
            m.state = "busy"
            group.run_refs[w] = m.actor.run.remote(queue, group.group_id)

    def notify(self, group_id: str, *, leaving: Sequence[str] = ()) -> None:
        """Ask a running group to commit its job at the next step and stop; `leaving` workers retire."""
        for w in self.groups[group_id].members:
            self.workers[w].actor.notify.remote(w in leaving)

    def running(self) -> list[Group]:
        return [g for g in self.groups.values() if g.run_refs]

    def poll(self, timeout_s: float = 0.0) -> list[GroupOutcome]:
        """Groups whose run ended since the last call (waits up to `timeout_s` for one)."""
        ray = self._ray
        refs = [ref for g in self.running() for ref in g.run_refs.values()]
        if not refs:
            return []
        ready, _ = ray.wait(refs, num_returns=1, timeout=timeout_s)
        if not ready:
            return []
        ended_at = time.monotonic()
        ready_set = set(ray.wait(refs, num_returns=len(refs), timeout=0)[0])
        outcomes = []
        for g in self.running():
            if any(ref in ready_set for ref in g.run_refs.values()):
                outcomes.append(self._settle(g, ended_at))
        return outcomes

    def _settle(self, group: Group, ended_at: float) -> GroupOutcome:
        ray = self._ray
        refs = group.run_refs
        ray.wait(list(refs.values()), num_returns=len(refs), timeout=self.settle_s)
        silent = [w for w, ref in refs.items() if not ray.wait([ref], timeout=0)[0]]
        if silent:
            # A member blocked on a live peer: aborting its group closes its sockets, so it fails too.
            for w in silent:
                self.workers[w].actor.abort.remote()
            ray.wait([refs[w] for w in silent], num_returns=len(silent), timeout=self.settle_s)
        reports, dead, failed = {}, [], []
        for w, ref in refs.items():
            m = self.workers[w]
            m.group = None
            if not ray.wait([ref], timeout=0)[0]:
                logger.warning("worker %s stayed silent after its group %s ended: counted lost", w, group.group_id)
                dead.append(w)
                self._retire(m, "dead", "silent")
                continue
            try:
                report: RunReport = ray.get(ref)
            except ray.exceptions.RayActorError as err:
                dead.append(w)
                self._retire(m, "dead", type(err).__name__)
                # An unreachable worker's node may be dying and not yet declared dead: wait before
                # starting another there (`maintain`).
                self._deaths[m.node_id] = (time.monotonic(), isinstance(err, ray.exceptions.ActorUnavailableError))
                continue
            except ray.exceptions.RayTaskError as err:
                failed.append(err)  # a bug in the step: raised once the group is cleaned up
                if m.state == "busy":
                    m.state = "free"
                continue
            reports[w] = report
            if report.noticed:
                self._retire(m, "retired", "notice")  # its node is going away: no new group
                self._retired_nodes.add(m.node_id)
                if report.released_job:
                    self.nodes_hit.add(m.node_id)
            elif m.state == "busy":
                m.state = "free"
        group.run_refs = {}
        if failed:
            raise failed[0]
        outcome = GroupOutcome(group.group_id, reports, dead, ended_at)
        self._note(group.group_id, "broken" if outcome.broken else "ended")
        return outcome

    def close(self) -> None:
        """Kill every worker."""
        for m in self.workers.values():
            kill_actor(self._ray, m.actor)
        self.workers.clear()
        self.groups.clear()
