"""Seed exploration with stale weights: which seeds each GRPO group trains on (docs/architecture.md, "Seed
exploration").

GRPO learns only from groups whose rewards differ. Exploration samples many candidate seeds per
prompt, scores them with the recipe's reward, and keeps a high-contrast group of G of them
(`planners.select_contrast`) for the rollout, which resamples those seeds with the current weights
for the actual update. Seeds fix whole trajectories (`core.seeds.derive_seed`, `sampling.seeded_noise`) and
explorers run the training rollout's sampler (same steps, noise level, SDE type and window), so the
stale reward of a seed refers to exactly the noise the fresh rollout will use.

Modes (`explore.mode`):
    none    the G default seeds of `train.plan_iteration`; Ray is never imported (plain GRPO).
    inline  before rollout k: publish θ_k, explore batch k, wait for every result, select. The
            on-critical-path baseline (same budget rule as stale; nothing is explored at k = 0).
    stale   Spotlight: while the trainer computes θ_k -> θ_{k+1}, explorers score batch k+1 with
            θ_k; after the update the driver takes what is ready and never waits.

Iteration k in stale mode, as `train.run_training` calls it:

    seeds_for(k)  seeds of batch k: the selection from what was collected after update k-1
                  [window "iteration", k >= 1: open batch k+1's window here, as launch does below]
    rollout, reward, advantages with θ_k
    launch(k)     feed the planner batch k's unbiased groups; [window "update", or k = 0:] publish
                  θ_k (one `ray.put`, then an async `set_weights`); plan batch k+1 within the
                  budget; submit one job per explorer
    update        θ_k -> θ_{k+1}
    collect(k)    `ray.wait(timeout=0)`: the results ready now serve batch k+1, the rest are late

The window (`explore.window`). "update" is the paper's: the explorers work while the trainer
updates. "iteration" (the default) also gives them the trainer's rollout and reward of iteration k:
θ_k exists from the end of update k-1, and explorers on devices of their own would otherwise sit
idle through the rollout. The weights are the same θ_k, so staleness stays 1; the cost is that
batch k+1 is planned before batch k's fresh rewards reach the planner (they inform batch k+2).
Iteration 0 opens after its rollout in both: before it nothing is timed to size a budget with.

Seeds. Candidate i of prompt slot p at iteration k is derive_seed(train.seed, k, p, i). The first G
are the default seeds, so exploring extends the default group and a fallback is simply candidates
0..G-1. Only the slot index, not the prompt text, enters the seed: exactly as `plan_iteration`.

Budget (in candidates). budget_fraction x predicted window x explorer samples/s x live
explorers. The window is a running mean of measured windows (the update's time, or with window
"iteration" the time from `seeds_for` to the end of the update; with runtime.rollouts=cluster the
time from the rollout's end, as the spot workers serve the rollout before any exploration job);
before the first update is
timed it is half the same iteration's rollout time (a guess on the short side: a windowed SDE or
DiffusionNFT update can cost less than the rollout, and the first rollout also pays warm-up;
explore/update_guessed = 1 says so). The throughput is a running mean of what explorers report
(candidates over busy seconds); before the first report it is guessed as the trainer's
rollout+reward throughput per torch thread times runtime.worker_threads, halved
(explore/throughput_guessed = 1). Each job also carries a time limit, the predicted step time: an
explorer starts no batch after it and returns what it has.

A stale window whose budget is too small for one prompt (G + 1 candidates) because of the
measured throughput, where the guessed throughput would allow one, sends that smallest plan
anyway (explore/probe = 1): otherwise a throughput measured while the explorers were slowed down
(a shared CPU, a cold start) would never be measured again and exploration would stop for the
rest of the run.

Fallbacks. A planned prompt trains on its default seeds when fewer than G + 1 of its candidates
came back; the cause is counted in explore/fallback_<cause> (prompts):
    late     its job was still running when the update ended
    died     its explorer died (RayActorError); the pool replaces the actor when a spot slot is free
    error    its job raised
    partial  its job hit its time limit before scoring enough of the prompt's candidates
Late results are still read at the next collect: they feed the planner and the throughput mean.

Planner feedback follows `planners.Observation`: the explored candidates' stale rewards (tagged with
the iteration of the weights that produced them) and the fresh rewards of groups that trained on
default seeds; never the fresh rewards of a selected group (extremes, not draws).

Checkpoints carry the planner state and the running means (`state_dict`). Exploration in flight at
a crash is lost, so the first iteration after a resume trains on default seeds; in mode none
nothing changes and a resumed run repeats the uninterrupted one exactly.

This module holds no Ray: the pool it drives (`spot_runtime.RuntimeExplorers`: exploration jobs on
the spot runtime's workers) is the Ray edge.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from planners import Observation, build_planner, group_variance, prompt_family
from spotlight.config import DiTRecipe
from spotlight.core.seeds import derive_seed
from spotlight.seed_selection import (
    Budget,
    BudgetModel,
    ExploreJob,
    ExploreResult,
    SlotOutcome,
    choose_groups,
    exploration_budget,
    opens_before_rollout,
    planner_ids,
    publishes_before_rollout,
    publishes_before_update,
    selection_metrics,
    split_jobs,
)

logger = logging.getLogger(__name__)


LOG_FILE = "explore.jsonl"
"""Per-iteration record in the run directory: candidates, stale rewards, chosen seeds, fresh rewards."""

WeightsSource = Callable[[], dict[str, torch.Tensor]]
"""The trainable weights to publish, as a CPU snapshot later optimizer steps leave unchanged: the
trainer passes a callable so that nothing is copied when no candidate is planned (under FSDP it
passes the full weights every rank gathered beforehand, `spotlight.parallel.fsdp.ShardedWeightsSource`)."""


# ---------------------------------------------------------------------------------------------
# The driver side: one window of exploration per iteration
# ---------------------------------------------------------------------------------------------


class ExplorerPool(Protocol):
    """What `Exploration` needs from the explorers (`spot_runtime.RuntimeExplorers` runs them as jobs
    on the spot runtime's workers). A handle stands for one submitted job."""

    deaths: int
    respawns: int

    def wait_ready(self, timeout_s: float) -> int: ...
    def maintain(self) -> None: ...
    def capacity(self) -> int: ...
    def publish(self, version: int, weights: WeightsSource) -> None: ...
    def submit(self, job: ExploreJob) -> Any: ...
    def poll(
        self, handles: Sequence[Any], timeout_s: float | None
    ) -> list[tuple[Any, ExploreResult | None, str | None]]: ...
    def cancel(self, handles: Sequence[Any]) -> None: ...
    def close(self) -> None: ...
    def take_emulated_s(self) -> float:
        """Seconds the trainer waited for emulated explorers since the last call (0 for real ones)."""


@dataclass
class _Window:
    """One round of exploration: a plan for one batch, its jobs, and what came back."""

    iteration: int
    version: int
    ids: list[str]
    counts_P: list[int]
    budget: Budget
    jobs: list[ExploreJob]
    handles: list[Any]
    launched: float
    probe: bool = False
    """The budget was too small for one prompt; the smallest plan went out to re-measure throughput."""
    window_s: float = 0.0
    results: list[ExploreResult] = field(default_factory=list)
    failed: list[tuple[ExploreJob, str]] = field(default_factory=list)


class Exploration:
    """Chooses each iteration's seeds from explored candidates; drives the explorer pool.

    The driver makes the same calls in every mode: for `explore.mode` none it holds a
    `NullExploration`.

    Args:
        cfg: the recipe (explore.mode "inline" or "stale").
        pool: the explorers.
        log_path: where to append the per-iteration record (`LOG_FILE`); None = nowhere.
    """

    active = True

    def __init__(self, cfg: DiTRecipe, pool: ExplorerPool, *, log_path: str | Path | None = None):
        assert cfg.explore.mode in ("inline", "stale"), cfg.explore.mode
        self.cfg = cfg
        self.ecfg = cfg.explore
        self.pool = pool
        self.group_size = cfg.train.group_size
        # Only the bandit keeps a prior per family of prompts (planners/families.py).
        family = {"family": prompt_family(cfg.explore.planner_family)} if cfg.explore.planner == "bandit" else {}
        self.planner = build_planner(cfg.explore.planner, seed=cfg.train.seed, **family)
        self.budget_model = BudgetModel(cfg.explore.ema)
        self.log_path = Path(log_path) if log_path is not None else None
        self._guess_samples_per_s = 0.0
        self._rollout_s = 0.0
        self._window: _Window | None = None  # stale: launched, not collected yet
        self._collected: dict[int, _Window] = {}  # batch iteration -> its collected window
        self._stragglers: list[tuple[_Window, ExploreJob, Any]] = []
        self._current: tuple[int, list[str], list[SlotOutcome], _Window | None] | None = None
        self._metrics: dict[str, float] = {}
        self._critical_s = 0.0
        self._deaths_seen = 0

    # -- lifecycle ------------------------------------------------------------------------------

    def wait_ready(self, timeout_s: float) -> int:
        """Wait until every explorer loaded the model or `timeout_s` passed; the number ready."""
        return self.pool.wait_ready(timeout_s)

    def close(self) -> None:
        self.pool.close()

    def state_dict(self) -> dict:
        """Planner and running means, JSON-compatible (checkpoint `meta`); in-flight work is not saved."""
        return {"planner": self.planner.state_dict(), "budget": self.budget_model.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.planner.load_state_dict(state["planner"])
        self.budget_model.load_state_dict(state["budget"])

    def truncate_log(self, start_iteration: int) -> None:
        """Drop log rows of iterations a resumed run repeats."""
        if self.log_path is None or not self.log_path.exists():
            return
        rows = [line for line in self.log_path.read_text().splitlines() if line.strip()]
        keep = []
        for line in rows:
            try:
                if json.loads(line)["iteration"] < start_iteration:
                    keep.append(line)
            except (json.JSONDecodeError, KeyError):
                break  # a cut-off last line
        self.log_path.write_text("".join(line + "\n" for line in keep))

    # -- the three calls of an iteration --------------------------------------------------------

    def seeds_for(
        self,
        iteration: int,
        weights: WeightsSource,
        prompts_P: list[str],
        default_seeds: list[int],
        sde_steps: list[int],
        next_batch: tuple[list[str], list[int], list[int]] | None = None,
    ) -> list[int]:
        """Seeds (P * G, prompt-major) of batch `iteration`: selected groups, default seeds elsewhere.

        Inline mode explores the batch here with the current weights (`weights()`, called only when
        there are candidates to sample) and waits for the results. Stale mode with `explore.window`
        "iteration" opens the next batch's window here (`next_batch`: its `plan_iteration`), with
        the same weights, and does not wait.
        """
        t0 = time.monotonic()
        self._metrics = {}
        G = self.group_size
        when = dict(window=self.ecfg.window, iteration=iteration, has_next_batch=next_batch is not None)
        if self.ecfg.mode == "inline" and publishes_before_rollout(self.ecfg.mode, **when):
            window = self._open_window(iteration, iteration, weights, prompts_P, sde_steps, time_limit=False)
            if window is not None:
                self._gather(window, timeout_s=None)
        window = self._collected.pop(iteration, None)
        if window is not None:
            outcomes = choose_groups(
                window.counts_P,
                window.results,
                window.failed,
                group_size=G,
                rule=self.ecfg.selection,
                run_seed=self.cfg.train.seed,
                iteration=iteration,
            )
        else:
            outcomes = [SlotOutcome() for _ in prompts_P]
        seeds = list(default_seeds)
        for p, out in enumerate(outcomes):
            if out.chosen is not None:
                seeds[p * G : (p + 1) * G] = [derive_seed(self.cfg.train.seed, iteration, p, i) for i in out.chosen]
        self._current = (iteration, list(prompts_P), outcomes, window)
        self._metrics.update(selection_metrics(outcomes, G))
        if window is not None:
            self._metrics.update(self._window_metrics(window, iteration))
        if opens_before_rollout(self.ecfg.mode, **when):
            next_prompts, _, next_steps = next_batch
            self._window = self._open_window(
                iteration + 1, iteration, weights, next_prompts[::G], next_steps, time_limit=True
            )
        self._critical_s += time.monotonic() - t0
        return seeds

    def launch(
        self,
        iteration: int,
        weights: WeightsSource,
        rewards_B: torch.Tensor,
        seeds: list[int],
        rollout_s: float,
        next_batch: tuple[list[str], list[int], list[int]] | None,
    ) -> None:
        """After the rollout of `iteration`: feed the planner, log, and (stale) explore the next batch.

        Args:
            weights: θ_k, the weights the explorers sample the next batch with (stale mode).
            rewards_B: (P * G,) fresh rewards of this iteration's rollout.
            seeds: the seeds that rollout used.
            rollout_s: the rollout + reward time (the stand-ins of the budget's first window).
            next_batch: `plan_iteration` of the next iteration (prompts, seeds, SDE steps); None at the end.
        """
        t0 = time.monotonic()
        assert self._current is not None and self._current[0] == iteration
        _, prompts_P, outcomes, window = self._current
        G = self.group_size
        fresh_PG = rewards_B.detach().float().cpu().view(len(prompts_P), G).numpy()
        ids = planner_ids(prompts_P)
        # Unbiased groups only: a selected group holds extremes, not draws (planners.Observation).
        self.planner.observe(
            [Observation(ids[p], fresh_PG[p], iteration) for p, o in enumerate(outcomes) if o.chosen is None]
        )
        sel = [p for p, o in enumerate(outcomes) if o.chosen is not None]
        rest = [p for p, o in enumerate(outcomes) if o.chosen is None]
        if sel:
            self._metrics["explore/var_selected_fresh"] = float(np.mean([group_variance(fresh_PG[p]) for p in sel]))
        if rest:
            self._metrics["explore/var_default_fresh"] = float(np.mean([group_variance(fresh_PG[p]) for p in rest]))
        self._write_log(iteration, prompts_P, outcomes, window, seeds, fresh_PG)

        num_samples = fresh_PG.size
        self._rollout_s = rollout_s
        # The throughput guess before any explorer reported (module docstring).
        trainer_rate = num_samples / max(rollout_s, 1e-9)
        self._guess_samples_per_s = 0.5 * trainer_rate * self.cfg.runtime.worker_threads / torch.get_num_threads()
        when = dict(window=self.ecfg.window, iteration=iteration, has_next_batch=next_batch is not None)
        if publishes_before_update(self.ecfg.mode, **when):
            next_prompts, _, next_steps = next_batch
            self._window = self._open_window(
                iteration + 1, iteration, weights, next_prompts[::G], next_steps, time_limit=True
            )
        self._critical_s += time.monotonic() - t0

    def collect(self, iteration: int, window_s: float) -> None:
        """After the update of `iteration`: take the results that are ready; never wait.

        Args:
            window_s: how long this iteration's window lasted (what the next budget predicts):
                the update's time; with `explore.window` "iteration" the time since `seeds_for`;
                with the rollout on the cluster (whose spot workers serve the rollout first) the
                time from the rollout's end.
        """
        t0 = time.monotonic()
        self.budget_model.observe_update(window_s)
        self._read_stragglers()
        if self._window is not None:
            self._gather(self._window, timeout_s=0.0)
            self._window = None
        self.pool.maintain()  # replacements for dead explorers start loading the model now
        self._critical_s += time.monotonic() - t0

    def metrics(self, *, weights_copies: int) -> dict[str, float]:
        """The iteration's explore/ metrics and the time exploration took on the critical path;
        `weights_copies`: the trainer's copies (gathers, under FSDP) of the weights for the explorers."""
        deaths = self.pool.deaths
        m = {
            **self._metrics,
            "explore/weights_copies": weights_copies,
            "explore/num_explorers": self.pool.capacity(),
            "explore/explorer_deaths": deaths - self._deaths_seen,
            "explore/explorer_respawns_total": self.pool.respawns,
            "time/explore_s": self._critical_s,
        }
        emulated = self.pool.take_emulated_s()
        if self.cfg.explore.emulated_nodes:
            # Time the trainer waited for emulated explorers: part of time/explore_s, not of the
            # trainer's time (spotlight.emulated); the driver takes it out of time/iteration_s.
            m["time/emulated_explore_s"] = emulated
            m["explore/emulated_nodes"] = self.cfg.explore.emulated_nodes
        self._deaths_seen = deaths
        self._critical_s = 0.0
        return m

    # -- internals ------------------------------------------------------------------------------

    def _open_window(
        self,
        iteration: int,
        version: int,
        weights: WeightsSource,
        prompts_P: list[str],
        sde_steps: list[int],
        *,
        time_limit: bool,
    ) -> _Window | None:
        """Plan batch `iteration` within the budget and submit it with weights `version`."""
        self.pool.maintain()
        live = self.pool.capacity()
        budget = self.budget_model.budget(
            live, self.ecfg.budget_fraction, rollout_s=self._rollout_s, guess_samples_per_s=self._guess_samples_per_s
        )
        if self.ecfg.fixed_budget:
            budget.num_samples = self.ecfg.fixed_budget  # whatever the window (the oracle's full pools)
        ids = planner_ids(prompts_P)
        counts_P = [0] * len(prompts_P)
        plan_samples = budget.num_samples
        # Probe (module docstring): a stale window the measured throughput, not the budget
        # setting, leaves without a plan sends the smallest one; nothing waits for it.
        probe = (
            time_limit
            and live > 0
            and not self.ecfg.fixed_budget
            and plan_samples <= self.group_size
            and exploration_budget(budget.update_s, self._guess_samples_per_s, live, self.ecfg.budget_fraction)
            > self.group_size
        )
        if probe:
            plan_samples = self.group_size + 1
        if plan_samples > self.group_size:
            alloc = self.planner.plan(
                ids,
                plan_samples,
                group_size=self.group_size,
                max_candidates=self.ecfg.candidates_cap(self.group_size),
            )
            counts_P = [alloc[i] for i in ids]
        jobs = split_jobs(
            iteration,
            version,
            prompts_P,
            counts_P,
            run_seed=self.cfg.train.seed,
            sde_steps=sde_steps,
            num_jobs=live,
            time_limit_s=budget.update_s if time_limit else None,
        )
        handles = []
        if jobs:
            self.pool.publish(version, weights)
            handles = [self.pool.submit(job) for job in jobs]
        window = _Window(iteration, version, ids, counts_P, budget, jobs, handles, time.monotonic(), probe=probe)
        if not jobs:
            self._collected[iteration] = window
            return None
        return window

    def _gather(self, window: _Window, timeout_s: float | None) -> None:
        """Take the window's finished jobs (waiting up to timeout_s; None = all); the rest are late."""
        polled = time.monotonic()
        done = {id(h): (res, cause) for h, res, cause in self.pool.poll(window.handles, timeout_s)}
        # A stale window ends when it is polled (an emulated pool runs its jobs inside the poll,
        # on the trainer's time); an inline window lasts until every result is in.
        window.window_s = (polled if timeout_s is not None else time.monotonic()) - window.launched
        late = []
        for job, h in zip(window.jobs, window.handles):
            if id(h) not in done:
                window.failed.append((job, "late"))
                late.append(h)
                self._stragglers.append((window, job, h))
                continue
            res, cause = done[id(h)]
            if res is None:
                window.failed.append((job, cause))
            else:
                window.results.append(res)
                self._learn(window, res)
        self._collected[window.iteration] = window

    def _learn(self, window: _Window, res: ExploreResult) -> None:
        """Feed the planner the stale rewards of a result, and the throughput mean its speed."""
        self.budget_model.observe_explorer(len(res.rewards), res.busy_s)
        by_slot: dict[int, list[float]] = {}
        for slot, r in zip(res.slots, res.rewards):
            by_slot.setdefault(slot, []).append(r)
        self.planner.observe([Observation(window.ids[s], np.asarray(r), res.version) for s, r in by_slot.items()])

    def _read_stragglers(self) -> None:
        """Late jobs of earlier windows: learn from those done; give up on those a window older."""
        if not self._stragglers:
            return
        done = {id(h): res for h, res, _ in self.pool.poll([h for _, _, h in self._stragglers], 0.0)}
        keep = []
        for window, job, h in self._stragglers:
            if id(h) in done:
                if done[id(h)] is not None:
                    self._learn(window, done[id(h)])
            elif window.iteration >= self._latest_batch():
                keep.append((window, job, h))
            else:
                self.pool.cancel([h])
        self._stragglers = keep

    def _latest_batch(self) -> int:
        return self._current[0] if self._current is not None else -1

    def _window_metrics(self, window: _Window, iteration: int) -> dict[str, float]:
        b = window.budget
        busy = sum(r.busy_s for r in window.results) + window.window_s * sum(c == "late" for _, c in window.failed)
        m = {
            "explore/budget_samples": b.num_samples,
            "explore/probe": float(window.probe),
            "explore/predicted_update_s": b.update_s,
            "explore/samples_per_s": b.samples_per_s,
            "explore/throughput_guessed": float(b.guessed_throughput),
            "explore/update_guessed": float(b.guessed_update),
            "explore/window_s": window.window_s,
            "explore/jobs_cut_short": sum(not r.complete for r in window.results),
        }
        if b.num_explorers and window.window_s > 0:
            m["explore/utilisation"] = min(1.0, busy / (b.num_explorers * window.window_s))
        if window.results:
            m["explore/staleness"] = float(np.mean([iteration - r.version for r in window.results]))
        return m

    def _write_log(
        self,
        iteration: int,
        prompts_P: list[str],
        outcomes: list[SlotOutcome],
        window: _Window | None,
        seeds: list[int],
        fresh_PG: np.ndarray,
    ) -> None:
        if self.log_path is None:
            return
        G = self.group_size

        def clean(xs) -> list:
            return [None if isinstance(x, float) and math.isnan(x) else x for x in (float(v) for v in xs)]

        row = {
            "iteration": iteration,
            "mode": self.ecfg.mode,
            "version": window.version if window is not None and window.results else None,
            "slots": [
                {
                    "prompt": prompts_P[p],
                    "planned": o.planned,
                    "candidates": o.candidates,
                    "stale_rewards": clean(o.rewards),
                    "chosen": o.chosen,
                    "cause": o.cause,
                    "seeds": seeds[p * G : (p + 1) * G],
                    "fresh_rewards": clean(fresh_PG[p]),
                }
                for p, o in enumerate(outcomes)
            ],
        }
        with self.log_path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")


class NullExploration:
    """`explore.mode` none (and the trainer's ranks other than 0, which hold no explorers): the same
    calls as `Exploration`, which keep the default seeds and explore nothing."""

    active = False

    def wait_ready(self, timeout_s: float) -> None:
        return None

    def close(self) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def truncate_log(self, start_iteration: int) -> None:
        pass

    def seeds_for(self, iteration: int, weights, prompts_P, default_seeds: list[int], sde_steps, next_batch=None):
        return default_seeds

    def launch(self, iteration: int, weights, rewards_B, seeds, rollout_s: float, next_batch) -> None:
        pass

    def collect(self, iteration: int, window_s: float) -> None:
        pass

    def metrics(self, *, weights_copies: int) -> dict[str, float]:
        return {}


def start_exploration(cfg: DiTRecipe, run_dir: str | Path, pool: ExplorerPool | None) -> Exploration | NullExploration:
    """The exploration of a recipe on `pool` (the spot runtime's explorers); `NullExploration` for mode "none"."""
    if cfg.explore.mode == "none":
        return NullExploration()
    cfg.explore.validate()
    cfg.validate()
    assert pool is not None, "exploration needs the runtime's workers"
    return Exploration(cfg, pool, log_path=Path(run_dir) / LOG_FILE)
