"""The recipe sections both paths share, one name per setting: GRPO's optimisation (`train`) and
tracking (`log`).

The DiT recipe (`spotlight.config`) and the VLM recipe (`vlm.config`) subclass these sections and
add their own settings; a subclass that only changes a default redeclares the field without a
docstring, and `config_io.field_docs` keeps the one written here. The checks a value needs
whatever the path are `validate` here; each subclass calls it first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass
class TrainSettings:
    """GRPO optimisation."""

    num_iterations: int = 1000
    """Rollout + update iterations, at most; `max_minutes` usually ends a run first."""
    prompts_per_iteration: int = 16
    """Prompts per iteration (P); the batch is P x G samples."""
    group_size: int = 16
    """Samples per prompt (G): the GRPO group (DiT: seeds; VLM: responses)."""
    lr: float = 3e-4
    """AdamW learning rate."""
    lr_warmup_steps: int = 0
    """Optimizer steps over which the learning rate ramps linearly up to lr (Adam's first steps are its largest); 0:
    none."""
    lr_cooldown: float = 0.0
    """The last fraction of the run over which the learning rate falls linearly to lr_cooldown_floor x lr; progress is
    the larger of the time budget (train.max_minutes) used and the iterations done over num_iterations (0: none; also
    none without a time budget)."""
    lr_cooldown_floor: float = 0.1
    """The learning-rate factor the cooldown ends at."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    adam_beta2: float = 0.999
    """AdamW's second-moment decay: its horizon, about 1 / (1 - adam_beta2) optimizer steps, is how long a past
    gradient's size keeps scaling the steps down."""
    max_grad_norm: float = 1.0
    """Gradient clipping norm."""
    clip_range: float = 0.2
    """PPO ratio clip epsilon (the ratio's lower bound is 1 - clip_range)."""
    adv_clip: float = 5.0
    """Clamp |advantage| to this."""
    adv_std: Literal["group", "batch"] = "group"
    """Normalise advantages by the per-group (GRPO) or the whole-batch (Flow-GRPO) reward std."""
    beta: float = 0.0
    """KL weight to the reference policy (the model at the start of training: LoRA disabled, or a frozen copy)."""
    num_inner_epochs: int = 1
    """Passes over each iteration's rollouts."""
    minibatch_size: int = 128
    """Samples per optimizer step."""
    seed: int = 0
    """Run seed: prompts, sampling seeds and minibatch order derive from it."""
    max_minutes: float = 14.0
    """Training time budget: stop before an iteration predicted (the slowest of the last 5) to end after it; 0 = no
    limit."""
    num_threads: int = 0
    """torch CPU threads; 0 keeps torch's default."""

    def validate(self) -> None:
        if self.group_size < 2:
            raise ValueError(f"train.group_size must be >= 2 for GRPO, got {self.group_size}")
        for name in ("num_iterations", "prompts_per_iteration", "minibatch_size", "num_inner_epochs"):
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name} must be >= 1, got {getattr(self, name)}")
        if not self.lr >= 0:  # 0 freezes the weights (a diagnostic: stale equals fresh)
            raise ValueError(f"train.lr must be >= 0, got {self.lr}")
        if self.weight_decay < 0:
            raise ValueError(f"train.weight_decay must be >= 0, got {self.weight_decay}")
        if self.lr_warmup_steps < 0:
            raise ValueError(f"train.lr_warmup_steps must be >= 0, got {self.lr_warmup_steps}")
        if not 0 <= self.lr_cooldown < 1 or not 0 <= self.lr_cooldown_floor <= 1:
            raise ValueError(
                f"train.lr_cooldown must be in [0, 1) and train.lr_cooldown_floor in [0, 1], got {self.lr_cooldown}, "
                f"{self.lr_cooldown_floor}"
            )
        if not 0 < self.adam_beta2 < 1:
            raise ValueError(f"train.adam_beta2 must be in (0, 1), got {self.adam_beta2}")
        if self.clip_range <= 0 or self.beta < 0:
            raise ValueError(f"train.clip_range must be > 0 and train.beta >= 0, got {self.clip_range}, {self.beta}")
        if self.max_minutes < 0:
            raise ValueError(f"train.max_minutes must be >= 0 (0: no limit), got {self.max_minutes}")


@dataclass
class LogSettings:
    """Tracking and checkpoints."""

    wandb_project: str = "spotlight"
    """wandb project name."""
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"
    """wandb mode; online needs `wandb login` (or WANDB_API_KEY)."""
    checkpoint_every: int = 10
    """Save a checkpoint every this many iterations (and at the end)."""
    keep_last: int = 3
    """Checkpoints kept on disk."""
