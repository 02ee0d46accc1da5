"""Seed exploration: seed bookkeeping and budget (pure), then real runs on a local Ray cluster.

The Ray tests start a real multi-node cluster on 127.0.0.1 (an on-demand head and two nodes with
the `spot` resource) once per module, and run the real `run_training` against it with a tiny real
model: stale and inline exploration, and an explorer killed mid-window with `ray.kill`. The CLI
test starts its own cluster, as `spotlight train ... explore.mode=stale` does for a user.
"""

from __future__ import annotations

import os

# Bind every Ray process to 127.0.0.1; read when `ray` is first imported (spot.localray.import_ray_on_loopback).
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

import dataclasses
import importlib.util
import json
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
import pytest

from planners import select_contrast
from spotlight.config import DiTRecipe
from spotlight.core.config_io import from_dict
from spotlight.core.seeds import derive_seed
from spotlight.core.tracking import read_metrics
from spotlight.driver import plan_iteration
from spotlight.explore import LOG_FILE, Exploration
from spotlight.seed_selection import (
    BudgetModel,
    ExploreJob,
    ExploreResult,
    candidate_seeds,
    choose_groups,
    exploration_budget,
    opens_before_rollout,
    planner_ids,
    publishes_before_rollout,
    publishes_before_update,
    selection_metrics,
    split_jobs,
)

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------
# Pure: seeds, budget, jobs, selection, config
# ---------------------------------------------------------------------------------------------


def test_candidates_extend_the_default_seeds_and_plan_iteration_is_pure():
    cfg = DiTRecipe()
    cfg.train.prompts_per_iteration, cfg.train.group_size, cfg.train.seed = 3, 4, 7
    prompts = [f"prompt {i}" for i in range(20)]
    later = plan_iteration(cfg, prompts, 6)  # the next batch is planned during the current iteration
    for k in (5, 6):
        _batch, seeds, _ = plan_iteration(cfg, prompts, k)
        for p in range(3):
            cands = candidate_seeds(cfg.train.seed, k, p, 12)
            assert cands[:4] == seeds[p * 4 : (p + 1) * 4]
            assert len(set(cands)) == 12
    assert plan_iteration(cfg, prompts, 6) == later
    assert planner_ids(["a", "b", "a"]) == ["a", "b", "a #2"]


def test_which_call_publishes_the_weights_per_mode_and_window():
    """Exactly one of the two publish points serves each window; every rank computes the same."""

    # inline: before the rollout, from iteration 1 on (nothing is timed at iteration 0).
    def when(window, k, has_next):
        return dict(window=window, iteration=k, has_next_batch=has_next)

    assert [publishes_before_rollout("inline", **when("update", k, True)) for k in (0, 1)] == [False, True]
    assert not publishes_before_update("inline", **when("update", 1, True))
    for window in ("update", "iteration"):
        for k in (0, 1, 5):
            for has_next in (False, True):
                early = publishes_before_rollout("stale", **when(window, k, has_next))
                late = publishes_before_update("stale", **when(window, k, has_next))
                assert early == opens_before_rollout("stale", **when(window, k, has_next))
                # A next batch gets exactly one window; the last iteration none.
                assert early + late == int(has_next), (window, k, has_next)
                # "iteration" opens before the rollout except at iteration 0 (no rollout timed yet).
                assert early == (window == "iteration" and k > 0 and has_next)
    assert not any(publishes_before_rollout("none", **when("iteration", k, True)) for k in (0, 3))
    assert not publishes_before_update("none", **when("iteration", 3, True))


def test_budget_is_step_time_times_throughput_with_flagged_guesses():
    assert exploration_budget(2.0, 10.0, 2, 0.8) == 32
    assert exploration_budget(2.0, 10.0, 0, 0.8) == 0
    assert exploration_budget(0.0, 10.0, 2, 0.8) == 0
    bm = BudgetModel(ema=0.5)
    b = bm.budget(2, 0.8, rollout_s=3.0, guess_samples_per_s=5.0)  # nothing measured: half the rollout time
    assert (b.num_samples, b.update_s, b.samples_per_s, b.guessed_update, b.guessed_throughput) == (
        12,
        1.5,
        5.0,
        True,
        True,
    )
    bm.observe_update(3.0)
    bm.observe_update(1.0)
    bm.observe_explorer(20, 2.0)
    bm.observe_explorer(0, 1.0)  # nothing scored: no throughput evidence
    b = bm.budget(3, 0.5, rollout_s=9.0, guess_samples_per_s=99.0)
    assert (b.update_s, b.samples_per_s, b.num_samples, b.guessed_update, b.guessed_throughput) == (
        2.0,
        10.0,
        30,
        False,
        False,
    )
    again = BudgetModel(ema=0.5)
    again.load_state_dict(json.loads(json.dumps(bm.state_dict())))
    assert again.budget(3, 0.5, rollout_s=9.0, guess_samples_per_s=99.0) == b


