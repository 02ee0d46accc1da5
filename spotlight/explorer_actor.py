"""The Ray edge of seed exploration: a local cluster, the explorer actor, and the pool that drives it.

`spotlight.explore` decides what to explore and which seeds to keep; this module only moves work
and weights. An `Explorer` actor (1 CPU and one unit of the custom `spot` resource, so it lands on
a spot node) loads the recipe's policy and reward once, then for each job samples the candidates
with the training rollout's sampler (`rollout.rollout`) and scores them.

Weights reach explorers without blocking the trainer: `publish` does one `ray.put` of a CPU copy
of the trainable state, and `submit` sends `set_weights.remote(version, ref)` ahead of
`explore.remote(job)`; calls from one caller to one actor run in order, so the job sees those
weights, and the explorer checks the version anyway.

Faults: a dead actor (RayActorError) is dropped and replaced by a new one, which takes jobs once
its `ready` call returns (it may wait for a spot node to come back); a slot whose replacements
fail to start three times in a row is given up.

Local cluster: `ray.cluster_utils.Cluster` with a head node carrying {"on_demand": 1} and
`explore.num_spot_nodes` nodes carrying {"spot": 1}, one CPU each, all bound to 127.0.0.1. Ray
maps 127.0.0.1 to the machine's outward address unless RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 is set
before `ray` is first imported (design.md §4), which `LocalCluster` does. It is not set when
joining a user's cluster (`explore.ray_address`), whose nodes must reach each other.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from spot.localray import ON_DEMAND, SPOT, import_ray_on_loopback, kill_actor
from spotlight.config import DiTRecipe
from spotlight.explore import ExploreJob, ExploreResult

logger = logging.getLogger(__name__)

_MAX_FAILED_STARTS = 3


class LocalCluster:
    """A real multi-node Ray cluster on this machine: an on-demand head and `num_spot_nodes` spot nodes.

    Args:
        num_spot_nodes: nodes with {"spot": 1} and one CPU each.
        head_cpus: CPUs of the head node (the driver needs none; 1 leaves room for small tasks).
    """

    def __init__(self, num_spot_nodes: int, *, head_cpus: int = 1):
        ray = import_ray_on_loopback()
        from ray.cluster_utils import Cluster

        common = {"node_ip_address": "127.0.0.1"}
        self.cluster = Cluster(
            initialize_head=True,
            head_node_args={**common, "num_cpus": head_cpus, "resources": {ON_DEMAND: 1}, "include_dashboard": False},
        )
        try:
            self.spot_nodes = [self.cluster.add_node(**common, num_cpus=1, resources={SPOT: 1}) for _ in range(num_spot_nodes)]
        except BaseException:
            self.cluster.shutdown()
            raise
        self._ray = ray

    @property
    def address(self) -> str:
        return self.cluster.address

    def shutdown(self) -> None:
        self.cluster.shutdown()


class Explorer:
    """Ray actor: samples and scores candidate seeds with the weights it was last sent."""

    def __init__(self, cfg: DiTRecipe, num_threads: int):
        torch.set_num_threads(num_threads)
        from spotlight.policy import load_policy
        from spotlight.rewards import build_reward
        from spotlight.sampling import qwen_image_sigmas

        _quiet_libraries()
        self.cfg = cfg
        self.policy = load_policy(cfg.model, trainable=False)
        self.reward_fn = build_reward(cfg.reward.weights, **cfg.reward.options())
        self.sigmas = qwen_image_sigmas(cfg.sample.num_steps, self.policy.latent_shape[0])
        self.version = -1

    def ready(self) -> str:
        """The node this explorer runs on (returns once the model is loaded)."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def set_weights(self, version: int, state: dict[str, torch.Tensor]) -> None:
        from spotlight.policy import load_trainable_state

        load_trainable_state(self.policy, state)
        self.version = version

    def explore(self, job: ExploreJob) -> ExploreResult:
        """Sample and score the job's rows in batches, stopping at its time limit."""
        from spotlight.rollout import resolve_autocast, rollout

        if job.version != self.version:
            raise RuntimeError(f"explorer holds weights version {self.version}, job needs {job.version}")
        s = self.cfg.sample
        t0 = time.monotonic()
        rewards: list[float] = []
        bs = self.cfg.explore.batch_size
        autocast = resolve_autocast(s.autocast, self.policy.device, self.cfg.train.objective)
        for start in range(0, len(job.seeds), bs):
            if job.time_limit_s is not None and time.monotonic() - t0 > job.time_limit_s:
                break
            prompts = job.prompts[start : start + bs]
            ro = rollout(
                self.policy, prompts, job.seeds[start : start + bs], self.sigmas,
                noise_level=s.noise_level, sde_steps=job.sde_steps, sde_type=s.sde_type,
                guidance_scale=s.guidance_scale, negative_prompt=s.negative_prompt, batch_size=bs,
                autocast=autocast,
            )  # fmt: skip
            rewards.extend(self.reward_fn(ro.images, prompts).total_B.tolist())
        n = len(rewards)
        return ExploreResult(
            iteration=job.iteration,
            version=self.version,
            slots=job.slots[:n],
            candidates=job.candidates[:n],
            rewards=rewards,
            busy_s=time.monotonic() - t0,
            complete=n == len(job.seeds),
            explorer=self.ready(),
        )


