"""Iterations and wall time to a held-out target: seed exploration against plain GRPO, over seeds.

Every mode trains the same recipe from the same base; only where a group's seeds come from differs:

    none            the G default seeds (plain GRPO), the trainer on --trainer-threads threads
    none_all_cores  the same with the trainer on every core: the spare capacity given to the
                    trainer instead of to explorers (what a user would pick instead)
    stale           Spotlight: batch k+1 explored with θ_k while the trainer works, on k spot
                    nodes of explorer capacity EMULATED by time-slicing (`explore.emulated_nodes`,
                    spotlight/emulated.py): the trainer pauses while the explorers score exactly
                    what k nodes would have scored in its window, and the pause is not counted
    oracle          the upper bound: every prompt explored with the fresh weights (inline, no time
                    limit), --oracle-candidates candidates each, also emulated and not counted
    stale_real      stale with one real explorer (a Ray spot node on the core the trainer leaves),
                    to check the emulation at k = 1: candidates per window and iterations to target

Each mode runs once per training seed (`train.seed` = 0..S-1: the prompts, trajectories and
candidates all follow it). The held-out reward (`eval.every`, --eval-seeds seeds per held-out
prompt) is evaluated every --eval-every iterations; a run's iterations to target are those of the
first evaluation at or above the target (base + --gain), and its wall time to target is
time/run_s at that row: start-up, iterations, evaluations and checkpoints on the trainer's clock,
emulated waits excluded. Ratios are per seed (none of seed s over stale of seed s), then the
median and range over seeds; a seed where either run never reached the target within
--iterations gives no ratio (counted in "unreached"). The learning-rate schedule runs on
iterations (train.lr_cooldown 0), so that it does not depend on how fast a mode's iterations are.

Prints one JSON line; per-run progress goes to stderr. Examples:

    .venv/bin/python benchmarks/time_to_target.py --emulate-spot-nodes 4 --seeds 3 --json
    .venv/bin/python benchmarks/time_to_target.py --emulate-spot-nodes 1,2,4,8 --seeds 3 --modes none,stale --json
    .venv/bin/python benchmarks/time_to_target.py --emulate-spot-nodes 1 --modes stale,stale_real --seeds 2 --json
    .venv/bin/python benchmarks/time_to_target.py --emulate-spot-nodes 8 --modes none,stale,oracle --seeds 3 --json \
        --selection-override train.group_size=8 --selection-override train.prompts_per_iteration=32
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from contextlib import nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spotlight.config import DiTRecipe
from spotlight.core.config_io import load_config
from spotlight.core.tracking import read_metrics
from spotlight.driver import run_training
from spotlight.evaluate import evaluate
from spotlight.policy import load_policy
from spotlight.prompts import train_and_eval_prompts
from spotlight.rewards import build_reward

MODES = ("none", "none_all_cores", "stale", "oracle", "stale_real")
SELECTING_MODES = ("stale", "oracle", "stale_real")  # the modes --selection-override applies to


def mode_overrides(mode: str, *, nodes: int, trainer_threads: int, oracle_candidates: int, prompts: int) -> list[str]:
    """The recipe overrides of one mode (module docstring)."""
    threads = f"train.num_threads={trainer_threads}"
    if mode == "none":
        return ["explore.mode=none", threads]
    if mode == "none_all_cores":
        return ["explore.mode=none", "train.num_threads=0"]
    if mode == "stale":
        return ["explore.mode=stale", f"explore.emulated_nodes={nodes}", threads]
    if mode == "oracle":
        return [
            "explore.mode=inline",
            "explore.emulated_nodes=1",
            "explore.planner=uniform",
            f"explore.max_candidates={oracle_candidates}",
            f"explore.fixed_budget={prompts * oracle_candidates}",
            threads,
        ]
    if mode == "stale_real":
        return ["explore.mode=stale", "runtime.spot_nodes=1", "runtime.local_cluster_cpus=1", threads]
    raise ValueError(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")


def run_overrides(mode: str, common: list[str], selection: list[str], **mode_args) -> list[str]:
    """A run's recipe overrides: the common ones, then --selection-override's for the modes that select
    seeds (so plain GRPO keeps the recipe's own shape), then the mode's (`mode_overrides`)."""
    return [*common, *(selection if mode in SELECTING_MODES else []), *mode_overrides(mode, **mode_args)]


def to_target(rows: list[dict], target: float) -> dict:
    """Iterations and time/run_s at the first evaluation >= target (None if never)."""
    for row in rows:
        value = row.get("eval/mean_reward")
        if value is not None and value >= target:
            return {"reached": True, "iterations": row["step"], "wall_s": round(row["time/run_s"], 1)}
    return {"reached": False, "iterations": None, "wall_s": None}


def summarize_run(rows: list[dict], target: float) -> dict:
    """What one run gives the figures: time to target, the held-out curve, the exploration dose."""

    def mean(key: str, skip_first: bool = True) -> float | None:
        values = [r[key] for r in (rows[1:] if skip_first else rows) if key in r]
        return round(statistics.fmean(values), 3) if values else None

    curve = [[r["step"], round(r["eval/mean_reward"], 4)] for r in rows if "eval/mean_reward" in r]
    return {
        **to_target(rows, target),
        "curve": curve,
        "final_eval": curve[-1][1] if curve else None,
        "median_iteration_s": round(statistics.median(r["time/iteration_s"] for r in rows[1:] or rows), 3),
        "candidates_scored_per_window": mean("explore/candidates_scored"),
        "prompts_selected_per_iteration": mean("explore/prompts_selected"),
        "late_prompts_per_iteration": mean("explore/fallback_late"),
        "staleness": mean("explore/staleness"),
        "emulated_wait_s_per_iteration": mean("time/emulated_explore_s"),
    }


def spread(values: list[float | None]) -> dict:
    """Median and range of the values that exist, and how many did not."""
    have = [v for v in values if v is not None]
    return {
        "median": round(statistics.median(have), 3) if have else None,
        "range": [round(min(have), 3), round(max(have), 3)] if have else None,
        "per_seed": [None if v is None else round(v, 3) for v in values],
        "unreached": len(values) - len(have),
    }


def ratios(num: list[dict], den: list[dict], key: str) -> dict:
    """Per seed num[key] / den[key], with their median and range."""
    return spread([a[key] / b[key] if a[key] is not None and b[key] else None for a, b in zip(num, den)])


def figures(runs: dict[str, list[dict]], nodes: list[int]) -> dict:
    """The JSON's named figures from the runs of every mode (key "stale@k" for each k)."""
    out: dict = {}
    none = runs.get("none")
    main_k = nodes[-1] if len(nodes) == 1 else (4 if 4 in nodes else nodes[-1])
    stale = runs.get(f"stale@{main_k}")
    if none and stale:
        out["iterations_ratio_none_over_stale"] = ratios(none, stale, "iterations")
        out["wall_ratio_none_over_stale"] = ratios(none, stale, "wall_s")
        stales = [r["staleness"] for r in stale if r["staleness"] is not None]
        out["staleness"] = round(statistics.fmean(stales), 3) if stales else None
    if runs.get("none_all_cores") and stale:
        out["wall_ratio_none_all_cores_over_stale"] = ratios(runs["none_all_cores"], stale, "wall_s")
    if none and runs.get("oracle"):
        out["oracle_iterations_ratio_none_over_oracle"] = ratios(none, runs["oracle"], "iterations")
    if none and len(nodes) > 1:
        out["iterations_ratio_none_over_stale_by_k"] = {
            str(k): ratios(none, runs[f"stale@{k}"], "iterations") for k in nodes if f"stale@{k}" in runs
        }
    if runs.get("stale@1") and runs.get("stale_real"):
        emu, real = runs["stale@1"], runs["stale_real"]
        out["emulation_check_k1"] = {
            "candidates_per_window_emulated_over_real": ratios(emu, real, "candidates_scored_per_window"),
            "iterations_ratio_real_over_emulated": ratios(real, emu, "iterations"),
        }
    out["emulated_spot_nodes"] = main_k
    return out


def finished(run_dir: Path, target: float, iterations: int) -> bool:
    """Whether a kept run directory holds a whole run: one that reached the target or ran every iteration."""
    if not (run_dir / "metrics.jsonl").exists():
        return False
    rows = read_metrics(run_dir)
    return bool(rows) and (to_target(rows, target)["reached"] or rows[-1]["step"] >= iterations)


def run_one(job: tuple[str, int, str, list[str], str, float]) -> dict:
    """Train one (mode, seed) run and summarise it (module level: a spawned process runs it). A run
    a --keep directory already holds whole is read, not trained again (a benchmark resumed)."""
    _name, seed, recipe, overrides, run_dir, target = job
    cfg = load_config(DiTRecipe, recipe, overrides)
    if not finished(Path(run_dir), target, cfg.train.num_iterations):
        run_training(cfg, run_dir, resume=False, progress=False)
    return {"seed": seed, **summarize_run(read_metrics(run_dir), target)}


def read_runs(root: Path, target: float) -> dict[str, list[dict]]:
    """The runs a --keep directory holds (NAME-seedS/metrics.jsonl), summarised against `target`."""
    runs: dict[str, list[dict]] = {}
    for run_dir in sorted(root.glob("*-seed*")):
        name, _, seed = run_dir.name.rpartition("-seed")
        if (run_dir / "metrics.jsonl").exists():
            runs.setdefault(name, []).append({"seed": int(seed), **summarize_run(read_metrics(run_dir), target)})
    for rs in runs.values():
        rs.sort(key=lambda r: r["seed"])
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="recipe overrides, key=value (every mode)")
    parser.add_argument("--recipe", default="configs/dit/tiny-shapes.yaml")
    parser.add_argument(
        "--modes", default="none,none_all_cores,stale,oracle", help=f"comma-separated, of {', '.join(MODES)}"
    )
    parser.add_argument(
        "--emulate-spot-nodes", default="4", help="k, or a comma-separated list of k (one stale run per k and seed)"
    )
    parser.add_argument("--seeds", type=int, default=3, help="training seeds per mode (train.seed 0..S-1)")
    parser.add_argument(
        "--iterations", type=int, default=40, help="iterations per run (the target may be reached earlier)"
    )
    parser.add_argument("--eval-every", type=int, default=2)
    parser.add_argument("--eval-seeds", type=int, default=4, help="samples per held-out prompt per evaluation")
    parser.add_argument("--target", type=float, default=None, help="held-out reward to reach (default: base + --gain)")
    parser.add_argument("--gain", type=float, default=0.05, help="target over the base's held-out reward")
    parser.add_argument(
        "--trainer-threads", type=int, default=1, help="the trainer's threads in none, stale and oracle"
    )
    parser.add_argument("--oracle-candidates", type=int, default=64)
    parser.add_argument(
        "--selection-override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a recipe override for the selecting modes only (stale, oracle, stale_real), repeatable: e.g. "
        "train.group_size=8 and train.prompts_per_iteration=32 select smaller groups while none keeps 16 x 16",
    )
    parser.add_argument(
        "--keep",
        default="",
        help="keep the run directories here (default: a temporary directory); "
        "runs it already holds whole are read, not trained again",
    )
    parser.add_argument(
        "--parallel",
        type=int,
        default=1,
        help="runs at a time, each on --trainer-threads threads (2 on 2 cores with one thread each: "
        "iterations to target are unaffected, wall figures then come from shared cores; "
        "none_all_cores uses every core and should run alone)",
    )
    parser.add_argument(
        "--from-runs",
        default="",
        help="no training: recompute the figures from the run directories a --keep "
        "left (NAME-seedS), e.g. for another --target",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="accepted for symmetry with the other benchmarks: stdout is always just the JSON line",
    )
    args = parser.parse_args()

    modes = args.modes.split(",")
    for mode in modes:
        mode_overrides(mode, nodes=1, trainer_threads=1, oracle_candidates=2, prompts=1)  # names a bad mode early
    nodes = [int(k) for k in args.emulate_spot_nodes.split(",")]
    common = [
        f"train.num_iterations={args.iterations}",
        "train.max_minutes=0",
        "train.lr_cooldown=0",
        f"eval.every={args.eval_every}",
        f"eval.num_seeds={args.eval_seeds}",
        "log.images_every=0",
        "log.checkpoint_every=100000",
        "log.wandb_mode=disabled",
        *args.overrides,
    ]
    cfg = load_config(DiTRecipe, args.recipe, common)
    selection_prompts = load_config(
        DiTRecipe, args.recipe, [*common, *args.selection_override]
    ).train.prompts_per_iteration
    base_eval = None
    target = args.target
    if args.from_runs:
        if target is None:
            raise SystemExit("--from-runs needs --target (the base's held-out reward is not in the run directories)")
        runs = read_runs(Path(args.from_runs), target)
        print(json.dumps({**figures(runs, nodes), "target": target, "from_runs": args.from_runs, "runs": runs}))
        return
    if target is None:
        policy = load_policy(cfg.model, trainable=False)
        prompts = train_and_eval_prompts(cfg.data, cfg.reward.weights)[1]
        summary, _ = evaluate(
            policy, prompts, build_reward(cfg.reward.weights, **cfg.reward.options()), cfg, progress=False
        )
        base_eval = round(summary["mean_reward"], 4)
        target = round(base_eval + args.gain, 4)
        print(f"base held-out {base_eval}, target {target}", file=sys.stderr)

    plan = [(m, k) for m in modes for k in (nodes if m == "stale" else [None])]
    # Alternate the order of the modes from seed to seed: drift of a shared host hits them alike.
    tasks = [(mode, k, seed) for seed in range(args.seeds) for mode, k in (plan if seed % 2 == 0 else plan[::-1])]
    runs: dict[str, list[dict]] = {}
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="time-to-target-") as tmp:
        root = Path(args.keep or tmp)
        jobs = []
        for mode, k, seed in tasks:
            name = f"{mode}@{k}" if k is not None else mode
            overrides = run_overrides(
                mode,
                common,
                args.selection_override,
                nodes=k or 1,
                trainer_threads=args.trainer_threads,
                oracle_candidates=args.oracle_candidates,
                prompts=selection_prompts,  # only the oracle's budget uses it, and the oracle selects
            )
            # A run ends at the evaluation that reaches the target (eval.stop_at), or after --iterations.
            overrides += [f"train.seed={seed}", f"eval.stop_at={target}"]
            jobs.append((name, seed, args.recipe, overrides, str(root / f"{name}-seed{seed}"), target))
        # With --parallel, several runs at once, each on its own threads (spawned processes: a fresh torch each).
        with (
            ProcessPoolExecutor(args.parallel, mp_context=multiprocessing.get_context("spawn"))
            if args.parallel > 1
            else nullcontext() as pool
        ):
            mapper = pool.map if pool is not None else map
            for (name, seed, *_), result in zip(jobs, mapper(run_one, jobs)):
                runs.setdefault(name, []).append(result)
                print(f"{name} seed {seed}: {json.dumps(result)}", file=sys.stderr)
    for name in runs:
        runs[name].sort(key=lambda r: r["seed"])

    print(
        json.dumps(
            {
                **figures(runs, nodes),
                "emulated": (
                    "explorer capacity of stale and oracle runs is emulated by time-slicing on this host "
                    "(spotlight/emulated.py)"
                ),
                "baseline": (
                    "none: the same trainer on default seeds, same threads; "
                    "none_all_cores: the same trainer on every core"
                ),
                "target": target,
                "base_eval": base_eval,
                "gain": args.gain,
                "seeds": args.seeds,
                "iterations_per_run": args.iterations,
                "eval_every": args.eval_every,
                "eval_seeds": args.eval_seeds,
                "trainer_threads": args.trainer_threads,
                "oracle_candidates": args.oracle_candidates,
                "overrides": args.overrides,
                "selection_overrides": args.selection_override,
                "parallel_runs": args.parallel,
                "benchmark_s": round(time.monotonic() - started, 1),
                "runs": runs,
            }
        )
    )


if __name__ == "__main__":
    main()
