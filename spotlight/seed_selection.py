"""Seed exploration's pure parts (`spotlight.explore` drives them): the candidate seeds, when the
weights are published, the budget, the exploration jobs and their results, and the choice of each
group's seeds among the explored candidates.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from planners import group_variance, select_contrast
from spotlight.core.seeds import derive_seed

FALLBACK_CAUSES = ("late", "died", "error", "partial")
"""Why a planned prompt trained on its default seeds (`spotlight.explore`'s module docstring)."""
_SELECTION_STREAM = 0x5E1EC7  # derive_seed stream of the "random" selection rule


def candidate_seeds(run_seed: int, iteration: int, slot: int, num_candidates: int) -> list[int]:
    """Seeds of candidates 0..n-1 of prompt slot `slot` at `iteration`; the first G are the defaults."""
    return [derive_seed(run_seed, iteration, slot, i) for i in range(num_candidates)]


def opens_before_rollout(mode: str, *, window: str, iteration: int, has_next_batch: bool) -> bool:
    """Whether stale exploration of the next batch starts before this iteration's rollout
    (`explore.window` "iteration"). Iteration 0 opens after its rollout, as "update" does: before
    the first rollout nothing is timed to size a budget with."""
    return mode == "stale" and window == "iteration" and iteration > 0 and has_next_batch


def publishes_before_rollout(mode: str, *, window: str, iteration: int, has_next_batch: bool) -> bool:
    """Whether `Exploration.seeds_for` of `iteration` may publish the current weights: inline mode
    (to explore this batch), or stale mode opening the next batch's window before the rollout."""
    opens = opens_before_rollout(mode, window=window, iteration=iteration, has_next_batch=has_next_batch)
    return (mode == "inline" and iteration > 0) or opens


def publishes_before_update(mode: str, *, window: str, iteration: int, has_next_batch: bool) -> bool:
    """Whether `Exploration.launch` may publish the current weights (stale mode, a next batch to
    explore, its window not opened before the rollout already)."""
    opens = opens_before_rollout(mode, window=window, iteration=iteration, has_next_batch=has_next_batch)
    return mode == "stale" and has_next_batch and not opens


def planner_ids(prompts_P: Sequence[str]) -> list[str]:
    """Distinct planner ids for a batch's prompts: the text, suffixed " #p" where a prompt repeats."""
    seen: set[str] = set()
    ids = []
    for p, text in enumerate(prompts_P):
        ids.append(text if text not in seen else f"{text} #{p}")
        seen.add(text)
    return ids


def exploration_budget(update_s: float, samples_per_s: float, num_explorers: int, fraction: float) -> int:
    """Candidates the explorers can score while the trainer updates: floor(f * t * rate * n)."""
    if update_s <= 0 or samples_per_s <= 0 or num_explorers <= 0:
        return 0
    return math.floor(fraction * update_s * samples_per_s * num_explorers)


@dataclass
class Budget:
    """The budget of one exploration window and what it was computed from."""

    num_samples: int
    """Candidates the plan may spend."""
    update_s: float
    """Predicted training-step (update) time, seconds."""
    samples_per_s: float
    """Predicted throughput of one explorer, candidates per second."""
    num_explorers: int
    """Live explorers the jobs go to."""
    guessed_update: bool
    """True before any update was timed (half the rollout time stands in)."""
    guessed_throughput: bool
    """True before any explorer reported (a guess from the trainer's rollout stands in)."""


class BudgetModel:
    """Running means (exponential, weight `ema` on the newest value) of step time and throughput."""

    UNTIMED_UPDATE_FRACTION = 0.5
    """Before any update is timed, the predicted update time is this fraction of the rollout time."""

    def __init__(self, ema: float):
        self.ema = ema
        self.update_s: float | None = None
        self.samples_per_s: float | None = None  # per explorer

    def _mix(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.ema) * old + self.ema * new

    def observe_update(self, seconds: float) -> None:
        self.update_s = self._mix(self.update_s, seconds)

    def observe_explorer(self, num_samples: int, busy_s: float) -> None:
        if num_samples > 0 and busy_s > 0:
            self.samples_per_s = self._mix(self.samples_per_s, num_samples / busy_s)

    def budget(self, num_explorers: int, fraction: float, *, rollout_s: float, guess_samples_per_s: float) -> Budget:
        """The budget of a window, with the module docstring's stand-ins where nothing was measured."""
        update_s = self.update_s if self.update_s is not None else self.UNTIMED_UPDATE_FRACTION * rollout_s
        rate = self.samples_per_s if self.samples_per_s is not None else guess_samples_per_s
        return Budget(
            num_samples=exploration_budget(update_s, rate, num_explorers, fraction),
            update_s=update_s,
            samples_per_s=rate,
            num_explorers=num_explorers,
            guessed_update=self.update_s is None,
            guessed_throughput=self.samples_per_s is None,
        )

    def state_dict(self) -> dict:
        return {"update_s": self.update_s, "samples_per_s": self.samples_per_s}

    def load_state_dict(self, state: dict) -> None:
        self.update_s, self.samples_per_s = state["update_s"], state["samples_per_s"]


@dataclass
class ExploreJob:
    """Candidates one explorer samples and scores: (prompt, slot, candidate index, seed) rows."""

    iteration: int
    """Training iteration the candidates are for (their seeds derive from it)."""
    version: int
    """Weights version to sample with (the trainer iteration that produced them)."""
    prompts: list[str]
    slots: list[int]
    candidates: list[int]
    seeds: list[int]
    sde_steps: list[int]
    """Stochastic steps of that iteration's rollout (its SDE window)."""
    time_limit_s: float | None = None
    """Start no batch after this many seconds of work; None = no limit."""


@dataclass
class ExploreResult:
    """What an explorer returns for a job: the first len(rewards) rows of the job, scored."""

    iteration: int
    version: int
    """Weights version the explorer sampled with."""
    slots: list[int]
    candidates: list[int]
    rewards: list[float]
    """Stale reward of each scored row (NaN = failed reward)."""
    busy_s: float
    """Seconds spent sampling and scoring."""
    complete: bool
    """False when the time limit cut the job short."""
    explorer: str = ""
    """Who ran it (node id), for logs."""


def split_jobs(
    iteration: int,
    version: int,
    prompts_P: Sequence[str],
    counts_P: Sequence[int],
    *,
    run_seed: int,
    sde_steps: Sequence[int],
    num_jobs: int,
    time_limit_s: float | None,
) -> list[ExploreJob]:
    """Cut the planned candidates, prompt-major, into at most `num_jobs` contiguous near-equal jobs.

    Prompt-major order keeps most prompts on one explorer (at most num_jobs - 1 are split), so a
    late or dead explorer costs few prompts, and a job cut short by its time limit still completes
    its first prompts.
    """
    rows = [(p, i) for p, n in enumerate(counts_P) for i in range(n)]
    if not rows or num_jobs < 1:
        return []
    bounds = np.linspace(0, len(rows), min(num_jobs, len(rows)) + 1).round().astype(int)
    jobs = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        part = rows[lo:hi]
        jobs.append(
            ExploreJob(
                iteration=iteration,
                version=version,
                prompts=[prompts_P[p] for p, _ in part],
                slots=[p for p, _ in part],
                candidates=[i for _, i in part],
                seeds=[derive_seed(run_seed, iteration, p, i) for p, i in part],
                sde_steps=list(sde_steps),
                time_limit_s=time_limit_s,
            )
        )
    return jobs


@dataclass
class SlotOutcome:
    """How one prompt slot's group was chosen."""

    planned: int = 0
    """Candidates the plan gave it (0 = not explored)."""
    candidates: list[int] = field(default_factory=list)
    """Scored candidate indices, ascending."""
    rewards: list[float] = field(default_factory=list)
    """Their stale rewards."""
    chosen: list[int] | None = None
    """Candidate indices of the group; None = the default seeds (candidates 0..G-1)."""
    cause: str | None = None
    """For a planned prompt left on default seeds: one of FALLBACK_CAUSES."""

    def group(self, group_size: int) -> list[int]:
        return self.chosen if self.chosen is not None else list(range(group_size))


def choose_groups(
    counts_P: Sequence[int],
    results: Sequence[ExploreResult],
    failed: Sequence[tuple[ExploreJob, str]],
    *,
    group_size: int,
    rule: str,
    run_seed: int,
    iteration: int,
) -> list[SlotOutcome]:
    """Per prompt slot, the G candidates to train on, or the default seeds and why.

    Args:
        counts_P: (P,) candidates planned per slot.
        results: results returned in time (possibly cut short by their time limit).
        failed: (job, cause) for jobs that returned nothing in time: "late", "died" or "error".
        group_size: G.
        rule: "extremes" or "random" (`planners.select_contrast`).
        run_seed, iteration: seed the "random" rule per slot.
    """
    scored: list[dict[int, float]] = [{} for _ in counts_P]
    for res in results:
        for slot, cand, r in zip(res.slots, res.candidates, res.rewards):
            scored[slot][cand] = r
    failed_cause: dict[int, str] = {}
    for job, cause in failed:
        for slot in job.slots:
            failed_cause.setdefault(slot, cause)
    outcomes = []
    for slot, planned in enumerate(counts_P):
        cands = sorted(scored[slot])
        out = SlotOutcome(planned=int(planned), candidates=cands, rewards=[scored[slot][c] for c in cands])
        if planned > 0:
            if len(cands) > group_size:
                rng = (
                    np.random.default_rng(derive_seed(run_seed, iteration, slot, _SELECTION_STREAM))
                    if rule == "random"
                    else None
                )
                out.chosen = [cands[i] for i in select_contrast(out.rewards, group_size, rule, rng)]
            else:
                out.cause = failed_cause.get(slot, "partial")
        outcomes.append(out)
    return outcomes


def selection_metrics(outcomes: Sequence[SlotOutcome], group_size: int) -> dict[str, float]:
    """Allocation, fallbacks and variance captured (stale rewards) of one batch's selection."""
    selected = [o for o in outcomes if o.chosen is not None]
    m: dict[str, float] = {
        "explore/prompts_planned": sum(o.planned > 0 for o in outcomes),
        "explore/candidates_planned": sum(o.planned for o in outcomes),
        "explore/candidates_scored": sum(len(o.candidates) for o in outcomes),
        "explore/prompts_selected": len(selected),
        **{f"explore/fallback_{c}": sum(o.cause == c for o in outcomes) for c in FALLBACK_CAUSES},
    }
    if selected:
        var_sel, var_def = [], []
        for o in selected:
            by_cand = dict(zip(o.candidates, o.rewards))
            var_sel.append(group_variance([by_cand[c] for c in o.chosen]))
            if all(c in by_cand for c in range(group_size)):
                var_def.append(group_variance([by_cand[c] for c in range(group_size)]))
        # Variance captured: the selected groups' stale-reward variance against what the default
        # seeds of the same prompts would have given under the same (stale) weights.
        m["explore/var_selected_stale"] = float(np.mean(var_sel))
        if var_def:
            m["explore/var_default_stale"] = float(np.mean(var_def))
    return m
