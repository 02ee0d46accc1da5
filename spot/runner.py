"""The job-runner interface: what the runtime asks of the code that does the work.

`spot/` runs opaque jobs. A client (the DiT path in `spotlight.jobs`) implements a `JobRunner`;
the runtime (`spot.worker.Worker` on every node, `spot.pool` around them) moves jobs, states and
weights between the queue and the runners, and never looks inside them. A job is a payload and a
number of steps; after each step the worker may commit the runner's state to the queue, and a job
that lost its worker resumes on another from its last commit:

    runner = make_runner()                       # once per worker: loads the model
    runner.load_weights(version, weights)        # weights versions reach the worker through the queue
    state = runner.start(payload, step, saved)   # step 0 (saved None), or a committed resume point
    while not runner.finished(state):
        state = runner.advance(state)            # one step
        ... every m steps: queue.commit(lease, step, runner.commit(state))
    queue.complete(lease, step, runner.output(state))

Resuming must give the bits an uninterrupted run gives: `start(payload, k, commit(state_k))`
followed by the remaining steps equals the uninterrupted job (the DiT sampler's noise is a
function of (seed, step) alone, so a trajectory resumes from (k, latent_k)).

Sequence parallelism: a runner that can split its steps over a group of workers reports its
`num_heads` (the group degree must divide it) and takes the group's process group in `set_group`;
every member then calls `start` and `advance` with the same arguments and holds the same state.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import torch


class JobRunner(ABC):
    """Runs the steps of jobs with the weights it holds; built once per worker."""

    num_heads: int | None = None
    """Attention heads the steps split over a sequence-parallel group (None: groups of one only)."""

    @abstractmethod
    def load_weights(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        """Hold weights `version` (the versioned part of the model, as `weights()` returns it)."""

    @abstractmethod
    def weights(self) -> dict[str, torch.Tensor]:
        """The versioned weights it holds (a sibling copies them from here)."""

    @abstractmethod
    def start(self, payload: Any, step: int, saved: Any) -> Any:
        """The state of a job after `step` steps: fresh from `payload` at step 0 (`saved` is None),
        else from the state `commit` returned after that many steps."""

    @abstractmethod
    def advance(self, state: Any) -> Any:
        """The state after one more step."""

    @abstractmethod
    def finished(self, state: Any) -> bool:
        """Whether the job is done (its output can be read)."""

    @abstractmethod
    def commit(self, state: Any) -> Any:
        """A picklable resume point for `start` (small: it travels to the queue every m steps)."""

    @abstractmethod
    def output(self, state: Any) -> Any:
        """What a finished job delivers (picklable)."""

    def set_group(self, group: Any | None) -> None:
        """Run the next steps over `group` (a torch.distributed process group), or alone (None)."""
        if group is not None:
            raise ValueError(f"{type(self).__name__} runs alone: it has no sequence-parallel steps")


RunnerFactory = Callable[[], JobRunner]
"""A picklable callable that builds a worker's runner in the worker's process."""
