"""The iteration loop of each simulated policy, and the learning model that turns exploration into
fewer iterations to the target.

Policies (all run P x G rollout trajectories per iteration through the real pull queue, then score,
then update on the trainer GPUs; the update's GPU-seconds are split over the trainer GPUs):

    ondemand       `baseline_gpus` on-demand GPUs do everything; random seeds (plain Flow-GRPO).
    inline         the same GPUs, and before each rollout they explore candidate seeds with the
                   fresh weights, on the critical path (the real planner chooses; budget below).
    spotlight      `trainer_gpus` on-demand GPUs plus the spot pool of the trace. The rollout runs
                   on both (pull scheduler, commits, hand-off); while the trainer updates, the spot
                   workers explore the next batch's seeds with the previous weights, within the
                   planner's budget (predicted update time x spot throughput, as `spotlight.explore`
                   computes it); what is not done when the update ends is cut (a fallback).
                   Elastic SP where the profile uses SP. This is the trainer's
                   runtime.rollouts=cluster explore.mode=stale (docs/spot.md says where they differ).
    disaggregated  rollout on the spot pool only, update on the trainer GPUs; random seeds.

Learning model, measured. The target is `iterations_to_target` units; an iteration of plain GRPO
(random seeds) advances one unit. An iteration whose every prompt trained on the contrast group of
a full pool of fresh candidates advances `selection_iterations_ratio` units: the iterations-to-
target ratio of plain GRPO over the oracle, measured over several training seeds by
benchmarks/time_to_target.py. Stale candidates (spot explorers, the weights of one iteration
before) keep `stale_gain_share` of that gain, measured the same way. In between, each prompt adds
its share of the full pool's gain, (1/P) sum_p h(n_p), where h(n) is how much of the contrast
variance of a full pool the first n candidates capture, on average over the reward table recorded
from a real run (`planners.captured_variance`: 0 for random seeds, 1 for the full pool). Each
simulated iteration maps to an iteration of that table, whose prompts the real planner allocates
candidates to. Two assumptions are ours: the gain adds up linearly over prompts, and a partial
pool is worth its share of the captured variance. Checked against the measured curve over
explorer capacity (1-8 emulated nodes, tests/test_simulator.py); the speed-ups inherit both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from planners import Observation, RewardTable, build_planner, captured_variance, prompt_family
from spot.jobqueue import Job
from spot.sim.engine import Cluster, EventLoop
from spot.sim.profile import Profile
from spot.traces import Trace
from spotlight.core.cost import cost_usd

POLICIES = ("ondemand", "inline", "spotlight", "disaggregated")


@dataclass
class Setup:
    """What every policy of one comparison shares."""

    profile: Profile
    trace: Trace | None
    """Spot capacity in seconds, one GPU per trace node (already rescaled to the spot pool size)."""
    table: RewardTable
    trainer_gpus: int
    """On-demand GPUs of spotlight and disaggregated."""
    baseline_gpus: int
    """On-demand GPUs of ondemand and inline (default: trainer + peak spot GPUs)."""
    on_demand_usd_per_gpu_hour: float = 4.0
    spot_prices: list[list[float]] | None = None
    """[[t_s, usd_per_gpu_hour], ...] from the run's start; None: on-demand x (1 - spot_discount)."""
    spot_discount: float = 0.7
    planner: str = "bandit"
    planner_family: str = ""
    """The bandit's prompt families (a `planners.prompt_family` spec, as `explore.planner_family`); "": one."""
    elastic: bool = True
    handoff: bool = True
    seed: int = 0
    max_iterations: int = 100_000

    def __post_init__(self):
        if self.table.group_size not in (None, self.profile.group_size):
            raise ValueError(
                f"the reward table was recorded with group size {self.table.group_size}, the profile uses "
                f"{self.profile.group_size}; use a table of the same G"
            )
        if self.trainer_gpus < self.profile.min_sp_degree or self.baseline_gpus < self.profile.min_sp_degree:
            raise ValueError(f"need at least min_sp_degree={self.profile.min_sp_degree} on-demand GPUs")
        try:
            prompt_family(self.planner_family)
        except ValueError as err:
            raise ValueError(f"planner_family: {err}") from None
        if not 0 <= self.spot_discount < 1:
            raise ValueError(f"spot_discount must be in [0, 1), got {self.spot_discount}")


