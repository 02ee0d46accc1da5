"""The planner interface: plan an exploration budget over prompts, observe rewards, checkpoint.

A planner answers one question per Spotlight iteration (docs/architecture.md, "One iteration"): while the trainer
updates θ_k, how many candidate seeds should the spot explorers sample for each prompt of the next
batch? `plan` turns a budget into an `Allocation`; `observe` feeds back the rewards the iteration
revealed; `state_dict` / `load_state_dict` let a training run checkpoint and resume a planner so
that its later plans are bit-identical to the uninterrupted run.

Invariants every planner keeps (checked by `Planner.plan` itself, so no subclass can break them):
  * cost: sum(allocation) * cost_per_sample <= budget, always;
  * choice: a prompt gets 0 candidates or at least G + 1 (with G or fewer there is nothing to
    choose: the rollout's own G random seeds do as well), and never more than `max_candidates`;
  * determinism: `plan` is a pure function of the constructor's seed, the observations so far and
    its arguments. It does not change the planner; only `observe` and `load_state_dict` do.
"""

from __future__ import annotations

import hashlib
import math
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np


@dataclass(frozen=True)
class Allocation:
    """How many candidate seeds to explore per prompt (0 = not explored)."""

    counts: dict[str, int] = field(default_factory=dict)
    """Prompt id -> number of candidate seeds; every planned prompt is present."""

    def total(self) -> int:
        """Candidate seeds over all prompts (multiply by the cost per sample for the spend)."""
        return sum(self.counts.values())

    def explored(self) -> list[str]:
        """Prompts that get candidates, in planning order."""
        return [p for p, n in self.counts.items() if n > 0]

    def __getitem__(self, prompt: str) -> int:
        return self.counts.get(prompt, 0)

    def __iter__(self) -> Iterator[str]:
        return iter(self.counts)

    def __len__(self) -> int:
        return len(self.counts)


@dataclass(frozen=True)
class Observation:
    """Rewards of independent seeds of one prompt, revealed at one iteration.

    Feed the explored candidates' rewards, and for a prompt that was not explored the rewards of
    its rollout group (G random seeds). Do not feed the rewards of a group chosen by
    `select_contrast`: they are the extremes, not draws of the prompt's reward distribution.
    """

    prompt: str
    """Prompt id, as passed to `plan`."""
    rewards: np.ndarray
    """(N,) rewards of N seeds; NaN (failed reward) entries are ignored."""
    iteration: int
    """Training iteration whose weights produced the rewards."""


class Planner(ABC):
    """Decides which prompts to explore and with how many candidate seeds each."""

    name: ClassVar[str] = ""
    """Registry name (`build_planner`), also stored in `state_dict` to catch mismatched loads."""

    def __init__(self, seed: int = 0) -> None:
        self.seed = int(seed)

    def plan(
        self,
        prompts: Sequence[str],
        budget: float,
        *,
        group_size: int,
        cost_per_sample: float = 1.0,
        max_candidates: int | None = None,
    ) -> Allocation:
        """Split an exploration budget over prompts.

        Args:
            prompts: (P,) distinct prompt ids of the batch to explore for.
            budget: what exploration may spend, in the unit of `cost_per_sample` (samples, or
                seconds of spot time: the predicted duration of the training step).
            group_size: G, the GRPO group size.
            cost_per_sample: cost of sampling and scoring one candidate seed.
            max_candidates: most candidates one prompt may get (the explorer's limit); None =
                only the budget limits it.

        Returns:
            An `Allocation` over every prompt, within the budget (see the module invariants).

        Raises:
            ValueError: naming the bad argument.
        """
        prompts = list(prompts)
        if not math.isfinite(budget) or budget < 0:
            raise ValueError(f"budget must be a finite number >= 0, got {budget!r}")
        if not math.isfinite(cost_per_sample) or cost_per_sample <= 0:
            raise ValueError(f"cost_per_sample must be a finite number > 0, got {cost_per_sample!r}")
        if group_size < 2:
            raise ValueError(f"group_size must be >= 2 (a GRPO group needs two samples), got {group_size}")
        if max_candidates is not None and max_candidates < group_size + 1:
            raise ValueError(
                f"max_candidates={max_candidates} leaves nothing to choose with group_size={group_size}; "
                f"use at least {group_size + 1} or None"
            )
        seen: set[str] = set()
        for p in prompts:
            if p in seen:
                raise ValueError(f"prompt ids must be distinct; {p!r} appears more than once")
            seen.add(p)
        num_samples = affordable_samples(budget, cost_per_sample)
        cap = num_samples if max_candidates is None else min(max_candidates, num_samples)
        counts = self._allocate(prompts, num_samples, group_size, cap) if cap > group_size else {}
        allocation = Allocation({p: int(counts.get(p, 0)) for p in prompts})
        assert set(counts) <= set(prompts), sorted(set(counts) - set(prompts))
        assert allocation.total() <= num_samples and allocation.total() * cost_per_sample <= budget
        assert all(n == 0 or group_size < n <= cap for n in allocation.counts.values()), allocation
        return allocation

    @abstractmethod
    def _allocate(self, prompts: list[str], num_samples: int, group_size: int, cap: int) -> dict[str, int]:
        """Candidates per prompt: total <= num_samples, each 0 or in [G + 1, cap] (cap > G)."""

    def observe(self, observations: Sequence[Observation]) -> None:  # noqa: B027 - optional hook, no-op default
        """Learn from the rewards an iteration revealed (default: nothing to learn)."""

    def state_dict(self) -> dict[str, Any]:
        """Everything `observe` learned, as JSON-compatible values."""
        return {"planner": self.name, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned; later plans equal those of the saved planner."""
        if state.get("planner") != self.name:
            raise ValueError(f"state of planner {state.get('planner')!r} cannot be loaded into a {self.name!r} planner")
        self.seed = int(state["seed"])


def affordable_samples(budget: float, cost_per_sample: float) -> int:
    """The most samples n with n * cost_per_sample <= budget, exactly in floating point."""
    n = math.floor(budget / cost_per_sample)
    while n > 0 and n * cost_per_sample > budget:  # the division can round up by one ulp
        n -= 1
    return n


def plan_rng(seed: int, prompts: Sequence[str], *keys: int) -> np.random.Generator:
    """A generator determined by (seed, the prompt ids, keys); stable across processes.

    Python's `hash` of a string changes per process (PYTHONHASHSEED), so prompts are hashed with
    BLAKE2b.
    """
    digest = hashlib.blake2b("\x00".join(prompts).encode(), digest_size=8).digest()
    return np.random.default_rng([int(seed), int.from_bytes(digest, "little"), *(int(k) for k in keys)])
