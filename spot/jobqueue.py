"""The job queue of the pull scheduler: jobs, leases, commits and results (pure Python, no Ray).

A job is opaque to the queue: a payload only its runner reads (`spot.runner.JobRunner`), the
weights version it must run with, a priority, and how many steps it has. Its state after k steps
is (k, state_k), where state_k is whatever the runner commits (a DiT trajectory's latent after k
denoising steps; an exploration job's scores so far). The queue is the single source of truth for
who holds which job and where each job resumes:

    pull(worker)      a free worker takes a pending job under a fresh lease id (an epoch)
    progress(lease)   after each step: renews the lease, records how far the worker got
    commit(lease, k)  every m steps, and at once on a preemption notice: the queue keeps (k, state_k)
    complete(lease)   the job's output; the job is done and its result is delivered once
    publish(v, w)     weights version v is available as handle w (the driver's, e.g. a Ray ref)
    worker_lost(w)    death detection: w's lease is revoked, its job resumes from the last commit
    expire()          leases whose worker went silent for lease_timeout_s are revoked the same way
    cancel(ids)       jobs nobody wants any more (late exploration): dropped, their leases revoked

Exactly once: a commit or result counts only under the job's current lease, and a commit never
moves a job backwards (an older k is ignored); a revoked lease's late messages are dropped, and a
worker declared lost is fenced (its pulls get STOP). `spot.pool` runs it as one single-threaded
Ray actor, so every call is atomic: a worker killed mid-commit either delivered the whole commit
or none of it.

Priorities: a pull takes the first pending job of the lowest `priority` value this worker may take
(rollouts 0 before exploration 1, in `spotlight`). A worker running a job while a job of a lower
value waits that it could take is answered YIELD at its next report: it commits its current step
and releases the job (nothing is recomputed), then pulls again. So a low-priority job never delays
a higher one by more than one step.

Pools: a worker pulls with the name of its pool ("spot" or "on_demand"); a job with `pools` set
goes only to workers of those pools (exploration runs on spot capacity only).

Weights versions: a job carries the weights version it must be run with, and a worker pulls with
the version it holds. When nothing of that version is pending for it but a job of another version
is, and that version's weights were published, `pull` answers a `WeightsUpdate` instead of a
lease: the worker loads those weights and pulls again. So new policy weights reach the workers
through the queue, without the driver calling them (a worker that joins later catches up the same
way), and jobs whose version is not published yet simply wait. The queue keeps the handles of the
newest version and of every version an unfinished job still needs.

Tail hand-off (pull only, `handoff=True`): when a free worker finds nothing pending, it may take
over a running job from a slower worker. The queue keeps each worker's time per step of each job
kind (from the gaps between its reports); if the free worker, resuming from the holder's next
reported step, would finish the job (`Job.num_steps`) at least `handoff_margin` of its own steps
sooner than the holder, the lease is marked. The holder's next report answers HANDOFF; it commits its current step with
`release=True` (nothing recomputed) and the job waits, reserved for the free worker for
`reserve_s`, first in line. With heterogeneous workers the run's last jobs migrate to the fast ones
instead of finishing on the slowest (a push scheduler has no such move). A job with
`handoff=False` (exploration: no one waits for it) is never moved.

Accounting: each lease records the last step its worker reported (`progress`). When a lease ends
early, the steps past the job's last commit are lost and counted in `recomputed_steps`; a worker
that died in the middle of a step also loses that step, which no report covers: the queue counts it
(`steps_in_flight_lost`) when the lease is revoked, since a worker that reported step k was
working on step k + 1 (unless k was the job's last). Every counter is kept in total (`stats`) and
per job kind (`stats_by_kind`).

One module on purpose (longer than the ~600 lines of the others): the queue is one state machine
whose transitions must each keep the invariants above, and reading them side by side is how they
are checked; the message types and the queue that interprets them stay together.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any

logger = logging.getLogger(__name__)

WAIT, STOP = "wait", "stop"
"""`JobQueue.pull` answers: nothing for this worker now / never again (queue closed or worker fenced)."""
ACCEPTED, IGNORED, STALE, HANDOFF, YIELD = "accepted", "ignored", "stale", "handoff", "yield"
"""Acks: applied / harmless no-op (a commit for an older step) / the lease is gone: abandon the job /
applied, and a faster free worker waits for this job / applied, and a job of higher priority waits:
for both of the last two, commit the current step with release=True."""
RELEASE_ACKS = (HANDOFF, YIELD)
"""Acks that ask the worker to commit its current step and hand the job back."""


# -- jobs and the queue (pure) ------------------------------------------------------------------


@dataclass(frozen=True)
class Job:
    """One unit of work for a runner; the queue reads only its bookkeeping fields."""

    job_id: int
    """Unique within a queue."""
    payload: Any = None
    """What to run: opaque to the runtime, read by the worker's `JobRunner`."""
    version: int = 0
    """Weights version to run with; a worker pulls only jobs of the version it holds."""
    priority: int = 0
    """Lower runs first; a running job yields to a waiting one of lower value."""
    num_steps: int = 0
    """Steps of the job, for the tail hand-off's estimate (0: unknown, never handed off)."""
    kind: str = ""
    """A label for accounting (`JobQueue.stats_by_kind`), e.g. "rollout" or "explore"."""
    pools: tuple[str, ...] = ()
    """Worker pools that may run it; empty: any."""
    handoff: bool = True
    """Whether the tail hand-off may move it to a faster free worker (False for work nobody waits
    for, such as exploration: moving it costs a commit and a restart and shortens no critical path)."""


