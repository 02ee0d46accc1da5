"""Choosing the G seeds of a GRPO group from explored candidates, and the variance they capture.

GRPO learns only from groups whose rewards differ (GRPO, Shao et al. 2024): a group's reward variance is
the signal it carries. Exploration scores many candidate seeds of a prompt with stale weights;
`select_contrast` keeps a high-contrast subset of G of them for the fresh rollout, and
`captured_variance` is the figure every planner is judged by: the population variance of the
selected group (an unexplored prompt keeps its first G seeds, i.e. random seeds).

Rewards may hold NaN (a failed reward function, as in `spotlight.grpo`): NaN candidates are never
preferred over scored ones, and NaN rewards count in no variance.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

RULES = ("extremes", "random")


def select_contrast(
    rewards: Sequence[float], group_size: int, rule: str = "extremes", rng: np.random.Generator | None = None
) -> list[int]:
    """Indices (ascending) of the G candidates that form the group.

    Rules:
        "extremes": the top ceil(G/2) and the bottom floor(G/2) candidates by reward. Ties are
            broken by index (the lower index wins, on both sides), so the choice is deterministic.
            NaN candidates are taken only when fewer than G candidates were scored, lowest
            index first.
        "random": G candidates drawn without replacement with `rng` (the control: what
            exploration without selection gives).

    Args:
        rewards: (N,) rewards of the N candidates, N >= G.
        group_size: G.
        rule: "extremes" or "random".
        rng: required for "random" (pass `np.random.default_rng(seed)`); unused by "extremes".

    Raises:
        ValueError: unknown rule, G < 1, fewer than G candidates, or "random" without `rng`.
    """
    r = np.asarray(rewards, dtype=np.float64).reshape(-1)
    if rule not in RULES:
        raise ValueError(f"unknown selection rule {rule!r}; use one of {', '.join(RULES)}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if r.size < group_size:
        raise ValueError(f"need at least group_size={group_size} candidates to select from, got {r.size}")
    if rule == "random":
        if rng is None:
            raise ValueError('rule "random" needs rng, e.g. rng=np.random.default_rng(seed)')
        return sorted(int(i) for i in rng.choice(r.size, size=group_size, replace=False))

    index = np.arange(r.size)
    valid = ~np.isnan(r)
    scored = index[valid]
    # lexsort sorts by the last key first: reward, then index.
    descending = scored[np.lexsort((scored, -r[valid]))]
    num_top = math.ceil(group_size / 2)
    top = descending[:num_top]
    ascending = scored[np.lexsort((scored, r[valid]))]
    taken = set(top.tolist())
    bottom = [i for i in ascending if i not in taken][: group_size - len(top)]
    chosen = [int(i) for i in top] + [int(i) for i in bottom]
    chosen += [int(i) for i in index[~valid][: group_size - len(chosen)]]
    assert len(chosen) == group_size, (len(chosen), group_size)
    return sorted(chosen)


def group_variance(rewards: Sequence[float]) -> float:
    """Population variance of the non-NaN rewards; 0.0 when fewer than two are left (no signal)."""
    r = np.asarray(rewards, dtype=np.float64).reshape(-1)
    r = r[~np.isnan(r)]
    if r.size < 2:
        return 0.0
    return float(np.mean((r - r.mean()) ** 2))


def captured_variance(
    candidates: Sequence[float], num_explored: int, group_size: int, selected_by: Sequence[float] | None = None
) -> float:
    """Variance of the group a prompt trains on when `num_explored` candidates were explored.

    With num_explored > G, "extremes" selects G of the first `num_explored` candidates (fewer
    when the table holds fewer); otherwise the prompt was not explored and the rollout uses its
    first G seeds, which are random seeds.

    In sample (`selected_by` None) the group is chosen by the same rewards it is scored on. Out of
    sample, it is chosen by `selected_by` (what the explorers measured: stale weights, or a
    cheaper sampler) and scored on `candidates` (the rewards the training rollout gets with fresh
    weights), as Spotlight's explorers select with weights one update old.

    Args:
        candidates: (N,) rewards of the candidate seeds in exploration order (the scored ones).
        num_explored: candidates the planner gave the prompt (0 = not explored).
        group_size: G.
        selected_by: (N,) rewards of the same seeds that the selection sees; default `candidates`.
    """
    r = np.asarray(candidates, dtype=np.float64).reshape(-1)
    n = min(int(num_explored), r.size)
    if n <= group_size:
        return group_variance(r[:group_size])
    s = r if selected_by is None else np.asarray(selected_by, dtype=np.float64).reshape(-1)
    if s.size != r.size:
        raise ValueError(f"selected_by holds {s.size} rewards for {r.size} candidates")
    return group_variance(r[select_contrast(s[:n], group_size)])
