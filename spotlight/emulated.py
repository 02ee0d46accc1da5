"""Explorer capacity a host does not have, emulated by time-slicing (`explore.emulated_nodes`).

Whether seed selection makes learning faster per iteration depends on how many candidates the
explorers score in a window, which is the spot capacity beside the trainer: k nodes. A 2-core
host has room for one explorer at most, and one sharing the trainer's cores slows the trainer.
`EmulatedExplorers` is an `explore.ExplorerPool` that runs the explorers' jobs in the trainer's own
process while the trainer waits, and leaves that wait out of the trainer's clock:

    submit(job)   queued; nothing runs (the trainer goes on with its rollout and update)
    poll(jobs)    at the window's end (`Exploration.collect`): each job not run yet runs now, on a
                  `jobs.DiTRunner` holding the weights published for it, with runtime.worker_threads
                  torch threads: one node's job. Its busy time is what that node would have spent.
                  A job whose busy time exceeds the window (the trainer's time since the job was
                  submitted, pauses excluded) is late, exactly as the node's would be: it is held
                  back and returned at the next poll (the planner still learns from it).
    cancel(jobs)  dropped unrun.

One job per node per window (`explore.split_jobs` cuts a window into `capacity()` jobs), each
limited to the predicted window as a real explorer is, so a window scores what k nodes running
concurrently with the trainer would have scored, at the speed one node runs here alone. The pause
(`take_emulated_s`) is reported as time/emulated_explore_s and subtracted from
time/iteration_s by the driver. `spotlight train` says at start-up that the nodes are emulated,
the metrics carry explore/emulated_nodes, and the benchmarks label their figures emulated.

The runner is built with the recipe's model, once; weights versions are loaded only when a job of
another version runs. Nothing here imports Ray.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from spotlight.config import DiTRecipe
from spotlight.seed_selection import ExploreJob, ExploreResult


@dataclass
class _Entry:
    job: ExploreJob
    submitted: float
    paused_before: float
    """The pool's total pause when the job was submitted (its window counts trainer time only)."""
    weights: dict[str, torch.Tensor]
    result: ExploreResult | None = None
    late: bool = False


class EmulatedExplorers:
    """`explore.ExplorerPool` of `cfg.explore.emulated_nodes` nodes, time-sliced in this process.

    Args:
        cfg: the recipe (model, sampler, reward, explorer chunk size, runtime.worker_threads).
        clock: the time source (tests).
    """

    deaths = 0
    respawns = 0

    def __init__(self, cfg: DiTRecipe, clock: Callable[[], float] = time.monotonic):
        from spotlight.jobs import DiTRunner

        if cfg.explore.emulated_nodes < 1:
            raise ValueError(
                f"explore.emulated_nodes must be >= 1 for an emulated pool, got {cfg.explore.emulated_nodes}"
            )
        self.cfg = cfg
        self.nodes = cfg.explore.emulated_nodes
        self.threads = cfg.runtime.worker_threads
        self.clock = clock
        self.runner = DiTRunner(cfg)
        self._loaded: int | None = None
        self._published: tuple[int, dict[str, torch.Tensor]] | None = None
        self._entries: dict[int, _Entry] = {}
        self._next = 0
        self._paused_total = 0.0
        self._paused_unreported = 0.0
        self.jobs_run = 0
        self.jobs_late = 0

    # -- ExplorerPool ------------------------------------------------------------------------------

    def wait_ready(self, timeout_s: float) -> int:
        return self.nodes

    def maintain(self) -> None:
        pass  # emulated nodes are never preempted

    def capacity(self) -> int:
        return self.nodes

    def publish(self, version: int, weights: Callable[[], dict[str, torch.Tensor]]) -> None:
        # `weights()` is already a CPU snapshot the update leaves unchanged (explore.WeightsSource).
        self._published = (version, weights())

    def submit(self, job: ExploreJob) -> int:
        assert self._published is not None and self._published[0] == job.version, (
            "publish the job's weights version first"
        )
        handle = self._next
        self._next += 1
        self._entries[handle] = _Entry(job, self.clock(), self._paused_total, self._published[1])
        return handle

    def poll(
        self, handles: Sequence[int], timeout_s: float | None
    ) -> list[tuple[int, ExploreResult | None, str | None]]:
        """Run the jobs of `handles` not run yet; return those a node would have finished by now.

        With timeout_s None (inline mode waits for everything) every job is returned.
        """
        done = []
        for h in handles:
            entry = self._entries.get(h)
            if entry is None:
                continue
            if entry.result is None:
                window_s = (self.clock() - entry.submitted) - (self._paused_total - entry.paused_before)
                entry.result = self._run(entry)
                entry.late = timeout_s is not None and entry.result.busy_s > window_s
                self.jobs_late += entry.late
                if entry.late:
                    continue  # a node would still be on it: returned at the next poll
            done.append((h, entry.result, None))
            del self._entries[h]
        return done

    def cancel(self, handles: Sequence[int]) -> None:
        for h in handles:
            self._entries.pop(h, None)

    def close(self) -> None:
        self._entries.clear()

    def take_emulated_s(self) -> float:
        """Seconds the trainer waited for emulated explorers since the last call."""
        paused, self._paused_unreported = self._paused_unreported, 0.0
        return paused

    # -- internals ---------------------------------------------------------------------------------

    def _run(self, entry: _Entry) -> ExploreResult:
        t0 = self.clock()
        threads = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            if self._loaded != entry.job.version:
                self.runner.load_weights(entry.job.version, entry.weights)
                self._loaded = entry.job.version
            state = self.runner.start(entry.job, 0, None)
            while not self.runner.finished(state):
                state = self.runner.advance(state)
            result = self.runner.output(state)
        finally:
            torch.set_num_threads(threads)
            paused = self.clock() - t0
            self._paused_total += paused
            self._paused_unreported += paused
        self.jobs_run += 1
        result.explorer = "emulated"
        return result
