"""Baseline planners: none (no exploration), uniform (the same for every prompt), greedy (by last variance).

They are the controls the bandit is measured against (docs/architecture.md, "Seed exploration"); all keep the `Planner`
invariants (budget never exceeded, 0 or >= G + 1 candidates per prompt, deterministic plans).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from planners.base import Observation, Planner, plan_rng
from planners.selection import group_variance


class NonePlanner(Planner):
    """Explores nothing: every prompt trains on G random seeds (plain Flow-GRPO)."""

    name = "none"

    def _allocate(self, prompts: list[str], num_samples: int, group_size: int, cap: int) -> dict[str, int]:
        return {}


class UniformPlanner(Planner):
    """Spreads the budget evenly: every prompt gets floor(budget / P) candidates (up to the cap).

    When that is G or fewer, as many prompts as the budget allows get the budget split evenly
    between them (at least G + 1 each), chosen by a permutation seeded by (seed, prompt ids); the
    samples left by the rounding go one each to prompts in the same order.
    """

    name = "uniform"

    def _allocate(self, prompts: list[str], num_samples: int, group_size: int, cap: int) -> dict[str, int]:
        num_explored = min(len(prompts), num_samples // (group_size + 1))
        if num_explored == 0:
            return {}
        order = plan_rng(self.seed, prompts).permutation(len(prompts))
        chosen = [prompts[i] for i in order[:num_explored]]
        each = min(cap, num_samples // num_explored)
        counts = dict.fromkeys(chosen, each)
        left = num_samples - each * num_explored
        for p in chosen:
            if left == 0 or counts[p] == cap:
                break
            counts[p] += 1
            left -= 1
        return counts


class GreedyPlanner(Planner):
    """Puts the budget on the prompts whose last observed reward variance was highest.

    Ranking: prompts never observed come first (optimism: nothing shows they are saturated), in
    the order given; then observed prompts by the population variance of the rewards of their
    latest observed iteration, highest first (ties in the order given). Prompts are served in
    that order with `per_prompt` candidates each (default 8 G, at most the cap) until the budget
    runs out; the last one gets the remainder when that is at least G + 1.

    Args:
        seed: unused (the ranking is deterministic); kept for the common interface.
        per_prompt: candidates per explored prompt (at most `max_candidates`); None = 8 G.
    """

    name = "greedy"

    def __init__(self, seed: int = 0, *, per_prompt: int | None = None) -> None:
        super().__init__(seed)
        if per_prompt is not None and per_prompt < 3:
            raise ValueError(f"per_prompt must be >= 3 (G + 1 with G >= 2) or None, got {per_prompt}")
        self.per_prompt = per_prompt
        self._last: dict[str, tuple[int, list[float]]] = {}  # prompt -> (iteration, its rewards)

    def _allocate(self, prompts: list[str], num_samples: int, group_size: int, cap: int) -> dict[str, int]:
        per_prompt = min(cap, self.per_prompt if self.per_prompt is not None else 8 * group_size)

        def key(i: int) -> tuple[int, float, int]:
            last = self._last.get(prompts[i])
            return (0, 0.0, i) if last is None else (1, -group_variance(last[1]), i)

        counts: dict[str, int] = {}
        left = num_samples
        for i in sorted(range(len(prompts)), key=key):
            n = min(per_prompt, left)
            if n <= group_size:
                break
            counts[prompts[i]] = n
            left -= n
        return counts

    def observe(self, observations: Sequence[Observation]) -> None:
        for obs in observations:
            rewards = [float(r) for r in obs.rewards]
            last = self._last.get(obs.prompt)
            if last is None or obs.iteration > last[0]:
                self._last[obs.prompt] = (int(obs.iteration), rewards)
            elif obs.iteration == last[0]:
                last[1].extend(rewards)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "last": {p: [t, r] for p, (t, r) in self._last.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._last = {p: (int(t), [float(x) for x in r]) for p, (t, r) in state["last"].items()}
