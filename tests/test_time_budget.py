"""`train.max_minutes`: stop before an iteration that would end after the budget, in both trainers."""

from __future__ import annotations

import pytest
from test_cli import tiny_overrides

from spotlight.cli import main
from spotlight.config import DiTRecipe
from spotlight.core.checkpoint import load_checkpoint
from spotlight.core.config_io import load_config
from spotlight.core.time_budget import IterationBudget, progress_total
from spotlight.core.tracking import read_metrics


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def iterations_within(budget: IterationBudget, clock: FakeClock, durations: list[float]) -> int:
    """Runs iterations of the given durations (cycled) until the budget says stop; returns how many ran."""
    done = 0
    while True:
        budget.starts()
        clock.t += durations[done % len(durations)]
        done += 1
        if not budget.next_fits():
            return done


def test_steady_iterations_fill_the_budget_without_passing_it():
    clock = FakeClock()
    budget = IterationBudget(1.0, clock=clock)
    # 10-second iterations: the sixth ends at exactly 60 s, and a seventh would end at 70 s.
    assert iterations_within(budget, clock, [10.0]) == 6
    assert clock.t == 60.0
    # The old rule (stop once the time has run out) would have started a seventh at 60 s.


def test_a_periodic_slow_iteration_is_predicted_and_never_overruns():
    clock = FakeClock()
    budget = IterationBudget(1.0, clock=clock)
    # Every third iteration checkpoints and takes 16 s: the prediction is the slowest of the last five.
    n = iterations_within(budget, clock, [10.0, 10.0, 16.0])
    assert clock.t <= 60.0
    assert n == 4 and clock.t == 46.0  # a fifth could take 16 s: 62 > 60
    # One slow iteration that left the window no longer counts.
    clock2 = FakeClock()
    budget2 = IterationBudget(2.0, window=2, clock=clock2)
    assert iterations_within(budget2, clock2, [30.0, 10.0, 10.0, 10.0, 10.0, 10.0, 10.0, 10.0, 10.0, 10.0]) == 10
    assert clock2.t == 120.0


def test_the_progress_bar_shows_the_iterations_the_budget_holds():
    clock = FakeClock()
    budget = IterationBudget(1.0, clock=clock)
    assert budget.iterations_left() is None and progress_total(budget, 0, 500) == 500  # nothing timed yet
    for _ in range(2):
        budget.starts()
        clock.t += 10.0
    budget.starts()  # the second 10-s iteration closes: 40 s left, 4 more
    assert budget.iterations_left() == 4
    assert progress_total(budget, 2, 500) == 6 and progress_total(budget, 2, 5) == 5
    assert progress_total(budget, 2, 500, stopping=True) == 2
    assert progress_total(IterationBudget(0.0, clock=clock), 2, 500) == 500  # no limit


def test_the_recipe_is_ended_by_its_time_budget_not_by_an_iteration_cap():
    # A fast host (3.9 s per iteration on a 2-core Intel Xeon with AMX) must use the whole budget.
    train = load_config(DiTRecipe, "configs/dit/tiny-shapes.yaml").train
    assert train.num_iterations * 2.0 > 60 * train.max_minutes  # would need iterations under 2 s


def test_no_limit_and_bad_values():
    clock = FakeClock()
    budget = IterationBudget(0.0, clock=clock)
    clock.t = 1e9
    assert budget.next_fits()
    with pytest.raises(ValueError, match="max_minutes"):
        IterationBudget(-1.0)
    with pytest.raises(ValueError, match="window"):
        IterationBudget(1.0, window=0)


@pytest.mark.parametrize(
    "command", [["config", "configs/dit/tiny-shapes.yaml"], ["vlm", "config", "configs/vlm/tiny-count.yaml"]]
)
def test_negative_budget_is_refused_naming_the_field(capsys, command):
    assert main([*command, "train.max_minutes=-1"]) == 2
    assert "train.max_minutes" in capsys.readouterr().err


def test_recipe_budget_leaves_room_for_start_up_within_15_minutes():
    # The main job's goal is a 15-minute run: start-up and the last checkpoint take 10-20 s on 2 cores.
    assert load_config(DiTRecipe, "configs/dit/tiny-shapes.yaml").train.max_minutes <= 14.5


