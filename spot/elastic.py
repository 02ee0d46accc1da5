"""Elastic sequence parallelism: persistent workers, SP groups formed generation by generation, and the
pull scheduler on top of them.

    pool = ElasticPool(ModelConfig(), DenoiseSpec(num_steps=10), store_url="/tmp/store")
    publish_weights(open_store("/tmp/store"), 0, state)      # weights version 0 (spot.sp_worker)
    pool.add_workers(4, version=0)                           # one from the store, the rest from it
    sched = ElasticScheduler(pool, degree=4)
    sched.submit([Job(i, "a red circle", seed=i) for i in range(8)])
    report = sched.run(timeout_s=300)
    sched.close(); pool.close()

Pieces (the worker itself is `spot.sp_worker.SPWorker`):

    ElasticPool       the workers (one Ray actor per device slot, model loaded once) and the groups
                      among them; `form` starts a new generation: a fresh torch.distributed world of
                      the chosen members on a new prefix of one long-lived TCPStore hosted here;
                      `poll` reports groups that ended and which members died
    ElasticScheduler  the pull scheduler's driver loop for groups: a group (its rank 0) pulls jobs
                      from the same `JobQueue` the single-worker scheduler uses, under the group's id;
                      when a group breaks, the queue fences that id and requeues its job from the
                      last commit, and the survivors are re-formed at once into the largest groups
                      the model's head count allows (3 survivors of 4 heads: degrees 2 and 1)
    plan_groups       that choice, pure

Death detection, in the order it happens (see `spot.sp_worker` for the gloo side): the survivors'
collectives fail within ~10 ms of a member's process dying (its sockets close; a survivor in the
middle of a step notices at its next collective) and their `run` calls return `broken`; Ray reports the dead member's `run` as `ActorDiedError` (~15 ms for a killed
process; ~2-4 s for a lost node with `spot.replay`'s health check). `poll` waits up to `settle_s`
for every member of a group that ended; a member still silent then is told to `abort` (its process
group closes, so its blocked collective fails) and, if it stays silent, is counted lost.

Capacity: a group runs one trajectory at a time at about `degree` times one worker's speed (each
rank computes L / degree image tokens), and its memory per rank falls with the degree.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from spot.jobqueue import Job, JobQueue, QueueStats, Result
from spot.localray import kill_actor
from spot.scheduler import DenoiseSpec
from spot.sp_worker import GroupRunReport, SPWorker, WeightsMismatchError

logger = logging.getLogger(__name__)


class GroupFormError(RuntimeError):
    """A generation did not form (a member died before or during the rendezvous); the live ones are free."""


def plan_groups(workers: Sequence[tuple[str, str]], max_degree: int, num_heads: int) -> list[list[str]]:
    """Split workers into SP groups: greedily the largest degree <= max_degree that divides num_heads.

    Args:
        workers: (worker_id, node_id) of the free workers; a group keeps to as few nodes as it can
            (workers are taken node by node).
        max_degree: the largest group wanted.
        num_heads: attention heads of the model (Ulysses splits heads over the ranks).

    Returns:
        Groups as lists of worker ids, largest first; every worker is in one group.
    """
    if max_degree < 1:
        raise ValueError(f"max_degree must be >= 1, got {max_degree}")
    ordered = [w for w, _ in sorted(workers, key=lambda wn: (wn[1], wn[0]))]
    groups = []
    while ordered:
        degree = max(d for d in range(1, min(max_degree, len(ordered)) + 1) if num_heads % d == 0)
        groups.append(ordered[:degree])
        ordered = ordered[degree:]
    return groups


@dataclass(eq=False)
class _Member:
    worker_id: str
    actor: Any
    node_id: str = ""
    pid: int = 0
    version: int | None = None
    state: str = "loading"  # loading -> free <-> busy; -> dead | retired
    group: str | None = None
    spawned_at: float = 0.0
    """time.monotonic() of the start request."""
    loaded_at: float = 0.0
    """time.monotonic() when its model was loaded (its `info` answered)."""
    load_s: float = 0.0
    """Seconds its constructor took (the model load, without the process start)."""


@dataclass(eq=False)
class Group:
    """One generation: a fresh process group among `members` (rank = position)."""

    group_id: str
    generation: int
    members: list[str]
    version: int
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
    reports: dict[str, GroupRunReport]
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


class ElasticPool:
    """Persistent `SPWorker`s and the SP groups among them.

    Args:
        model: `ModelConfig` of the workers' policy.
        spec: how trajectories are sampled.
        store_url: the weights store (`spot.store`), where `publish_weights` put each version.
        worker_kwargs: more `SPWorker` arguments (commit_every, step_s, num_threads, poll_s).
        store_host: address of the rendezvous TCPStore this process hosts (reachable by every node).
        timeout_s: rendezvous and collective timeout of each generation (the last-resort detector).
        settle_s: how long `poll` waits for the other members of a group that ended.
    """

    def __init__(
        self,
        model,
        spec: DenoiseSpec,
        *,
        store_url: str,
        worker_kwargs: dict | None = None,
        store_host: str = "127.0.0.1",
        timeout_s: float = 30.0,
        settle_s: float = 2.0,
    ):
        import ray
        import torch.distributed as dist

        self._ray = ray
        self.model = model
        self.spec = spec
        self.store_url = store_url
        self.worker_kwargs = dict(worker_kwargs or {})
        self.timeout_s = timeout_s
        self.settle_s = settle_s
        self._cls = ray.remote(SPWorker)
        # One long-lived store for every generation; each generation uses its own key prefix.
        self._tcp = dist.TCPStore(store_host, 0, is_master=True, wait_for_workers=False)
        self.store_host = store_host
        self.workers: dict[str, _Member] = {}
        self.groups: dict[str, Group] = {}
        self.generation = 0
        self.num_heads: int | None = None
        self._next_id = 0
        self.events: list[tuple[float, str, str]] = []
        """(time.monotonic(), worker or group id, event)."""

    # -- workers -------------------------------------------------------------------------------

    def spawn(self, n: int = 1, node_id: str | None = None) -> list[str]:
        """Start `n` workers (one CPU or GPU slot each), on `node_id` if given; they load the model."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        ids = []
        gpu = 1 if self.model.device.startswith("cuda") else 0
        for _ in range(n):
            worker_id = f"w{self._next_id}"
            self._next_id += 1
            options = dict(num_cpus=1, num_gpus=gpu, max_concurrency=4, max_restarts=0, max_task_retries=0)
            if node_id is not None:
                options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id, soft=False)
            actor = self._cls.options(**options).remote(worker_id, self.model, self.spec, **self.worker_kwargs)
            self.workers[worker_id] = _Member(worker_id, actor, spawned_at=time.monotonic())
            ids.append(worker_id)
        return ids

    def add_workers(self, n: int, version: int, *, node_id: str | None = None, source: str = "auto") -> dict[str, dict]:
        """Start `n` workers and give them weights `version`; returns how each got them.

        With source "auto" a newcomer copies from a sibling on its node that holds the version (the
        first newcomer on a node without one fetches from the store, the others then copy from it);
        "store" always fetches. A sibling copy refused (`WeightsMismatchError`: the sibling moved on
        to another version meanwhile) falls back to the store.
        """
        if source not in ("auto", "store"):
            raise ValueError(f"source must be 'auto' or 'store', got {source!r}")
        ids = self.spawn(n, node_id)
        self._await_loaded(ids)
        return self.load_weights(ids, version, source=source)

    def _await_loaded(self, ids: Sequence[str]) -> None:
        infos = self._ray.get([self.workers[w].actor.info.remote() for w in ids])
        for info in infos:
            m = self.workers[info["worker_id"]]
            m.node_id, m.pid, m.loaded_at = info["node_id"], info["pid"], time.monotonic()
            m.load_s = info["load_s"]
            self.num_heads = info["num_heads"]
            self.events.append((time.monotonic(), m.worker_id, "loaded"))

    def load_weights(self, ids: Sequence[str], version: int, *, source: str = "auto") -> dict[str, dict]:
        """Bring workers `ids` (loaded, not in a running group) to weights `version`."""
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
                    calls[w] = m.actor.fetch_weights.remote(self.store_url, version)
            for w, ref in calls.items():
                m = self.workers[w]
                try:
                    done[w] = ray.get(ref)
                except WeightsMismatchError as err:
                    logger.warning("worker %s: sibling copy refused (%s); fetching from the store", w, err)
                    done[w] = {**ray.get(m.actor.fetch_weights.remote(self.store_url, version)), "refused": str(err)}
                done[w]["start_and_load_s"] = m.loaded_at - m.spawned_at
                done[w]["load_s"] = m.load_s
                m.version, m.state = version, "free"
                self.events.append((time.monotonic(), w, f"weights from {done[w]['source']}"))
            pending = [w for w in pending if w not in done]
        return done

    def sibling(self, node_id: str, version: int, *, exclude: str | None = None) -> str | None:
        """A live worker on `node_id` that holds weights `version`, or None."""
        for m in self.workers.values():
            if m.worker_id != exclude and m.node_id == node_id and m.version == version and m.state in ("free", "busy"):
                return m.worker_id
        return None

    def free(self) -> list[str]:
        """Workers with weights, in no running group."""
        return [w for w, m in self.workers.items() if m.state == "free"]

    def alive(self) -> list[str]:
        return [w for w, m in self.workers.items() if m.state in ("free", "busy")]

    def actor(self, worker_id: str):
        return self.workers[worker_id].actor

    def pid(self, worker_id: str) -> int:
        return self.workers[worker_id].pid

    def node_of(self, worker_id: str) -> str:
        return self.workers[worker_id].node_id

    # -- groups --------------------------------------------------------------------------------

    def form(self, worker_ids: Sequence[str]) -> Group:
        """A new generation among free workers `worker_ids` (rank = position); returns once all joined."""
        members = [self.workers[w] for w in worker_ids]
        bad = [m.worker_id for m in members if m.state != "free"]
        if bad:
            raise ValueError(f"workers {bad} are not free to join a group")
        versions = {m.version for m in members}
        if len(versions) != 1:
            raise ValueError(f"workers {list(worker_ids)} hold different weights versions {sorted(versions)}")
        self.generation += 1
        gen = self.generation
        version = versions.pop()
        refs = [
            m.actor.join.remote(gen, rank, len(members), self.store_host, self._tcp.port, version, self.timeout_s)
            for rank, m in enumerate(members)
        ]
        seconds, failed = [], []
        for m, ref in zip(members, refs):
            try:
                seconds.append(self._ray.get(ref))
            except self._ray.exceptions.RayActorError:
                self._retire(m, "dead")  # died while free: noticed only now
                failed.append(m.worker_id)
            except self._ray.exceptions.RayTaskError as err:  # its rendezvous timed out: a member was missing
                failed.append(f"{m.worker_id} ({type(err.cause).__name__})")
        if failed:
            raise GroupFormError(f"generation {gen} of {list(worker_ids)} did not form: {failed}")
        group = Group(f"g{gen}", gen, list(worker_ids), version, rendezvous_s=max(seconds))
        for m in members:
            m.group = group.group_id
        self.groups[group.group_id] = group
        self.events.append((time.monotonic(), group.group_id, f"formed degree {group.degree}"))
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
        by_ref = {ref: w for w, ref in refs.items()}
        ray.wait(list(refs.values()), num_returns=len(refs), timeout=self.settle_s)
        silent = [w for w, ref in refs.items() if not ray.wait([ref], timeout=0)[0]]
        if silent:
            # A member blocked on a live peer: aborting its group closes its sockets, so it fails too.
            for w in silent:
                self.workers[w].actor.abort.remote()
            ray.wait([refs[w] for w in silent], num_returns=len(silent), timeout=self.settle_s)
        reports, dead, failed = {}, [], []
        for ref, w in by_ref.items():
            m = self.workers[w]
            m.group = None
            if not ray.wait([ref], timeout=0)[0]:
                logger.warning("worker %s stayed silent after its group %s ended: counted lost", w, group.group_id)
                dead.append(w)
                self._retire(m, "dead")
                continue
            try:
                report: GroupRunReport = ray.get(ref)
            except ray.exceptions.RayActorError as err:
                logger.info("worker %s of group %s died: %s", w, group.group_id, type(err).__name__)
                dead.append(w)
                self._retire(m, "dead")
                continue
            except ray.exceptions.RayTaskError as err:
                failed.append(err)  # a bug in the step: raised once the group is cleaned up
                m.state = "free"
                continue
            reports[w] = report
            if report.noticed:
                self._retire(m, "retired")  # its node is going away: no new group
            else:
                m.state = "free"
        group.run_refs = {}
        if failed:
            raise failed[0]
        outcome = GroupOutcome(group.group_id, reports, dead, ended_at)
        self.events.append((ended_at, group.group_id, "broken" if outcome.broken else "ended"))
        return outcome

    def _retire(self, m: _Member, state: str) -> None:
        m.state = state
        self.events.append((time.monotonic(), m.worker_id, state))
        if state == "dead":
            kill_actor(self._ray, m.actor)

    def close(self) -> None:
        """Kill every worker."""
        for m in self.workers.values():
            kill_actor(self._ray, m.actor)
        self.workers.clear()
        self.groups.clear()


