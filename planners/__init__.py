"""Seed-exploration planners behind one small interface (docs/architecture.md, "Seed exploration"); plain Python and
numpy.

While the trainer updates the policy, spot workers sample many candidate seeds per prompt with the
previous weights; `select_contrast` then keeps a high-contrast group of G seeds per prompt for
the rollout. A planner decides, within a budget (samples, or seconds through a cost per sample),
which prompts to explore and with how many candidates, to maximise the reward variance of the
selected groups.

    base.py       Allocation, Observation, the Planner interface and its invariants
    selection.py  select_contrast, group_variance, captured_variance
    simple.py     NonePlanner, UniformPlanner, GreedyPlanner (baselines)
    bandit.py     BanditPlanner: Thompson sampling on a discounted Beta model, concave-hull greedy
    families.py   prompt_family: which prompts share the bandit's prior ("shapes_counts", "matches:REGEX")
    oracle.py     OraclePlanner: exact hindsight optimum on known rewards (evaluation only)
    tables.py     reward tables from real runs (JSON / NPZ), a synthetic table, replay

    planner = build_planner("bandit", seed=0)
    alloc = planner.plan(prompts, budget=512, group_size=8)       # {prompt: candidates}
    planner.observe([Observation(p, rewards, iteration=k) ...])   # what the iteration revealed
"""

from __future__ import annotations

import difflib
import inspect
from typing import Any

from planners.bandit import BanditPlanner
from planners.base import Allocation, Observation, Planner
from planners.families import FAMILY_PRESETS, prompt_family
from planners.oracle import OraclePlanner
from planners.selection import captured_variance, group_variance, select_contrast
from planners.simple import GreedyPlanner, NonePlanner, UniformPlanner
from planners.tables import RewardTable, load_reward_table, replay, save_reward_table, synthetic_reward_table

PLANNERS: dict[str, type[Planner]] = {
    cls.name: cls for cls in (NonePlanner, UniformPlanner, GreedyPlanner, BanditPlanner, OraclePlanner)
}
"""Registry: name -> planner class."""


def build_planner(name: str, **options: Any) -> Planner:
    """The planner registered as `name`, built with `options` (its constructor's arguments).

    Raises:
        ValueError: naming an unknown planner and the valid names, or an unknown option and the
            nearest valid one.
    """
    if name not in PLANNERS:
        raise ValueError(f"unknown planner {name!r}; valid planners: {', '.join(sorted(PLANNERS))}")
    cls = PLANNERS[name]
    params = inspect.signature(cls).parameters
    valid = list(params)
    for key in options:
        if key not in valid:
            near = difflib.get_close_matches(key, valid, n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise ValueError(f"planner {name!r} has no option {key!r}{hint} (options: {', '.join(valid)})")
    missing = [k for k, p in params.items() if p.default is inspect.Parameter.empty and k not in options]
    if missing:
        raise ValueError(f"planner {name!r} needs option {missing[0]!r}")
    return cls(**options)


__all__ = [
    "FAMILY_PRESETS",
    "PLANNERS",
    "Allocation",
    "BanditPlanner",
    "GreedyPlanner",
    "NonePlanner",
    "Observation",
    "OraclePlanner",
    "Planner",
    "RewardTable",
    "UniformPlanner",
    "build_planner",
    "captured_variance",
    "group_variance",
    "load_reward_table",
    "prompt_family",
    "replay",
    "save_reward_table",
    "select_contrast",
    "synthetic_reward_table",
]
