"""Evaluation: mean reward of a policy on a prompt list, with fixed seeds (`spotlight eval`)."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import torch
from rich.progress import Progress

from spotlight.config import DiTRecipe
from spotlight.policy import DiTPolicy
from spotlight.rewards import CombinedReward
from spotlight.rollout import rollout
from spotlight.sampling import derive_seed, qwen_image_sigmas


def eval_seeds(cfg: DiTRecipe, prompt_index: int) -> list[int]:
    """The evaluation seeds of the prompt at `prompt_index` (the same for every checkpoint)."""
    return [derive_seed(cfg.eval.seed_offset, prompt_index, j) for j in range(cfg.eval.num_seeds)]


def evaluate(
    policy: DiTPolicy, prompts: Sequence[str], reward_fn: CombinedReward, cfg: DiTRecipe, *, progress: bool = True
) -> tuple[dict, torch.Tensor]:
    """Sample `eval.num_seeds` images per prompt with the eval sampler and score them.

    Returns:
        (summary dict, images (B, 3, H, W) of the first seed of each prompt).
    """
    start = time.monotonic()
    all_prompts = [p for p in prompts for _ in range(cfg.eval.num_seeds)]
    all_seeds = [s for i in range(len(prompts)) for s in eval_seeds(cfg, i)]
    sigmas = qwen_image_sigmas(cfg.sample.eval_num_steps, policy.latent_shape[0])
    totals, components, firsts = [], {}, []
    batch = cfg.eval.batch_size
    with Progress(disable=not progress, transient=True) as bar:
        task = bar.add_task("evaluating", total=len(all_prompts))
        for i in range(0, len(all_prompts), batch):
            p, s = all_prompts[i : i + batch], all_seeds[i : i + batch]
            ro = rollout(
                policy, p, s, sigmas,
                noise_level=cfg.sample.eval_noise_level,
                guidance_scale=cfg.sample.guidance_scale,
                negative_prompt=cfg.sample.negative_prompt,
                batch_size=batch,
            )  # fmt: skip
            result = reward_fn(ro.images, p)
            totals.append(result.total_B)
            for name, scores in result.components.items():
                components.setdefault(name, []).append(scores)
            firsts.append(ro.images[[j for j in range(len(p)) if (i + j) % cfg.eval.num_seeds == 0]])
            bar.update(task, advance=len(p))
    total = torch.cat(totals)
    valid = total[~torch.isnan(total)]
    summary = {
        "mean_reward": float(valid.mean()) if len(valid) else math.nan,
        "reward_std": float(valid.std(unbiased=False)) if len(valid) else math.nan,
        "num_prompts": len(prompts),
        "num_samples": len(total),
        "num_failed": int(torch.isnan(total).sum()),
    }
    for name, parts in components.items():
        scores = torch.cat(parts)
        summary[f"reward/{name}"] = float(scores[~torch.isnan(scores)].mean())
    summary["seconds"] = round(time.monotonic() - start, 2)
    return summary, torch.cat(firsts)
