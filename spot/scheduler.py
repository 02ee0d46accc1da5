"""A pull-based scheduler for denoising jobs on spot workers, and the push baseline it is measured against.

Shape legend: L image tokens, C packed channels.

A job is one denoising trajectory (`spot.jobqueue.Job`). Its state after k of N steps is
(k, latent_k), nothing else: the sampler's noise is counter-based (`seeded_noise(seed, step)`),
so resuming from (k, latent_k) on any worker gives the bits an uninterrupted run gives
(`spotlight.sampling`). `denoise_step` runs one step of that trajectory.

The Ray edge around the pure `JobQueue` (leases, idempotent commits, exactly-once results):

    JobQueue actor    one single-threaded actor on the driver's (on-demand) node: the single source
                      of truth, so a worker killed mid-commit delivered all of the commit or none
    DenoiseWorker     one per spot node: pulls a job when free, runs its steps, commits every m
                      steps and at once on a preemption notice (its metadata watcher, or `notify`),
                      then hands the job back and stops pulling; reports the final latent
    WorkerPool        starts a worker on every spot node that joins, and reports deaths
    PullScheduler     the driver loop: membership, death detection, results, and `publish` of
                      new policy weights (put in the object store once; a worker pulls them through
                      the queue when it next needs a job of that version, see `JobQueue`)

Death detection (issue 4 item 2(b)): the pool sees a worker's `run` call fail (`RayActorError`:
`ActorDiedError`, `ActorUnavailableError`), or its node leave `ray.nodes()`, and tells the queue,
which fences the worker and requeues its job from the last commit; a worker that stops reporting
progress loses its lease after `lease_timeout_s` anyway. With the health check of
`spot.replay.ReplayCluster` (1 s period, 2 misses), a SIGKILLed node is seen in ~2-4 s.

Push baseline (`PushScheduler`): jobs are assigned round robin, up front, to the workers ready
at submission; a worker pulls only the jobs assigned to it. When a worker dies or leaves after a
notice, its unfinished jobs are re-pushed round robin to the workers ready at that moment (which
includes nodes that joined since); they resume from their last commit, exactly as under pull.
So push and pull share the lease, commit and resume machinery, and a throughput ratio between
them measures who chooses the job, nothing else. Workers that join later get only re-pushed jobs.

    pool = WorkerPool(ModelConfig(), DenoiseSpec(num_steps=10))
    sched = PullScheduler(pool)              # or PushScheduler(pool)
    sched.submit([Job(i, "a red circle", seed=i) for i in range(100)])
    report = sched.run(timeout_s=300)        # report.results: one Result per job
    sched.close(); pool.close()
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from spot.jobqueue import ACCEPTED, HANDOFF, STALE, STOP, WAIT, Job, JobQueue, Lease, QueueStats, Result, WeightsUpdate
from spot.localray import SPOT, kill_actor

logger = logging.getLogger(__name__)


# -- the denoising core (pure functions of the policy) -------------------------------------------


@dataclass(frozen=True)
class DenoiseSpec:
    """How jobs are sampled (the subset of `SampleConfig` a trajectory depends on)."""

    num_steps: int = 10
    """Denoising steps N per trajectory."""
    noise_level: float = 0.7
    """SDE noise scale (0: the ODE sampler)."""
    sde_type: str = "flow_grpo"
    """"flow_grpo" or "cps"."""
    sde_steps: tuple[int, ...] | None = None
    """Stochastic step indices; None: all."""
    guidance_scale: float = 1.0
    """Qwen-Image true CFG scale (1: off)."""
    negative_prompt: str = " "
    """Negative prompt when CFG is on."""


def denoise_step(policy, batch, sigmas: torch.Tensor, spec: DenoiseSpec, seed: int, step: int, latent_LC):
    """Latent (L, C) after step `step` + 1, from the latent after `step` steps (None at step 0).

    Runs `sampling.sample` on the schedule cut after sigma_{step+1}: its loop then does exactly
    step `step`, with the same sigmas and the same (seed, step) noise as an uninterrupted run.
    """
    from spotlight.rollout import guided_velocity
    from spotlight.sampling import sample

    traj = sample(
        lambda x, s: guided_velocity(policy, x, s, batch, spec.guidance_scale),
        [seed], policy.latent_shape, sigmas[: step + 2],
        noise_level=spec.noise_level, sde_steps=spec.sde_steps, sde_type=spec.sde_type,
        start_step=step, start_latents=None if latent_LC is None else latent_LC[None], device=policy.device,
    )  # fmt: skip
    return traj.latents[-1][0].cpu().clone()  # clone: not a view that would pickle the whole stack


def sample_uninterrupted(policy, job: Job, spec: DenoiseSpec) -> torch.Tensor:
    """The reference: the job's final latent (L, C) sampled in one go."""
    from spotlight.rollout import encode, guided_velocity
    from spotlight.sampling import qwen_image_sigmas, sample

    batch = encode(policy, [job.prompt], spec.guidance_scale, spec.negative_prompt)
    sigmas = qwen_image_sigmas(spec.num_steps, policy.latent_shape[0])
    traj = sample(
        lambda x, s: guided_velocity(policy, x, s, batch, spec.guidance_scale),
        [job.seed], policy.latent_shape, sigmas,
        noise_level=spec.noise_level, sde_steps=spec.sde_steps, sde_type=spec.sde_type, device=policy.device,
    )  # fmt: skip
    return traj.final[0].cpu()


