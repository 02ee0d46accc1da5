"""The discrete-event core: a virtual clock, a spot pool driven by a trace, and workers that run
denoising jobs through the real pull queue (`spot.jobqueue.JobQueue`, on the virtual clock).

Time is virtual seconds from the start of the run. A simulated worker does what `DenoiseWorker`
does, one event per denoising step: pull a lease (WAIT: try again after `poll_s`), step, then
`complete` at the last step, `commit` every `commit_every` steps and `progress` otherwise; STALE
drops the job, HANDOFF commits with release; a notice makes it commit its last finished step with
release at the next step boundary and leave. So the queue's exactly-once bookkeeping, its
recomputation accounting and its tail hand-off are the production code, not a model of it.

Spot capacity follows the trace's `timeline()`: an `add` starts paying for a GPU node and, after
`node_startup_s`, gives a ready GPU; a `notice` warns the node's worker; a `preempt` ends the node.
A worker that dies without notice is declared lost to the queue `detect_s` later (its lease is then
revoked and its job resumes from the last commit on another worker). With `wrap`, a trace shorter
than the run repeats: at each wrap the nodes alive at the end that are not in the trace's initial
set are preempted and the missing initial ones added.

Workers are groups of GPUs (`sp_degree`, sequence parallel). When a member is lost the survivors
form a smaller group (down to `min_sp_degree`), and a group short of `sp_degree` takes spare ready
GPUs when it is between jobs. Each such change costs `reform_s` when elastic (`spot.pool`:
persistent workers, a new process group from state on the nodes) and `cold_restart_s` otherwise
(processes restarted, the model reloaded). On-demand workers never fail.

Accounting per pool: GPU-seconds held (what is paid for) and busy (stepping, including steps later
lost); work lost = steps recomputed after a preemption (the queue's count) plus steps in flight
when a worker died or a phase was cut, in GPU-seconds.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from spot.jobqueue import ACCEPTED, HANDOFF, STALE, STOP, WAIT, Job, JobQueue, Lease
from spot.sim.profile import Profile
from spot.traces import Trace

_LATENT = torch.zeros(1)  # the queue stores a state per commit; the simulator's carry no data


class EventLoop:
    """A virtual clock and a heap of timed callbacks (ties run in scheduling order)."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list = []
        self._seq = 0
        self.num_events = 0

    def at(self, t: float, fn: Callable, *args) -> None:
        assert t >= self.now - 1e-9, (t, self.now)
        heapq.heappush(self._heap, (max(t, self.now), self._seq, fn, args))
        self._seq += 1

    def run_until(self, done: Callable[[], bool], deadline: float = math.inf) -> None:
        """Run events in time order until `done()` holds or the next event lies past `deadline`
        (the clock then stands at the deadline)."""
        while not done():
            if not self._heap or self._heap[0][0] > deadline:
                if deadline == math.inf:
                    raise RuntimeError(f"simulation stalled at t={self.now:.1f} s: nothing left to happen")
                self.now = max(self.now, deadline)
                return
            t, _, fn, args = heapq.heappop(self._heap)
            self.now = t
            self.num_events += 1
            fn(*args)

    def advance(self, duration: float) -> None:
        """Let `duration` seconds pass, running what happens meanwhile (capacity changes)."""
        self.run_until(lambda: False, self.now + duration)


@dataclass(eq=False)
class Worker:
    wid: str
    gpus: tuple[str, ...]
    """Node names (spot) or `od-<i>` (on-demand)."""
    spot: bool
    speed: float = 1.0
    version: int = 0
    """Weights version it holds."""
    state: str = "idle"  # idle | busy (pulling or stepping in a phase) | left | dead
    gen: int = 0
    """Bumped to cancel its scheduled events (phase end, death)."""
    lease: Lease | None = None
    step: int = 0
    committed: int = 0
    """The job's last committed step (what a lost lease resumes from)."""
    step_started: float = 0.0
    notice: bool = False
    available_at: float = 0.0
    """Ready to pull from this time on (after a re-form)."""


@dataclass
class PhaseResult:
    done: set[int]
    """Ids of the jobs delivered."""
    start_s: float
    end_s: float
    recomputed_steps: int
    cut_steps: int
    """Steps in flight when the phase was cut at its deadline (exploration only)."""
    handoffs: int


@dataclass
class PoolStats:
    held_gpu_s: float = 0.0
    busy_gpu_s: float = 0.0
    lost_gpu_s: float = 0.0
    """GPU-seconds of steps that were lost: recomputed after preemptions, or in flight at a death."""
    cut_gpu_s: float = 0.0
    """GPU-seconds of exploration steps cut short by the end of a training step."""
    usage: list[list[float]] = field(default_factory=list)
    """[[start_s, end_s, gpus], ...] held, for `spotlight.core.cost.cost_usd`."""


