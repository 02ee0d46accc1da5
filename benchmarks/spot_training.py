"""Training through preemptions: the tiny recipe with its rollouts on the spot runtime under a replayed
trace, against the same recipe with local rollouts, side by side in one run.

Three `spotlight train` runs of the tiny recipe (configs/dit/tiny-shapes.yaml), each in a process of
its own, for the same fixed number of iterations (`--iterations`, no time budget, explore.mode=none
unless `--explore`):

    local     runtime.rollouts=local: the trainer rolls out itself (the baseline, what a user of
              the trainer without the runtime runs)
    static    runtime.rollouts=cluster on a local cluster of fixed nodes (the on-demand worker on the
              trainer's node and runtime.spot_nodes spot nodes): no preemption
    trace     runtime.rollouts=cluster while a local cluster adds and kills spot nodes along the
              trace (`runtime.trace`: rescaled to `--nodes`, a `--window-s` stretch, compressed
              `--compress` times and replayed in a loop), with `--notice-s S` a notice S trace seconds
              ahead through each node's fake metadata endpoint

Reported (one JSON line with --json):

    preemptions                       spot nodes the trace run's runtime saw die
    preemptions_hitting_work          of which the ones that ended a lease with a job in flight
    lost_rollouts, duplicated_results rollout jobs never delivered / delivered twice (trace run)
    recomputed_steps_per_preemption   rollout steps lost over the preemptions that hit work: steps
                                      done after the job's last commit and the step in flight when
                                      the node died (the queue's accounting)
    jobs_resumed                      rollout jobs that needed more than one lease
    weights_equal_local               the final trainable weights of the trace run (and of the
                                      static run) equal the local run's, bit for bit
    iteration_time_ratio_cluster_over_local   median iteration time, static over local (iterations
                                      after the first two), and `where_time_goes`: the median of
                                      each phase in both runs

With `--explore`, the static and trace runs use explore.mode=stale as well, and a fourth run repeats
the trace run with explore.mode=none: `critical_path_ratio_stale_over_none` is the median iteration
time with exploration over without (both on the cluster under the trace), and `explore` gives the
exploration jobs' preemption accounting.

The window defaults per trace (`WINDOWS`) are chosen so that preemptions land on work: the run lasts
a few minutes, and the busiest stretch of each trace, compressed, brings several preemptions into
it (a preemption while the trainer updates finds the rollout workers idle).

    .venv/bin/python benchmarks/spot_training.py --trace traces/bamboo-g4dn-us-east-1c.csv --json
    .venv/bin/python benchmarks/spot_training.py --trace traces/parcae-p3-aws.csv --notice-s 120 --json
    .venv/bin/python benchmarks/spot_training.py --trace traces/parcae-aws-hh_55_65.jsonl --explore --json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

WINDOWS = {
    "bamboo-g4dn-us-east-1c.csv": {"nodes": 3, "window_s": 4800.0, "compress": 40.0},
    "parcae-p3-aws.csv": {"nodes": 3, "window_s": 9600.0, "compress": 80.0},
    "parcae-aws-hh_55_65.jsonl": {"nodes": 6, "window_s": 3600.0, "compress": 40.0},
}
"""Per shipped trace: peak spot nodes, stretch (trace seconds) and compression."""
DEFAULT_WINDOW = {"nodes": 3, "window_s": 2400.0, "compress": 40.0}


def train(run_dir: Path, overrides: list[str], timeout_s: float) -> list[dict]:
    """One `spotlight train` of the tiny recipe in a process of its own; its metrics rows."""
    from spotlight.tracking import read_metrics

    cmd = [sys.executable, "-m", "spotlight.cli", "train", str(REPO / "configs/dit/tiny-shapes.yaml"), *overrides, "--run-dir", str(run_dir)]
    env = dict(os.environ, WANDB_MODE="disabled")
    with open(run_dir.parent / f"{run_dir.name}.log", "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s, env=env, cwd=REPO)
    if proc.returncode:
        tail = (run_dir.parent / f"{run_dir.name}.log").read_text()[-3000:]
        raise RuntimeError(f"{run_dir.name} run failed ({proc.returncode}):\n{tail}")
    return read_metrics(run_dir)


def final_weights(run_dir: Path, step: int) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "checkpoints" / f"step-{step:08d}" / "trainable.safetensors"))


def same_weights(a: dict, b: dict) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def median_of(rows: list[dict], key: str, skip: int = 2) -> float | None:
    values = [r[key] for r in rows[skip:] if key in r]
    return round(statistics.median(values), 4) if values else None


PHASES = ("time/iteration_s", "time/rollout_s", "time/reward_s", "time/update_s", "time/explore_s",
          "time/rollout_publish_submit_s", "time/rollout_wait_s", "time/rollout_assemble_s")  # fmt: skip


def runtime_figures(rows: list[dict], kind: str = "rollout") -> dict:
    """The runtime's accounting at the end of a run (its metrics are running totals)."""
    last = rows[-1]
    hits = last.get("runtime/preemptions_hitting_work_total", 0)
    lost_steps = last.get(f"runtime/{kind}_steps_recomputed_total", 0)
    return {
        "preemptions": last.get("runtime/preemptions_total", 0),
        "preemptions_hitting_work": hits,
        "submitted": last.get(f"runtime/{kind}_jobs_submitted_total", 0),
        "delivered": last.get(f"runtime/{kind}_jobs_done_total", 0),
        "cancelled": last.get(f"runtime/{kind}_jobs_cancelled_total", 0),
        "duplicated_results": last.get("runtime/duplicated_results_total", 0),
        "jobs_resumed": last.get(f"runtime/{kind}_jobs_resumed_total", 0),
        "leases_revoked": last.get(f"runtime/{kind}_leases_revoked_total", 0),
        "leases_released": last.get(f"runtime/{kind}_leases_released_total", 0),
        "steps_recomputed": lost_steps,
        "recomputed_steps_per_preemption": round(lost_steps / hits, 3) if hits else None,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", type=Path, required=True, help="trace file (any format spot.traces reads)")
    p.add_argument("--notice-s", type=float, default=0.0, help="notice lead in trace seconds (0: no notice)")
    p.add_argument("--iterations", type=int, default=24, help="training iterations of every run")
    p.add_argument("--nodes", type=int, default=None, help="peak spot nodes (default: WINDOWS)")
    p.add_argument("--window-s", type=float, default=None, help="stretch of the trace, trace seconds (default: WINDOWS)")
    p.add_argument("--compress", type=float, default=None, help="trace seconds per wall second (default: WINDOWS)")
    p.add_argument("--spot-nodes", type=int, default=1, help="spot nodes of the static run")
    p.add_argument("--explore", action="store_true", help="stale exploration on the cluster runs, and a run without it")
    p.add_argument("--timeout-s", type=float, default=1800.0, help="give up a run after this long")
    p.add_argument("--keep", type=Path, default=None, help="keep the run directories here")
    p.add_argument("--json", action="store_true", help="print only the JSON line")
    p.add_argument("overrides", nargs="*", help="more recipe overrides, key=value, for every run")
    args = p.parse_args()

    window = {**DEFAULT_WINDOW, **WINDOWS.get(args.trace.name, {})}
    for key in ("nodes", "window_s", "compress"):
        if getattr(args, key) is not None:
            window[key] = getattr(args, key)
    n = args.iterations
    common = [
        f"train.num_iterations={n}", "train.max_minutes=0", "log.wandb_mode=disabled", "log.images_every=0",
        f"log.checkpoint_every={n}", *args.overrides,
    ]  # fmt: skip
    explore = ["explore.mode=stale"] if args.explore else []
    cluster = ["runtime.rollouts=cluster"]
    trace = [
        f"runtime.trace={args.trace.resolve()}", f"runtime.trace_nodes={window['nodes']}",
        f"runtime.trace_window_s={window['window_s']}", f"runtime.trace_compress={window['compress']}",
        f"runtime.trace_notice_s={args.notice_s}",
    ]  # fmt: skip
    runs = {
        "local": common,
        "static": [*common, *cluster, f"runtime.spot_nodes={args.spot_nodes}", *explore],
        "trace": [*common, *cluster, *trace, *explore],
    }
    if args.explore:
        runs["trace_none"] = [*common, *cluster, *trace]
    root = args.keep or Path(tempfile.mkdtemp(prefix="spot-training-"))
    root.mkdir(parents=True, exist_ok=True)
    rows = {}
    for name, overrides in runs.items():
        if not args.json:
            print(f"{name}: spotlight train ... {' '.join(overrides[len(common):])}", file=sys.stderr)
        rows[name] = train(root / name, overrides, args.timeout_s)
        if not args.json:
            print(f"{name}: median iteration {median_of(rows[name], 'time/iteration_s')} s", file=sys.stderr)

    local_w = final_weights(root / "local", n)
    t = runtime_figures(rows["trace"])
    where = {k.removeprefix("time/"): {name: median_of(rows[name], k) for name in ("local", "static")} for k in PHASES}
    where = {k: v for k, v in where.items() if any(x is not None for x in v.values())}
    result = {
        "trace": args.trace.name,
        "notice_s": args.notice_s,
        "iterations": n,
        "window": window,
        "explore": "stale" if args.explore else "none",
        "baseline": "the same recipe with runtime.rollouts=local (the trainer rolls out itself)",
        "preemptions": t["preemptions"],
        "preemptions_hitting_work": t["preemptions_hitting_work"],
        "lost_rollouts": t["submitted"] - t["delivered"] - t["cancelled"],
        "duplicated_results": t["duplicated_results"],
        "recomputed_steps_per_preemption": t["recomputed_steps_per_preemption"],
        "jobs_resumed": t["jobs_resumed"],
        "weights_equal_local": same_weights(final_weights(root / "trace", n), local_w),
        "weights_equal_local_static": same_weights(final_weights(root / "static", n), local_w),
        "iteration_time_ratio_cluster_over_local": round(median_of(rows["static"], "time/iteration_s") / median_of(rows["local"], "time/iteration_s"), 3),
        "where_time_goes": where,
        "trace_run": t,
        "runs_dir": str(root),
    }
    if args.explore:
        result["critical_path_ratio_stale_over_none"] = round(
            median_of(rows["trace"], "time/iteration_s") / median_of(rows["trace_none"], "time/iteration_s"), 3
        )
        e = runtime_figures(rows["trace"], "explore")
        e["yielded_to_rollouts"] = rows["trace"][-1].get("runtime/explore_leases_yielded_total", 0)
        e["prompts_selected_per_iteration"] = median_of(rows["trace"], "explore/prompts_selected")
        e["fallback_late_per_iteration"] = median_of(rows["trace"], "explore/fallback_late")
        result["explore_jobs"] = e
        result["weights_equal_local"] = None  # stale exploration picks its seeds by timing: not comparable
        result["weights_equal_local_static"] = None
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
