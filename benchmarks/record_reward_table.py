"""Record a reward table (planners/tables.py format) from a real tiny GRPO training run.

At every iteration k, for each of the iteration's P prompts (prompt index p), N candidate seeds
derive_seed(train.seed, k, p, i), i < N, are sampled with the current weights θ_k (stale
relative to the update that follows) and scored. The first G candidates are exactly the training
rollout's own seeds (`plan_iteration` derives them the same way; checked every iteration), so
their rewards are taken from the rollout and only candidates G..N-1 are sampled in addition.
The training update then proceeds as normal on the rollout of the first G seeds.

With `--staleness S` the same N seeds of every prompt are also sampled and scored with the
weights θ_{k-S} (what an explorer one update behind measures; iterations k < S use θ_0) and
stored as the table's `explored` rewards, so that a replay chooses groups by stale rewards and
scores them on fresh ones (out of sample; `planners.tables.replay`).

The table (rewards (I, P, N), prompts (I, P), group_size G, and with --staleness explored
(I, P, N) and staleness) is written with `planners.tables.save_reward_table`; replay it with

    .venv/bin/python benchmarks/record_reward_table.py                 # ~7.5 min on 2 idle cores
    .venv/bin/python benchmarks/record_reward_table.py --staleness 1 \\
        --out benchmarks/data/tiny-shapes-rewards-stale1.npz
    .venv/bin/python benchmarks/planner.py --table benchmarks/data/tiny-shapes-rewards.npz

Prints one JSON line describing the table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from stale_ranking import (
    DEFAULT_RECIPE,
    ROOT,
    IterationPlan,
    TinyRun,
    build_run,
    sample_rewards,
    snapshot,
    stale_copy,
    train,
)

from planners.tables import RewardTable, save_reward_table
from spotlight.core.seeds import derive_seed
from spotlight.policy import load_trainable_state
from spotlight.seed_selection import planner_ids

DEFAULT_OUT = str(ROOT / "benchmarks" / "data" / "tiny-shapes-rewards.npz")


def candidate_seeds(run_seed: int, iteration: int, prompt_index: int, start: int, stop: int) -> list[int]:
    """Seeds of candidates start..stop-1 of one prompt slot of one iteration (as seed_selection.candidate_seeds)."""
    return [derive_seed(run_seed, iteration, prompt_index, i) for i in range(start, stop)]


class TableRecorder:
    """Hook that samples and scores every prompt's candidates under the current weights (and,
    with `staleness` S > 0, under θ_{k-S} too: the table's explored rewards)."""

    def __init__(self, num_candidates: int, staleness: int = 0):
        self.num_candidates = num_candidates
        self.staleness = staleness
        self.iterations: list[dict[str, np.ndarray]] = []
        self.explored: list[dict[str, np.ndarray]] = []
        # After iteration k's snapshot, history holds θ_k ... θ_{k-S}; its last entry is θ_{k-S}
        # (θ_0 while fewer than S updates exist).
        self.history: deque[dict[str, torch.Tensor]] = deque(maxlen=staleness + 1)
        self.stale_policy = None

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
        ids = planner_ids(groups)
        self.iterations.append({pid: np.concatenate([own[j], extra[j]]) for j, pid in enumerate(ids)})
        if self.staleness:
            if self.stale_policy is None:
                self.stale_policy = stale_copy(run.policy)
            self.history.appendleft(snapshot(run.policy))
            load_trainable_state(self.stale_policy, self.history[-1])
            prompts = [p for p in groups for _ in range(N)]
            seeds = [s for p in range(len(groups)) for s in candidate_seeds(cfg.train.seed, k, p, 0, N)]
            stale = sample_rewards(run, self.stale_policy, prompts, seeds, plan.sde_steps).reshape(len(groups), N)
            self.explored.append({pid: stale[j] for j, pid in enumerate(ids)})

    def table(self, group_size: int) -> RewardTable:
        if not self.staleness:
            return RewardTable(self.iterations, group_size)
        return RewardTable(self.iterations, group_size, explored=self.explored, staleness=self.staleness)


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted recipe overrides, e.g. train.lr=1e-4")
    parser.add_argument(
        "--recipe", default=DEFAULT_RECIPE, help="DiT recipe YAML (default: configs/dit/tiny-shapes.yaml)"
    )
    parser.add_argument("--iterations", type=int, default=30, help="training iterations (table rows)")
    parser.add_argument("--candidates", type=int, default=64, help="candidate seeds per prompt (N >= G)")
    parser.add_argument(
        "--out",
        default=DEFAULT_OUT,
        help="table file, .npz or .json (default: benchmarks/data/tiny-shapes-rewards.npz)",
    )
    parser.add_argument(
        "--staleness",
        type=int,
        default=0,
        help="also score every candidate with the weights of S updates before (the table's explored rewards); 0: no",
    )
    parser.add_argument("--quiet", action="store_true", help="no per-iteration log on stderr")
    args = parser.parse_args(argv)

    began = time.monotonic()
    run = build_run(args.recipe, args.overrides)
    G = run.cfg.train.group_size
    if args.candidates < G:
        raise ValueError(f"--candidates {args.candidates} must be >= train.group_size={G} (the rollout's own seeds)")
    if args.staleness < 0:
        raise ValueError(f"--staleness must be >= 0, got {args.staleness}")
    recorder = TableRecorder(args.candidates, args.staleness)
    log = (lambda _: None) if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    result = train(run, args.iterations, recorder, log=log)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_reward_table(recorder.table(G), out)

    rows = [r for it in recorder.iterations for r in it.values()]
    line = {
        "baseline": None,  # it records data for planner.py; it compares nothing
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
        "staleness": args.staleness,
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
