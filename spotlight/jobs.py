"""The DiT path's jobs on the spot runtime: rollouts and exploration, as a `spot.runner.JobRunner`.

Shape legend: B samples of a job, L image tokens, C packed channels, N denoising steps, K latents kept.

Two kinds of job run on the same workers (`spot.worker.Worker`, one policy each):

    rollout   `RolloutJob`: the training rollout of B (prompt, seed) rows with the weights of the
              iteration, one step per denoising step; its output is what `rollout.rollout` gives
              for those rows: the latents the update reads, every step's log-prob, the images.
    explore   `ExploreJob` (`spotlight.explore`): candidate seeds sampled with stale weights and
              scored with the recipe's reward, in chunks of `explore.batch_size`; one step per
              denoising step of a chunk, the chunk's last step also decodes and scores it. It
              starts no chunk after its time limit (counted in seconds of work) and returns what
              it has.

A job's state after k steps is (k, the chunk's latent after its steps, what is kept so far): the
sampler's noise is a function of (seed, step) alone (`sampling.seeded_noise`), so a job resumed
from a commit gives the bits the uninterrupted job gives, and a rollout job gives the bits the
trainer's own `rollout.rollout` gives for the same rows in batches of the same size (fixed prompt
padding, per-sample noise; `tests/test_runtime_training.py`). Jobs of another size than the local
rollout's chunks (`sample.batch_size`) give the same bits only where the matmuls round the same
at both batch sizes: so on the tiny recipe here (jobs of 16, 32 or 64 against chunks of 128,
float32 and bfloat16), not on every model and CPU (a smaller tiny model differs in the last bit).

Only the latents the update reads travel back (`RolloutJob.keep`): for Flow-GRPO those before and
after each stochastic step, for DiffusionNFT the final one. `assemble_rollout` puts the jobs'
outputs back into one `Rollout`, with NaN where a latent was not kept.

With a sequence-parallel group (`set_group`), the transformer's forwards run through Ulysses
attention (`spotlight.parallel`): every member computes L / degree image tokens of every step and
holds the same state. `parallel.sp_backend` picks its attention core (ours, or xDiT's USP on CUDA).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from spot.runner import JobRunner
from spotlight.config import DiTRecipe
from spotlight.rollout import AUTOCAST_DTYPES, PromptBatch, Rollout, encode, guided_velocity, resolve_autocast
from spotlight.sampling import Trajectory, sample
from spotlight.seed_selection import ExploreJob, ExploreResult

ROLLOUT, EXPLORE = "rollout", "explore"
"""Job kinds (`spot.jobqueue.Job.kind`)."""
ROLLOUT_PRIORITY = 0
"""Rollouts run first: an exploration job yields to a waiting rollout at its next step."""
_EXPLORE_PRIORITY_BASE = 1 << 40


def explore_priority(iteration: int) -> int:
    """Exploration jobs come after every rollout, and the newest window first: a late job of an
    older window (whose batch was already selected) yields to the current window's."""
    return _EXPLORE_PRIORITY_BASE - iteration


@dataclass(frozen=True)
class RolloutJob:
    """B rows of one iteration's rollout."""

    prompts: list[str]
    seeds: list[int]
    sde_steps: list[int]
    """Stochastic steps of the iteration (its SDE window)."""
    keep: list[int]
    """Indices (of N + 1) of the latents the update reads; the others are not sent back."""


@dataclass
class RolloutOutput:
    """A finished rollout job: what `assemble_rollout` needs of its rows."""

    keep: list[int]
    latents: torch.Tensor
    """(K, B, L, C) the kept latents, in `keep`'s order."""
    log_probs: torch.Tensor
    """(N, B) every step's log-prob (0 on ODE steps)."""
    images: torch.Tensor
    """(B, 3, H, W) decoded images in [0, 1]."""


@dataclass
class _State:
    """A job in progress; `commit` sends the fields after `latent`."""

    payload: RolloutJob | ExploreJob
    batch: PromptBatch | None
    """Encoded prompts of the current chunk (re-encoded on resume)."""
    step: int
    """Denoising step of the current chunk about to run (N: the chunk is done)."""
    latent: torch.Tensor | None
    """(B, L, C) the chunk's latent before `step` (None: seeded initial noise)."""
    kept: dict[int, torch.Tensor] = field(default_factory=dict)
    """rollout: kept latent index -> (B, L, C)."""
    log_probs: list[torch.Tensor] = field(default_factory=list)
    """rollout: (B,) per finished step."""
    images: torch.Tensor | None = None
    """rollout: (B, 3, H, W) once finished."""
    chunk: int = 0
    """explore: index of the current chunk."""
    rewards: list[float] = field(default_factory=list)
    """explore: stale rewards of the rows of the finished chunks."""
    busy_s: float = 0.0
    """explore: seconds of work so far (over every lease)."""
    stopped: bool = False
    """explore: the time limit ended it before its last chunk."""