def _quiet_libraries() -> None:
    import diffusers
    import transformers

    diffusers.utils.logging.disable_progress_bar()
    diffusers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()


@dataclass
class _Slot:
    actor: Any
    ready_ref: Any
    live: bool = False
    dead: bool = False
    version: int = -1
    failed_starts: int = 0


@dataclass(eq=False)
class _Handle:
    slot: int
    actor: Any
    ref: Any


class RayExplorerPool:
    """`num_explorers` Explorer actors on `spot` resources, with the calls `explore.Exploration` makes.

    Args:
        cfg: the recipe (model, reward and sampler of the explorers).
        num_explorers: actors to keep.
        on_close: called in order by `close` (disconnect, stop the local cluster).
    """

    def __init__(self, cfg: DiTRecipe, num_explorers: int, *, on_close: Sequence = ()):
        import ray

        self._ray = ray
        self.cfg = cfg
        self.deaths = 0
        self.respawns = 0
        self._on_close = list(on_close)
        self._weights: tuple[int, Any] | None = None
        gpu = 1 if cfg.model.device.startswith("cuda") else 0
        self._cls = ray.remote(Explorer).options(
            num_cpus=1, num_gpus=gpu, resources={SPOT: 1}, max_restarts=0, max_task_retries=0
        )
        self.slots = [self._spawn() for _ in range(num_explorers)]

    def _spawn(self) -> _Slot:
        actor = self._cls.remote(self.cfg, self.cfg.explore.explorer_threads)
        return _Slot(actor, actor.ready.remote())

    def wait_ready(self, timeout_s: float) -> int:
        pending = [s.ready_ref for s in self.slots if not s.live and not s.dead]
        if pending:
            self._ray.wait(pending, num_returns=len(pending), timeout=timeout_s)
        self.maintain()
        return len(self.live())

    def maintain(self) -> None:
        """Promote explorers whose model is loaded; replace dead ones."""
        ray = self._ray
        for i, s in enumerate(self.slots):
            if s.dead:
                if s.failed_starts >= _MAX_FAILED_STARTS:
                    continue
                fresh = self._spawn()
                fresh.failed_starts = s.failed_starts
                self.slots[i] = fresh
                self.respawns += 1
                continue
            if s.live:
                continue
            ready, _ = ray.wait([s.ready_ref], timeout=0)
            if not ready:
                continue
            try:
                node = ray.get(ready[0])
            except ray.exceptions.RayError as err:
                s.failed_starts += 1
                self._mark_dead(i, f"explorer {i} failed to start: {err}")
                if s.failed_starts >= _MAX_FAILED_STARTS:
                    logger.error("explorer %d failed to start %d times; giving it up", i, s.failed_starts)
                continue
            s.live, s.failed_starts = True, 0
            logger.info("explorer %d ready on node %s", i, node)

    def _mark_dead(self, i: int, why: str) -> None:
        s = self.slots[i]
        if s.dead:
            return
        s.dead, s.live = True, False
        self.deaths += 1
        logger.warning("%s", why)
        kill_actor(self._ray, s.actor)

    def live(self) -> list[int]:
        return [i for i, s in enumerate(self.slots) if s.live]

    def publish(self, version: int, state: dict[str, torch.Tensor]) -> None:
        if self._weights is None or self._weights[0] != version:
            self._weights = (version, self._ray.put(state))

    def submit(self, explorer: int, job: ExploreJob) -> _Handle:
        assert self._weights is not None and self._weights[0] == job.version, "publish the job's weights first"
        s = self.slots[explorer]
        assert s.live, explorer
        if s.version != job.version:
            s.actor.set_weights.remote(job.version, self._weights[1])
            s.version = job.version
        return _Handle(explorer, s.actor, s.actor.explore.remote(job))

    def poll(self, handles: Sequence[_Handle], timeout_s: float | None) -> list[tuple[_Handle, ExploreResult | None, str | None]]:
        """The handles whose jobs finished within timeout_s (None: wait for all): (handle, result, cause)."""
        ray = self._ray
        if not handles:
            return []
        by_ref = {h.ref: h for h in handles}
        ready, _ = ray.wait(list(by_ref), num_returns=len(by_ref), timeout=timeout_s)
        out = []
        for ref in ready:
            h = by_ref[ref]
            try:
                out.append((h, ray.get(ref), None))
            except ray.exceptions.RayActorError as err:
                if self.slots[h.slot].actor is h.actor:
                    self._mark_dead(h.slot, f"explorer {h.slot} died: {type(err).__name__}")
                out.append((h, None, "died"))
            except ray.exceptions.TaskCancelledError:
                out.append((h, None, "late"))
            except ray.exceptions.RayError as err:
                logger.warning("explorer %d job failed: %s", h.slot, err)
                out.append((h, None, "error"))
        return out

    def cancel(self, handles: Sequence[_Handle]) -> None:
        for h in handles:
            try:
                self._ray.cancel(h.ref)
            except Exception:  # noqa: BLE001 - a finished or dead task cannot be cancelled: fine
                pass

    def close(self) -> None:
        try:
            for s in self.slots:
                kill_actor(self._ray, s.actor)
        finally:
            for fn in self._on_close:
                try:
                    fn()
                except Exception as err:  # noqa: BLE001 - shut down the rest regardless
                    logger.warning("shutting down exploration: %s", err)


