"""The VLM GRPO recipes: typed dataclasses, the single source of truth for every setting.

`VLMRecipe` defaults are the tiny CPU recipe (`configs/vlm/tiny-count.yaml` spells the same values
out, and turns on `train.refill_prompts`, off by default): GRPO on the shapes question task, starting from the
warm-started tiny Qwen2.5-VL that
`WarmStartRecipe` (`configs/vlm/tiny-warmstart.yaml`) builds. Recipes are loaded with
`spotlight.core.config_io.load_config`; dotted command-line overrides (`train.lr=1e-4`) win.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from spotlight.core.config import LogSettings, TrainSettings
from spotlight.core.cost import CostConfig

COLOR_RGB = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (230, 200, 30),
    "purple": (150, 60, 190),
    "orange": (245, 140, 20),
}
"""The task's colour names and how `vlm.task` draws them (a recipe's task.colors picks from these)."""
QUESTION_TYPES = ("count_color", "count_kind", "color_of", "compare")
"""The task's question types (task.question_weights names each)."""


@dataclass
class TaskConfig:
    """The synthetic shapes question task (see `vlm.task`)."""

    grid_size: int = 3
    """Cells per side; the image is grid_size * 28 pixels square (one vision token per cell)."""
    max_shapes: int = 4
    """Most shapes in a scene (at least one); counts range over 0..max_shapes."""
    colors: tuple[str, ...] = ("red", "green", "blue", "yellow")
    """Shape colours used (from red, green, blue, yellow, purple, orange)."""
    question_weights: dict[str, float] = field(
        default_factory=lambda: {"count_color": 1.0, "count_kind": 1.0, "color_of": 1.0, "compare": 1.0}
    )
    """Relative frequency of each question type (count_color, count_kind, color_of, compare)."""
    num_heldout: int = 256
    """Examples in the held-out split."""
    split_seed: int = 0
    """Seed of the held-out split (training examples are drawn from a disjoint seed stream)."""

    def validate(self) -> None:
        unknown = [c for c in self.colors if c not in COLOR_RGB]
        if unknown or len(set(self.colors)) < 2:
            raise ValueError(f"colors must be >= 2 distinct names from {sorted(COLOR_RGB)}, got {list(self.colors)}")
        if set(self.question_weights) != set(QUESTION_TYPES) or min(self.question_weights.values()) < 0:
            raise ValueError(f"question_weights needs a weight >= 0 for each of {list(QUESTION_TYPES)}")
        if not 1 <= self.max_shapes <= self.grid_size**2:
            raise ValueError(f"max_shapes must be in [1, grid_size^2 = {self.grid_size**2}], got {self.max_shapes}")


@dataclass
class TinyVLMConfig:
    """Sizes of a tiny VLM built from its transformers config (random weights, see `vlm.tiny`)."""

    family: Literal["qwen2_5_vl", "qwen3_vl"] = "qwen2_5_vl"
    """Model class: Qwen2_5_VLForConditionalGeneration or Qwen3VLForConditionalGeneration."""
    text_hidden: int = 64
    """Hidden size of the language model."""
    text_layers: int = 2
    """Decoder layers."""
    text_heads: int = 4
    """Attention heads of the language model (head dim = text_hidden / text_heads)."""
    vision_hidden: int = 64
    """Hidden size of the vision tower."""
    vision_depth: int = 2
    """Vision transformer blocks."""
    vision_heads: int = 4
    """Vision attention heads."""
    seed: int = 0
    """Initialisation seed."""


@dataclass
class WarmStartRecipe:
    """Supervised warm start: build a tiny VLM and teach it the answer format (`vlm warmstart`)."""

    name: str = "tiny-warmstart"
    """Recipe name."""
    model: TinyVLMConfig = field(default_factory=TinyVLMConfig)
    """Model sizes."""
    task: TaskConfig = field(default_factory=TaskConfig)
    """The task (its held-out split is never trained on)."""
    vision_pretrain_steps: int = 300
    """Steps of the vision tower's own pretraining, before the supervised run: it learns to name each
    grid cell's colour and kind through a linear head that is then dropped (`vlm.warmstart`). A
    stand-in for the pretrained vision encoder a real VLM ships with; 0 skips it."""
    freeze_vision: bool = True
    """Keep the vision tower (and its merger) fixed during the supervised run, as a pretrained
    encoder is; the language model learns to use its features."""
    num_steps: int = 400
    """Supervised optimizer steps (short on purpose: the base answers in the format but is often wrong)."""
    batch_size: int = 32
    """Examples per step."""
    lr: float = 1e-3
    """AdamW learning rate (constant)."""
    seed: int = 1
    """Data seed (a training stream distinct from GRPO's default train.seed)."""
    num_threads: int = 0
    """torch CPU threads; 0 keeps torch's default."""


@dataclass
class ModelConfig:
    """Which VLM to post-train and how."""

    path: str = "runs/vlm-tiny-base"
    """Model folder (weights, config, processor) as written by save_pretrained; `vlm warmstart` writes the tiny one
    here."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Weights dtype."""
    device: str = "cpu"
    """Torch device, e.g. cpu or cuda."""
    lora_rank: int = 0
    """LoRA rank on the language model's projections (and the vision tower's when train_vision);
    0 trains all weights."""
    lora_alpha: float = 0.0
    """LoRA alpha; 0 means equal to the rank."""
    train_vision: bool = True
    """Train the vision tower (and its merger); False freezes them."""