# -- the Ray edge: workers -----------------------------------------------------------------------


@dataclass
class WorkerReport:
    """What one `DenoiseWorker.run` did."""

    worker_id: str
    steps: int = 0
    """Denoising steps computed."""
    completed: int = 0
    """Results the queue accepted."""
    abandoned: int = 0
    """Jobs dropped because the queue had revoked the lease."""
    handed_off: int = 0
    """Jobs committed and handed to a faster free worker (tail hand-off)."""
    weight_loads: int = 0
    """Weights versions it loaded (`WeightsUpdate`s)."""
    left: bool = False
    """It stopped because of a preemption notice (its node is going away)."""
    busy_s: float = 0.0
    """Seconds spent running jobs (steps and the queue calls between them), not waiting for one."""


class DenoiseWorker:
    """Ray actor on a spot node: pulls jobs, denoises, commits every `commit_every` steps and on notice.

    Run it with `max_concurrency=2`: `run` loops on one thread while `notify` (or the metadata
    watcher's thread) can signal a preemption notice.

    Args:
        worker_id: name the queue knows it by.
        model: `spotlight.config.ModelConfig` of the policy.
        spec: how trajectories are sampled.
        version: weights version it holds at start (the model's own weights); it pulls jobs of
            the version it holds and loads another when the queue answers a `WeightsUpdate`.
        commit_every: m; commit the latent after every m-th step.
        step_s: minimum wall time of one step; the remainder is slept. It emulates a slower
            accelerator, for heterogeneous pools, without changing the bits (thread counts would).
        num_threads: torch CPU threads.
        imds_endpoint: instance-metadata endpoint to watch for notices; None: no watcher.
        imds_poll_s: the watcher's poll interval.
        drain_on_notice: also ask Ray to drain this node (reason preemption) on a notice.
        poll_s: wait between pulls when the queue has nothing for it.
    """

    def __init__(
        self,
        worker_id: str,
        model,
        spec: DenoiseSpec,
        *,
        version: int = 0,
        commit_every: int = 4,
        step_s: float = 0.0,
        num_threads: int = 1,
        imds_endpoint: str | None = None,
        imds_poll_s: float = 0.2,
        drain_on_notice: bool = True,
        poll_s: float = 0.05,
    ):
        self.policy, self.sigmas = load_worker_policy(model, spec, commit_every=commit_every, num_threads=num_threads)
        self.worker_id = worker_id
        self.spec = spec
        self.version = version
        self.commit_every = commit_every
        self.step_s = step_s
        self.poll_s = poll_s
        self._notice = threading.Event()
        self._watcher = None
        if imds_endpoint:
            self._start_watcher(imds_endpoint, imds_poll_s, drain_on_notice)

    def _start_watcher(self, endpoint: str, poll_s: float, drain: bool) -> None:
        from spot.metadata import MetadataWatcher, drain_node_on_notice

        callbacks: list = [self._on_notice]
        if drain:
            callbacks.append(drain_node_on_notice)  # after the commit signal: the commit must not wait on it
        self._watcher = MetadataWatcher(endpoint, poll_interval_s=poll_s, timeout_s=0.5, callbacks=tuple(callbacks)).start()

    def _on_notice(self, notice) -> None:
        if notice.kind == "interruption":
            self._notice.set()

    def ready(self) -> str:
        """The Ray node id it runs on (returns once the model is loaded)."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def notify(self) -> None:
        """A preemption notice: commit the running job now and take no more."""
        self._notice.set()

    def run(self, queue) -> WorkerReport:
        """Pull and run jobs until the queue answers STOP or a notice comes."""
        import ray

        report = WorkerReport(self.worker_id)
        while not self._notice.is_set():
            lease = ray.get(queue.pull.remote(self.worker_id, self.version))
            if lease == STOP:
                return report
            if lease == WAIT:
                self._notice.wait(self.poll_s)
                continue
            if isinstance(lease, WeightsUpdate):
                self.load_weights(lease.version, ray.get(lease.weights[0]))
                report.weight_loads += 1
                continue
            assert isinstance(lease, Lease), lease
            t0 = time.monotonic()
            self._run_job(queue, lease, report)
            report.busy_s += time.monotonic() - t0
        report.left = True
        return report

    def load_weights(self, version: int, state: dict[str, torch.Tensor]) -> None:
        """Hold weights `version`: the post-trained part of the policy (`trainable_state`'s keys)."""
        from spotlight.policy import load_trainable_state

        load_trainable_state(self.policy, state)
        self.version = version

    def _run_job(self, queue, lease: Lease, report: WorkerReport) -> None:
        import ray
        from spotlight.rollout import encode

        spec, job = self.spec, lease.job
        batch = encode(self.policy, [job.prompt], spec.guidance_scale, spec.negative_prompt)
        step, latent = lease.step, lease.latent_LC
        while True:
            if self._notice.is_set():
                # A notice leaves about two minutes: commit the last finished step, hand the job back.
                ray.get(queue.commit.remote(lease.lease_id, step, latent, release=True))
                return
            t0 = time.monotonic()
            latent = denoise_step(self.policy, batch, self.sigmas, spec, job.seed, step, latent)
            step += 1
            report.steps += 1
            pad = self.step_s - (time.monotonic() - t0)
            if pad > 0:
                time.sleep(pad)
            if step == spec.num_steps:
                ack = ray.get(queue.complete.remote(lease.lease_id, step, latent))
                report.completed += ack == ACCEPTED
                report.abandoned += ack == STALE
                return
            if step % self.commit_every == 0:
                ack = self._commit(queue, lease, step, latent)
            else:
                ack = ray.get(queue.progress.remote(lease.lease_id, step))  # renews the lease
            if ack == STALE:
                report.abandoned += 1
                return
            if ack == HANDOFF:
                # A faster free worker takes the rest: commit this step and hand the job over.
                ray.get(queue.commit.remote(lease.lease_id, step, latent, release=True))
                report.handed_off += 1
                return

    def _commit(self, queue, lease: Lease, step: int, latent_LC: torch.Tensor) -> str:
        import ray

        return ray.get(queue.commit.remote(lease.lease_id, step, latent_LC))


def load_worker_policy(model, spec: DenoiseSpec, *, commit_every: int, num_threads: int):
    """What a denoising worker sets up once: checked settings, its threads, the policy, the sigmas."""
    from spotlight.policy import load_policy
    from spotlight.sampling import qwen_image_sigmas

    if commit_every < 1:
        raise ValueError(f"commit_every must be >= 1, got {commit_every}")
    torch.set_num_threads(num_threads)
    _quiet_libraries()
    policy = load_policy(model, trainable=False)
    return policy, qwen_image_sigmas(spec.num_steps, policy.latent_shape[0])


def _quiet_libraries() -> None:
    import diffusers
    import transformers

    diffusers.utils.logging.disable_progress_bar()
    diffusers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()


# -- the Ray edge: the pool ----------------------------------------------------------------------


@dataclass(eq=False)
class _Worker:
    worker_id: str
    node_id: str
    actor: Any
    ready_ref: Any
    state: str = "loading"  # loading -> idle <-> running; -> left | dead
    run_ref: Any = None
    report: WorkerReport | None = None


class WorkerPool:
    """One `DenoiseWorker` on every alive spot node, started as nodes join; reports what happens to them.

    A node whose worker left after a notice gets no new worker (it is being reclaimed); a node
    whose worker died while the node lives (a crash, `ray.kill`) gets a fresh one, after
    `suspect_s` if the worker had become unreachable.

    Args:
        model: `ModelConfig` of the workers' policy.
        spec: how trajectories are sampled.
        worker_kwargs: more `DenoiseWorker` arguments, for every worker.
        node_kwargs: more arguments per node, from its `ray.nodes()` entry (e.g. its `Labels`):
            `node_kwargs(node) -> dict` (a speed, the node's metadata endpoint).
        worker_cls: the actor class (tests pass a subclass that injects faults).
        suspect_s: after a worker became unreachable (`ActorUnavailableError`), wait this long before
            starting another on its node, which is likely dying but not yet declared dead.
    """

    def __init__(
        self,
        model,
        spec: DenoiseSpec,
        *,
        worker_kwargs: dict | None = None,
        node_kwargs: Callable[[dict], dict] | None = None,
        worker_cls: type = DenoiseWorker,
        suspect_s: float = 15.0,
    ):
        import ray

        self._ray = ray
        self.model = model
        self.spec = spec
        self.worker_kwargs = dict(worker_kwargs or {})
        self.node_kwargs = node_kwargs
        self._cls = ray.remote(worker_cls)
        self.workers: dict[str, _Worker] = {}
        self._retired_nodes: set[str] = set()
        self._suspect_until: dict[str, float] = {}
        self.suspect_s = suspect_s
        self._next_id = 0
        self.events: list[tuple[float, str, str]] = []
        """(time.monotonic(), worker_id, event) for ready / died / left / stopped."""

    # -- membership ---------------------------------------------------------------------------

    def maintain(self) -> list[tuple[str, str]]:
        """Start workers on new spot nodes; return [(worker_id, event)] for what changed since the last call.

        Events: "ready" (model loaded), "stopped" (its run ended: queue closed), "left" (a notice),
        "died" (its actor or node is gone).
        """
        ray = self._ray
        alive_nodes = {n["NodeID"]: n for n in ray.nodes() if n["Alive"] and n["Resources"].get(SPOT, 0) > 0}
        events: list[tuple[str, str]] = []
        for w in self.workers.values():
            if w.state in ("left", "dead"):
                continue
            if w.node_id not in alive_nodes:
                self._mark_dead(w, "its node is gone", events)
            elif w.state == "loading" and ray.wait([w.ready_ref], timeout=0)[0]:
                try:
                    ray.get(w.ready_ref)
                    w.state = "idle"
                    events.append((w.worker_id, "ready"))
                except ray.exceptions.RayError as err:
                    self._mark_dead(w, f"failed to start: {err}", events)
            elif w.state == "running" and ray.wait([w.run_ref], timeout=0)[0]:
                try:
                    w.report = ray.get(w.run_ref)
                except ray.exceptions.RayError as err:  # RayActorError: ActorDiedError, ActorUnavailableError
                    self._mark_dead(w, type(err).__name__, events)
                    if isinstance(err, ray.exceptions.ActorUnavailableError):
                        # Its node may be dying and not yet declared dead: wait before starting another there.
                        self._suspect_until[w.node_id] = time.monotonic() + self.suspect_s
                    continue
                if w.report.left:
                    w.state = "left"
                    self._retired_nodes.add(w.node_id)
                    events.append((w.worker_id, "left"))
                else:
                    w.state = "idle"
                    events.append((w.worker_id, "stopped"))
        covered = {w.node_id for w in self.workers.values() if w.state != "dead"}
        now = time.monotonic()
        suspect = {n for n, until in self._suspect_until.items() if until > now}
        for node_id in sorted(alive_nodes.keys() - covered - self._retired_nodes - suspect):
            self._spawn(alive_nodes[node_id])
        self.events.extend((now, wid, ev) for wid, ev in events)
        return events

    def _spawn(self, node: dict) -> None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        node_id = node["NodeID"]
        worker_id = f"w{self._next_id}"
        self._next_id += 1
        kwargs = {**self.worker_kwargs, **(self.node_kwargs(node) if self.node_kwargs else {})}
        gpu = 1 if self.model.device.startswith("cuda") else 0
        actor = self._cls.options(
            num_cpus=1, num_gpus=gpu, resources={SPOT: 1}, max_concurrency=2, max_restarts=0, max_task_retries=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        ).remote(worker_id, self.model, self.spec, **kwargs)  # fmt: skip
        self.workers[worker_id] = _Worker(worker_id, node_id, actor, actor.ready.remote())

    def _mark_dead(self, w: _Worker, why: str, events: list) -> None:
        logger.info("worker %s on node %s lost: %s", w.worker_id, w.node_id[:8], why)
        w.state = "dead"
        events.append((w.worker_id, "died"))
        kill_actor(self._ray, w.actor)

    def wait_ready(self, num_workers: int, timeout_s: float) -> list[tuple[str, str]]:
        """Maintain until `num_workers` workers are ready (idle or running); the events seen meanwhile."""
        deadline = time.monotonic() + timeout_s
        events: list[tuple[str, str]] = []
        while True:
            events += self.maintain()
            if len(self.ready()) >= num_workers:
                return events
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(self.ready())} of {num_workers} workers ready after {timeout_s} s")
            time.sleep(0.1)

    def ready(self) -> list[str]:
        """Workers with a loaded model that can take jobs (idle or running)."""
        return [w.worker_id for w in self.workers.values() if w.state in ("idle", "running")]

    def idle(self) -> list[str]:
        return [w.worker_id for w in self.workers.values() if w.state == "idle"]

    def start(self, worker_id: str, queue) -> None:
        """Let an idle worker pull from `queue`."""
        w = self.workers[worker_id]
        assert w.state == "idle", (worker_id, w.state)
        w.state, w.report = "running", None
        w.run_ref = w.actor.run.remote(queue)

    def actor(self, worker_id: str):
        return self.workers[worker_id].actor

    def node_of(self, worker_id: str) -> str:
        return self.workers[worker_id].node_id

    def close(self) -> None:
        """Kill every worker."""
        for w in self.workers.values():
            kill_actor(self._ray, w.actor)
        self.workers.clear()