class Learning:
    """Prompts of each simulated iteration from a reward table, and the measured learning model
    (module docstring) that turns the candidates explored per prompt into progress."""

    def __init__(self, table: RewardTable, profile: Profile):
        self.table, self.G, self.P = table, profile.group_size, profile.prompts_per_iteration
        self.ratio, self.stale_share = profile.selection_iterations_ratio, profile.stale_gain_share
        rows = [np.asarray(r, dtype=np.float64) for it in table.iterations for r in it.values()]
        self.pool = max(r.size for r in rows)
        if self.pool <= self.G:
            raise ValueError(
                f"reward table {table.source!r}: {self.pool} candidates per prompt, "
                f"no more than G={self.G}: nothing to select"
            )
        base = np.array([captured_variance(r, 0, self.G) for r in rows])
        full = np.array([captured_variance(r, self.pool, self.G) for r in rows])
        gain = float(np.mean(full - base))
        if not gain > 0:
            raise ValueError(f"reward table {table.source!r}: a full pool captures no more variance than random seeds")
        # h(n) for n = 0..pool, the table's mean share of the full pool's variance gain.
        self._share = np.zeros(self.pool + 1)
        for n in range(self.G + 1, self.pool + 1):
            self._share[n] = float(np.mean([captured_variance(r, n, self.G) for r in rows]) - base.mean()) / gain

    def share(self, num_explored: int) -> float:
        """h(n): of the full pool's gain, the share a prompt explored with n candidates gets."""
        return float(self._share[min(max(int(num_explored), 0), self.pool)])

    def prompts(self, k: int) -> dict[str, np.ndarray]:
        """The P prompts of iteration k (consecutive table iterations, repeated), id -> candidate rewards."""
        out: dict[str, np.ndarray] = {}
        j = 0
        its = self.table.iterations
        while len(out) < self.P:
            it = its[(k * math.ceil(self.P / len(its[0])) + j) % len(its)]
            for pid, r in it.items():
                if len(out) < self.P:
                    out[pid if pid not in out else f"{pid}#{j}"] = r
            j += 1
        return out

    def progress(self, prompts: dict[str, np.ndarray], explored: dict[str, int], stale: bool) -> float:
        """Progress units of an iteration whose prompts were explored with `explored[p]` candidates
        (scored with the previous iteration's weights if `stale`)."""
        dose = float(np.mean([self.share(explored.get(p, 0)) for p in prompts]))
        return 1.0 + (self.ratio - 1.0) * (self.stale_share if stale else 1.0) * dose


@dataclass
class PolicyResult:
    policy: str
    wall_s: float
    """Time to the target."""
    iterations: int
    cost_usd: float
    cost_on_demand_usd: float
    cost_spot_usd: float
    on_demand_utilisation: float
    spot_utilisation: float | None
    """Busy over held spot GPU-seconds (None without a spot pool)."""
    work_lost_gpu_s: float
    """Spot GPU-seconds of steps lost to preemptions (recomputed, or in flight at a death)."""
    explore_cut_gpu_s: float
    preemptions: int
    notices: int
    recomputed_steps: int
    handoffs: int
    fallback_prompts: int
    """Prompts planned for exploration that trained on random seeds (too few candidates done)."""
    mean_budget_samples: float
    mean_rollout_s: float
    mean_iteration_s: float
    spot_gpu_s_held: float
    spot_gpu_s_busy: float
    series: dict = field(default_factory=dict)
    """Per-iteration end times and cumulative progress; the spot timeline (for plots)."""

    def summary(self) -> dict:
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in self.__dict__.items() if k != "series"}


