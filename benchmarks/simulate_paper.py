"""Paper-scale simulation: cost and time to target of Spotlight against on-demand only, per trace.

For each trace and each cluster size (default: 4 on-demand + 8 spot GPUs, and 8 + 24 = 32 GPUs),
`spot.sim` simulates the Qwen-Image 512 profile (`spot/sim/profile.py`, every value's assumption
written there) under the policies on-demand only, inline exploration, Spotlight and disaggregated
rollout, with the real bandit planner choosing candidates from the reward table of a real tiny run
(benchmarks/data/tiny-shapes-rewards.npz), and the measured learning model: what seed selection
saves in iterations to the target, measured on the tiny recipe over 3 training seeds
(benchmarks/data/exploration-iterations.json; the profile's selection_iterations_ratio and
stale_gain_share, spot/sim/policies.py). Spot GPUs cost the on-demand price times (1 - discount),
70% off by default. Two on-demand baselines, since the paper's is not pinned down:

    same GPUs       on-demand only with as many GPUs as Spotlight holds at peak (trainer + spot)
    trainer GPUs    on-demand only with Spotlight's trainer GPUs alone (what spot capacity is added to)

What the figures show: time and cost to the target under that learning model, on the trace's
spot capacity, with paper-scale phase times that are assumptions (spot/sim/profile.py). What they
do not show: that a Qwen-Image run gains per iteration what the tiny recipe gains; the sensitivity
table gives the ratios over the learning model (1.0: selection saves nothing; 1.222: what one
explorer node gave; the measured oracle; 2.0) and over the spot discount.

Prints one JSON line per trace:
    {"trace": ..., "baseline": ..., "cost_ratio_vs_ondemand": ..., "time_ratio_vs_ondemand": ...,
     "spot_utilisation": ...,                        # Spotlight at the first size, same-GPUs baseline
     "learning_model": {...}, "sensitivity": [{"selection_iterations_ratio", "spot_discount",
     "cost_ratio_vs_ondemand", "time_ratio_vs_ondemand"}, ...],   # first size, same-GPUs baseline
     "sizes": {"4+8": {...per baseline and policy...}, "8+24": {...}}}

    .venv/bin/python benchmarks/simulate_paper.py --trace traces/parcae-p3-aws.csv --json
    .venv/bin/python benchmarks/simulate_paper.py --all --json          # every shipped trace
    .venv/bin/python benchmarks/simulate_paper.py --all --profile qwen-image-1280 --json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planners import load_reward_table
from spot.sim import POLICIES, Setup, compare, load_profile, simulate
from spot.traces import load_trace

SHIPPED = ("parcae-p3-aws.csv", "parcae-aws-hh_55_65.jsonl", "bamboo-g4dn-us-east-1c.csv")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", type=Path, action="append", help="trace file (repeatable)")
    src.add_argument("--all", action="store_true", help="every trace shipped in traces/")
    p.add_argument("--profile", default="qwen-image-512", help="built-in profile or profile file")
    p.add_argument("--sizes", default="4+8,8+24", help="trainer+spot GPU counts, comma separated")
    p.add_argument("--spot-discount", type=float, default=0.7)
    p.add_argument("--table", type=Path, default=ROOT / "benchmarks/data/tiny-shapes-rewards.npz")
    p.add_argument(
        "--sensitivity-ratios",
        default="1.0,1.222,measured,2.0",
        help="selection_iterations_ratio values of the sensitivity table ('measured': the profile's)",
    )
    p.add_argument("--sensitivity-discounts", default="0.0,0.5,0.7", help="spot discounts of the sensitivity table")
    p.add_argument("--json", action="store_true", help="only the JSON lines")
    args = p.parse_args()
    traces = [ROOT / "traces" / name for name in SHIPPED] if args.all else args.trace
    profile = load_profile(args.profile)
    table = load_reward_table(args.table)
    sizes = [tuple(int(x) for x in s.split("+")) for s in args.sizes.split(",")]
    for path in traces:
        line, first = one_trace(path, profile, table, sizes, args.spot_discount)
        ratios = [
            profile.selection_iterations_ratio if r == "measured" else float(r)
            for r in args.sensitivity_ratios.split(",")
        ]
        line["sensitivity"] = sensitivity(
            path,
            profile,
            table,
            sizes[0],
            args.spot_discount,
            ratios,
            [float(d) for d in args.sensitivity_discounts.split(",")],
            first,
        )
        if not args.json:
            for size, row in line["sizes"].items():
                s = row["same_gpus"]["spotlight"]
                print(
                    f"{path.name} {size}: cost x{s['cost_ratio_vs_ondemand']}, "
                    f"time x{s['time_to_target_ratio_vs_ondemand']} (>1: faster), "
                    f"vs trainer GPUs only: cost x{row['trainer_gpus']['spotlight']['cost_ratio_vs_ondemand']}, "
                    f"time x{row['trainer_gpus']['spotlight']['time_to_target_ratio_vs_ondemand']}",
                    file=sys.stderr,
                )
        print(json.dumps(line), flush=True)


def one_trace(path: Path, profile, table, sizes, discount: float) -> tuple[dict, dict]:
    """The JSON line of one trace, and the first size's simulated on-demand and Spotlight results."""
    full = load_trace(path).trimmed()
    out = {"trace": path.name, "profile": profile.name, "spot_discount": discount, "sizes": {}}
    kept = {}
    for trainer, spot in sizes:
        trace = full.rescaled(spot)
        setup = Setup(
            profile=profile,
            trace=trace,
            table=table,
            trainer_gpus=trainer,
            baseline_gpus=trainer + spot,
            spot_discount=discount,
        )
        results = {name: simulate(name, setup) for name in POLICIES}
        kept = kept or {"ondemand": results["ondemand"], "spotlight": results["spotlight"]}
        same = compare(results)
        # The trainer-only baseline: on-demand with the trainer GPUs alone.
        small = Setup(**{**setup.__dict__, "baseline_gpus": trainer})
        trainer_only = compare(
            {"ondemand": simulate("ondemand", small), **{k: v for k, v in results.items() if k != "ondemand"}}
        )
        keys = (
            "cost_ratio_vs_ondemand",
            "time_to_target_ratio_vs_ondemand",
            "spot_utilisation",
            "wall_s",
            "cost_usd",
            "iterations",
            "preemptions",
            "work_lost_gpu_s",
            "fallback_prompts",
            "mean_budget_samples",
        )
        out["sizes"][f"{trainer}+{spot}"] = {
            "same_gpus": {n: {k: r.get(k) for k in keys} for n, r in same.items()},
            "trainer_gpus": {n: {k: r.get(k) for k in keys[:3]} for n, r in trainer_only.items()},
        }
    first = out["sizes"][f"{sizes[0][0]}+{sizes[0][1]}"]["same_gpus"]["spotlight"]
    return {
        "trace": out["trace"],
        "baseline": (
            f"on-demand only, {sizes[0][0] + sizes[0][1]} GPUs (as many as Spotlight holds at peak), random seeds"
        ),
        "cost_ratio_vs_ondemand": first["cost_ratio_vs_ondemand"],
        "time_ratio_vs_ondemand": first["time_to_target_ratio_vs_ondemand"],
        "spot_utilisation": first["spot_utilisation"],
        "learning_model": {
            "selection_iterations_ratio": profile.selection_iterations_ratio,
            "stale_gain_share": profile.stale_gain_share,
            "source": "benchmarks/data/exploration-iterations.json (tiny recipe, 3 seeds, emulated explorer capacity)",
        },
        **{k: v for k, v in out.items() if k != "trace"},
    }, kept


