"""Elastic SP recovery: re-forming survivors in place against a cold restart, side by side in one run.

Four persistent runtime workers (`spot.worker.Worker` with the DiT runner, one CPU slot each, one
thread) on one spot node with four slots of a local Ray cluster on 127.0.0.1
(`spot.cluster.LocalCluster`), the tiny shapes model shipped with spotlight (4 heads, 64 image
tokens). Phases, one runtime (`JobQueue`) each:

1. determinism: the same job sampled by groups of degree 4, 2 and 1 (the pull scheduler); each
   decoded image against a single-process run of the stock transformer.
2. reform: a degree-4 group runs a job; once it is past a commit, one member's process gets
   SIGKILL. The clock starts just before the kill. Detection is the survivors' collectives failing
   (their sockets to the dead process close) and Ray reporting the dead actor's call; the driver
   learns of it through `ray.wait` on the members' `run` calls. The runtime fences the group,
   requeues the job from its last commit, re-forms the 3 survivors (degrees 2 and 1: 4 heads) as a
   new generation and starts them; `reform_s` ends when a survivor finishes its first step of the
   resumed job (worker-side `time.monotonic()`, a system-wide clock). The job then runs to the end
   and its image is checked against the uninterrupted single-process run.
3. join from a sibling: a new worker starts on the node, copies the weights from a sibling through
   the object store (version and sha256 checked), and the 4 form one group; `join_from_sibling_s`
   runs from the start request to the grown group's first step of a job.
4. cold restart (the usual path): a degree-4 group loses a member the same way; the driver waits
   for a replacement process that loads the model, fetches the weights from the store, and joins
   the 3 survivors in a fresh process group; `cold_restart_s` runs from the kill to its first step.
   Only the lost member restarts (the survivors stay warm), so this is a lower bound of the usual
   path (Ray Train and torchrun restart the whole group).

    python benchmarks/sp_reform.py --json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import tempfile
import time

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # bind every Ray process to 127.0.0.1 (spot.localray.import_ray_on_loopback)

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from functools import partial  # noqa: E402

from spot.cluster import LocalCluster  # noqa: E402
from spot.jobqueue import Job  # noqa: E402
from spot.pool import WorkerPool  # noqa: E402
from spot.runtime import Runtime  # noqa: E402
from spot.store import open_store  # noqa: E402
from spot.weights import publish_weights  # noqa: E402
from spotlight.config import DiTRecipe  # noqa: E402
from spotlight.jobs import DiTRunner, RolloutJob  # noqa: E402
from spotlight.policy import load_policy, trainable_state  # noqa: E402
from spotlight.rollout import rollout  # noqa: E402
from spotlight.sampling import qwen_image_sigmas  # noqa: E402

PROMPT = "a red circle"


def past_a_commit(rt, commit_every: int, timeout_s: float = 60.0) -> None:
    """Tick until the running job has a commit and a step past it."""
    import ray

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        rt.tick()
        leases = ray.get(rt.queue.snapshot.remote())["leases"]
        if leases and leases[0][3] >= commit_every and leases[0][4] > leases[0][3]:
            return
        time.sleep(0.005)
    raise TimeoutError("the job did not get past a commit")


def ended(rt) -> list:
    """Tick until a group's run ends; its outcomes."""
    while True:
        outcomes = rt.tick()
        if outcomes:
            return outcomes
        time.sleep(0.001)


def add_worker(pool, node: str, source: str, store_dir: str) -> tuple[str, dict]:
    """Start one worker on `node` and give it weights version 0 (from a sibling or the store)."""
    (w,) = pool.spawn(1, node)
    pool.wait_ready(len(pool.alive()) + 1, timeout_s=120)
    return w, pool.load_weights([w], 0, source=source, store_url=store_dir)[w]


def first_step_after(pool, workers, t0: float, sched=None, timeout_s: float = 120.0) -> float:
    """The earliest first step after t0 of a run of any of `workers` (ticking `sched` meanwhile)."""
    import ray

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if sched is not None:
            sched.tick()
        marks = ray.get([pool.actor(w).first_step.remote() for w in workers])
        after = [m for m in marks if m is not None and m > t0]
        if after:
            return min(after)
        time.sleep(0.002)
    raise TimeoutError("no first step")


def kill_member(pool, group) -> tuple[str, float]:
    """SIGKILL the process of the group's rank 1; returns (worker, time just before the kill)."""
    victim = group.members[1]
    pid = pool.pid(victim)
    t_kill = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    return victim, t_kill


