"""benchmarks/stale_ranking.py and benchmarks/record_reward_table.py at a tiny size on a 1-layer real model."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from planners.tables import load_reward_table

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture()
def bench(monkeypatch):
    """The two benchmark modules (they live in benchmarks/, which is not a package)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import record_reward_table
    import stale_ranking

    return stale_ranking, record_reward_table


# The random 1-layer model draws no shapes, so the `shapes` reward is mostly constant and leaves no
# ranking; JPEG compressibility ranks any images, which exercises the tau path.
JPEG = "reward.weights={jpeg_compressibility: 1.0}"


def tiny_overrides(model_dir: Path) -> list[str]:
    return [
        f"model.path={model_dir}",
        "sample.num_steps=3",
        "train.prompts_per_iteration=2",
        "train.group_size=4",
        "train.minibatch_size=8",
        "data.num_heldout=8",
    ]


def test_tau_b_skips_constant_and_failed_rewards(bench):
    stale_ranking, _ = bench
    x = np.array([0.1, 0.5, 0.3, 0.9])
    assert stale_ranking.tau_b(x, x) == pytest.approx(1.0)
    assert stale_ranking.tau_b(x, -x) == pytest.approx(-1.0)
    assert stale_ranking.tau_b(x, np.full(4, 0.2)) is None
    assert stale_ranking.tau_b(np.array([0.1, np.nan, 0.3]), np.array([0.2, 0.5, 0.4])) == pytest.approx(1.0)
    assert stale_ranking.measurement_iterations(21, [1, 2, 4], 4) == [4, 8, 12, 16, 20]


def test_selection_figures_against_the_oracle_and_random_choices(bench):
    """Stale scores that rank like the fresh ones select the oracle's group; the random control's
    overlap is G / S in expectation and its variance captured below the oracle's."""
    stale_ranking, _ = bench
    rng = np.random.default_rng(0)
    fresh = np.linspace(0.0, 1.0, 16)
    same = stale_ranking.selection_figures(fresh, fresh + 0.5, 4, rng, draws=2000)
    assert same["overlap_stale"] == 1.0 and same["captured_stale"] == pytest.approx(1.0)
    assert same["overlap_random"] == pytest.approx(4 / 16, abs=0.02)
    assert 0.2 < same["captured_random"] < 0.6 and same["captured_default"] < 0.1  # the first 4 are the lowest
    # A reversed ranking (tau -1) selects the very same extremes: tau is not what selection needs.
    flipped = stale_ranking.selection_figures(fresh, fresh[::-1].copy(), 4, rng, draws=10)
    assert stale_ranking.tau_b(fresh, fresh[::-1].copy()) == pytest.approx(-1.0)
    assert flipped["overlap_stale"] == 1.0 and flipped["captured_stale"] == pytest.approx(1.0)
    # Scores that put the middle seeds on top keep only the two lowest-scored ends: half the oracle's group.
    middle = stale_ranking.selection_figures(fresh, -np.abs(fresh - 0.5), 4, rng, draws=10)
    assert middle["overlap_stale"] == 0.5 and middle["captured_stale"] < 0.6
    assert stale_ranking.selection_figures(np.full(16, 0.3), fresh, 4, rng, draws=10) is None


def test_stale_ranking_tiny_run(bench, tiny_model_dir, capsys):
    stale_ranking, _ = bench
    args = [
        "--iterations",
        "3",
        "--measure-every",
        "1",
        "--staleness",
        "1",
        "2",
        "--probe-prompts",
        "2",
        "--seeds",
        "6",
        "--quiet",
    ]
    lines = stale_ranking.main([*args, *tiny_overrides(tiny_model_dir), JPEG, "--explore-steps", "2"])
    printed = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert len(printed) == len(lines) == 2
    assert [line["staleness"] for line in lines] == [1, 2]
    for line in lines:
        assert line["measured_iterations"] == [2] and line["explore_steps"] == 2
        # Every probe prompt is either ranked or counted as constant.
        assert line["num_pairs"] + line["skipped_constant"] == 2
        assert line["num_selections"] == 2
        assert 0.0 <= line["selection_overlap_stale"] <= 1.0
        # Random choices of 4 of 6 seeds share 4/6 of the oracle's 4 on average (32 draws).
        assert line["selection_overlap_random"] == pytest.approx(4 / 6, abs=0.12)
        assert line["seconds"] > 0