@dataclass(frozen=True)
class Lease:
    """A job handed to a worker, with the committed state it resumes from."""

    lease_id: int
    """Epoch of this hand-out; every later message about the job carries it."""
    job: Job
    """The job."""
    step: int
    """Steps already done (0: start from the payload)."""
    state: Any
    """The state committed after `step` steps; None when step is 0."""


@dataclass(frozen=True)
class WeightsUpdate:
    """`JobQueue.pull`'s answer to a worker that holds the wrong weights for every job it could take."""

    version: int
    """The version to load."""
    weights: Any
    """Its handle, as published (`spot.pool` publishes `[ObjectRef]`: a Ray ref inside a list
    travels through the queue actor unresolved)."""


@dataclass(frozen=True)
class Result:
    """A finished job's output, delivered once."""

    job_id: int
    output: Any
    """What the runner produced (`JobRunner.output`)."""
    worker_id: str
    """Worker (or group) that ran the last steps."""
    num_leases: int
    """Hand-outs the job needed (1: never interrupted)."""
    kind: str = ""
    """The job's kind."""


@dataclass
class QueueStats:
    """Counters of a `JobQueue` (in total, and per job kind)."""

    submitted: int = 0
    done: int = 0
    leases: int = 0
    """Leases handed out."""
    commits: int = 0
    """Commits applied."""
    commits_ignored: int = 0
    """Commits for a step not newer than the committed one (harmless repeats)."""
    stale_messages: int = 0
    """Commits, progress reports and results under a revoked lease, dropped."""
    stale_results: int = 0
    """Of which final results: what would have been duplicates."""
    revoked: int = 0
    """Leases taken back from lost or silent workers (or of cancelled jobs)."""
    released: int = 0
    """Leases handed back by workers (a notice, a hand-off or a yield) with a commit of their last step."""
    yielded: int = 0
    """Of which releases to let a job of higher priority run."""
    recomputed_steps: int = 0
    """Steps finished under a lease after its job's last commit, lost when the lease ended early."""
    max_recomputed_steps: int = 0
    """The most steps lost by one lease."""
    steps_in_flight_lost: int = 0
    """Steps a revoked lease's worker was computing when it was lost (no report covers them)."""
    steps_reported: int = 0
    """Steps workers reported done (useful and lost)."""
    handoffs: int = 0
    """Running jobs moved from a slower worker to a free faster one (tail hand-off)."""
    weight_updates: int = 0
    """`WeightsUpdate`s handed to workers."""
    cancelled: int = 0
    """Jobs cancelled before they were delivered."""

    def add(self, other: QueueStats) -> None:
        """Add `other`'s counters to these (the maximum for `max_recomputed_steps`)."""
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            setattr(self, f.name, max(a, b) if f.name == "max_recomputed_steps" else a + b)


