"""Reward functions for generated images: the registry (`spotlight.rewards.registry`) and the
built-in rewards, which register themselves with it when imported here: clip (CLIP and PickScore
style scores), geneval (object detection), jpeg (compressibility), ocr (text), shapes (the tiny
task's verifier).

`build_reward(weights, **options)` builds the weighted combination a recipe's `reward` section
names; `register_reward(name)` adds a reward of one's own.
"""

from spotlight.rewards import clip, geneval, jpeg, ocr, shapes  # noqa: F401 - importing registers them
from spotlight.rewards.registry import REWARDS, CombinedReward, build_reward, register_reward

__all__ = ["REWARDS", "CombinedReward", "build_reward", "register_reward"]
