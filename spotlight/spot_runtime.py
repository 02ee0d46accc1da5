"""The DiT trainer's side of the spot runtime: the cluster, the workers, and the two kinds of job.

`start_runtime(cfg, run_dir)` brings up what the recipe's `runtime` section asks for:

    runtime.ray_address set   join that cluster (its nodes with the `spot` resource are spot capacity)
    runtime.trace set         a local cluster in a process of its own that adds and kills spot nodes
                              along the trace (`spot.replay.ReplayProcess`, rescaled and compressed
                              like `benchmarks/preemption_replay.py`; notices through a fake
                              metadata endpoint per node with runtime.trace_notice_s)
    otherwise                 a local cluster: an on-demand head and runtime.spot_nodes spot nodes

then a `spot.pool.WorkerPool` of `spotlight.jobs.DiTRunner` workers (one per spot slot, and
runtime.on_demand_workers on this node when rollouts run on the cluster) in groups of
parallel.sp_degree, and the driver `spot.runtime.Runtime` ticking on a background thread.

`SpotRuntime.rollout` runs an iteration's rollout as jobs on the pull queue and waits only for
them; `SpotRuntime.explorers()` is the exploration pool (`spotlight.explore.ExplorerPool`) on the
same workers: exploration jobs run on spot workers only, at a lower priority than rollouts (a
running exploration job yields to a waiting rollout at its next step), the newest window first.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

import torch

from spot.jobqueue import Job
from spot.localray import import_ray_on_loopback
from spot.runtime import Runtime, RuntimeStatus
from spotlight.config import DiTRecipe
from spotlight.core.cost import ON_DEMAND, SPOT
from spotlight.jobs import (
    EXPLORE,
    ROLLOUT,
    ROLLOUT_PRIORITY,
    DiTRunner,
    assemble_rollout,
    explore_num_steps,
    explore_priority,
    rollout_jobs,
)
from spotlight.rollout import Rollout
from spotlight.seed_selection import ExploreJob, ExploreResult

logger = logging.getLogger(__name__)

REPLAY_EVENTS, REPLAY_LOG = "replay.jsonl", "replay.log"
"""Files of a trace replay in the run directory: the events as applied, and the replay process's log."""
LEASES = "leases.jsonl"
"""Every lease the queue handed out and how it ended (`spot.jobqueue.JobQueue.lease_log`), written
to the run directory when the runtime closes: which worker ran which steps of each job, and which
jobs a notice, a hand-off or a lost worker moved."""


def warn_if_cpus_oversubscribed(cfg: DiTRecipe, num_cpus: int | None = None) -> str | None:
    """Warn (and return the message) when a local cluster's spot workers and the trainer want more
    CPUs than this machine has.

    Ray starts worker processes at niceness 15 (its `worker_niceness` setting), so on a shared CPU the
    spot workers get only what the trainer leaves idle, and exploration budgets fall to nothing
    (docs/tiny-recipe-notes.md, fourteenth session, has a measurement). That keeps exploration off the
    critical path, as on real spot GPUs, but it explores little. Rollout workers are not counted: the
    trainer waits while they work.
    """
    r = cfg.runtime
    cpus = num_cpus or len(os.sched_getaffinity(0))
    trainer = cfg.train.num_threads or torch.get_num_threads()
    workers = r.spot_nodes * r.worker_threads
    if trainer + workers <= cpus:
        return None
    msg = (
        f"local cluster: the trainer's {trainer} torch thread(s) (train.num_threads) and {r.spot_nodes} spot "
        f"worker(s) x {r.worker_threads} thread(s) share {cpus} CPU(s); Ray runs the workers at a lower priority, "
        "so they explore only with the CPU the trainer leaves idle (see explore/samples_per_s). Give them cores "
        "of their own"
        + (f", e.g. train.num_threads={cpus - 1} runtime.spot_nodes=1 on this machine," if cpus >= 2 else "")
        + " or join a cluster with runtime.ray_address."
    )
    logger.warning("%s", msg)
    return msg


