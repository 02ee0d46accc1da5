"""Elastic sequence parallelism: persistent SP workers on a real local Ray cluster, against one process.

Pure tests check the group plan and the weights' packing, checksum and store round trip. The Ray
tests start one cluster (an on-demand head and one spot node on 127.0.0.1) and four `SPWorker`s
with a tiny real model of 4 heads whose 24x40 image has 15 tokens (padded at degrees 2 and 4) and
whose prompts are padded to 16 tokens. Every image is compared with the same (prompt, seed) sampled
in this process by the stock transformer: degrees 4, 2 and 1 on the same four processes; a group of
4 whose rank 0 gets SIGKILL mid-trajectory, its survivors re-formed in place (degrees 2 and 1) and
the job resumed from its last commit; a newcomer that copies its weights from a sibling and grows
the pool back to one group of 4; a notice to one member, which commits and hands the job back with
no step lost. A sibling copy of the wrong version is refused. The tests share the pool and run in
file order (the kill leaves 3 workers, the newcomer makes 4 again).
"""

from __future__ import annotations

import os

# Bind every Ray process to 127.0.0.1; read when `ray` is first imported (design.md §4).
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

import logging
import signal
import time

import pytest
import torch

from spot.elastic import ElasticPool, ElasticScheduler, plan_groups
from spot.jobqueue import Job
from spot.scheduler import DenoiseSpec, sample_uninterrupted
from spot.sp_worker import (
    WeightsMismatchError,
    fetch_weights,
    pack_state,
    publish_weights,
    state_checksum,
    unpack_state,
)
from spot.store import IncompleteError, open_store

TOL = 1e-5
NUM_STEPS, COMMIT_EVERY = 8, 3
SPEC = DenoiseSpec(num_steps=NUM_STEPS, noise_level=0.7)
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
def model_cfg(tmp_path_factory):
    """A tiny real model with 4 heads; 24x40 pixels -> 3x5 = 15 image tokens; prompts padded to 16."""
    from spotlight.config import ModelConfig, TinyModelConfig
    from spotlight.rewards.shapes import all_prompts
    from spotlight.tiny import build_tiny_model

    spec = TinyModelConfig(codec_factor=4, num_layers=1, num_heads=4, head_dim=16, text_hidden=32)
    folder = build_tiny_model(tmp_path_factory.mktemp("tiny4") / "model", spec, all_prompts() + PROMPTS)
    return ModelConfig(path=str(folder), height=24, width=40, max_text_tokens=16)


@pytest.fixture(scope="module")
def policy(model_cfg):
    from spotlight.policy import load_policy

    return load_policy(model_cfg, trainable=False)


@pytest.fixture(scope="module")
def cluster():
    import ray

    from spot.replay import ReplayCluster

    c = ReplayCluster(node_cpus=6)
    try:
        c.add_node("spot-a")
        ray.init(address=c.address, logging_level=logging.WARNING, log_to_driver=False)
        yield c
    finally:
        c.shutdown()


@pytest.fixture(scope="module")
def pool(cluster, model_cfg, policy, tmp_path_factory):
    from spotlight.policy import trainable_state

    store_dir = tmp_path_factory.mktemp("weights-store")
    publish_weights(open_store(store_dir), 0, trainable_state(policy))
    p = ElasticPool(
        model_cfg, SPEC, store_url=str(store_dir),
        worker_kwargs={"commit_every": COMMIT_EVERY, "step_s": 0.05, "poll_s": 0.01},
    )  # fmt: skip
    try:
        how = p.add_workers(4, 0, node_id=cluster.node_id("spot-a"))
        # One fetched from the store (no sibling had version 0 yet), the others copied from it.
        assert sorted(h["source"] for h in how.values()) == ["sibling", "sibling", "sibling", "store"]
        # A sibling copy maps the object store's shared memory (read-only arrays), it does not copy it.
        assert all(h["zero_copy"] for h in how.values() if h["source"] == "sibling")
        yield p
    finally:
        p.close()


@pytest.fixture(scope="module")
def reference(policy):
    """Uninterrupted single-process final latents by (prompt, seed), single-threaded like the workers."""
    cache: dict = {}

    def get(job: Job) -> torch.Tensor:
        key = (job.prompt, job.seed)
        if key not in cache:
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                cache[key] = sample_uninterrupted(policy, job, SPEC)
            finally:
                torch.set_num_threads(threads)
        return cache[key]

    return get


def make_jobs(n: int, first_id: int) -> list[Job]:
    return [Job(i, PROMPTS[i % len(PROMPTS)], seed=500 + i) for i in range(first_id, first_id + n)]


def check_results(report, jobs, reference) -> None:
    assert report.lost == 0 and report.duplicated == 0
    assert sorted(r.job_id for r in report.results) == [j.job_id for j in jobs]
    by_id = {j.job_id: j for j in jobs}
    for r in report.results:
        err = (r.latent_LC - reference(by_id[r.job_id])).abs().max().item()
        assert err <= TOL, f"job {r.job_id}: {err} off the single-process run"