def test_train_stops_before_the_iteration_that_would_overrun(tiny_model_dir, tmp_path, capsys):
    run_dir = tmp_path / "run"
    minutes = 0.1  # 6 s: a few tiny iterations, far fewer than the 500 asked for
    code = main(
        ["train", *tiny_overrides(tiny_model_dir, 500), f"train.max_minutes={minutes}", "--run-dir", str(run_dir)]
    )
    assert code == 0
    out = capsys.readouterr().out
    rows = read_metrics(run_dir)
    assert 1 <= len(rows) < 500
    assert f"iteration {len(rows) + 1} would not end in time" in out
    # The last iteration done is checkpointed, so a longer budget resumes from it.
    assert load_checkpoint(run_dir).step == len(rows)
    # The iterations themselves fit the budget (the prediction is the slowest of the last five;
    # a slack of one second for start-up of the loop and a noisy machine).
    assert sum(r["time/iteration_s"] for r in rows) <= 60 * minutes + 1.0


def test_lr_cooldown_falls_linearly_over_the_end_of_the_budget():
    from spotlight.core.optim import lr_cooldown_scale

    assert [lr_cooldown_scale(f, 0.2, 0.1) for f in (0.0, 0.5, 0.8)] == [1.0, 1.0, 1.0]
    assert lr_cooldown_scale(0.9, 0.2, 0.1) == pytest.approx(0.55)
    assert lr_cooldown_scale(1.0, 0.2, 0.1) == pytest.approx(0.1)
    assert lr_cooldown_scale(1.3, 0.2, 0.1) == pytest.approx(0.1)  # an overrun stays at the floor
    assert lr_cooldown_scale(0.99, 0.0, 0.1) == 1.0  # off


def test_warmup_and_cooldown_multiply():
    import torch

    from spotlight.core.optim import apply_lr_schedule

    w = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([w], lr=1.0)
    apply_lr_schedule(opt, 3e-4, 0, scale=0.5)
    assert opt.param_groups[0]["lr"] == pytest.approx(1.5e-4)
    apply_lr_schedule(opt, 3e-4, 4, scale=0.5)  # first step of a 4-step ramp
    assert opt.param_groups[0]["lr"] == pytest.approx(3e-4 / 4 * 0.5)
    w.grad = torch.ones(2)
    opt.step()
    # No ramp, no cooldown: the rate is set anyway (a resumed optimizer never keeps a cooled rate).
    apply_lr_schedule(opt, 3e-4, 0)
    assert opt.param_groups[0]["lr"] == pytest.approx(3e-4)


@pytest.mark.parametrize("override", ["train.lr_cooldown=1.0", "train.lr_cooldown=-0.1", "train.lr_cooldown_floor=2"])
def test_bad_cooldown_is_refused_naming_the_field(capsys, override):
    assert main(["config", "configs/dit/tiny-shapes.yaml", override]) == 2
    assert override.split("=")[0] in capsys.readouterr().err


def test_the_learning_rate_cools_down_at_the_end_of_the_budget_or_of_the_iterations(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    minutes = 0.1
    args = [
        *tiny_overrides(tiny_model_dir, 500),
        f"train.max_minutes={minutes}",
        "train.lr_cooldown=0.6",
        "--run-dir",
        str(run_dir),
        "--quiet",
    ]
    assert main(["train", *args]) == 0
    scales = [r["grpo/lr_scale"] for r in read_metrics(run_dir)]
    assert scales[0] == 1.0 and 0.1 <= scales[-1] < 1.0
    assert scales == sorted(scales, reverse=True)
    # A host that finishes num_iterations well within the budget cools down over the last
    # lr_cooldown of the iterations instead: the same schedule whatever its speed. Progress after
    # iteration k of 4 is k/4, so with lr_cooldown 0.5 and floor 0.1 the factors are 1, 1, 0.55, 0.1.
    by_iterations = tmp_path / "by_iterations"
    args = [
        *tiny_overrides(tiny_model_dir, 4),
        "train.max_minutes=60",
        "train.lr_cooldown=0.5",
        "--run-dir",
        str(by_iterations),
        "--quiet",
    ]
    assert main(["train", *args]) == 0
    assert [r["grpo/lr_scale"] for r in read_metrics(by_iterations)] == pytest.approx([1.0, 1.0, 0.55, 0.1])
    # Without a time budget there is no cooldown (and no metric for it).
    plain = tmp_path / "plain"
    assert (
        main(["train", *tiny_overrides(tiny_model_dir, 2), "train.max_minutes=0", "--run-dir", str(plain), "--quiet"])
        == 0
    )
    assert all("grpo/lr_scale" not in r for r in read_metrics(plain))
