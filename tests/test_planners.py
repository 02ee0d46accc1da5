"""Exploration planners: budget invariants, determinism, adaptation, checkpoints, selection, oracle."""

from __future__ import annotations

import itertools
import json
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from planners import (
    PLANNERS,
    BanditPlanner,
    GreedyPlanner,
    NonePlanner,
    Observation,
    OraclePlanner,
    UniformPlanner,
    build_planner,
    captured_variance,
    group_variance,
    load_reward_table,
    prompt_family,
    replay,
    save_reward_table,
    select_contrast,
    synthetic_reward_table,
)
from planners.tables import RewardTable

ROOT = Path(__file__).resolve().parents[1]


def _random_table(rng: np.random.Generator, prompts: list[str], num_candidates: int) -> dict[str, np.ndarray]:
    """Rewards per prompt: Bernoulli or Beta with a random mean, some prompts saturated."""
    table = {}
    for p in prompts:
        mean = rng.choice([0.0, 1.0, rng.uniform(0.05, 0.95)])
        if rng.random() < 0.5:
            table[p] = (rng.random(num_candidates) < mean).astype(float)
        else:
            table[p] = rng.beta(1 + 5 * mean, 1 + 5 * (1 - mean), num_candidates)
    return table


def _planners(table: dict[str, np.ndarray], seed: int = 0) -> dict:
    return {
        "none": NonePlanner(seed),
        "uniform": UniformPlanner(seed),
        "greedy": GreedyPlanner(seed),
        "bandit": BanditPlanner(seed, num_draws=16),
        "oracle": OraclePlanner(table, seed),
    }


# -- selection ------------------------------------------------------------------------------------


def test_extremes_picks_top_and_bottom_with_index_ties():
    r = [0.5, 0.9, 0.1, 0.9, 0.3, 0.0]
    assert select_contrast(r, 4) == [1, 2, 3, 5]  # top 0.9 (1), 0.9 (3); bottom 0.0 (5), 0.1 (2)
    assert select_contrast(r, 3) == [1, 3, 5]  # top ceil(3/2) = 2, bottom 1
    assert select_contrast(r, 6) == [0, 1, 2, 3, 4, 5]
    assert select_contrast([1.0] * 5, 3) == [0, 1, 2]  # all tied: lowest indices
    assert select_contrast([0.2, 0.7, 0.7, 0.7, 0.1], 2) == [1, 4]  # top tie -> lowest index
    assert select_contrast([float("nan"), 0.2, 0.8], 2) == [1, 2]  # NaN only when needed
    assert select_contrast([float("nan"), float("nan"), 0.5], 2) == [0, 2]


def test_random_rule_is_seeded():
    r = np.arange(20.0)
    a = select_contrast(r, 6, "random", np.random.default_rng(3))
    b = select_contrast(r, 6, "random", np.random.default_rng(3))
    assert a == b and len(set(a)) == 6 and a == sorted(a)
    draws = {tuple(select_contrast(r, 6, "random", np.random.default_rng(s))) for s in range(5)}
    assert len(draws) > 1


def test_selection_errors_name_the_bad_value():
    with pytest.raises(ValueError, match="'middle'"):
        select_contrast([0.0, 1.0, 0.5], 2, rule="middle")
    with pytest.raises(ValueError, match="group_size=4.*got 3"):
        select_contrast([0.0, 1.0, 0.5], 4)
    with pytest.raises(ValueError, match="rng"):
        select_contrast([0.0, 1.0, 0.5], 2, rule="random")


def test_group_and_captured_variance():
    assert group_variance([1.0, float("nan"), 3.0]) == pytest.approx(1.0)
    assert group_variance([float("nan"), 2.0]) == 0.0
    r = [0.5, 0.5, 0.5, 0.5, 1.0, 0.0]
    assert captured_variance(r, 0, 4) == 0.0  # first G seeds
    assert captured_variance(r, 6, 4) == pytest.approx(group_variance([0.5, 0.5, 1.0, 0.0]))
    assert captured_variance(r, 100, 4) == captured_variance(r, 6, 4)  # more than the table holds


# -- invariants -------------------------------------------------------------------------------------


