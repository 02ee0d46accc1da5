"""Pull scheduling against what a Ray user writes today, on a local Ray cluster that replays a spot trace.

The trace is fitted to this machine: trimmed, its node count rescaled to `--nodes` (counts scaled
and rounded, `Trace.rescaled`), cut to a `--window-s` stretch, compressed `--compress` times, and, with
`--notice-s S`, every preemption warned S trace-seconds ahead (AWS gives 120) through a fake
instance-metadata endpoint per node that the node's worker watches. `--synthetic` replaces the
file with `synthetic_trace` (already node-sized; not rescaled or windowed).

The stretch is chosen so that preemptions end work: a preemption of a node whose worker is not up
yet (8 s of wall time after its add, `WORKER_STARTUP_S`, 320 trace seconds at 40x) ends nothing
under any scheduler. By default `--window-s` is, per trace, the shortest length from 2,400 trace
seconds in steps of 1,200 whose busiest stretch holds `--min-preemptions` (4) preemptions of nodes
that were up (`spot.replay.shortest_busy_window`; the whole trace if none does), and the stretch
starts where it holds the most of them (`spot.replay.busiest_window`): parcae-p3 at 3 nodes 6,000
s from 2,940 s, Bamboo 4,800 s from 1,547 s, the Parcae hh hour at 8 nodes all of it.

Jobs are sized from the paper-scale setting, not to reach a figure: a job is one micro-batch of a
Qwen-Image rollout, `--job` qwen-image-1280 by default (`spot.sim.profile`: 10 steps of 2.1 s on a
4-GPU sequence-parallel group; 512x512: 10 steps of 0.9 s on one GPU), each step compressed like
the trace (2.1 s / 40 = 52.5 ms of wall time). `--steps` overrides the step count (Qwen-Image's own
sampler takes 50); `--curve` runs the comparison at 512x512 and at 1280x1280 with 10, 20 and 50
steps, one JSON line with the ratio at each length.

Workers are heterogeneous by default: trace node `node-K` runs at speed `speeds[K % len(speeds)]`
(`--speeds 1,0.5`: nodes alternate fast and half as fast; `--speeds 1` makes them equal), i.e. each
denoising step is padded to `step_s / speed` wall seconds. The padding stands for a slower
accelerator and leaves the bits alone; the tiny model's real step (~6 ms on one core) fits inside.

The work comes as a training run's: waves of `--wave-jobs` jobs (default 16 per peak node: the
paper-scale profile's 64 jobs per iteration, 16 prompts x 16 images / 4 per job, over 4 groups),
the next wave submitted when the last result of the one before arrived. Each run starts once the
trace's initial nodes have loaded their model; the trace clock and the first wave start together;
the run ends when every job has a result. The same jobs run under pull (the runtime's scheduler:
workers pull, commit every `--commit-every` steps, resume elsewhere from the last commit, drain on
a notice, hand a running job from a slow worker to a free fast one) and under `--baseline`:

    ray-retries  (default) what a Ray user writes: one Ray task per job (`num_cpus=1` on a spot
                 node, the model cached in the worker process after its first task), Ray's own
                 scheduler handing queued tasks to free nodes (the SPREAD policy: the default one
                 leaves gaps between a node's tasks, see `ray_run`), and Ray's own fault tolerance
                 (`max_retries=-1`: a task whose node died is rerun from scratch; no notices)
    push         the runtime with `policy="push"`: each job pushed at submission to the
                 least-loaded live worker, a lost worker's jobs re-pushed the same way, resuming
                 from their last commit (commits and notices as under pull; who chooses the job
                 is the only difference)

runs alternate (`--repeats R`: R pairs, alternating which goes first).

Reported (one JSON line with --json):
    throughput_ratio_pull_vs_baseline   jobs/s under pull over jobs/s under the baseline (total
                             jobs over total wall time of all repeats); ratio_per_repeat
    preemptions              preemptions replayed during the pull runs
    preemptions_hitting_work per scheduler: preemptions of a node with a job in flight
    recomputed_steps_per_preemption     per scheduler: steps computed and lost (after the last
                             commit, the step in flight included) over the preemptions replayed
    lost, duplicated         jobs without a result / results delivered twice, all runs summed
    job_trace_s, job_wall_s  one job at speed 1: steps x step time, in trace and in wall seconds
    bit_exact                every final latent of every run equals the uninterrupted sampling
                             of its (prompt, seed)
    pull, <baseline>         per-scheduler details, summed over repeats

    .venv/bin/python benchmarks/preemption_replay.py --trace traces/parcae-p3-aws.csv --baseline ray-retries --json
    .venv/bin/python benchmarks/preemption_replay.py --trace traces/parcae-p3-aws.csv --notice-s 120 --json
    .venv/bin/python benchmarks/preemption_replay.py --trace traces/parcae-p3-aws.csv --curve --json
    .venv/bin/python benchmarks/preemption_replay.py --trace traces/bamboo-g4dn-us-east-1c.csv --baseline push --json
    .venv/bin/python benchmarks/preemption_replay.py --synthetic --json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
import time
from pathlib import Path

import torch

# The job lengths of `--curve`: (profile, steps) from 512x512 to Qwen-Image's own 50-step sampler at 1280x1280.
CURVE = (("qwen-image-512", 10), ("qwen-image-1280", 10), ("qwen-image-1280", 20), ("qwen-image-1280", 50))
BASELINES = {
    "ray-retries": (
        "Ray tasks, one per job, Ray's SPREAD scheduling and max_retries=-1 (rerun from scratch on node death, no "
        "notices)"
    ),
    "push": (
        "push: each job at submission to the least-loaded live worker, lost jobs re-pushed the same way from their "
        "last commit"
    ),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", type=Path, help="trace file (any format spot.traces reads)")
    src.add_argument("--synthetic", action="store_true", help="a seeded synthetic trace instead")
    add_replay_arguments(p)
    # --window-s by default: per trace, the shortest stretch holding --min-preemptions preemptions of
    # nodes whose worker was up (spot.replay.shortest_busy_window): parcae-p3 at 3 nodes 6,000 s,
    # Bamboo 4,800 s, the Parcae hh hour at 6 nodes all of it.
    p.set_defaults(steps=None, step_s=None, window_s=None)
    p.add_argument(
        "--min-preemptions",
        type=int,
        default=4,
        help="default --window-s: the shortest stretch with this many preemptions of nodes whose worker was up",
    )
    p.add_argument(
        "--job", default="qwen-image-1280", help="paper-scale profile whose job this replays (spot.sim.profile)"
    )
    p.add_argument("--curve", action="store_true", help="the ratio at each job length of CURVE, one JSON line")
    p.add_argument("--baseline", choices=sorted(BASELINES), default="ray-retries")
    p.add_argument("--wave-jobs", type=int, default=0, help="jobs per wave (a training iteration); 0: 16 per peak node")
    p.add_argument("--start-s", type=float, default=None, help="start of the stretch; default: the busiest")
    p.add_argument("--timeout-s", type=float, default=600.0, help="give up a run after this long")
    p.add_argument("--seed", type=int, default=0, help="seed of the jobs (and of the synthetic trace)")
    p.add_argument("--repeats", type=int, default=1, help="pull/baseline run pairs, alternating which goes first")
    p.add_argument("--json", action="store_true", help="print only the JSON line")
    args = p.parse_args()

    # Ray's processes write to this process's stdout; keep it for the JSON line alone.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    logging.basicConfig(level=logging.WARNING if args.json else logging.INFO, format="%(message)s")

    trace = fit_trace(args)
    speeds = [float(s) for s in args.speeds.split(",")]
    shapes = CURVE if args.curve else ((args.job, args.steps),)
    from spot.cluster import LocalCluster

    cluster = LocalCluster()
    try:
        import ray

        ray.init(address=cluster.address, logging_level=logging.WARNING, log_to_driver=False)
        results = []
        for job, steps in shapes:
            set_job_shape(args, job, steps)
            jobs_n = args.jobs or size_jobs(trace, speeds, args)
            results.append(run(cluster, trace, speeds, jobs_n, args))
            if not args.json:
                print(summary(results[-1]), file=sys.stderr)
    finally:
        cluster.shutdown()
    if args.curve:
        keys = (
            "job",
            "steps",
            "job_trace_s",
            "job_wall_s",
            "jobs",
            "throughput_ratio_pull_vs_baseline",
            "preemptions",
            "preemptions_hitting_work",
            "bit_exact",
        )
        result = {
            k: results[0][k]
            for k in (
                "trace",
                "baseline",
                "window_s",
                "compress",
                "notice_s",
                "nodes",
                "speeds",
                "repeats",
                "commit_every",
            )
        }
        result["curve"] = [{k: r[k] for k in keys} for r in results]
        result["runs"] = results
    else:
        result = results[0]
    print(json.dumps(result), file=out, flush=True)


def set_job_shape(args, job: str, steps: int | None) -> None:
    """`args.steps` and `args.step_s` (wall seconds per step at speed 1) from a paper-scale profile:
    its step time on its sequence-parallel group, compressed like the trace."""
    from spot.sim.profile import builtin_profile

    prof = builtin_profile(job)
    args.job = job
    args.steps = steps or prof.num_steps
    args.step_s = prof.job_step_s / args.compress
    args.job_trace_s = args.steps * prof.job_step_s


def add_replay_arguments(p: argparse.ArgumentParser) -> None:
    """The replay and workload options this benchmark shares with calibrate_simulator.py."""
    p.add_argument("--notice-s", type=float, default=0.0, help="notice lead in trace seconds (0: no notice)")
    p.add_argument("--compress", type=float, default=40.0, help="trace seconds per wall second")
    p.add_argument("--window-s", type=float, default=2400.0, help="stretch of the trace to replay, trace seconds")
    p.add_argument("--nodes", type=int, default=3, help="peak spot nodes (each one CPU, one worker)")
    p.add_argument("--speeds", default="1,0.5", help="worker speeds, cycled over trace nodes node-0, node-1, ...")
    p.add_argument("--step-s", type=float, default=0.05, help="wall time of one step at speed 1")
    p.add_argument("--steps", type=int, default=10, help="denoising steps per job")
    p.add_argument("--commit-every", type=int, default=4, help="m: commit every m steps")
    p.add_argument("--jobs", type=int, default=0, help="jobs per run; 0: sized to the window")


def fit_trace(args):
    from spot.replay import fit_trace as fit
    from spot.traces import synthetic_trace

    if args.synthetic:
        trace = synthetic_trace(
            num_nodes=args.nodes,
            duration_s=args.window_s or 4800.0,
            preemptions_per_node_hour=4.0,
            replacement_delay_s=120.0,
            seed=args.seed,
        ).compressed(args.compress)
        if args.notice_s > 0:
            trace = trace.with_notices(args.notice_s / args.compress)
        start = 0.0
    else:
        trace, start = fit(
            args.trace,
            nodes=args.nodes,
            window_s=args.window_s,
            start_s=args.start_s,
            min_age_s=WORKER_STARTUP_S * args.compress,
            min_preemptions=getattr(args, "min_preemptions", 4),
            compress=args.compress,
            notice_s=args.notice_s,
        )
    logging.info("%s; start %g s", trace.summary(), start)
    args.window_start_s = start
    args.window_s = trace.duration_s * args.compress
    return trace


def node_speed(name: str, speeds: list[float]) -> float:
    """Speed of trace node `node-K`."""
    return speeds[int(name.rsplit("-", 1)[1]) % len(speeds)]


WORKER_STARTUP_S = 8.0
"""Wall seconds from a node's add to its worker holding work (node start and model load, measured)."""


