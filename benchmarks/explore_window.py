"""Stale exploration's two windows side by side: `explore.window=update` vs `iteration`.

Each window trains the same recipe from the same base for `--iterations` iterations with
`explore.mode=stale` (a local Ray cluster; pass `runtime.spot_nodes=1 train.num_threads=1`
on 2 cores, so that the trainer and the explorer have a core each). The runs alternate (`--repeats
R`: R pairs, the order reversed on every other pair, as this machine's load drifts). Figures are
means over the iterations after the first two (iteration 0 explores nothing, and the first window
of "iteration" is sized from an update alone), summed over repeats before the ratios:

    scored_ratio          candidates scored in time per window, iteration / update
    selected_ratio        prompts that trained on selected seeds per iteration, iteration / update
    iteration_time_ratio  median iteration time, iteration / update (the critical path: ~1)
    late_prompts          planned prompts whose results came back after the update, per window kind

    .venv/bin/python benchmarks/explore_window.py runtime.spot_nodes=1 train.num_threads=1
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spotlight.config import DiTRecipe
from spotlight.core.config_io import load_config
from spotlight.core.tracking import read_metrics
from spotlight.driver import run_training

WINDOWS = ("update", "iteration")
SKIP = 2
"""Iterations left out of the means (see the module docstring)."""


def summarize_run(rows: list[dict]) -> dict:
    """The per-run figures of one window (rows of `metrics.jsonl`)."""
    if len(rows) <= SKIP:
        raise ValueError(f"a run needs more than {SKIP} iterations to measure, got {len(rows)}")
    kept = rows[SKIP:]
    return {
        "scored_per_window": statistics.fmean(r.get("explore/candidates_scored", 0) for r in kept),
        "planned_per_window": statistics.fmean(r.get("explore/candidates_planned", 0) for r in kept),
        "selected_per_iteration": statistics.fmean(r.get("explore/prompts_selected", 0) for r in kept),
        "late_prompts": sum(r.get("explore/fallback_late", 0) for r in kept),
        "median_iteration_s": statistics.median(r["time/iteration_s"] for r in kept),
        "iterations": len(rows),
    }


def ratios(runs: dict[str, list[dict]]) -> dict:
    """iteration / update of the summed per-run figures."""

    def total(window: str, key: str) -> float:
        return sum(r[key] for r in runs[window])

    def ratio(key: str) -> float | None:
        base = total("update", key)
        return round(total("iteration", key) / base, 3) if base else None

    return {
        "scored_ratio": ratio("scored_per_window"),
        "selected_ratio": ratio("selected_per_iteration"),
        "iteration_time_ratio": ratio("median_iteration_s"),
        "late_prompts": {w: total(w, "late_prompts") for w in WINDOWS},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="recipe overrides, key=value")
    parser.add_argument("--recipe", default="configs/dit/tiny-shapes.yaml")
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=1, help="pairs of runs, alternating which window goes first")
    args = parser.parse_args()
    base = [
        "explore.mode=stale",
        f"train.num_iterations={args.iterations}",
        "train.max_minutes=0",
        "log.images_every=0",
        "log.checkpoint_every=100000",
        "log.wandb_mode=disabled",
        *args.overrides,
    ]
    runs: dict[str, list[dict]] = {w: [] for w in WINDOWS}
    with tempfile.TemporaryDirectory(prefix="explore-window-") as tmp:
        for rep in range(args.repeats):
            for window in WINDOWS if rep % 2 == 0 else WINDOWS[::-1]:
                cfg = load_config(DiTRecipe, args.recipe, [*base, f"explore.window={window}"])
                run_dir = Path(tmp) / f"{window}-{rep}"
                run_training(cfg, run_dir, resume=False, progress=False)
                result = summarize_run(read_metrics(run_dir))
                runs[window].append(result)
                print(f"{window} #{rep}: {result}", file=sys.stderr)
    print(
        json.dumps(
            {
                "baseline": "explore.window=update (exploration within the update alone)",
                **ratios(runs),
                "iterations": args.iterations,
                "repeats": args.repeats,
                "runs": {w: [{k: round(v, 3) for k, v in r.items()} for r in rs] for w, rs in runs.items()},
            }
        )
    )


if __name__ == "__main__":
    main()
