"""Time to a target held-out reward with seed exploration `none`, `inline` and `stale`, side by side.

Each mode trains the same recipe from the same base with the same on-demand trainer (the
driver process); only `explore.mode` differs. The held-out `shapes` reward is evaluated every
`--eval-every` iterations during training (`eval.every`, outside the iteration time). A mode's
time to target is the summed `time/iteration_s` up to the first evaluation at or above the
target, so evaluation time never counts. Prints one JSON line:

    speedup_wall_stale_vs_none    time(none) / time(stale)      (null if either never reached it)
    speedup_wall_stale_vs_inline  time(inline) / time(stale)
    critical_path_ratio           median iteration time of stale / of none (iterations after the first)

plus per-mode details (iterations and seconds to target, final evaluation, median iteration time,
fallbacks). The modes run one after another; this machine's load drifts, so also compare
`critical_path_ratio` with a rerun.

    .venv/bin/python benchmarks/time_to_target.py                       # target: base + 0.03
    .venv/bin/python benchmarks/time_to_target.py --target 0.43 --minutes 8 explore.num_spot_nodes=1
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spotlight.config import DiTRecipe  # noqa: E402
from spotlight.config_io import load_config  # noqa: E402
from spotlight.evaluate import evaluate  # noqa: E402
from spotlight.policy import load_policy  # noqa: E402
from spotlight.prompts import train_and_eval_prompts  # noqa: E402
from spotlight.rewards import build_reward  # noqa: E402
from spotlight.tracking import read_metrics  # noqa: E402
from spotlight.train import run_training  # noqa: E402


def time_to_target(rows: list[dict], target: float) -> dict:
    """Iterations and summed iteration seconds up to the first evaluation >= target (None if never)."""
    seconds = 0.0
    for row in rows:
        seconds += row["time/iteration_s"]
        value = row.get("eval/mean_reward")
        if value is not None and value >= target:
            return {"reached": True, "iterations": row["step"], "seconds": round(seconds, 1)}
    return {"reached": False, "iterations": None, "seconds": None}


def run_mode(cfg: DiTRecipe, mode: str, target: float, root: Path) -> dict:
    cfg.explore.mode = mode
    start = time.monotonic()
    run_training(cfg, root / mode, resume=False, progress=False)
    rows = read_metrics(root / mode)
    evals = [r["eval/mean_reward"] for r in rows if "eval/mean_reward" in r]
    # The first iteration carries one-off warm-up (allocator, thread pools, explorers not yet timed).
    iteration_s = [r["time/iteration_s"] for r in rows[1:]] or [rows[0]["time/iteration_s"]]
    fallbacks = sum(v for r in rows for k, v in r.items() if k.startswith("explore/fallback_"))
    return {
        **time_to_target(rows, target),
        "iterations_run": len(rows),
        "median_iteration_s": round(statistics.median(iteration_s), 3),
        "final_eval": round(evals[-1], 4) if evals else None,
        "best_eval": round(max(evals), 4) if evals else None,
        "fallback_prompts": fallbacks,
        "wall_s": round(time.monotonic() - start, 1),
    }


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="recipe overrides, key=value")
    parser.add_argument("--recipe", default="configs/dit/tiny-shapes.yaml")
    parser.add_argument("--target", type=float, default=None, help="held-out reward to reach (default: base + --gain)")
    parser.add_argument("--gain", type=float, default=0.03, help="target over the base's held-out reward")
    parser.add_argument("--minutes", type=float, default=6.0, help="training time per mode (train.max_minutes)")
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--eval-seeds", type=int, default=8)
    parser.add_argument("--modes", default="none,stale,inline")
    args = parser.parse_args()

    base_overrides = [
        f"train.max_minutes={args.minutes}", "train.num_iterations=100000", f"eval.every={args.eval_every}",
        f"eval.num_seeds={args.eval_seeds}", "log.images_every=0", "log.checkpoint_every=100000",
        "log.wandb_mode=disabled", *args.overrides,
    ]  # fmt: skip
    cfg = load_config(DiTRecipe, args.recipe, base_overrides)
    target = args.target
    base_eval = None
    if target is None:
        policy = load_policy(cfg.model, trainable=False)
        prompts = train_and_eval_prompts(cfg.data, cfg.reward.weights)[1]
        summary, _ = evaluate(policy, prompts, build_reward(cfg.reward.weights, **cfg.reward.options()), cfg, progress=False)
        base_eval = summary["mean_reward"]
        target = round(base_eval + args.gain, 4)

    results = {}
    with tempfile.TemporaryDirectory(prefix="time-to-target-") as tmp:
        for mode in args.modes.split(","):
            results[mode] = run_mode(load_config(DiTRecipe, args.recipe, base_overrides), mode, target, Path(tmp))
            print(f"{mode}: {results[mode]}", file=sys.stderr)

    def seconds(mode: str) -> float | None:
        return results.get(mode, {}).get("seconds")

    none_it = results.get("none", {}).get("median_iteration_s")
    stale_it = results.get("stale", {}).get("median_iteration_s")
    print(json.dumps({
        "speedup_wall_stale_vs_none": ratio(seconds("none"), seconds("stale")),
        "speedup_wall_stale_vs_inline": ratio(seconds("inline"), seconds("stale")),
        "critical_path_ratio": ratio(stale_it, none_it),
        "target": target,
        "base_eval": base_eval,
        "minutes_per_mode": args.minutes,
        "modes": results,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