def test_a_local_cluster_that_oversubscribes_the_cpus_is_named(caplog):
    from spotlight.spot_runtime import warn_if_cpus_oversubscribed

    cfg = DiTRecipe()
    cfg.train.num_threads = 2
    cfg.runtime.spot_nodes = 2
    with caplog.at_level("WARNING"):
        msg = warn_if_cpus_oversubscribed(cfg, num_cpus=2)
    assert msg is not None and msg in caplog.text
    assert (
        "2 torch thread(s)" in msg and "2 spot worker(s)" in msg and "train.num_threads=1 runtime.spot_nodes=1" in msg
    )
    cfg.train.num_threads, cfg.runtime.spot_nodes = 1, 1
    assert warn_if_cpus_oversubscribed(cfg, num_cpus=2) is None
    assert warn_if_cpus_oversubscribed(cfg, num_cpus=1) is not None


def test_split_jobs_cover_the_plan_once_prompt_major():
    counts = [0, 9, 5, 10]
    jobs = split_jobs(4, 3, ["a", "b", "c", "d"], counts, run_seed=1, sde_steps=[0, 1], num_jobs=3, time_limit_s=2.0)
    rows = [(s, c) for j in jobs for s, c in zip(j.slots, j.candidates)]
    assert rows == [(p, i) for p, n in enumerate(counts) for i in range(n)]
    assert max(len(j.seeds) for j in jobs) - min(len(j.seeds) for j in jobs) <= 1
    for j in jobs:
        assert (j.iteration, j.version, j.sde_steps, j.time_limit_s) == (4, 3, [0, 1], 2.0)
        assert j.seeds == [derive_seed(1, 4, s, c) for s, c in zip(j.slots, j.candidates)]
        assert j.prompts == [["a", "b", "c", "d"][s] for s in j.slots]
    assert split_jobs(0, 0, ["a"], [0], run_seed=1, sde_steps=[], num_jobs=2, time_limit_s=None) == []


def _result(slots, cands, rewards, version=3) -> ExploreResult:
    return ExploreResult(4, version, slots, cands, rewards, busy_s=1.0, complete=True)


def test_choose_groups_selects_by_rule_and_names_fallback_causes():
    G = 2
    counts = [5, 5, 5, 0, 5, 5]
    r0 = [0.1, 0.9, 0.5, 0.0, 0.7]
    results = [
        _result([0] * 5, list(range(5)), r0),
        _result([1, 1], [0, 1], [0.0, 1.0]),
        _result([5] * 4, [1, 2, 3, 4], [0.2, 0.3, 0.1, 0.8]),
    ]
    dead = ExploreJob(4, 3, ["c"] * 5, [2] * 5, list(range(5)), [0] * 5, [0])
    late = ExploreJob(4, 3, ["e"] * 5, [4] * 5, list(range(5)), [0] * 5, [0])
    out = choose_groups(
        counts, results, [(dead, "died"), (late, "late")], group_size=G, rule="extremes", run_seed=0, iteration=4
    )
    assert out[0].chosen == [1, 3] == select_contrast(r0, G)  # the top and the bottom candidate
    assert out[1].chosen is None and out[1].cause == "partial"  # only G scored: nothing to choose
    assert (out[2].cause, out[3].cause, out[4].cause) == ("died", None, "late")
    assert out[3].planned == 0 and out[3].group(G) == [0, 1]
    assert out[5].chosen == [3, 4]  # candidate indices, not positions: candidate 0 never came back
    m = selection_metrics(out, G)
    assert m["explore/prompts_planned"] == 5 and m["explore/prompts_selected"] == 2
    assert (
        m["explore/fallback_died"],
        m["explore/fallback_late"],
        m["explore/fallback_partial"],
        m["explore/fallback_error"],
    ) == (1, 1, 1, 0)
    assert m["explore/var_selected_stale"] == pytest.approx(np.mean([np.var([0.9, 0.0]), np.var([0.1, 0.8])]))
    assert m["explore/var_default_stale"] == pytest.approx(np.var([0.1, 0.9]))  # prompt 5 lacks candidate 0
    rand = [
        choose_groups(counts, results, [], group_size=G, rule="random", run_seed=0, iteration=4)[0].chosen
        for _ in range(2)
    ]
    assert rand[0] == rand[1] and len(set(rand[0])) == G