def test_budget_never_exceeded_and_choice_rule_for_every_planner():
    rng = np.random.default_rng(0)
    for trial in range(25):
        num_prompts = int(rng.integers(1, 10))
        prompts = [f"p{trial}-{i}" for i in range(num_prompts)]
        group = int(rng.integers(2, 9))
        table = _random_table(rng, prompts, num_candidates=48)
        cost = float(rng.choice([1.0, 0.37, 2.5, 1e-3 * rng.integers(1, 5000)]))
        budget = float(rng.uniform(0, 60 * num_prompts) * cost)
        cap = None if rng.random() < 0.3 else int(rng.integers(group + 1, 49))
        for name, planner in _planners(table, seed=trial).items():
            if name != "oracle" and trial % 2:
                planner.observe([Observation(p, table[p][:8], iteration=0) for p in prompts])
            alloc = planner.plan(prompts, budget, group_size=group, cost_per_sample=cost, max_candidates=cap)
            assert list(alloc) == prompts, name
            assert alloc.total() * cost <= budget, (name, alloc, budget, cost)
            for n in alloc.counts.values():
                assert n == 0 or group + 1 <= n <= (cap or n), (name, alloc, group, cap)


def test_plans_are_deterministic_and_pure():
    rng = np.random.default_rng(1)
    prompts = [f"p{i}" for i in range(6)]
    obs = [Observation(p, rng.random(10), iteration=k) for k in range(3) for p in prompts[:4]]
    plans = []
    for _ in range(2):
        for planner in (BanditPlanner(seed=7), UniformPlanner(seed=7), GreedyPlanner(seed=7)):
            planner.observe(obs)
            first = planner.plan(prompts, 200, group_size=4, max_candidates=40)
            assert planner.plan(prompts, 200, group_size=4, max_candidates=40) == first  # plan changes nothing
            plans.append(first)
    assert plans[:3] == plans[3:]


def test_budget_too_small_to_choose_explores_nothing():
    for planner in _planners({"a": np.zeros(20), "b": np.ones(20)}).values():
        assert planner.plan(["a", "b"], 4.9, group_size=4).total() == 0
        assert planner.plan([], 100, group_size=4).counts == {}


def test_greedy_serves_unseen_then_highest_last_variance():
    planner = GreedyPlanner(per_prompt=10)
    planner.observe(
        [
            Observation("flat", np.ones(8), 0),
            Observation("wide", np.tile([0.0, 1.0], 4), 0),
            Observation("narrow", np.tile([0.4, 0.6], 4), 0),
            Observation("wide", np.ones(8), 1),  # only the latest iteration counts: now flat
        ]
    )
    alloc = planner.plan(["flat", "wide", "narrow", "new"], 25, group_size=4)
    # new (unseen), narrow (variance 0.01), then the rest (5 >= G + 1) to flat (variance 0, listed first)
    assert alloc.counts == {"flat": 5, "wide": 0, "narrow": 10, "new": 10}


def test_uniform_spreads_evenly_and_explores_fewer_prompts_when_short():
    assert sorted(UniformPlanner().plan(["a", "b", "c"], 31, group_size=4).counts.values()) == [10, 10, 11]
    assert sorted(UniformPlanner().plan(["a", "b", "c"], 12, group_size=4).counts.values()) == [0, 6, 6]
    assert UniformPlanner().plan(["a", "b"], 100, group_size=4, max_candidates=20).counts == {"a": 20, "b": 20}


# -- the bandit -------------------------------------------------------------------------------------


@pytest.mark.parametrize("level, num_saturated", [(0.7, 15), (1.0, 40)])
def test_bandit_moves_budget_away_from_a_saturating_prompt(level, num_saturated):
    """A's rewards narrow to all-equal (a reward model's constant score, or a verifier's constant 1).

    The verifier case takes longer: all-ones at a mean near 1 could still hide a rare failure,
    which would be the most valuable thing to explore for, until enough evidence says otherwise.
    """
    varied = np.linspace(0.0, 1.0, 16)  # uniform-like: more candidates keep finding wider extremes
    planner = BanditPlanner(seed=0)
    for k in range(5):
        planner.observe([Observation("A", varied, k), Observation("B", varied, k)])
    before = planner.plan(["A", "B"], 60, group_size=4, max_candidates=40)
    for k in range(5, 5 + num_saturated):
        spread = max(0.0, 1 - (k - 4) / 5)  # the spread shrinks to nothing over 5 iterations
        planner.observe([Observation("A", level + spread * (varied - level), k), Observation("B", varied, k)])
    after = planner.plan(["A", "B"], 60, group_size=4, max_candidates=40)
    assert after["A"] < before["A"] and after["B"] > before["B"], (before, after)
    # An unexplored prompt is tried rather than the saturated one.
    fresh = planner.plan(["A", "C"], 30, group_size=4, max_candidates=40)
    assert fresh["C"] > fresh["A"], fresh