# -- the driver -------------------------------------------------------------------------------------


@dataclass
class RunReport:
    """Outcome of `PullScheduler.run`."""

    results: list[Result]
    """One per delivered job, in delivery order."""
    num_jobs: int
    wall_s: float
    """From submission to the last result (to the end of the run if some are missing)."""
    stats: QueueStats
    duplicated: int
    """Results delivered twice (0 is the promise)."""
    lost: int
    """Jobs without a result when the run ended (0 unless it timed out)."""
    events: list[tuple[float, str, str]] = field(default_factory=list)
    """The pool's events (seconds since submission, worker, event)."""


class PullScheduler:
    """Drives one queue with a pool: free workers pull; lost workers' jobs go back to the queue.

    Call `submit`, then `run` (or `tick` in your own loop), then `close`.

    Args:
        pool: the workers.
        lease_timeout_s: see `JobQueue`.
        tick_s: the driver's loop period (membership, results).
        handoff: let a free worker take a running job over from a slower one (`JobQueue`'s tail hand-off).
    """

    def __init__(self, pool: WorkerPool, *, lease_timeout_s: float = 5.0, tick_s: float = 0.1, handoff: bool = True):
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self._ray = ray
        self.pool = pool
        self.tick_s = tick_s
        # The queue lives on the driver's node: the on-demand node, which outlives the spot ones.
        here = ray.get_runtime_context().get_node_id()
        self.queue = ray.remote(JobQueue).options(
            num_cpus=0, max_restarts=0, scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False)
        ).remote(lease_timeout_s=lease_timeout_s, handoff_steps=pool.spec.num_steps if handoff else 0)
        self.results: list[Result] = []
        self._seen: set[int] = set()
        self.duplicated = 0
        self.num_jobs = 0
        self._t0: float | None = None
        self._t_last: float | None = None
        self._published: dict[int, Any] = {}  # version -> ObjectRef the queue may still hand out

    def publish(self, version: int, state: dict[str, torch.Tensor]) -> None:
        """Make weights `version` (`spotlight.policy.trainable_state` of the trained policy)
        available to the workers. It goes into the object store once; each worker fetches it when
        it next needs a job of that version. Jobs of a version not published yet wait for it."""
        ref = self._ray.put(state)
        self._published[version] = ref  # this process owns the object: keep it while the queue may hand it out
        self._ray.get(self.queue.publish.remote(version, [ref]))  # in a list: Ray passes it on unresolved
        kept = set(self._ray.get(self.queue.published_versions.remote()))
        self._published = {v: r for v, r in self._published.items() if v in kept}

    def submit(self, jobs: Sequence[Job]) -> None:
        self._ray.get(self.queue.submit.remote(list(jobs)))
        self._begin(len(jobs))

    def _begin(self, num_jobs: int) -> None:
        self.num_jobs += num_jobs
        if self._t0 is None:
            self._t0 = time.monotonic()

    def tick(self) -> list[Result]:
        """One round: react to pool events, start idle workers, collect new results."""
        ray = self._ray
        for worker_id, event in self.pool.maintain():
            self._on_event(worker_id, event)
        for worker_id in self.pool.idle():
            self.pool.start(worker_id, self.queue)
        fresh = ray.get(self.queue.results.remote(len(self.results)))
        for r in fresh:
            if r.job_id in self._seen:
                self.duplicated += 1
            self._seen.add(r.job_id)
        self.results.extend(fresh)
        if fresh:
            self._t_last = time.monotonic()
        return fresh

    def _on_event(self, worker_id: str, event: str) -> None:
        if event in ("died", "left"):
            # Fence it and requeue its job (a departed worker already handed its job back).
            self._ray.get(self.queue.worker_lost.remote(worker_id))

    @property
    def started_at(self) -> float | None:
        """`time.monotonic()` at the first submission (the zero of `RunReport`'s times)."""
        return self._t0

    @property
    def done(self) -> bool:
        return len(self._seen) >= self.num_jobs

    def run(self, timeout_s: float) -> RunReport:
        """Tick until every job has a result or `timeout_s` passes."""
        assert self._t0 is not None, "submit jobs first"
        deadline = time.monotonic() + timeout_s
        while not self.done and time.monotonic() < deadline:
            self.tick()
            if not self.done:
                time.sleep(self.tick_s)
        return self.report()

    def report(self) -> RunReport:
        t_end = self._t_last if self.done and self._t_last is not None else time.monotonic()
        stats = self._ray.get(self.queue.snapshot.remote())["stats"]
        t0 = self._t0 or t_end
        return RunReport(
            results=list(self.results),
            num_jobs=self.num_jobs,
            wall_s=t_end - t0,
            stats=stats,
            duplicated=self.duplicated,
            lost=self.num_jobs - len(self._seen),
            events=[(t - t0, wid, ev) for t, wid, ev in self.pool.events if t >= t0],
        )

    def close(self, timeout_s: float = 10.0) -> list[WorkerReport]:
        """Close the queue, let running workers return to idle, and drop the queue."""
        ray = self._ray
        ray.get(self.queue.close.remote())
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.pool.maintain()
            if not any(w.state == "running" for w in self.pool.workers.values()):
                break
            time.sleep(0.05)
        reports = [w.report for w in self.pool.workers.values() if w.report is not None]
        ray.kill(self.queue, no_restart=True)
        return reports


