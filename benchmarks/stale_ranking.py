"""Kendall's tau between seed rankings under stale and fresh weights, in a real tiny GRPO run.

Spotlight's claim (the Spotlight paper): ranking a prompt's seeds by reward under θ_{k-s} gives nearly
the ranking under θ_k, so seeds can be explored with stale weights off the critical path.

The run trains the recipe (default configs/dit/tiny-shapes.yaml, its own objective) with the same
pieces `spotlight.train.run_training` uses: `plan_iteration`, `rollout`, `build_reward`,
`group_advantages`, `GRPOTrainer.update` (no checkpoints or tracking). It keeps copies of the
trainable state of the last max(staleness) iterations. At each measurement iteration k, before
the update, for the first P distinct prompts of the iteration and S seeds each it samples with the
rollout sampler (the recipe's steps, SDE window, noise level and sde_type: seeds fix whole
trajectories, so "the reward of seed s under θ" is well defined):

    set A = derive_seed(train.seed, k, p, i), i < S   (its first G are the rollout's own seeds)
    set B = derive_seed(train.seed, k, p, S + i)       (unrelated seeds, for the control)

and takes, per prompt, Kendall's tau-b (scipy.stats.kendalltau) between
  - stale:   rewards of A under θ_k and rewards of A under θ_{k-s}, seed by seed;
  - control: rewards of A under θ_k and rewards of B under θ_{k-1}, paired by index (expected ~0).
A prompt whose rewards are constant under either weights has no ranking; it is skipped and
counted. Taus are averaged over prompts and measurement iterations. The control does not depend
on s and is repeated on every line. Prints one JSON line per staleness.

    .venv/bin/python benchmarks/stale_ranking.py                       # ~4 min on 2 idle cores
    .venv/bin/python benchmarks/stale_ranking.py --iterations 12 train.lr=1e-4
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from scipy.stats import kendalltau

from spotlight.config import DiTRecipe
from spotlight.config_io import load_config
from spotlight.grpo import group_advantages
from spotlight.policy import DiTPolicy, load_policy, load_trainable_state, trainable_state
from spotlight.prompts import train_and_eval_prompts
from spotlight.rewards import CombinedReward, build_reward
from spotlight.rollout import resolve_autocast, rollout
from spotlight.sampling import derive_seed, qwen_image_sigmas
from spotlight.train import plan_iteration
from spotlight.trainer import GRPOTrainer

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_RECIPE = str(ROOT / "configs" / "dit" / "tiny-shapes.yaml")


# ---------------------------------------------------------------------------------------------
# A training run with a hook (shared with record_reward_table.py)
# ---------------------------------------------------------------------------------------------


@dataclass
class TinyRun:
    """The pieces of `run_training`, built the same way."""

    cfg: DiTRecipe
    policy: DiTPolicy
    trainer: GRPOTrainer
    reward_fn: CombinedReward
    sigmas: torch.Tensor
    train_prompts: list[str]


def build_run(recipe: str, overrides: Sequence[str]) -> TinyRun:
    """Load the recipe (with dotted overrides) and build policy, trainer and reward as run_training does."""
    cfg = load_config(DiTRecipe, recipe, list(overrides))
    if cfg.train.num_threads:
        torch.set_num_threads(cfg.train.num_threads)
    train_prompts, _ = train_and_eval_prompts(cfg.data, cfg.reward.weights)
    policy = load_policy(cfg.model)
    trainer = GRPOTrainer(policy, cfg)
    reward_fn = build_reward(cfg.reward.weights, **cfg.reward.options())
    sigmas = qwen_image_sigmas(cfg.sample.num_steps, policy.latent_shape[0])
    return TinyRun(cfg, policy, trainer, reward_fn, sigmas, train_prompts)


@dataclass
class IterationPlan:
    """What iteration k samples: its prompts and seeds (prompt-major, P groups of G) and SDE steps."""

    iteration: int
    prompts: list[str]
    seeds: list[int]
    sde_steps: list[int]
    rewards_B: np.ndarray
    """(P * G,) rewards of the training rollout (under the current weights θ_k)."""

    def group_prompts(self, group_size: int) -> list[str]:
        """The P prompts of the iteration, one per group."""
        return self.prompts[::group_size]


Hook = Callable[[TinyRun, IterationPlan], None]


def sample_rewards(run: TinyRun, policy: DiTPolicy, prompts: Sequence[str], seeds: Sequence[int], sde_steps: Sequence[int]) -> np.ndarray:
    """(B,) rewards of one trajectory per (prompt, seed), sampled exactly as the training rollout samples."""
    s = run.cfg.sample
    ro = rollout(
        policy, prompts, seeds, run.sigmas,
        noise_level=s.noise_level,
        sde_steps=sde_steps,
        sde_type=s.sde_type,
        guidance_scale=s.guidance_scale,
        negative_prompt=s.negative_prompt,
        batch_size=s.batch_size,
        autocast=resolve_autocast(s.autocast, policy.device, run.cfg.train.objective),
    )  # fmt: skip
    return run.reward_fn(ro.images, list(prompts)).total_B.double().numpy()


@dataclass
class TrainResult:
    """What `train` reports."""

    rewards: list[float]
    """Mean training rollout reward of each iteration."""
    train_seconds: float
    """Rollout, reward and update time."""
    hook_seconds: float
    """Time spent in the hook (the measurement)."""


def train(run: TinyRun, num_iterations: int, hook: Hook, *, log: Callable[[str], None] = lambda _: None) -> TrainResult:
    """GRPO iterations as in `run_training`: rollout, reward, hook (weights still θ_k), advantages, update."""
    cfg = run.cfg
    P, G = cfg.train.prompts_per_iteration, cfg.train.group_size
    result = TrainResult([], 0.0, 0.0)
    for it in range(num_iterations):
        t0 = time.monotonic()
        prompts, seeds, sde_steps = plan_iteration(cfg, run.train_prompts, it)
        ro = rollout(
            run.policy, prompts, seeds, run.sigmas,
            noise_level=cfg.sample.noise_level,
            sde_steps=sde_steps,
            sde_type=cfg.sample.sde_type,
            guidance_scale=cfg.sample.guidance_scale,
            negative_prompt=cfg.sample.negative_prompt,
            batch_size=cfg.sample.batch_size,
            autocast=resolve_autocast(cfg.sample.autocast, run.policy.device, cfg.train.objective),
        )  # fmt: skip
        reward = run.reward_fn(ro.images, prompts)
        t1 = time.monotonic()
        hook(run, IterationPlan(it, prompts, seeds, sde_steps, reward.total_B.double().numpy()))
        t2 = time.monotonic()
        adv = group_advantages(reward.total_B.view(P, G), std_mode=cfg.train.adv_std, clip=cfg.train.adv_clip)
        run.trainer.update(ro, adv, it)
        valid = reward.total_B[~torch.isnan(reward.total_B)]
        result.rewards.append(float(valid.mean()) if len(valid) else float("nan"))
        result.train_seconds += time.monotonic() - t2 + t1 - t0
        result.hook_seconds += t2 - t1
        log(f"iteration {it}: reward {result.rewards[-1]:.4f}, train {time.monotonic() - t2 + t1 - t0:.1f}s, hook {t2 - t1:.1f}s")
    return result


def snapshot(policy: DiTPolicy) -> dict[str, torch.Tensor]:
    """A copy of the trainable state (`trainable_state` returns views of the live weights)."""
    return {k: v.detach().clone() for k, v in trainable_state(policy).items()}


def stale_copy(policy: DiTPolicy) -> DiTPolicy:
    """A second policy sharing the frozen prompt encoder and codec, with its own transformer."""
    other = copy.copy(policy)
    other.transformer = copy.deepcopy(policy.transformer).requires_grad_(False).eval()
    return other


# ---------------------------------------------------------------------------------------------
# The ranking measurement
# ---------------------------------------------------------------------------------------------


def tau_b(x: np.ndarray, y: np.ndarray) -> float | None:
    """Kendall's tau-b of paired rewards; None when either side is constant (no ranking)."""
    keep = ~(np.isnan(x) | np.isnan(y))  # a failed reward drops its pair
    x, y = x[keep], y[keep]
    if len(x) < 2 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return None
    return float(kendalltau(x, y, variant="b").statistic)


