"""Optimizer helpers both GRPO trainers share (the DiT's `spotlight.trainer`, the VLM's `vlm.train`)."""

from __future__ import annotations

import torch


def apply_lr_warmup(optimizer: torch.optim.Optimizer, lr: float, warmup_steps: int) -> None:
    """Before an optimizer step: a linear ramp, step k (from 1) at lr * min(1, k / warmup_steps);
    warmup_steps 0 leaves the learning rate alone. The steps taken so far are read from the
    optimizer state (Adam's per-parameter "step"), so a resumed run picks up the ramp where it was."""
    if warmup_steps <= 0:
        return
    first = optimizer.param_groups[0]["params"][0]
    taken = int(optimizer.state.get(first, {}).get("step", 0))
    for group in optimizer.param_groups:
        group["lr"] = lr * min(1.0, (taken + 1) / warmup_steps)