class PushScheduler(PullScheduler):
    """The baseline: jobs pushed round robin to the workers ready at submission; a lost worker's
    jobs re-pushed round robin to the workers ready then (from their last commit)."""

    def __init__(self, pool: WorkerPool, **kwargs):
        super().__init__(pool, handoff=False, **kwargs)  # pushed jobs stay where they were pushed
        self._orphaned: list[str] = []  # lost workers whose jobs found nobody to go to
        self.repushed: list[int] = []
        """Ids of the jobs re-pushed so far (a job once per re-push)."""

    def submit(self, jobs: Sequence[Job]) -> None:
        workers = self.pool.ready()
        if not workers:
            raise ValueError("push needs ready workers to assign jobs to; call pool.wait_ready first")
        assignees = [workers[i % len(workers)] for i in range(len(jobs))]
        self._ray.get(self.queue.submit.remote(list(jobs), assignees))
        self._begin(len(jobs))

    def _on_event(self, worker_id: str, event: str) -> None:
        super()._on_event(worker_id, event)
        ray = self._ray
        if event in ("died", "left"):
            self._orphaned.append(worker_id)
        targets = self.pool.ready()
        if self._orphaned and targets:
            for lost in self._orphaned:
                self.repushed += ray.get(self.queue.reassign.remote(lost, targets))
            self._orphaned.clear()
