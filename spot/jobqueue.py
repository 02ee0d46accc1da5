"""The job queue of the pull scheduler: jobs, leases, commits and results (pure Python, no Ray).

Shape legend: L image tokens, C packed channels.

A job is one denoising trajectory; its state after k of its N steps is (k, latent_k), its RNG state
(seed, k) (the noise is counter-based). The queue is the single source of truth for who holds which
job and where each job resumes:

    pull(worker)      a free worker takes a pending job under a fresh lease id (an epoch)
    progress(lease)   after each step: renews the lease, records how far the worker got
    commit(lease, k)  every m steps, and at once on a preemption notice: the queue keeps (k, latent)
    complete(lease)   the final latent; the job is done and its result is delivered once
    publish(v, w)     weights version v is available as handle w (the driver's, e.g. a Ray ref)
    worker_lost(w)    death detection: w's lease is revoked, its job resumes from the last commit
    expire()          leases whose worker went silent for lease_timeout_s are revoked the same way

Exactly once: a commit or result counts only under the job's current lease, and a commit never
moves a job backwards (an older k is ignored); a revoked lease's late messages are dropped, and a
worker declared lost is fenced (its pulls get STOP). `spot.scheduler` runs it as one
single-threaded Ray actor, so every call is atomic: a worker killed mid-commit either delivered
the whole commit or none of it.

Weights versions: a job carries the weights version it must be sampled with, and a worker pulls
with the version it holds. When nothing of that version is pending for it but a job of another
version is, and that version's weights were published, `pull` answers a `WeightsUpdate` instead of
a lease: the worker loads those weights and pulls again. So new policy weights reach the workers
through the queue, without the driver calling them (a worker that joins later catches up the same
way), and jobs whose version is not published yet simply wait. The queue keeps the handles of the
newest version and of every version an unfinished job still needs.

Tail hand-off (pull only; `handoff_steps` = N): when a free worker finds nothing pending, it may
take over a running job from a slower worker. The queue keeps each worker's time per step (from
the gaps between its reports); if the free worker, resuming from the holder's next reported step,
would finish the job at least `handoff_margin` of its own steps sooner than the holder, the lease is
marked. The holder's next `progress` answers HANDOFF; it commits its current step with
`release=True` (nothing recomputed) and the job waits, reserved for the free worker for
`reserve_s`, first in line. This is what committed in-flight state buys beyond preemptions: with
heterogeneous workers the run's last jobs migrate to the fast ones instead of finishing on the
slowest (a push scheduler has no such move).

Accounting: each lease records the last step its worker reported (`progress`). When a lease ends
early, the steps past the job's last commit are lost and counted in `recomputed_steps` (a step in
flight when the worker died, or a report lost with it, is not counted).
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)

WAIT, STOP = "wait", "stop"
"""`JobQueue.pull` answers: nothing for this worker now / never again (queue closed or worker fenced)."""
ACCEPTED, IGNORED, STALE, HANDOFF = "accepted", "ignored", "stale", "handoff"
"""Acks: applied / harmless no-op (a commit for an older step) / the lease is gone: abandon the job /
applied, and a faster worker waits for this job: commit the current step with release=True."""


# -- jobs and the queue (pure) ------------------------------------------------------------------


@dataclass(frozen=True)
class Job:
    """One denoising trajectory to sample."""

    job_id: int
    """Unique within a queue."""
    prompt: str
    """Text prompt."""
    seed: int
    """Trajectory seed: fixes the initial noise and every SDE draw."""
    version: int = 0
    """Weights version to sample with; a worker pulls only jobs of the version it holds."""


@dataclass(frozen=True)
class Lease:
    """A job handed to a worker, with the committed state it resumes from."""

    lease_id: int
    """Epoch of this hand-out; every later message about the job carries it."""
    job: Job
    """The job."""
    step: int
    """Steps already done (0: start from the seeded initial noise)."""
    latent_LC: torch.Tensor | None
    """(L, C) latent after `step` steps; None when step is 0."""


@dataclass(frozen=True)
class WeightsUpdate:
    """`JobQueue.pull`'s answer to a worker that holds the wrong weights for every job it could take."""

    version: int
    """The version to load."""
    weights: Any
    """Its handle, as published (`spot.scheduler` publishes `[ObjectRef]`: a Ray ref inside a list
    travels through the queue actor unresolved)."""