class SpotRuntime:
    """The recipe's cluster, workers and runtime; `close` undoes all of it.

    Args:
        cfg: the recipe.
        runtime: the driver, started.
        on_close: called in order by `close` (disconnect, stop the cluster or the replay).
        replay: the trace replay, if any (its clock starts with `go`).
        run_dir: where `close` writes the lease log (`LEASES`); None: nowhere.
    """

    def __init__(
        self,
        cfg: DiTRecipe,
        runtime: Runtime,
        *,
        on_close: Sequence[Callable[[], None]] = (),
        replay=None,
        run_dir: str | Path | None = None,
    ):
        self.cfg = cfg
        self.run_dir = None if run_dir is None else Path(run_dir)
        self.runtime = runtime
        self.replay = replay
        self._on_close = list(on_close)
        self._next_job = 0
        self._published: int | None = None
        self.last_rollout: dict[str, float] = {}

    # -- lifecycle ------------------------------------------------------------------------------

    def wait_ready(self, timeout_s: float) -> dict[str, int]:
        """Wait until the workers the trainer needs first are up (the on-demand ones and the initial
        spot ones, or at least one spot worker when only exploring); the workers up per pool."""
        pool = self.runtime.pool
        want_on_demand = pool.on_demand_workers if self.cfg.runtime.rollouts == "cluster" else 0
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            status = self.status()
            spot_ok = status.workers[SPOT] >= max(1, status.spot_nodes) or status.spot_nodes == 0
            if status.workers[ON_DEMAND] >= want_on_demand and spot_ok and status.groups:
                break
            time.sleep(0.2)
        return self.status().workers

    def _write_lease_log(self) -> None:
        if self.run_dir is None:
            return
        try:
            rows = self.runtime.lease_log()
            tmp = self.run_dir / f".{LEASES}.tmp"
            tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
            os.replace(tmp, self.run_dir / LEASES)
        except Exception as err:
            logger.warning("could not write %s: %s", self.run_dir / LEASES, err)

    def start_trace(self) -> None:
        """Start the trace replay's clock (no-op without a trace)."""
        if self.replay is not None:
            self.replay.go()

    def close(self) -> None:
        try:
            self._write_lease_log()
            self.runtime.close()
            self.runtime.pool.close()
        finally:
            for fn in self._on_close:
                try:
                    fn()
                except Exception as err:
                    logger.warning("shutting down the runtime: %s", err)

    def status(self) -> RuntimeStatus:
        return self.runtime.status()

    def _ids(self, n: int) -> list[int]:
        ids = list(range(self._next_job, self._next_job + n))
        self._next_job += n
        return ids

    def publish(self, version: int, weights: Callable[[], dict[str, torch.Tensor]]) -> None:
        """Publish weights `version` (once per version: `weights()` is called only the first time)."""
        if self._published != version:
            self.runtime.publish(version, weights())
            self._published = version

    # -- rollouts -------------------------------------------------------------------------------

    def rollout(
        self,
        version: int,
        weights: Callable[[], dict[str, torch.Tensor]],
        prompts: Sequence[str],
        seeds: Sequence[int],
        sde_steps: Sequence[int],
        sigmas: torch.Tensor,
    ) -> Rollout:
        """The rollout of these rows with weights `version`, as jobs on the queue; waits only for them."""
        t0 = time.monotonic()
        self.publish(version, weights)
        work = rollout_jobs(self.cfg, prompts, seeds, sde_steps)
        ids = self._ids(len(work))
        n = self.cfg.sample.num_steps
        self.runtime.submit(
            [
                Job(i, w, version=version, priority=ROLLOUT_PRIORITY, num_steps=n, kind=ROLLOUT)
                for i, w in zip(ids, work)
            ]
        )
        t1 = time.monotonic()
        results = self.runtime.wait(ids, timeout_s=self.cfg.runtime.rollout_timeout_s)
        t2 = time.monotonic()
        ro = assemble_rollout(self.cfg, work, [results[i].output for i in ids], sigmas)
        self.last_rollout = {"publish_submit_s": t1 - t0, "wait_s": t2 - t1, "assemble_s": time.monotonic() - t2}
        return ro

    # -- the exploration pool -------------------------------------------------------------------

    def explorers(self) -> RuntimeExplorers:
        return RuntimeExplorers(self)

    def metrics(self) -> dict[str, float]:
        """runtime/* metrics: capacity held, preemptions, and what they cost in steps."""
        s = self.status()
        m = {
            "runtime/spot_nodes": s.spot_nodes,
            "runtime/spot_workers": s.workers[SPOT],
            "runtime/on_demand_workers": s.workers[ON_DEMAND],
            "runtime/groups": s.groups,
            "runtime/preemptions_total": s.preemptions,
            "runtime/preemptions_hitting_work_total": s.preemptions_hitting_work,
            "runtime/duplicated_results_total": s.duplicated,
        }
        for kind in (ROLLOUT, EXPLORE):
            k = s.stats_by_kind.get(kind)
            if k is None:
                continue
            m[f"runtime/{kind}_jobs_submitted_total"] = k.submitted
            m[f"runtime/{kind}_jobs_done_total"] = k.done
            m[f"runtime/{kind}_jobs_cancelled_total"] = k.cancelled
            m[f"runtime/{kind}_jobs_resumed_total"] = s.resumed.get(kind, 0)
            m[f"runtime/{kind}_leases_revoked_total"] = k.revoked
            m[f"runtime/{kind}_leases_released_total"] = k.released
            m[f"runtime/{kind}_leases_yielded_total"] = k.yielded
            m[f"runtime/{kind}_steps_recomputed_total"] = k.recomputed_steps + k.steps_in_flight_lost
        if self.last_rollout:
            m.update({f"time/rollout_{k}": v for k, v in self.last_rollout.items()})
        return m

    def describe(self) -> str:
        """One line for the progress display: nodes held, preemptions, jobs resumed."""
        s = self.status()
        resumed = sum(s.resumed.values())
        return (
            f"spot nodes {s.spot_nodes} · preemptions {s.preemptions} ({s.preemptions_hitting_work} on work) · "
            f"jobs resumed {resumed}"
        )


