"""Prompt families: prompts of one family share the bandit planner's prior (planners/bandit.py).

In real runs prompts rarely recur, so most prompts a plan sees are new and are valued by their
family's prior alone. With one family for all prompts every new prompt looks alike and the budget
goes where the posterior draws happen to fall. A family that groups prompts whose reward spread
over seeds is alike lets the planner learn, from the prompts it has seen, which new ones are worth
exploring.

A family spec (the recipe's `explore.planner_family`) says how a prompt maps to its family key:

    ""                 one family for every prompt (the bandit's behaviour without families)
    "matches:REGEX"    the sorted multiset of REGEX's matches in the prompt (of its first group
                       when it has groups), joined by "+"; a prompt without a match gets ""
    a preset name      a REGEX spelled out in FAMILY_PRESETS

For the shapes grammar (`spotlight.rewards.shapes`), the preset "shapes_counts" keys a prompt by
its count words: "two red circles and one blue square" -> "one+two". On the reward tables
recorded from tiny-shapes runs of the shipped base (benchmarks/data/tiny-shapes-rewards-long6k.npz
and -beta05.npz), the count words explain 0.59-0.62 of the variance of the per-prompt reward std
over seeds (more objects to draw, less spread), the colours 0.04-0.05 and the shapes 0.01-0.02;
on the older 300-step base's table, counts 0.21 and shapes 0.22. For GenEval-style prompts a
family would be the prompt's task tag.
"""

from __future__ import annotations

import re
from collections.abc import Callable

FAMILY_PRESETS: dict[str, str] = {
    "shapes_counts": r"\b(one|two|three|four)\b",
}
"""Named family regexes (see the module docstring)."""

_MATCHES = "matches:"


class MatchesFamily:
    """Family key: the sorted multiset of a regex's matches in the prompt, joined by "+".

    A class rather than a closure so that a planner holding it can be pickled (Ray, checkpoints).
    """

    def __init__(self, pattern: str):
        self.pattern = pattern
        self._regex = re.compile(pattern)

    def __call__(self, prompt: str) -> str:
        group = 1 if self._regex.groups else 0
        return "+".join(sorted(m.group(group) for m in self._regex.finditer(prompt)))

    def __repr__(self) -> str:
        return f"MatchesFamily({self.pattern!r})"


def prompt_family(spec: str) -> Callable[[str], str] | None:
    """The family function named by `spec` (module docstring); None for "" (one family).

    Raises:
        ValueError: for an unknown preset (naming the valid ones) or a REGEX that does not compile.
    """
    if not spec:
        return None
    if spec in FAMILY_PRESETS:
        return MatchesFamily(FAMILY_PRESETS[spec])
    if spec.startswith(_MATCHES):
        pattern = spec[len(_MATCHES) :]
        if not pattern:
            raise ValueError(f"family {spec!r}: empty regex after {_MATCHES!r}")
        try:
            return MatchesFamily(pattern)
        except re.error as e:
            raise ValueError(f"family {spec!r}: the regex does not compile: {e}") from None
    presets = ", ".join(repr(p) for p in sorted(FAMILY_PRESETS))
    raise ValueError(f"unknown family {spec!r}; use '' (one family), a preset ({presets}) or 'matches:REGEX'")
