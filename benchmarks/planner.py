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

The budget. The default, 0.317, is what the tiny recipe's stale exploration actually had on this
2-core machine (one explorer core, the trainer on the other), with the default window
(`explore.window=iteration`: rollout and update): a mean of 325 candidates per window against
16 prompts x 64 candidates, measured with

    .venv/bin/spotlight train configs/dit/tiny-shapes.yaml explore.mode=stale runtime.spot_nodes=1 \
        train.num_threads=1 train.num_iterations=10 --run-dir R
    .venv/bin/python benchmarks/planner.py --table T --budget-from R

With `explore.window=update` (the update alone) the same run had 197 candidates, 0.193.

`--budget-from RUN_DIR` reads a run's measured budgets (`explore/budget_samples` of the windows
whose throughput and update time were measured, not guessed) and divides their mean by
prompts_per_iteration x the most candidates of a prompt of that run. How much allocation can
gain depends on the budget: with half of every candidate (0.5) uniform exploration already
captures most of the variance. `sweep` reports vs_uniform and vs_oracle at several fractions
beside the main figure, so no single budget stands alone.

The main path is a table recorded by a real run (`--table`, .json or .npz; format in
planners/tables.py). Without it, a seeded synthetic non-stationary table is used and the JSON
says "table": "synthetic". Prints one JSON line.

Out of sample. Scored on the rewards it selected by, a planner is flattered twice: the extremes of
a prompt's candidates are picked with the very rewards that measure them, and its settings may
have been tuned on the table that scores it. So:

- A table recorded with `record_reward_table.py --staleness 1` holds, for the same seeds, the
  rewards of the weights one update behind (what an explorer measures). Replayed, every planner
  chooses and learns by those stale rewards and is scored on the fresh ones ("scored":
  "out_of_sample"); the oracle keeps hindsight (fresh rewards). The in-sample figures of the same
  table are printed beside them (`in_sample`).
- `--tune-on TABLE2` chooses the bandit's family and its two settings (discount, prior strength)
  by the variance captured on another table (from another run, or another base), and reports the
  chosen settings' figures on `--table`, beside the shipped defaults' (`tuned`).

    .venv/bin/python benchmarks/planner.py --table benchmarks/data/tiny-shapes-rewards-long6k.npz
    .venv/bin/python benchmarks/planner.py                   # synthetic
    .venv/bin/python benchmarks/planner.py --table T --family ""   # the bandit without families
    .venv/bin/python benchmarks/planner.py --table benchmarks/data/tiny-shapes-rewards-stale1.npz \
        --tune-on benchmarks/data/tiny-shapes-rewards-long6k.npz     # out of sample both ways
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from pathlib import Path

from planners import build_planner, load_reward_table, prompt_family, replay, synthetic_reward_table
from spotlight.config import DiTRecipe, ExploreConfig

MEASURED_BUDGET_FRACTION = 0.317
"""The tiny recipe's stale budget on 2 cores (module docstring): 325 candidates of 16 x 64."""

SWEEP = (0.1, 0.2, 0.3, 0.5, 0.75)

TUNE_FAMILIES = (
    "",
    "shapes_counts",
    r"matches:\b(red|green|blue|yellow)\b",
    r"matches:\b(circles?|squares?|triangles?)\b",
)
"""Families `--tune-on` tries: one family, the count words (the shipped preset), colours, shapes."""
TUNE_DISCOUNTS = (0.8, 0.9, 0.95)
TUNE_PRIOR_STRENGTHS = (2.0, 4.0, 8.0)


def budget_fraction_of_run(run_dir: str | Path) -> float:
    """Mean measured exploration budget of a run over prompts_per_iteration x max candidates."""
    from spotlight.core.config_io import load_config
    from spotlight.core.tracking import read_metrics

    run_dir = Path(run_dir)
    config = run_dir / "config.yaml"
    if not config.is_file():
        raise SystemExit(f"--budget-from {run_dir}: no config.yaml (not a spotlight run directory)")
    cfg = load_config(DiTRecipe, config)
    budgets = [
        r["explore/budget_samples"]
        for r in read_metrics(run_dir)
        if "explore/budget_samples" in r
        and not r.get("explore/throughput_guessed")
        and not r.get("explore/update_guessed")
    ]
    if not budgets:
        raise SystemExit(
            f"--budget-from {run_dir}: no window with a measured budget in metrics.jsonl (explore.mode none?)"
        )
    t = cfg.train
    return statistics.fmean(budgets) / (t.prompts_per_iteration * cfg.explore.candidates_cap(t.group_size))


