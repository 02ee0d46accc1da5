"""Seed rankings and selections under stale (and cheap) scores against fresh ones, in a real tiny GRPO run.

Spotlight's claim (the Spotlight paper): ranking a prompt's seeds by reward under θ_{k-s} gives nearly
the ranking under θ_k, so seeds can be explored with stale weights off the critical path.

The run trains the recipe (default configs/dit/tiny-shapes.yaml, its own objective) with the same
pieces `spotlight.driver.run_training` uses: `plan_iteration`, `rollout`, `build_reward`,
`group_advantages`, `GRPOTrainer.update` (no checkpoints or tracking). It keeps copies of the
trainable state of the last max(staleness) iterations. At each measurement iteration k, before
the update, for the first P distinct prompts of the iteration and S seeds each it samples with the
rollout sampler (the recipe's steps, SDE window, noise level and sde_type: seeds fix whole
trajectories, so "the reward of seed s under θ" is well defined):

    set A = derive_seed(train.seed, k, p, i), i < S   (its first G are the rollout's own seeds)

under θ_k (fresh) and under θ_{k-s} (stale), where the stale side may be cheap (`--explore-steps N`: N denoising steps
from the same seeded
initial noise, as explorers with `explore.num_steps` sample), and the fresh side is always the
rollout's full sampler. Per prompt it takes

  - Kendall's tau-b (scipy.stats.kendalltau) between the stale (cheap) and the fresh rewards of
    set A, seed by seed;
  - the selection it drives: the G seeds `planners.select_contrast` ("extremes") keeps by stale
    score against those it would keep by fresh score (the oracle's). `selection_overlap` is the
    shared fraction; `variance_captured` the fresh-reward variance of the stale-selected group
    over that of the oracle's group (what the update sees);
  - the control, random selection of the same S seeds (`--random-draws` draws per prompt): its
    overlap and variance captured, and those of the default seeds (the first G, plain GRPO).
    Random overlap is G / S in expectation; a stale selection is worth as much as it exceeds it.

A prompt whose rewards are constant under either weights has no ranking; it is skipped for tau
and counted. Figures are averaged over prompts and measurement iterations. Prints one JSON line
per staleness.

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

from planners import group_variance, select_contrast
from spotlight.config import DiTRecipe
from spotlight.core.advantages import group_advantages
from spotlight.core.config_io import load_config
from spotlight.core.seeds import derive_seed
from spotlight.driver import plan_iteration
from spotlight.policy import DiTPolicy, load_policy, load_trainable_state, trainable_state
from spotlight.prompts import train_and_eval_prompts
from spotlight.rewards import CombinedReward, build_reward
from spotlight.rollout import resolve_autocast, rollout
from spotlight.sampling import qwen_image_sigmas
from spotlight.update import GRPOTrainer

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


def sample_rewards(
    run: TinyRun,
    policy: DiTPolicy,
    prompts: Sequence[str],
    seeds: Sequence[int],
    sde_steps: Sequence[int],
    sigmas: torch.Tensor | None = None,
) -> np.ndarray:
    """(B,) rewards of one trajectory per (prompt, seed), sampled exactly as the training rollout
    samples (or on another schedule `sigmas`: cheap exploration)."""
    s = run.cfg.sample
    ro = rollout(
        policy,
        prompts,
        seeds,
        run.sigmas if sigmas is None else sigmas,
        noise_level=s.noise_level,
        sde_steps=sde_steps,
        sde_type=s.sde_type,
        guidance_scale=s.guidance_scale,
        negative_prompt=s.negative_prompt,
        batch_size=s.batch_size,
        autocast=resolve_autocast(s.autocast, policy.device, run.cfg.train.objective),
    )
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
            run.policy,
            prompts,
            seeds,
            run.sigmas,
            noise_level=cfg.sample.noise_level,
            sde_steps=sde_steps,
            sde_type=cfg.sample.sde_type,
            guidance_scale=cfg.sample.guidance_scale,
            negative_prompt=cfg.sample.negative_prompt,
            batch_size=cfg.sample.batch_size,
            autocast=resolve_autocast(cfg.sample.autocast, run.policy.device, cfg.train.objective),
        )
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
        log(
            f"iteration {it}: reward {result.rewards[-1]:.4f}, "
            f"train {time.monotonic() - t2 + t1 - t0:.1f}s, hook {t2 - t1:.1f}s"
        )
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


def selection_figures(
    fresh: np.ndarray, stale: np.ndarray, group_size: int, rng: np.random.Generator, draws: int
) -> dict[str, float] | None:
    """What selecting G of one prompt's S seeds by stale score gives, against the oracle's choice
    (by fresh score), random choices of the same seeds, and the default seeds (the first G).

    Returns None when the fresh rewards are constant (no group has any variance to capture).
    """
    S = len(fresh)
    oracle = set(select_contrast(fresh, group_size))
    best = group_variance(fresh[sorted(oracle)])
    if best == 0:
        return None
    chosen = select_contrast(stale, group_size)
    randoms = [sorted(rng.choice(S, size=group_size, replace=False)) for _ in range(draws)]
    return {
        "overlap_stale": len(oracle & set(chosen)) / group_size,
        "overlap_random": float(np.mean([len(oracle & set(r)) / group_size for r in randoms])),
        "captured_stale": group_variance(fresh[chosen]) / best,
        "captured_random": float(np.mean([group_variance(fresh[r]) for r in randoms])) / best,
        "captured_default": group_variance(fresh[:group_size]) / best,
    }


class RankingProbe:
    """Hook that keeps the last states and measures tau and selection at the chosen iterations."""

    def __init__(
        self,
        run: TinyRun,
        *,
        staleness: Sequence[int],
        measure_at: Sequence[int],
        num_prompts: int,
        num_seeds: int,
        explore_steps: int = 0,
        random_draws: int = 32,
    ):
        if num_prompts > run.cfg.train.prompts_per_iteration:
            raise ValueError(
                f"--probe-prompts {num_prompts} exceeds "
                f"train.prompts_per_iteration={run.cfg.train.prompts_per_iteration}"
            )
        G = run.cfg.train.group_size
        if num_seeds <= G:
            raise ValueError(f"--seeds must be > train.group_size={G} to select G of them, got {num_seeds}")
        self.staleness = sorted(set(staleness))
        self.measure_at = set(measure_at)
        self.num_prompts, self.num_seeds = num_prompts, num_seeds
        self.random_draws = random_draws
        self.history: deque[dict[str, torch.Tensor]] = deque(maxlen=max(self.staleness))
        self.stale_policy = stale_copy(run.policy)
        # Cheap exploration: the stale side's schedule (the same initial noise, fewer steps).
        self.explore_sigmas = qwen_image_sigmas(explore_steps, run.policy.latent_shape[0]) if explore_steps else None
        self.rng = np.random.default_rng(run.cfg.train.seed)
        self.taus: dict[int, list[float]] = {s: [] for s in self.staleness}
        self.skipped: dict[int, int] = dict.fromkeys(self.staleness, 0)
        self.selection: dict[int, list[dict[str, float]]] = {s: [] for s in self.staleness}
        self.same_reward: dict[int, list[float]] = {s: [] for s in self.staleness}
        self.measured: list[int] = []

    def __call__(self, run: TinyRun, plan: IterationPlan) -> None:
        # history[s - 1] holds θ_{k-s}: the state each earlier iteration's rollout sampled with.
        if plan.iteration in self.measure_at and len(self.history) == self.history.maxlen:
            self._measure(run, plan)
        self.history.appendleft(snapshot(run.policy))

    def _measure(self, run: TinyRun, plan: IterationPlan) -> None:
        cfg, k, S, G = run.cfg, plan.iteration, self.num_seeds, run.cfg.train.group_size
        groups = plan.group_prompts(G)[: self.num_prompts]
        prompts = [p for p in groups for _ in range(S)]
        seeds_a = [derive_seed(cfg.train.seed, k, j, i) for j in range(len(groups)) for i in range(S)]
        shape = (len(groups), S)
        fresh_a = sample_rewards(run, run.policy, prompts, seeds_a, plan.sde_steps).reshape(shape)
        for s in self.staleness:
            load_trainable_state(self.stale_policy, self.history[s - 1])
            stale_a = sample_rewards(
                run, self.stale_policy, prompts, seeds_a, plan.sde_steps, self.explore_sigmas
            ).reshape(shape)
            self.same_reward[s].append(float(np.mean(stale_a == fresh_a)))
            for j in range(len(groups)):
                tau = tau_b(fresh_a[j], stale_a[j])
                if tau is None:
                    self.skipped[s] += 1
                else:
                    self.taus[s].append(tau)
                figures = selection_figures(fresh_a[j], stale_a[j], G, self.rng, self.random_draws)
                if figures is not None:
                    self.selection[s].append(figures)
        self.measured.append(k)


def measurement_iterations(num_iterations: int, staleness: Sequence[int], every: int) -> list[int]:
    """Iterations k >= max(staleness) (so θ_{k-s} exists for every s), every `every` iterations."""
    return list(range(max(staleness), num_iterations, every))


def main(argv: Sequence[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted recipe overrides, e.g. train.lr=1e-4")
    parser.add_argument(
        "--recipe", default=DEFAULT_RECIPE, help="DiT recipe YAML (default: configs/dit/tiny-shapes.yaml)"
    )
    parser.add_argument("--iterations", type=int, default=25, help="training iterations")
    parser.add_argument(
        "--measure-every", type=int, default=3, help="measure at iterations max(staleness), +every, ..."
    )
    parser.add_argument(
        "--probe-prompts", type=int, default=8, help="prompts per measurement (the iteration's first ones)"
    )
    parser.add_argument("--seeds", type=int, default=32, help="seeds per probe prompt")
    parser.add_argument("--staleness", type=int, nargs="+", default=[1, 2, 4], help="staleness values s")
    parser.add_argument(
        "--explore-steps",
        type=int,
        default=0,
        help="denoising steps of the stale scores (0 = the rollout's): cheap exploration",
    )
    parser.add_argument("--random-draws", type=int, default=32, help="random selections per prompt for the control")
    parser.add_argument("--quiet", action="store_true", help="no per-iteration log on stderr")
    args = parser.parse_args(argv)
    if min(args.staleness) < 1:
        raise ValueError(f"--staleness values must be >= 1, got {args.staleness}")
    measure_at = measurement_iterations(args.iterations, args.staleness, args.measure_every)
    if not measure_at:
        raise ValueError(
            f"--iterations {args.iterations} leaves no iteration >= max staleness {max(args.staleness)} to measure"
        )

    began = time.monotonic()
    run = build_run(args.recipe, args.overrides)
    probe = RankingProbe(
        run,
        staleness=args.staleness,
        measure_at=measure_at,
        num_prompts=args.probe_prompts,
        num_seeds=args.seeds,
        explore_steps=args.explore_steps,
        random_draws=args.random_draws,
    )
    log = (lambda _: None) if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    result = train(run, args.iterations, probe, log=log)
    seconds = time.monotonic() - began

    s_cfg = run.cfg.sample

    def mean(rows: list[dict[str, float]], key: str) -> float | None:
        return round(float(np.mean([r[key] for r in rows])), 4) if rows else None

    lines = []
    for s in probe.staleness:
        taus, sel = probe.taus[s], probe.selection[s]
        line = {
            "baseline": "random selection of the same candidate seeds, and the first G seeds (plain GRPO)",
            "kendall_tau_stale": round(float(np.mean(taus)), 4) if taus else None,
            "selection_overlap_stale": mean(sel, "overlap_stale"),
            "selection_overlap_random": mean(sel, "overlap_random"),
            "variance_captured_stale": mean(sel, "captured_stale"),
            "variance_captured_random": mean(sel, "captured_random"),
            "variance_captured_default": mean(sel, "captured_default"),
            "staleness": s,
            "explore_steps": args.explore_steps or s_cfg.num_steps,
            "num_pairs": len(taus),
            "skipped_constant": probe.skipped[s],
            "num_selections": len(sel),
            "tau_stale_p10": round(float(np.percentile(taus, 10)), 4) if taus else None,
            "frac_same_reward": round(float(np.mean(probe.same_reward[s])), 4),
            "iterations": args.iterations,
            "measured_iterations": probe.measured,
            "probe_prompts": args.probe_prompts,
            "seeds": args.seeds,
            "sampler": {
                "num_steps": s_cfg.num_steps,
                "noise_level": s_cfg.noise_level,
                "sde_type": s_cfg.sde_type,
                "sde_window_size": s_cfg.sde_window_size,
            },
            "train_reward_first_last": [round(result.rewards[0], 4), round(result.rewards[-1], 4)],
            "seconds": round(seconds, 1),
            "train_seconds": round(result.train_seconds, 1),
            "probe_seconds": round(result.hook_seconds, 1),
        }
        print(json.dumps(line), flush=True)
        lines.append(line)
    return lines


if __name__ == "__main__":
    main()
