"""Pull vs push in the simulator, in benchmarks/preemption_replay.py's trace setting, to set beside it.

The trace is fitted as preemption_replay.py fits it (same options; rescaled to `--nodes`, the
busiest `--window-s` stretch, compressed), the job count is sized the same way, and the
workers step at `--step-s / speed` plus the per-step overhead and start up / are declared dead as
measured by benchmarks/calibrate_simulator.py on this machine (`--overhead-s`, `--startup-s`,
`--detect-s`). `spot.sim.engine.Cluster` then runs the jobs through the real `JobQueue` under pull
(with tail hand-off) and push (least-loaded at submission, as `spot.runtime`'s); each figure is the
mean over `--sim-samples` step-jittered simulations. Unlike the replay, all jobs are submitted at
once (no waves), the step time is this script's `--step-s` (the replay's default job is the
paper-scale one, `--job`), the window is 2,400 s, and there is no Ray-retries baseline. Prints one
JSON line per trace:

    {"trace": ..., "jobs": ..., "wall_s": {"pull": ..., "push": ...}, "throughput_ratio_pull_vs_push": ...,
     "empty_fraction": share of the window with no spot node up}

    .venv/bin/python benchmarks/simulate_replay.py --all
    .venv/bin/python benchmarks/simulate_replay.py --trace traces/bamboo-g4dn-us-east-1c.csv --window-s 4800
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

from preemption_replay import add_replay_arguments, fit_trace, node_speed, size_jobs
from simulate_paper import SHIPPED

from spot.jobqueue import Job
from spot.sim.engine import Cluster, EventLoop
from spot.sim.profile import Profile


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", type=Path, help="trace file")
    src.add_argument("--synthetic", action="store_true", help="preemption_replay.py's synthetic trace")
    src.add_argument("--all", action="store_true", help="every shipped trace, then the synthetic one")
    add_replay_arguments(p)
    p.add_argument("--start-s", type=float, default=None, help="start of the stretch; default: the busiest")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--overhead-s", type=float, default=0.004, help="per-step overhead over --step-s (measured ~0.002-0.008)"
    )
    p.add_argument("--startup-s", type=float, default=5.0, help="node add -> worker ready (measured 4.6-5.6 s)")
    p.add_argument(
        "--detect-s", type=float, default=1.5, help="preemption -> worker declared dead (measured 1.3-1.6 s)"
    )
    p.add_argument("--sim-samples", type=int, default=8)
    args = p.parse_args()
    logging.disable(logging.INFO)  # fit_trace logs the trace summary
    sources = [ROOT / "traces" / n for n in SHIPPED] + [None] if args.all else [None if args.synthetic else args.trace]
    for src in sources:
        args.trace, args.synthetic = src, src is None
        print(json.dumps(one(args)), flush=True)


def one(args) -> dict:
    speeds = [float(s) for s in args.speeds.split(",")]
    trace = fit_trace(args)
    num_jobs = args.jobs or size_jobs(trace, speeds, args)
    profile = Profile(
        name="replay",
        prompts_per_iteration=1,
        group_size=2,
        num_steps=args.steps,
        samples_per_job=1,
        job_step_s=args.step_s + args.overhead_s,
        reward_gpu_s_per_sample=0.0,
        update_gpu_s=0.0,
        iterations_to_target=1,
        node_startup_s=args.startup_s,
        detect_s=args.detect_s,
        poll_s=0.1,
        commit_every=args.commit_every,
    )
    walls = {}
    for scheduler in ("pull", "push"):
        runs = []
        for seed in range(args.sim_samples):
            loop = EventLoop()
            cluster = Cluster(
                loop,
                profile,
                trace,
                on_demand_gpus=0,
                wrap=False,
                initial_ready=True,
                node_speed=lambda name: node_speed(name, speeds),
                step_jitter=0.1,
                seed=seed,
            )
            res = cluster.run_phase(
                [Job(i, num_steps=args.steps) for i in range(num_jobs)], args.steps, pools=(True,), scheduler=scheduler
            )
            runs.append(res.end_s - res.start_s)
        walls[scheduler] = statistics.mean(runs)
    steps = trace.availability() + [(trace.duration_s, 0)]
    empty = sum(b[0] - a[0] for a, b in zip(steps, steps[1:]) if a[1] == 0) / trace.duration_s
    return {
        "baseline": "the simulator's least-loaded push (a lost worker's jobs pushed again from their last commit)",
        "trace": "synthetic" if args.synthetic else args.trace.name,
        "window_s": args.window_s,
        "jobs": num_jobs,
        "wall_s": {k: round(v, 2) for k, v in walls.items()},
        "throughput_ratio_pull_vs_push": round(walls["push"] / walls["pull"], 3),
        "empty_fraction": round(empty, 3),
    }


if __name__ == "__main__":
    main()