def degrees_of(pool, report) -> set[int]:
    return {pool.groups[o.group_id].degree for o in report.outcomes}


def test_sp_groups_match_one_process_at_degrees_4_2_1_without_restarts(pool, reference):
    pids = {w: pool.pid(w) for w in pool.alive()}
    for degree, first_id in ((4, 0), (2, 10), (1, 20)):
        sched = ElasticScheduler(pool, degree=degree)
        jobs = make_jobs(2, first_id)
        sched.submit(jobs)
        sched.run(timeout_s=60)
        report = sched.close()
        check_results(report, jobs, reference)
        assert degrees_of(pool, report) == {degree}
        assert {r.worker_id for r in report.results} <= {o.group_id for o in report.outcomes}
    # Re-forming 4 -> 2 -> 1 changed no process.
    assert {w: pool.pid(w) for w in pool.alive()} == pids
    assert [a for a in pool.events if a[2] == "dead"] == []


def test_a_sibling_copy_of_another_version_is_refused(pool):
    import ray

    a, b = pool.alive()[:2]
    with pytest.raises(WeightsMismatchError, match="asked for weights version 1, the sibling holds 0"):
        ray.get(pool.actor(b).copy_weights_from.remote(pool.actor(a), 1))
    assert ray.get(pool.actor(b).info.remote())["version"] == 0  # kept what it had
    # No sibling holds version 1: a newcomer would fetch it from the store.
    assert pool.sibling(pool.node_of(a), 1) is None
    assert pool.sibling(pool.node_of(a), 0, exclude=b) is not None


def test_a_member_killed_mid_trajectory_leaves_the_job_finishing_with_the_same_image(pool, reference):
    import ray

    assert len(pool.alive()) == 4
    pids = {w: pool.pid(w) for w in pool.alive()}
    sched = ElasticScheduler(pool, degree=4)
    jobs = make_jobs(1, 30)
    sched.submit(jobs)
    deadline = time.monotonic() + 60
    while True:  # until the group holds the job past a commit
        assert time.monotonic() < deadline, "the job never got past a commit"
        sched.tick(0.01)
        leases = ray.get(sched.queue.snapshot.remote())["leases"]
        if leases and leases[0][3] >= COMMIT_EVERY and leases[0][4] > leases[0][3]:
            break
    (group,) = pool.running()
    victim = group.members[0]  # rank 0: the member that holds the lease and commits
    os.kill(pool.pid(victim), signal.SIGKILL)
    sched.run(timeout_s=60)
    report = sched.close()
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


def test_a_newcomer_copies_from_a_sibling_and_the_pool_regroups_to_degree_4(cluster, pool, reference):
    alive = pool.alive()
    pids = {w: pool.pid(w) for w in alive}
    sched = ElasticScheduler(pool, degree=4)
    sched.tick()  # groups of the workers there now (3 after the kill: degrees 2 and 1)
    how = pool.add_workers(max(1, 4 - len(alive)), 0, node_id=cluster.node_id("spot-a"))
    assert {h["source"] for h in how.values()} == {"sibling"}
    sched.regroup()  # merges the fragments and the newcomer, without a restart
    (newcomer,) = how
    grown = [g for g in pool.running() if newcomer in g.members]
    assert grown and grown[0].degree == 4
    jobs = make_jobs(2, 40)
    sched.submit(jobs)
    sched.run(timeout_s=60)
    check_results(sched.close(), jobs, reference)
    assert {w: pool.pid(w) for w in alive} == pids


def test_a_notice_hands_the_job_back_with_nothing_lost_and_retires_the_member(pool, reference):
    import ray

    assert len(pool.alive()) == 4
    sched = ElasticScheduler(pool, degree=4)
    jobs = make_jobs(1, 50)
    sched.submit(jobs)
    deadline = time.monotonic() + 60
    while True:  # until the group is two steps into the job
        assert time.monotonic() < deadline, "the job never started"
        sched.tick(0.01)
        leases = ray.get(sched.queue.snapshot.remote())["leases"]
        if leases and leases[0][4] >= 2:
            break
    (group,) = pool.running()
    leaving = group.members[2]
    pool.notify(group.group_id, leaving=[leaving])  # e.g. its node's two-minute interruption notice
    sched.run(timeout_s=60)
    report = sched.close()
    check_results(report, jobs, reference)
    s = report.stats
    assert s.released == 1 and s.revoked == 0 and s.recomputed_steps == 0
    assert pool.workers[leaving].state == "retired" and leaving not in pool.alive()
    later = [pool.groups[o.group_id] for o in report.outcomes if o.group_id != group.group_id]
    assert sorted(g.degree for g in later) == [1, 2] and all(leaving not in g.members for g in later)
