"""Explorer capacity emulated by time-slicing (`explore.emulated_nodes`, spotlight/emulated.py)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest
import torch
from test_explore import check_selection, read_log, tiny_recipe

import spotlight.jobs
from spotlight.core.tracking import read_metrics
from spotlight.emulated import EmulatedExplorers
from spotlight.seed_selection import ExploreJob, ExploreResult


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class _FakeState:
    job: ExploreJob
    done: bool = False


class FakeRunner:
    """Stands in for `jobs.DiTRunner` in the timing tests only: each job takes `busy[seeds[0]]`
    seconds of a fake clock (the real runner's timing is what the integration test below runs)."""

    clock: FakeClock
    busy: dict[int, float]

    def __init__(self, cfg):
        self.loaded: list[tuple[int, float]] = []
        self.started: list[int] = []
        self.version = None

    def load_weights(self, version, weights):
        self.version = version
        self.loaded.append((version, float(weights["w"].sum())))

    def start(self, payload, step, saved):
        self.started.append(payload.seeds[0])
        return _FakeState(payload)

    def finished(self, state):
        return state.done

    def advance(self, state):
        self.clock.now += self.busy[state.job.seeds[0]]
        state.done = True
        return state

    def output(self, state):
        job = state.job
        return ExploreResult(
            job.iteration,
            self.version,
            job.slots,
            job.candidates,
            [0.5] * len(job.seeds),
            busy_s=self.busy[job.seeds[0]],
            complete=True,
        )


def job(seed: int, version: int = 0) -> ExploreJob:
    return ExploreJob(
        iteration=version + 1, version=version, prompts=["a"], slots=[0], candidates=[0], seeds=[seed], sde_steps=[]
    )


@pytest.fixture()
def fake_pool(monkeypatch, tiny_model_dir):
    clock = FakeClock()
    FakeRunner.clock, FakeRunner.busy = clock, {1: 2.0, 2: 5.0, 3: 1.0}
    monkeypatch.setattr(spotlight.jobs, "DiTRunner", FakeRunner)
    cfg = tiny_recipe(tiny_model_dir, "stale", emulated_nodes=2)
    return EmulatedExplorers(cfg, clock=clock), clock


def test_a_job_longer_than_its_window_comes_back_late_and_the_wait_is_not_trainer_time(fake_pool):
    pool, clock = fake_pool
    pool.publish(0, lambda: {"w": torch.ones(3)})
    a, b = pool.submit(job(1)), pool.submit(job(2))
    assert pool.runner.started == []  # nothing runs while the trainer works
    clock.now = 4.0  # the trainer's window: 4 s
    done = pool.poll([a, b], timeout_s=0.0)
    # A (2 s of work) fits the 4 s window; B (5 s) does not, although it ran only after A's 2 s
    # pause: a node running beside A's would have needed 5 s of the same 4 s window.
    assert [h for h, _, _ in done] == [a] and pool.jobs_late == 1
    assert pool.runner.loaded == [(0, 3.0)]  # loaded once, with the weights published for version 0
    assert pool.take_emulated_s() == 7.0 and pool.take_emulated_s() == 0.0
    assert [h for h, _, _ in pool.poll([b], timeout_s=0.0)] == [b]  # read as a straggler later
    assert pool.runner.started == [1, 2]


def test_inline_polls_take_everything_and_cancelled_jobs_never_run(fake_pool):
    pool, _clock = fake_pool
    pool.publish(0, lambda: {"w": torch.ones(1)})
    a, b, c = pool.submit(job(1)), pool.submit(job(2)), pool.submit(job(3))
    pool.cancel([c])
    assert [h for h, _, _ in pool.poll([a, b, c], timeout_s=None)] == [a, b]
    assert pool.runner.started == [1, 2] and pool.jobs_late == 0
    with pytest.raises(AssertionError, match="publish"):
        pool.submit(job(1, version=3))


def test_stale_exploration_on_emulated_nodes_selects_without_ray_and_leaves_the_wait_out(
    tiny_model_dir, tmp_path, monkeypatch
):
    """A real tiny run: the explorers' jobs run in the trainer's process on the real runner, the
    selected groups are the rule's choice among stale (staleness 1) candidates, and the waits are
    in time/emulated_explore_s, not in time/iteration_s."""
    from spotlight.driver import run_training

    def no_runtime(*args, **kwargs):
        raise AssertionError("an emulated pool needs no spot runtime")

    monkeypatch.setattr("spotlight.driver.start_runtime", no_runtime)
    # Each emulated job's wait gets 1 s longer (outside the job's own busy time, so nothing turns
    # late): the wait must then show in time/emulated_explore_s and not in time/iteration_s.
    output = spotlight.jobs.DiTRunner.output

    def slow_output(self, state):
        time.sleep(1.0)
        return output(self, state)

    monkeypatch.setattr(spotlight.jobs.DiTRunner, "output", slow_output)
    cfg = tiny_recipe(tiny_model_dir, "stale", emulated_nodes=2)
    cfg.train.num_iterations = 4
    run_training(cfg, tmp_path, progress=False)
    rows, log = read_metrics(tmp_path), read_log(tmp_path)
    assert check_selection(cfg, log) > 0
    assert all(r["explore/num_explorers"] == 2 and r["explore/emulated_nodes"] == 2 for r in rows)
    waited = [r for r in rows if r["time/emulated_explore_s"] > 1.0]
    assert waited, "no window ran on the emulated nodes"
    for r in rows:
        work = (
            r["time/rollout_s"]
            + r["time/reward_s"]
            + r["time/update_s"]
            + r["time/explore_s"]
            - r["time/emulated_explore_s"]
        )
        assert r["time/iteration_s"] <= work + 0.5, r
        assert r["time/explore_s"] >= r["time/emulated_explore_s"]
    for r, row in zip(rows, log):
        if row["version"] is not None:
            assert row["version"] == row["iteration"] - 1 and r["explore/staleness"] == 1
    assert rows[-1]["time/run_s"] > sum(r["time/iteration_s"] for r in rows)  # start-up counted too


def test_cheap_exploration_scores_the_same_seeds_with_fewer_steps(tiny_model_dir):
    """explore.num_steps: an explore job samples each seed's initial noise in fewer ODE steps; its
    stale rewards are the rewards of the trainer's own rollout of those seeds on that schedule."""
    from spotlight.jobs import DiTRunner, explore_num_steps
    from spotlight.rewards import build_reward
    from spotlight.rollout import resolve_autocast, rollout
    from spotlight.sampling import qwen_image_sigmas

    cfg = tiny_recipe(tiny_model_dir, "stale", num_steps=2, batch_size=2)
    cfg.validate()
    runner = DiTRunner(cfg)
    prompts, seeds = ["a red circle", "two blue squares", "a red circle"], [11, 12, 13]
    explore = ExploreJob(1, 0, prompts, [0, 1, 0], [0, 1, 2], seeds, [])
    assert explore_num_steps(cfg, explore) == 2 * 2  # two chunks of two steps
    state, steps = runner.start(explore, 0, None), 0
    while not runner.finished(state):
        state, steps = runner.advance(state), steps + 1
    assert steps == 4
    cheap = runner.output(state).rewards
    sigmas = qwen_image_sigmas(2, runner.policy.latent_shape[0])
    reward_fn = build_reward(cfg.reward.weights, **cfg.reward.options())
    autocast = resolve_autocast(cfg.sample.autocast, runner.policy.device, cfg.train.objective)
    expected, full = [], []
    for lo in (0, 2):  # the explorer's chunks of explore.batch_size
        for schedule, out in ((sigmas, expected), (runner.sigmas, full)):
            ro = rollout(
                runner.policy,
                prompts[lo : lo + 2],
                seeds[lo : lo + 2],
                schedule,
                noise_level=0.0,
                sde_steps=[],
                batch_size=2,
                autocast=autocast,
            )
            out += reward_fn(ro.images, prompts[lo : lo + 2]).total_B.tolist()
    assert cheap == pytest.approx(expected, abs=1e-6)
    assert cheap != pytest.approx(full, abs=1e-6)  # two steps are not the rollout's three


def test_cheap_exploration_refuses_stochastic_rollouts(tiny_model_dir):
    cfg = tiny_recipe(tiny_model_dir, "stale", num_steps=2)
    cfg.sample.noise_level = 0.7
    with pytest.raises(ValueError, match="explore.num_steps=2 differs from sample.num_steps=3"):
        cfg.validate()


def test_a_run_ends_at_the_evaluation_that_reaches_the_target(tiny_model_dir, tmp_path):
    """eval.stop_at (what benchmarks/time_to_target.py stops its runs with): the run ends after the
    first held-out evaluation at or above it, with a checkpoint; a target never reached changes nothing."""
    from spotlight.core.checkpoint import find_latest_checkpoint
    from spotlight.driver import run_training

    cfg = tiny_recipe(tiny_model_dir, "none")
    cfg.train.num_iterations, cfg.eval.every, cfg.eval.num_seeds = 4, 2, 1
    cfg.eval.stop_at = 100.0  # JPEG compressibility never gets there
    run_training(cfg, tmp_path / "never", progress=False)
    rows = read_metrics(tmp_path / "never")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    cfg.eval.stop_at = rows[1]["eval/mean_reward"]  # what the same run's first evaluation gives
    run_training(cfg, tmp_path / "reached", progress=False)
    rows = read_metrics(tmp_path / "reached")
    assert [r["step"] for r in rows] == [1, 2] and rows[-1]["eval/mean_reward"] >= cfg.eval.stop_at
    assert find_latest_checkpoint(tmp_path / "reached").name.endswith("2")
