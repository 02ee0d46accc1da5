"""Elastic sequence parallelism: the runtime's workers in SP groups on a real local Ray cluster,
against one process.

Pure tests check the group plan and the weights' packing, checksum and store round trip. The Ray
tests start one cluster (an on-demand head and one spot node with 4 slots on 127.0.0.1) and a
`WorkerPool` of four DiT runners with a tiny real model of 4 heads whose 24x40 image has 15 tokens
(padded at degrees 2 and 4) and whose prompts are padded to 16 tokens. Every image is compared with
the same (prompt, seed) sampled in this process by the stock transformer: degrees 4, 2 and 1 on the
same four processes; a group of 4 whose rank 0 gets SIGKILL mid-trajectory, its survivors re-formed
in place (degrees 2 and 1) and the job resumed from its last commit; a replacement that joins and
the fragments merge back into one group of 4; a notice to one member, which commits and hands the
job back with no step lost. A sibling copy of the wrong version is refused. The tests share the pool
and run in file order (the kill leaves 3 workers, the replacement makes 4 again).
"""

from __future__ import annotations

import os

# Bind every Ray process to 127.0.0.1; read when `ray` is first imported (spot.localray.import_ray_on_loopback).
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

import logging
import signal
import time
from functools import partial

import pytest
import torch

from spot.jobqueue import Job
from spot.pool import WorkerPool, plan_groups
from spot.runtime import Runtime
from spot.store import open_store
from spot.store_base import IncompleteError
from spot.weights import WeightsMismatchError, fetch_weights, pack_state, publish_weights, state_checksum, unpack_state

TOL = 1e-5
"""Ulysses splits each forward's tokens over the ranks: the sums come out in another order."""
NUM_STEPS, COMMIT_EVERY = 8, 3
PROMPTS = ["a red circle", "two blue squares on the left"]


# -- pure ---------------------------------------------------------------------------------------


def test_plan_groups_takes_the_largest_degree_that_divides_the_heads():
    four = [(f"w{i}", "a") for i in range(4)]
    assert plan_groups(four, 4, 4) == [["w0", "w1", "w2", "w3"]]
    assert plan_groups(four, 2, 4) == [["w0", "w1"], ["w2", "w3"]]
    assert plan_groups(four[:3], 4, 4) == [["w0", "w1"], ["w2"]]
    assert plan_groups(four, 4, 6) == [["w0", "w1", "w2"], ["w3"]]
    # Workers are taken node by node, so a pair stays on one node when it can.
    mixed = [("w0", "b"), ("w1", "a"), ("w2", "b"), ("w3", "a")]
    assert plan_groups(mixed, 2, 4) == [["w1", "w3"], ["w0", "w2"]]
    assert plan_groups(four, 4, None) == [["w0"], ["w1"], ["w2"], ["w3"]]  # a runner without SP steps
    with pytest.raises(ValueError, match="max_degree"):
        plan_groups(four, 0, 4)


def test_packed_weights_round_trip_and_any_change_breaks_the_checksum():
    state = {"a.weight": torch.randn(3, 5), "b.bias": torch.randn(7).to(torch.bfloat16), "c": torch.arange(6)}
    packed = pack_state(state)
    back = unpack_state(packed)
    assert all(torch.equal(back[k], v) and back[k].dtype == v.dtype for k, v in state.items())
    checksum = state_checksum(packed)
    assert checksum == state_checksum(pack_state({k: v.clone() for k, v in reversed(state.items())}))
    flipped = dict(state, **{"a.weight": state["a.weight"].clone()})
    flipped["a.weight"].view(torch.int32)[1, 2] ^= 1  # one bit
    assert state_checksum(pack_state(flipped)) != checksum
    renamed = {("z" if k == "c" else k): v for k, v in state.items()}
    assert state_checksum(pack_state(renamed)) != checksum
    reshaped = dict(state, c=state["c"].reshape(2, 3))
    assert state_checksum(pack_state(reshaped)) != checksum


def test_store_weights_round_trip(tmp_path):
    store = open_store(tmp_path / "store")
    state = {"w": torch.randn(4, 4), "v": torch.randn(2).to(torch.bfloat16)}
    publish_weights(store, 3, state)
    back = fetch_weights(store, 3)
    assert all(torch.equal(back[k], v) for k, v in state.items())
    with pytest.raises(IncompleteError):
        fetch_weights(store, 4)  # never published


# -- on a real local Ray cluster ----------------------------------------------------------------


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    """A tiny real model with 4 heads; 24x40 pixels -> 3x5 = 15 image tokens; prompts padded to 16."""
    from spotlight.config import DiTRecipe, TinyModelConfig
    from spotlight.core.config_io import from_dict
    from spotlight.rewards.shapes import all_prompts
    from spotlight.tiny import build_tiny_model

    spec = TinyModelConfig(codec_factor=4, num_layers=1, num_heads=4, head_dim=16, text_hidden=32)
    folder = build_tiny_model(tmp_path_factory.mktemp("tiny4") / "model", spec, all_prompts() + PROMPTS)
    data = {
        "model": {"path": str(folder), "height": 24, "width": 40, "max_text_tokens": 16},
        "sample": {"num_steps": NUM_STEPS, "noise_level": 0.7, "autocast": "none"},
        "train": {"objective": "flow_grpo"},
    }
    return from_dict(DiTRecipe, data)


