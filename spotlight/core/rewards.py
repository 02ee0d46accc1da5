"""A batch's rewards, as both paths score them, and their all-gather across data-parallel ranks."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spotlight.core.distributed import DataParallel


@dataclass
class RewardResult:
    """Scores of one batch; every tensor is float32 on the CPU."""

    total_B: torch.Tensor
    """(B,) weighted sum of the components; NaN where any component failed for that sample."""
    components: dict[str, torch.Tensor]
    """(B,) unweighted scores of each reward by name; NaN where it failed."""
    num_failed: int = 0
    """Number of samples whose total is NaN."""


def gather_rewards(dp: DataParallel, local: RewardResult) -> RewardResult:
    """The whole batch's rewards on every rank, from each rank's rewards of its rows (rank order)."""
    if dp.world_size == 1:
        return local
    total_B = dp.all_gather_rows(local.total_B)
    components = {name: dp.all_gather_rows(value) for name, value in local.components.items()}
    return RewardResult(total_B, components, num_failed=int(torch.isnan(total_B).sum()))