def size_jobs(trace, speeds: list[float], args, startup_s: float = WORKER_STARTUP_S) -> int:
    """About the jobs pull finishes in the window: each node's speed x its time in the window once
    its worker is up (~8 s after a mid-window add: node start and model load), over the time one job
    takes at speed 1, times 0.8."""
    added: dict[str, float] = {}
    speed_s = 0.0

    def useful(node: str, end_s: float) -> float:
        up = added[node] + (startup_s if added[node] > 0 else 0.0)
        return max(0.0, end_s - up) * node_speed(node, speeds)

    for ev in trace.events:
        if ev.kind == "add":
            added[ev.node_id] = ev.t_s
        else:
            speed_s += useful(ev.node_id, ev.t_s)
            del added[ev.node_id]
    speed_s += sum(useful(node, trace.duration_s) for node in list(added))
    return max(2 * args.nodes, int(0.8 * speed_s / (args.steps * args.step_s)))


def bench_recipe(args):
    """The shipped tiny model's recipe with the benchmark's sampler: `--steps` SDE steps, float32."""
    from spotlight.config import DiTRecipe

    cfg = DiTRecipe()
    cfg.sample.num_steps, cfg.sample.noise_level, cfg.sample.autocast = args.steps, 0.7, "none"
    cfg.train.objective = "flow_grpo"
    return cfg