def test_frozen_weights_rank_seeds_identically(bench, tiny_model_dir):
    """With lr 0 the stale weights equal the fresh ones, so every seed's reward repeats exactly."""
    stale_ranking, _ = bench
    args = [
        "--iterations",
        "2",
        "--measure-every",
        "1",
        "--staleness",
        "1",
        "--probe-prompts",
        "2",
        "--seeds",
        "6",
        "--quiet",
    ]
    (line,) = stale_ranking.main([*args, *tiny_overrides(tiny_model_dir), JPEG, "train.lr=0"])
    assert line["frac_same_reward"] == 1.0
    assert line["num_pairs"] == 2 and math.isclose(line["kendall_tau_stale"], 1.0)
    assert line["selection_overlap_stale"] == 1.0 and line["variance_captured_stale"] == pytest.approx(1.0)


def test_record_reward_table_tiny_run(bench, tiny_model_dir, tmp_path):
    stale_ranking, record = bench
    out = tmp_path / "table.npz"
    overrides = tiny_overrides(tiny_model_dir)
    line = record.main(["--iterations", "2", "--candidates", "6", "--out", str(out), "--quiet", *overrides])
    assert line["iterations"] == 2 and line["group_size"] == 4 and line["candidates"] == 6

    table = load_reward_table(out)
    assert table.group_size == 4 and len(table.iterations) == 2
    for it in table.iterations:
        assert len(it) == 2
        assert all(r.shape == (6,) and np.all((r >= 0) & (r <= 1)) for r in it.values())

    # Candidates 0..G-1 of iteration 0 are the training rollout's own seeds: a fresh run's
    # rollout of plan_iteration's prompts and seeds (same initial weights) scores them the same.
    from spotlight.driver import plan_iteration

    run = stale_ranking.build_run(stale_ranking.DEFAULT_RECIPE, overrides)
    prompts, seeds, sde_steps = plan_iteration(run.cfg, run.train_prompts, 0)
    assert seeds == [s for p in range(2) for s in record.candidate_seeds(run.cfg.train.seed, 0, p, 0, 4)]
    rollout_rewards = stale_ranking.sample_rewards(run, run.policy, prompts, seeds, sde_steps).reshape(2, 4)
    recorded = table.iterations[0]
    assert list(recorded) == prompts[::4]
    np.testing.assert_array_equal(np.stack([recorded[p][:4] for p in prompts[::4]]), rollout_rewards)


def test_record_reward_table_with_stale_rewards(bench, tiny_model_dir, tmp_path):
    """--staleness 1: iteration k's candidates are also scored with θ_{k-1}. At iteration 1 that is
    the initial weights, so a fresh, untrained build of the run scores them the same."""
    stale_ranking, record = bench
    out = tmp_path / "table.npz"
    overrides = [*tiny_overrides(tiny_model_dir), JPEG, "train.lr=1e-2"]
    line = record.main(
        ["--iterations", "2", "--candidates", "6", "--staleness", "1", "--out", str(out), "--quiet", *overrides]
    )
    assert line["staleness"] == 1
    table = load_reward_table(out)
    assert table.staleness == 1 and table.explored is not None and len(table.explored) == 2
    # Iteration 0: θ_{-1} does not exist; θ_0 stands in, which is the rollout's own weights.
    for p, r in table.iterations[0].items():
        np.testing.assert_array_equal(table.explored[0][p], r)

    from spotlight.driver import plan_iteration

    run = stale_ranking.build_run(stale_ranking.DEFAULT_RECIPE, overrides)  # θ_0
    prompts, _, sde_steps = plan_iteration(run.cfg, run.train_prompts, 1)
    groups = prompts[::4]
    seeds = [s for p in range(len(groups)) for s in record.candidate_seeds(run.cfg.train.seed, 1, p, 0, 6)]
    theta0 = stale_ranking.sample_rewards(
        run, run.policy, [p for p in groups for _ in range(6)], seeds, sde_steps
    ).reshape(len(groups), 6)
    np.testing.assert_array_equal(np.stack([table.explored[1][p] for p in groups]), theta0)
    # The fresh rewards of iteration 1 come from θ_1, after one update at a large learning rate.
    assert not np.array_equal(np.stack([table.iterations[1][p] for p in groups]), theta0)