def simulate(policy: str, setup: Setup, *, progress_cb=None) -> PolicyResult:
    """Run `policy` until the learning target is reached; see the module docstring."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; policies: {', '.join(POLICIES)}")
    sim = _Simulation(policy, setup)
    p = setup.profile
    while sim.progress < p.iterations_to_target and sim.k < setup.max_iterations:
        sim.iteration()
        if progress_cb is not None:
            progress_cb(policy, sim.k, sim.progress / p.iterations_to_target)
    sim.cluster.finish()
    return _result(
        policy,
        setup,
        sim.cluster,
        sim.loop,
        sim.k,
        sim.budgets,
        sim.rollout_times,
        sim.ends,
        sim.progress_curve,
        sim.fallbacks,
        sim.recomputed,
        sim.handoffs,
    )


class _Simulation:
    """One policy's run on the simulated cluster: its state, and one training iteration at a time."""

    def __init__(self, policy: str, setup: Setup):
        self.policy, self.setup = policy, setup
        p = self.p = setup.profile
        self.loop = EventLoop()
        uses_spot = policy in ("spotlight", "disaggregated")
        self.trainer_gpus = setup.trainer_gpus if uses_spot else setup.baseline_gpus
        self.cluster = Cluster(
            self.loop,
            p,
            setup.trace if uses_spot else None,
            on_demand_gpus=self.trainer_gpus,
            elastic=setup.elastic,
            handoff=setup.handoff,
        )
        self.learning = Learning(setup.table, p)
        explores = policy in ("inline", "spotlight")
        # Only the bandit keeps a prior per family of prompts (as `spotlight.explore.Exploration`).
        family = {"family": prompt_family(setup.planner_family)} if setup.planner == "bandit" else {}
        self.planner = build_planner(setup.planner, seed=setup.seed, **family) if explores else None
        self.pools = {"ondemand": (False,), "inline": (False,), "spotlight": (False, True), "disaggregated": (True,)}[
            policy
        ]
        self.update_s = p.update_gpu_s / self.trainer_gpus
        self.reward_s = p.reward_gpu_s_per_sample * p.samples_per_iteration / self.trainer_gpus
        # inline explores as many candidates as spotlight's planner gets with the whole spot pool during
        # its update (on trainer_gpus), but on its own GPUs, before the rollout.
        peak_spot = setup.trace.num_nodes_max if setup.trace is not None else 0
        per_gpu_rate = p.samples_per_job / (p.steps_per_candidate * p.step_s(p.sp_degree)) / p.sp_degree
        self.inline_budget = math.floor(p.update_gpu_s / setup.trainer_gpus * peak_spot * per_gpu_rate)
        self.cap = max(setup.table.max_candidates(k) for k in range(len(setup.table.iterations)))
        self.next_job = 0
        self.explored_next: dict[str, int] = {}  # counts ready for the next iteration's prompts (spotlight)
        self.budgets: list[float] = []
        self.rollout_times: list[float] = []
        self.ends: list[float] = []
        self.progress_curve: list[float] = []
        self.fallbacks = self.recomputed = self.handoffs = 0
        self.progress, self.k = 0.0, 0

    def iteration(self) -> None:
        """Iteration k: (inline) explore, roll out with θ_k, reward, update (spotlight explores the next
        batch meanwhile), publish θ_{k+1}, and the learning progress it made."""
        p, k, loop, cluster, policy = self.p, self.k, self.loop, self.cluster, self.policy
        prompts = self.learning.prompts(k)
        explored: dict[str, int] = {}
        if policy == "inline" and k > 0 and self.inline_budget:
            explored = self.explore(prompts, self.inline_budget, k, self.pools, math.inf)
        elif policy == "spotlight":
            explored = {pid: n for pid, n in self.explored_next.items() if pid in prompts}
        # Rollout with θ_k.
        t0 = loop.now
        res = cluster.run_phase(self.jobs_for(p.samples_per_iteration, k), p.num_steps, pools=self.pools)
        self.recomputed += res.recomputed_steps
        self.handoffs += res.handoffs
        self.rollout_times.append(loop.now - t0)
        # Rewards, then the update θ_k -> θ_{k+1} on the trainer GPUs.
        loop.advance(self.reward_s)
        cluster.on_demand.busy_gpu_s += self.reward_s * self.trainer_gpus
        t_update_end = loop.now + self.update_s
        cluster.on_demand.busy_gpu_s += self.update_s * self.trainer_gpus
        if policy == "spotlight":
            nxt = self.learning.prompts(k + 1)
            budget = self.update_s * cluster.samples_per_s(spot=True, steps=p.steps_per_candidate)
            self.explored_next = self.explore(nxt, budget, k, (True,), t_update_end)
        if loop.now < t_update_end:
            loop.advance(t_update_end - loop.now)
        cluster.publish(k + 1, p.weight_sync_s)
        self.progress += self.learning.progress(prompts, explored, stale=policy == "spotlight")
        if self.planner is not None:
            self.planner.observe(
                [Observation(pid, r[: explored.get(pid) or p.group_size], iteration=k) for pid, r in prompts.items()]
            )
        self.k += 1
        self.ends.append(loop.now)
        self.progress_curve.append(self.progress)

    def jobs_for(self, n_samples: int, version: int, sizes: list | None = None) -> list[Job]:
        """Jobs of `samples_per_job` samples (the last one smaller); their sizes appended to `sizes`."""
        p, out = self.p, []
        for i in range(0, n_samples, p.samples_per_job):
            out.append(Job(self.next_job, version=version, num_steps=p.num_steps))
            if sizes is not None:
                sizes.append(min(p.samples_per_job, n_samples - i))
            self.next_job += 1
        return out

    def explore(self, prompts: dict, budget: float, version: int, phase_pools, deadline: float) -> dict[str, int]:
        """Plan and run exploration; the candidates done per prompt."""
        p = self.p
        alloc = self.planner.plan(list(prompts), budget, group_size=p.group_size, max_candidates=self.cap)
        self.budgets.append(alloc.total())
        jobs, owner, sizes = [], [], []
        for pid in alloc.explored():
            new = self.jobs_for(alloc[pid], version, sizes)
            jobs += new
            owner += [pid] * len(new)
        if not jobs:
            return {}
        res = self.cluster.run_phase(jobs, p.steps_per_candidate, pools=phase_pools, deadline=deadline)
        self.recomputed += res.recomputed_steps
        self.handoffs += res.handoffs
        done: dict[str, int] = {}
        first_missing: dict[str, bool] = {}
        for job, pid, size in zip(jobs, owner, sizes):
            # Candidates are used in exploration order: a prompt's count stops at its first missing job.
            if job.job_id in res.done and not first_missing.get(pid):
                done[pid] = done.get(pid, 0) + size
            else:
                first_missing[pid] = True
        self.fallbacks += sum(done.get(pid, 0) <= p.group_size for pid in alloc.explored())
        return {pid: n for pid, n in done.items() if n > p.group_size}


