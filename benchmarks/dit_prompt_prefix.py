"""Prompt-encoder calls per prompt per DiT GRPO step, with and without the per-step prompt cache.

Two copies of the shipped tiny model (spotlight/assets/tiny-shapes-base) train side by side from
the same weights on the same iterations (the driver's `plan_iteration`: prompts, seeds, window),
each step being what `spotlight train` runs: begin the step's prompts, rollout, reward,
advantages, update, end the step. One copy looks prompts up through `PromptCache` (each distinct
prompt encoded once per step, shared by its G samples, the rollout's chunks and the update), the
other through `UncachedPrompts` (every phase encodes every row, as a naive pipeline does).

- encoder_calls_per_prompt_per_step: prompt rows the text encoder ran on / distinct prompts, per
  step (mean over the timed steps); uncached is 2G without CFG (rollout + update), cached 1.
- images_identical, latents_identical, weights_identical: the two copies' rollout images and
  trajectories at every step, and their trained weights after the last step, compared bit for bit.
- step_time_ratio_uncached_over_cached: fastest step time of each copy, measured alternately (the
  order flips every step) after one warm-up step each; the minimum, because on a shared machine
  the noise only ever adds time (medians are reported too).
- encoder_share_of_step: seconds in the text encoder / step seconds, per copy. Small on the tiny
  model (and on Qwen-Image, whose 7B encoder reads ~100 tokens per prompt against 50 denoising
  steps of a 20B transformer over thousands of image tokens per sample): the cache removes
  repeated work and holds memory for one step only, but is not where the step's time goes.

--prefetch compares instead two cached copies, with and without `train.prefetch_prompts` (the
next step's prompts encoded on the cache's worker thread during this step, what the driver does),
alternating in the same way:

- encoder_seconds_hidden_per_step: the encoder's seconds on the step's path without prefetch
  (encoder_seconds_per_step.no_prefetch) less what the prefetching copy's `begin_step` still waited
  for (wait_seconds_per_step.prefetch), means over the timed steps: the most prefetch can save.
  encoder_seconds_per_step.prefetch is the worker's encoder time, longer where it shares the cores
  with the step it overlaps; that sharing is the price, which only the step times show;
- step_time_ratio_no_prefetch_over_prefetch: of the fastest steps (> 1: prefetch faster); the
  paired differences of the alternated steps give step_seconds_saved_mean and its standard error,
  and saving_within_noise is true when the mean is within two standard errors of 0. A prefetch
  still running when its copy's step ends is waited for and its time added to that step (so it
  does not slow the other copy's timed step);
- images_identical, latents_identical, weights_identical, embeddings_identical: the two copies
  bit for bit at every step (the embeddings: of the step's prompts, as each copy's cache holds
  them), and the weights after the last.

No projection to Qwen-Image here: the tiny model's encoder-to-transformer ratio does not scale to
it, and no Qwen-Image encoder timing has been measured (`gpu_check.sh` cuts the encoder to a layer).

    .venv/bin/python benchmarks/dit_prompt_prefix.py --json
    .venv/bin/python benchmarks/dit_prompt_prefix.py --json sample.guidance_scale=4.0   # true CFG
    .venv/bin/python benchmarks/dit_prompt_prefix.py --json --prefetch --repeats 6      # prefetch vs not
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from spotlight.config import DiTRecipe
from spotlight.core.advantages import group_advantages
from spotlight.core.config_io import load_config
from spotlight.driver import plan_iteration
from spotlight.policy import load_policy
from spotlight.prompt_cache import PromptCache, UncachedPrompts
from spotlight.prompts import train_and_eval_prompts
from spotlight.rewards import build_reward
from spotlight.rollout import Rollout, rollout
from spotlight.sampling import qwen_image_sigmas
from spotlight.update import GRPOTrainer


class Copy:
    """One policy copy with its trainer; `step` is one iteration of the driver loop."""

    def __init__(self, cfg: DiTRecipe, *, cached: bool, prefetch: bool = False):
        self.cfg = cfg
        self.prefetch = prefetch
        self.policy = load_policy(cfg.model)
        if not cached:
            self.policy.prompt_cache = UncachedPrompts(self.policy._encode_uncached)
        self.trainer = GRPOTrainer(self.policy, cfg)
        self.reward_fn = build_reward(cfg.reward.weights, **cfg.reward.options())
        self.sigmas = qwen_image_sigmas(cfg.sample.num_steps, self.policy.latent_shape[0])
        self.embeddings: list[torch.Tensor] = []
        """The step's prompt embeddings as the cache held them (sorted distinct prompts; cached copies)."""

    def step(self, train_prompts: list[str], it: int):
        cfg, s = self.cfg, self.cfg.sample
        P, G = cfg.train.prompts_per_iteration, cfg.train.group_size
        prompts, seeds, sde_steps = plan_iteration(cfg, train_prompts, it)
        # What the driver does with train.prefetch_prompts: the next step's prompts, known in advance.
        nxt = plan_iteration(cfg, train_prompts, it + 1)[0] if self.prefetch else None
        cache = self.policy.prompt_cache
        t0 = time.perf_counter()
        cache.begin_step(prompts, next_prompts=nxt)
        if isinstance(cache, PromptCache):
            self.embeddings = cache.lookup(sorted(set(prompts)))
        ro: Rollout = rollout(
            self.policy,
            prompts,
            seeds,
            self.sigmas,
            noise_level=s.noise_level,
            sde_steps=sde_steps,
            sde_type=s.sde_type,
            guidance_scale=s.guidance_scale,
            negative_prompt=s.negative_prompt,
            batch_size=s.batch_size,
        )
        reward = self.reward_fn(ro.images, prompts)
        adv = group_advantages(reward.total_B.view(P, G), std_mode=cfg.train.adv_std, clip=cfg.train.adv_clip)
        self.trainer.update(ro, adv, it)
        stats = cache.end_step()
        if isinstance(cache, PromptCache) and cache._pending is not None:
            # A prefetch still running at the end of its step would run into the other copy's timed
            # step: wait for it here and charge the wait to this step.
            cache._pending.future.result()
        return time.perf_counter() - t0, stats, ro


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON line (the default output too)")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per copy (after one warm-up step)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads; 0 keeps torch's default")
    parser.add_argument(
        "--prefetch", action="store_true", help="compare cached copies with and without prefetch instead"
    )
    parser.add_argument("overrides", nargs="*", help="dotted recipe overrides (default: the tiny-shapes recipe)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    cfg = load_config(DiTRecipe, None, args.overrides)
    train_prompts = train_and_eval_prompts(cfg.data, cfg.reward.weights)[0]
    if args.prefetch:
        compare_prefetch(cfg, train_prompts, args.repeats)
        return
    copies = {"uncached": Copy(cfg, cached=False), "cached": Copy(cfg, cached=True)}
    seconds: dict[str, list[float]] = {k: [] for k in copies}
    calls: dict[str, list[float]] = {k: [] for k in copies}
    forwards: dict[str, list[int]] = {k: [] for k in copies}
    encoder_s: dict[str, list[float]] = {k: [] for k in copies}
    held_bytes: list[int] = []
    images_identical = latents_identical = True
    for it in range(1 + args.repeats):
        order = ["uncached", "cached"] if it % 2 == 0 else ["cached", "uncached"]
        rollouts: dict[str, Rollout] = {}
        for name in order:
            secs, stats, rollouts[name] = copies[name].step(train_prompts, it)
            if it == 0:
                continue  # warm-up
            seconds[name].append(secs)
            calls[name].append(stats.calls_per_prompt)
            forwards[name].append(stats.num_forwards)
            encoder_s[name].append(stats.encoder_s)
            if name == "cached":
                held_bytes.append(stats.held_bytes)
        a, b = rollouts["uncached"], rollouts["cached"]
        images_identical &= torch.equal(a.images, b.images)
        latents_identical &= torch.equal(a.trajectory.latents, b.trajectory.latents)
    sa, sb = (copies[k].policy.transformer.state_dict() for k in ("uncached", "cached"))
    weights_identical = all(torch.equal(sa[k], sb[k]) for k in sa)
    step_s = {k: min(v) for k, v in seconds.items()}
    print(
        json.dumps(
            {
                "baseline": "the same step encoding the prompt at every denoising step (uncached)",
                "encoder_calls_per_prompt_per_step": {k: statistics.mean(v) for k, v in calls.items()},
                "images_identical": images_identical,
                "latents_identical": latents_identical,
                "weights_identical": weights_identical,
                "step_time_ratio_uncached_over_cached": round(step_s["uncached"] / step_s["cached"], 4),
                "step_seconds_min": {k: round(v, 3) for k, v in step_s.items()},
                "step_seconds_median": {k: round(statistics.median(v), 3) for k, v in seconds.items()},
                "encoder_seconds_per_step": {k: round(statistics.mean(v), 4) for k, v in encoder_s.items()},
                "encoder_forwards_per_step": {k: statistics.mean(v) for k, v in forwards.items()},
                "encoder_share_of_step": {k: round(sum(encoder_s[k]) / sum(seconds[k]), 5) for k in copies},
                "held_kib_cached": round(max(held_bytes) / 1024, 1),
                "prompts": cfg.train.prompts_per_iteration,
                "group_size": cfg.train.group_size,
                "denoising_steps": cfg.sample.num_steps,
                "objective": cfg.train.objective,
                "guidance_scale": cfg.sample.guidance_scale,
                "timed_steps": args.repeats,
                "threads": torch.get_num_threads(),
            }
        )
    )


def compare_prefetch(cfg: DiTRecipe, train_prompts: list[str], repeats: int) -> None:
    """Two cached copies, the next step's prompts prefetched or not, alternated step by step."""
    copies = {"no_prefetch": Copy(cfg, cached=True), "prefetch": Copy(cfg, cached=True, prefetch=True)}
    seconds: dict[str, list[float]] = {k: [] for k in copies}
    encoder_s: dict[str, list[float]] = {k: [] for k in copies}
    wait_s: dict[str, list[float]] = {k: [] for k in copies}
    prefetched: list[bool] = []
    identical = {"images": True, "latents": True, "embeddings": True}
    for it in range(1 + repeats):
        order = ["no_prefetch", "prefetch"] if it % 2 == 0 else ["prefetch", "no_prefetch"]
        rollouts: dict[str, Rollout] = {}
        for name in order:
            secs, stats, rollouts[name] = copies[name].step(train_prompts, it)
            if it == 0:
                continue  # warm-up (and nothing was prefetched for it)
            seconds[name].append(secs)
            encoder_s[name].append(stats.encoder_s)
            wait_s[name].append(stats.wait_s)
            if name == "prefetch":
                prefetched.append(stats.prefetched)
        a, b = rollouts["no_prefetch"], rollouts["prefetch"]
        identical["images"] &= torch.equal(a.images, b.images)
        identical["latents"] &= torch.equal(a.trajectory.latents, b.trajectory.latents)
        ea, eb = copies["no_prefetch"].embeddings, copies["prefetch"].embeddings
        identical["embeddings"] &= len(ea) == len(eb) and all(torch.equal(x, y) for x, y in zip(ea, eb))
    copies["prefetch"].policy.prompt_cache.close()  # the last step's prefetch of the step after
    sa, sb = (copies[k].policy.transformer.state_dict() for k in copies)
    step_min = {k: min(v) for k, v in seconds.items()}
    saved = [x - y for x, y in zip(seconds["no_prefetch"], seconds["prefetch"])]  # paired by step
    saved_mean = statistics.mean(saved)
    saved_se = statistics.stdev(saved) / len(saved) ** 0.5 if len(saved) > 1 else float("inf")
    # The encoder's time on the step's path without prefetch, less what is left on it with prefetch.
    hidden = statistics.mean(encoder_s["no_prefetch"]) - statistics.mean(wait_s["prefetch"])
    print(
        json.dumps(
            {
                "baseline": "the same step encoding its prompts on the critical path (train.prefetch_prompts=false)",
                "mode": "prefetch",
                "encoder_seconds_hidden_per_step": round(hidden, 5),
                "encoder_seconds_per_step": {k: round(statistics.mean(v), 5) for k, v in encoder_s.items()},
                "wait_seconds_per_step": {k: round(statistics.mean(v), 5) for k, v in wait_s.items()},
                "step_time_ratio_no_prefetch_over_prefetch": round(step_min["no_prefetch"] / step_min["prefetch"], 4),
                "step_seconds_min": {k: round(v, 3) for k, v in step_min.items()},
                "step_seconds_median": {k: round(statistics.median(v), 3) for k, v in seconds.items()},
                "step_seconds_saved_mean": round(saved_mean, 4),
                "step_seconds_saved_stderr": round(saved_se, 4),
                "saving_within_noise": abs(saved_mean) <= 2 * saved_se,
                "encoder_share_of_step_no_prefetch": round(
                    sum(encoder_s["no_prefetch"]) / sum(seconds["no_prefetch"]), 5
                ),
                "steps_prefetched": sum(prefetched),
                "images_identical": identical["images"],
                "latents_identical": identical["latents"],
                "embeddings_identical": identical["embeddings"],
                "weights_identical": all(torch.equal(sa[k], sb[k]) for k in sa),
                "prompts": cfg.train.prompts_per_iteration,
                "group_size": cfg.train.group_size,
                "denoising_steps": cfg.sample.num_steps,
                "objective": cfg.train.objective,
                "guidance_scale": cfg.sample.guidance_scale,
                "timed_steps": repeats,
                "threads": torch.get_num_threads(),
            }
        )
    )


if __name__ == "__main__":
    main()