@dataclass
class RolloutConfig:
    """Response sampling."""

    MOVED: ClassVar[dict[str, str]] = {"group_size": "train.group_size"}
    """Keys that moved to another section (`config_io`: a recipe that uses one fails naming the new key)."""

    engine: Literal["hf"] = "hf"
    """Rollout engine: "hf" (transformers generate); vLLM can be added behind the same interface."""
    max_new_tokens: int = 6
    """Most generated tokens per response (the end-of-turn token included)."""
    temperature: float = 1.0
    """Sampling temperature; log-probs for the loss use the same temperature."""
    batch_size: int = 128
    """Sequences per generate call (results do not depend on it; size it to memory)."""


@dataclass
class RewardConfig:
    """Answer rewards and their weights (see `vlm.rewards`)."""

    weights: dict[str, float] = field(default_factory=lambda: {"accuracy": 1.0, "format": 0.1})
    """Reward name -> weight (accuracy, numeric, format); the total is the weighted sum."""


@dataclass
class TrainConfig(TrainSettings):
    """GRPO optimisation (the shared settings: `spotlight.core.config.TrainSettings`)."""

    num_iterations: int = 8000
    group_size: int = 8
    lr: float = 1e-3
    """AdamW learning rate (tiny recipe: 1e-3 with beta 0.1 and refill_prompts 16; see docs/vlm-recipe-notes.md)."""
    beta: float = 0.1
    """Weight of the k3 KL estimate to the reference policy (the model at the start of training); the tiny recipe's 0.1
    keeps the base's answer spread at lr 1e-3 (beta 0 collapses every group to one answer)."""
    clip_range_high: float = 0.0
    """DAPO clip-higher: the ratio's upper bound is 1 + clip_range_high; 0 keeps it symmetric (1 + clip_range)."""
    loss_agg: Literal["token", "sequence"] = "token"
    """"token": mean over all response tokens of the batch (DAPO); "sequence": mean over sequences of each one's token
    mean (GRPO)."""
    drop_flat_groups: bool = False
    """Leave groups whose rewards are all equal (advantage 0) out of the reference pass and the update (DAPO's dynamic
    sampling, without refilling). Saves their compute; changes only which samples the KL term sees."""
    refill_prompts: int = 0
    """DAPO's dynamic sampling (Yu et al. 2025, Sec. 3.2), with one bounded refill: roll out this many extra prompts
    each iteration, and update on the first prompts_per_iteration groups with a reward spread among all of them (flat
    groups are dropped, as with drop_flat_groups, and replaced); 0 = off."""
    micro_batch_size: int = 128
    """Responses per forward pass (gradients accumulate; results do not depend on it beyond float order)."""
    schedule: Literal["serial", "rollplex"] = "rollplex"
    """Phase schedule (the Rollplex paper): "serial" runs each phase over the whole sequence; "rollplex" runs the
    reference and actor prefixes (vision tower + prompt prefill, once per prompt) during decode and only the response
    suffix after. Same losses up to float order."""

    def validate(self) -> None:
        super().validate()
        if self.schedule not in ("serial", "rollplex"):
            raise ValueError(f"train.schedule must be 'serial' or 'rollplex', got {self.schedule!r}")
        if self.refill_prompts < 0:
            raise ValueError(f"train.refill_prompts must be >= 0 (0: no refill), got {self.refill_prompts}")
        if self.micro_batch_size < 1:
            raise ValueError(f"train.micro_batch_size must be >= 1, got {self.micro_batch_size}")
        if self.clip_range_high < 0:
            raise ValueError(f"train.clip_range_high must be >= 0 (0: equal to clip_range), got {self.clip_range_high}")


@dataclass
class LogConfig(LogSettings):
    """Tracking and checkpoints (the shared settings: `spotlight.core.config.LogSettings`)."""

    wandb_project: str = "spotlight-vlm"
    checkpoint_every: int = 50


@dataclass
class EvalConfig:
    """Held-out evaluation (greedy decoding)."""

    every: int = 0
    """During `vlm train`, evaluate the held-out split every this many iterations (eval/* metrics); 0 = never."""
    batch_size: int = 128
    """Examples per generate call."""


@dataclass
class VLMRecipe:
    """A VLM GRPO post-training recipe."""

    name: str = "tiny-count"
    """Recipe name (the wandb run name and the default run directory name)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Model."""
    task: TaskConfig = field(default_factory=TaskConfig)
    """Task and held-out split."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Sampling."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Rewards."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Optimisation."""
    log: LogConfig = field(default_factory=LogConfig)
    """Tracking and checkpoints."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Evaluation."""
    cost: CostConfig = field(default_factory=CostConfig)
    """GPU prices for the run's cost ledger (`cost.json`, `spotlight cost RUN_DIR`)."""

    def validate(self) -> None:
        if self.rollout.temperature <= 0:
            raise ValueError(f"rollout.temperature must be > 0, got {self.rollout.temperature}")
        if self.rollout.max_new_tokens < 1:
            raise ValueError(f"rollout.max_new_tokens must be >= 1, got {self.rollout.max_new_tokens}")