def test_bandit_prefers_rare_success_over_coin_flip():
    """Extremes of many seeds gain most where a random group usually misses the rare outcome."""
    rng = np.random.default_rng(0)
    planner = BanditPlanner(seed=0)
    for k in range(10):
        planner.observe(
            [
                Observation("rare", (rng.random(32) < 0.1).astype(float), k),
                Observation("coin", (rng.random(32) < 0.5).astype(float), k),
            ]
        )
    alloc = planner.plan(["rare", "coin"], 40, group_size=8, max_candidates=32)
    assert alloc["rare"] > alloc["coin"], alloc


def test_family_specs_map_prompts_and_bad_specs_name_the_spec():
    counts = prompt_family("shapes_counts")
    assert counts("two red circles and one blue square") == "one+two"
    assert counts("one green square and two yellow triangles") == "one+two"  # a multiset: order does not count
    assert counts("four blue triangles") == "four"
    assert counts("a photo of a cat") == ""  # no match: the family of such prompts
    assert counts("two red circles #3") == "two"  # planner ids of repeated prompts keep their family
    colours = prompt_family(r"matches:\b(?:red|blue)\b")  # no group: the whole match
    assert colours("two red circles and one blue square and one red square") == "blue+red+red"
    assert prompt_family("") is None
    restored = pickle.loads(pickle.dumps(counts))  # a planner holding it pickles (Ray, checkpoints)
    assert restored("three red circles") == "three"
    with pytest.raises(ValueError, match="'shapes'.*shapes_counts.*matches:REGEX"):
        prompt_family("shapes")
    with pytest.raises(ValueError, match=r"'matches:\('.*does not compile"):
        prompt_family("matches:(")


def test_bandit_families_send_budget_to_new_prompts_of_the_varied_family():
    """Family "x" always spreads, family "y" always scores the same: with families, the budget for
    prompts never seen before goes to x's; with one family for all, they look alike."""
    rng = np.random.default_rng(0)
    family = prompt_family("matches:^(x|y)")
    with_f, one = BanditPlanner(seed=0, family=family), BanditPlanner(seed=0)
    for k in range(6):
        obs = [Observation(f"x{k}.{i}", rng.random(16), k) for i in range(4)]
        obs += [Observation(f"y{k}.{i}", np.full(16, 0.6), k) for i in range(4)]
        with_f.observe(obs)
        one.observe(obs)
    new = ["x-new-1", "y-new-1", "x-new-2", "y-new-2"]
    plan_f = with_f.plan(new, 80, group_size=4, max_candidates=40)
    on_x = plan_f["x-new-1"] + plan_f["x-new-2"]
    assert on_x >= 70 and plan_f["y-new-1"] + plan_f["y-new-2"] <= 10, plan_f
    # One family: the pooled prior is the same for every new prompt, so neither side gets
    # nearly all of it (over several plans, to average the Thompson draws out).
    shares = []
    for k in range(6, 12):
        one.observe([Observation("z", rng.random(16), k)])  # moves the draws' seed
        plan = one.plan(new, 80, group_size=4, max_candidates=40)
        shares.append((plan["x-new-1"] + plan["x-new-2"]) / max(1, plan.total()))
    assert 0.2 < np.mean(shares) < 0.8, shares


def test_state_dict_round_trip_gives_identical_plans():
    rng = np.random.default_rng(2)
    prompts = [f"p{i}" for i in range(8)]
    for name in ("bandit", "greedy", "uniform", "none"):
        a, b = build_planner(name, seed=3), build_planner(name, seed=0)
        a.observe([Observation(p, rng.random(12), iteration=k) for k in range(4) for p in prompts[: 4 + k]])
        b.load_state_dict(json.loads(json.dumps(a.state_dict())))  # through JSON, as a checkpoint would
        assert a.plan(prompts, 150, group_size=4) == b.plan(prompts, 150, group_size=4), name
        later = [Observation(p, rng.random(12), iteration=4) for p in prompts[2:]]
        a.observe(later)
        b.observe(later)
        assert a.plan(prompts, 150, group_size=4) == b.plan(prompts, 150, group_size=4), name
        assert a.state_dict() == b.state_dict()


