"""The spot runtime: the queue's lease logic (pure), a runner resuming from a commit, then fault
injection on a real local Ray cluster.

Pure tests drive `JobQueue` with a fake clock and cut trace windows. The Ray tests start one
cluster per module (an on-demand head and two spot nodes on 127.0.0.1, one with a 4x slower step)
and one worker pool of DiT runners (`spotlight.jobs.DiTRunner`, the tiny real model); each test
runs a fresh runtime (queue) on it and kills what it needs: a worker (`ray.kill`), a worker right
after it sent a commit (`os._exit`), a whole node (SIGKILL), or warns a worker first (a notice).
Each asserts that every job was delivered exactly once and that its output equals, bit for bit,
the same (prompt, seed) sampled without interruption.
"""

from __future__ import annotations

import os

# Bind every Ray process to 127.0.0.1; read when `ray` is first imported (spot.localray.import_ray_on_loopback).
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

import logging
import sys
import time
from functools import partial
from pathlib import Path

import pytest
import torch

from spot.jobqueue import (
    ACCEPTED,
    HANDOFF,
    IGNORED,
    STALE,
    STOP,
    WAIT,
    YIELD,
    Job,
    JobQueue,
    WeightsUpdate,
    least_loaded,
)
from spot.pool import WorkerPool
from spot.replay import busiest_window, fit_trace, preemptions_of_working_nodes, shortest_busy_window, window
from spot.runtime import Runtime
from spot.traces import Trace
from spot.worker import Worker

PROMPTS = ["a red circle", "two blue squares", "a green triangle"]


def make_jobs(n: int, first_id: int = 0, num_steps: int = 10) -> list[Job]:
    """Jobs whose payload is one (prompt, seed) row (the queue never reads it)."""
    return [Job(i, (PROMPTS[i % len(PROMPTS)], 1000 + i), num_steps=num_steps) for i in range(first_id, first_id + n)]


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def latent(step: int) -> torch.Tensor:
    return torch.full((4, 3), float(step))


# -- the queue, without Ray ---------------------------------------------------------------------


def test_queue_hands_each_job_out_once_and_delivers_each_result_once():
    q = JobQueue()
    q.submit(make_jobs(3))
    leases = [q.pull("a"), q.pull("b"), q.pull("c")]
    assert [ls.job.job_id for ls in leases] == [0, 1, 2]
    assert len({ls.lease_id for ls in leases}) == 3
    assert q.pull("d") == WAIT
    for ls in leases:
        assert ls.step == 0 and ls.state is None
        assert q.complete(ls.lease_id, 10, latent(10)) == ACCEPTED
        assert q.complete(ls.lease_id, 10, latent(10)) == STALE  # a retried result is not delivered twice
    assert [r.job_id for r in q.results()] == [0, 1, 2]
    assert [r.job_id for r in q.results(2)] == [2]  # the caller has the first two: they are dropped
    assert [r.job_id for r in q.results(2)] == [2]  # re-reading from the same cursor is safe
    with pytest.raises(ValueError, match="already taken"):
        q.results(0)
    assert q.stats.done == 3 and q.stats.stale_results == 3
    q.close()
    assert q.pull("a") == STOP


