"""The runtime's one worker: a Ray actor per device slot that keeps its runner (and model) for life.

A `Worker` builds its `JobRunner` once (`spot.runner`), then serves the queue (`spot.jobqueue`) as
a member of a *group*: one worker alone, or a sequence-parallel group of several. A group is one
*generation*: a fresh torch.distributed world among the chosen members, rendezvoused on
`PrefixStore("sp/gen<g>", TCPStore)` over one long-lived TCPStore the pool hosts. Forming,
shrinking, merging and growing groups is `join` with a new generation number: the old world is
destroyed, a new one is initialised, the runner keeps its model (`JobRunner.set_group`). Why a
fresh world and not `new_group` inside an old one: a gloo world whose member died is unusable
(every later collective that involves the dead rank fails, and `new_group` itself is a collective
over the whole old world), and `shrink_group` is NCCL-only and cannot grow. A fresh world needs
only the survivors and the store: a few milliseconds on one machine (gloo).

Serving (`run`): rank 0 pulls under the group's id and broadcasts what it got; every rank runs each
step; rank 0 reports progress after every step and commits the runner's state every
`commit_every` steps. The queue's answer decides what the whole group does next (one tiny
all-reduce agrees on it): go on; abandon the job (STALE: its lease was revoked or the job
cancelled); or commit the current step and release the job (HANDOFF to a faster worker, YIELD to a
job of higher priority). Before every step each rank checks that it holds the weights version the
job needs (fencing: a job never runs a step on other weights).

Preemption notices: a `spot.metadata.MetadataWatcher` on the node's instance-metadata endpoint (or
a `notify` call) sets the notice; at the next step boundary the group commits the step it finished,
releases the job and stops, and the noticed member leaves for good (its node is going away). Its
watcher may also ask Ray to drain the node (reason preemption). A notice seen before the worker
runs (while it loads, or waits for a group) holds: its first `run` leaves before it pulls a job.

Death inside a group (gloo on 127.0.0.1): when a member's process dies the OS closes its sockets,
and the peers that talk to it fail within ~10 ms of reaching their next collective ("Connection
reset by peer"): detection costs at most the rest of the step in flight. A peer blocked on a *live*
rank would wait for the whole gloo timeout, so every member that sees a collective fail aborts its
process group at once (`ProcessGroup.abort` closes its sockets): the failure cascades to every
survivor in milliseconds. `run` then returns a report marked `broken`, and the pool re-forms the
survivors from the state they hold (weights in memory, warm processes).

Weights reach a worker through the queue (`WeightsUpdate`: a Ray object ref of the state), from a
sibling on its node (`copy_weights_from`), or from the store (`fetch_weights`); see `spot.weights`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from spot.cluster import pin_process
from spot.jobqueue import ACCEPTED, RELEASE_ACKS, STALE, STOP, WAIT, YIELD, Lease, WeightsUpdate
from spot.runner import JobRunner, RunnerFactory
from spot.weights import (
    SharedWeights,
    WeightsMismatchError,
    fetch_weights,
    pack_state,
    state_checksum,
    unpack_state,
)

logger = logging.getLogger(__name__)

RENDEZVOUS_TIMEOUT_S = 10.0
NO_VERSION = -1
"""The version a worker pulls with when it holds none, or its group's members disagree: the queue
then answers a `WeightsUpdate` to the version its next job needs."""


@dataclass
class RunReport:
    """What one member's `Worker.run` did."""

    worker_id: str
    group_id: str
    rank: int
    degree: int
    steps: int = 0
    """Steps this member computed (every member computes every step of its group)."""
    completed: int = 0
    """Results the queue accepted (rank 0)."""
    abandoned: int = 0
    """Jobs dropped because the queue had revoked the lease or cancelled the job."""
    handed_off: int = 0
    """Jobs committed and handed to a faster free worker (tail hand-off)."""
    yielded: int = 0
    """Jobs committed and released for a job of higher priority."""
    weight_loads: int = 0
    """Weights versions loaded through the queue."""
    version_mismatches: int = 0
    """Jobs refused because this member held other weights than the job needs (never expected)."""
    released: bool = False
    """It stopped on a notice (or the pool's request) between or after committing its job."""
    released_job: bool = False
    """A job was in flight when the notice came: it was committed and handed back."""
    noticed: bool = False
    """This member had the notice (its node is going away): it takes no new group."""
    broken: str | None = None
    """A collective failed: a member died; the message of the error."""
    broken_at: float | None = None
    """time.monotonic() when this member saw the collective fail."""
    first_step_at: float | None = None
    """time.monotonic() when its first step finished (the clock is system-wide on Linux)."""
    busy_s: float = 0.0
    """Seconds spent running jobs (steps and the queue calls between them), not waiting for one."""
    step_s: float = 0.0
    """Of which seconds inside the runner (`start`, `advance`, `commit`, `output`): the rest is the runtime's."""
    weights_s: float = 0.0
    """Seconds loading weights versions through the queue."""


