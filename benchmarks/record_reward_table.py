"""Record a reward table (planners/tables.py format) from a real tiny GRPO training run.

At every iteration k, for each of the iteration's P prompts (prompt index p), N candidate seeds
derive_seed(train.seed, k, p, i), i < N, are sampled with the current weights θ_k (stale
relative to the update that follows) and scored. The first G candidates are exactly the training
rollout's own seeds (`plan_iteration` derives them the same way; checked every iteration), so
their rewards are taken from the rollout and only candidates G..N-1 are sampled in addition.
The training update then proceeds as normal on the rollout of the first G seeds.

The table (rewards (I, P, N), prompts (I, P), group_size G) is written with
`planners.tables.save_reward_table`; replay it with

    .venv/bin/python benchmarks/record_reward_table.py                 # ~7.5 min on 2 idle cores
    .venv/bin/python benchmarks/planner.py --table benchmarks/data/tiny-shapes-rewards.npz

Prints one JSON line describing the table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from planners.tables import RewardTable, save_reward_table
from spotlight.explore import planner_ids
from spotlight.sampling import derive_seed
from stale_ranking import DEFAULT_RECIPE, ROOT, IterationPlan, TinyRun, build_run, sample_rewards, train

DEFAULT_OUT = str(ROOT / "benchmarks" / "data" / "tiny-shapes-rewards.npz")


def candidate_seeds(run_seed: int, iteration: int, prompt_index: int, start: int, stop: int) -> list[int]:
    """Seeds of candidates start..stop-1 of one prompt slot of one iteration (as spotlight.explore.candidate_seeds)."""
    return [derive_seed(run_seed, iteration, prompt_index, i) for i in range(start, stop)]


class TableRecorder:
    """Hook that samples and scores every prompt's candidates under the current weights."""

    def __init__(self, num_candidates: int):
        self.num_candidates = num_candidates
        self.iterations: list[dict[str, np.ndarray]] = []

    def __call__(self, run: TinyRun, plan: IterationPlan) -> None:
        cfg, k = run.cfg, plan.iteration
        G, N = cfg.train.group_size, self.num_candidates
        groups = plan.group_prompts(G)
        # The candidates' first G seeds must be the rollout's, or the table's "first G = random
        # seeds" would not be what training sampled.
        assert plan.seeds == [s for p in range(len(groups)) for s in candidate_seeds(cfg.train.seed, k, p, 0, G)]
        extra = np.empty((len(groups), 0))
        if N > G:
            prompts = [p for p in groups for _ in range(N - G)]
            seeds = [s for p in range(len(groups)) for s in candidate_seeds(cfg.train.seed, k, p, G, N)]
            extra = sample_rewards(run, run.policy, prompts, seeds, plan.sde_steps).reshape(len(groups), N - G)
        own = plan.rewards_B.reshape(len(groups), G)
        self.iterations.append({pid: np.concatenate([own[j], extra[j]]) for j, pid in enumerate(planner_ids(groups))})

    def table(self, group_size: int) -> RewardTable:
        return RewardTable(self.iterations, group_size)


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted recipe overrides, e.g. train.lr=1e-4")
    parser.add_argument("--recipe", default=DEFAULT_RECIPE, help="DiT recipe YAML (default: configs/dit/tiny-shapes.yaml)")
    parser.add_argument("--iterations", type=int, default=30, help="training iterations (table rows)")
    parser.add_argument("--candidates", type=int, default=64, help="candidate seeds per prompt (N >= G)")
    parser.add_argument("--out", default=DEFAULT_OUT, help="table file, .npz or .json (default: benchmarks/data/tiny-shapes-rewards.npz)")
    parser.add_argument("--quiet", action="store_true", help="no per-iteration log on stderr")
    args = parser.parse_args(argv)

    began = time.monotonic()
    run = build_run(args.recipe, args.overrides)
    G = run.cfg.train.group_size
    if args.candidates < G:
        raise ValueError(f"--candidates {args.candidates} must be >= train.group_size={G} (the rollout's own seeds)")
    recorder = TableRecorder(args.candidates)
    log = (lambda _: None) if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    result = train(run, args.iterations, recorder, log=log)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_reward_table(recorder.table(G), out)

    rows = [r for it in recorder.iterations for r in it.values()]
    line = {
        "table": str(out),
        "iterations": len(recorder.iterations),
        "prompts_per_iteration": run.cfg.train.prompts_per_iteration,
        "candidates": args.candidates,
        "group_size": G,
        "bytes": out.stat().st_size,
        "zero_variance_first_g": sum(float(np.nanvar(r[:G])) == 0.0 for r in rows),
        "zero_variance_all": sum(float(np.nanvar(r)) == 0.0 for r in rows),
        "reward_mean": round(float(np.nanmean(np.concatenate(rows))), 4),
        "train_reward_first_last": [round(result.rewards[0], 4), round(result.rewards[-1], 4)],
        "recipe": args.recipe,
        "overrides": list(args.overrides),
        "seconds": round(time.monotonic() - began, 1),
        "train_seconds": round(result.train_seconds, 1),
        "explore_seconds": round(result.hook_seconds, 1),
    }
    print(json.dumps(line), flush=True)
    return line


if __name__ == "__main__":
    main()