@pytest.fixture(scope="module")
def policy(cfg):
    from spotlight.policy import load_policy

    return load_policy(cfg.model, trainable=False)


@pytest.fixture(scope="module")
def cluster():
    import ray

    from spot.cluster import LocalCluster

    c = LocalCluster(node_cpus=6)
    try:
        c.add_node("spot-a", slots=4)
        ray.init(address=c.address, logging_level=logging.WARNING, log_to_driver=False)
        yield c
    finally:
        c.shutdown()


@pytest.fixture(scope="module")
def pool(cluster, cfg, policy, tmp_path_factory):
    from spotlight.jobs import DiTRunner
    from spotlight.policy import trainable_state

    store_dir = tmp_path_factory.mktemp("weights-store")
    publish_weights(open_store(store_dir), 0, trainable_state(policy))
    p = WorkerPool(
        partial(DiTRunner, cfg),
        sp_degree=4,
        worker_kwargs={"commit_every": COMMIT_EVERY, "step_s": 0.05, "poll_s": 0.01},
    )
    try:
        p.wait_ready(4, timeout_s=120)  # one per slot of the node
        how = p.load_weights(p.alive(), 0, store_url=str(store_dir))
        # One fetched from the store (no sibling had version 0 yet), the others copied from it.
        assert sorted(h["source"] for h in how.values()) == ["sibling", "sibling", "sibling", "store"]
        # A sibling copy maps the object store's shared memory (read-only arrays), it does not copy it.
        assert all(h["zero_copy"] for h in how.values() if h["source"] == "sibling")
        yield p
    finally:
        p.close()


@pytest.fixture(scope="module")
def reference(cfg, policy):
    """Uninterrupted single-process final latents by (prompt, seed), from the trainer's own rollout."""
    from spotlight.rollout import rollout
    from spotlight.sampling import qwen_image_sigmas

    sigmas = qwen_image_sigmas(NUM_STEPS, policy.latent_shape[0])
    cache: dict = {}

    def get(job: Job) -> torch.Tensor:
        key = (job.payload.prompts[0], job.payload.seeds[0])
        if key not in cache:
            ro = rollout(policy, [key[0]], [key[1]], sigmas, noise_level=0.7, sde_steps=list(range(NUM_STEPS)))
            cache[key] = ro.trajectory.final[0]
        return cache[key]

    return get


def make_jobs(n: int, first_id: int) -> list[Job]:
    from spotlight.jobs import RolloutJob

    return [
        Job(
            i,
            RolloutJob([PROMPTS[i % len(PROMPTS)]], [500 + i], list(range(NUM_STEPS)), [NUM_STEPS]),
            num_steps=NUM_STEPS,
        )
        for i in range(first_id, first_id + n)
    ]


def start(pool, policy, degree: int, **kwargs) -> Runtime:
    """A fresh runtime on the pool at SP degree `degree`, with the model's weights as version 0."""
    from spotlight.policy import trainable_state

    pool.sp_degree = degree
    rt = Runtime(pool, tick_s=0.01, **kwargs)
    rt.publish(0, trainable_state(policy))
    return rt


def check_results(report, jobs, reference) -> None:
    assert report.lost == 0 and report.duplicated == 0
    assert sorted(r.job_id for r in report.results) == [j.job_id for j in jobs]
    by_id = {j.job_id: j for j in jobs}
    for r in report.results:
        err = (r.output.latents[-1][0] - reference(by_id[r.job_id])).abs().max().item()
        assert err <= TOL, f"job {r.job_id}: {err} off the single-process run"


def degrees_of(pool, report) -> set[int]:
    return {pool.groups[o.group_id].degree for o in report.outcomes}


def test_sp_groups_match_one_process_at_degrees_4_2_1_without_restarts(pool, policy, reference):
    pids = {w: pool.pid(w) for w in pool.alive()}
    for degree, first_id in ((4, 0), (2, 10), (1, 20)):
        rt = start(pool, policy, degree)
        jobs = make_jobs(2, first_id)
        rt.submit(jobs)
        rt.run(timeout_s=60)
        report = rt.close()
        check_results(report, jobs, reference)
        assert degrees_of(pool, report) == {degree}
        assert {r.worker_id for r in report.results} <= {o.group_id for o in report.outcomes}
    # Re-forming 4 -> 2 -> 1 changed no process.
    assert {w: pool.pid(w) for w in pool.alive()} == pids
    assert [e for e in pool.events if e[2] == "died"] == []