def _is_collective_failure(err: Exception) -> bool:
    """Whether `err` is a collective failing because a peer is gone (gloo raises plain RuntimeErrors
    naming its transport; NCCL raises DistBackendError), rather than a bug in the step."""
    import torch.distributed as dist

    if isinstance(err, dist.DistError):
        return True
    text = str(err)
    return isinstance(err, RuntimeError) and any(
        mark in text for mark in ("gloo", "Connection closed", "Connection reset", "abort", "Timed out")
    )


class Worker:
    """Ray actor for one device slot: builds its runner once, then serves the queue in groups of any degree.

    Run it with `max_concurrency` >= 4: `run` loops on one thread while `notify`, `wake`, `abort`,
    `share_weights` (a newcomer's copy) and `first_step` are served on the others.

    Args:
        worker_id: its name in the pool.
        make_runner: builds the `JobRunner` (in this process).
        pool: the pool it pulls for ("spot" or "on_demand"; jobs may be limited to pools).
        version: weights version the runner's own weights count as (None: none; it loads a
            published version before its first job).
        commit_every: m; rank 0 commits the runner's state after every m-th step of a job.
        step_s: minimum wall time of one step (the rest is slept), to emulate a slower device
            without changing the bits (thread counts would).
        num_threads: torch CPU threads.
        cpus: the CPUs this worker's process runs on (None: the ones it inherited from its node).
            An emulation on one host gives the on-demand workers the trainer's CPUs: the devices
            the trainer leaves idle while it waits for its rollout (`spot.cluster`).
        poll_s: first wait between pulls when the queue has nothing for it; doubles up to
            `idle_poll_s` while idle, and `wake` cuts it short (the driver wakes idle workers when
            jobs are submitted or requeued, so idle workers need not poll often: on a shared CPU
            every wake-up stalls the trainer's threads).
        idle_poll_s: the longest wait between pulls.
        imds_endpoint: instance-metadata endpoint to watch for notices; None: no watcher.
        imds_poll_s: the watcher's poll interval.
        drain_on_notice: also ask Ray to drain this node (reason preemption) on a notice.
        backend: torch.distributed backend of its groups ("gloo"; "nccl" for CUDA runners).
    """

    def __init__(
        self,
        worker_id: str,
        make_runner: RunnerFactory,
        *,
        pool: str = "spot",
        version: int | None = None,
        commit_every: int = 4,
        step_s: float = 0.0,
        num_threads: int = 1,
        cpus: Sequence[int] | None = None,
        poll_s: float = 0.02,
        idle_poll_s: float = 2.0,
        imds_endpoint: str | None = None,
        imds_poll_s: float = 0.5,
        drain_on_notice: bool = True,
        backend: str = "gloo",
    ):
        if commit_every < 1:
            raise ValueError(f"commit_every must be >= 1, got {commit_every}")
        t0 = time.monotonic()
        if cpus:
            pin_process(set(cpus))
        torch.set_num_threads(num_threads)
        self.runner: JobRunner = make_runner()
        self.worker_id = worker_id
        self.pool = pool
        self.version = version
        self.commit_every = commit_every
        self.step_s = step_s
        self.poll_s = poll_s
        self.idle_poll_s = max(idle_poll_s, poll_s)
        self.backend = backend
        self._shared: SharedWeights | None = None
        self._lock = threading.Lock()
        self._notice = threading.Event()
        self._wake = threading.Event()
        self._noticed = False
        self._store_client = None
        self._group = None  # the torch.distributed world of the current generation (None: alone)
        self._rank, self._degree = 0, 1
        self._gen: int | None = None
        self.first_step_at: float | None = None
        self._watcher = None
        if imds_endpoint:
            self._start_watcher(imds_endpoint, imds_poll_s, drain_on_notice)
        self.load_s = time.monotonic() - t0

    def _start_watcher(self, endpoint: str, poll_s: float, drain: bool) -> None:
        from spot.metadata import MetadataWatcher, drain_node_on_notice

        callbacks: list = [self._on_notice]
        if drain:
            callbacks.append(drain_node_on_notice)  # after the commit signal: the commit must not wait on it
        self._watcher = MetadataWatcher(
            endpoint, poll_interval_s=poll_s, timeout_s=1.0, callbacks=tuple(callbacks)
        ).start()

    def _on_notice(self, notice) -> None:
        if notice.kind == "interruption":
            self.notify(True)

    # -- identity ------------------------------------------------------------------------------

    def info(self) -> dict:
        """pid, Ray node id, weights version, generation; returns once the runner is built."""
        import ray

        return {
            "worker_id": self.worker_id,
            "pid": os.getpid(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "version": self.version,
            "generation": self._gen,
            "load_s": self.load_s,
            "num_heads": self.runner.num_heads,
            "pool": self.pool,
        }

    # -- weights -------------------------------------------------------------------------------

    def load_weights(self, version: int, state: dict[str, torch.Tensor]) -> None:
        """Hold weights `version` (given directly)."""
        self.runner.load_weights(version, state)
        self._set_version(version)

    def share_weights(self) -> SharedWeights:
        """This worker's weights in the object store: `ray.put` once per version, then the same ref."""
        import ray

        with self._lock:
            if self.version is None:
                raise WeightsMismatchError(f"worker {self.worker_id} holds no versioned weights yet")
            if self._shared is None or self._shared.version != self.version:
                packed = pack_state(self.runner.weights())
                num_bytes = sum(raw.nbytes for _, _, raw in packed.values())
                self._shared = SharedWeights(self.version, state_checksum(packed), num_bytes, [ray.put(packed)])
            return self._shared

    def copy_weights_from(self, sibling, version: int) -> dict:
        """Take weights `version` from a sibling's shared copy; refuse a wrong version or a bad checksum.

        Raises:
            WeightsMismatchError: the sibling holds another version, or the bytes do not hash to its checksum.
        """
        import ray

        t0 = time.monotonic()
        shared: SharedWeights = ray.get(sibling.share_weights.remote())
        if shared.version != version:
            raise WeightsMismatchError(
                f"worker {self.worker_id} asked for weights version {version}, the sibling holds {shared.version}"
            )
        packed = ray.get(shared.refs[0])  # same node: views of the object store's shared memory
        zero_copy = all(not raw.flags.writeable for _, _, raw in packed.values())  # read-only: mapped, not copied
        if state_checksum(packed) != shared.checksum:
            raise WeightsMismatchError(f"weights version {version} from a sibling do not match their checksum")
        self.runner.load_weights(version, unpack_state(packed))  # copies into this worker's parameters
        del packed
        self._set_version(version)
        return {
            "source": "sibling",
            "num_bytes": shared.num_bytes,
            "zero_copy": zero_copy,
            "seconds": time.monotonic() - t0,
        }

    def fetch_weights(self, store_url: str, version: int) -> dict:
        """Take weights `version` from the store (the fallback when no sibling holds it)."""
        from spot.store import open_store

        t0 = time.monotonic()
        self.runner.load_weights(version, fetch_weights(open_store(store_url), version))
        self._set_version(version)
        return {"source": "store", "seconds": time.monotonic() - t0}

    def _set_version(self, version: int) -> None:
        with self._lock:
            self.version = version
            self._shared = None

    # -- groups --------------------------------------------------------------------------------

    def join(self, generation: int, rank: int, degree: int, host: str, port: int, timeout_s: float) -> float:
        """Leave the current group and enter generation `generation` as `rank` of `degree`; returns seconds.

        Every member of the generation calls this at the same time; the call returns once all have
        connected (degree 1 needs no process group).
        """
        import torch.distributed as dist

        t0 = time.monotonic()
        if degree > 1 and self.runner.num_heads is None:
            raise ValueError(f"worker {self.worker_id}: its runner has no sequence-parallel steps (degree {degree})")
        self.leave()
        if not self._noticed:
            # A stop the pool asked for ends with the group; a notice of the node's reclaim does
            # not: the worker may have seen it while it loaded or waited for a group (the metadata
            # endpoint announces it once), and `run` must still leave at once.
            self._notice.clear()
        if degree > 1:
            if self._store_client is None:
                self._store_client = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
            # The rendezvous waits on the store: a member that never comes fails it after this long.
            self._store_client.set_timeout(timedelta(seconds=min(timeout_s, RENDEZVOUS_TIMEOUT_S)))
            store = dist.PrefixStore(f"sp/gen{generation}", self._store_client)
            dist.init_process_group(
                self.backend, store=store, rank=rank, world_size=degree, timeout=timedelta(seconds=timeout_s)
            )
            self._group = dist.group.WORLD
        self.runner.set_group(self._group)
        self._rank, self._degree, self._gen = rank, degree, generation
        return time.monotonic() - t0

    def leave(self) -> None:
        """Drop the current process group (the runner keeps its model and weights)."""
        import torch.distributed as dist

        self.runner.set_group(None)
        self._group = None
        if dist.is_initialized():
            dist.destroy_process_group()
        self._rank, self._degree, self._gen = 0, 1, None

    def notify(self, leaving: bool = True) -> None:
        """Commit the group's job at the next step and stop; `leaving`: this worker's node is going away."""
        self._noticed = self._noticed or leaving
        self._notice.set()
        self._wake.set()

    def wake(self) -> None:
        """Pull now instead of at the end of the current idle wait (new jobs were submitted)."""
        self._wake.set()

    def abort(self) -> None:
        """Abort the current process group (closes its connections, so blocked peers fail and return)."""
        import torch.distributed as dist

        pg = dist.group.WORLD if dist.is_initialized() else None
        if pg is not None:  # None: `run` left the group meanwhile (abort comes from another thread)
            pg.abort()

    # -- work ----------------------------------------------------------------------------------

    def run(self, queue, group_id: str) -> RunReport:
        """Serve the queue as one member of group `group_id` until STOP, a notice, or a failed collective."""
        import ray

        report = RunReport(self.worker_id, group_id, self._rank, self._degree)
        self.first_step_at = None
        wait_s = self.poll_s
        try:
            version = self._group_version()
            while True:
                if self._agree(self._notice.is_set())[0]:
                    report.released, report.noticed = True, self._noticed
                    return report
                msg: Any = None
                handle = None
                if self._rank == 0:
                    msg = ray.get(queue.pull.remote(group_id, version, self.pool))
                    if isinstance(msg, WeightsUpdate):
                        # A Ray ref does not survive torch's pickling: the members ask the queue for it.
                        handle, msg = msg.weights, WeightsUpdate(msg.version, None)
                msg = self._broadcast(msg)
                if msg == STOP:
                    return report
                if msg == WAIT:
                    # Idle: back off, but wake at once for new jobs or a notice.
                    self._wake.wait(wait_s)
                    self._wake.clear()
                    wait_s = min(2 * wait_s, self.idle_poll_s)
                    continue
                wait_s = self.poll_s
                if isinstance(msg, WeightsUpdate):
                    t0 = time.monotonic()
                    handle = handle or ray.get(queue.weights.remote(msg.version))
                    self.runner.load_weights(msg.version, ray.get(handle[0]))
                    report.weights_s += time.monotonic() - t0
                    self._set_version(msg.version)
                    version = msg.version
                    report.weight_loads += 1
                    continue
                assert isinstance(msg, Lease), msg
                t0 = time.monotonic()
                self._run_job(queue, msg, report)
                report.busy_s += time.monotonic() - t0
                if report.released:
                    return report
        except Exception as err:
            if self._degree == 1:
                raise
            # Whatever failed, abort our process group: peers blocked on us then fail now instead of
            # after the collective timeout.
            self.abort()
            self.leave()
            if not _is_collective_failure(err):
                raise  # a bug, not a lost member: the pool sees it
            # A member died (its sockets closed) or a peer aborted.
            report.broken_at = time.monotonic()
            report.broken = str(err).splitlines()[0][:300]
            logger.info("worker %s: group %s broken: %s", self.worker_id, group_id, report.broken)
            return report

    def _group_version(self) -> int:
        """The version the group pulls with: the one every member holds, else NO_VERSION (the queue
        then sends every member the same update)."""
        import torch.distributed as dist

        mine = NO_VERSION if self.version is None else self.version
        if self._degree == 1:
            return mine
        lo_hi = torch.tensor([-mine, mine])
        dist.all_reduce(lo_hi, op=dist.ReduceOp.MAX, group=self._group)
        lo, hi = -int(lo_hi[0]), int(lo_hi[1])
        return hi if lo == hi else NO_VERSION

    def _run_job(self, queue, lease: Lease, report: RunReport) -> None:
        import ray

        job, rank0 = lease.job, self._rank == 0
        runner = self.runner
        step = lease.step
        t_start = time.monotonic()
        state = runner.start(job.payload, step, lease.state)
        report.step_s += time.monotonic() - t_start
        stale = release = False
        ack = ACCEPTED
        acks: list = []  # rank 0: refs of the reports whose answers it has not read yet, in order
        while True:
            notice, stale, release = self._agree(self._notice.is_set(), stale, release)
            if stale:
                report.abandoned += 1
                return
            if notice or release:
                # Commit the last finished step and hand the job back: nothing is lost.
                if rank0:
                    ray.get(queue.commit.remote(lease.lease_id, step, runner.commit(state), release=True))
                if notice:
                    report.released, report.released_job, report.noticed = True, True, self._noticed
                elif ack == YIELD:
                    report.yielded += 1
                else:
                    report.handed_off += 1
                return
            if self.version != job.version:
                # Fencing: never run a step of a job on other weights (the queue hands out only jobs
                # of the version pulled with, so this is a broken invariant, not a race).
                logger.error(
                    "worker %s holds weights %s, job %d needs %d: abandoned",
                    self.worker_id,
                    self.version,
                    job.job_id,
                    job.version,
                )
                report.version_mismatches += 1
                return
            t0 = time.monotonic()
            state = runner.advance(state)
            report.step_s += time.monotonic() - t0
            step += 1
            report.steps += 1
            pad = self.step_s - (time.monotonic() - t0)
            if pad > 0:
                time.sleep(pad)
            if report.first_step_at is None:
                report.first_step_at = time.monotonic()
                self.first_step_at = report.first_step_at
            if runner.finished(state):
                if rank0:
                    ack = ray.get(queue.complete.remote(lease.lease_id, step, runner.output(state)))
                    report.completed += ack == ACCEPTED
                    report.abandoned += ack == STALE
                return
            if rank0:
                # Reports are not waited for: on a busy machine the queue's answer can take a
                # scheduling slice, every step. Answers are read as they arrive (a STALE, HANDOFF
                # or YIELD acts a step or two later); calls from one caller reach the queue in order.
                if step % self.commit_every == 0:
                    acks.append(self._commit(queue, lease.lease_id, step, runner.commit(state)))
                else:
                    acks.append(queue.progress.remote(lease.lease_id, step))  # renews the lease
                for answer in self._answers(acks):
                    stale = stale or answer == STALE
                    if answer in RELEASE_ACKS:
                        release, ack = True, answer

    _MAX_UNREAD = 2
    """Reports rank 0 may have in flight before it waits for the oldest answer (backpressure)."""

    def _answers(self, acks: list) -> list[str]:
        """The answers that arrived, oldest first (removed from `acks`); waits only when too many are unread."""
        import ray

        ready = set(ray.wait(acks, num_returns=len(acks), timeout=0)[0])
        out = []
        while acks and (acks[0] in ready or len(acks) > self._MAX_UNREAD):
            out.append(ray.get(acks.pop(0)))
        return out

    def _commit(self, queue, lease_id: int, step: int, saved: Any):
        """One periodic commit, not waited for: its answer's ref (a method of its own: fault-injection
        tests override it)."""
        return queue.commit.remote(lease_id, step, saved)

    def first_step(self) -> float | None:
        """time.monotonic() when the current (or last) `run` finished its first step; readable during `run`."""
        return self.first_step_at

    def _agree(self, *flags: bool) -> tuple[bool, ...]:
        """The flags OR-ed over the group (one tiny all-reduce), so every rank takes the same branch."""
        import torch.distributed as dist

        if self._degree == 1:
            return flags
        t = torch.tensor([int(f) for f in flags])
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._group)
        return tuple(bool(v) for v in t)

    def _broadcast(self, msg):
        import torch.distributed as dist

        if self._degree == 1:
            return msg
        box = [msg]
        dist.broadcast_object_list(box, src=0, group=self._group)
        return box[0]