@dataclass(frozen=True)
class Result:
    """A finished trajectory, delivered once."""

    job_id: int
    latent_LC: torch.Tensor
    """(L, C) final latent."""
    worker_id: str
    """Worker that ran the last steps."""
    num_leases: int
    """Hand-outs the job needed (1: never interrupted)."""


@dataclass
class QueueStats:
    """Counters of a `JobQueue` (the benchmark's accounting)."""

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
    """Leases taken back from lost or silent workers."""
    released: int = 0
    """Leases handed back by workers after a notice (with a commit of their last step)."""
    recomputed_steps: int = 0
    """Steps finished under a lease after its job's last commit, lost when the lease ended early."""
    max_recomputed_steps: int = 0
    """The most steps lost by one lease."""
    steps_reported: int = 0
    """Steps workers reported done (useful and lost)."""
    handoffs: int = 0
    """Running jobs moved from a slower worker to a free faster one (tail hand-off)."""
    weight_updates: int = 0
    """`WeightsUpdate`s handed to workers."""


@dataclass
class _Entry:
    job: Job
    step: int = 0
    latent_LC: Any = None
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
    progress: int
    deadline: float
    reported_at: float = 0.0
    """When `progress` last moved (the worker's step time is measured between reports)."""
    handoff_to: str | None = None
    """A free worker that will take this job over once its holder releases it."""


