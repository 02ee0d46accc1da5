"""Training through preemptions: the tiny recipe with its rollouts on the spot runtime under a replayed
trace, against the same recipe with local rollouts, side by side in one run.

`spotlight train` runs of the tiny recipe (configs/dit/tiny-shapes.yaml), each in a process of its
own, for the same fixed number of iterations (`--iterations`, no time budget, explore.mode=none):

    local     runtime.rollouts=local: the trainer rolls out itself (the baseline, what a user of
              the trainer without the runtime runs)
    static    runtime.rollouts=cluster on a local cluster of fixed nodes (the on-demand worker on the
              trainer's node and `--spot-nodes` spot nodes): no preemption
              (local and static alternate `--pairs` times: the machine's speed drifts by 10-20%
              over minutes, and one run of each would measure the drift)
    traceK    one per trace and notice lead: runtime.rollouts=cluster while a local cluster adds and
              kills spot nodes along the trace (`runtime.trace`: rescaled to `--nodes`, a
              `--window-s` stretch, compressed `--compress` times and replayed in a loop), with
              `--notice-s S` > 0 a notice S trace seconds ahead through each node's fake metadata
              endpoint
    explore_noneI, exploreI   with `--explore`: the first trace at the first notice lead, with
              explore.mode=none and with stale, alternated `--explore-pairs` times (exploration
              jobs on the spot workers, at a lower priority), all with `--explore-layout`: by
              default the spot nodes' processes on one CPU of their own, the trainer and its
              on-demand worker on the other (runtime.local_cluster_cpus=1 train.num_threads=1), so
              that explorers do not compute on the trainer's CPU, as on separate machines (emulated)

One JSON line per trace and notice lead (the local and static runs are shared):

    preemptions                       spot nodes the trace run's runtime saw die
    preemptions_hitting_work          of which the ones that ended a lease with a job in flight (a
                                      kill, or a notice that made the worker commit and hand it back)
    lost_rollouts, duplicated_results rollout jobs never delivered / delivered twice (trace run)
    recomputed_steps_per_preemption   rollout steps lost over the preemptions that hit work: steps
                                      done after the job's last commit and the step in flight when
                                      the node died (the queue's accounting)
    jobs_resumed                      rollout jobs that needed more than one lease
    weights_equal_local               the final trainable weights of the trace run (and of the
                                      static run) equal the local run's, bit for bit
    iteration_time_ratio_cluster_over_local   median iteration time, static over local (iterations
                                      after the first two), the median over the pairs (each pair's
                                      in `..._pairs`), and `where_time_goes`: the median of each
                                      phase over the runs of each kind
    explore                           with `--explore`: `critical_path_ratio_stale_over_none`, the
                                      median iteration time of the explore run over explore_none
                                      (same trace, same layout) per pair, their median and range,
                                      with the update and rollout phases of each; nothing lost; what
                                      the explorers scored and selected; the exploration jobs'
                                      accounting (preempted ones: leases revoked and steps lost)

The window defaults per trace (`WINDOWS`) are chosen so that preemptions land on work: the run lasts
a few minutes, and the busiest stretch of each trace, compressed, brings several preemptions into
it (a preemption while the trainer updates finds the rollout workers idle). The runs share 2 cores:
the spot nodes are processes on this machine (emulated capacity, time-sliced with the trainer,
except in the exploration runs' layout).

    .venv/bin/python benchmarks/spot_training.py --trace traces/*.csv traces/*.jsonl --notice-s 0 120 --explore --json
    .venv/bin/python benchmarks/spot_training.py --trace traces/parcae-p3-aws.csv --notice-s 120 --json
    .venv/bin/python benchmarks/spot_training.py --trace traces/*.csv traces/*.jsonl --plan-only 200
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

WINDOWS = {
    "bamboo-g4dn-us-east-1c.csv": {"nodes": 4, "window_s": 9600.0, "compress": 80.0},
    "parcae-p3-aws.csv": {"nodes": 5, "window_s": 3600.0, "compress": 80.0},
    "parcae-aws-hh_55_65.jsonl": {"nodes": 6, "window_s": 3600.0, "compress": 80.0},
}
"""Per shipped trace: peak spot nodes, stretch (trace seconds) and compression. Chosen so that about
10 nodes live past their worker's start-up (7-10 s) and die within the run's first 200 s: a
preemption hits work only if the node's worker is up and holds a rollout job (about half of an
iteration), so the run sees several hits on every trace (`--plan-only` prints these counts)."""
WORKER_READY_S = 10.0
"""A local spot node's worker serves jobs about this long after the node is added (docs/spot.md)."""