# -- the driver ----------------------------------------------------------------------------------


@dataclass
class ElasticReport:
    """Outcome of `ElasticScheduler.run`."""

    results: list[Result]
    num_jobs: int
    wall_s: float
    stats: QueueStats
    duplicated: int
    lost: int
    outcomes: list[GroupOutcome]
    """Every group run that ended, in order."""


class ElasticScheduler:
    """Serve a `JobQueue` with SP groups; re-form the survivors of a broken group at once.

    Args:
        pool: the workers.
        degree: the largest group to form (groups are the largest that divide the head count).
        lease_timeout_s: see `JobQueue`.
        tick_s: the driver's loop period.
        auto_form: form groups from free workers on every tick (False: the caller forms them).
    """

    def __init__(self, pool: ElasticPool, *, degree: int, lease_timeout_s: float = 5.0, tick_s: float = 0.01,
                 auto_form: bool = True):  # fmt: skip
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self._ray = ray
        self.pool = pool
        self.degree = degree
        self.tick_s = tick_s
        self.auto_form = auto_form
        here = ray.get_runtime_context().get_node_id()
        self.queue = ray.remote(JobQueue).options(
            num_cpus=0, max_restarts=0, scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False)
        ).remote(lease_timeout_s=lease_timeout_s)
        self.results: list[Result] = []
        self._seen: set[int] = set()
        self.duplicated = 0
        self.num_jobs = 0
        self.outcomes: list[GroupOutcome] = []
        self._t0: float | None = None
        self._t_last: float | None = None

    def submit(self, jobs: Sequence[Job]) -> None:
        self._ray.get(self.queue.submit.remote(list(jobs)))
        self.num_jobs += len(jobs)
        if self._t0 is None:
            self._t0 = time.monotonic()

    def tick(self, wait_s: float = 0.0) -> list[GroupOutcome]:
        """One round: handle ended groups, form and start groups of free workers, collect results."""
        ray = self._ray
        outcomes = self._handled(self.pool.poll(wait_s))
        self.outcomes += outcomes
        if self.auto_form:
            self.form_free()
        fresh = ray.get(self.queue.results.remote(len(self.results)))
        for r in fresh:
            self.duplicated += r.job_id in self._seen
            self._seen.add(r.job_id)
        self.results += fresh
        if fresh:
            self._t_last = time.monotonic()
        return outcomes

    def form_free(self) -> list[Group]:
        """Form groups of the free workers (`plan_groups`) and start them on the queue."""
        free = self.pool.free()
        if not free:
            return []
        groups = []
        plan = plan_groups([(w, self.pool.node_of(w)) for w in free], self.degree, self.pool.num_heads)
        for members in plan:
            try:
                group = self.pool.form(members)
            except GroupFormError as err:
                logger.warning("%s; re-planning on the next tick", err)
                continue
            self.pool.start(group, self.queue)
            groups.append(group)
        return groups

    def regroup(self, timeout_s: float = 30.0) -> None:
        """Stop every running group at its next step (jobs committed and handed back) and re-form all
        free workers: merges fragments and takes in newcomers, without restarting a process."""
        for g in self.pool.running():
            self.pool.notify(g.group_id)
        deadline = time.monotonic() + timeout_s
        while self.pool.running():
            if time.monotonic() > deadline:
                raise TimeoutError("groups did not stop for a regroup")
            self.outcomes += self._handled(self.pool.poll(0.05))
        self.form_free()

    def _handled(self, outcomes: list[GroupOutcome]) -> list[GroupOutcome]:
        for out in outcomes:
            # Fence the group's id and requeue its job from the last commit (a released group has none).
            self._ray.get(self.queue.worker_lost.remote(out.group_id))
        return outcomes

    @property
    def done(self) -> bool:
        return len(self._seen) >= self.num_jobs

    def run(self, timeout_s: float) -> ElasticReport:
        """Tick until every job has a result or `timeout_s` passes."""
        deadline = time.monotonic() + timeout_s
        while not self.done and time.monotonic() < deadline:
            self.tick(self.tick_s)
        return self.report()

    def report(self) -> ElasticReport:
        t_end = self._t_last if self.done and self._t_last is not None else time.monotonic()
        t0 = self._t0 or t_end
        return ElasticReport(
            results=list(self.results), num_jobs=self.num_jobs, wall_s=t_end - t0,
            stats=self._ray.get(self.queue.snapshot.remote())["stats"], duplicated=self.duplicated,
            lost=self.num_jobs - len(self._seen), outcomes=list(self.outcomes),
        )  # fmt: skip

    def close(self, timeout_s: float = 10.0) -> ElasticReport:
        """Close the queue (groups get STOP and return), drop it, and return the final report."""
        ray = self._ray
        ray.get(self.queue.close.remote())
        deadline = time.monotonic() + timeout_s
        while self.pool.running() and time.monotonic() < deadline:
            self.outcomes += self._handled(self.pool.poll(0.05))
        report = self.report()
        ray.kill(self.queue, no_restart=True)
        return report