class Cluster:
    """On-demand GPUs plus a spot pool following `trace`, and the workers on them.

    Args:
        loop: the event loop.
        profile: durations and SP settings.
        trace: the spot trace, in seconds (None: no spot pool).
        on_demand_gpus: GPUs of the on-demand pool (grouped into workers of `sp_degree`).
        elastic: elastic SP groups (see the module docstring).
        wrap: repeat the trace when the run outlasts it; otherwise capacity stays as it ends.
        node_speed: relative speed of a spot node by name (heterogeneous nodes).
        handoff: the queue's tail hand-off.
        initial_ready: the trace's nodes at t = 0 are ready at once (a run that waited for them
            before its clock started), instead of after `node_startup_s`.
        step_jitter: each step lasts its time x (1 + U(-j, j)) (seeded): real steps vary, and where
            a preemption falls within a job (the work it loses) depends on that phase.
        seed: seed of the jitter.
    """

    def __init__(
        self,
        loop: EventLoop,
        profile: Profile,
        trace: Trace | None,
        *,
        on_demand_gpus: int,
        elastic: bool = True,
        wrap: bool = True,
        node_speed: Callable[[str], float] | None = None,
        handoff: bool = True,
        initial_ready: bool = False,
        step_jitter: float = 0.0,
        seed: int = 0,
    ):
        if not 0 <= step_jitter < 1:
            raise ValueError(f"step_jitter must be in [0, 1), got {step_jitter}")
        self.initial_ready = initial_ready
        self.step_jitter = step_jitter
        self._rng = random.Random(seed)
        self.loop, self.profile, self.trace = loop, profile, trace
        self.elastic, self.wrap, self.handoff = elastic, wrap, handoff
        self.node_speed = node_speed or (lambda name: 1.0)
        self.workers: dict[str, Worker] = {}
        self._next_wid = 0
        self.on_demand = PoolStats()
        self.spot = PoolStats()
        self.on_demand_gpus = on_demand_gpus
        self._latest_version = 0
        left = on_demand_gpus
        i = 0
        while left >= profile.min_sp_degree:
            size = min(profile.sp_degree, left)
            self._new_worker(tuple(f"od-{i + j}" for j in range(size)), spot=False, speed=1.0)
            i, left = i + size, left - size
        self._node_added: dict[str, float] = {}  # alive spot nodes -> when added
        self._node_epoch: dict[str, int] = {}
        self._spare: set[str] = set()  # ready spot GPUs in no worker
        self._retired: set[str] = set()  # warned nodes: no new work
        self.preemptions = 0
        self.notices = 0
        self.lost_steps = 0
        """Steps lost with dead workers past their job's last commit (the queue's recomputed_steps)."""
        self.timeline: list[tuple[float, int, int]] = []
        """(t, spot GPUs held, spot GPUs in workers) after every capacity change."""
        self._queue: JobQueue | None = None
        self._push = False
        self._orphaned: list[str] = []
        self._phase_pools: tuple[bool, ...] = ()
        self._phase_steps = 0
        self._initial: set[str] = set()
        if trace is not None:
            self._initial = {ev.node_id for ev in trace.events if ev.kind == "add" and ev.t_s <= 0}
            self._schedule_cycle(0)

    # -- capacity ------------------------------------------------------------------------------

    def _schedule_cycle(self, cycle: int) -> None:
        trace = self.trace
        offset = cycle * trace.duration_s
        if cycle > 0:
            # Bring the alive set back to the trace's initial set, then replay it again.
            for name in sorted(set(self._node_added) - self._initial):
                self.loop.at(offset, self._preempt, name)
            for name in sorted(self._initial - set(self._node_added)):
                self.loop.at(offset, self._add, name)
        for ev in trace.timeline():
            if cycle > 0 and ev.kind == "add" and ev.t_s <= 0:
                continue
            handler = {"add": self._add, "notice": self._notice, "preempt": self._preempt}[ev.kind]
            self.loop.at(offset + ev.t_s, handler, ev.node_id)
        if self.wrap and trace.duration_s > 0:
            self.loop.at(offset + trace.duration_s, self._schedule_cycle, cycle + 1)

    def _add(self, name: str) -> None:
        if name in self._node_added:  # a wrap re-adds a node that the trace kept: nothing to do
            return
        now = self.loop.now
        self._node_added[name] = now
        epoch = self._node_epoch.get(name, 0) + 1
        self._node_epoch[name] = epoch
        self._retired.discard(name)
        startup = 0.0 if self.initial_ready and now == 0 else self.profile.node_startup_s
        self.loop.at(now + startup, self._node_ready, name, epoch)
        self._record()

    def _node_ready(self, name: str, epoch: int) -> None:
        if self._node_epoch.get(name) != epoch or name not in self._node_added or name in self._retired:
            return
        self._spare.add(name)
        self._form_groups()

    def _notice(self, name: str) -> None:
        if name not in self._node_added:
            return
        self.notices += 1
        self._retired.add(name)
        self._spare.discard(name)
        w = self._worker_on(name)
        if w is not None:
            w.notice = True
            if w.lease is None:  # not in a job: leave now
                self._leave(w)

    def _preempt(self, name: str) -> None:
        if name not in self._node_added:
            return
        now = self.loop.now
        self.preemptions += 1
        self.spot.usage.append([self._node_added.pop(name), now, 1.0])
        self._spare.discard(name)
        self._retired.discard(name)
        w = self._worker_on(name)
        if w is not None:
            self._die(w, name)
        self._record()

    def _worker_on(self, name: str) -> Worker | None:
        for w in self.workers.values():
            if name in w.gpus and w.state in ("idle", "busy"):
                return w
        return None

    def _record(self) -> None:
        in_workers = sum(len(w.gpus) for w in self.workers.values() if w.spot and w.state in ("idle", "busy"))
        self.timeline.append((self.loop.now, len(self._node_added), in_workers))

    # -- workers ------------------------------------------------------------------------------

    def _new_worker(self, gpus: tuple[str, ...], *, spot: bool, speed: float, available_at: float = 0.0) -> Worker:
        w = Worker(f"w{self._next_wid}", gpus, spot, speed=speed, available_at=available_at)
        self._next_wid += 1
        w.version = self._latest_version  # a new group loads the latest published weights
        self.workers[w.wid] = w
        self.loop.at(max(available_at, self.loop.now), self._kick, w, w.gen)
        return w

    @property
    def _reform_cost(self) -> float:
        """Changing a live group's membership: elastic re-form, or a cold restart of its processes."""
        return self.profile.reform_s if self.elastic else self.profile.cold_restart_s

    def _form_groups(self, delay: float = 0.0) -> None:
        """Top up short groups that are between jobs with spare ready GPUs, then group the rest."""
        p = self.profile
        spare = sorted(self._spare)
        for w in list(self.workers.values()):
            between_jobs = w.state == "idle" or (w.state == "busy" and w.lease is None)
            if spare and w.spot and between_jobs and not w.notice and len(w.gpus) < p.sp_degree:
                take = spare[: p.sp_degree - len(w.gpus)]
                spare = spare[len(take) :]
                self._regroup(w, w.gpus + tuple(take), delay=self._reform_cost)
        while len(spare) >= p.min_sp_degree:
            group, spare = tuple(spare[: p.sp_degree]), spare[p.sp_degree :]
            # Fresh GPUs (their model loaded during start-up) form a new group in reform_s.
            self._new_worker(
                group,
                spot=True,
                speed=min(self.node_speed(n) for n in group),
                available_at=self.loop.now + delay + (p.reform_s if len(group) > 1 else 0.0),
            )
        self._spare = set(spare)
        self._record()

    def _regroup(self, w: Worker, gpus: tuple[str, ...], *, delay: float) -> None:
        """Replace worker `w` (between jobs) by a group on `gpus` (same weights) ready after `delay`."""
        w.gen += 1
        w.state = "left"
        if self._queue is not None:
            self._lost_to_queue(w.wid)  # holds no lease; fence the old id
        self._new_worker(
            gpus, spot=True, speed=min(self.node_speed(n) for n in gpus), available_at=self.loop.now + delay
        )

    def _leave(self, w: Worker) -> None:
        """After a notice: the worker is done; its surviving GPUs regroup."""
        w.gen += 1
        w.state = "left"
        if self._queue is not None:
            self._lost_to_queue(w.wid)  # it released its lease already; fence it
        self._survivors(w, delay=0.0)
        self._record()

    def _die(self, w: Worker, lost_gpu: str) -> None:
        now = self.loop.now
        if w.lease is not None:
            # The step in flight, and the steps since the last commit, are lost (the queue counts
            # the latter in recomputed_steps once it declares the worker lost).
            partial = now - w.step_started
            redo = (w.step - w.committed) * self.profile.step_s(len(w.gpus), w.speed)
            self.spot.busy_gpu_s += partial * len(w.gpus)
            self.spot.lost_gpu_s += (partial + redo) * len(w.gpus)
            self.lost_steps += w.step - w.committed
        w.gen += 1
        w.state = "dead"
        queue = self._queue
        if queue is not None:
            self.loop.at(now + self.profile.detect_s, self._declare_lost, queue, w.wid)
        self._survivors(w, delay=self.profile.detect_s, exclude=lost_gpu)

    def _declare_lost(self, queue: JobQueue, wid: str) -> None:
        if queue is self._queue:
            self._lost_to_queue(wid)

    def _lost_to_queue(self, wid: str) -> None:
        """Fence `wid` (its job resumes from the last commit); push re-pushes its assigned jobs."""
        self._queue.worker_lost(wid)
        if self._push:
            self._orphaned.append(wid)
            self._repush()

    def _repush(self) -> None:
        """As the runtime's push: a lost worker's jobs go to the least-loaded workers ready now."""
        targets = [
            w.wid for w in self.live_workers() if w.spot in self._phase_pools and w.available_at <= self.loop.now
        ]
        if self._orphaned and targets:
            for wid in self._orphaned:
                self._queue.reassign(wid, targets)
            self._orphaned.clear()

    def _survivors(self, w: Worker, *, delay: float, exclude: str | None = None) -> None:
        """The GPUs of a lost group that are still up form a new group after the re-form cost."""
        p = self.profile
        rest = tuple(g for g in w.gpus if g != exclude and g in self._node_added and g not in self._retired)
        if not rest:
            return
        if len(rest) >= p.min_sp_degree:
            self._new_worker(
                rest,
                spot=True,
                speed=min(self.node_speed(n) for n in rest),
                available_at=self.loop.now + delay + self._reform_cost,
            )
        else:  # too few to run: they wait for more GPUs
            self.loop.at(self.loop.now + delay, self._return_spare, rest)

    def _return_spare(self, gpus: tuple[str, ...]) -> None:
        self._spare |= {g for g in gpus if g in self._node_added and g not in self._retired}
        self._form_groups()

    def live_workers(self, *, spot: bool | None = None) -> list[Worker]:
        return [w for w in self.workers.values() if w.state in ("idle", "busy") and (spot is None or w.spot == spot)]

    def publish(self, version: int, delay: float) -> None:
        """New weights: on-demand workers hold them now, spot workers after `delay`."""
        self._latest_version = version
        for w in self.live_workers(spot=False):
            w.version = version
        self.loop.at(self.loop.now + delay, self._sync_spot, version)

    def _sync_spot(self, version: int) -> None:
        for w in self.live_workers(spot=True):
            w.version = max(w.version, version)
            self._kick(w, w.gen)

    def samples_per_s(self, *, spot: bool, steps: int) -> float:
        """Throughput of the live workers of a pool for trajectories of `steps` steps."""
        p = self.profile
        return sum(p.samples_per_job / (steps * p.step_s(len(w.gpus), w.speed)) for w in self.live_workers(spot=spot))

    # -- phases: a batch of jobs through the real queue ------------------------------------------

    def run_phase(
        self,
        jobs: Sequence[Job],
        num_steps: int,
        *,
        pools: tuple[bool, ...],
        deadline: float = math.inf,
        scheduler: str = "pull",
    ) -> PhaseResult:
        """Run `jobs` on the workers of `pools` (False: on-demand, True: spot) until every job is
        delivered or `deadline` comes (the rest is cut). A worker takes only jobs of the weights
        version it holds (`Job.version`).

        `scheduler="push"` is the push baseline of `spot.runtime`: jobs assigned up front to the
        least-loaded workers ready at submission (all idle: round robin), a lost worker's jobs
        re-pushed to the least-loaded workers ready then
        (when none is, at the next worker that becomes ready), no hand-off.
        """
        if scheduler not in ("pull", "push"):
            raise ValueError(f"scheduler must be 'pull' or 'push', got {scheduler!r}")
        p = self.profile
        self.loop.run_until(lambda: False, self.loop.now)  # what happens at this instant (nodes arriving) first
        self._push, self._orphaned = scheduler == "push", []
        handoff = self.handoff and not self._push
        queue = JobQueue(lease_timeout_s=1e12, clock=lambda: self.loop.now, handoff=handoff)
        if self._push:
            ready = [w.wid for w in self.live_workers() if w.spot in pools and w.available_at <= self.loop.now]
            if not ready:
                raise ValueError("push needs ready workers at submission")
            queue.push(list(jobs), ready)
        else:
            queue.submit(list(jobs))
        self._queue, self._phase_pools, self._phase_steps = queue, pools, num_steps
        cut_steps = 0
        start = self.loop.now
        for w in self.live_workers():
            if w.spot in pools:
                self._kick(w, w.gen)
        n = len(jobs)
        self.loop.run_until(lambda: queue.stats.done >= n, deadline)
        # Phase over: cancel what the workers had scheduled; count steps cut at the deadline.
        for w in self.live_workers():
            if w.spot in pools and w.lease is not None:
                partial = (self.loop.now - w.step_started) * len(w.gpus)
                pool = self.spot if w.spot else self.on_demand
                pool.busy_gpu_s += partial
                pool.cut_gpu_s += partial + (w.step - w.lease.step) * p.step_s(len(w.gpus), w.speed) * len(w.gpus)
                cut_steps += w.step - w.lease.step
            if w.spot in pools:
                w.gen += 1
                w.state, w.lease = "idle", None
        queue.close()
        self._queue = None
        stats = queue.stats
        done = {r.job_id for r in queue.results()}
        return PhaseResult(done, start, self.loop.now, stats.recomputed_steps, cut_steps, stats.handoffs)

    def _kick(self, w: Worker, gen: int) -> None:
        """Start `w` pulling if a phase wants it (and it is not already at work)."""
        if gen != w.gen or w.state != "idle" or self._queue is None or w.spot not in self._phase_pools:
            return
        if self.loop.now < w.available_at:
            self.loop.at(w.available_at, self._kick, w, w.gen)
            return
        if w.notice:
            self._leave(w)
            return
        w.state = "busy"
        if self._push:
            self._repush()  # a worker became ready: jobs waiting for one go to it
        self._pull(w, w.gen)

    def _pull(self, w: Worker, gen: int) -> None:
        if gen != w.gen:
            return
        if w.notice:
            self._leave(w)
            return
        if w.spot and self.elastic and len(w.gpus) < self.profile.sp_degree and self._spare:
            self._form_groups()  # between jobs: a short group takes spare GPUs and re-forms
            if w.state != "busy":
                return
        queue = self._queue
        lease = queue.pull(w.wid, w.version)
        if lease == STOP:
            w.state = "idle"
            return
        if lease == WAIT:
            self.loop.at(self.loop.now + self.profile.poll_s, self._pull, w, gen)
            return
        assert isinstance(lease, Lease)
        w.lease, w.step, w.committed = lease, lease.step, lease.step
        self._start_step(w)

    def _start_step(self, w: Worker) -> None:
        w.step_started = self.loop.now
        dt = self.profile.step_s(len(w.gpus), w.speed)
        if self.step_jitter:
            dt *= 1.0 + self._rng.uniform(-self.step_jitter, self.step_jitter)
        self.loop.at(self.loop.now + dt, self._step_done, w, w.gen)

    def _step_done(self, w: Worker, gen: int) -> None:
        if gen != w.gen:
            return
        p, queue, lease = self.profile, self._queue, w.lease
        dt = self.loop.now - w.step_started
        (self.spot if w.spot else self.on_demand).busy_gpu_s += dt * len(w.gpus)
        w.step += 1
        if w.step == self._phase_steps:
            queue.complete(lease.lease_id, w.step, _LATENT)
            w.lease = None
            self._pull(w, gen)
            return
        if w.step % p.commit_every == 0:
            ack = queue.commit(lease.lease_id, w.step, _LATENT)
            if ack in (ACCEPTED, HANDOFF):
                w.committed = w.step
        else:
            ack = queue.progress(lease.lease_id, w.step)
        if ack == STALE:
            w.lease = None
            self._pull(w, gen)
            return
        if ack == HANDOFF or w.notice:
            queue.commit(lease.lease_id, w.step, _LATENT, release=True)
            w.lease = None
            self._pull(w, gen)  # a warned worker leaves there
            return
        assert ack in (ACCEPTED, "ignored"), ack
        self._start_step(w)

    def finish(self) -> None:
        """Close the books at the current time: nodes still held are paid up to now."""
        now = self.loop.now
        for since in self._node_added.values():
            self.spot.usage.append([since, now, 1.0])
        self.spot.held_gpu_s = sum((b - a) * g for a, b, g in self.spot.usage)
        self.on_demand.usage = [[0.0, now, float(self.on_demand_gpus)]] if self.on_demand_gpus else []
        self.on_demand.held_gpu_s = now * self.on_demand_gpus