@dataclass
class _Entry:
    job: Job
    step: int = 0
    state: Any = None
    assignee: str | None = None
    reserved_for: tuple[str, float] | None = None
    """(worker, until): a handed-off job waits for the worker that asked for it, until then."""
    lease: _LeaseState | None = None
    done: bool = False
    num_leases: int = 0


@dataclass
class _LeaseState:
    lease_id: int
    job_id: int
    worker_id: str
    pool: str
    progress: int
    deadline: float
    reported_at: float = 0.0
    """When `progress` last moved (the worker's step time is measured between reports)."""
    handoff_to: str | None = None
    """A free worker that will take this job over once its holder releases it."""
    yielding: bool = False
    """Asked to release the job for one of higher priority."""
    start_step: int = 0
    """The committed step the lease resumed from."""
    started_at: float = 0.0
    """When the lease was granted (the queue's clock)."""


def least_loaded(loads: dict[str, int], n: int) -> list[str]:
    """Assignees for `n` new jobs, each to the worker with the fewest unfinished jobs then (ties to
    the first in `loads`' order), counting the ones assigned before it: a push scheduler's choice."""
    loads = dict(loads)
    if not loads:
        raise ValueError("no workers to assign jobs to")
    out = []
    for _ in range(n):
        worker = min(loads, key=loads.__getitem__)
        loads[worker] += 1
        out.append(worker)
    return out


