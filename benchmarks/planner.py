"""Reward variance the bandit planner captures within a fixed budget, against uniform and the oracle.

vs_uniform = captured(bandit) / captured(uniform), vs_oracle = captured(bandit) / captured(oracle),
each summed over all prompts and iterations of a replayed reward table (`planners.tables.replay`):
at every iteration each planner plans over that iteration's prompts with a budget of
budget_fraction x (prompts x most candidates of a prompt) samples; a prompt's captured variance
is that of `select_contrast` on its first n candidates (n = 0: its first G seeds, random seeds);
then each planner observes what it explored (or the unexplored prompt's G rollout seeds).

The bandit groups prompts into families as the embedded recipe does (`--family`, default
`explore.planner_family` of `DiTRecipe`, "shapes_counts"; planners/families.py); the same bandit
with one family for all prompts is reported beside it (`bandit_one_family`).

The main path is a table recorded by a real run (`--table`, .json or .npz; format in
planners/tables.py). Without it, a seeded synthetic non-stationary table is used and the JSON
says "table": "synthetic". Prints one JSON line.

    .venv/bin/python benchmarks/planner.py --table runs/<run>/reward_table.npz
    .venv/bin/python benchmarks/planner.py                   # synthetic
    .venv/bin/python benchmarks/planner.py --table T --family ""   # the bandit without families
"""

from __future__ import annotations

import argparse
import json

from planners import build_planner, load_reward_table, prompt_family, replay, synthetic_reward_table
from spotlight.config import ExploreConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", default="", help="reward table (.json or .npz); default: synthetic")
    parser.add_argument("--budget-fraction", type=float, default=0.5, help="budget / (prompts x max candidates)")
    parser.add_argument("--group-size", type=int, default=0, help="G; default: the table's, else 8")
    parser.add_argument("--seed", type=int, default=0, help="planner seed (and the synthetic table's)")
    parser.add_argument(
        "--family", default=ExploreConfig.planner_family, help="the bandit's prompt families (planners/families.py); \"\" one family"
    )
    args = parser.parse_args()

    table = load_reward_table(args.table) if args.table else synthetic_reward_table(seed=args.seed)
    group_size = args.group_size or table.group_size or 8
    planners = {"bandit": build_planner("bandit", seed=args.seed, family=prompt_family(args.family))}
    planners |= {name: build_planner(name, seed=args.seed) for name in ("uniform", "greedy", "none")}
    planners["bandit_one_family"] = build_planner("bandit", seed=args.seed)
    result = replay(table, planners, group_size=group_size, budget_fraction=args.budget_fraction)
    captured = result.captured
    print(
        json.dumps(
            {
                "vs_uniform": round(captured["bandit"] / captured["uniform"], 4),
                "vs_oracle": round(captured["bandit"] / captured["oracle"], 4),
                "one_family_vs_uniform": round(captured["bandit_one_family"] / captured["uniform"], 4),
                "one_family_vs_oracle": round(captured["bandit_one_family"] / captured["oracle"], 4),
                "greedy_vs_uniform": round(captured["greedy"] / captured["uniform"], 4),
                "uniform_vs_none": round(captured["uniform"] / captured["none"], 4),
                "captured": {k: round(v, 4) for k, v in captured.items()},
                "zero_variance_groups": result.zero_variance_groups,
                "samples_spent": result.samples_spent,
                "budget_samples": sum(result.budget_samples),
                "budget_fraction": args.budget_fraction,
                "groups": sum(len(it) for it in table.iterations),
                "iterations": len(table.iterations),
                "group_size": group_size,
                "family": args.family,
                "table": "synthetic" if not args.table else args.table,
            }
        )
    )


if __name__ == "__main__":
    main()