def make_jobs(args, num_jobs: int, seed: int) -> list:
    """One-row rollout jobs of the DiT runner, only the final latent kept."""
    from spot.jobqueue import Job
    from spotlight.core.seeds import derive_seed
    from spotlight.jobs import RolloutJob
    from spotlight.rewards.shapes import all_prompts

    prompts = all_prompts(1)
    steps = list(range(args.steps))
    return [
        Job(
            i,
            RolloutJob([prompts[i % len(prompts)]], [derive_seed(seed, i)], steps, [args.steps]),
            num_steps=args.steps,
            kind="rollout",
        )
        for i in range(num_jobs)
    ]


def wave_size(args) -> int:
    """Jobs per wave: `--wave-jobs`, or 16 per peak node."""
    return args.wave_jobs or 16 * args.nodes


def waves_of(jobs: list, args) -> list[list]:
    """The jobs cut into waves of `wave_size`."""
    n = wave_size(args)
    return [jobs[i : i + n] for i in range(0, len(jobs), n)]


def run(cluster, trace, speeds: list[float], num_jobs: int, args) -> dict:
    """Pull against `args.baseline` on the same jobs and replay, `args.repeats` alternating pairs."""
    wave = wave_size(args)
    num_jobs = -(-num_jobs // wave) * wave  # whole waves
    jobs = make_jobs(args, num_jobs, args.seed)
    cfg = bench_recipe(args)
    base = args.baseline
    runs: dict[str, list[dict]] = {"pull": [], base: []}
    for rep in range(args.repeats):
        # Alternate the order so that drift of a shared, noisy machine hits both schedulers alike.
        for name in ("pull", base) if rep % 2 == 0 else (base, "pull"):
            if name == "ray-retries":
                one = ray_run(cluster, trace, cfg, jobs, speeds, args)
            else:
                one = one_run(cluster, trace, name, cfg, jobs, speeds, args)
            runs[name].append(one)
            logging.info("%s #%d: %s", name, rep, {k: v for k, v in one.items() if k != "latents"})
    bit_exact = check_bits(cfg, jobs, [r.pop("latents") for name in runs for r in runs[name]])
    pull, other = _combined(runs["pull"]), _combined(runs[base])
    ratios = [round(a["jobs_per_s"] / b["jobs_per_s"], 3) for a, b in zip(runs["pull"], runs[base])]
    per_preemption = {
        name: round(r["recomputed_steps"] / max(1, r["preemptions"]), 2) for name, r in (("pull", pull), (base, other))
    }
    return {
        "trace": "synthetic" if args.synthetic else args.trace.name,
        "baseline": BASELINES[base],
        "window_s": [args.window_start_s, args.window_start_s + args.window_s],
        "compress": args.compress,
        "notice_s": args.notice_s,
        "nodes": args.nodes,
        "speeds": speeds,
        "job": args.job,
        "steps": args.steps,
        "job_trace_s": round(args.job_trace_s, 2),
        "job_wall_s": round(args.steps * args.step_s, 3),
        "jobs": num_jobs,
        "wave_jobs": wave,
        "repeats": args.repeats,
        "commit_every": args.commit_every,
        "preemptions": pull["preemptions"],
        "preemptions_hitting_work": {"pull": pull["preemptions_hitting_work"], base: other["preemptions_hitting_work"]},
        "lost": pull["lost"] + other["lost"],
        "duplicated": pull["duplicated"] + other["duplicated"],
        "recomputed_steps_per_preemption": per_preemption,
        # The share of all denoising steps done twice: what handling preemptions better can save at most
        # in work (a rerun at a wave's tail can also delay the wave by up to one job).
        "recomputed_fraction": {
            name: round(r["recomputed_steps"] / (num_jobs * args.steps * args.repeats), 4)
            for name, r in (("pull", pull), (base, other))
        },
        "throughput_ratio_pull_vs_baseline": round(pull["jobs_per_s"] / other["jobs_per_s"], 3),
        "ratio_per_repeat": ratios,
        "bit_exact": bit_exact,
        "pull": pull,
        base: other,
    }


def one_run(cluster, trace, policy: str, cfg, jobs, speeds, args) -> dict:
    """One run of the runtime (`policy` pull or push) on a fresh replay of the trace."""
    from spot.replay import TraceReplayer
    from spot.runtime import Runtime

    replayer = TraceReplayer(cluster, trace, fake_imds=args.notice_s > 0)
    pool = None
    sched = None
    try:
        pool, initial = start_pool(replayer, cfg, speeds, args)
        sched = Runtime(pool, policy=policy, tick_s=0.1)
        wait_groups(sched, initial)
        report = run_waves_on_replay(sched, replayer, waves_of(jobs, args), args.timeout_s)
        status = sched.status()
        s = report.stats
        return {
            "wall_s": round(report.wall_s, 2),
            "jobs_per_s": round(len(report.results) / report.wall_s, 3),
            "preemptions": replayer.num_preemptions,
            "preemptions_hitting_work": status.preemptions_hitting_work,
            "notices": sum(ev.kind == "notice" for ev in replayer.applied),
            "lost": report.lost,
            "duplicated": report.duplicated,
            "leases": s.leases,
            "revoked": s.revoked,
            "released": s.released,
            "handoffs": s.handoffs,
            # The step each lost worker was computing is lost too.
            "recomputed_steps": s.recomputed_steps + s.steps_in_flight_lost,
            "max_recomputed_steps": s.max_recomputed_steps,
            "stale_results_dropped": s.stale_results,
            "workers_died": sum(ev == "died" for _, _, ev in report.events),
            "workers_left": sum(ev == "left" for _, _, ev in report.events),
            "repushed": len(sched.repushed),
            "max_event_delay_s": max_event_delay(replayer),
            "latents": {r.job_id: r.output.latents[-1][0] for r in report.results},
        }
    finally:
        tear_down(sched, pool, replayer)


def max_event_delay(replayer) -> float:
    return round(max((ev.at_s - ev.t_s for ev in replayer.applied if ev.t_s > 0), default=0.0), 2)


# -- the Ray baseline: tasks with Ray's own retries ---------------------------------------------------
# What a Ray user writes without a scheduler of their own. The task below runs a job's steps on the
# same DiT runner as the runtime's workers (the same bits), padded to the node's speed like them,
# with no commits: a task whose node dies is rerun from step 0 by Ray (`max_retries=-1`). The model
# is built once per Ray worker process, as a user would cache it. Each attempt appends its steps to
# a file in `log_dir` (all nodes share this machine's disk): the only way to count what a killed
# attempt had done, since Ray keeps no record of it.

_RUNNER = {}


def rollout_task(cfg, job_id: int, payload, step_s: float, speeds: list[float], log_dir: str, warm: bool = False):
    """One job, start to end, in a Ray task; the final latent."""
    import uuid

    import ray

    from spot.cluster import NODE_LABEL
    from spotlight.jobs import DiTRunner

    if "runner" not in _RUNNER:
        import torch

        torch.set_num_threads(1)  # as the runtime's workers
        _RUNNER["runner"] = DiTRunner(cfg)
        with open(os.path.join(log_dir, "model-loads"), "a") as f:
            f.write(f"{os.getpid()}\n")
        _RUNNER["node"] = ray.get_runtime_context().get_node_labels()[NODE_LABEL]  # a GCS call: once
    runner, node = _RUNNER["runner"], _RUNNER["node"]
    if warm:
        return node
    pad = step_s / node_speed(node, speeds)
    attempt = uuid.uuid4().hex[:8]
    with open(os.path.join(log_dir, f"{attempt}.log"), "a", buffering=1) as log:
        log.write(json.dumps({"job": job_id, "node": node}) + "\n")
        state = runner.start(payload, 0, None)
        while not runner.finished(state):
            t0 = time.monotonic()
            state = runner.advance(state)
            time.sleep(max(0.0, pad - (time.monotonic() - t0)))
            log.write(json.dumps({"step": 1}) + "\n")
        log.write(json.dumps({"done": True}) + "\n")
    return runner.output(state).latents[-1][0]


def ray_run(cluster, trace, cfg, jobs, speeds, args) -> dict:
    """One run of the Ray-retries baseline on a fresh replay of the trace (no notices: Ray has none)."""
    import shutil
    import tempfile

    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from spot.cluster import NODE_LABEL
    from spot.replay import TraceReplayer
    from spotlight.core.cost import SPOT

    replayer = TraceReplayer(cluster, trace, fake_imds=False)
    log_dir = tempfile.mkdtemp(prefix="spot-ray-tasks-")
    # SPREAD: Ray's default (hybrid) policy fills one node first, and here left 0.3-0.4 s between a
    # node's tasks on all nodes but one (a 24-job batch on 2 nodes took 1.8x its ideal time; 1.03x
    # with SPREAD). Compressed 40x, that gap would be a quarter of a minute per job at paper scale,
    # which no user running one job per node would accept.
    task = ray.remote(num_cpus=1, resources={SPOT: 1}, max_retries=-1, scheduling_strategy="SPREAD")(rollout_task)
    try:
        initial = replayer.add_initial()
        # Load the model on the initial nodes before the clock starts, as the runtime's run does.
        ids = {n["Labels"].get(NODE_LABEL): n["NodeID"] for n in ray.nodes() if n["Alive"]}
        warm = [
            task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(ids[name], soft=False)).remote(
                cfg, -1, None, 0.0, speeds, log_dir, True
            )
            for name in initial
        ]
        ray.get(warm, timeout=300)

        def drive() -> dict:
            t0 = time.monotonic()
            latents = {}
            for wave in waves_of(jobs, args):
                refs = [task.remote(cfg, j.job_id, j.payload, args.step_s, speeds, log_dir) for j in wave]
                left = args.timeout_s - (time.monotonic() - t0)
                for j, out in zip(wave, ray.get(refs, timeout=max(1.0, left))):
                    latents[j.job_id] = out
            return {"wall_s": time.monotonic() - t0, "latents": latents}

        box = during_replay(replayer, drive)
        attempts = read_attempts(log_dir)
        preempted = {ev.node for ev in replayer.applied if ev.kind == "preempt"}
        broken = [a for a in attempts if not a["done"]]
        latents = box["latents"]
        return {
            "wall_s": round(box["wall_s"], 2),
            "jobs_per_s": round(len(latents) / box["wall_s"], 3),
            "preemptions": replayer.num_preemptions,
            "preemptions_hitting_work": len({a["node"] for a in broken} & preempted),
            "lost": len(jobs) - len(latents),
            "duplicated": 0,  # one ObjectRef per job: Ray returns one value
            "attempts": len(attempts),
            "model_loads": len((Path(log_dir) / "model-loads").read_text().split()),
            # Every step of an attempt that did not finish is lost, and the step it was computing.
            "recomputed_steps": sum(a["steps"] + 1 for a in broken),
            "max_recomputed_steps": max((a["steps"] + 1 for a in broken), default=0),
            "max_event_delay_s": max_event_delay(replayer),
            "latents": latents,
        }
    finally:
        replayer.remove_all()
        shutil.rmtree(log_dir, ignore_errors=True)