class JobQueue:
    """Pending jobs, leases and committed states; the single source of truth (pure, no Ray).

    Args:
        lease_timeout_s: a lease with no message for this long is revoked and its job requeued.
        clock: monotonic time source (tests pass a fake one).
        handoff: enable the tail hand-off (jobs need `num_steps`).
        handoff_margin: a hand-off must save at least this many of the free worker's steps.
        reserve_s: how long a handed-off job waits for the worker that asked for it.
    """

    def __init__(
        self,
        *,
        lease_timeout_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        handoff: bool = False,
        handoff_margin: float = 2.0,
        reserve_s: float = 2.0,
        lease_log_len: int = 100_000,
    ):
        if lease_timeout_s <= 0:
            raise ValueError(f"lease_timeout_s must be > 0, got {lease_timeout_s}")
        if handoff_margin < 0 or reserve_s <= 0:
            raise ValueError("handoff_margin must be >= 0 and reserve_s > 0")
        self.lease_timeout_s = lease_timeout_s
        self.handoff = handoff
        self.handoff_margin = handoff_margin
        self.reserve_s = reserve_s
        self._step_s: dict[tuple[str, str], float] = {}  # (worker, job kind) -> seconds per step (moving average)
        self._clock = clock
        self._entries: dict[int, _Entry] = {}
        self._pending: dict[int, deque[int]] = {}  # priority -> job ids in line
        self._leases: dict[int, _LeaseState] = {}  # live leases by id
        self._next_lease_id = 1
        self._fenced: set[str] = set()
        self._timed_out: dict[str, list[int]] = {}  # worker -> jobs whose lease expired, until `worker_lost`
        self._results: list[Result] = []
        self._results_offset = 0  # results before this index were taken by the driver and dropped
        self._closed = False
        self._weights: dict[int, Any] = {}  # published version -> handle
        self._unfinished: Counter[int] = Counter()  # version -> jobs of it without a result
        self.stats = QueueStats()
        self.stats_by_kind: dict[str, QueueStats] = {}
        # Every ended lease, oldest first (bounded): what `lease_log` returns.
        self._lease_log: deque[dict] = deque(maxlen=lease_log_len)

    # -- driver side --------------------------------------------------------------------------

    def submit(self, jobs: Sequence[Job], assignees: Sequence[str] | None = None) -> None:
        """Queue jobs (in order within their priority), optionally each for one worker only (push)."""
        if assignees is not None and len(assignees) != len(jobs):
            raise ValueError(f"{len(jobs)} jobs but {len(assignees)} assignees")
        for i, job in enumerate(jobs):
            if job.job_id in self._entries:
                raise ValueError(f"job id {job.job_id} was already submitted")
            self._entries[job.job_id] = _Entry(job, assignee=None if assignees is None else assignees[i])
            self._pending.setdefault(job.priority, deque()).append(job.job_id)
            self._unfinished[job.version] += 1
            self._count(job, submitted=1)

    def push(self, jobs: Sequence[Job], workers: Sequence[str]) -> None:
        """Queue jobs, each for the least-loaded of `workers` then (`least_loaded`): the push baseline."""
        self.submit(jobs, least_loaded(self.loads(workers), len(jobs)))

    def publish(self, version: int, weights: Any) -> None:
        """Weights `version` is available as `weights` (opaque here; handed to workers as is)."""
        self._weights[version] = weights
        self._prune_weights()

    def published_versions(self) -> list[int]:
        """Versions whose handles the queue still keeps."""
        return sorted(self._weights)

    def weights(self, version: int) -> Any:
        """The handle of weights `version` as published (None if not kept): for the members of a
        group whose rank 0 got the `WeightsUpdate`."""
        return self._weights.get(version)

    def loads(self, workers: Sequence[str]) -> dict[str, int]:
        """Unfinished jobs assigned to each of `workers` (push: a worker's backlog)."""
        load = dict.fromkeys(workers, 0)
        for e in self._entries.values():
            if not e.done and e.assignee in load:
                load[e.assignee] += 1
        return load

    def reassign(self, from_worker: str, to_workers: Sequence[str]) -> list[int]:
        """Re-push the unfinished jobs assigned to `from_worker`, each to the least-loaded of
        `to_workers` (`least_loaded`); they resume there from their last commit."""
        moved = [e.job.job_id for e in self._entries.values() if e.assignee == from_worker and not e.done]
        for job_id, worker in zip(moved, least_loaded(self.loads(to_workers), len(moved))):
            self._entries[job_id].assignee = worker
        return moved

    def worker_lost(self, worker_id: str) -> list[int]:
        """Fence a dead (or departed) worker and requeue its job from the last commit.

        Returns the jobs the worker's death took from it: the lease revoked now, and any that timed
        out (`expire`) before the death was seen. A node killed without a word can go unnoticed for
        longer than the lease timeout, and its job resumes elsewhere first; it still hit work."""
        self._fenced.add(worker_id)
        self._forget_handoffs_to(worker_id)
        lost = [ls for ls in self._leases.values() if ls.worker_id == worker_id]
        for ls in lost:
            self._end_lease(ls, revoked=True)
        return self._timed_out.pop(worker_id, []) + [ls.job_id for ls in lost]

    def expire(self) -> list[int]:
        """Revoke leases whose worker went silent; their jobs resume elsewhere."""
        now = self._clock()
        late = [ls for ls in self._leases.values() if ls.deadline < now]
        for ls in late:
            logger.warning("lease %d of job %d (worker %s) timed out", ls.lease_id, ls.job_id, ls.worker_id)
            self._end_lease(ls, revoked=True)
            self._timed_out.setdefault(ls.worker_id, []).append(ls.job_id)
        return [ls.job_id for ls in late]

    def cancel(self, job_ids: Sequence[int]) -> list[int]:
        """Drop jobs that are not done: pending ones leave the line, running ones lose their lease
        (the worker's next message is STALE). Returns the ids actually cancelled."""
        cancelled = []
        for job_id in job_ids:
            e = self._entries.get(job_id)
            if e is None or e.done:
                continue
            if e.lease is not None:
                self._end_lease(e.lease, revoked=True, requeue=False, in_flight=False)
            else:
                line = self._pending.get(e.job.priority)
                if line is not None and job_id in line:
                    line.remove(job_id)
            e.done, e.state = True, None
            self._unfinished[e.job.version] -= 1
            self._count(e.job, cancelled=1)
            cancelled.append(job_id)
        self._prune_weights()
        return cancelled

    def results(self, cursor: int = 0) -> list[Result]:
        """Results from index `cursor` on, in completion order. The results before `cursor` are
        dropped: the caller has them (re-reading from the same cursor is safe)."""
        if cursor < self._results_offset:
            raise ValueError(f"results before {self._results_offset} were already taken (cursor {cursor})")
        drop = min(cursor, self._results_offset + len(self._results)) - self._results_offset
        if drop:
            del self._results[:drop]
            self._results_offset += drop
        return self._results[cursor - self._results_offset :]

    def lease_log(self, cursor: int = 0) -> list[dict]:
        """Ended leases from index `cursor` on (oldest first, the last `lease_log_len` kept), one dict
        each: lease, job, kind, worker, pool, version, from_step (the commit it resumed from),
        to_step (the committed step when it ended, or the last step for a completed job), progress,
        end (completed / released: a notice / handoff / yield / revoked: lost worker or timeout /
        cancelled), recomputed (steps past the last commit), seconds held."""
        return list(self._lease_log)[cursor:]

    def close(self) -> None:
        """From now on every pull answers STOP."""
        self._closed = True

    def snapshot(self) -> dict:
        """Counters, and the live leases as (job_id, worker_id, lease_id, committed step, progress)."""
        leases = [
            (ls.job_id, ls.worker_id, ls.lease_id, self._entries[ls.job_id].step, ls.progress)
            for ls in self._leases.values()
        ]
        return {
            "stats": self.stats,
            "stats_by_kind": self.stats_by_kind,
            "leases": leases,
            "pending": sum(len(line) for line in self._pending.values()),
        }

    # -- worker side --------------------------------------------------------------------------

    def pull(self, worker_id: str, version: int = 0, pool: str = "") -> Lease | WeightsUpdate | str:
        """A lease on the first pending job of the best priority this worker may take, if it is of
        the version the worker holds; else a `WeightsUpdate` to that job's version if it was
        published; else WAIT (or STOP).

        A worker runs one job at a time: any lease it still holds is revoked first (it abandoned
        that job), so a job can never be held twice by one worker.
        """
        if self._closed or worker_id in self._fenced:
            return STOP
        self.expire()
        for ls in [ls for ls in self._leases.values() if ls.worker_id == worker_id]:
            self._end_lease(ls, revoked=True, in_flight=False)  # it pulls: it is not computing that job
        now = self._clock()
        update = None
        for priority in sorted(self._pending):
            line = self._pending[priority]
            for i, job_id in enumerate(line):
                e = self._entries[job_id]
                if not self._may_take(e, worker_id, pool, now):
                    continue
                if e.job.version != version:
                    if update is None and e.job.version in self._weights:
                        update = e.job.version
                    continue
                del line[i]
                return self._lease(e, worker_id, pool, now)
            if update is not None:
                break  # the best priority with work for this worker needs other weights: load them
        if update is not None:
            self.stats.weight_updates += 1
            return WeightsUpdate(update, self._weights[update])
        if self.handoff:
            self._ask_for_handoff(worker_id, version)
        return WAIT

    def _may_take(self, e: _Entry, worker_id: str, pool: str, now: float) -> bool:
        if e.assignee not in (None, worker_id):
            return False
        if e.job.pools and pool not in e.job.pools:
            return False
        return e.reserved_for is None or e.reserved_for[0] == worker_id or e.reserved_for[1] <= now

    def _lease(self, e: _Entry, worker_id: str, pool: str, now: float) -> Lease:
        if e.reserved_for is not None and e.reserved_for[0] == worker_id:
            self.stats.handoffs += 1
        self._forget_handoffs_to(worker_id)  # busy again: it takes over nothing else
        e.reserved_for = None
        lease_id = self._next_lease_id
        self._next_lease_id += 1
        e.lease = _LeaseState(
            lease_id,
            e.job.job_id,
            worker_id,
            pool,
            e.step,
            now + self.lease_timeout_s,
            reported_at=now,
            start_step=e.step,
            started_at=now,
        )
        e.num_leases += 1
        self._leases[lease_id] = e.lease
        self._count(e.job, leases=1)
        return Lease(lease_id, e.job, e.step, e.state)

    def _forget_handoffs_to(self, worker_id: str) -> None:
        for ls in self._leases.values():
            if ls.handoff_to == worker_id:
                ls.handoff_to = None

    def _ask_for_handoff(self, worker_id: str, version: int) -> None:
        """Mark the running job of `version` that `worker_id` (free, holding those weights) would
        finish soonest relative to its holder."""
        if any(ls.handoff_to == worker_id for ls in self._leases.values()):
            return
        best, best_gain = None, 0.0
        for ls in self._leases.values():
            job = self._entries[ls.job_id].job
            # Step times of the same kind of job (an exploration step and a rollout step differ).
            mine, theirs = self._step_s.get((worker_id, job.kind)), self._step_s.get((ls.worker_id, job.kind))
            if (
                ls.handoff_to is not None
                or mine is None
                or theirs is None
                or ls.worker_id == worker_id
                or ls.yielding
                or not job.handoff
            ):
                continue
            if job.version != version:
                continue  # it would have to load other weights first
            # The holder finishes its step in flight, commits it and hands over; both then need the rest.
            left = job.num_steps - ls.progress - 1
            gain = left * (theirs - mine)
            if left > 0 and gain > self.handoff_margin * mine and gain > best_gain:
                best, best_gain = ls, gain
        if best is not None:
            best.handoff_to = worker_id

    def progress(self, lease_id: int, step: int) -> str:
        """The worker finished `step` steps: renew the lease. HANDOFF or YIELD ask it to commit and
        release the job."""
        ls = self._live(lease_id)
        if ls is None:
            return STALE
        self._advance(ls, step)
        return self._release_ack(ls) or ACCEPTED

    def _release_ack(self, ls: _LeaseState) -> str | None:
        """HANDOFF or YIELD when the holder should give the job back now, else None."""
        if ls.handoff_to is not None:
            return HANDOFF
        if self._outranked(ls):
            ls.yielding = True
            return YIELD
        return None

    def _outranked(self, ls: _LeaseState) -> bool:
        """Whether a pending job of better priority waits that this lease's worker could take
        (with the weights it holds, or with published ones it would load)."""
        e = self._entries[ls.job_id]
        now = self._clock()
        for priority in sorted(self._pending):
            if priority >= e.job.priority:
                return False
            for job_id in self._pending[priority]:
                other = self._entries[job_id]
                if self._may_take(other, ls.worker_id, ls.pool, now) and (
                    other.job.version == e.job.version or other.job.version in self._weights
                ):
                    return True
        return False

    def commit(self, lease_id: int, step: int, state: Any, *, release: bool = False) -> str:
        """Keep (step, state) as the job's resume point; `release` also hands the job back (a notice,
        or HANDOFF / YIELD, which a commit without release may answer too).

        Idempotent: a commit for a step not newer than the committed one is IGNORED.
        """
        ls = self._live(lease_id)
        if ls is None:
            return STALE
        self._advance(ls, step)
        e = self._entries[ls.job_id]
        if step > e.step:
            e.step, e.state = step, state
            self._count(e.job, commits=1)
            ack = ACCEPTED
        else:
            self._count(e.job, commits_ignored=1)
            ack = IGNORED
        if release:
            if ls.handoff_to is not None:
                e.reserved_for = (ls.handoff_to, self._clock() + self.reserve_s)
            self._end_lease(ls, revoked=False)
            return ack
        return self._release_ack(ls) or ack

    def complete(self, lease_id: int, step: int, output: Any) -> str:
        """The job's output (after `step` steps): delivered once, under its current lease only."""
        ls = self._live(lease_id)
        if ls is None:
            self._count(None, stale_results=1)
            return STALE
        self._advance(ls, step)
        e = self._entries[ls.job_id]
        assert not e.done, f"job {e.job.job_id} completed twice under lease {lease_id}"
        del self._leases[lease_id]
        self._log_lease(ls, "completed", step)
        e.lease, e.done = None, True
        e.state = None  # the result holds what is needed now
        self._results.append(Result(e.job.job_id, output, ls.worker_id, e.num_leases, e.job.kind))
        self._count(e.job, done=1)
        self._unfinished[e.job.version] -= 1
        self._prune_weights()
        return ACCEPTED

    # -- internals ----------------------------------------------------------------------------

    def _count(self, job: Job | None, **counts: int) -> None:
        """Add to the total counters and to those of the job's kind."""
        targets = [self.stats]
        if job is not None:
            targets.append(self.stats_by_kind.setdefault(job.kind, QueueStats()))
        for stats in targets:
            for name, n in counts.items():
                setattr(stats, name, getattr(stats, name) + n)

    def _prune_weights(self) -> None:
        """Drop the handles no unfinished job needs, except the newest version's."""
        newest = max(self._weights, default=None)
        for v in [v for v in self._weights if v != newest and self._unfinished[v] == 0]:
            del self._weights[v]

    def _log_lease(self, ls: _LeaseState, end: str, step: int, recomputed: int = 0) -> None:
        e = self._entries[ls.job_id]
        self._lease_log.append(
            {
                "lease": ls.lease_id,
                "job": ls.job_id,
                "kind": e.job.kind,
                "worker": ls.worker_id,
                "pool": ls.pool,
                "version": e.job.version,
                "from_step": ls.start_step,
                "to_step": step,
                "progress": ls.progress,
                "end": end,
                "recomputed": recomputed,
                "seconds": round(self._clock() - ls.started_at, 4),
            }
        )

    def _live(self, lease_id: int) -> _LeaseState | None:
        ls = self._leases.get(lease_id)
        if ls is None:
            self._count(None, stale_messages=1)
        return ls

    def _advance(self, ls: _LeaseState, step: int) -> None:
        now = self._clock()
        if step > ls.progress:
            # Time per step of this worker, from consecutive reports (a moving average: speeds drift).
            per_step = (now - ls.reported_at) / (step - ls.progress)
            key = (ls.worker_id, self._entries[ls.job_id].job.kind)
            old = self._step_s.get(key)
            self._step_s[key] = per_step if old is None else 0.7 * old + 0.3 * per_step
            self._count(self._entries[ls.job_id].job, steps_reported=step - ls.progress)
            ls.progress, ls.reported_at = step, now
        ls.deadline = now + self.lease_timeout_s

    def _end_lease(self, ls: _LeaseState, *, revoked: bool, requeue: bool = True, in_flight: bool = True) -> None:
        """Take a lease back; its job is pending again (first in its line) from its last commit.

        `in_flight`: for a revoked lease, whether its worker may have been computing a step (it died
        or went silent; not when it pulled again or the job was cancelled)."""
        del self._leases[ls.lease_id]
        e = self._entries[ls.job_id]
        e.lease = None
        lost = max(0, ls.progress - e.step)
        if revoked:
            self._log_lease(ls, "revoked" if requeue else "cancelled", e.step, recomputed=lost)
        else:
            self._log_lease(
                ls, "handoff" if ls.handoff_to is not None else "yield" if ls.yielding else "released", e.step
            )
        counts = {"recomputed_steps": lost}
        if revoked:
            counts["revoked"] = 1
            # A lost worker was computing the step after its last report (none after the job's last).
            counts["steps_in_flight_lost"] = int(in_flight and (ls.progress < e.job.num_steps or e.job.num_steps == 0))
        else:
            counts["released"] = 1
            counts["yielded"] = int(ls.yielding)
        self._count(e.job, **counts)
        for stats in (self.stats, self.stats_by_kind.setdefault(e.job.kind, QueueStats())):
            stats.max_recomputed_steps = max(stats.max_recomputed_steps, lost)
        if requeue:
            self._pending.setdefault(e.job.priority, deque()).appendleft(ls.job_id)
