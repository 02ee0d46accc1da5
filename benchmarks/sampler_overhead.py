"""Overhead of the seeded SDE sampling loop with log-probs over the bare transformer forwards.

overhead_ratio = time(sample(): B images x K steps, SDE with log-probs, per-sample seeded noise)
                 / (K x time(one batched transformer forward of the same batch)),
both measured alternately in one run (medians of `--repeats`), at the tiny default recipe's sizes
(its rollout batch and steps). Every step is stochastic with Flow-GRPO's step at `--noise-level`
(default 1.2, Qwen-Image's), whatever sampler the recipe trains with: the figure is the cost of
the SDE loop. Prints one JSON line.

    .venv/bin/python benchmarks/sampler_overhead.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from spotlight.config import DiTRecipe
from spotlight.policy import load_policy
from spotlight.prompts import train_and_eval_prompts
from spotlight.sampling import qwen_image_sigmas, sample


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--noise-level", type=float, default=1.2, help="SDE noise level a (> 0)")
    args = parser.parse_args()

    cfg = DiTRecipe()
    batch = cfg.train.prompts_per_iteration * cfg.train.group_size
    steps = cfg.sample.num_steps
    policy = load_policy(cfg.model, trainable=False)
    prompts = train_and_eval_prompts(cfg.data, cfg.reward.weights)[0][:batch]
    embeds, mask = policy.encode_prompts(prompts)
    sigmas = qwen_image_sigmas(steps, policy.latent_shape[0])
    seeds = list(range(batch))
    x = torch.randn(batch, *policy.latent_shape)
    sigma_B = torch.full((batch,), 0.5)

    def velocity(latents, s):
        return policy.velocity(latents, s, embeds, mask)

    def loop() -> float:
        t = time.perf_counter()
        traj = sample(velocity, seeds, policy.latent_shape, sigmas, noise_level=args.noise_level)
        assert bool((traj.log_probs != 0).all()), "every step must be stochastic, with a log-prob"
        assert traj.log_probs.shape == (steps, batch)
        return time.perf_counter() - t

    def forward() -> float:
        t = time.perf_counter()
        with torch.no_grad():
            velocity(x, sigma_B)
        return time.perf_counter() - t

    loop(), forward()  # warm-up
    loop_times, forward_times = [], []
    for _ in range(args.repeats):
        loop_times.append(loop())
        forward_times.extend(forward() for _ in range(steps))
    loop_s = statistics.median(loop_times)
    forward_s = statistics.median(forward_times)
    print(
        json.dumps(
            {
                "baseline": "the transformer's forwards alone (steps x one forward)",
                "overhead_ratio": round(loop_s / (steps * forward_s), 4),
                "loop_seconds": round(loop_s, 4),
                "forward_seconds": round(forward_s, 5),
                "batch": batch,
                "steps": steps,
                "noise_level": args.noise_level,
                "threads": torch.get_num_threads(),
            }
        )
    )


if __name__ == "__main__":
    main()