# -- the oracle ---------------------------------------------------------------------------------------


def test_oracle_is_exact_on_a_small_table():
    rng = np.random.default_rng(4)
    prompts = ["a", "b", "c"]
    table = _random_table(rng, prompts, num_candidates=9)
    table["a"] = np.array([0.5, 0.5, 0.5, 0.5, 0.9, 0.1, 0.2, 1.0, 0.0])
    group, budget = 3, 15
    alloc = OraclePlanner(table).plan(prompts, budget, group_size=group)
    value = sum(captured_variance(table[p], alloc[p], group) for p in prompts)
    options = [0, *range(group + 1, 10)]
    best = max(
        sum(captured_variance(table[p], n, group) for p, n in zip(prompts, ns))
        for ns in itertools.product(options, repeat=3)
        if sum(ns) <= budget
    )
    assert value == pytest.approx(best)


def test_oracle_captures_at_least_as_much_as_every_planner():
    table = synthetic_reward_table(seed=5, num_iterations=6, pool_size=16, prompts_per_iteration=6, num_candidates=24)
    planners = {n: p for n, p in _planners({}).items() if n != "oracle"}
    result = replay(table, planners, group_size=4, budget_fraction=0.4)
    for name in planners:
        for mine, best in zip(result.per_iteration[name], result.per_iteration["oracle"], strict=True):
            assert mine <= best + 1e-12, name
    assert result.captured["none"] < result.captured["uniform"]
    assert all(s <= sum(result.budget_samples) for s in result.samples_spent.values())


# -- errors, registry, tables -------------------------------------------------------------------------


def test_errors_name_the_bad_value():
    with pytest.raises(ValueError, match="'bandid'.*bandit, greedy, none, oracle, uniform"):
        build_planner("bandid")
    with pytest.raises(ValueError, match="'discont'.*'discount'"):
        build_planner("bandit", discont=0.9)
    with pytest.raises(ValueError, match="reward_table"):
        build_planner("oracle")
    planner = UniformPlanner()
    with pytest.raises(ValueError, match="budget.*-1"):
        planner.plan(["a"], -1, group_size=4)
    with pytest.raises(ValueError, match="cost_per_sample.*0"):
        planner.plan(["a"], 10, group_size=4, cost_per_sample=0)
    with pytest.raises(ValueError, match="group_size.*1"):
        planner.plan(["a"], 10, group_size=1)
    with pytest.raises(ValueError, match="max_candidates=4.*group_size=4"):
        planner.plan(["a"], 10, group_size=4, max_candidates=4)
    with pytest.raises(ValueError, match="'a' appears more than once"):
        planner.plan(["a", "b", "a"], 10, group_size=4)
    with pytest.raises(ValueError, match="'greedy'.*'uniform'"):
        planner.load_state_dict(GreedyPlanner().state_dict())
    with pytest.raises(ValueError, match="'zz'"):
        OraclePlanner({"a": np.zeros(8)}).plan(["a", "zz"], 20, group_size=2)
    with pytest.raises(ValueError, match="discount"):
        BanditPlanner(discount=0)
    assert set(PLANNERS) == {"none", "uniform", "greedy", "bandit", "oracle"}


@pytest.mark.parametrize("suffix", [".json", ".npz"])
def test_reward_table_round_trip(tmp_path, suffix):
    table = RewardTable(
        [{"a": np.array([0.0, 1.0, np.nan]), "b": np.array([0.5])}, {"b": np.array([0.25, 0.75])}], group_size=2
    )
    path = tmp_path / f"table{suffix}"
    save_reward_table(table, path)
    loaded = load_reward_table(path)
    assert loaded.group_size == 2 and loaded.source == str(path)
    assert [list(it) for it in loaded.iterations] == [["a", "b"], ["b"]]
    for mine, theirs in zip(table.iterations, loaded.iterations, strict=True):
        for p in mine:
            np.testing.assert_array_equal(mine[p], theirs[p])
    with pytest.raises(ValueError, match="missing.txt"):
        load_reward_table(tmp_path / "missing.txt")
    (tmp_path / "bad.json").write_text('{"rewards": 3}')
    with pytest.raises(ValueError, match="bad.json"):
        load_reward_table(tmp_path / "bad.json")


