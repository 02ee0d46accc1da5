"""Reward variance the bandit planner captures within a fixed budget, against uniform and the oracle.

vs_uniform = captured(bandit) / captured(uniform), vs_oracle = captured(bandit) / captured(oracle),
each summed over all prompts and iterations of a replayed reward table (`planners.tables.replay`):
at every iteration each planner plans over that iteration's prompts with a budget of
budget_fraction x (prompts x most candidates of a prompt) samples; a prompt's captured variance
is that of `select_contrast` on its first n candidates (n = 0: its first G seeds, random seeds);
then each planner observes what it explored (or the unexplored prompt's G rollout seeds).

The main path is a table recorded by a real run (`--table`, .json or .npz; format in
planners/tables.py). Without it, a seeded synthetic non-stationary table is used and the JSON
says "table": "synthetic". Prints one JSON line.

    .venv/bin/python benchmarks/planner.py --table runs/<run>/reward_table.npz
    .venv/bin/python benchmarks/planner.py                   # synthetic
"""

from __future__ import annotations

import argparse
import json

from planners import build_planner, load_reward_table, replay, synthetic_reward_table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", default="", help="reward table (.json or .npz); default: synthetic")
    parser.add_argument("--budget-fraction", type=float, default=0.5, help="budget / (prompts x max candidates)")
    parser.add_argument("--group-size", type=int, default=0, help="G; default: the table's, else 8")
    parser.add_argument("--seed", type=int, default=0, help="planner seed (and the synthetic table's)")
    args = parser.parse_args()

    table = load_reward_table(args.table) if args.table else synthetic_reward_table(seed=args.seed)
    group_size = args.group_size or table.group_size or 8
    names = ("bandit", "uniform", "greedy", "none")
    planners = {name: build_planner(name, seed=args.seed) for name in names}
    result = replay(table, planners, group_size=group_size, budget_fraction=args.budget_fraction)
    captured = result.captured
    print(
        json.dumps(
            {
                "vs_uniform": round(captured["bandit"] / captured["uniform"], 4),
                "vs_oracle": round(captured["bandit"] / captured["oracle"], 4),
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
                "table": "synthetic" if not args.table else args.table,
            }
        )
    )


if __name__ == "__main__":
    main()
