"""The reward registry and the weighted combination of rewards.

Shape legend: B batch, H height, W width.

A reward is a callable `fn(images_B3HW, prompts) -> scores_B`: images are float tensors in [0, 1],
prompts a list of B strings, scores a float32 (B,) tensor where higher is better. Rewards are
registered as *factories*, `make(**options) -> fn`, whose explicit keyword parameters are the
options they take (`clip_model_path`, `jpeg_quality`, ...). `build_reward` hands each factory only
the options named in its signature, so one flat `reward.*` config section serves every reward.

A reward that fails must not end a training run that has spent GPU-hours on its rollouts: the
combined reward catches the exception (or the NaN/inf a reward returns), logs it once per call,
and marks only the affected samples NaN, which the advantage code drops.
"""

from __future__ import annotations

import difflib
import inspect
import logging
import math
from collections.abc import Callable, Mapping

import torch

from spotlight.core.rewards import RewardResult

logger = logging.getLogger(__name__)

RewardFn = Callable[[torch.Tensor, list[str]], torch.Tensor]
"""fn(images_B3HW in [0, 1], prompts of length B) -> float32 scores (B,)."""

RewardFactory = Callable[..., RewardFn]
"""make(**options) -> RewardFn; its keyword parameters are the options it accepts."""

REWARDS: dict[str, RewardFactory] = {}
"""Registered reward factories by name."""


def register_reward(name: str) -> Callable[[RewardFactory], RewardFactory]:
    """Decorator that registers a reward factory under `name`.

    Args:
        name: the name used in `build_reward`'s weights (and in configs).

    Returns:
        A decorator that stores the factory in `REWARDS` and returns it unchanged.
    """

    def decorator(factory: RewardFactory) -> RewardFactory:
        if name in REWARDS:
            raise ValueError(
                f"reward {name!r} is already registered (by {REWARDS[name].__qualname__}); pick another name"
            )
        for param in inspect.signature(factory).parameters.values():
            # Options are matched by name across all rewards, so positional-only or *args
            # parameters could never be filled: a registration bug, caught at import time.
            assert param.kind in (param.KEYWORD_ONLY, param.POSITIONAL_OR_KEYWORD), (
                f"reward factory {factory.__qualname__} must take only named options, not {param}"
            )
        REWARDS[name] = factory
        return factory

    return decorator


def _unknown_name_error(kind: str, name: str, known: list[str]) -> ValueError:
    close = difflib.get_close_matches(name, known, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return ValueError(f"unknown {kind} {name!r}.{hint} Registered: {', '.join(sorted(known))}")


def _option_names(factory: RewardFactory) -> set[str]:
    return set(inspect.signature(factory).parameters)


class CombinedReward:
    """A weighted sum of rewards that survives failures of any of them.

    Args:
        fns: reward functions by name.
        weights: weight of each reward by name; the same keys as `fns`.
    """

    def __init__(self, fns: Mapping[str, RewardFn], weights: Mapping[str, float]):
        assert fns.keys() == weights.keys(), (sorted(fns), sorted(weights))
        self.fns = dict(fns)
        self.weights = {name: float(w) for name, w in weights.items()}

    def __call__(self, images: torch.Tensor, prompts: list[str]) -> RewardResult:
        """Scores a batch with every reward.

        Args:
            images: (B, 3, H, W) float in [0, 1].
            prompts: B prompts, one per image.

        Returns:
            The total and per-reward scores.
        """
        if images.ndim != 4 or images.shape[1] != 3:
            raise ValueError(f"images must be (B, 3, H, W), got shape {tuple(images.shape)}")
        if len(prompts) != images.shape[0]:
            raise ValueError(f"got {images.shape[0]} images but {len(prompts)} prompts")
        batch_size = images.shape[0]
        components = {name: self._score_one(name, images, prompts) for name in self.fns}
        total_B = torch.zeros(batch_size, dtype=torch.float32)
        for name, scores_B in components.items():
            # NaN * w stays NaN (even for w = 0), so a failed component fails the total.
            total_B = total_B + self.weights[name] * scores_B
        return RewardResult(
            total_B=total_B,
            components=components,
            num_failed=int(torch.isnan(total_B).sum()),
        )

    def _score_one(self, name: str, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        batch_size = images.shape[0]
        try:
            scores = torch.as_tensor(self.fns[name](images, prompts))
            if scores.shape != (batch_size,):
                raise RuntimeError(f"returned shape {tuple(scores.shape)}, expected ({batch_size},)")
        except Exception as e:
            logger.warning("reward %r failed on a batch of %d: %r", name, batch_size, e)
            return torch.full((batch_size,), float("nan"), dtype=torch.float32)
        scores = scores.detach().to(device="cpu", dtype=torch.float32)
        bad = ~torch.isfinite(scores)
        if bad.any():
            logger.warning(
                "reward %r gave non-finite scores for %d of %d samples",
                name,
                int(bad.sum()),
                batch_size,
            )
            scores = scores.masked_fill(bad, float("nan"))
        return scores


def build_reward(weights: Mapping[str, float], **options: object) -> CombinedReward:
    """Builds the weighted combination of registered rewards.

    Args:
        weights: weight of each reward by registered name, e.g. `{"shapes": 1.0}`.
        **options: options for the rewards, e.g. `clip_model_path="/models/clip"`. Each reward's
            factory receives the options its signature names; an option that no registered reward
            takes is an error (a typo), one taken only by rewards not in `weights` is ignored.

    Returns:
        The combined reward.
    """
    if not weights:
        raise ValueError(f"reward weights are empty; give at least one of: {', '.join(sorted(REWARDS))}")
    for name, weight in weights.items():
        if name not in REWARDS:
            raise _unknown_name_error("reward", name, list(REWARDS))
        if not math.isfinite(weight):
            raise ValueError(f"weight of reward {name!r} is {weight}; give a finite number")
    known_options = set().union(*(_option_names(f) for f in REWARDS.values()))
    for option in options:
        if option not in known_options:
            raise _unknown_name_error("reward option", option, sorted(known_options))
    fns = {}
    for name in weights:
        factory = REWARDS[name]
        accepted = _option_names(factory)
        fns[name] = factory(**{k: v for k, v in options.items() if k in accepted})
    return CombinedReward(fns, weights)