class JobQueue:
    """Pending jobs, leases and committed states; the single source of truth (pure, no Ray).

    Args:
        lease_timeout_s: a lease with no message for this long is revoked and its job requeued.
        clock: monotonic time source (tests pass a fake one).
        handoff_steps: N, the steps of every job, to enable the tail hand-off; 0 disables it.
        handoff_margin: a hand-off must save at least this many of the free worker's steps.
        reserve_s: how long a handed-off job waits for the worker that asked for it.
    """

    def __init__(
        self,
        *,
        lease_timeout_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        handoff_steps: int = 0,
        handoff_margin: float = 2.0,
        reserve_s: float = 2.0,
    ):
        if lease_timeout_s <= 0:
            raise ValueError(f"lease_timeout_s must be > 0, got {lease_timeout_s}")
        if handoff_steps < 0 or handoff_margin < 0 or reserve_s <= 0:
            raise ValueError("handoff_steps and handoff_margin must be >= 0 and reserve_s > 0")
        self.lease_timeout_s = lease_timeout_s
        self.handoff_steps = handoff_steps
        self.handoff_margin = handoff_margin
        self.reserve_s = reserve_s
        self._step_s: dict[str, float] = {}  # worker -> seconds per step (moving average)
        self._clock = clock
        self._entries: dict[int, _Entry] = {}
        self._pending: deque[int] = deque()
        self._leases: dict[int, _LeaseState] = {}  # live leases by id
        self._next_lease_id = 1
        self._fenced: set[str] = set()
        self._results: list[Result] = []
        self._closed = False
        self._weights: dict[int, Any] = {}  # published version -> handle
        self._unfinished: Counter[int] = Counter()  # version -> jobs of it without a result
        self.stats = QueueStats()

    # -- driver side --------------------------------------------------------------------------

    def submit(self, jobs: Sequence[Job], assignees: Sequence[str] | None = None) -> None:
        """Queue jobs (in order), optionally each for one worker only (the push baseline)."""
        if assignees is not None and len(assignees) != len(jobs):
            raise ValueError(f"{len(jobs)} jobs but {len(assignees)} assignees")
        for i, job in enumerate(jobs):
            if job.job_id in self._entries:
                raise ValueError(f"job id {job.job_id} was already submitted")
            self._entries[job.job_id] = _Entry(job, assignee=None if assignees is None else assignees[i])
            self._pending.append(job.job_id)
            self._unfinished[job.version] += 1
        self.stats.submitted += len(jobs)

    def publish(self, version: int, weights: Any) -> None:
        """Weights `version` is available as `weights` (opaque here; handed to workers as is)."""
        self._weights[version] = weights
        self._prune_weights()

    def published_versions(self) -> list[int]:
        """Versions whose handles the queue still keeps."""
        return sorted(self._weights)

    def reassign(self, from_worker: str, to_workers: Sequence[str]) -> list[int]:
        """Re-push the unfinished jobs assigned to `from_worker`, round robin over `to_workers`."""
        moved = [e.job.job_id for e in self._entries.values() if e.assignee == from_worker and not e.done]
        for i, job_id in enumerate(moved):
            self._entries[job_id].assignee = to_workers[i % len(to_workers)]
        return moved

    def worker_lost(self, worker_id: str) -> list[int]:
        """Fence a dead (or departed) worker and requeue its job from the last commit."""
        self._fenced.add(worker_id)
        self._forget_handoffs_to(worker_id)
        lost = [ls for ls in self._leases.values() if ls.worker_id == worker_id]
        for ls in lost:
            self._end_lease(ls, revoked=True)
        return [ls.job_id for ls in lost]

    def expire(self) -> list[int]:
        """Revoke leases whose worker went silent; their jobs resume elsewhere."""
        now = self._clock()
        late = [ls for ls in self._leases.values() if ls.deadline < now]
        for ls in late:
            logger.warning("lease %d of job %d (worker %s) timed out", ls.lease_id, ls.job_id, ls.worker_id)
            self._end_lease(ls, revoked=True)
        return [ls.job_id for ls in late]

    def results(self, cursor: int = 0) -> list[Result]:
        """Results from index `cursor` on, in completion order (re-reading is safe)."""
        return self._results[cursor:]

    def close(self) -> None:
        """From now on every pull answers STOP."""
        self._closed = True

    def snapshot(self) -> dict:
        """Counters, and the live leases as (job_id, worker_id, lease_id, committed step, progress)."""
        leases = [
            (ls.job_id, ls.worker_id, ls.lease_id, self._entries[ls.job_id].step, ls.progress)
            for ls in self._leases.values()
        ]
        return {"stats": self.stats, "leases": leases, "pending": len(self._pending)}

    # -- worker side --------------------------------------------------------------------------

    def pull(self, worker_id: str, version: int = 0) -> Lease | WeightsUpdate | str:
        """A lease on the first pending job of `version` this worker may take; else a
        `WeightsUpdate` to the version of the first pending job it may take whose weights were
        published; else WAIT (or STOP).

        A worker runs one job at a time: any lease it still holds is revoked first (it abandoned
        that job), so a job can never be held twice by one worker.
        """
        if self._closed or worker_id in self._fenced:
            return STOP
        self.expire()
        for ls in [ls for ls in self._leases.values() if ls.worker_id == worker_id]:
            self._end_lease(ls, revoked=True)
        now = self._clock()
        update = None
        for i, job_id in enumerate(self._pending):
            e = self._entries[job_id]
            reserved = e.reserved_for is not None and e.reserved_for[0] != worker_id and e.reserved_for[1] > now
            if e.assignee not in (None, worker_id) or reserved:
                continue
            if e.job.version != version:
                if update is None and e.job.version in self._weights:
                    update = e.job.version
                continue
            del self._pending[i]
            if e.reserved_for is not None and e.reserved_for[0] == worker_id:
                self.stats.handoffs += 1
            self._forget_handoffs_to(worker_id)  # busy again: it takes over nothing else
            e.reserved_for = None
            lease_id = self._next_lease_id
            self._next_lease_id += 1
            e.lease = _LeaseState(lease_id, job_id, worker_id, e.step, now + self.lease_timeout_s, reported_at=now)
            e.num_leases += 1
            self._leases[lease_id] = e.lease
            self.stats.leases += 1
            return Lease(lease_id, e.job, e.step, e.latent_LC)
        if update is not None:
            self.stats.weight_updates += 1
            return WeightsUpdate(update, self._weights[update])
        if self.handoff_steps:
            self._ask_for_handoff(worker_id, version)
        return WAIT

    def _forget_handoffs_to(self, worker_id: str) -> None:
        for ls in self._leases.values():
            if ls.handoff_to == worker_id:
                ls.handoff_to = None

    def _ask_for_handoff(self, worker_id: str, version: int) -> None:
        """Mark the running job of `version` that `worker_id` (free, holding those weights) would
        finish soonest relative to its holder."""
        mine = self._step_s.get(worker_id)
        if mine is None or any(ls.handoff_to == worker_id for ls in self._leases.values()):
            return
        best, best_gain = None, self.handoff_margin * mine
        for ls in self._leases.values():
            theirs = self._step_s.get(ls.worker_id)
            if ls.handoff_to is not None or theirs is None or ls.worker_id == worker_id:
                continue
            if self._entries[ls.job_id].job.version != version:
                continue  # it would have to load other weights first
            # The holder finishes its step in flight, commits it and hands over; both then need the rest.
            left = self.handoff_steps - ls.progress - 1
            gain = left * (theirs - mine)
            if left > 0 and gain > best_gain:
                best, best_gain = ls, gain
        if best is not None:
            best.handoff_to = worker_id

    def progress(self, lease_id: int, step: int) -> str:
        """The worker finished `step` steps: renew the lease; HANDOFF asks it to commit and release."""
        ls = self._live(lease_id)
        if ls is None:
            return STALE
        self._advance(ls, step)
        return HANDOFF if ls.handoff_to is not None else ACCEPTED

    def commit(self, lease_id: int, step: int, latent_LC: torch.Tensor, *, release: bool = False) -> str:
        """Keep (step, latent) as the job's resume point; `release` also hands the job back (a notice,
        or HANDOFF, which a commit without release may answer too).

        Idempotent: a commit for a step not newer than the committed one is IGNORED.
        """
        ls = self._live(lease_id)
        if ls is None:
            return STALE
        self._advance(ls, step)
        e = self._entries[ls.job_id]
        if step > e.step:
            e.step, e.latent_LC = step, latent_LC
            self.stats.commits += 1
            ack = ACCEPTED
        else:
            self.stats.commits_ignored += 1
            ack = IGNORED
        if release:
            if ls.handoff_to is not None:
                e.reserved_for = (ls.handoff_to, self._clock() + self.reserve_s)
            self._end_lease(ls, revoked=False)
        elif ls.handoff_to is not None:
            return HANDOFF  # applied; now release
        return ack

    def complete(self, lease_id: int, step: int, latent_LC: torch.Tensor) -> str:
        """The job's final latent (after `step` = N steps): delivered once, under its current lease only."""
        ls = self._live(lease_id)
        if ls is None:
            self.stats.stale_results += 1
            return STALE
        self._advance(ls, step)
        e = self._entries[ls.job_id]
        assert not e.done, f"job {e.job.job_id} completed twice under lease {lease_id}"
        del self._leases[lease_id]
        e.lease, e.done = None, True
        e.latent_LC = None  # the result holds it now
        self._results.append(Result(e.job.job_id, latent_LC, ls.worker_id, e.num_leases))
        self.stats.done += 1
        self._unfinished[e.job.version] -= 1
        self._prune_weights()
        return ACCEPTED

    # -- internals ----------------------------------------------------------------------------

    def _prune_weights(self) -> None:
        """Drop the handles no unfinished job needs, except the newest version's."""
        newest = max(self._weights, default=None)
        for v in [v for v in self._weights if v != newest and self._unfinished[v] == 0]:
            del self._weights[v]

    def _live(self, lease_id: int) -> _LeaseState | None:
        ls = self._leases.get(lease_id)
        if ls is None:
            self.stats.stale_messages += 1
        return ls

    def _advance(self, ls: _LeaseState, step: int) -> None:
        now = self._clock()
        if step > ls.progress:
            # Time per step of this worker, from consecutive reports (a moving average: speeds drift).
            per_step = (now - ls.reported_at) / (step - ls.progress)
            old = self._step_s.get(ls.worker_id)
            self._step_s[ls.worker_id] = per_step if old is None else 0.7 * old + 0.3 * per_step
            self.stats.steps_reported += step - ls.progress
            ls.progress, ls.reported_at = step, now
        ls.deadline = now + self.lease_timeout_s

    def _end_lease(self, ls: _LeaseState, *, revoked: bool) -> None:
        """Take a lease back; its job is pending again (first in line) from its last commit."""
        del self._leases[ls.lease_id]
        e = self._entries[ls.job_id]
        e.lease = None
        lost = max(0, ls.progress - e.step)
        self.stats.recomputed_steps += lost
        self.stats.max_recomputed_steps = max(self.stats.max_recomputed_steps, lost)
        if revoked:
            self.stats.revoked += 1
        else:
            self.stats.released += 1
        self._pending.appendleft(ls.job_id)