def read_attempts(log_dir: str) -> list[dict]:
    """The Ray tasks' attempts: job, node, steps finished, done."""
    out = []
    for path in Path(log_dir).glob("*.log"):
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if not lines:
            continue
        out.append(
            {
                "job": lines[0]["job"],
                "node": lines[0]["node"],
                "steps": sum("step" in x for x in lines),
                "done": any("done" in x for x in lines),
            }
        )
    return out


def wait_groups(sched, n: int, timeout_s: float = 300.0) -> None:
    """Tick until `n` groups serve the queue (push assigns jobs to the groups ready at submission)."""
    deadline = time.monotonic() + timeout_s
    while len(sched.pool.running()) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(sched.pool.running())} of {n} workers ready after {timeout_s} s")
        sched.tick()
        time.sleep(0.05)


def tear_down(sched, pool, replayer) -> None:
    """Close the runtime and the pool (either may be None) and remove the replay's nodes."""
    if sched is not None:
        sched.close()
    if pool is not None:
        pool.close()
    replayer.remove_all()


def start_pool(replayer, cfg, speeds: list[float], args, on_node=None):
    """Add the trace's initial nodes and a `WorkerPool` of DiT runners for them (speeds by node name;
    each worker watches its node's fake metadata endpoint when the replay gives notices); returns the
    pool and the number of initial nodes. `on_node(ray_node_id, trace_name)` is called as each node
    gets a worker."""
    from functools import partial

    from spot.cluster import NODE_LABEL
    from spot.pool import WorkerPool
    from spotlight.jobs import DiTRunner

    initial = replayer.add_initial()

    def node_kwargs(node: dict) -> dict:
        name = node["Labels"][NODE_LABEL]
        if on_node is not None:
            on_node(node["NodeID"], name)
        return {"step_s": args.step_s / node_speed(name, speeds)}

    # version 0: the model each worker loads from disk is the jobs' weights (nothing is published).
    worker_kwargs = {
        "commit_every": args.commit_every,
        "imds_poll_s": 0.2,
        "poll_s": 0.05,
        "idle_poll_s": 0.05,
        "version": 0,
    }
    pool = WorkerPool(partial(DiTRunner, cfg), worker_kwargs=worker_kwargs, node_kwargs=node_kwargs)
    pool.wait_ready(len(initial), timeout_s=300)
    return pool, len(initial)