class RankingProbe:
    """Hook that keeps the last states and measures tau at the chosen iterations."""

    def __init__(self, run: TinyRun, *, staleness: Sequence[int], measure_at: Sequence[int], num_prompts: int, num_seeds: int):
        if num_prompts > run.cfg.train.prompts_per_iteration:
            raise ValueError(f"--probe-prompts {num_prompts} exceeds train.prompts_per_iteration={run.cfg.train.prompts_per_iteration}")
        if num_seeds < 2:
            raise ValueError(f"--seeds must be >= 2 to rank seeds, got {num_seeds}")
        self.staleness = sorted(set(staleness))
        self.measure_at = set(measure_at)
        self.num_prompts, self.num_seeds = num_prompts, num_seeds
        self.history: deque[dict[str, torch.Tensor]] = deque(maxlen=max(self.staleness))
        self.stale_policy = stale_copy(run.policy)
        self.taus: dict[int, list[float]] = {s: [] for s in self.staleness}
        self.skipped: dict[int, int] = dict.fromkeys(self.staleness, 0)
        self.control: list[float] = []
        self.skipped_control = 0
        self.same_reward: dict[int, list[float]] = {s: [] for s in self.staleness}
        self.measured: list[int] = []

    def __call__(self, run: TinyRun, plan: IterationPlan) -> None:
        # history[s - 1] holds θ_{k-s}: the state each earlier iteration's rollout sampled with.
        if plan.iteration in self.measure_at and len(self.history) == self.history.maxlen:
            self._measure(run, plan)
        self.history.appendleft(snapshot(run.policy))

    def _measure(self, run: TinyRun, plan: IterationPlan) -> None:
        cfg, k, S = run.cfg, plan.iteration, self.num_seeds
        groups = plan.group_prompts(cfg.train.group_size)[: self.num_prompts]
        prompts = [p for p in groups for _ in range(S)]
        seeds_a = [derive_seed(cfg.train.seed, k, j, i) for j in range(len(groups)) for i in range(S)]
        seeds_b = [derive_seed(cfg.train.seed, k, j, S + i) for j in range(len(groups)) for i in range(S)]
        shape = (len(groups), S)
        fresh_a = sample_rewards(run, run.policy, prompts, seeds_a, plan.sde_steps).reshape(shape)
        for s in self.staleness:
            load_trainable_state(self.stale_policy, self.history[s - 1])
            stale_a = sample_rewards(run, self.stale_policy, prompts, seeds_a, plan.sde_steps).reshape(shape)
            self.same_reward[s].append(float(np.mean(stale_a == fresh_a)))
            for j in range(len(groups)):
                tau = tau_b(fresh_a[j], stale_a[j])
                if tau is None:
                    self.skipped[s] += 1
                else:
                    self.taus[s].append(tau)
        # Control: the unrelated seed set B under θ_{k-1}, paired by index with A under θ_k.
        load_trainable_state(self.stale_policy, self.history[0])
        stale_b = sample_rewards(run, self.stale_policy, prompts, seeds_b, plan.sde_steps).reshape(shape)
        for j in range(len(groups)):
            tau = tau_b(fresh_a[j], stale_b[j])
            if tau is None:
                self.skipped_control += 1
            else:
                self.control.append(tau)
        self.measured.append(k)