def main() -> dict:
    import ray

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON line only")
    parser.add_argument("--num-steps", type=int, default=24, help="denoising steps per job")
    parser.add_argument("--commit-every", type=int, default=3)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    torch.set_num_threads(1)
    cfg = DiTRecipe()
    cfg.sample.num_steps, cfg.sample.noise_level, cfg.sample.autocast = args.num_steps, 0.7, "none"
    cfg.train.objective = "flow_grpo"
    policy = load_policy(cfg.model, trainable=False)
    sigmas = qwen_image_sigmas(args.num_steps, policy.latent_shape[0])
    cluster = LocalCluster(node_cpus=5)
    out: dict = {}
    try:
        node = cluster.add_node("spot-a", slots=4)
        ray.init(address=cluster.address, logging_level=logging.WARNING, log_to_driver=False)
        store_dir = tempfile.mkdtemp(prefix="sp-reform-store-")
        publish_weights(open_store(store_dir), 0, trainable_state(policy))
        # No automatic replacement of a killed worker: phases 3 and 4 start one themselves.
        pool = WorkerPool(
            partial(DiTRunner, cfg), sp_degree=4, worker_kwargs={"commit_every": args.commit_every}, respawn_delay_s=1e9
        )
        pool.wait_ready(4, timeout_s=120)
        pool.load_weights(pool.alive(), 0, store_url=store_dir)
        pids = {w: pool.pid(w) for w in pool.alive()}

        def job(job_id: int, seed: int) -> Job:
            return Job(job_id, RolloutJob([PROMPT], [seed], list(range(args.num_steps)), [args.num_steps]), num_steps=args.num_steps)

        def image_err(result, j: Job) -> float:
            ref = rollout(policy, [PROMPT], j.payload.seeds, sigmas, noise_level=0.7, sde_steps=j.payload.sde_steps)
            return (result.output.images - ref.images).abs().max().item()

        def runtime(degree: int, **kwargs) -> Runtime:
            pool.sp_degree = degree
            return Runtime(pool, tick_s=0.001, **kwargs)

        # 1. determinism across degrees
        errs = {}
        for degree in (4, 2, 1):
            rt = runtime(degree)
            j = job(degree, 11)
            rt.submit([j])
            (result,) = rt.run(120).results
            rt.close()
            errs[degree] = image_err(result, j)

        # 2. reform in place after a SIGKILL
        rt = runtime(4)
        j = job(10, 12)
        rt.submit([j])
        past_a_commit(rt, args.commit_every)
        (group,) = pool.running()
        victim, t_kill = kill_member(pool, group)
        outcomes = ended(rt)
        survivors = [w for w in group.members if w != victim]
        first = first_step_after(pool, survivors, t_kill, rt)
        new_groups = [g for g in pool.running() if set(g.members) <= set(survivors)]
        out["reform_s"] = first - t_kill
        out["detection_s"] = outcomes[0].ended_at - t_kill
        out["worker_detection_s"] = min(r.broken_at for r in outcomes[0].reports.values() if r.broken_at) - t_kill
        out["rendezvous_s"] = max(g.rendezvous_s for g in new_groups)
        report = rt.run(120)
        rt.close()
        errs["regrouped 4->2"] = image_err(report.results[0], j)
        out["pids_unchanged"] = all(pool.pid(w) == pids[w] for w in survivors)

        # 3. a newcomer joins from a sibling and the group grows back to 4
        rt = runtime(4, auto_form=False)
        t_join = time.monotonic()
        newcomer, how = add_worker(pool, node, "auto", store_dir)
        assert how["source"] == "sibling", how
        t_formed = time.monotonic()
        rt.form_free()
        j = job(20, 13)
        rt.submit([j])
        out["join_from_sibling_s"] = first_step_after(pool, [newcomer], t_join, rt) - t_join
        out["join_start_and_load_s"] = how["start_and_load_s"]
        out["join_sibling_copy_s"] = how["seconds"]
        out["join_model_load_s"] = how["load_s"]
        out["join_group_and_first_step_s"] = out["join_from_sibling_s"] - (t_formed - t_join)
        report = rt.run(120)
        rt.close()
        errs["grown 4"] = image_err(report.results[0], j)

        # 4. cold restart: a replacement process loads the model and the store's weights
        rt = runtime(4, auto_form=False)
        rt.form_free()
        j = job(30, 14)
        rt.submit([j])
        past_a_commit(rt, args.commit_every)
        (group,) = pool.running()
        victim, t_kill = kill_member(pool, group)
        ended(rt)
        replacement, how = add_worker(pool, node, "store", store_dir)
        t_formed = time.monotonic()
        rt.form_free()
        first = first_step_after(pool, [replacement], t_kill, rt)
        out["cold_restart_s"] = first - t_kill
        out["cold_start_and_load_s"] = how["start_and_load_s"]
        out["cold_store_fetch_s"] = how["seconds"]
        out["cold_model_load_s"] = how["load_s"]
        out["cold_group_and_first_step_s"] = first - t_formed
        report = rt.run(120)
        rt.close()
        errs["cold 4"] = image_err(report.results[0], j)

        out["speedup"] = out["cold_restart_s"] / out["reform_s"]
        out["max_abs_err_vs_single"] = max(errs[d] for d in (1, 2, 4))
        out["max_abs_err_after_regroups"] = max(v for k, v in errs.items() if isinstance(k, str))
        pool.close()
    finally:
        cluster.shutdown()
    first_keys = ["reform_s", "join_from_sibling_s", "cold_restart_s", "speedup", "max_abs_err_vs_single"]
    ordered = {k: out[k] for k in first_keys} | {k: v for k, v in out.items() if k not in first_keys}
    return {k: (round(v, 4) if isinstance(v, float) and not k.startswith("max_abs") else v) for k, v in ordered.items()}


if __name__ == "__main__":
    import contextlib

    # Ray's driver prints worker-death notices ("(raylet) A worker died ...") on stdout: keep stdout
    # for the JSON line.
    with contextlib.redirect_stdout(sys.stderr):
        result = main()
    print(json.dumps(result) if "--json" in sys.argv else json.dumps(result, indent=1))
