"""The cluster simulator (`spot.sim`): event engine on the real queue, spot pool, SP groups, policies, CLI."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from planners import load_reward_table, synthetic_reward_table
from spot.jobqueue import Job
from spot.sim import POLICIES, Learning, Profile, Setup, compare, load_profile, profile_from_run, simulate
from spot.sim.engine import Cluster, EventLoop
from spot.traces import Trace, TraceEvent

REPO = Path(__file__).resolve().parents[1]


def small_profile(**kw) -> Profile:
    base = dict(
        name="small",
        prompts_per_iteration=4,
        group_size=4,
        num_steps=6,
        samples_per_job=2,
        job_step_s=1.0,
        reward_gpu_s_per_sample=0.0,
        update_gpu_s=20.0,
        iterations_to_target=6,
        weight_sync_s=0.0,
        node_startup_s=3.0,
        detect_s=2.0,
        poll_s=0.5,
        commit_every=2,
    )
    return Profile(**{**base, **kw})


def trace_of(*events, duration=1000.0) -> Trace:
    return Trace(
        tuple(TraceEvent(t, n, k, lead) for t, n, k, lead in events), duration_s=duration, source="test", format="test"
    )


def jobs(n: int) -> list[Job]:
    return [Job(i, num_steps=10) for i in range(n)]


def test_event_loop_order_and_stall():
    loop, seen = EventLoop(), []
    loop.at(2.0, seen.append, "b")
    loop.at(1.0, seen.append, "a")
    loop.at(2.0, seen.append, "c")  # ties keep scheduling order
    loop.run_until(lambda: False, deadline=5.0)
    assert seen == ["a", "b", "c"] and loop.now == 5.0
    with pytest.raises(RuntimeError, match="stalled"):
        loop.run_until(lambda: False)


def test_on_demand_phase_time_is_exact():
    # 2 workers, 5 jobs of 6 steps at 1 s: 3 rounds on one worker -> 18 s; nothing lost.
    loop = EventLoop()
    c = Cluster(loop, small_profile(), None, on_demand_gpus=2, handoff=False)
    res = c.run_phase(jobs(5), 6, pools=(False,))
    assert res.done == set(range(5))
    assert res.end_s == pytest.approx(18.0)
    assert res.recomputed_steps == 0 and c.on_demand.busy_gpu_s == pytest.approx(30.0)


def test_preemption_without_notice_resumes_from_last_commit_exactly_once():
    # A spot node preempted at 3.5 s: its job had 3 steps done, committed at step 2 -> 1 step lost.
    loop = EventLoop()
    trace = trace_of((0.0, "n0", "add", None), (3.5, "n0", "preempt", None))
    c = Cluster(loop, small_profile(), trace, on_demand_gpus=1, wrap=False, initial_ready=True, handoff=False)
    res = c.run_phase(jobs(2), 6, pools=(False, True))
    assert res.done == {0, 1}
    assert res.recomputed_steps == 1 == c.lost_steps
    assert c.preemptions == 1
    # The on-demand worker finishes job 0 at 6 s, then the lost job (declared lost at 5.5 s) from
    # step 2: 4 more steps -> 10 s.
    assert res.end_s == pytest.approx(10.0)
    # Lost work: the step in flight (0.5 s) plus the one recomputed step (1 s).
    assert c.spot.lost_gpu_s == pytest.approx(1.5)


def test_notice_commits_and_loses_nothing():
    loop = EventLoop()
    trace = trace_of((0.0, "n0", "add", None), (3.5, "n0", "preempt", 2.0))  # warned at 1.5 s
    c = Cluster(loop, small_profile(), trace, on_demand_gpus=1, wrap=False, initial_ready=True, handoff=False)
    res = c.run_phase(jobs(2), 6, pools=(False, True))
    assert res.done == {0, 1} and res.recomputed_steps == 0 and c.notices == 1
    assert c.spot.lost_gpu_s == 0.0
    # The spot worker finished step 2 at 2 s, committed and released it; the on-demand worker
    # resumes it after its own job: 6 + 4 = 10 s.
    assert res.end_s == pytest.approx(10.0)


def test_new_nodes_start_after_startup_and_are_paid_while_held():
    loop = EventLoop()
    trace = trace_of((0.0, "n0", "add", None), (50.0, "n0", "preempt", None), duration=60.0)
    c = Cluster(loop, small_profile(), trace, on_demand_gpus=0, wrap=False)
    res = c.run_phase(jobs(1), 6, pools=(True,))
    assert res.end_s == pytest.approx(3.0 + 6.0)  # startup then 6 steps
    loop.advance(100.0)
    c.finish()
    assert c.spot.held_gpu_s == pytest.approx(50.0)
    assert c.spot.busy_gpu_s == pytest.approx(6.0)


def test_trace_wraps_when_the_run_outlasts_it():
    loop = EventLoop()
    trace = trace_of((0.0, "n0", "add", None), (5.0, "n0", "preempt", None), (8.0, "n0", "add", None), duration=10.0)
    c = Cluster(loop, small_profile(), trace, on_demand_gpus=1, wrap=True)
    loop.advance(35.0)
    assert c.preemptions == 4  # one per 10 s cycle (the cycles start with n0 already up)


def test_elastic_sp_group_shrinks_instead_of_restarting_cold():
    prof = small_profile(sp_degree=2, min_sp_degree=1, reform_s=0.5, cold_restart_s=30.0, detect_s=1.0)
    trace = trace_of((0.0, "a", "add", None), (0.0, "b", "add", None), (2.5, "b", "preempt", None))
    ends = {}
    for elastic in (True, False):
        loop = EventLoop()
        c = Cluster(loop, prof, trace, on_demand_gpus=0, wrap=False, initial_ready=True, elastic=elastic, handoff=False)
        res = c.run_phase(jobs(3), 6, pools=(True,))
        assert res.done == {0, 1, 2}
        ends[elastic] = res.end_s
    # Elastic: "a" re-forms alone 1.5 s after the loss and carries on at half speed (x 2**0.9 slower);
    # not elastic: it waits for a 30 s cold restart first.
    assert ends[True] < ends[False] - 20


def test_the_learning_model_gives_the_measured_iterations_ratios():
    """Plain GRPO advances one unit, a full fresh pool on every prompt `selection_iterations_ratio`,
    a stale one `stale_gain_share` of the gain; a partial pool its share in between."""
    table = synthetic_reward_table(seed=1, prompts_per_iteration=4, group_size=4, num_candidates=32)
    learning = Learning(table, small_profile(selection_iterations_ratio=1.8, stale_gain_share=0.5))
    prompts = learning.prompts(3)
    full = {p: 32 for p in prompts}
    assert learning.progress(prompts, {}, stale=False) == 1.0
    assert learning.progress(prompts, full, stale=False) == pytest.approx(1.8)
    assert learning.progress(prompts, full, stale=True) == pytest.approx(1.4)
    assert learning.progress(prompts, {p: 32 for p in list(prompts)[:2]}, stale=False) == pytest.approx(1.4)
    shares = [learning.share(n) for n in range(0, 33)]
    assert shares[:5] == [0.0] * 5 and shares[-1] == pytest.approx(1.0) and 0 < shares[8] < 1
    # Through the whole simulation: inline exploration with a budget for every prompt's full pool
    # (from the second iteration on) reaches the target of 18 plain iterations in 1 + 17 / 1.5.
    prof = small_profile(iterations_to_target=18, selection_iterations_ratio=1.5, update_gpu_s=400.0)
    tab = synthetic_reward_table(seed=0, prompts_per_iteration=4, group_size=4, num_candidates=32)
    big = Setup(
        profile=prof,
        trace=trace_of((0.0, "n0", "add", None), duration=100.0),
        table=tab,
        trainer_gpus=1,
        baseline_gpus=1,
        planner="uniform",
    )
    assert simulate("ondemand", big).iterations == 18
    assert simulate("inline", big).iterations == 1 + math.ceil(17 / 1.5)


def test_the_learning_model_predicts_the_measured_curve_over_explorer_capacity():
    """Fitted on the oracle alone (one ratio), the model predicts what stale selection with 1, 2, 4
    and 8 emulated spot nodes measured from the prompts each selected per iteration (full pools of
    64), within 20% of each median. The medians move in steps of about 17% (evaluations every 2
    iterations): a model that ignored the dose (every k at the oracle's ratio) misses k = 1 by 36%."""
    measured = json.loads((REPO / "benchmarks/data/exploration-iterations.json").read_text())
    table = load_reward_table(REPO / "benchmarks/data/tiny-shapes-rewards.npz")
    prof = load_profile("qwen-image-512")
    learning = Learning(table, prof)
    assert prof.selection_iterations_ratio == measured["oracle"]["ratio_median"] and learning.pool == measured["pool"]
    prompts = learning.prompts(0)
    assert len(prompts) == 16
    for row in measured["stale"]:
        explored = {p: learning.pool for p in list(prompts)[: round(row["prompts_selected_per_iteration"])]}
        predicted = learning.progress(
            prompts, explored, stale=True
        )  # iterations ratio: progress per iteration over plain GRPO's 1
        assert abs(predicted / row["ratio_median"] - 1) <= 0.2, (row, predicted)


def setup(**kw) -> Setup:
    prof = kw.pop("profile", small_profile())
    table = synthetic_reward_table(
        seed=0, prompts_per_iteration=prof.prompts_per_iteration, group_size=prof.group_size, num_candidates=32
    )
    trace = kw.pop(
        "trace",
        trace_of(
            (0.0, "n0", "add", None),
            (0.0, "n1", "add", None),
            (40.0, "n1", "preempt", None),
            (70.0, "n1", "add", None),
            duration=100.0,
        ),
    )
    return Setup(**{"profile": prof, "trace": trace, "table": table, "trainer_gpus": 1, "baseline_gpus": 3, **kw})


def test_policies_reach_the_target_and_explore_within_budget():
    s = setup()
    results = {name: simulate(name, s) for name in POLICIES}
    target = s.profile.iterations_to_target
    for name, r in results.items():
        assert r.series["progress"][-1] >= target and r.series["progress"][-2] < target, name
        assert r.wall_s == pytest.approx(r.series["iteration_end_s"][-1])
    # Exploration buys fewer iterations; spotlight retains a share of it (stale weights).
    assert results["inline"].iterations <= results["ondemand"].iterations
    assert results["spotlight"].mean_budget_samples > 0 and results["spotlight"].spot_utilisation > 0
    assert results["ondemand"].spot_utilisation is None and results["ondemand"].cost_spot_usd == 0
    # Costs: on-demand GPUs x wall time x price, exactly.
    r = results["ondemand"]
    assert r.cost_usd == pytest.approx(3 * r.wall_s / 3600 * s.on_demand_usd_per_gpu_hour)
    rows = compare(results)
    assert rows["ondemand"]["cost_ratio_vs_ondemand"] == 1.0
    assert rows["spotlight"]["cost_ratio_vs_ondemand"] == pytest.approx(
        r.cost_usd / results["spotlight"].cost_usd, rel=1e-3
    )


def test_spot_price_history_is_charged_by_interval():
    flat = simulate("disaggregated", setup(spot_discount=0.5))
    stepped = simulate("disaggregated", setup(spot_prices=[[0.0, 2.0], [50.0, 4.0]]))
    assert flat.cost_spot_usd < stepped.cost_spot_usd  # 2.0 throughout vs 2.0 then 4.0 from 50 s
    assert stepped.spot_gpu_s_held == pytest.approx(flat.spot_gpu_s_held)


def test_setup_and_profile_errors_name_the_field(tmp_path):
    with pytest.raises(ValueError, match="group size 8"):
        Setup(
            profile=small_profile(),
            trace=None,
            table=synthetic_reward_table(group_size=8),
            trainer_gpus=1,
            baseline_gpus=1,
        )
    with pytest.raises(ValueError, match="job_step_s"):
        small_profile(job_step_s=0.0)
    bad = tmp_path / "p.yaml"
    bad.write_text("base: qwen-image-512\njob_stp_s: 1.0\n")
    with pytest.raises(ValueError, match="job_stp_s.*job_step_s"):
        load_profile(str(bad))
    good = tmp_path / "q.yaml"
    good.write_text("base: qwen-image-512\nname: mine\njob_step_s: 2.0\n")
    prof = load_profile(str(good))
    assert prof.job_step_s == 2.0 and prof.group_size == 16
    with pytest.raises(ValueError, match="neither a built-in"):
        load_profile(str(tmp_path / "missing.yaml"))
    with pytest.raises(ValueError, match="unknown policy"):
        simulate("spot-everything", setup())


def test_profile_from_run_reads_the_time_columns(tmp_path):
    from spot.sim.profile import METRICS_FILE
    from spotlight.config import DiTRecipe
    from spotlight.core.config_io import save_config
    from spotlight.core.tracking import METRICS_FILE as TRAINER_METRICS_FILE
    from spotlight.core.tracking import Tracker

    assert METRICS_FILE == TRAINER_METRICS_FILE  # spot repeats the name: it may not import spotlight
    cfg = DiTRecipe()
    save_config(cfg, tmp_path / "config.yaml")
    with Tracker(tmp_path, project="t", run_name="t", mode="disabled", config={}) as tracker:
        for step, (ro, up) in enumerate([(9.0, 9.0), (2.0, 4.0), (2.2, 4.4), (1.8, 3.6)], start=1):
            tracker.log({"time/rollout_s": ro, "time/reward_s": 0.1, "time/update_s": up}, step=step)
    prof = profile_from_run(tmp_path)
    steps = cfg.sample.num_steps
    assert prof.job_step_s == pytest.approx(2.0 / steps)  # median of the iterations after the first
    assert prof.update_gpu_s == pytest.approx(4.0)
    assert prof.prompts_per_iteration == cfg.train.prompts_per_iteration and prof.num_steps == steps
    with pytest.raises(ValueError, match="not a run directory"):
        profile_from_run(tmp_path / "nope")


def test_cli_writes_json_and_plots(tmp_path, capsys):
    from spotlight.cli import main

    prof = tmp_path / "prof.json"
    prof.write_text(json.dumps(small_profile(prompts_per_iteration=8, group_size=8).to_dict()))
    out = tmp_path / "sim"
    rc = main(
        [
            "simulate",
            "--synthetic",
            "--profile",
            str(prof),
            "--trainer-gpus",
            "1",
            "--spot-gpus",
            "2",
            "--out",
            str(out),
            "--json",
        ]
    )
    assert rc == 0
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(rows) == set(POLICIES)
    assert all(math.isfinite(r["cost_ratio_vs_ondemand"]) for r in rows.values())
    for name in ("simulation.json", "progress.png", "cost_time.png", "spot_timeline.png"):
        assert (out / name).stat().st_size > 0
    assert main(["simulate", "--trace", str(tmp_path / "none.csv"), "--out", str(out)]) == 2
    assert "--trace" in capsys.readouterr().err
    assert main(["simulate", "--synthetic", "--set", "node_startup_s=-1", "--out", str(out)]) == 2
    assert "node_startup_s" in capsys.readouterr().err
    rc = main(
        [
            "simulate",
            "--synthetic",
            "--profile",
            str(prof),
            "--set",
            "iterations_to_target=3",
            "--policies",
            "ondemand",
            "--trainer-gpus",
            "1",
            "--spot-gpus",
            "2",
            "--out",
            str(out),
            "--json",
        ]
    )
    assert rc == 0
    assert (
        json.loads(capsys.readouterr().out.strip().splitlines()[-1])["ondemand"]["iterations"]
        < rows["ondemand"]["iterations"]
    )


def test_push_baseline_keeps_jobs_where_they_were_pushed():
    # n0 steps at 1 s, n1 at 2 s; 4 jobs of 6 steps. Push: 2 jobs each -> n1 needs 24 s. Pull: n0 runs
    # jobs 0 and 2 (12 s) while n1 runs job 1 (12 s); n1 pulls job 3 at 12 s, and the free, faster n0
    # takes it over through a commit after n1's first step (14 s): 5 more steps -> 19 s.
    trace = trace_of((0.0, "n0", "add", None), (0.0, "n1", "add", None))
    ends = {}
    for scheduler in ("push", "pull"):
        loop = EventLoop()
        c = Cluster(
            loop,
            small_profile(),
            trace,
            on_demand_gpus=0,
            wrap=False,
            initial_ready=True,
            node_speed=lambda n: 1.0 if n == "n0" else 0.5,
        )
        res = c.run_phase(jobs(4), 6, pools=(True,), scheduler=scheduler)
        assert res.done == set(range(4))
        ends[scheduler] = res.end_s
    assert ends == {"push": pytest.approx(24.0), "pull": pytest.approx(19.0)}


def test_push_re_pushes_a_lost_workers_jobs_to_the_workers_ready():
    trace = trace_of((0.0, "n0", "add", None), (0.0, "n1", "add", None), (3.5, "n1", "preempt", None))
    loop = EventLoop()
    c = Cluster(loop, small_profile(), trace, on_demand_gpus=0, wrap=False, initial_ready=True)
    res = c.run_phase(jobs(4), 6, pools=(True,), scheduler="push")
    # n1 held jobs 1 and 3; declared lost at 5.5 s, both go to n0, job 1 from its commit at step 2.
    assert res.done == set(range(4)) and res.recomputed_steps == 1
    assert res.end_s == pytest.approx(6 + 6 + 4 + 6)
    with pytest.raises(ValueError, match="scheduler"):
        c.run_phase(jobs(1), 6, pools=(True,), scheduler="round-robin")


def test_the_bandit_gets_the_setups_prompt_family(monkeypatch, capsys):
    from spot.sim import policies
    from spotlight.cli import main

    seen = []
    real = policies.build_planner
    # A spy on the real factory (the planner it builds runs the simulation unchanged).
    monkeypatch.setattr(policies, "build_planner", lambda name, **kw: seen.append((name, kw)) or real(name, **kw))
    simulate("spotlight", setup(planner_family=r"matches:\d$"))
    name, kw = seen[-1]
    assert name == "bandit" and kw["family"]("prompt-034") == "4"
    simulate("spotlight", setup())
    assert seen[-1][1]["family"] is None  # "": one family
    simulate("spotlight", setup(planner="uniform", planner_family="shapes_counts"))
    assert "family" not in seen[-1][1]  # only the bandit has families
    with pytest.raises(ValueError, match="planner_family"):
        setup(planner_family="matches:(")
    assert main(["simulate", "--synthetic", "--planner-family", "no_such_preset", "--json"]) == 2
    assert "planner_family" in capsys.readouterr().err