def window_plan(trace, run_s: float, ready_s: float = WORKER_READY_S) -> dict:
    """What the looped, compressed `trace` does in a run's first `run_s` wall seconds: preemptions,
    and those of nodes that lived past `ready_s` (the ones that can hit work)."""
    preempts = ready = loops = 0
    offset = 0.0
    while offset < run_s:
        added: dict[str, float] = {}
        for ev in trace.events:
            t = ev.t_s + offset
            if t > run_s:
                break
            if ev.kind == "add":
                added[ev.node_id] = t
            elif ev.kind == "preempt":
                preempts += 1
                ready += ev.node_id in added and t - added[ev.node_id] > ready_s
        offset += trace.duration_s
        loops += 1
    return {
        "run_s": run_s,
        "trace_loop_s": round(trace.duration_s, 1),
        "loops": loops,
        "preemptions": preempts,
        "preemptions_of_ready_nodes": ready,
    }


DEFAULT_WINDOW = {"nodes": 3, "window_s": 2400.0, "compress": 40.0}


def train(run_dir: Path, overrides: list[str], timeout_s: float) -> list[dict]:
    """One `spotlight train` of the tiny recipe in a process of its own; its metrics rows."""
    from spotlight.core.tracking import read_metrics

    cmd = [
        sys.executable,
        "-m",
        "spotlight.cli",
        "train",
        str(REPO / "configs/dit/tiny-shapes.yaml"),
        *overrides,
        "--run-dir",
        str(run_dir),
    ]
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


PHASES = (
    "time/iteration_s",
    "time/rollout_s",
    "time/reward_s",
    "time/update_s",
    "time/explore_s",
    "time/rollout_publish_submit_s",
    "time/rollout_wait_s",
    "time/rollout_assemble_s",
)


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