def test_a_sibling_copy_of_another_version_is_refused(pool):
    import ray

    a, b = pool.alive()[:2]
    with pytest.raises(WeightsMismatchError, match="asked for weights version 1, the sibling holds 0"):
        ray.get(pool.actor(b).copy_weights_from.remote(pool.actor(a), 1))
    assert ray.get(pool.actor(b).info.remote())["version"] == 0  # kept what it had
    # No sibling holds version 1: a newcomer would fetch it from the store.
    assert pool.sibling(pool.node_of(a), 1) is None
    assert pool.sibling(pool.node_of(a), 0, exclude=b) is not None


def test_a_member_killed_mid_trajectory_leaves_the_job_finishing_with_the_same_image(pool, policy, reference):
    import ray

    assert len(pool.alive()) == 4
    pool.respawn_delay_s = 1e9  # no replacement in its slot during this test (the next one adds it)
    pids = {w: pool.pid(w) for w in pool.alive()}
    rt = start(pool, policy, 4)
    jobs = make_jobs(1, 30)
    rt.submit(jobs)
    deadline = time.monotonic() + 60
    while True:  # until the group holds the job past a commit
        assert time.monotonic() < deadline, "the job never got past a commit"
        rt.tick()
        leases = ray.get(rt.queue.snapshot.remote())["leases"]
        if leases and leases[0][3] >= COMMIT_EVERY and leases[0][4] > leases[0][3]:
            break
    (group,) = pool.running()
    victim = group.members[0]  # rank 0: the member that holds the lease and commits
    os.kill(pool.pid(victim), signal.SIGKILL)
    rt.run(timeout_s=60)
    report = rt.close()
    check_results(report, jobs, reference)
    broken = [o for o in report.outcomes if o.group_id == group.group_id]
    assert broken and broken[0].dead == [victim] and broken[0].broken
    assert all(r.broken for r in broken[0].reports.values())  # the survivors saw the collective fail
    s = report.stats
    assert s.revoked == 1 and 1 <= s.recomputed_steps <= COMMIT_EVERY and report.results[0].num_leases == 2
    # The three survivors were re-formed in place (degrees 2 and 1) and none restarted.
    survivors = sorted(set(pids) - {victim})
    assert sorted(pool.alive()) == survivors
    assert {w: pool.pid(w) for w in survivors} == {w: pids[w] for w in survivors}
    later = [pool.groups[o.group_id] for o in report.outcomes if o.group_id != group.group_id]
    assert sorted(g.degree for g in later) == [1, 2]
    assert all(g.generation > group.generation for g in later)


def test_a_replacement_joins_and_the_fragments_merge_back_into_degree_4(pool, policy, reference):
    """The slot freed by the kill gets a new worker; the survivors run as degrees 2 and 1 meanwhile,
    then merge with it into one group of 4 (no restart); its weights come through the queue."""
    survivors = pool.alive()
    pids = {w: pool.pid(w) for w in survivors}
    pool.respawn_delay_s = 0.0
    rt = start(pool, policy, 4)
    deadline = time.monotonic() + 120
    fragments = set()
    while True:
        assert time.monotonic() < deadline, f"no group of 4 with the newcomer: {[g.members for g in pool.running()]}"
        rt.tick()
        fragments |= {g.degree for g in pool.running() if set(g.members) <= set(survivors)}
        grown = [g for g in pool.running() if g.degree == 4]
        if grown:
            break
        time.sleep(0.02)
    assert fragments == {1, 2}  # the survivors served as degrees 2 and 1 before the newcomer was ready
    (newcomer,) = set(grown[0].members) - set(survivors)
    jobs = make_jobs(2, 40)
    rt.submit(jobs)
    rt.run(timeout_s=60)
    report = rt.close()
    check_results(report, jobs, reference)
    assert {w: pool.pid(w) for w in survivors} == pids
    assert pool.workers[newcomer].version == 0 or report.stats.weight_updates >= 1


def test_a_notice_hands_the_job_back_with_nothing_lost_and_retires_the_member(pool, policy, reference):
    import ray

    assert len(pool.alive()) == 4
    pool.respawn_delay_s = 1e9
    rt = start(pool, policy, 4)
    jobs = make_jobs(1, 50)
    rt.submit(jobs)
    deadline = time.monotonic() + 60
    while True:  # until the group is two steps into the job
        assert time.monotonic() < deadline, "the job never started"
        rt.tick()
        leases = ray.get(rt.queue.snapshot.remote())["leases"]
        if leases and leases[0][4] >= 2:
            break
    (group,) = pool.running()
    leaving = group.members[2]
    pool.notify(group.group_id, leaving=[leaving])  # e.g. its node's two-minute interruption notice
    rt.run(timeout_s=60)
    report = rt.close()
    check_results(report, jobs, reference)
    s = report.stats
    assert s.released == 1 and s.revoked == 0 and s.recomputed_steps == 0
    assert pool.workers[leaving].state == "retired" and leaving not in pool.alive()
    later = [pool.groups[o.group_id] for o in report.outcomes if o.group_id != group.group_id]
    assert sorted(g.degree for g in later) == [1, 2] and all(leaving not in g.members for g in later)