def during_replay(replayer, work):
    """`work()` on a thread while the trace replays on this one (Ray starts nodes from the main
    thread); its value once it returns (the replay stops then), or its exception re-raised here."""
    done, box = threading.Event(), {}

    def drive():
        try:
            box["value"] = work()
        except BaseException as err:
            box["error"] = err
        finally:
            done.set()

    driver = threading.Thread(target=drive, name="workload")
    driver.start()
    replayer.run(stop=done)
    driver.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def run_on_replay(sched, replayer, timeout_s: float):
    """The runtime (jobs submitted) run during the replay; its `RunOutcome` once every job is
    delivered or `timeout_s` passed."""
    return during_replay(replayer, lambda: sched.run(timeout_s=timeout_s))


def run_waves_on_replay(sched, replayer, waves: list[list], timeout_s: float):
    """Each wave submitted once the one before is delivered, during the replay; the runtime's
    `RunOutcome` over all of them."""

    def work():
        deadline = time.monotonic() + timeout_s
        for wave in waves:
            sched.submit(wave)
            sched.wait([j.job_id for j in wave], timeout_s=max(1.0, deadline - time.monotonic()), take=False)
        return sched.report()

    return during_replay(replayer, work)


def _combined(runs: list[dict]) -> dict:
    """One scheduler's runs summed (jobs/s over all of them: total jobs over total wall time)."""
    if len(runs) == 1:
        return runs[0]
    out = {
        k: sum(r[k] for r in runs)
        for k in runs[0]
        if k not in ("jobs_per_s", "max_recomputed_steps", "max_event_delay_s", "latents")
    }
    out["jobs_per_s"] = round(sum(r["jobs_per_s"] * r["wall_s"] for r in runs) / out["wall_s"], 3)
    out["max_recomputed_steps"] = max(r["max_recomputed_steps"] for r in runs)
    out["max_event_delay_s"] = max(r["max_event_delay_s"] for r in runs)
    out["wall_s"] = round(out["wall_s"], 2)
    return out