def fast_then_slow(q: JobQueue, clock: FakeClock, fast, slow) -> None:
    """Ten seconds of two leases: the fast worker 1 s per step (it completes its job), the slow one 4 s."""
    for step in range(1, 11):
        clock.now = float(step)
        if step < 10:
            assert q.progress(fast.lease_id, step) == ACCEPTED
        if step % 4 == 0:
            assert q.progress(slow.lease_id, step // 4) == ACCEPTED
    assert q.complete(fast.lease_id, 10, latent(10)) == ACCEPTED


def test_a_free_fast_worker_takes_the_tail_job_over_from_a_slow_one():
    """Tail hand-off: the slow holder commits its current step and the fast worker resumes from it."""
    clock = FakeClock()
    q = JobQueue(clock=clock, handoff=True, lease_timeout_s=100)
    q.submit(make_jobs(2))
    slow, fast = q.pull("slow"), q.pull("fast")
    fast_then_slow(q, clock, fast, slow)
    assert q.pull("fast") == WAIT  # nothing pending: it asks for the slow worker's job
    clock.now = 12.0
    assert q.progress(slow.lease_id, 3) == HANDOFF
    assert q.commit(slow.lease_id, 3, latent(3), release=True) == ACCEPTED
    assert q.pull("slow") == WAIT  # reserved for the worker that asked
    took = q.pull("fast")
    assert (took.job.job_id, took.step) == (slow.job.job_id, 3) and torch.equal(took.state, latent(3))
    assert q.complete(took.lease_id, 10, latent(10)) == ACCEPTED
    assert sorted(r.job_id for r in q.results()) == [0, 1]
    assert q.stats.handoffs == 1 and q.stats.recomputed_steps == 0


def test_a_job_that_opts_out_of_the_hand_off_stays_with_its_slow_holder():
    """Job.handoff=False (exploration: nobody waits for it) is never moved to a free faster worker."""
    clock = FakeClock()
    q = JobQueue(clock=clock, handoff=True, lease_timeout_s=100)
    q.submit([Job(0, num_steps=10), Job(1, num_steps=10, handoff=False)])
    fast, slow = q.pull("fast"), q.pull("slow")
    assert slow.job.job_id == 1
    fast_then_slow(q, clock, fast, slow)
    assert q.pull("fast") == WAIT
    clock.now = 12.0
    assert q.progress(slow.lease_id, 3) == ACCEPTED  # where the hand-off answered HANDOFF
    assert q.complete(slow.lease_id, 10, latent(10)) == ACCEPTED
    assert q.stats.handoffs == 0


def test_the_lease_log_says_who_ran_which_steps_of_each_job_and_how_each_lease_ended():
    clock = FakeClock()
    q = JobQueue(clock=clock, lease_timeout_s=100)
    q.submit(make_jobs(3))
    a, b, c = q.pull("a"), q.pull("b"), q.pull("c")
    q.progress(a.lease_id, 1)
    q.commit(a.lease_id, 2, latent(2))
    q.progress(a.lease_id, 3)
    q.worker_lost("a")  # dies past its commit: step 3 is recomputed
    q.commit(b.lease_id, 4, latent(4), release=True)  # a notice: commits and hands the job back
    q.cancel([c.job.job_id])
    resumed = [q.pull("d"), q.pull("e")]
    assert sorted((ls.job.job_id, ls.step) for ls in resumed) == [(0, 2), (1, 4)]
    for ls in resumed:
        q.complete(ls.lease_id, 10, latent(10))
    log = q.lease_log()
    got = [(r["job"], r["worker"], r["from_step"], r["to_step"], r["end"], r["recomputed"]) for r in log]
    assert got[:3] == [(0, "a", 0, 2, "revoked", 1), (1, "b", 0, 4, "released", 0), (2, "c", 0, 0, "cancelled", 0)]
    assert sorted(got[3:]) == [
        (0, "e", 2, 10, "completed", 0),
        (1, "d", 4, 10, "completed", 0),
    ]  # the last released first
    assert q.lease_log(3) == log[3:]


def test_no_hand_off_when_it_would_not_pay_or_is_disabled():
    for handoff, slow_s in ((True, 1.2), (False, 4.0)):  # barely slower / hand-off off (push)
        clock = FakeClock()
        q = JobQueue(clock=clock, handoff=handoff, lease_timeout_s=100)
        q.submit(make_jobs(2))
        slow, fast = q.pull("slow"), q.pull("fast")
        clock.now = slow_s
        q.progress(slow.lease_id, 1)
        for step in range(1, 11):  # 1 s per step
            clock.now = float(step)
            q.progress(fast.lease_id, step)
        q.complete(fast.lease_id, 10, latent(10))
        assert q.pull("fast") == WAIT
        clock.now = 2 * slow_s
        assert q.progress(slow.lease_id, 2) == ACCEPTED, (handoff, slow_s)
        assert q.stats.handoffs == 0


def test_a_hand_off_to_a_worker_that_died_is_forgotten():
    clock = FakeClock()
    q = JobQueue(clock=clock, handoff=True, lease_timeout_s=100)
    q.submit(make_jobs(2))
    slow, fast = q.pull("slow"), q.pull("fast")
    clock.now = 1.0
    q.progress(fast.lease_id, 1)
    clock.now = 4.0
    q.progress(slow.lease_id, 1)
    q.complete(fast.lease_id, 10, latent(10))
    assert q.pull("fast") == WAIT
    q.worker_lost("fast")
    assert q.progress(slow.lease_id, 2) == ACCEPTED  # the slow worker keeps its job


def test_commits_are_idempotent_and_never_move_a_job_back():
    q = JobQueue()
    q.submit(make_jobs(1))
    ls = q.pull("a")
    assert q.commit(ls.lease_id, 4, latent(4)) == ACCEPTED
    assert q.commit(ls.lease_id, 4, latent(99)) == IGNORED  # the same commit again
    assert q.commit(ls.lease_id, 2, latent(2)) == IGNORED  # an older one, late
    q.worker_lost("a")
    resumed = q.pull("b")
    assert resumed.step == 4 and torch.equal(resumed.state, latent(4))


def test_a_death_seen_after_the_lease_timed_out_still_names_the_job_it_hit():
    """A node killed without a word may be declared dead after its lease expired and its job
    resumed elsewhere: the death still took that job (the runtime counts the node as hit)."""
    now = [0.0]
    q = JobQueue(lease_timeout_s=5.0, clock=lambda: now[0])
    q.submit(make_jobs(2))
    q.pull("a")
    now[0] = 6.0
    assert q.expire() == [0]
    assert q.worker_lost("b") == []
    assert q.worker_lost("a") == [0]
    assert q.worker_lost("a") == []  # said once


def test_a_lost_worker_is_fenced_and_its_late_messages_are_dropped():
    q = JobQueue()
    q.submit(make_jobs(1))
    old = q.pull("a")
    q.commit(old.lease_id, 4, latent(4))
    q.progress(old.lease_id, 6)  # two steps past the commit, then the worker dies
    assert q.worker_lost("a") == [0]
    assert q.pull("a") == STOP  # fenced: a worker declared dead that was only slow takes nothing more
    new = q.pull("b")
    assert new.lease_id != old.lease_id and new.step == 4
    assert q.commit(old.lease_id, 8, latent(8)) == STALE
    assert q.progress(old.lease_id, 9) == STALE
    assert q.complete(old.lease_id, 10, latent(10)) == STALE
    assert q.complete(new.lease_id, 10, latent(10)) == ACCEPTED
    (result,) = q.results()
    assert result.worker_id == "b" and result.num_leases == 2
    s = q.stats
    assert (s.revoked, s.recomputed_steps, s.max_recomputed_steps, s.stale_results) == (1, 2, 2, 1)
    assert s.stale_messages == 3


def test_a_silent_worker_loses_its_lease_after_the_timeout():
    clock = FakeClock()
    q = JobQueue(lease_timeout_s=5.0, clock=clock)
    q.submit(make_jobs(1))
    ls = q.pull("a")
    clock.now = 4.0
    assert q.progress(ls.lease_id, 1) == ACCEPTED  # renews until 9 s
    clock.now = 8.0
    assert q.pull("b") == WAIT
    clock.now = 9.5
    new = q.pull("b")  # expired on the way
    assert new.job.job_id == 0 and new.step == 0
    assert q.commit(ls.lease_id, 4, latent(4)) == STALE  # it was only slow: its commit comes too late
    assert q.stats.revoked == 1 and q.stats.recomputed_steps == 1
    # Not fenced: a slow worker may take new work.
    q.submit(make_jobs(1, first_id=1))
    assert q.pull("a").job.job_id == 1


def test_a_notice_commits_and_hands_back_with_nothing_to_recompute():
    q = JobQueue()
    q.submit(make_jobs(2))
    ls = q.pull("a")
    q.commit(ls.lease_id, 4, latent(4))
    q.progress(ls.lease_id, 5)
    assert q.commit(ls.lease_id, 5, latent(5), release=True) == ACCEPTED
    resumed = q.pull("b")  # first in line again, ahead of job 1
    assert resumed.job.job_id == 0 and resumed.step == 5 and torch.equal(resumed.state, latent(5))
    assert q.stats.released == 1 and q.stats.recomputed_steps == 0


def test_a_worker_pulling_again_gives_up_the_job_it_held():
    q = JobQueue()
    q.submit(make_jobs(1))
    first = q.pull("a")
    again = q.pull("a")
    assert again.job.job_id == 0 and again.lease_id != first.lease_id
    assert q.commit(first.lease_id, 2, latent(2)) == STALE


def test_push_assignment_and_repush():
    q = JobQueue()
    jobs = make_jobs(4)
    q.submit(jobs, assignees=["a", "b", "a", "b"])
    assert q.pull("c") == WAIT  # pushed jobs are not up for grabs
    ls = q.pull("a")
    assert ls.job.job_id == 0
    q.commit(ls.lease_id, 3, latent(3))
    q.worker_lost("a")
    assert q.loads(["a", "b", "c"]) == {"a": 2, "b": 2, "c": 0}
    # Least loaded: b holds two unfinished jobs, c none, so both of a's go to c.
    assert sorted(q.reassign("a", ["b", "c"])) == [0, 2]
    assert q.loads(["b", "c"]) == {"b": 2, "c": 2}
    resumed = q.pull("c")  # job 0, first in line again, from its commit
    assert resumed.job.job_id == 0 and resumed.step == 3
    assert q.pull("b").job.job_id == 1
    with pytest.raises(ValueError, match="already submitted"):
        q.submit(make_jobs(1))


def test_least_loaded_fills_the_emptiest_worker_first():
    assert least_loaded({"a": 2, "b": 0, "c": 1}, 4) == ["b", "b", "c", "a"]
    assert least_loaded({"a": 0, "b": 0}, 3) == ["a", "b", "a"]  # ties: round robin in order
    with pytest.raises(ValueError, match="no workers"):
        least_loaded({}, 1)


def test_jobs_of_a_new_version_wait_for_its_weights_then_workers_update_through_the_queue():
    q = JobQueue(handoff=True)
    q.submit([Job(0, version=0, num_steps=8)])
    q.submit([Job(1, version=1, num_steps=8), Job(2, version=1, num_steps=8)])
    first = q.pull("a", 0)
    assert first.job.job_id == 0  # its own version first
    assert q.pull("b", 0) == WAIT  # version 1 is not published yet: its jobs wait
    q.publish(1, ["w1"])
    update = q.pull("b", 0)
    assert update == WeightsUpdate(1, ["w1"])
    assert q.pull("b", 1).job.job_id == 1
    q.complete(first.lease_id, 8, latent(8))
    assert q.published_versions() == [1]
    assert q.pull("a", 0) == WeightsUpdate(1, ["w1"])  # the version-0 worker catches up the same way
    assert q.pull("a", 1).job.job_id == 2
    assert q.stats.weight_updates == 2


def test_a_worker_goes_back_to_an_older_version_when_only_its_jobs_are_left():
    q = JobQueue()
    q.submit([Job(0, version=0, num_steps=8)])
    q.publish(0, ["w0"])
    q.publish(1, ["w1"])
    assert q.published_versions() == [0, 1]  # job 0 still needs version 0
    assert q.pull("a", 1) == WeightsUpdate(0, ["w0"])  # otherwise job 0 would wait forever
    ls = q.pull("a", 0)
    q.complete(ls.lease_id, 8, latent(8))
    assert q.published_versions() == [1]  # the newest stays for workers that join later


def test_no_hand_off_to_a_worker_holding_other_weights():
    clock = FakeClock()
    q = JobQueue(clock=clock, handoff=True, handoff_margin=1.0)
    q.submit([Job(0, version=1, num_steps=8), Job(1, version=1, num_steps=8), Job(2, version=0, num_steps=8)])
    q.publish(1, ["w1"])
    slow, fast = q.pull("slow", 1), q.pull("fast", 0)
    assert fast.job.job_id == 2
    for k in range(1, 3):  # fast does 1 s per step, slow 4 s
        clock.now = 4.0 * k
        q.progress(slow.lease_id, k)
        q.progress(fast.lease_id, 2 * k)
    q.complete(fast.lease_id, 8, latent(8))
    other = q.pull("other", 1)
    assert other.job.job_id == 1
    assert q.pull("fast", 0) == WAIT  # nothing of version 0 left and no version-0 lease to take over
    assert q.progress(slow.lease_id, 3) == ACCEPTED
    assert q.pull("fast", 1) == WAIT  # with version 1 it may ask for the slow job
    assert q.progress(slow.lease_id, 4) == HANDOFF


def test_a_job_of_better_priority_makes_a_running_one_yield_at_its_next_report():
    """Exploration (priority 1) yields to a rollout (priority 0): commit the current step, release,
    and the rollout is pulled first; the yielded job resumes from that commit with nothing lost."""
    q = JobQueue()
    q.submit([Job(0, num_steps=10, priority=1, kind="explore")])
    explore = q.pull("a")
    assert q.progress(explore.lease_id, 1) == ACCEPTED  # nothing better waits
    q.submit([Job(1, num_steps=10, priority=0, kind="rollout")])
    assert q.progress(explore.lease_id, 2) == YIELD
    assert q.commit(explore.lease_id, 2, latent(2), release=True) == ACCEPTED
    assert q.pull("a").job.job_id == 1  # the rollout first
    resumed = q.pull("b")
    assert resumed.job.job_id == 0 and resumed.step == 2 and torch.equal(resumed.state, latent(2))
    assert q.stats.yielded == 1 and q.stats.recomputed_steps == 0
    assert q.stats_by_kind["explore"].yielded == 1 and q.stats_by_kind["rollout"].yielded == 0


def test_no_yield_for_a_job_the_worker_could_not_take():
    q = JobQueue()
    q.submit([Job(0, num_steps=10, priority=1)])
    running = q.pull("a", 0, pool="spot")
    q.submit([Job(1, num_steps=10, priority=0, version=5)])  # weights 5 not published: it waits anyway
    q.submit([Job(2, num_steps=10, priority=0, pools=("on_demand",))])  # not for a spot worker
    assert q.progress(running.lease_id, 1) == ACCEPTED
    assert q.pull("b", 0, pool="spot") == WAIT
    assert q.pull("c", 0, pool="on_demand").job.job_id == 2
    q.publish(5, ["w5"])
    assert q.commit(running.lease_id, 2, latent(2)) == YIELD  # applied, and now it should go
    assert q.pull("a", 0, pool="spot") == WeightsUpdate(5, ["w5"])


def test_cancelled_jobs_leave_the_line_and_their_holders_abandon_them():
    q = JobQueue()
    q.submit(make_jobs(3))
    running = q.pull("a")
    assert sorted(q.cancel([0, 1, 99])) == [0, 1]  # an unknown id is ignored
    assert q.progress(running.lease_id, 1) == STALE
    assert q.pull("b").job.job_id == 2
    assert q.pull("c") == WAIT
    assert q.stats.cancelled == 2 and q.cancel([0]) == []


def test_a_lost_worker_also_loses_the_step_it_was_computing():
    q = JobQueue()
    q.submit(make_jobs(2, num_steps=10))
    a, b = q.pull("a"), q.pull("b")
    q.commit(a.lease_id, 4, latent(4))
    q.progress(a.lease_id, 5)
    q.worker_lost("a")  # died during step 6
    q.progress(b.lease_id, 3)
    q.pull("b")  # it pulls again: it abandoned its job, it was computing nothing
    s = q.stats
    assert (s.recomputed_steps, s.steps_in_flight_lost, s.revoked) == (1 + 3, 1, 2)


# -- a runner resuming from a commit, without Ray ------------------------------------------------


def tiny_cfg(model_dir, **sample):
    from spotlight.config import DiTRecipe
    from spotlight.core.config_io import from_dict

    data = {
        "model": {"path": str(model_dir), "height": 32, "width": 32, "max_text_tokens": 16},
        "sample": {"num_steps": NUM_STEPS, "noise_level": 0.7, "autocast": "none", **sample},
        "reward": {"weights": {"jpeg_compressibility": 1.0}},
        "train": {"objective": "flow_grpo", "group_size": 2},
        "explore": {"batch_size": 2},
    }
    return from_dict(DiTRecipe, data)


def row_job(job_id: int, version: int = 0) -> Job:
    """One (prompt, seed) row as a rollout job of the DiT runner; every latent kept."""
    from spotlight.jobs import RolloutJob

    prompt, seed = PROMPTS[job_id % len(PROMPTS)], 1000 + job_id
    payload = RolloutJob([prompt], [seed], list(range(NUM_STEPS)), list(range(NUM_STEPS + 1)))
    return Job(job_id, payload, version=version, num_steps=NUM_STEPS, kind="rollout")


def uninterrupted(policy, job: Job) -> torch.Tensor:
    """The final latent of the job's row, sampled in one go by the trainer's own rollout."""
    from spotlight.rollout import rollout
    from spotlight.sampling import qwen_image_sigmas

    p = job.payload
    sigmas = qwen_image_sigmas(NUM_STEPS, policy.latent_shape[0])
    return rollout(policy, p.prompts, p.seeds, sigmas, noise_level=0.7, sde_steps=p.sde_steps).trajectory.final[0]


def test_a_runner_resumed_from_a_commit_gives_the_uninterrupted_bits(tiny_model_dir):
    """Rollout and exploration jobs: start, 3 steps, commit; a second runner resumes from the
    commit and finishes; the output equals the uninterrupted job's (and the trainer's rollout)."""
    from spotlight.jobs import DiTRunner
    from spotlight.seed_selection import ExploreJob

    cfg = tiny_cfg(tiny_model_dir)
    first, second = DiTRunner(cfg), DiTRunner(cfg)

    def run(runner, payload, state=None, upto=None):
        state = state or runner.start(payload, 0, None)
        while not runner.finished(state) and (upto is None or state.step < upto):
            state = runner.advance(state)
        return state

    job = row_job(0)
    saved = first.commit(run(first, job.payload, upto=3))
    resumed = second.output(run(second, job.payload, second.start(job.payload, 3, saved)))
    whole = first.output(run(first, job.payload))
    assert torch.equal(resumed.latents, whole.latents) and torch.equal(resumed.log_probs, whole.log_probs)
    assert torch.equal(whole.latents[-1][0], uninterrupted(first.policy, job))
    # Exploration: 3 rows in chunks of 2; resumed mid-way through the second chunk.
    explore = ExploreJob(0, 0, PROMPTS, [0, 0, 1], [0, 1, 2], [7, 8, 9], list(range(NUM_STEPS)))
    state = run(first, explore, upto=3)
    while state.chunk == 0 or state.step < 3:
        state = first.advance(state)
    saved = first.commit(state)
    a = second.output(run(second, explore, second.start(explore, 0, saved)))
    b = first.output(run(first, explore))
    assert a.rewards == b.rewards and len(a.rewards) == 3 and a.complete


# -- fitting traces to the cluster ---------------------------------------------------------------


def test_window_starts_with_the_nodes_alive_then():
    trace = Trace.from_counts([0, 10, 20, 30], [3, 1, 2, 0], duration_s=40, source="t", format="rescaled")
    w = window(trace, 15, 20)
    assert w.availability() == [(0.0, 1), (5.0, 2), (15.0, 0)]
    assert w.duration_s == 20 and w.num_preemptions == 2
    # Two preemptions at 10 s and two at 30 s: the earlier wins, starting a tenth of 12 s ahead.
    assert busiest_window(trace, 12) == pytest.approx(8.8)


def test_stretches_rank_by_preemptions_that_can_end_work():
    # Nodes 0-1 from t=0; a third joins at 100 and goes at 105 (too young to hold work), a fourth
    # joins at 200 and goes at 300, then node-1 goes at 400.
    trace = Trace.from_counts(
        [0, 100, 105, 200, 300, 400], [2, 3, 2, 3, 2, 1], duration_s=500, source="t", format="rescaled"
    )
    assert trace.num_preemptions == 3
    assert preemptions_of_working_nodes(trace) == 3
    assert preemptions_of_working_nodes(trace, min_age_s=50) == 2  # the 5-s node does not count
    assert preemptions_of_working_nodes(trace, min_age_s=150) == 1  # nor the 100-s one; node-1 was there at 0
    # 60-s stretches: the earliest with a preemption is [99, 159), but it only ends a 5-s node.
    assert busiest_window(trace, 60) == pytest.approx(99.0)
    assert busiest_window(trace, 60, min_age_s=50) == pytest.approx(294.0)
    # Two preemptions of working nodes need [~280, ~480): 200 s, the first length tried that holds them.
    assert shortest_busy_window(trace, min_preemptions=2, min_age_s=50, first_s=100, step_s=100) == 200
    assert shortest_busy_window(trace, min_preemptions=5, first_s=100, step_s=100) == 500  # never: all of it


def test_shipped_traces_default_to_a_stretch_with_four_preemptions_of_working_nodes():
    for name, nodes in (("parcae-p3-aws.csv", 3), ("bamboo-g4dn-us-east-1c.csv", 3)):
        path = Path(__file__).resolve().parents[1] / "traces" / name
        fitted, _ = fit_trace(path, nodes=nodes, window_s=None, min_age_s=320.0, compress=1.0)
        assert preemptions_of_working_nodes(fitted, 320.0) >= 4, name


# -- on a real local Ray cluster -------------------------------------------------------------------

NUM_STEPS, COMMIT_EVERY = 8, 3
STEP_S = {"fast": 0.03, "slow": 0.12}
"""Per-step wall time of the worker on each node: the slow one is 4x slower."""


class FaultyWorker(Worker):
    """A Worker that, once armed, dies (os._exit) right after sending its next commit."""

    _armed = False

    def arm_crash_after_commit(self) -> None:
        self._armed = True

    def _commit(self, queue, lease_id, step, saved):
        if not self._armed:
            return super()._commit(queue, lease_id, step, saved)
        queue.commit.remote(lease_id, step, saved)  # issued, not awaited
        os._exit(1)


@pytest.fixture(scope="module")
def cluster():
    from spot.cluster import LocalCluster

    c = LocalCluster()
    try:
        c.add_node("fast")
        c.add_node("slow")
        import ray
        from ray import cloudpickle

        # The test module is not importable on the workers: ship FaultyWorker by value.
        cloudpickle.register_pickle_by_value(sys.modules[__name__])
        ray.init(address=c.address, logging_level=logging.WARNING, log_to_driver=False)
        yield c
    finally:
        c.shutdown()


@pytest.fixture(scope="module")
def imds():
    """A fake instance-metadata endpoint per node name, made on first use."""
    from spot.fake_imds import FakeIMDS

    servers: dict[str, FakeIMDS] = {}

    def get(name: str) -> FakeIMDS:
        if name not in servers:
            servers[name] = FakeIMDS().start()
        return servers[name]

    try:
        yield get
    finally:
        for server in servers.values():
            server.stop()


@pytest.fixture(scope="module")
def pool(cluster, tiny_model_dir, imds):
    from spot.cluster import NODE_LABEL
    from spotlight.jobs import DiTRunner

    def node_kwargs(node: dict) -> dict:
        name = node["Labels"][NODE_LABEL]
        return {"step_s": STEP_S[name.split("-")[0]], "imds_endpoint": imds(name).url}

    p = WorkerPool(
        partial(DiTRunner, tiny_cfg(tiny_model_dir)),
        worker_kwargs={"commit_every": COMMIT_EVERY, "poll_s": 0.02, "imds_poll_s": 0.1, "version": 0},
        node_kwargs=node_kwargs,
        worker_cls=FaultyWorker,
    )
    try:
        yield p
    finally:
        p.close()


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """Uninterrupted final latents, by job id, with the model's own weights (version 0)."""
    from spotlight.policy import load_policy

    policy = load_policy(tiny_cfg(tiny_model_dir).model, trainable=False)
    cache: dict[int, torch.Tensor] = {}

    def get(job: Job) -> torch.Tensor:
        if job.job_id not in cache:
            cache[job.job_id] = uninterrupted(policy, job)
        return cache[job.job_id]

    return get


def runtime_on(pool, n: int = 2, **kwargs) -> Runtime:
    """A fresh runtime (queue) on the module's pool, once `n` groups serve it."""
    rt = Runtime(pool, tick_s=0.02, **kwargs)
    deadline = time.monotonic() + 120
    while len(pool.running()) < n:
        assert time.monotonic() < deadline, "workers did not come up"
        rt.tick()
        time.sleep(0.05)
    return rt


def check_exactly_once(report, jobs, reference):
    assert report.lost == 0 and report.duplicated == 0
    assert sorted(r.job_id for r in report.results) == [j.job_id for j in jobs]
    by_id = {j.job_id: j for j in jobs}
    for r in report.results:
        assert torch.equal(r.output.latents[-1][0], reference(by_id[r.job_id])), (
            f"job {r.job_id} differs from the uninterrupted run"
        )


def run_until(rt, cond, timeout_s: float = 30.0):
    """Tick the runtime until cond(snapshot) returns a value; return it."""
    import ray

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        rt.tick()
        hit = cond(ray.get(rt.queue.snapshot.remote()))
        if hit:
            return hit
        time.sleep(0.01)
    raise TimeoutError("condition not reached")


def group_on(cluster, pool, prefix: str) -> tuple[str, str]:
    """(group id, worker id) of the running group on the node named `prefix`...: the victim."""
    for g in pool.running():
        (w,) = g.members
        if node_name(cluster, pool, w).startswith(prefix):
            return g.group_id, w
    raise AssertionError(f"no running group on a {prefix} node")


def node_name(cluster, pool, worker_id: str) -> str:
    return next(n for n in cluster.node_names() if cluster.node_id(n) == pool.node_of(worker_id))


def past_a_commit(group_id: str):
    """Condition: `group_id` holds a job with a commit and is past it; gives (job, committed step)."""

    def cond(snapshot):
        for job_id, g, _lease, committed, progress in snapshot["leases"]:
            if g == group_id and committed >= COMMIT_EVERY and progress > committed:
                return job_id, committed
        return None

    return cond


def test_pull_delivers_every_job_once_with_the_uninterrupted_bits(pool, reference):
    rt = runtime_on(pool)
    jobs = [row_job(i) for i in range(8)]
    rt.submit(jobs)
    report = rt.run(timeout_s=60)
    rt.close()
    check_exactly_once(report, jobs, reference)
    s = report.stats
    # A tail job may move from the slow worker to the fast one (hand-off): one more lease and one
    # release commit each, nothing recomputed.
    assert s.leases == 8 + s.handoffs and s.released == s.handoffs and s.revoked == 0 and s.recomputed_steps == 0
    assert s.commits + s.commits_ignored == 8 * ((NUM_STEPS - 1) // COMMIT_EVERY) + s.handoffs
    assert len({r.worker_id for r in report.results}) == 2  # both worked


def test_pull_beats_push_with_a_slow_worker(pool):
    times = {}
    for policy in ("pull", "push"):
        rt = runtime_on(pool, policy=policy)
        rt.submit([row_job(i) for i in range(100, 108)])
        report = rt.run(timeout_s=60)
        rt.close()
        assert report.lost == 0 and report.duplicated == 0
        times[policy] = report.wall_s
    # Push gives the 4x slower worker half the jobs; pull lets the fast one take most.
    assert times["pull"] < 0.85 * times["push"], times


def test_a_worker_killed_mid_job_is_resumed_from_its_last_commit(cluster, pool, reference):
    import ray

    rt = runtime_on(pool)
    group, victim = group_on(cluster, pool, "slow")
    jobs = [row_job(i) for i in range(200, 206)]
    rt.submit(jobs)
    job_id, _ = run_until(rt, past_a_commit(group))
    ray.kill(pool.actor(victim), no_restart=True)
    report = rt.run(timeout_s=60)
    rt.close()
    check_exactly_once(report, jobs, reference)
    assert "died" in [ev for _, w, ev in report.events if w == victim]
    s = report.stats
    assert s.revoked == 1 and 1 <= s.recomputed_steps <= COMMIT_EVERY and s.steps_in_flight_lost == 1
    assert next(r for r in report.results if r.job_id == job_id).num_leases == 2


def test_push_repushes_a_dead_workers_jobs(cluster, pool, reference):
    import ray

    rt = runtime_on(pool, policy="push")
    group, victim = group_on(cluster, pool, "slow")
    jobs = [row_job(i) for i in range(300, 306)]
    ready = [g.group_id for g in pool.running()]
    pushed_to_victim = [j.job_id for i, j in enumerate(jobs) if ready[i % len(ready)] == group]
    rt.submit(jobs)
    run_until(rt, past_a_commit(group))
    ray.kill(pool.actor(victim), no_restart=True)
    report = rt.run(timeout_s=60)
    rt.close()
    check_exactly_once(report, jobs, reference)
    assert report.stats.revoked == 1
    # Least loaded over idle groups (round robin) gave the victim 3 jobs; it was killed in its first, so all
    # three were re-pushed to the one other group running then (the victim's replacement was still loading).
    assert sorted(rt.repushed) == pushed_to_victim and len(pushed_to_victim) == 3
    assert group not in {r.worker_id for r in report.results}


def test_a_worker_killed_right_after_sending_a_commit_leaves_the_queue_consistent(cluster, pool, reference):
    import ray

    rt = runtime_on(pool)
    group, victim = group_on(cluster, pool, "slow")
    jobs = [row_job(i) for i in range(400, 406)]
    rt.submit(jobs)
    run_until(rt, lambda snap: any(g == group and p >= 1 for _, g, _, _, p in snap["leases"]))
    ray.get(pool.actor(victim).arm_crash_after_commit.remote())
    report = rt.run(timeout_s=60)
    rt.close()
    check_exactly_once(report, jobs, reference)
    assert [w for _, w, ev in report.events if ev == "died"] == [victim]
    assert report.stats.revoked == 1


def test_a_notice_commits_at_once_and_nothing_is_recomputed(cluster, pool, imds, reference):
    from ray._raylet import GcsClient

    rt = runtime_on(pool)
    group, victim = group_on(cluster, pool, "slow")
    node = node_name(cluster, pool, victim)
    lost, hit = len(pool.nodes_lost), len(set(pool.nodes_lost) & pool.nodes_hit)
    jobs = [row_job(i) for i in range(500, 506)]
    rt.submit(jobs)
    job_id, _ = run_until(rt, past_a_commit(group))
    imds(node).schedule_interruption(lead_s=60)  # the node's metadata endpoint announces the reclaim
    # Its worker's watcher sees it, commits its last step, hands the job back, stops pulling and
    # drains the node; then the node goes.
    run_until(rt, lambda _: (victim, "left") in [(w, ev) for _, w, ev in pool.events])
    assert pool.node_of(victim) in GcsClient(address=cluster.cluster.gcs_address).get_draining_nodes()
    cluster.remove_node(node)  # the reclaim the notice announced
    report = rt.run(timeout_s=60)
    run_until(rt, lambda _: len(pool.nodes_lost) > lost)  # Ray declares the node dead within seconds
    status = rt.status()
    rt.close()
    check_exactly_once(report, jobs, reference)
    s = report.stats
    assert s.released == 1 and s.revoked == 0 and s.recomputed_steps == 0 and s.steps_in_flight_lost == 0
    assert next(r for r in report.results if r.job_id == job_id).num_leases == 2
    assert (status.preemptions, status.preemptions_hitting_work) == (lost + 1, hit + 1)
    cluster.add_node(f"{node.split('-')[0]}-2")  # capacity comes back under a new node


def test_a_node_removed_without_notice_loses_at_most_the_commit_interval(cluster, pool, reference):
    rt = runtime_on(pool)
    group, victim = group_on(cluster, pool, "slow")
    lost, hit = len(pool.nodes_lost), len(set(pool.nodes_lost) & pool.nodes_hit)
    jobs = [row_job(i) for i in range(600, 606)]
    rt.submit(jobs)
    job_id, _ = run_until(rt, past_a_commit(group))
    cluster.remove_node(node_name(cluster, pool, victim))
    report = rt.run(timeout_s=60)
    run_until(rt, lambda _: len(pool.nodes_lost) > lost)
    status = rt.status()
    rt.close()
    check_exactly_once(report, jobs, reference)
    s = report.stats
    assert s.revoked == 1 and 1 <= s.recomputed_steps + s.steps_in_flight_lost <= COMMIT_EVERY
    assert next(r for r in report.results if r.job_id == job_id).num_leases == 2
    assert (status.preemptions, status.preemptions_hitting_work) == (lost + 1, hit + 1)


def test_a_node_announced_for_reclaim_before_its_worker_is_up_takes_no_job(cluster, pool, imds, reference):
    """The metadata endpoint announces a reclaim once; on a node reclaimed soon after it joined, the
    worker sees it while it loads or waits for a group. It must still leave at its first chance,
    before it pulls a job (joining a group must not forget the notice)."""
    node = "slow-3"
    imds(node).schedule_interruption(lead_s=60)  # announced before the node's worker exists
    cluster.add_node(node)
    rt = runtime_on(pool)
    jobs = [row_job(i) for i in range(700, 706)]
    rt.submit(jobs)

    def left(_):
        mine = [w for w in pool.workers if pool.node_of(w) == cluster.node_id(node)]
        return mine and all((w, "left") in [(x, ev) for _, x, ev in pool.events] for w in mine) and mine

    (_worker,) = run_until(rt, left, timeout_s=120)
    report = rt.run(timeout_s=60)
    rt.close()
    check_exactly_once(report, jobs, reference)
    assert report.stats.revoked == 0 and report.stats.released == 0  # it never held a lease
    assert all(r.num_leases == 1 for r in report.results)
    cluster.remove_node(node)  # the reclaim


def test_published_weights_reach_the_workers_through_the_queue(cluster, pool, tiny_model_dir, reference):
    """New policy weights: the version-1 jobs wait until `publish`, then every worker (one that
    joined meanwhile too) loads them through the queue and samples with them. The pool's last test:
    its workers keep version 1 afterwards."""
    import ray

    from spotlight.policy import load_policy, load_trainable_state, trainable_state

    rt = runtime_on(pool, 1)
    trained = load_policy(tiny_cfg(tiny_model_dir).model, trainable=False)
    g = torch.Generator().manual_seed(0)
    state = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in trainable_state(trained).items()}
    load_trainable_state(trained, state)
    jobs = [row_job(i, version=1) for i in range(700, 706)]
    rt.submit(jobs)
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        rt.tick()
        time.sleep(0.05)
    assert ray.get(rt.queue.snapshot.remote())["stats"].leases == 0  # no weights yet: nothing runs
    before = {g.group_id for g in pool.running()}
    serving = len(before)
    cluster.add_node("fast-late")  # its worker starts with the model's own weights, version 0
    while len(pool.running()) < serving + 1:
        rt.tick()
        time.sleep(0.05)
    (late,) = {g.group_id for g in pool.running()} - before
    # One more job for each worker, only it may take: without them the first worker to pull could
    # run all six (the late worker, on a fast node, did) and another would never need version 1.
    serve = [late, *sorted(before)]
    extras = [row_job(706 + i, version=1) for i in range(len(serve))]
    ray.get(rt.queue.submit.remote(extras, serve))
    rt.num_jobs += len(extras)
    jobs += extras
    rt.publish(1, state)
    report = rt.run(timeout_s=60)
    rt.close()
    check_exactly_once(report, jobs, lambda job: uninterrupted(trained, job))
    # Each worker once, the one that joined meanwhile too (how many serve depends on which of the
    # earlier tests' nodes are up by now).
    assert report.stats.weight_updates == serving + 1
    for job in jobs[:2]:
        assert not torch.equal(reference(job), uninterrupted(trained, job))  # the update changed the bits


def test_the_replayer_adds_warns_and_preempts_on_the_trace_clock(cluster):
    import ray

    from spot.cluster import IMDS_LABEL, NODE_LABEL
    from spot.metadata import MetadataWatcher
    from spot.replay import TraceReplayer
    from spot.traces import TraceEvent

    trace = Trace((TraceEvent(0.0, "r-0", "add"), TraceEvent(1.5, "r-0", "preempt")), 2.0, "test", "synthetic")
    replayer = TraceReplayer(cluster, trace.with_notices(1.0), fake_imds=True)
    try:
        assert replayer.add_initial() == ["r-0"]
        node_id = cluster.node_id("r-0")
        (node,) = [n for n in ray.nodes() if n["NodeID"] == node_id]
        assert node["Alive"] and node["Labels"][NODE_LABEL] == "r-0"
        assert node["Labels"][IMDS_LABEL] == replayer.imds_url("r-0")  # where the node's workers look
        notices = []
        watcher = MetadataWatcher(replayer.imds_url("r-0"), poll_interval_s=0.1, callbacks=(notices.append,))
        with watcher:
            replayer.run()
        assert [(e.kind, e.t_s) for e in replayer.applied] == [("add", 0.0), ("notice", 0.5), ("preempt", 1.5)]
        assert all(e.at_s - e.t_s < 0.5 for e in replayer.applied)
        assert replayer.num_preemptions == 1 and "r-0" not in cluster.node_names()
        (notice,) = notices  # the node's endpoint announced the preemption, about 1 s ahead
        assert notice.kind == "interruption" and 0.5 < notice.seconds_left(notice.received_at) <= 1.05
    finally:
        replayer.remove_all()
