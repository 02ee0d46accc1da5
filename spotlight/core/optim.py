"""Optimizer helpers both GRPO trainers share (the DiT's `spotlight.update`, the VLM's `vlm.driver`)."""

from __future__ import annotations

import torch


def apply_lr_schedule(optimizer: torch.optim.Optimizer, lr: float, warmup_steps: int, scale: float = 1.0) -> None:
    """Before an optimizer step, set the learning rate: a linear warm-up ramp, step k (from 1) at
    lr * min(1, k / warmup_steps) (warmup_steps 0: none), times `scale` (both trainers'
    end-of-run cooldown, `run_cooldown_scale`). The steps taken so far are read from the
    optimizer state (Adam's per-parameter "step"), so a resumed run picks up the ramp where it was;
    the rate is set every time, so a resumed run never keeps the rate a checkpoint's optimizer had."""
    ramp = 1.0
    if warmup_steps > 0:
        first = optimizer.param_groups[0]["params"][0]
        taken = int(optimizer.state.get(first, {}).get("step", 0))
        ramp = min(1.0, (taken + 1) / warmup_steps)
    for group in optimizer.param_groups:
        group["lr"] = lr * ramp * scale


def lr_cooldown_scale(progress: float, cooldown: float, floor: float) -> float:
    """The learning-rate factor at `progress` (a fraction) of a run (of its time budget or of its
    iterations, whichever is further along): 1 until the last `cooldown` of it, then falling
    linearly to `floor` at its end (a warmup-stable-decay schedule's decay phase,
    Hu et al. 2024, arXiv 2404.06395; Haegele et al. 2024, arXiv 2405.18392). cooldown 0: always 1."""
    if cooldown <= 0:
        return 1.0
    into = (progress - (1.0 - cooldown)) / cooldown  # 0 where the cooldown starts, 1 at the end
    return 1.0 - (1.0 - floor) * min(1.0, max(0.0, into))


def run_cooldown_scale(budget, iterations_done: int, num_iterations: int, cooldown: float, floor: float) -> float:
    """The cooldown factor after `iterations_done` iterations of a run with a time budget
    (`spotlight.core.time_budget.IterationBudget`) and `num_iterations`: its progress is the larger of
    the budget used and iterations_done / num_iterations, so a host fast enough to finish
    num_iterations within the budget runs the same schedule, iteration for iteration, whatever its
    speed. Without a time budget (0 minutes) there is no cooldown: 1."""
    if cooldown <= 0 or budget.seconds <= 0:
        return 1.0
    return lr_cooldown_scale(max(budget.fraction_used(), iterations_done / num_iterations), cooldown, floor)
