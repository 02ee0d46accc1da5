"""The runtime's driver: one queue, one pool, and the tick that keeps them together.

    runtime = Runtime(WorkerPool(make_runner, sp_degree=2, on_demand_workers=1)).start()
    runtime.publish(0, weights)                   # weights version 0, through the object store
    runtime.submit([Job(i, payload, version=0, num_steps=10) for i, payload in enumerate(work)])
    results = runtime.wait([0, 1, 2], timeout_s=300)   # job id -> Result; only these are waited for
    runtime.close()

The queue (`spot.jobqueue.JobQueue`) runs as one single-threaded Ray actor on the driver's node
(the on-demand node, which outlives the spot ones); workers pull from it directly. The driver's
tick (on a background thread after `start`, so that membership is kept while the caller computes)
reacts to the pool: a group whose run ended has its id fenced and its job requeued from the last
commit; free workers form groups and start serving; fragments merge when workers join (a running
group smaller than the free workers could make it is asked to commit and release its job, and all
re-form together); new results are collected, each delivered once.

Push baseline (`policy="push"`): each job is assigned at submission to the least-loaded group
ready then (fewest unfinished jobs assigned, `jobqueue.least_loaded`); a group pulls only the jobs
assigned to it. A lost group's unfinished jobs are re-pushed the same way to the groups ready at
that moment (they resume from their last commit, as under pull). Groups that form later get the
jobs submitted later (a training run's next batch). Push and pull share the lease, commit and
resume machinery, so a throughput ratio between them measures who chooses the job, nothing else.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from spot.jobqueue import Job, JobQueue, QueueStats, Result
from spot.localray import kill_actor
from spot.pool import Group, GroupFormError, GroupOutcome, WorkerPool, plan_groups
from spotlight.core.cost import ON_DEMAND, SPOT

logger = logging.getLogger(__name__)


@dataclass
class RuntimeStatus:
    """What the runtime holds and has been through (for progress displays and benchmarks)."""

    spot_nodes: int
    """Spot nodes alive now."""
    workers: dict[str, int]
    """Workers with a built runner, per pool."""
    groups: int
    """Groups running."""
    preemptions: int
    """Spot nodes lost so far."""
    preemptions_hitting_work: int
    """Of those, the ones where a lease ended with its job in flight (revoked, or released on a notice)."""
    resumed: dict[str, int]
    """Delivered jobs that needed more than one lease, per kind."""
    duplicated: int
    """Results delivered twice (0 is the promise)."""
    stats: QueueStats
    stats_by_kind: dict[str, QueueStats]


@dataclass
class RunOutcome:
    """What a `Runtime` delivered (`run`, `report`, `close`)."""

    results: list[Result]
    """Delivered results not taken yet, by job id."""
    num_jobs: int
    wall_s: float
    """From the first submission to the last result (to now if some are missing)."""
    stats: QueueStats
    duplicated: int
    """Results delivered twice (0 is the promise)."""
    lost: int
    """Jobs without a result (0 unless it timed out)."""
    events: list[tuple[float, str, str]] = field(default_factory=list)
    """The pool's events (seconds since the first submission, worker/group/node, event)."""
    outcomes: list[GroupOutcome] = field(default_factory=list)
    """Every group run that ended, in order."""