class _SPPolicy:
    """The policy seen by the sampler, with the transformer forward run through `ulysses_forward`."""

    def __init__(self, policy, ctx):
        self.policy = policy
        self.ctx = ctx

    def velocity(self, latents_BLC, sigma_B, embeds, mask):
        from spotlight.parallel import ulysses_forward

        p = self.policy
        dtype = embeds.dtype
        shapes = [[(1, p.latent_h // 2, p.latent_w // 2)]] * latents_BLC.shape[0]
        return ulysses_forward(p.transformer, self.ctx, latents_BLC.to(dtype), embeds, mask, sigma_B.to(dtype), shapes)


class DiTRunner(JobRunner):
    """Rollout and exploration jobs of a DiT recipe, on one worker.

    Args:
        cfg: the recipe (model, sampler, reward, exploration chunk size).
    """

    def __init__(self, cfg: DiTRecipe):
        from spotlight.parallel import SPContext, install_ulysses
        from spotlight.policy import load_policy, quiet_model_libraries
        from spotlight.sampling import qwen_image_sigmas

        quiet_model_libraries()
        self.cfg = cfg
        # The attention core first (parallel.sp_backend): a backend that cannot run here fails before the model loads.
        cfg.parallel.check_device(cfg.model.device)
        ctx = SPContext(backend=cfg.parallel.sp_backend)
        self.policy = load_policy(cfg.model, trainable=False)
        self.sigmas = qwen_image_sigmas(cfg.sample.num_steps, self.policy.latent_shape[0])
        # Cheap exploration (explore.num_steps): the same seeded initial noise, integrated in fewer
        # ODE steps; the stale score then approximates the full-step sample's.
        self.explore_sigmas = qwen_image_sigmas(
            cfg.explore.num_steps or cfg.sample.num_steps, self.policy.latent_shape[0]
        )
        self.autocast = AUTOCAST_DTYPES[resolve_autocast(cfg.sample.autocast, self.policy.device, cfg.train.objective)]
        self.ctx = install_ulysses(self.policy.transformer, ctx)
        self.num_heads = self.ctx.num_heads
        self._forward = self.policy  # what `guided_velocity` calls `velocity` on
        self._reward_fn = None
        self.version: int | None = None
        self.name = f"{socket.gethostname()}:{os.getpid()}"

    # -- weights and groups --------------------------------------------------------------------

    def load_weights(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        from spotlight.policy import load_trainable_state

        load_trainable_state(self.policy, weights)
        self.version = version

    def weights(self) -> dict[str, torch.Tensor]:
        from spotlight.policy import trainable_state

        return trainable_state(self.policy)

    def set_group(self, group) -> None:
        self.ctx.set_group(group)
        self._forward = self.policy if group is None else _SPPolicy(self.policy, self.ctx)

    # -- jobs ----------------------------------------------------------------------------------

    def start(self, payload, step: int, saved) -> _State:
        state = _State(payload, None, 0, None)
        if saved is not None:
            for name, value in saved.items():
                setattr(state, name, value)
        if not self.finished(state):
            state.batch = self._encode(state)
        return state

    def advance(self, state: _State) -> _State:
        t0 = time.monotonic()
        rows = self._rows(state)
        sigmas = self._sigmas(state.payload)
        n = len(sigmas) - 1
        s = self.cfg.sample
        sde_steps = state.payload.sde_steps
        traj = sample(
            self._velocity(state.batch),
            rows[1],
            self.policy.latent_shape,
            sigmas[: state.step + 2],
            noise_level=s.noise_level,
            sde_steps=sde_steps,
            sde_type=s.sde_type,
            start_step=state.step,
            start_latents=state.latent,
            device=self.policy.device,
        )
        if isinstance(state.payload, RolloutJob):
            if state.step == 0 and 0 in state.payload.keep:
                state.kept[0] = traj.latents[0].cpu().clone()
            state.log_probs.append(traj.log_probs[0].cpu().clone())
        state.latent = traj.latents[-1].clone()  # not a view that would pickle the whole stack
        state.step += 1
        if isinstance(state.payload, RolloutJob):
            if state.step in state.payload.keep:
                state.kept[state.step] = state.latent.cpu().clone()
            if state.step == n:
                state.images = self.policy.decode(state.latent).float().cpu()
        elif state.step == n:
            self._score_chunk(state, rows[0])
        state.busy_s += time.monotonic() - t0
        return state

    def finished(self, state: _State) -> bool:
        if isinstance(state.payload, RolloutJob):
            return state.step == len(self.sigmas) - 1
        return state.stopped or state.chunk * self.cfg.explore.batch_size >= len(state.payload.seeds)

    def commit(self, state: _State) -> dict:
        fields = ("step", "latent", "kept", "log_probs", "images", "chunk", "rewards", "busy_s", "stopped")
        return {name: getattr(state, name) for name in fields}

    def output(self, state: _State) -> RolloutOutput | ExploreResult:
        job = state.payload
        if isinstance(job, RolloutJob):
            latents = torch.stack([state.kept[i] for i in job.keep])
            return RolloutOutput(list(job.keep), latents, torch.stack(state.log_probs), state.images)
        n = len(state.rewards)
        return ExploreResult(
            iteration=job.iteration,
            version=self.version,
            slots=job.slots[:n],
            candidates=job.candidates[:n],
            rewards=list(state.rewards),
            busy_s=state.busy_s,
            complete=n == len(job.seeds),
            explorer=self.name,
        )

    # -- internals -----------------------------------------------------------------------------

    def _sigmas(self, payload: RolloutJob | ExploreJob) -> torch.Tensor:
        return self.sigmas if isinstance(payload, RolloutJob) else self.explore_sigmas

    def _rows(self, state: _State) -> tuple[list[str], list[int]]:
        """(prompts, seeds) of the current chunk (a rollout job is one chunk)."""
        job = state.payload
        if isinstance(job, RolloutJob):
            return job.prompts, job.seeds
        bs = self.cfg.explore.batch_size
        lo = state.chunk * bs
        return job.prompts[lo : lo + bs], job.seeds[lo : lo + bs]

    def _encode(self, state: _State) -> PromptBatch:
        s = self.cfg.sample
        return encode(self.policy, self._rows(state)[0], s.guidance_scale, s.negative_prompt)

    def _velocity(self, batch: PromptBatch):
        gs, dtype, device = self.cfg.sample.guidance_scale, self.autocast, self.policy.device

        def velocity(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
            # As `rollout.rollout` does: the transformer under autocast, the sampler in float32.
            if dtype is None:
                return guided_velocity(self._forward, x, sigma, batch, gs)
            with torch.autocast(device.type, dtype=dtype):
                v = guided_velocity(self._forward, x, sigma, batch, gs)
            return v.to(x.dtype)

        return velocity

    def _score_chunk(self, state: _State, prompts: list[str]) -> None:
        """The chunk is sampled: score it, move to the next one unless the time limit is spent."""
        if self._reward_fn is None:
            from spotlight.rewards import build_reward

            self._reward_fn = build_reward(self.cfg.reward.weights, **self.cfg.reward.options())
        images = self.policy.decode(state.latent)
        state.rewards.extend(self._reward_fn(images, prompts).total_B.tolist())
        state.chunk += 1
        state.step, state.latent = 0, None
        job = state.payload
        if self.finished(state):
            return
        if job.time_limit_s is not None and state.busy_s > job.time_limit_s:
            state.stopped = True  # starts no chunk after its time limit
            return
        state.batch = self._encode(state)


def explore_num_steps(cfg: DiTRecipe, job: ExploreJob) -> int:
    """Steps of an exploration job: its chunks times the denoising steps."""
    bs = cfg.explore.batch_size
    return -(-len(job.seeds) // bs) * (cfg.explore.num_steps or cfg.sample.num_steps)


def rollout_jobs(
    cfg: DiTRecipe, prompts: Sequence[str], seeds: Sequence[int], sde_steps: Sequence[int]
) -> list[RolloutJob]:
    """An iteration's rows cut into jobs of `runtime.job_size` rows (at most `sample.batch_size`), in order."""
    n = cfg.sample.num_steps
    keep = {n}
    if cfg.train.objective == "flow_grpo":
        keep |= {j for s in sde_steps for j in (s, s + 1)}
    size = min(cfg.runtime.job_size or cfg.train.group_size, cfg.sample.batch_size)
    return [
        RolloutJob(list(prompts[lo : lo + size]), list(seeds[lo : lo + size]), list(sde_steps), sorted(keep))
        for lo in range(0, len(prompts), size)
    ]


def assemble_rollout(
    cfg: DiTRecipe, jobs: Sequence[RolloutJob], outputs: Sequence[RolloutOutput], sigmas: torch.Tensor
) -> Rollout:
    """One `Rollout` of the jobs' rows, in order; latents nobody kept are NaN (the update never reads them)."""
    n = cfg.sample.num_steps
    first = outputs[0]
    B = sum(len(j.seeds) for j in jobs)
    latents = torch.full((n + 1, B, *first.latents.shape[2:]), float("nan"))
    lo = 0
    for job, out in zip(jobs, outputs):
        hi = lo + len(job.seeds)
        latents[out.keep, lo:hi] = out.latents
        lo = hi
    log_probs = torch.cat([o.log_probs for o in outputs], dim=1)
    traj = Trajectory(latents=latents, log_probs=log_probs, sigmas=sigmas, sde_steps=sorted(set(jobs[0].sde_steps)))
    prompts = [p for j in jobs for p in j.prompts]
    seeds = [s for j in jobs for s in j.seeds]
    return Rollout(prompts, seeds, traj, torch.cat([o.images for o in outputs]))