def _result(policy, setup, cluster, loop, k, budgets, rollout_times, ends, curve, fallbacks, recomputed, handoffs):
    wall = loop.now
    od_usd = cost_usd(cluster.on_demand.usage, [[0.0, setup.on_demand_usd_per_gpu_hour]])
    spot_prices = setup.spot_prices or [[0.0, setup.on_demand_usd_per_gpu_hour * (1 - setup.spot_discount)]]
    spot_usd = cost_usd(cluster.spot.usage, spot_prices)
    held = cluster.spot.held_gpu_s
    return PolicyResult(
        policy=policy,
        wall_s=wall,
        iterations=k,
        cost_usd=od_usd + spot_usd,
        cost_on_demand_usd=od_usd,
        cost_spot_usd=spot_usd,
        on_demand_utilisation=cluster.on_demand.busy_gpu_s / cluster.on_demand.held_gpu_s
        if cluster.on_demand.held_gpu_s
        else 0.0,
        spot_utilisation=cluster.spot.busy_gpu_s / held if held else None,
        work_lost_gpu_s=cluster.spot.lost_gpu_s,
        explore_cut_gpu_s=cluster.spot.cut_gpu_s + cluster.on_demand.cut_gpu_s,
        preemptions=cluster.preemptions,
        notices=cluster.notices,
        recomputed_steps=recomputed,
        handoffs=handoffs,
        fallback_prompts=fallbacks,
        mean_budget_samples=float(np.mean(budgets)) if budgets else 0.0,
        mean_rollout_s=float(np.mean(rollout_times)) if rollout_times else 0.0,
        mean_iteration_s=wall / max(k, 1),
        spot_gpu_s_held=held,
        spot_gpu_s_busy=cluster.spot.busy_gpu_s,
        series={"iteration_end_s": ends, "progress": curve, "spot_timeline": cluster.timeline},
    )


def compare(results: dict[str, PolicyResult]) -> dict:
    """Ratios against `ondemand` (> 1: cheaper / faster than on-demand only)."""
    base = results.get("ondemand")
    out = {}
    for name, r in results.items():
        row = r.summary()
        if base is not None:
            row["cost_ratio_vs_ondemand"] = round(base.cost_usd / r.cost_usd, 4) if r.cost_usd else None
            row["time_to_target_ratio_vs_ondemand"] = round(base.wall_s / r.wall_s, 4) if r.wall_s else None
        out[name] = row
    return out