def check_bits(cfg, jobs, latents_by_run: list[dict]) -> bool:
    """Every delivered final latent equals the trainer's own uninterrupted rollout of its row."""
    from spotlight.policy import load_policy
    from spotlight.rollout import rollout
    from spotlight.sampling import qwen_image_sigmas

    policy = load_policy(cfg.model, trainable=False)
    sigmas = qwen_image_sigmas(cfg.sample.num_steps, policy.latent_shape[0])
    for job in jobs:
        p = job.payload
        ref = rollout(
            policy, p.prompts, p.seeds, sigmas, noise_level=cfg.sample.noise_level, sde_steps=p.sde_steps
        ).trajectory.final[0]
        for latents in latents_by_run:
            if job.job_id in latents and not torch.equal(latents[job.job_id], ref):
                logging.warning("job %d differs from its uninterrupted sampling", job.job_id)
                return False
    return True


def summary(r: dict) -> str:
    base = next(k for k in r if k in BASELINES)
    return (
        f"{r['trace']} window {r['window_s']} s /{r['compress']:g}, notice {r['notice_s']:g} s, "
        f"{r['job']} x {r['steps']} steps ({r['job_trace_s']} trace s): {r['jobs']} jobs, "
        f"{r['preemptions']} preemptions, hitting work {r['preemptions_hitting_work']}; "
        f"lost {r['lost']}, duplicated {r['duplicated']}, "
        f"recomputed steps/preemption {r['recomputed_steps_per_preemption']}; "
        f"pull {r['pull']['jobs_per_s']} vs {base} {r[base]['jobs_per_s']} jobs/s = "
        f"{r['throughput_ratio_pull_vs_baseline']}x; bit exact {r['bit_exact']}"
    )


if __name__ == "__main__":
    main()