@pytest.mark.parametrize(
    "override, message",
    [
        ({"explore": {"mode": "x"}}, "explore.mode: expected one of 'none', 'inline', 'stale'"),
        ({"explore": {"planner": "oracle"}}, "explore.planner: expected one of"),
        ({"explore": {"selection": "top"}}, "explore.selection: expected one of 'extremes', 'random'"),
        (
            {"explore": {"max_candidates": 4}, "train": {"group_size": 4}},
            "explore.max_candidates=4 must be > train.group_size=4",
        ),
        ({"explore": {"budget_fraction": 0}}, "explore: budget_fraction must be in (0, 1]"),
        ({"explore": {"planner_family": "counts"}}, "explore.planner_family: unknown family 'counts'"),
        (
            {"explore": {"planner_family": "matches:[a-"}},
            "explore.planner_family: family 'matches:[a-': the regex does not compile",
        ),
    ],
)
def test_explore_config_errors_name_the_field(override, message):
    with pytest.raises(ValueError) as err:
        from_dict(DiTRecipe, override, source="r.yaml")
    assert message in str(err.value)


@pytest.mark.parametrize("planner, spec", [("bandit", "shapes_counts"), ("bandit", ""), ("uniform", "shapes_counts")])
def test_the_bandit_gets_the_recipes_prompt_family(planner, spec):
    cfg = from_dict(DiTRecipe, {"explore": {"mode": "stale", "planner": planner, "planner_family": spec}})
    planner_obj = Exploration(cfg, pool=None).planner  # the pool is only used from launch on
    family = getattr(planner_obj, "family", None)
    if planner == "bandit" and spec:
        assert family("two red circles and one blue square") == "one+two"
    else:
        assert family is None


# ---------------------------------------------------------------------------------------------
# Real runs
# ---------------------------------------------------------------------------------------------


def tiny_recipe(model_dir: Path, mode: str, ray_address: str = "", **explore) -> DiTRecipe:
    """A tiny run whose update is several times its rollout (so a window has room for candidates).

    The reward is JPEG compressibility: the random tiny model draws no recognisable shapes, so the
    shapes reward would be 0 everywhere, every group would be filtered, and no update would run.
    """
    data = {
        "model": {"path": str(model_dir), "height": 32, "width": 32},
        "sample": {"num_steps": 3, "batch_size": 16},
        "reward": {"weights": {"jpeg_compressibility": 1.0}},
        "train": {
            "num_iterations": 3,
            "prompts_per_iteration": 2,
            "group_size": 4,
            "num_inner_epochs": 4,
            "minibatch_size": 2,
            "max_minutes": 0,
        },
        "log": {"wandb_mode": "disabled", "images_every": 0, "checkpoint_every": 3},
        "data": {"num_heldout": 8},
        "explore": {"mode": mode, "planner": "uniform", "max_candidates": 8, "budget_fraction": 1.0, **explore},
        "runtime": {"ray_address": ray_address},
    }
    return from_dict(DiTRecipe, data)


def read_log(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / LOG_FILE).read_text().splitlines()]


def check_selection(cfg: DiTRecipe, rows: list[dict]) -> int:
    """Every selected group is the rule's choice among the stale candidates, seeded as a candidate."""
    G, num_selected = cfg.train.group_size, 0
    for row in rows:
        for p, slot in enumerate(row["slots"]):
            if slot["chosen"] is None:
                assert slot["seeds"] == candidate_seeds(cfg.train.seed, row["iteration"], p, G)
                continue
            num_selected += 1
            picks = select_contrast(slot["stale_rewards"], G, "extremes")
            assert slot["chosen"] == [slot["candidates"][i] for i in picks]
            assert slot["seeds"] == [derive_seed(cfg.train.seed, row["iteration"], p, i) for i in slot["chosen"]]
    return num_selected


