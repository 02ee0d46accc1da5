"""Verifiable rewards for text answers, and their weighted combination.

Shape legend: B responses.

A reward is `fn(responses, answers) -> scores_B`: B response texts, B gold answers, a float32 (B,)
tensor where higher is better. Responses are expected as `answer : <word>` (`vlm.task`);
`parse_answer` extracts the word, or None when the response is not in that format. The weighted
sum mirrors `spotlight.rewards` (the DiT path): `{"accuracy": 1.0, "format": 0.1}`.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Callable, Mapping

import torch

from spotlight.core.rewards import RewardResult

TextRewardFn = Callable[[list[str], list[str]], torch.Tensor]
"""fn(responses, answers) -> float32 scores (B,)."""

_FORMAT = re.compile(r"^answer\s*:\s*(\S+)$")


def parse_answer(response: str) -> str | None:
    """The answer word of a well-formed response (`answer : <word>`, nothing after it), else None."""
    match = _FORMAT.fullmatch(response.strip().lower())
    return match.group(1) if match else None


def _number(text: str | None) -> float | None:
    try:
        return float(text) if text is not None else None
    except ValueError:
        return None


def accuracy_reward(responses: list[str], answers: list[str]) -> torch.Tensor:
    """1 when the parsed answer equals the gold answer (numbers compared as numbers), else 0."""
    scores = []
    for response, gold in zip(responses, answers, strict=True):
        pred = parse_answer(response)
        pred_num, gold_num = _number(pred), _number(gold)
        if gold_num is not None:
            scores.append(float(pred_num is not None and pred_num == gold_num))
        else:
            scores.append(float(pred is not None and pred == gold.strip().lower()))
    return torch.tensor(scores, dtype=torch.float32)


def numeric_reward(responses: list[str], answers: list[str]) -> torch.Tensor:
    """For numeric gold answers exp(-|pred - gold|) (0 when no number is given); others as accuracy.

    A dense signal for counting: an answer off by one earns exp(-1) ~ 0.37.
    """
    exact = accuracy_reward(responses, answers)
    scores = []
    for i, (response, gold) in enumerate(zip(responses, answers, strict=True)):
        gold_num, pred_num = _number(gold), _number(parse_answer(response))
        if gold_num is None:
            scores.append(float(exact[i]))
        else:
            scores.append(math.exp(-abs(pred_num - gold_num)) if pred_num is not None else 0.0)
    return torch.tensor(scores, dtype=torch.float32)


def format_reward(responses: list[str], answers: list[str]) -> torch.Tensor:
    """1 when the response is exactly `answer : <word>`, else 0."""
    return torch.tensor([float(parse_answer(r) is not None) for r in responses], dtype=torch.float32)


REWARDS: dict[str, TextRewardFn] = {"accuracy": accuracy_reward, "numeric": numeric_reward, "format": format_reward}
"""Registered answer rewards by name."""


class CombinedReward:
    """A weighted sum of answer rewards.

    Args:
        weights: reward name -> weight; names from `REWARDS`.
    """

    def __init__(self, weights: Mapping[str, float]):
        for name in weights:
            if name not in REWARDS:
                close = difflib.get_close_matches(name, list(REWARDS), n=1)
                hint = f" Did you mean {close[0]!r}?" if close else ""
                raise ValueError(
                    f"reward.weights: unknown reward {name!r}.{hint} Registered: {', '.join(sorted(REWARDS))}"
                )
        if not weights:
            raise ValueError("reward.weights is empty; give at least one reward, e.g. {accuracy: 1.0}")
        self.weights = {name: float(w) for name, w in weights.items()}

    def __call__(self, responses: list[str], answers: list[str]) -> RewardResult:
        if len(responses) != len(answers):
            raise ValueError(f"got {len(responses)} responses but {len(answers)} answers")
        components = {name: REWARDS[name](responses, answers) for name in self.weights}
        total_B = torch.zeros(len(responses), dtype=torch.float32)
        for name, scores_B in components.items():
            total_B += self.weights[name] * scores_B
        return RewardResult(total_B=total_B, components=components)