class Runtime:
    """The driver of one queue and one pool.

    Call `start` to tick on a background thread (the trainer's case), or `tick`/`run` yourself.

    Args:
        pool: the workers.
        lease_timeout_s: see `JobQueue`.
        tick_s: the loop period (membership, groups, results).
        handoff: let a free worker take a running job over from a slower one (the queue's tail
            hand-off; pull only).
        policy: "pull", or "push" (the baseline: each job assigned at submission to the least-loaded group).
        auto_form: form groups from free workers on every tick (False: the caller forms them).
        regroup: merge fragments when free workers could make a running group larger.
        membership_s: how often a tick looks at the cluster's nodes (`WorkerPool.maintain`).
        idle_tick_s: the loop period while nobody waits for results (`wait`): on a shared CPU
            every wake-up of the loop stalls the caller's compute threads a little.
    """

    def __init__(
        self,
        pool: WorkerPool,
        *,
        lease_timeout_s: float = 5.0,
        tick_s: float = 0.05,
        handoff: bool = True,
        policy: str = "pull",
        auto_form: bool = True,
        regroup: bool = True,
        membership_s: float = 0.25,
        idle_tick_s: float = 0.5,
    ):
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        if policy not in ("pull", "push"):
            raise ValueError(f"policy must be 'pull' or 'push', got {policy!r}")
        self._ray = ray
        self.pool = pool
        self.tick_s = tick_s
        self.policy = policy
        self.auto_form = auto_form
        self.regroup = regroup
        self.membership_s = membership_s
        self.idle_tick_s = max(idle_tick_s, tick_s)
        self._waiters = 0  # callers in `wait`: the loop ticks fast for them
        self.queue = (
            ray.remote(JobQueue)
            .options(
                num_cpus=0, max_restarts=0, scheduling_strategy=NodeAffinitySchedulingStrategy(pool.here, soft=False)
            )
            .remote(lease_timeout_s=lease_timeout_s, handoff=handoff and policy == "pull")
        )
        self._lock = threading.RLock()
        self._arrived = threading.Condition(self._lock)
        self._results: dict[int, Result] = {}  # delivered, not yet taken
        self._cursor = 0
        self._seen: set[int] = set()
        self.duplicated = 0
        self.resumed: Counter[str] = Counter()
        self.num_jobs = 0
        self._published: dict[int, Any] = {}  # version -> ObjectRef the queue may still hand out
        self._merging: set[str] = set()  # groups asked to stop so that fragments re-form together
        self._orphaned: list[str] = []  # push: lost groups whose jobs found no group to go to
        self.repushed: list[int] = []
        """Push: ids of the jobs re-pushed so far (a job once per re-push)."""
        self.outcomes: list[GroupOutcome] = []
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._wake_loop = threading.Event()
        self._error: BaseException | None = None
        self._t0: float | None = None
        self._t_last: float | None = None
        self._maintained_at = -float("inf")

    # -- the caller's side ---------------------------------------------------------------------

    def start(self) -> Runtime:
        """Tick on a background thread until `close`."""
        assert self._thread is None, "already started"
        self._thread = threading.Thread(target=self._loop, name="spot-runtime", daemon=True)
        self._thread.start()
        return self

    def publish(self, version: int, state: dict) -> None:
        """Make weights `version` available to the workers: one `ray.put`, then each worker fetches
        it when it next needs a job of that version. Jobs of a version not published yet wait."""
        ref = self._ray.put(state)
        with self._lock:
            self._published[version] = ref  # this process owns the object: keep it while the queue may hand it out
            self._ray.get(self.queue.publish.remote(version, [ref]))  # in a list: Ray passes it on unresolved
            kept = set(self._ray.get(self.queue.published_versions.remote()))
            self._published = {v: r for v, r in self._published.items() if v in kept}

    def published(self, version: int) -> bool:
        """Whether weights `version` was published and is still kept."""
        with self._lock:
            return version in self._published

    def submit(self, jobs: Sequence[Job]) -> None:
        """Queue jobs; idle workers are woken to pull them."""
        jobs = list(jobs)
        with self._lock:
            if self.policy == "push":
                ready = [g.group_id for g in self.pool.running()]
                if not ready:
                    raise ValueError("push needs running groups to assign jobs to; wait for workers first")
                self._ray.get(self.queue.push.remote(jobs, ready))
            else:
                self._ray.get(self.queue.submit.remote(jobs))
            self.num_jobs += len(jobs)
            if self._t0 is None:
                self._t0 = time.monotonic()
            self.pool.wake()

    def cancel(self, job_ids: Sequence[int]) -> list[int]:
        """Drop jobs not delivered yet (their workers abandon them at the next step); the ids cancelled."""
        with self._lock:
            cancelled = self._ray.get(self.queue.cancel.remote(list(job_ids)))
            self.num_jobs -= len(cancelled)
            return cancelled

    def take(self, job_ids: Sequence[int]) -> dict[int, Result]:
        """The results among `job_ids` delivered so far; each is handed out once."""
        with self._lock:
            if any(j not in self._results for j in job_ids):
                self._collect()  # what the queue holds now, whatever the loop's pace
            return {j: self._results.pop(j) for j in job_ids if j in self._results}

    def wait(self, job_ids: Sequence[int], timeout_s: float, *, take: bool = True) -> dict[int, Result]:
        """Block until every job of `job_ids` has a result (only these: other jobs go on running);
        the results, taken unless `take` is False (then they stay for a later `take`).

        Raises:
            TimeoutError: not all delivered within `timeout_s` (what was delivered stays takeable).
        """
        want = set(job_ids)
        got: dict[int, Result] = {}
        deadline = time.monotonic() + timeout_s
        with self._lock:
            self._waiters += 1
        self._wake_loop.set()
        try:
            return self._wait(want, got, deadline, timeout_s, take)
        finally:
            with self._lock:
                self._waiters -= 1

    def _wait(
        self, want: set[int], got: dict[int, Result], deadline: float, timeout_s: float, take: bool
    ) -> dict[int, Result]:
        while True:
            with self._arrived:
                got.update(self.take(want - got.keys()))
                if len(got) == len(want):
                    if not take:
                        self._results.update(got)
                    return got
                if self._error is not None:
                    raise RuntimeError("the runtime's background loop failed") from self._error
                left = deadline - time.monotonic()
                if left <= 0:
                    self._results.update(got)
                    raise TimeoutError(
                        f"{len(want) - len(got)} of {len(want)} jobs without a result after {timeout_s:g} s"
                    )
                if self._thread is not None:
                    self._arrived.wait(min(0.5, left))
                    continue
            self.tick()
            time.sleep(min(self.tick_s, max(0.0, left)))

    def lease_log(self) -> list[dict]:
        """Every ended lease and how it ended (`JobQueue.lease_log`)."""
        with self._lock:
            return self._ray.get(self.queue.lease_log.remote())

    def status(self) -> RuntimeStatus:
        """Nodes, workers, preemptions and queue counters, now."""
        with self._lock:
            snap = self._ray.get(self.queue.snapshot.remote())
            pool = self.pool
            return RuntimeStatus(
                spot_nodes=len(pool.spot_nodes()),
                workers={p: len(pool.alive(p)) for p in (SPOT, ON_DEMAND)},
                groups=len(pool.running()),
                preemptions=len(pool.nodes_lost),
                preemptions_hitting_work=len(set(pool.nodes_lost) & pool.nodes_hit),
                resumed=dict(self.resumed),
                duplicated=self.duplicated,
                stats=snap["stats"],
                stats_by_kind=snap["stats_by_kind"],
            )

    # -- the loop ------------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
            except BaseException as err:
                logger.exception("the runtime's tick failed")
                with self._arrived:
                    self._error = err
                    self._arrived.notify_all()
                return
            self._wake_loop.wait(self.tick_s if self._waiters else self.idle_tick_s)
            self._wake_loop.clear()

    def tick(self) -> list[GroupOutcome]:
        """One round: react to pool events, form and start groups of free workers, collect results."""
        with self._lock:
            now = time.monotonic()
            if now - self._maintained_at >= self.membership_s:
                self.pool.maintain()  # a GCS call: membership changes in seconds, results in milliseconds
                self._maintained_at = now
            outcomes = self._handled(self.pool.poll(0.0))
            self.outcomes += outcomes
            if self.auto_form:
                if self.regroup:
                    self._merge_fragments()
                self.form_free()
            self._collect()
            return outcomes

    def _collect(self) -> None:
        """Take the queue's new results (each job once; a second delivery is counted, not kept)."""
        with self._lock:
            fresh = self._ray.get(self.queue.results.remote(self._cursor))
            self._cursor += len(fresh)
            for r in fresh:
                if r.job_id in self._seen:
                    self.duplicated += 1
                    continue
                self._seen.add(r.job_id)
                self.resumed[r.kind] += r.num_leases > 1
                self._results[r.job_id] = r
            if fresh:
                self._t_last = time.monotonic()
                self._arrived.notify_all()

    def form_free(self) -> list[Group]:
        """Form groups of the free workers of each pool (`plan_groups`) and start them on the queue;
        a pool whose fragments are being merged waits until they are all free."""
        groups = []
        merging_pools = {g.pool for g in self.pool.running() if g.group_id in self._merging}
        for pool_name in (SPOT, ON_DEMAND):
            free = self.pool.free(pool_name)
            if not free or pool_name in merging_pools:
                continue
            plan = plan_groups([(w, self.pool.node_of(w)) for w in free], self.pool.sp_degree, self.pool.num_heads)
            for members in plan:
                try:
                    group = self.pool.form(members)
                except GroupFormError as err:
                    logger.warning("%s; re-planning on the next tick", err)
                    continue
                self.pool.start(group, self.queue)
                groups.append(group)
        if groups and self.policy == "push" and self._orphaned:
            self._repush()
        return groups

    def _merge_fragments(self) -> None:
        """Free workers that could make a running group of their pool larger: ask the smaller
        groups to commit and release their jobs at the next step, so that all re-form together."""
        if self.pool.sp_degree == 1:
            return
        heads, degree = self.pool.num_heads, self.pool.sp_degree
        for pool_name in (SPOT, ON_DEMAND):
            free = self.pool.free(pool_name)
            if not free:
                continue
            small = [
                g
                for g in self.pool.running()
                if g.pool == pool_name and g.degree < degree and g.group_id not in self._merging
            ]
            if not small:
                continue
            alone = len(plan_groups([(w, "") for w in free], degree, heads)) + len(small)
            together = len(plan_groups([(w, "") for w in free + [w for g in small for w in g.members]], degree, heads))
            if together < alone:
                for g in small:
                    self._merging.add(g.group_id)
                    self.pool.notify(g.group_id)

    def _handled(self, outcomes: list[GroupOutcome]) -> list[GroupOutcome]:
        for out in outcomes:
            self._merging.discard(out.group_id)
            # Fence the group's id and requeue its job from the last commit (a released group has none).
            revoked = self._ray.get(self.queue.worker_lost.remote(out.group_id))
            if revoked:
                self.pool.wake()  # idle workers take the requeued job now
                if out.dead:
                    self.pool.nodes_hit.update(self.pool.node_of(w) for w in out.dead)
            if self.policy == "push" and (out.broken or out.released):
                self._orphaned.append(out.group_id)
        if self.policy == "push" and self._orphaned:
            self._repush()
        return outcomes

    def _repush(self) -> None:
        targets = [g.group_id for g in self.pool.running()]
        if not targets:
            return
        for lost in self._orphaned:
            self.repushed += self._ray.get(self.queue.reassign.remote(lost, targets))
        self._orphaned.clear()

    # -- one batch of jobs, start to end (tests, benchmarks) -------------------------------------

    @property
    def started_at(self) -> float | None:
        """`time.monotonic()` at the first submission (the zero of `RunOutcome`'s times)."""
        return self._t0

    @property
    def done(self) -> bool:
        """Every submitted (and not cancelled) job was delivered."""
        return len(self._seen) >= self.num_jobs

    def run(self, timeout_s: float) -> RunOutcome:
        """Tick until every submitted job has a result or `timeout_s` passes (no background thread)."""
        assert self._thread is None, "run ticks itself; do not start the background loop too"
        assert self._t0 is not None, "submit jobs first"
        deadline = time.monotonic() + timeout_s
        while not self.done and time.monotonic() < deadline:
            self.tick()
            if not self.done:
                time.sleep(self.tick_s)
        return self.report()

    def report(self) -> RunOutcome:
        """The results not taken yet, the queue's counters and the pool's events, since the first submission."""
        with self._lock:
            t_end = self._t_last if self.done and self._t_last is not None else time.monotonic()
            t0 = self._t0 or t_end
            return RunOutcome(
                results=sorted(self._results.values(), key=lambda r: r.job_id),
                num_jobs=self.num_jobs,
                wall_s=t_end - t0,
                stats=self._ray.get(self.queue.snapshot.remote())["stats"],
                duplicated=self.duplicated,
                lost=self.num_jobs - len(self._seen),
                events=[(t - t0, who, ev) for t, who, ev in self.pool.events if t >= t0],
                outcomes=list(self.outcomes),
            )

    def close(self, timeout_s: float = 10.0) -> RunOutcome | None:
        """Stop the loop, close the queue (groups get STOP and return), drop it; the last report."""
        ray = self._ray
        self._stop.set()
        self._wake_loop.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)
        report = None
        try:
            ray.get(self.queue.close.remote())
            deadline = time.monotonic() + timeout_s
            while self.pool.running() and time.monotonic() < deadline:
                self.outcomes += self._handled(self.pool.poll(0.05))
            report = self.report()
        except ray.exceptions.RayError as err:
            logger.warning("closing the runtime: %s", err)
        kill_actor(ray, self.queue)
        return report
