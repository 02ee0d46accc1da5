"""`spotlight simulate`: cost and time to target of each policy on a spot trace, at any scale.

    spotlight simulate --trace traces/parcae-p3-aws.csv --profile qwen-image-512 --trainer-gpus 4 --spot-gpus 8
    spotlight simulate --synthetic --profile-from-run runs/tiny-shapes --json

Writes OUT/simulation.json and PNG plots (progress.png, cost_time.png, spot_timeline.png) and prints a
table (or, with --json, one JSON line).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

from spot.sim.policies import POLICIES


def add_subcommands(sub) -> None:
    help_text = "Simulate a post-training run on on-demand + spot GPUs: cost and time to target per policy."
    p = sub.add_parser("simulate", help=help_text, description=help_text)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", type=Path, help="spot trace (parcae csv/jsonl, bamboo csv, skypilot json)")
    src.add_argument("--synthetic", action="store_true", help="a seeded synthetic trace instead")
    prof = p.add_mutually_exclusive_group()
    prof.add_argument(
        "--profile",
        default="qwen-image-512",
        help="built-in profile (qwen-image-512, qwen-image-1280) or a YAML/JSON file",
    )
    prof.add_argument(
        "--profile-from-run", type=Path, metavar="RUN_DIR", help="measure the profile from a run directory"
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="change a profile field, e.g. --set node_startup_s=5 (repeatable)",
    )
    p.add_argument(
        "--trainer-gpus", type=int, default=4, help="on-demand trainer GPUs of spotlight / disaggregated (default 4)"
    )
    p.add_argument("--spot-gpus", type=int, default=8, help="peak spot GPUs: the trace is rescaled to it (default 8)")
    p.add_argument("--baseline-gpus", type=int, help="on-demand GPUs of ondemand / inline (default: trainer + spot)")
    p.add_argument("--policies", default=",".join(POLICIES), help=f"comma list of {', '.join(POLICIES)}")
    p.add_argument("--planner", default="bandit", help="exploration planner (bandit, uniform, greedy)")
    p.add_argument(
        "--planner-family",
        default="",
        metavar="SPEC",
        help="the bandit's prompt families, as explore.planner_family: '' (one), shapes_counts, matches:REGEX",
    )
    p.add_argument(
        "--reward-table", type=Path, help="reward table of a real run (.npz/.json); default: a synthetic one"
    )
    p.add_argument("--on-demand-price", type=float, default=4.0, help="USD per on-demand GPU-hour (default 4.0)")
    p.add_argument(
        "--spot-discount", type=float, default=0.7, help="spot price = on-demand x (1 - discount) (default 0.7)"
    )
    p.add_argument(
        "--spot-price-history",
        type=Path,
        help="JSON [[seconds from start, USD per GPU-hour], ...] instead of the discount",
    )
    p.add_argument("--notice-s", type=float, default=0.0, help="give every preemption a notice this many seconds ahead")
    p.add_argument("--no-elastic", action="store_true", help="SP groups restart cold after a loss")
    p.add_argument("--no-handoff", action="store_true", help="no tail hand-off in the pull queue")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("simulation"), help="output folder (default: ./simulation)")
    p.add_argument("--json", action="store_true", help="print one JSON line")
    p.set_defaults(fn=cmd_simulate, items=[], loads_models=False)


def load_spot_prices(path: Path) -> list[list[float]]:
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"--spot-price-history {path}: {err}") from None
    ok = (
        isinstance(doc, list)
        and doc
        and all(isinstance(r, list) and len(r) == 2 and all(isinstance(x, (int, float)) for x in r) for r in doc)
    )
    if not ok:
        raise ValueError(f"--spot-price-history {path}: expected [[seconds, usd_per_gpu_hour], ...]")
    return sorted([float(t), float(u)] for t, u in doc)


def build_setup(args: argparse.Namespace):
    from planners import load_reward_table, synthetic_reward_table
    from spot.sim.policies import Setup
    from spot.sim.profile import load_profile, profile_from_dict, profile_from_run
    from spot.traces import load_trace, synthetic_trace

    if args.spot_gpus < 1 or args.trainer_gpus < 1:
        raise ValueError("--spot-gpus and --trainer-gpus must be >= 1")
    profile = (
        profile_from_run(args.profile_from_run, trainer_gpus=1) if args.profile_from_run else load_profile(args.profile)
    )
    if args.set:
        changes = {}
        for item in args.set:
            key, sep, raw = item.partition("=")
            if not sep:
                raise ValueError(f"--set {item!r}: use FIELD=VALUE")
            changes[key.strip()] = yaml.safe_load(raw)
        profile = profile_from_dict({**profile.to_dict(), **changes}, where="--set")
    if args.synthetic:
        # About one preemption per node every two hours, replaced 10 minutes later.
        trace = synthetic_trace(
            num_nodes=args.spot_gpus,
            duration_s=12 * 3600,
            preemptions_per_node_hour=0.5,
            replacement_delay_s=600.0,
            seed=args.seed,
        )
    else:
        if not args.trace.is_file():
            raise ValueError(f"--trace {args.trace}: no such file")
        trace = load_trace(args.trace).trimmed().rescaled(args.spot_gpus)
    if args.notice_s > 0:
        trace = trace.with_notices(args.notice_s)
    if args.reward_table:
        table = load_reward_table(args.reward_table)
    else:
        table = synthetic_reward_table(
            seed=args.seed, prompts_per_iteration=profile.prompts_per_iteration, group_size=profile.group_size
        )
    return Setup(
        profile=profile,
        trace=trace,
        table=table,
        trainer_gpus=args.trainer_gpus,
        baseline_gpus=args.baseline_gpus or args.trainer_gpus + args.spot_gpus,
        on_demand_usd_per_gpu_hour=args.on_demand_price,
        spot_prices=load_spot_prices(args.spot_price_history) if args.spot_price_history else None,
        spot_discount=args.spot_discount,
        planner=args.planner,
        planner_family=args.planner_family,
        elastic=not args.no_elastic,
        handoff=not args.no_handoff,
        seed=args.seed,
    )


def run_policies(setup, policies: list[str], *, quiet: bool = False) -> dict:
    from rich.progress import Progress

    from spot.sim.policies import simulate

    results = {}
    with Progress(disable=quiet, transient=True) as bar:
        for name in policies:
            task = bar.add_task(f"simulating {name}", total=1.0)
            results[name] = simulate(
                name, setup, progress_cb=lambda _n, _k, frac, task=task: bar.update(task, completed=min(frac, 1.0))
            )
    return results


def cmd_simulate(args: argparse.Namespace) -> int:
    from spot.sim.plots import write_outputs

    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    for name in policies:
        if name not in POLICIES:
            raise ValueError(f"--policies: unknown policy {name!r}; policies: {', '.join(POLICIES)}")
    setup = build_setup(args)
    results = run_policies(setup, policies, quiet=args.json)
    doc = write_outputs(args.out, results, setup)
    if args.json:
        print(json.dumps(doc["policies"]))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{setup.profile.name} on {doc['trace']}")
    cols = ("policy", "hours", "USD", "cost ratio", "time ratio", "spot util.", "lost GPU-h", "preemptions")
    for c in cols:
        table.add_column(c, justify="left" if c == "policy" else "right")
    for name, row in doc["policies"].items():
        util = row["spot_utilisation"]
        table.add_row(
            name,
            f"{row['wall_s'] / 3600:.1f}",
            f"{row['cost_usd']:,.0f}",
            f"{row.get('cost_ratio_vs_ondemand') or 0:.2f}",
            f"{row.get('time_to_target_ratio_vs_ondemand') or 0:.2f}",
            "-" if util is None else f"{util:.0%}",
            f"{row['work_lost_gpu_s'] / 3600:.2f}",
            str(row["preemptions"]),
        )
    Console().print(table)
    print(
        f"ratios are on-demand only ({setup.baseline_gpus} GPUs) over each policy; outputs in {args.out}/",
        file=sys.stderr,
    )
    return 0