def warn_if_cpus_oversubscribed(cfg: DiTRecipe, num_cpus: int | None = None) -> str | None:
    """Warn (and return the message) when a local cluster's explorers and the trainer want more
    CPUs than this machine has.

    Ray starts worker processes at niceness 15 (its `worker_niceness` setting), so on a shared CPU
    the explorers get only what the trainer leaves idle: measured on 2 cores with the trainer's 2
    threads, one 16-candidate batch took 10-13 s instead of 0.4 s, and the budget fell to nothing.
    That keeps exploration off the critical path, as on real spot GPUs, but it explores little.
    """
    e = cfg.explore
    cpus = num_cpus or len(os.sched_getaffinity(0))
    trainer = cfg.train.num_threads or torch.get_num_threads()
    explorers = e.num_spot_nodes * e.explorer_threads
    if trainer + explorers <= cpus:
        return None
    msg = (
        f"local exploration cluster: the trainer's {trainer} torch thread(s) (train.num_threads) and "
        f"{e.num_spot_nodes} explorer(s) x {e.explorer_threads} thread(s) share {cpus} CPU(s); Ray runs the "
        "explorers at a lower priority, so they get only the CPU the trainer leaves idle and explore little "
        "(see explore/samples_per_s). Give them cores of their own"
        + (f", e.g. train.num_threads={cpus - 1} explore.num_spot_nodes=1 on this machine," if cpus >= 2 else "")
        + " or join a cluster with explore.ray_address."
    )
    logger.warning("%s", msg)
    return msg


def start_ray_pool(cfg: DiTRecipe) -> RayExplorerPool:
    """Start (or join) the Ray cluster and the explorers; the pool's `close` undoes both."""
    e = cfg.explore
    cluster = None
    if not e.ray_address:
        warn_if_cpus_oversubscribed(cfg)
        cluster = LocalCluster(e.num_spot_nodes)
    import ray

    try:
        ray.init(address=cluster.address if cluster else e.ray_address, log_to_driver=False, logging_level=logging.WARNING)
        num = e.num_explorers or int(ray.cluster_resources().get(SPOT, 0))
        if num == 0:
            raise ValueError(f"explore.ray_address={e.ray_address!r}: the cluster has no '{SPOT}' resource for explorers")
        on_close = [ray.shutdown] + ([cluster.shutdown] if cluster else [])
        return RayExplorerPool(cfg, num, on_close=on_close)
    except BaseException:
        if ray.is_initialized():
            ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        raise