class RuntimeExplorers:
    """`spotlight.explore.ExplorerPool` on the runtime: exploration jobs for the spot workers.

    A handle is the job's id. A job whose worker is preempted resumes from its last commit on
    another spot worker (it comes back late rather than not at all), so "died" is never a cause
    here; a cancelled job loses only its own partial scores.
    """

    def __init__(self, rt: SpotRuntime):
        self.rt = rt
        self._version: int | None = None
        self._weights: Callable | None = None

    @property
    def deaths(self) -> int:
        """Spot workers lost so far (preempted, killed or retired after a notice)."""
        pool = self.rt.runtime.pool
        return sum(1 for m in pool.workers.values() if m.pool == SPOT and m.state in ("dead", "retired"))

    @property
    def respawns(self) -> int:
        """Spot workers started to replace lost ones (or on nodes that joined later)."""
        pool = self.rt.runtime.pool
        started = sum(1 for m in pool.workers.values() if m.pool == SPOT)
        return max(0, started - self._initial)

    def wait_ready(self, timeout_s: float) -> int:
        self.rt.wait_ready(timeout_s)
        self._initial = sum(1 for m in self.rt.runtime.pool.workers.values() if m.pool == SPOT)
        return self.capacity()

    def maintain(self) -> None:
        pass  # the runtime's own loop keeps membership

    def take_emulated_s(self) -> float:
        return 0.0  # real workers: the trainer never waits for them

    def capacity(self) -> int:
        """Spot groups running (what a window's jobs are split over)."""
        return sum(1 for g in self.rt.runtime.pool.running() if g.pool == SPOT)

    def publish(self, version: int, weights: Callable[[], dict[str, torch.Tensor]]) -> None:
        self.rt.publish(version, weights)

    def submit(self, job: ExploreJob) -> int:
        (job_id,) = self.rt._ids(1)
        cfg = self.rt.cfg
        self.rt.runtime.submit(
            [
                Job(
                    job_id,
                    job,
                    version=job.version,
                    priority=explore_priority(job.iteration),
                    num_steps=explore_num_steps(cfg, job),
                    kind=EXPLORE,
                    pools=(SPOT,),
                    handoff=False,
                )
            ]
        )
        return job_id

    def poll(
        self, handles: Sequence[int], timeout_s: float | None
    ) -> list[tuple[int, ExploreResult | None, str | None]]:
        """The jobs of `handles` done within `timeout_s` (None: wait for all), as (handle, result, None)."""
        if not handles:
            return []
        if timeout_s is None:
            got = self.rt.runtime.wait(list(handles), timeout_s=self.rt.cfg.runtime.rollout_timeout_s)
        else:
            deadline = time.monotonic() + timeout_s
            got = self.rt.runtime.take(handles)
            while len(got) < len(handles) and time.monotonic() < deadline:
                time.sleep(0.02)
                got.update(self.rt.runtime.take([h for h in handles if h not in got]))
        return [(h, got[h].output, None) for h in handles if h in got]

    def cancel(self, handles: Sequence[int]) -> None:
        self.rt.runtime.cancel(list(handles))

    def close(self) -> None:
        pass  # the trainer closes the runtime