def test_stale_mode_from_the_cli(tiny_model_dir, tmp_path):
    """`spotlight train <recipe> explore.mode=stale` with its own local cluster, end to end."""
    run_dir = tmp_path / "run"
    cfg = tiny_recipe(tiny_model_dir, "stale")
    overrides = [
        f"model.path={tiny_model_dir}",
        "sample.num_steps=3",
        "sample.batch_size=16",
        "train.num_iterations=4",
        "train.prompts_per_iteration=2",
        "train.group_size=4",
        "train.num_inner_epochs=4",
        "train.minibatch_size=2",
        "reward.weights={jpeg_compressibility: 1.0}",
        "train.max_minutes=0",
        "log.wandb_mode=disabled",
        "log.images_every=0",
        "log.checkpoint_every=4",
        "data.num_heldout=8",
        "explore.mode=stale",
        "explore.planner=uniform",
        "explore.max_candidates=8",
        "explore.budget_fraction=1.0",
        "explore.fixed_budget=8",
    ]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "spotlight.cli",
            "train",
            "configs/dit/tiny-shapes.yaml",
            *overrides,
            "--run-dir",
            str(run_dir),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=REPO,
        env=dict(os.environ, WANDB_MODE="disabled"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 spot group(s) explore" in proc.stdout
    rows, log = read_metrics(run_dir), read_log(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[0]["explore/prompts_selected"] == 0  # nothing was explored before the first update
    # A fixed budget of 8 candidates (one prompt's pool, 3 steps each: tens of milliseconds on the
    # explorers) fits inside an update of 4 inner epochs, so windows come back in time and their
    # seeds are trained on: a run where every window is late fails here.
    late = sum(r.get("explore/fallback_late", 0) for r in rows)
    assert check_selection(cfg, log) > 0, ([r.get("explore/budget_samples") for r in rows], late)
    for r, row in zip(rows[1:], log[1:]):
        if row["version"] is not None:
            assert row["version"] == row["iteration"] - 1 and r["explore/staleness"] == 1
        assert "time/explore_s" in r and "time/iteration_s" in r
    # The weights are copied for the explorers only for a window with candidates (batch k's at iteration k - 1).
    planned = {row["iteration"] for row in log if any(slot["planned"] for slot in row["slots"])}
    assert [r["explore/weights_copies"] for r in rows] == [int(r["step"] in planned) for r in rows]
    from spotlight.core.checkpoint import load_checkpoint

    meta = load_checkpoint(run_dir).meta["explore"]
    assert meta["planner"]["planner"] == "uniform" and meta["budget"]["update_s"] > 0


def test_mode_none_is_plain_grpo_and_never_imports_ray(tiny_model_dir, tmp_path, monkeypatch):
    """Mode none with local rollouts: one iteration of the driver gives, bit for bit, the weights of
    plain GRPO written out here from its parts (plan, rollout, reward, advantages, update), and
    Ray is never imported."""
    import torch

    from spotlight.core.advantages import group_advantages
    from spotlight.core.checkpoint import load_checkpoint
    from spotlight.driver import run_training
    from spotlight.policy import load_policy, trainable_state
    from spotlight.prompts import train_and_eval_prompts
    from spotlight.rewards import build_reward
    from spotlight.rollout import rollout
    from spotlight.sampling import qwen_image_sigmas
    from spotlight.update import GRPOTrainer

    data = {
        "model": {"path": str(tiny_model_dir), "height": 32, "width": 32},
        "sample": {"num_steps": 3, "autocast": "none"},
        "reward": {"weights": {"jpeg_compressibility": 1.0}},  # varies per seed: every group trains
        "train": {
            "num_iterations": 1,
            "prompts_per_iteration": 2,
            "group_size": 4,
            "minibatch_size": 4,
            "max_minutes": 0,
        },
        "log": {"wandb_mode": "disabled", "images_every": 0},
        "data": {"num_heldout": 8},
    }
    cfg = from_dict(DiTRecipe, data)
    monkeypatch.setitem(sys.modules, "ray", None)  # any `import ray` now raises ImportError
    run_training(cfg, tmp_path, progress=False)
    assert not (tmp_path / LOG_FILE).exists()

    torch.manual_seed(0)
    policy = load_policy(cfg.model, seed=cfg.train.seed)
    trainer = GRPOTrainer(policy, cfg)
    train_prompts, _ = train_and_eval_prompts(cfg.data, cfg.reward.weights)
    prompts, seeds, steps = plan_iteration(cfg, train_prompts, 0)
    sigmas = qwen_image_sigmas(cfg.sample.num_steps, policy.latent_shape[0])
    ro = rollout(policy, prompts, seeds, sigmas, noise_level=cfg.sample.noise_level, sde_steps=steps)
    rewards = build_reward(cfg.reward.weights)(ro.images, prompts).total_B
    adv = group_advantages(rewards.view(2, 4), std_mode=cfg.train.adv_std, clip=cfg.train.adv_clip)
    policy.prompt_cache.begin_step(prompts)
    trainer.update(ro, adv, 0)
    policy.prompt_cache.end_step()
    saved = load_checkpoint(tmp_path).tensors["trainable"]
    mine = trainable_state(policy)
    assert saved.keys() == mine.keys()
    assert all(torch.equal(saved[k], mine[k]) for k in saved), "the driver's update differs from plain GRPO"


def test_inline_waits_and_uses_fresh_weights(tiny_model_dir, ray_address, tmp_path):
    from spotlight.driver import run_training

    cfg = tiny_recipe(tiny_model_dir, "inline", ray_address=ray_address)
    run_training(cfg, tmp_path, progress=False)
    rows, log = read_metrics(tmp_path), read_log(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert "explore/prompts_planned" in rows[0] and rows[0]["explore/prompts_planned"] == 0  # nothing timed yet
    explored = [r for r in log if r["version"] is not None]
    assert explored, "inline exploration never ran"
    assert all(r["version"] == r["iteration"] for r in explored)  # fresh weights: staleness 0
    assert all(rows[r["iteration"]]["explore/staleness"] == 0 for r in explored)
    assert all(rows[r["iteration"]][f"explore/fallback_{c}"] == 0 for r in explored for c in ("late", "died", "error"))
    assert check_selection(cfg, log) > 0


def test_stale_selects_when_the_window_finishes_in_time(tiny_model_dir, ray_address, tmp_path, monkeypatch):
    """With the update outlasting the exploration (forced here), batch k+1 trains on selected seeds."""
    from spotlight.driver import run_training

    launch = Exploration.launch

    def launch_then_let_it_finish(self, iteration, *args, **kwargs):
        launch(self, iteration, *args, **kwargs)
        if self._window is not None:  # stands in for an update longer than the window
            self.pool.rt.runtime.wait(self._window.handles, timeout_s=120, take=False)

    monkeypatch.setattr(Exploration, "launch", launch_then_let_it_finish)
    cfg = tiny_recipe(tiny_model_dir, "stale", ray_address=ray_address)
    run_training(cfg, tmp_path, progress=False)
    rows, log = read_metrics(tmp_path), read_log(tmp_path)
    assert check_selection(cfg, log) > 0
    for r, row in zip(rows[1:], log[1:]):
        if row["version"] is not None:
            assert row["version"] == row["iteration"] - 1 and r["explore/staleness"] == 1
    assert all(r["explore/fallback_late"] == 0 for r in rows)


@pytest.mark.parametrize("window", ["update", "iteration"])
def test_the_stale_window_opens_where_the_setting_says(tiny_model_dir, ray_address, tmp_path, monkeypatch, window):
    """explore.window: batch k+1 is submitted after rollout k ("update") or before it ("iteration",
    from k = 1), with θ_k either way, and the budget then predicts the longer window."""
    import spotlight.driver as train_module

    events: list[tuple[str, int]] = []
    open_window, rollout = Exploration._open_window, train_module.rollout

    def record_open(self, iteration, version, *args, **kwargs):
        events.append(("open", iteration))
        return open_window(self, iteration, version, *args, **kwargs)

    def record_rollout(*args, **kwargs):
        events.append(("rollout", sum(e[0] == "rollout" for e in events)))
        return rollout(*args, **kwargs)

    monkeypatch.setattr(Exploration, "_open_window", record_open)
    monkeypatch.setattr(train_module, "rollout", record_rollout)
    cfg = tiny_recipe(tiny_model_dir, "stale", ray_address=ray_address, window=window)
    cfg.train.num_iterations = 4
    train_module.run_training(cfg, tmp_path, progress=False)
    where = {it: events.index(("open", it)) for kind, it in events if kind == "open"}
    ro = {k: events.index(("rollout", k)) for k in range(4)}
    assert sorted(where) == [1, 2, 3]  # one window per next batch, none after the last
    assert ro[0] < where[1] < ro[1]  # iteration 0 always opens after its rollout
    for k in (1, 2):
        assert (where[k + 1] < ro[k]) == (window == "iteration"), events
        assert ro[k - 1] < where[k + 1] if window == "iteration" else ro[k] < where[k + 1]
    rows, log = read_metrics(tmp_path), read_log(tmp_path)
    for r, row in zip(rows[1:], log[1:]):
        if row["version"] is not None:
            assert row["version"] == row["iteration"] - 1 and r["explore/staleness"] == 1
    # The budget of batch 3 (sized at iteration 2, ema 0.5) predicts from the windows of iterations
    # 0 and 1. Iteration 0's is its update either way; iteration 1's is its update ("update"), or
    # its rollout, reward and update ("iteration").
    predicted, u = rows[3]["explore/predicted_update_s"], [r["time/update_s"] for r in rows]
    if window == "iteration":
        assert predicted >= 0.5 * u[0] + 0.5 * (rows[1]["time/rollout_s"] + u[1]), (predicted, rows[1])
    else:
        assert predicted == pytest.approx(0.5 * u[0] + 0.5 * u[1], rel=1e-6), (predicted, rows[1])


def test_with_the_rollout_on_the_cluster_the_budget_predicts_the_time_after_it(tiny_model_dir, ray_address, tmp_path):
    """runtime.rollouts=cluster: the spot workers serve the rollout before any exploration job, so
    the window the budget predicts runs from the rollout's end (reward, launch, update), not from
    `seeds_for` as explore.window "iteration" (the default) measures with local rollouts. Sized on
    the whole iteration, the plan overfilled the workers' free time and every job came back late."""
    from spotlight.driver import run_training

    cfg = tiny_recipe(tiny_model_dir, "stale", ray_address=ray_address)
    cfg.runtime.rollouts = "cluster"
    cfg.runtime.emulated_step_s = 0.5  # a rollout of 3 steps lasts >= 1.5 s: longer than the clocks' slack below
    cfg.train.num_iterations = 4
    run_training(cfg, tmp_path, progress=False)
    rows = read_metrics(tmp_path)
    assert rows[1]["time/rollout_s"] >= 1.5
    assert all(r["runtime/rollout_jobs_done_total"] == r["runtime/rollout_jobs_submitted_total"] for r in rows)
    # Batch 3's budget (sized at iteration 2, ema 0.5) predicts from the windows of iterations 0 and 1.
    after = [r["time/reward_s"] + r["time/update_s"] for r in rows]
    predicted = rows[3]["explore/predicted_update_s"]
    launch = 0.5 * (rows[0]["time/explore_s"] + rows[1]["time/explore_s"])  # the launch is part of each window
    assert 0.5 * (after[0] + after[1]) <= predicted <= 0.5 * (after[0] + after[1]) + launch + 0.25, (
        predicted,
        rows[:2],
    )
    assert predicted < 0.5 * after[0] + 0.5 * (rows[1]["time/rollout_s"] + after[1])  # the "iteration" window's


def test_a_budget_too_small_for_one_prompt_probes_and_recovers(tiny_model_dir, ray_address, tmp_path, monkeypatch):
    """Regression: one slow throughput report (an explorer starved by a busy CPU, a cold start) left
    a budget of fewer than G + 1 candidates, nothing was planned again, so nothing re-measured the
    throughput and exploration stopped for the rest of the run. Now the smallest plan goes out."""
    from spotlight.driver import run_training

    launch = Exploration.launch

    def launch_then_let_it_finish(self, iteration, *args, **kwargs):
        launch(self, iteration, *args, **kwargs)
        if self._window is not None:  # deterministic: every window's report arrives in time
            self.pool.rt.runtime.wait(self._window.handles, timeout_s=120, take=False)

    learn = Exploration._learn
    starved = []

    def first_window_starved(self, window, res):
        # Every report of the first explored window is made 10,000 times slower, as a starved
        # explorer's would be.
        if not starved or starved[0] == window.iteration:
            starved.append(window.iteration)
            res = dataclasses.replace(res, busy_s=res.busy_s * 1e4)
        learn(self, window, res)

    monkeypatch.setattr(Exploration, "launch", launch_then_let_it_finish)
    monkeypatch.setattr(Exploration, "_learn", first_window_starved)
    cfg = tiny_recipe(tiny_model_dir, "stale", ray_address=ray_address, ema=1.0)
    cfg.train.num_iterations = 5
    run_training(cfg, tmp_path, progress=False)
    rows = read_metrics(tmp_path)
    G = cfg.train.group_size
    budgets = [r.get("explore/budget_samples") for r in rows]
    probes = [r.get("explore/probe") for r in rows]
    k = starved[0] + 1  # the first batch planned from the starved throughput
    assert budgets[k] <= G and probes[k] == 1 and rows[k]["explore/candidates_planned"] == G + 1, (k, budgets, probes)
    assert rows[k]["explore/candidates_scored"] > 0  # the probe was sampled, and measured the real speed
    assert k + 1 < len(rows), "no iteration left to see the recovery"
    assert budgets[k + 1] > G and probes[k + 1] == 0, (k, budgets, probes)
    assert rows[k + 1]["explore/prompts_selected"] > 0


def test_an_explorer_killed_mid_window_loses_only_its_steps_since_the_last_commit(
    tiny_model_dir, ray_address, tmp_path, monkeypatch
):
    """Exploration jobs run on the runtime: the worker running one is killed mid-job; the job resumes
    from its last commit on the other spot worker, its scores come back, the dead worker is replaced,
    and the preempted work shows in the metrics."""
    import ray

    from spotlight.driver import run_training

    killed = []
    launch = Exploration.launch

    def launch_then_kill(self, iteration, *args, **kwargs):
        launch(self, iteration, *args, **kwargs)
        if killed or self._window is None:
            return
        runtime = self.pool.rt.runtime
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # until a worker is past a commit of one of the window's jobs
            leases = ray.get(runtime.queue.snapshot.remote())["leases"]
            hit = [
                (job, group)
                for job, group, _, committed, progress in leases
                if job in self._window.handles and committed > 0 and progress > committed
            ]
            if hit:
                break
            time.sleep(0.005)
        assert hit, "no exploration job got past a commit"
        job, group = hit[0]
        (worker,) = runtime.pool.groups[group].members
        ray.kill(runtime.pool.actor(worker), no_restart=True)
        runtime.wait([job], timeout_s=120, take=False)  # it resumed on the other worker and finished
        # The replacement loads the model in a new process (4-5 s here), which a 3-iteration run of
        # the tiny model can outlast; wait for it to start so the run's last row can count it.
        deadline = time.monotonic() + 60
        while self.pool.respawns < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        killed.append((iteration, job))

    monkeypatch.setattr(Exploration, "launch", launch_then_kill)
    cfg = tiny_recipe(tiny_model_dir, "stale", ray_address=ray_address, batch_size=2)
    cfg.runtime.commit_every = 2
    summary = run_training(cfg, tmp_path, progress=False)
    assert summary["iterations"] == 3  # training went on
    assert killed, "no exploration window was launched"
    it, _ = killed[0]
    rows = read_metrics(tmp_path)
    assert rows[it]["explore/explorer_deaths"] == 1
    assert rows[it + 1]["explore/fallback_late"] == 0 and rows[it + 1]["explore/prompts_selected"] > 0
    assert rows[it]["runtime/explore_leases_revoked_total"] >= 1
    assert (
        1 <= rows[it]["runtime/explore_steps_recomputed_total"] <= 2
    )  # the step past the commit, and the one in flight
    assert rows[it]["runtime/explore_jobs_resumed_total"] >= 1
    assert rows[-1]["explore/explorer_respawns_total"] >= 1


def load_benchmark(name: str) -> types.ModuleType:
    """benchmarks/<name>.py as a module (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_time_to_target_takes_the_run_clock_at_the_first_evaluation_at_the_target():
    """benchmarks/time_to_target.py: iterations and time/run_s (start-up, evaluations and
    checkpoints included, emulated waits excluded) at the first evaluation at the target; per-seed
    ratios with their median and range, a seed that never reached it counted apart."""
    module = load_benchmark("time_to_target")
    rows = [
        {"step": 1, "time/iteration_s": 2.0, "time/run_s": 12.0},
        {"step": 2, "time/iteration_s": 3.0, "time/run_s": 20.0, "eval/mean_reward": 0.41},
        {"step": 3, "time/iteration_s": 4.0, "time/run_s": 24.0},
        {"step": 4, "time/iteration_s": 1.0, "time/run_s": 31.0, "eval/mean_reward": 0.45},
    ]
    assert module.to_target(rows, 0.45) == {"reached": True, "iterations": 4, "wall_s": 31.0}
    assert module.to_target(rows, 0.41) == {"reached": True, "iterations": 2, "wall_s": 20.0}
    assert module.to_target(rows, 0.5) == {"reached": False, "iterations": None, "wall_s": None}
    summary = module.summarize_run(rows, 0.45)
    assert summary["curve"] == [[2, 0.41], [4, 0.45]] and summary["median_iteration_s"] == 3.0

    def run(iterations, wall, staleness=None):
        return {"iterations": iterations, "wall_s": wall, "staleness": staleness, "candidates_scored_per_window": None}

    runs = {
        "none": [run(20, 200.0), run(16, 160.0), run(None, None)],
        "none_all_cores": [run(20, 120.0), run(16, 100.0), run(30, 300.0)],
        "stale@4": [run(10, 150.0, 1.0), run(16, 170.0, 1.0), run(12, 120.0, 1.0)],
        "oracle": [run(5, 90.0), run(8, 99.0), run(6, 60.0)],
    }
    out = module.figures(runs, [4])
    assert out["iterations_ratio_none_over_stale"] == {
        "median": 1.5,
        "range": [1.0, 2.0],
        "per_seed": [2.0, 1.0, None],
        "unreached": 1,
    }
    assert out["oracle_iterations_ratio_none_over_oracle"]["per_seed"] == [4.0, 2.0, None]
    assert out["wall_ratio_none_all_cores_over_stale"]["per_seed"] == [0.8, 0.588, 2.5]
    assert out["emulated_spot_nodes"] == 4 and out["staleness"] == 1.0
    with pytest.raises(ValueError, match="unknown mode 'fast'"):
        module.mode_overrides("fast", nodes=1, trainer_threads=1, oracle_candidates=64, prompts=16)
    oracle = module.mode_overrides("oracle", nodes=1, trainer_threads=1, oracle_candidates=64, prompts=16)
    assert "explore.fixed_budget=1024" in oracle and "explore.mode=inline" in oracle
    # --selection-override reaches the selecting modes only: plain GRPO keeps the recipe's shape.
    selection = ["train.group_size=8", "train.prompts_per_iteration=32"]
    common = ["train.num_iterations=40"]
    args = dict(nodes=4, trainer_threads=1, oracle_candidates=64)
    assert module.run_overrides("none", common, selection, prompts=16, **args) == [
        "train.num_iterations=40",
        "explore.mode=none",
        "train.num_threads=1",
    ]
    stale = module.run_overrides("stale", common, selection, prompts=32, **args)
    assert stale[:3] == [*common, *selection] and "explore.emulated_nodes=4" in stale
    oracle = module.run_overrides("oracle", common, selection, prompts=32, **args)
    assert oracle[1:3] == selection and "explore.fixed_budget=2048" in oracle


def test_explore_window_benchmark_compares_the_windows_after_the_first_two_iterations():
    """benchmarks/explore_window.py: per-window means skip iterations 0 and 1; ratios iteration / update."""
    module = load_benchmark("explore_window")

    def rows(scored, selected, late=0):
        out = [{"time/iteration_s": 99.0}, {"time/iteration_s": 99.0, "explore/candidates_scored": 999}]
        for s in scored:
            out.append(
                {
                    "time/iteration_s": 10.0,
                    "explore/candidates_scored": s,
                    "explore/candidates_planned": s,
                    "explore/prompts_selected": selected,
                    "explore/fallback_late": late,
                }
            )
        return out

    update = module.summarize_run(rows([100, 200], 2, late=1))
    assert update["scored_per_window"] == 150 and update["median_iteration_s"] == 10.0 and update["late_prompts"] == 2
    runs = {"update": [update], "iteration": [module.summarize_run(rows([300, 300], 3))]}
    out = module.ratios(runs)
    assert out["scored_ratio"] == 2.0 and out["selected_ratio"] == 1.5 and out["iteration_time_ratio"] == 1.0
    assert out["late_prompts"] == {"update": 2, "iteration": 0}
    with pytest.raises(ValueError, match="more than 2 iterations"):
        module.summarize_run(rows([], 0))


def test_spot_training_benchmark_takes_the_critical_path_ratio_per_pair():
    """benchmarks/spot_training.py --explore: each stale run over the none run it alternated with
    (median iterations after the first two), then the median and range of those ratios; a rollout
    job neither delivered nor cancelled counts as lost."""
    module = load_benchmark("spot_training")

    def rows(iteration_s: float, lost: int = 0, selected: float = 0.0) -> list[dict]:
        last = {
            "runtime/rollout_jobs_submitted_total": 10,
            "runtime/rollout_jobs_done_total": 10 - lost,
            "runtime/explore_jobs_submitted_total": 6,
            "runtime/explore_jobs_done_total": 4,
            "runtime/explore_jobs_cancelled_total": 2,
            "runtime/explore_leases_revoked_total": 1,
            "runtime/explore_steps_recomputed_total": 3,
        }
        return [
            {
                "time/iteration_s": 99.0,
                "time/update_s": 1.0,
                "time/rollout_s": 1.0,
                "explore/prompts_selected": selected,
            }
        ] * 2 + [
            {
                "time/iteration_s": iteration_s,
                "time/update_s": 1.0,
                "time/rollout_s": 1.0,
                "explore/prompts_selected": selected,
                **last,
            }
        ] * 3

    names = [("explore_none", "explore"), ("explore_none1", "explore1"), ("explore_none2", "explore2")]
    pairs = [
        (rows(10.0), rows(10.4, selected=2)),
        (rows(20.0), rows(19.0, selected=1)),
        (rows(10.0), rows(12.0, lost=1, selected=3)),
    ]
    out = module.explore_figures(names, pairs, ["runtime.local_cluster_cpus=1"], Path("/runs"))
    assert out["critical_path_ratio_pairs"] == [1.04, 0.95, 1.2]
    assert out["critical_path_ratio_stale_over_none"] == 1.04 and out["critical_path_ratio_range"] == [0.95, 1.2]
    assert out["lost_rollouts"] == 1 and out["prompts_selected_per_iteration"] == 2
    assert out["explore_leases_revoked"] == 3 and out["explore_steps_recomputed"] == 9
    assert "emulated" in out["layout"] and "explore.mode=none" in out["baseline"]
