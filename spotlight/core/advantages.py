"""Group-relative advantages (GRPO; Shao et al. 2024, DeepSeekMath), shared by the DiT and VLM paths.

Shape legend: P prompts, G samples per prompt (the group).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Advantages:
    """Per-sample advantages and which samples carry a training signal."""

    adv_PG: torch.Tensor
    """(P, G) advantages; 0 where not trainable."""
    trainable_PG: torch.Tensor
    """(P, G) bool: valid reward and a group with reward variance."""
    num_zero_variance_groups: int
    """Groups whose valid rewards were all equal (filtered)."""
    num_dropped_samples: int
    """Samples whose reward was NaN (failed reward), dropped from their group."""


def group_advantages(
    rewards_PG: torch.Tensor, *, std_mode: str = "batch", clip: float = 5.0, eps: float = 1e-4
) -> Advantages:
    """A = (r - mean_group) / (std + eps), clamped to [-clip, clip].

    NaN rewards (a failed reward function) are dropped: they count neither in their group's mean
    nor in the std, and get no advantage. A group with fewer than two valid rewards, or whose
    valid rewards are all equal, has no signal and is filtered.

    Args:
        rewards_PG: (P, G) rewards, NaN for dropped samples.
        std_mode: "group" (per-group std) or "batch" (std over all valid rewards; Flow-GRPO).
        clip: clamp of |A|.
        eps: added to the std.
    """
    if std_mode not in ("group", "batch"):
        raise ValueError(f"std_mode must be 'group' or 'batch', got {std_mode!r}")
    r = rewards_PG.double()
    valid = ~torch.isnan(r)
    count = valid.sum(dim=1, keepdim=True)
    filled = torch.where(valid, r, torch.zeros_like(r))
    mean = filled.sum(dim=1, keepdim=True) / count.clamp_min(1)
    centred = torch.where(valid, r - mean, torch.zeros_like(r))
    group_var = (centred**2).sum(dim=1, keepdim=True) / count.clamp_min(1)
    has_signal = (count >= 2) & (group_var > 1e-12)
    if std_mode == "group":
        std = group_var.sqrt()
    else:
        std = r[valid].std(unbiased=False) if valid.any() else torch.zeros((), dtype=r.dtype)
    adv = (centred / (std + eps)).clamp(-clip, clip)
    trainable = valid & has_signal
    adv = torch.where(trainable, adv, torch.zeros_like(adv)).float()
    return Advantages(
        adv_PG=adv,
        trainable_PG=trainable,
        num_zero_variance_groups=int(((count >= 1) & ~has_signal).sum()),
        num_dropped_samples=int((~valid).sum()),
    )