def explore_figures(
    names: list[tuple[str, str]], pairs: list[tuple[list[dict], list[dict]]], layout: list[str], root: Path
) -> dict:
    """The exploration runs' block: per pair (explore_none, explore) the critical-path ratio, then
    the median and range over the pairs, and each stale run's accounting (nothing lost; its
    exploration jobs, the preempted ones among them; what it selected)."""
    ratios, runs = [], []
    for (none_name, stale_name), (n_rows, e_rows) in zip(names, pairs):
        ratios.append(round(median_of(e_rows, "time/iteration_s") / median_of(n_rows, "time/iteration_s"), 3))
        r = runtime_figures(e_rows)
        e = runtime_figures(e_rows, "explore")
        e["yielded_to_rollouts"] = e_rows[-1].get("runtime/explore_leases_yielded_total", 0)
        runs.append(
            {
                "runs": [none_name, stale_name],
                "iteration_s": {
                    "none": median_of(n_rows, "time/iteration_s"),
                    "stale": median_of(e_rows, "time/iteration_s"),
                },
                "update_s": {"none": median_of(n_rows, "time/update_s"), "stale": median_of(e_rows, "time/update_s")},
                "rollout_s": {
                    "none": median_of(n_rows, "time/rollout_s"),
                    "stale": median_of(e_rows, "time/rollout_s"),
                },
                "lost_rollouts": r["submitted"] - r["delivered"] - r["cancelled"],
                "duplicated_results": r["duplicated_results"],  # the runtime's one counter, rollout and explore jobs
                "preemptions_hitting_work": r["preemptions_hitting_work"],
                "candidates_scored_per_iteration": median_of(e_rows, "explore/candidates_scored"),
                "prompts_selected_per_iteration": median_of(e_rows, "explore/prompts_selected"),
                "fallback_late_per_iteration": median_of(e_rows, "explore/fallback_late"),
                "explore_jobs": e,
            }
        )
    return {
        "baseline": "the same trace and layout with explore.mode=none, alternated with each stale run",
        "layout": " ".join(layout) + " (emulated: the spot nodes are processes on this machine)",
        "critical_path_ratio_stale_over_none": round(statistics.median(ratios), 3),
        "critical_path_ratio_pairs": ratios,
        "critical_path_ratio_range": [min(ratios), max(ratios)],
        "lost_rollouts": sum(x["lost_rollouts"] for x in runs),
        "duplicated_results": sum(x["duplicated_results"] for x in runs),
        "prompts_selected_per_iteration": statistics.median(x["prompts_selected_per_iteration"] or 0 for x in runs),
        "explore_leases_revoked": sum(x["explore_jobs"]["leases_revoked"] for x in runs),
        "explore_steps_recomputed": sum(x["explore_jobs"]["steps_recomputed"] for x in runs),
        "pairs": runs,
        "runs_dir": str(root),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", type=Path, nargs="+", required=True, help="trace file(s) (any format spot.traces reads)")
    p.add_argument(
        "--notice-s", type=float, nargs="+", default=[0.0], help="notice lead(s) in trace seconds (0: no notice)"
    )
    p.add_argument(
        "--notice-poll-s",
        type=float,
        default=0.1,
        help="runtime.notice_poll_s of the runs with a notice: the compressed lead (120 s / 80 = 1.5 s wall) "
        "then holds 15 polls, where a real 120 s notice holds 60 of the watcher's 2 s polls",
    )
    p.add_argument("--iterations", type=int, default=24, help="training iterations of every run")
    p.add_argument("--nodes", type=int, default=None, help="peak spot nodes (default: WINDOWS)")
    p.add_argument(
        "--window-s", type=float, default=None, help="stretch of the trace, trace seconds (default: WINDOWS)"
    )
    p.add_argument("--compress", type=float, default=None, help="trace seconds per wall second (default: WINDOWS)")
    p.add_argument("--spot-nodes", type=int, default=1, help="spot nodes of the static run")
    p.add_argument("--pairs", type=int, default=2, help="local and static runs, alternated, this many of each")
    p.add_argument(
        "--explore",
        action="store_true",
        help="also the first trace at the first notice lead with explore.mode=stale and with none, "
        "both with --explore-layout",
    )
    p.add_argument(
        "--explore-pairs",
        type=int,
        default=3,
        help="explore_none and explore runs, alternated, this many of each (under a trace on 2 cores one "
        "run's median iteration drifts by up to half from the next one's: the ratio is taken per pair)",
    )
    p.add_argument(
        "--explore-layout",
        nargs="*",
        default=["runtime.local_cluster_cpus=1", "train.num_threads=1"],
        help="overrides of the two exploration runs: by default the local cluster (every spot node, Ray's own "
        "processes, the replay) on one CPU of its own and the trainer on the other, as separate machines "
        "would be (emulated); without it the spot workers explore on the trainer's CPUs",
    )
    p.add_argument("--timeout-s", type=float, default=1800.0, help="give up a run after this long")
    p.add_argument("--keep", type=Path, default=None, help="keep the run directories here")
    p.add_argument(
        "--resume",
        action="store_true",
        help="with --keep: read the runs that already finished there with the same overrides (their "
        "NAME.args.json and final checkpoint), and run only the others",
    )
    p.add_argument("--json", action="store_true", help="print only the JSON lines")
    p.add_argument(
        "--plan-only",
        type=float,
        default=None,
        metavar="RUN_S",
        help="print what each window does in a run's first RUN_S wall seconds, and train nothing",
    )
    p.add_argument("overrides", nargs="*", help="more recipe overrides, key=value, for every run")
    args = p.parse_args()

    windows = {}
    for path in args.trace:
        if not path.is_file():
            p.error(f"--trace {path}: no such file")
        windows[path] = {**DEFAULT_WINDOW, **WINDOWS.get(path.name, {})}
        for key in ("nodes", "window_s", "compress"):
            if getattr(args, key) is not None:
                windows[path][key] = getattr(args, key)
    if args.plan_only is not None:
        from spot.replay import fit_trace

        for path, window in windows.items():
            fitted, start = fit_trace(
                path, nodes=int(window["nodes"]), window_s=window["window_s"], compress=window["compress"]
            )
            print(
                json.dumps(
                    {"trace": path.name, "window": window, "start_s": start, **window_plan(fitted, args.plan_only)}
                )
            )
        return
    n = args.iterations
    common = [
        f"train.num_iterations={n}",
        "train.max_minutes=0",
        "log.wandb_mode=disabled",
        "log.images_every=0",
        f"log.checkpoint_every={n}",
        *args.overrides,
    ]
    cluster = ["runtime.rollouts=cluster"]

    def trace_args(path: Path, notice_s: float) -> list[str]:
        w = windows[path]
        return [
            f"runtime.trace={path.resolve()}",
            f"runtime.trace_nodes={w['nodes']}",
            f"runtime.trace_window_s={w['window_s']}",
            f"runtime.trace_compress={w['compress']}",
            f"runtime.trace_notice_s={notice_s}",
            *([f"runtime.notice_poll_s={args.notice_poll_s}"] if notice_s > 0 else []),
        ]

    # One local and one static run serve every trace run: the same recipe, iterations and seeds.
    if args.pairs < 1:
        p.error(f"--pairs must be >= 1, got {args.pairs}")
    pairs = [("local", "static")] + [(f"local{i}", f"static{i}") for i in range(1, args.pairs)]
    runs = {}
    for lo, st in pairs:
        runs[lo], runs[st] = common, [*common, *cluster, f"runtime.spot_nodes={args.spot_nodes}"]
    cases = [(path, notice) for path in args.trace for notice in args.notice_s]
    for k, (path, notice) in enumerate(cases):
        runs[f"trace{k}"] = [*common, *cluster, *trace_args(path, notice)]
    if args.explore:
        # Both on the same emulated layout: the cluster's processes on CPUs of their own.
        base = [*common, *cluster, *trace_args(args.trace[0], args.notice_s[0]), *args.explore_layout]
        if args.explore_pairs < 1:
            p.error(f"--explore-pairs must be >= 1, got {args.explore_pairs}")
        explore_pairs = [("explore_none", "explore")] + [
            (f"explore_none{i}", f"explore{i}") for i in range(1, args.explore_pairs)
        ]
        for none, stale in explore_pairs:
            runs[none], runs[stale] = base, [*base, "explore.mode=stale"]
    root = args.keep or Path(tempfile.mkdtemp(prefix="spot-training-"))
    root.mkdir(parents=True, exist_ok=True)
    rows = {}

    if args.resume and args.keep is None:
        p.error("--resume needs --keep DIR (where the earlier runs are)")

    def run(name: str) -> list[dict]:
        from spotlight.core.tracking import read_metrics

        record = root / f"{name}.args.json"
        done = (root / name / "checkpoints" / f"step-{n:08d}").is_dir()
        if args.resume and done and record.is_file() and json.loads(record.read_text()) == runs[name]:
            rows[name] = read_metrics(root / name)
            if not args.json:
                print(f"{name}: read from {root / name} (--resume)", file=sys.stderr)
            return rows[name]
        if not args.json:
            print(f"{name}: spotlight train ... {' '.join(runs[name][len(common) :])}", file=sys.stderr)
        if (root / name).exists():
            shutil.rmtree(root / name)  # a run cut short, or of other overrides: from the start
        record.write_text(json.dumps(runs[name]))
        rows[name] = train(root / name, runs[name], args.timeout_s)
        if not args.json:
            print(f"{name}: median iteration {median_of(rows[name], 'time/iteration_s')} s", file=sys.stderr)
        return rows[name]

    # The shared runs first; then each trace run, its line printed as soon as it ends (a long
    # invocation stopped early keeps the lines it printed). The exploration run follows the run it
    # is compared with.
    for lo, st in pairs:
        run(lo)
        run(st)
    local_w = final_weights(root / "local", n)
    # Every rerun trains the same bits (the check that the pairs time the same work).
    static_equal = all(same_weights(final_weights(root / name, n), local_w) for pair in pairs for name in pair[1:])
    reruns_equal = all(same_weights(final_weights(root / lo, n), local_w) for lo, _ in pairs[1:])
    pair_ratios = [
        median_of(rows[st], "time/iteration_s") / median_of(rows[lo], "time/iteration_s") for lo, st in pairs
    ]
    ratio = round(statistics.median(pair_ratios), 3)

    def phase(kind: int, key: str) -> float | None:
        values = [median_of(rows[pair[kind]], key) for pair in pairs]
        return None if None in values else round(statistics.median(values), 4)

    where = {k.removeprefix("time/"): {"local": phase(0, k), "static": phase(1, k)} for k in PHASES}
    where = {k: v for k, v in where.items() if any(x is not None for x in v.values())}
    for k, (path, notice) in enumerate(cases):
        t = runtime_figures(run(f"trace{k}"))
        result = {
            "trace": path.name,
            "notice_s": notice,
            "notice_wall_s": round(notice / windows[path]["compress"], 3),
            "notice_poll_s": args.notice_poll_s if notice > 0 else None,
            "iterations": n,
            "window": windows[path],
            "baseline": "the same recipe with runtime.rollouts=local (the trainer rolls out itself)",
            "preemptions": t["preemptions"],
            "preemptions_hitting_work": t["preemptions_hitting_work"],
            "lost_rollouts": t["submitted"] - t["delivered"] - t["cancelled"],
            "duplicated_results": t["duplicated_results"],
            "recomputed_steps_per_preemption": t["recomputed_steps_per_preemption"],
            "jobs_resumed": t["jobs_resumed"],
            "weights_equal_local": same_weights(final_weights(root / f"trace{k}", n), local_w),
            "weights_equal_local_static": static_equal,
            "iteration_time_ratio_cluster_over_local": ratio,
            "iteration_time_ratio_cluster_over_local_pairs": [round(r, 3) for r in pair_ratios],
            "local_reruns_weights_equal": reruns_equal,
            "iteration_time_ratio_trace_over_local": round(
                median_of(rows[f"trace{k}"], "time/iteration_s") / median_of(rows["local"], "time/iteration_s"), 3
            ),
            "where_time_goes": where,
            "trace_run": t,
            "runs_dir": str(root / f"trace{k}"),
        }
        if args.explore and k == 0:
            result["explore"] = explore_figures(
                explore_pairs, [(run(a), run(b)) for a, b in explore_pairs], args.explore_layout, root
            )
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
