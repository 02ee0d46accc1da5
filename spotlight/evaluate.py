"""Evaluation: mean reward of a policy on a prompt list, with fixed seeds (`spotlight eval`)."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import torch
from rich.progress import Progress

from spotlight.config import DiTRecipe
from spotlight.core.distributed import DataParallel
from spotlight.core.seeds import derive_seed
from spotlight.policy import DiTPolicy
from spotlight.rewards import CombinedReward
from spotlight.rollout import resolve_autocast, rollout
from spotlight.sampling import qwen_image_sigmas


def eval_seeds(cfg: DiTRecipe, prompt_index: int) -> list[int]:
    """The evaluation seeds of the prompt at `prompt_index` (the same for every checkpoint)."""
    return [derive_seed(cfg.eval.seed_offset, prompt_index, j) for j in range(cfg.eval.num_seeds)]


def evaluate(
    policy: DiTPolicy,
    prompts: Sequence[str],
    reward_fn: CombinedReward,
    cfg: DiTRecipe,
    *,
    progress: bool = True,
    dp: DataParallel | None = None,
) -> tuple[dict, torch.Tensor]:
    """Sample `eval.num_seeds` images per prompt with the eval sampler and score them.

    With data parallelism (`dp`; every rank calls this) each rank samples a contiguous slice of the
    (prompt, seed) samples, under FSDP padded to the same count (every forward is a collective),
    and the rewards and images are gathered: every rank returns the whole batch's summary. Fewer
    samples than ranks: every rank samples all of them.

    Returns:
        (summary dict, images (B, 3, H, W) of the first seed of each prompt).
    """
    start = time.monotonic()
    dp = dp if dp is not None and len(prompts) * cfg.eval.num_seeds >= dp.world_size else DataParallel()
    all_prompts = [p for p in prompts for _ in range(cfg.eval.num_seeds)]
    all_seeds = [s for i in range(len(prompts)) for s in eval_seeds(cfg, i)]
    lo, hi = dp.shard(len(all_prompts))
    my_prompts, my_seeds = dp.padded_shard(all_prompts), dp.padded_shard(all_seeds)  # padding dropped below
    sigmas = qwen_image_sigmas(cfg.sample.eval_num_steps, policy.latent_shape[0])
    autocast = resolve_autocast(cfg.sample.autocast, policy.device, cfg.train.objective)
    totals, components, firsts = [], {}, []
    batch = cfg.eval.batch_size
    with Progress(disable=not progress, transient=True) as bar:
        task = bar.add_task("evaluating", total=len(my_prompts))
        for i in range(0, len(my_prompts), batch):
            p, s = my_prompts[i : i + batch], my_seeds[i : i + batch]
            ro = rollout(
                policy,
                p,
                s,
                sigmas,
                noise_level=cfg.sample.eval_noise_level,
                guidance_scale=cfg.sample.guidance_scale,
                negative_prompt=cfg.sample.negative_prompt,
                batch_size=batch,
                autocast=autocast,
            )
            keep = min(len(p), hi - lo - i)  # the padding samples are not scored
            bar.update(task, advance=len(p))
            if keep <= 0:
                continue
            result = reward_fn(ro.images[:keep], p[:keep])
            totals.append(result.total_B)
            for name, scores in result.components.items():
                components.setdefault(name, []).append(scores)
            firsts.append(ro.images[[j for j in range(keep) if (lo + i + j) % cfg.eval.num_seeds == 0]])
    total = dp.all_gather_rows(torch.cat(totals))
    components = {name: dp.all_gather_rows(torch.cat(parts)) for name, parts in components.items()}
    valid = total[~torch.isnan(total)]
    summary = {
        "mean_reward": float(valid.mean()) if len(valid) else math.nan,
        **_standard_errors(total, len(prompts)),
        "reward_std": float(valid.std(unbiased=False)) if len(valid) else math.nan,
        "num_prompts": len(prompts),
        "num_samples": len(total),
        "num_failed": int(torch.isnan(total).sum()),
    }
    for name, scores in components.items():
        summary[f"reward/{name}"] = float(scores[~torch.isnan(scores)].mean())
    summary["seconds"] = round(time.monotonic() - start, 2)
    return summary, dp.all_gather_rows(torch.cat(firsts))


def _standard_errors(total_B: torch.Tensor, num_prompts: int) -> dict[str, float]:
    """Standard errors of the mean reward, samples prompt-major (each prompt's seeds together).

    stderr: the seeds' noise with these prompts fixed, sqrt(sum_p var_p / S_p) / P (var_p the
    unbiased variance of prompt p's seeds): how far a second evaluation with other seeds would move
    the mean, what a comparison of two checkpoints on the same prompts needs.
    stderr_prompts: the spread of the per-prompt means over sqrt(P): how the figure would move on
    another draw of P prompts from the same task.
    """
    per_prompt = total_B.double().reshape(num_prompts, -1)
    seeds = (~torch.isnan(per_prompt)).sum(1)
    means = per_prompt.nanmean(1)
    ok = seeds >= 2
    var = ((per_prompt - means[:, None]) ** 2).nan_to_num(0.0).sum(1)[ok] / (seeds[ok] - 1)
    nan = math.nan
    return {
        "stderr": float((var / seeds[ok]).sum().sqrt() / ok.sum()) if ok.any() else nan,
        "stderr_prompts": float(means[~torch.isnan(means)].std() / math.sqrt((~torch.isnan(means)).sum()))
        if (~torch.isnan(means)).sum() > 1
        else nan,
    }