def measurement_iterations(num_iterations: int, staleness: Sequence[int], every: int) -> list[int]:
    """Iterations k >= max(staleness) (so θ_{k-s} exists for every s), every `every` iterations."""
    return list(range(max(staleness), num_iterations, every))


def main(argv: Sequence[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted recipe overrides, e.g. train.lr=1e-4")
    parser.add_argument("--recipe", default=DEFAULT_RECIPE, help="DiT recipe YAML (default: configs/dit/tiny-shapes.yaml)")
    parser.add_argument("--iterations", type=int, default=25, help="training iterations")
    parser.add_argument("--measure-every", type=int, default=3, help="measure at iterations max(staleness), +every, ...")
    parser.add_argument("--probe-prompts", type=int, default=8, help="prompts per measurement (the iteration's first ones)")
    parser.add_argument("--seeds", type=int, default=32, help="seeds per probe prompt")
    parser.add_argument("--staleness", type=int, nargs="+", default=[1, 2, 4], help="staleness values s")
    parser.add_argument("--quiet", action="store_true", help="no per-iteration log on stderr")
    args = parser.parse_args(argv)
    if min(args.staleness) < 1:
        raise ValueError(f"--staleness values must be >= 1, got {args.staleness}")
    measure_at = measurement_iterations(args.iterations, args.staleness, args.measure_every)
    if not measure_at:
        raise ValueError(f"--iterations {args.iterations} leaves no iteration >= max staleness {max(args.staleness)} to measure")

    began = time.monotonic()
    run = build_run(args.recipe, args.overrides)
    probe = RankingProbe(run, staleness=args.staleness, measure_at=measure_at, num_prompts=args.probe_prompts, num_seeds=args.seeds)
    log = (lambda _: None) if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    result = train(run, args.iterations, probe, log=log)
    seconds = time.monotonic() - began

    s_cfg = run.cfg.sample
    control = float(np.mean(probe.control)) if probe.control else None
    lines = []
    for s in probe.staleness:
        taus = probe.taus[s]
        line = {
            "kendall_tau_stale": round(float(np.mean(taus)), 4) if taus else None,
            "kendall_tau_control": round(control, 4) if control is not None else None,
            "staleness": s,
            "num_pairs": len(taus),
            "skipped_constant": probe.skipped[s],
            "num_pairs_control": len(probe.control),
            "skipped_constant_control": probe.skipped_control,
            "tau_stale_p10": round(float(np.percentile(taus, 10)), 4) if taus else None,
            "frac_same_reward": round(float(np.mean(probe.same_reward[s])), 4),
            "iterations": args.iterations,
            "measured_iterations": probe.measured,
            "probe_prompts": args.probe_prompts,
            "seeds": args.seeds,
            "sampler": {"num_steps": s_cfg.num_steps, "noise_level": s_cfg.noise_level, "sde_type": s_cfg.sde_type,
                        "sde_window_size": s_cfg.sde_window_size},
            "train_reward_first_last": [round(result.rewards[0], 4), round(result.rewards[-1], 4)],
            "seconds": round(seconds, 1),
            "train_seconds": round(result.train_seconds, 1),
            "probe_seconds": round(result.hook_seconds, 1),
        }  # fmt: skip
        print(json.dumps(line), flush=True)
        lines.append(line)
    return lines


if __name__ == "__main__":
    main()