def test_benchmark_prints_one_json_line(tmp_path):
    table = synthetic_reward_table(seed=1, num_iterations=3, pool_size=8, prompts_per_iteration=4, num_candidates=16)
    save_reward_table(table, tmp_path / "t.json")
    out = (
        subprocess.run(
            [sys.executable, str(ROOT / "benchmarks" / "planner.py"), "--table", str(tmp_path / "t.json")],
            capture_output=True,
            text=True,
            check=True,
            cwd=ROOT,
        )
        .stdout.strip()
        .splitlines()
    )
    assert len(out) == 1
    result = json.loads(out[0])
    assert result["table"].endswith("t.json") and result["iterations"] == 3 and result["group_size"] == 8
    assert result["vs_oracle"] <= 1.0 and "vs_uniform" in result


def test_benchmark_reads_the_budget_a_run_measured(tmp_path):
    """`--budget-from RUN_DIR`: the mean of the run's measured (not guessed) budgets over P x max candidates."""
    from spotlight.config import DiTRecipe
    from spotlight.core.config_io import save_config

    cfg = DiTRecipe()
    cfg.train.prompts_per_iteration, cfg.train.group_size, cfg.explore.max_candidates = 4, 4, 10
    run = tmp_path / "run"
    run.mkdir()
    save_config(cfg, run / "config.yaml")
    rows = [
        {"step": 1},  # nothing explored yet
        {"step": 2, "explore/budget_samples": 40, "explore/throughput_guessed": 1.0, "explore/update_guessed": 1.0},
        {"step": 3, "explore/budget_samples": 10, "explore/throughput_guessed": 0.0, "explore/update_guessed": 0.0},
        {"step": 4, "explore/budget_samples": 14, "explore/throughput_guessed": 0.0, "explore/update_guessed": 0.0},
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    table = synthetic_reward_table(seed=1, num_iterations=2, pool_size=8, prompts_per_iteration=4, num_candidates=16)
    save_reward_table(table, tmp_path / "t.json")
    cmd = [sys.executable, str(ROOT / "benchmarks" / "planner.py"), "--table", str(tmp_path / "t.json")]
    out = subprocess.run([*cmd, "--budget-from", str(run)], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    result = json.loads(out)
    assert result["budget_fraction"] == 0.3 and result["budget_from"] == str(run)  # mean(10, 14) / (4 x 10)
    assert set(result["sweep"]) == {"0.1", "0.2", "0.3", "0.5", "0.75"}
    assert result["sweep"]["0.3"] == {"vs_uniform": result["vs_uniform"], "vs_oracle": result["vs_oracle"]}
    (run / "metrics.jsonl").write_text(json.dumps(rows[0]) + "\n")
    bad = subprocess.run([*cmd, "--budget-from", str(run)], capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode != 0 and "no window with a measured budget" in bad.stderr


def test_captured_variance_out_of_sample_chooses_by_one_reward_and_scores_by_the_other():
    fresh = np.array([0.0, 1.0, 0.2, 0.9, 0.5, 0.5])
    # In sample, the extremes (G=2) of all six: 1.0 and 0.0.
    assert captured_variance(fresh, 6, 2) == pytest.approx(group_variance([1.0, 0.0]))
    assert captured_variance(fresh, 6, 2, selected_by=fresh) == captured_variance(fresh, 6, 2)
    # Stale scores that rank the middle seeds at the ends choose 0.5 and 0.5: no fresh variance.
    stale = np.array([0.5, 0.5, 0.5, 0.5, 1.0, 0.0])
    assert captured_variance(fresh, 6, 2, selected_by=stale) == 0.0
    # An unexplored prompt keeps its first G seeds whatever the stale scores say.
    assert captured_variance(fresh, 0, 2, selected_by=stale) == pytest.approx(group_variance([0.0, 1.0]))
    with pytest.raises(ValueError, match="5 rewards for 6 candidates"):
        captured_variance(fresh, 6, 2, selected_by=stale[:5])


def _with_explored(table: RewardTable, explored: list[dict[str, np.ndarray]]) -> RewardTable:
    return RewardTable(table.iterations, table.group_size, table.source, explored, staleness=1)


def test_replay_out_of_sample_selects_by_the_explored_rewards():
    table = synthetic_reward_table(seed=3, num_iterations=8, pool_size=24, prompts_per_iteration=8, num_candidates=32)
    planners = lambda: {"bandit": BanditPlanner(seed=0), "uniform": UniformPlanner(seed=0), "none": NonePlanner()}  # noqa: E731
    kw = {"group_size": 8, "budget_fraction": 0.6}
    in_sample = replay(table, planners(), **kw).captured
    # Explored rewards equal to the fresh ones: the same replay, figure for figure.
    same = replay(_with_explored(table, table.iterations), planners(), **kw).captured
    assert same == in_sample
    # Explored rewards that carry no information about the fresh ones (noise): selection loses
    # most of what it gained over random seeds in sample (a blind pick of G is a random group),
    # while the oracle (hindsight, fresh rewards) keeps its figure.
    rng = np.random.default_rng(0)
    noise = [{p: rng.random(r.size) for p, r in it.items()} for it in table.iterations]
    blind_table = _with_explored(table, noise)
    blind = replay(blind_table, planners(), **kw).captured
    assert blind["oracle"] == in_sample["oracle"]
    none = in_sample["none"]
    assert blind["none"] == none
    for name in ("uniform", "bandit"):
        assert in_sample[name] > 1.2 * none
        assert blind[name] - none < 0.25 * (in_sample[name] - none), (name, blind[name], in_sample[name], none)
    # in_sample=True ignores the explored rewards.
    assert replay(blind_table, planners(), **kw, in_sample=True).captured == in_sample


@pytest.mark.parametrize("suffix", [".json", ".npz"])
def test_reward_table_with_explored_rewards_round_trips(tmp_path, suffix):
    fresh = [{"a": np.array([0.0, 1.0, 0.5]), "b": np.array([0.5, 0.25])}]
    stale = [{"a": np.array([0.1, 0.9, 0.4]), "b": np.array([0.5, 0.0])}]
    path = tmp_path / f"t{suffix}"
    save_reward_table(RewardTable(fresh, 2, explored=stale, staleness=1), path)
    loaded = load_reward_table(path)
    assert loaded.staleness == 1 and loaded.explored is not None
    for p in ("a", "b"):
        np.testing.assert_array_equal(loaded.explored[0][p], stale[0][p])
        np.testing.assert_array_equal(loaded.iterations[0][p], fresh[0][p])
    with pytest.raises(ValueError, match="prompt 'b': 1 explored rewards for 2 candidates"):
        RewardTable(fresh, 2, explored=[{"a": stale[0]["a"], "b": np.array([0.5])}])
    with pytest.raises(ValueError, match="different prompts"):
        RewardTable(fresh, 2, explored=[{"a": stale[0]["a"]}])


def test_benchmark_scores_out_of_sample_and_tunes_on_another_table(tmp_path):
    """A stale table is scored out of sample, beside its in-sample figures; --tune-on picks settings elsewhere."""
    kw = {"num_iterations": 3, "pool_size": 8, "prompts_per_iteration": 4, "num_candidates": 16}
    table = synthetic_reward_table(seed=1, **kw)
    rng = np.random.default_rng(1)
    noisy = [{p: r + rng.normal(0, 0.3, r.size) for p, r in it.items()} for it in table.iterations]
    save_reward_table(_with_explored(table, noisy), tmp_path / "stale.npz")
    save_reward_table(synthetic_reward_table(seed=2, **kw), tmp_path / "other.npz")
    out = (
        subprocess.run(
            [
                sys.executable,
                str(ROOT / "benchmarks" / "planner.py"),
                "--table",
                str(tmp_path / "stale.npz"),
                "--tune-on",
                str(tmp_path / "other.npz"),
            ],
            capture_output=True,
            text=True,
            check=True,
            cwd=ROOT,
        )
        .stdout.strip()
        .splitlines()
    )
    assert len(out) == 1
    result = json.loads(out[0])
    assert result["scored"] == "out_of_sample" and result["staleness"] == 1 and result["baseline"].startswith("uniform")
    assert result["in_sample"]["vs_oracle"] != result["vs_oracle"]
    tuned = result["tuned"]
    assert tuned["tune_table"].endswith("other.npz") and tuned["trials"] == 36
    assert set(tuned["chosen"]) == {"family", "discount", "prior_strength"}
    # The chosen settings are the best of the trials on the tuning table, so at least the defaults' figure there.
    assert tuned["chosen_on_tune_table"]["vs_uniform"] >= tuned["defaults_on_tune_table"]["vs_uniform"]
