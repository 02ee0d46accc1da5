"""Pull vs push scheduling of real denoising jobs on a local Ray cluster that replays a spot trace.

The trace is fitted to this machine: trimmed, its node count rescaled to `--nodes` (counts scaled
and rounded, `Trace.rescaled`), cut to a `--window-s` stretch (default: the one with the most
preemptions, `spot.replay.busiest_window`), compressed `--compress` times, and, with
`--notice-s S`, every preemption warned S trace-seconds ahead (AWS gives 120) through a fake
instance-metadata endpoint per node that the node's worker watches. `--synthetic` replaces the
file with `synthetic_trace` (already node-sized; not rescaled or windowed).

Workers are heterogeneous: trace node `node-K` runs at speed `speeds[K % len(speeds)]` (default
1, 0.5, so nodes alternate fast and half as fast), i.e. each denoising step is padded to
`step_s / speed` wall seconds. The padding stands for a slower accelerator and leaves the bits
alone; the tiny model's real step (~6 ms on one core) fits inside it.

The same jobs (the shipped tiny model, `--steps` steps each, prompts from the shapes grammar; each
a one-row rollout job of the DiT runner) run twice on the same replay, one after the other
(`--repeats R`: R such pairs, alternating which scheduler goes first): under the runtime's pull
scheduler and under its push baseline (`spot.runtime.Runtime(policy="push")`: round robin up front
to the workers ready at the start, a lost worker's jobs re-pushed round robin to the workers ready
then, resuming from their last commit like pull; pull also moves a running job from a slower worker
to a free faster one through a commit, the queue's tail hand-off). Each run starts once the trace's initial nodes have
loaded their workers; the trace clock and the job stream start together; the run ends when every
job has a result (after the window the cluster stays as the trace left it).

Reported (one JSON line with --json):
    jobs, preemptions        jobs per run; preemptions replayed during the pull runs
    lost, duplicated         jobs without a result / results delivered twice, both runs summed
    recomputed_steps_per_preemption   pull run: steps finished after a job's last commit and lost
                             with its worker (queue accounting), over the preemptions replayed
    max_recomputed_steps     the most steps one interrupted job lost (goal: <= commit_every)
    throughput_ratio_pull_vs_push     jobs/s under pull over jobs/s under push (over all repeats:
                             total jobs over total wall time); ratio_per_repeat: each pair's ratio
    bit_exact                every final latent of both runs equals the uninterrupted sampling of
                             its (prompt, seed)
    pull, push               per-scheduler details, summed over repeats

    .venv/bin/python benchmarks/preemption_replay.py --trace traces/parcae-p3-aws.csv --json
    .venv/bin/python benchmarks/preemption_replay.py --trace traces/parcae-p3-aws.csv --notice-s 120 --json
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", type=Path, help="trace file (any format spot.traces reads)")
    src.add_argument("--synthetic", action="store_true", help="a seeded synthetic trace instead")
    add_replay_arguments(p)
    p.add_argument("--start-s", type=float, default=None, help="start of the stretch; default: the busiest")
    p.add_argument("--timeout-s", type=float, default=600.0, help="give up a run after this long")
    p.add_argument("--seed", type=int, default=0, help="seed of the jobs (and of the synthetic trace)")
    p.add_argument("--repeats", type=int, default=1, help="pull/push run pairs, alternating which goes first")
    p.add_argument("--json", action="store_true", help="print only the JSON line")
    args = p.parse_args()

    # Ray's processes write to this process's stdout; keep it for the JSON line alone.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    logging.basicConfig(level=logging.WARNING if args.json else logging.INFO, format="%(message)s")

    trace = fit_trace(args)
    speeds = [float(s) for s in args.speeds.split(",")]
    jobs_n = args.jobs or size_jobs(trace, speeds, args)
    result = run(trace, speeds, jobs_n, args)
    line = json.dumps(result)
    if not args.json:
        print(summary(result), file=sys.stderr)
    print(line, file=out, flush=True)


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
            num_nodes=args.nodes, duration_s=args.window_s, preemptions_per_node_hour=4.0,
            replacement_delay_s=120.0, seed=args.seed,
        ).compressed(args.compress)  # fmt: skip
        if args.notice_s > 0:
            trace = trace.with_notices(args.notice_s / args.compress)
        start = 0.0
    else:
        trace, start = fit(
            args.trace, nodes=args.nodes, window_s=args.window_s, start_s=args.start_s,
            compress=args.compress, notice_s=args.notice_s,
        )  # fmt: skip
    logging.info("%s; start %g s", trace.summary(), start)
    args.window_start_s = start
    return trace


def node_speed(name: str, speeds: list[float]) -> float:
    """Speed of trace node `node-K`."""
    return speeds[int(name.rsplit("-", 1)[1]) % len(speeds)]


def size_jobs(trace, speeds: list[float], args, startup_s: float = 8.0) -> int:
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
    from spotlight.jobs import RolloutJob
    from spotlight.rewards.shapes import all_prompts
    from spotlight.sampling import derive_seed

    prompts = all_prompts(1)
    steps = list(range(args.steps))
    return [
        Job(i, RolloutJob([prompts[i % len(prompts)]], [derive_seed(seed, i)], steps, [args.steps]), num_steps=args.steps, kind="rollout")
        for i in range(num_jobs)
    ]


def run(trace, speeds: list[float], num_jobs: int, args) -> dict:
    from spot.cluster import LocalCluster

    jobs = make_jobs(args, num_jobs, args.seed)
    cfg = bench_recipe(args)
    cluster = LocalCluster()
    try:
        import ray

        ray.init(address=cluster.address, logging_level=logging.WARNING, log_to_driver=False)
        runs: dict[str, list[dict]] = {"pull": [], "push": []}
        for rep in range(args.repeats):
            # Alternate the order so that drift of a shared, noisy machine hits both schedulers alike.
            for name in ("pull", "push") if rep % 2 == 0 else ("push", "pull"):
                one = one_run(cluster, trace, name, cfg, jobs, speeds, args)
                runs[name].append(one)
                logging.info("%s #%d: %s", name, rep, {k: v for k, v in one.items() if k != "latents"})
    finally:
        cluster.shutdown()
    bit_exact = check_bits(cfg, jobs, [r.pop("latents") for name in runs for r in runs[name]])
    pull, push = _combined(runs["pull"]), _combined(runs["push"])
    ratios = [round(a["jobs_per_s"] / b["jobs_per_s"], 3) for a, b in zip(runs["pull"], runs["push"])]
    return {
        "trace": "synthetic" if args.synthetic else args.trace.name,
        "baseline": "push: round robin at submission to the workers ready then, re-pushed on a loss",
        "window_s": [args.window_start_s, args.window_start_s + args.window_s],
        "compress": args.compress,
        "notice_s": args.notice_s,
        "nodes": args.nodes,
        "speeds": speeds,
        "jobs": num_jobs,
        "repeats": args.repeats,
        "steps": args.steps,
        "commit_every": args.commit_every,
        "preemptions": pull["preemptions"],
        "lost": pull["lost"] + push["lost"],
        "duplicated": pull["duplicated"] + push["duplicated"],
        "recomputed_steps_per_preemption": pull["recomputed_steps"] / max(1, pull["preemptions"]),
        "max_recomputed_steps": max(pull["max_recomputed_steps"], push["max_recomputed_steps"]),
        "throughput_ratio_pull_vs_push": round(pull["jobs_per_s"] / push["jobs_per_s"], 3),
        "ratio_per_repeat": ratios,
        "bit_exact": bit_exact,
        "pull": pull,
        "push": push,
    }


def one_run(cluster, trace, policy: str, cfg, jobs, speeds, args) -> dict:
    from spot.replay import TraceReplayer
    from spot.runtime import Runtime

    replayer = TraceReplayer(cluster, trace, fake_imds=args.notice_s > 0)
    pool = None
    sched = None
    try:
        pool, initial = start_pool(replayer, cfg, speeds, args)
        sched = Runtime(pool, policy=policy, tick_s=0.1)
        wait_groups(sched, initial)
        sched.submit(jobs)
        report = run_on_replay(sched, replayer, args.timeout_s)
        preemptions = replayer.num_preemptions
        notices = sum(ev.kind == "notice" for ev in replayer.applied)
        s = report.stats
        late = [ev.at_s - ev.t_s for ev in replayer.applied if ev.t_s > 0]
        return {
            "wall_s": round(report.wall_s, 2),
            "jobs_per_s": round(len(report.results) / report.wall_s, 3),
            "preemptions": preemptions,
            "notices": notices,
            "lost": report.lost,
            "duplicated": report.duplicated,
            "leases": s.leases,
            "revoked": s.revoked,
            "released": s.released,
            "handoffs": s.handoffs,
            "recomputed_steps": s.recomputed_steps,
            "steps_in_flight_lost": s.steps_in_flight_lost,
            "max_recomputed_steps": s.max_recomputed_steps,
            "stale_results_dropped": s.stale_results,
            "workers_died": sum(ev == "died" for _, _, ev in report.events),
            "workers_left": sum(ev == "left" for _, _, ev in report.events),
            "repushed": len(sched.repushed),
            "max_event_delay_s": round(max(late, default=0.0), 2),
            "latents": {r.job_id: r.output.latents[-1][0] for r in report.results},
        }
    finally:
        tear_down(sched, pool, replayer)


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

    worker_kwargs = {"commit_every": args.commit_every, "imds_poll_s": 0.2, "poll_s": 0.05, "idle_poll_s": 0.05}
    pool = WorkerPool(partial(DiTRunner, cfg), worker_kwargs=worker_kwargs, node_kwargs=node_kwargs)
    pool.wait_ready(len(initial), timeout_s=300)
    return pool, len(initial)


def run_on_replay(sched, replayer, timeout_s: float):
    """Run the runtime (jobs submitted) on a thread while the trace replays on this one (Ray starts
    nodes from the main thread); its `RunOutcome` once every job is delivered or `timeout_s` passed."""
    done, box = threading.Event(), {}

    def drive():
        try:
            box["report"] = sched.run(timeout_s=timeout_s)
        except BaseException as err:  # noqa: BLE001 - re-raised on the main thread
            box["error"] = err
        finally:
            done.set()

    driver = threading.Thread(target=drive, name="scheduler")
    driver.start()
    replayer.run(stop=done)
    driver.join()  # ends on its own: every job delivered, or its timeout
    if "error" in box:
        raise box["error"]
    return box["report"]


def _combined(runs: list[dict]) -> dict:
    """One scheduler's runs summed (jobs/s over all of them: total jobs over total wall time)."""
    if len(runs) == 1:
        return runs[0]
    out = {k: sum(r[k] for r in runs) for k in runs[0] if k not in ("jobs_per_s", "max_recomputed_steps", "max_event_delay_s")}
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
        ref = rollout(policy, p.prompts, p.seeds, sigmas, noise_level=cfg.sample.noise_level, sde_steps=p.sde_steps).trajectory.final[0]
        for latents in latents_by_run:
            if job.job_id in latents and not torch.equal(latents[job.job_id], ref):
                logging.warning("job %d differs from its uninterrupted sampling", job.job_id)
                return False
    return True


def summary(r: dict) -> str:
    return (
        f"{r['trace']} window {r['window_s']} s /{r['compress']:g}, notice {r['notice_s']:g} s: {r['jobs']} jobs, "
        f"{r['preemptions']} preemptions; lost {r['lost']}, duplicated {r['duplicated']}, "
        f"recomputed {r['recomputed_steps_per_preemption']:.2f} steps/preemption; pull {r['pull']['jobs_per_s']} "
        f"vs push {r['push']['jobs_per_s']} jobs/s = {r['throughput_ratio_pull_vs_push']}x; bit exact {r['bit_exact']}"
    )


if __name__ == "__main__":
    main()
