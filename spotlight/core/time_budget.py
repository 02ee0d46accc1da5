"""A wall-clock budget for a loop of iterations (`train.max_minutes` of both trainers).

Stopping "after the iteration during which the time ran out" overshoots the budget by up to one
iteration, so a recipe that must finish within a fixed
time has to leave that much unused. `IterationBudget` instead stops *before* an iteration that
would end after the budget: the next iteration is predicted to take as long as the slowest of the
last few (checkpoint and evaluation iterations included, so a periodic slow one is covered).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable


class IterationBudget:
    """Decides, after each iteration, whether the next one still ends within `minutes`.

    Call `starts()` at the top of every iteration and `next_fits()` at its end (before its
    checkpoint). `minutes` 0 means no limit. The clock starts when the object is made.

    Args:
        minutes: the budget; 0 = no limit.
        window: how many recent iterations the prediction looks at (their maximum).
        clock: seconds, monotonic (tests pass a fake one).
    """

    def __init__(self, minutes: float, *, window: int = 5, clock: Callable[[], float] = time.monotonic):
        if minutes < 0:
            raise ValueError(f"max_minutes must be >= 0, got {minutes}")
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.seconds = 60.0 * minutes
        self._clock = clock
        self.began = clock()
        self._top: float | None = None  # when the current iteration started
        self._durations: deque[float] = deque(maxlen=window)  # whole iterations, top to top

    def starts(self) -> None:
        """The top of an iteration: closes the previous iteration's duration."""
        now = self._clock()
        if self._top is not None:
            self._durations.append(now - self._top)
        self._top = now

    def elapsed_s(self) -> float:
        return self._clock() - self.began

    def fraction_used(self) -> float:
        """The share of the budget spent so far (0 without a limit)."""
        return self.elapsed_s() / self.seconds if self.seconds else 0.0

    def predicted_s(self) -> float:
        """How long the next iteration is expected to take: the slowest of the recent ones, the
        current one (measured so far) included."""
        current = self._clock() - self._top if self._top is not None else 0.0
        return max([current, *self._durations])

    def iterations_left(self) -> int | None:
        """About how many more iterations the budget holds, at the recent iterations' mean duration
        (None without a limit or before one iteration has been timed): for progress displays."""
        if not self.seconds or not self._durations:
            return None
        mean = sum(self._durations) / len(self._durations)
        return max(0, int((self.seconds - self.elapsed_s()) / mean)) if mean > 0 else None

    def next_fits(self) -> bool:
        """True when there is no limit or the next iteration should end within the budget."""
        if not self.seconds:
            return True
        return self.elapsed_s() + self.predicted_s() <= self.seconds


def progress_total(budget: IterationBudget, done: int, num_iterations: int, *, stopping: bool = False) -> int:
    """The iterations a progress bar should show as the run's length: `num_iterations`, or fewer
    where the time budget will end the run first (`done` when it stops now)."""
    if stopping:
        return done
    left = budget.iterations_left()
    return num_iterations if left is None else min(num_iterations, done + left)