def start_runtime(cfg: DiTRecipe, run_dir: str | Path) -> SpotRuntime:
    """Start (or join) the recipe's cluster, its workers and the runtime; `close` undoes all of it."""
    r = cfg.runtime
    cfg.parallel.check_device(cfg.model.device)  # before a cluster starts or a worker loads a model
    ray = import_ray_on_loopback() if not r.ray_address else __import__("ray")
    from spot.cluster import children_on, pin_process, split_cpus
    from spot.pool import WorkerPool

    run_dir = Path(run_dir)
    on_close: list[Callable[[], None]] = []
    cpus, trainer_cpus = contextlib.nullcontext(), None
    if r.local_cluster_cpus and not r.ray_address:
        trainer_cpus, cluster_cpus = split_cpus(r.local_cluster_cpus, field="runtime.local_cluster_cpus")
        cpus = children_on(cluster_cpus)
        logger.info(
            "local cluster on CPU(s) %s, the trainer on %s (runtime.local_cluster_cpus)",
            sorted(cluster_cpus),
            sorted(trainer_cpus),
        )
    try:
        with cpus:  # the cluster's processes inherit the mask of the thread that starts them
            replay, address = _start_cluster(cfg, run_dir, on_close)
        if trainer_cpus is not None:
            mask, threads = os.sched_getaffinity(0), torch.get_num_threads()

            def unpin() -> None:  # after close the process has its CPUs and threads back
                pin_process(mask)
                torch.set_num_threads(threads)

            on_close.append(unpin)
            pin_process(trainer_cpus)
            if not cfg.train.num_threads:
                torch.set_num_threads(len(trainer_cpus))
        ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
        on_close.insert(0, ray.shutdown)
        gpu = cfg.model.device.startswith("cuda")
        pool = WorkerPool(
            partial(DiTRunner, cfg),
            sp_degree=cfg.parallel.sp_degree,
            on_demand_workers=r.on_demand_workers if r.rollouts == "cluster" else 0,
            worker_kwargs={
                "commit_every": r.commit_every,
                "num_threads": r.worker_threads,
                "imds_poll_s": r.notice_poll_s,
                "step_s": r.emulated_step_s,
            },
            # Emulated separate machines: the on-demand workers use the trainer's devices (CPUs
            # here), which it leaves idle while it waits for its rollout.
            on_demand_kwargs={"cpus": sorted(trainer_cpus)} if trainer_cpus is not None else None,
            imds_endpoint=r.imds_endpoint or None,
            gpu=gpu,
        )
        runtime = Runtime(pool, lease_timeout_s=r.lease_timeout_s).start()
        return SpotRuntime(cfg, runtime, on_close=on_close, replay=replay, run_dir=run_dir)
    except BaseException:
        for fn in ([ray.shutdown] if ray.is_initialized() else []) + [f for f in on_close if f is not ray.shutdown]:
            try:
                fn()
            except Exception:
                pass
        raise


def _start_cluster(cfg: DiTRecipe, run_dir: Path, on_close: list[Callable[[], None]]):
    """(replay, address): a trace replay's local cluster, a local cluster, or runtime.ray_address's
    (joined as it is); what was started has its stop appended to `on_close` at once."""
    from spot.cluster import LocalCluster
    from spot.replay import ReplayProcess, fit_trace

    r = cfg.runtime
    if r.trace:
        trace, _ = fit_trace(
            r.trace,
            nodes=r.trace_nodes,
            window_s=r.trace_window_s,
            start_s=None if r.trace_start_s < 0 else r.trace_start_s,
            compress=r.trace_compress,
            notice_s=r.trace_notice_s,
        )
        replay = ReplayProcess(
            trace,
            fake_imds=r.trace_notice_s > 0,
            loop=r.trace_loop,
            events_path=run_dir / REPLAY_EVENTS,
            log_path=run_dir / REPLAY_LOG,
        ).start()
        on_close.append(replay.stop)
        return replay, replay.address
    if r.ray_address:
        return None, r.ray_address
    if not r.local_cluster_cpus:
        warn_if_cpus_oversubscribed(cfg)
    cluster = LocalCluster(r.spot_nodes)
    on_close.append(cluster.shutdown)
    return None, cluster.address


def runtime_wanted(cfg: DiTRecipe) -> bool:
    """Whether a run needs the spot runtime: rollouts on the cluster, or exploration not emulated in the trainer's
    process."""
    return cfg.runtime.rollouts == "cluster" or (cfg.explore.mode != "none" and not cfg.explore.emulated_nodes)
