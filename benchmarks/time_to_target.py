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

`--repeats R` runs every mode R times (the order of the modes reversed on every other repeat, so
that drift of a shared machine hits them alike). `stale` is not deterministic (which candidates
come back within a window depends on timing), so one run of it cannot tell a speed-up from luck.
The speed-ups are then the ratios of the mean seconds to target over the repeats, and null unless
every repeat of both modes reached the target; `reached` counts the repeats that did, and
`speedup_per_repeat` gives each repeat's ratios. `critical_path_ratio` is the ratio of the mean
median iteration times.

    .venv/bin/python benchmarks/time_to_target.py                       # target: base + 0.03
    .venv/bin/python benchmarks/time_to_target.py --target 0.43 --minutes 8 runtime.spot_nodes=1
    .venv/bin/python benchmarks/time_to_target.py --minutes 5 --gain 0.05 --modes none,stale --repeats 2 \
        runtime.spot_nodes=1 train.num_threads=1
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


def mean_if_all(values: list[float | None]) -> float | None:
    """The mean, or None if any value is None (a repeat that never reached the target) or none given."""
    return statistics.fmean(values) if values and all(v is not None for v in values) else None


def summarize(runs: dict[str, list[dict]]) -> dict:
    """The speed-ups and critical-path ratio over the repeats of each mode (`run_mode` results)."""

    def seconds(mode: str) -> list[float | None]:
        return [r["seconds"] for r in runs.get(mode, [])]

    def iteration_s(mode: str) -> float | None:
        return mean_if_all([r["median_iteration_s"] for r in runs.get(mode, [])])

    def at(mode: str, rep: int) -> float | None:
        rs = runs.get(mode, [])
        return rs[rep]["seconds"] if rep < len(rs) else None

    per_repeat = [
        {"stale_vs_none": ratio(at("none", k), at("stale", k)), "stale_vs_inline": ratio(at("inline", k), at("stale", k))}
        for k in range(max((len(rs) for rs in runs.values()), default=0))
    ]
    return {
        "speedup_wall_stale_vs_none": ratio(mean_if_all(seconds("none")), mean_if_all(seconds("stale"))),
        "speedup_wall_stale_vs_inline": ratio(mean_if_all(seconds("inline")), mean_if_all(seconds("stale"))),
        "critical_path_ratio": ratio(iteration_s("stale"), iteration_s("none")),
        "reached": {mode: sum(r["reached"] for r in rs) for mode, rs in runs.items()},
        "speedup_per_repeat": per_repeat,
    }


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
    parser.add_argument("--repeats", type=int, default=1, help="runs of every mode (stale is not deterministic)")
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

    modes = args.modes.split(",")
    runs: dict[str, list[dict]] = {mode: [] for mode in modes}
    with tempfile.TemporaryDirectory(prefix="time-to-target-") as tmp:
        for rep in range(args.repeats):
            for mode in modes if rep % 2 == 0 else modes[::-1]:
                result = run_mode(load_config(DiTRecipe, args.recipe, base_overrides), mode, target, Path(tmp) / f"r{rep}")
                runs[mode].append(result)
                print(f"{mode} #{rep}: {result}", file=sys.stderr)

    print(json.dumps({
        **summarize(runs),
        "target": target,
        "base_eval": base_eval,
        "minutes_per_mode": args.minutes,
        "repeats": args.repeats,
        "modes": {mode: rs[0] if len(rs) == 1 else rs for mode, rs in runs.items()},
    }))  # fmt: skip


if __name__ == "__main__":
    main()