def build_planners(family: str, seed: int, **bandit) -> dict:
    planners = {"bandit": build_planner("bandit", seed=seed, family=prompt_family(family), **bandit)}
    planners |= {name: build_planner(name, seed=seed) for name in ("uniform", "greedy", "none")}
    planners["bandit_one_family"] = build_planner("bandit", seed=seed, **bandit)
    return planners


def bandit_ratios(captured: dict[str, float]) -> dict[str, float]:
    """The bandit's captured variance over uniform's and over the oracle's."""
    return {
        "vs_uniform": round(captured["bandit"] / captured["uniform"], 4),
        "vs_oracle": round(captured["bandit"] / captured["oracle"], 4),
    }


def bandit_figures(table, group_size: int, fraction: float, seed: int, family: str, **bandit) -> dict[str, float]:
    """The bandit's captured variance over uniform's and the oracle's (out of sample where the table allows)."""
    planners = {"bandit": build_planner("bandit", seed=seed, family=prompt_family(family), **bandit)}
    planners["uniform"] = build_planner("uniform", seed=seed)
    return bandit_ratios(replay(table, planners, group_size=group_size, budget_fraction=fraction).captured)


def tune(tune_table, score_table, group_size: int, fraction: float, seed: int, family: str) -> dict:
    """Choose family, discount and prior strength on `tune_table`; report them on `score_table`."""
    trials = []
    for fam, discount, strength in itertools.product(TUNE_FAMILIES, TUNE_DISCOUNTS, TUNE_PRIOR_STRENGTHS):
        fig = bandit_figures(tune_table, group_size, fraction, seed, fam, discount=discount, prior_strength=strength)
        trials.append((fig["vs_uniform"], fam, discount, strength))
    best_vs_uniform, fam, discount, strength = max(trials, key=lambda t: t[0])
    defaults = {"discount": 0.9, "prior_strength": 4.0}
    return {
        "tune_table": tune_table.source,
        "trials": len(trials),
        "chosen": {"family": fam, "discount": discount, "prior_strength": strength},
        "chosen_on_tune_table": {"vs_uniform": best_vs_uniform},
        "chosen_on_table": bandit_figures(
            score_table, group_size, fraction, seed, fam, discount=discount, prior_strength=strength
        ),
        "defaults_on_tune_table": bandit_figures(tune_table, group_size, fraction, seed, family, **defaults),
        "defaults_on_table": bandit_figures(score_table, group_size, fraction, seed, family, **defaults),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", default="", help="reward table (.json or .npz); default: synthetic")
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument(
        "--budget-fraction",
        type=float,
        default=MEASURED_BUDGET_FRACTION,
        help="budget / (prompts x max candidates); default: the tiny recipe's measured stale budget",
    )
    budget.add_argument("--budget-from", default="", help="a stale or inline run directory: its measured budget")
    parser.add_argument("--group-size", type=int, default=0, help="G; default: the table's, else 8")
    parser.add_argument("--seed", type=int, default=0, help="planner seed (and the synthetic table's)")
    parser.add_argument(
        "--family",
        default=ExploreConfig.planner_family,
        help='the bandit\'s prompt families (planners/families.py); "" one family',
    )
    parser.add_argument(
        "--tune-on",
        default="",
        help="another reward table: choose the bandit's family, discount and prior strength there, "
        "score them on --table",
    )
    args = parser.parse_args()

    fraction = round(budget_fraction_of_run(args.budget_from), 4) if args.budget_from else args.budget_fraction
    table = load_reward_table(args.table) if args.table else synthetic_reward_table(seed=args.seed)
    group_size = args.group_size or table.group_size or 8
    result = replay(table, build_planners(args.family, args.seed), group_size=group_size, budget_fraction=fraction)
    captured = result.captured
    out_of_sample = table.explored is not None
    in_sample = None
    if out_of_sample:
        c = replay(
            table,
            build_planners(args.family, args.seed),
            group_size=group_size,
            budget_fraction=fraction,
            in_sample=True,
        ).captured
        in_sample = bandit_ratios(c)
    sweep = {}
    for f in SWEEP:
        c = replay(table, build_planners(args.family, args.seed), group_size=group_size, budget_fraction=f).captured
        sweep[str(f)] = bandit_ratios(c)
    tuned = None
    if args.tune_on:
        tuned = tune(load_reward_table(args.tune_on), table, group_size, fraction, args.seed, args.family)
    print(
        json.dumps(
            {
                "baseline": "uniform: the same budget spread evenly over the iteration's prompts",
                "scored": "out_of_sample" if out_of_sample else "in_sample",
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
                "budget_fraction": fraction,
                "budget_from": args.budget_from or None,
                "sweep": sweep,
                "in_sample": in_sample,
                "staleness": table.staleness,
                "tuned": tuned,
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
