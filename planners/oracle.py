"""The hindsight oracle: the best allocation when every candidate's reward is known in advance.

For evaluation only (`planners.tables.replay`): no real planner can see the rewards of seeds it
has not sampled. It bounds what any planner could capture on a reward table.

Exact, by dynamic programming (a multiple-choice knapsack): prompts are the item classes, the
options of a prompt are "not explored" (cost 0) or n = G + 1 .. min(cap, candidates in the table)
candidates (cost n samples), and the value of n is the variance `captured_variance` gives for the
first n candidates minus that of the first G seeds. best_p[b] = max(best_{p-1}[b],
max_n best_{p-1}[b - n] + gain_p(n)) over b = 0..budget, one pass per prompt: O(P * K * B) for K
options and a budget of B samples, with B capped at the sum of the largest options. Greedy would
not be exact: the gain of the first n candidates of a real table is neither concave nor even
monotone in n (a new candidate can push a better one out of the extremes).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from planners.base import Planner
from planners.selection import captured_variance


class OraclePlanner(Planner):
    """Exact best allocation given the rewards of every candidate seed of this iteration.

    Args:
        reward_table: prompt id -> (N,) rewards of its candidate seeds at the iteration being
            planned, in exploration order (explored prompts use the first n).
        seed: unused (the plan is exact); kept for the common interface.
    """

    name = "oracle"

    def __init__(self, reward_table: Mapping[str, Sequence[float]], seed: int = 0) -> None:
        super().__init__(seed)
        self.reward_table = {p: np.asarray(r, dtype=np.float64).reshape(-1) for p, r in reward_table.items()}

    def _allocate(self, prompts: list[str], num_samples: int, group_size: int, cap: int) -> dict[str, int]:
        missing = [p for p in prompts if p not in self.reward_table]
        if missing:
            raise ValueError(f"the oracle's reward table has no rewards for prompt {missing[0]!r}")
        options = []  # per prompt: (counts (K,), gains (K,)) with positive gains only
        for p in prompts:
            r = self.reward_table[p]
            base = captured_variance(r, 0, group_size)
            counts = np.arange(group_size + 1, min(cap, r.size) + 1)
            gains = np.array([captured_variance(r, n, group_size) - base for n in counts])
            keep = gains > 0
            options.append((counts[keep], gains[keep]))
        budget = min(num_samples, sum(int(c.max()) for c, _ in options if c.size))
        best = np.zeros(budget + 1)  # best[b]: most gain with at most b samples
        choices = []
        for counts, gains in options:
            new = best.copy()
            choice = np.zeros(budget + 1, dtype=np.int64)
            for n, g in zip(counts.tolist(), gains.tolist(), strict=True):
                if n > budget:
                    break
                cand = best[: budget + 1 - n] + g
                better = cand > new[n:]  # strict: on ties keep fewer candidates
                new[n:][better] = cand[better]
                choice[n:][better] = n
            best = new
            choices.append(choice)
        allocation: dict[str, int] = {}
        b = budget
        for p, choice in zip(reversed(prompts), reversed(choices), strict=True):
            allocation[p] = int(choice[b])
            b -= allocation[p]
        return allocation