def sensitivity(
    path: Path,
    profile,
    table,
    size: tuple[int, int],
    discount: float,
    ratios: list[float],
    discounts: list[float],
    first: dict,
) -> list[dict]:
    """Spotlight against same-GPUs on-demand at the first size, over the learning model's ratio and
    the spot discount. The discount changes only the spot bill (the simulation is the same), so each
    ratio is simulated once and its spot cost rescaled by (1 - d) / (1 - discount). `first`: the
    results `one_trace` simulated at the profile's own ratio (on-demand does not depend on it)."""
    trainer, spot = size
    trace = load_trace(path).trimmed().rescaled(spot)
    rows = []
    base = first["ondemand"]  # random seeds: the learning model does not change it
    for ratio in ratios:
        prof = dataclasses.replace(profile, selection_iterations_ratio=ratio)
        setup = Setup(
            profile=prof,
            trace=trace,
            table=table,
            trainer_gpus=trainer,
            baseline_gpus=trainer + spot,
            spot_discount=discount,
        )
        s = first["spotlight"] if ratio == profile.selection_iterations_ratio else simulate("spotlight", setup)
        for d in discounts:
            cost = s.cost_on_demand_usd + s.cost_spot_usd * (1 - d) / (1 - discount)
            rows.append(
                {
                    "selection_iterations_ratio": ratio,
                    "spot_discount": d,
                    "iterations": s.iterations,
                    "cost_ratio_vs_ondemand": round(base.cost_usd / cost, 4),
                    "time_ratio_vs_ondemand": round(base.wall_s / s.wall_s, 4),
                }
            )
    return rows


if __name__ == "__main__":
    main()
