"""A training rollout of the tiny default recipe in float32 against the same rollout under autocast.

Times `spotlight.rollout.rollout` (P x G samples, the recipe's steps, batch and sampler: the
trainer's call) with `autocast="none"` and with `--dtype` (default bfloat16), alternately in one
run, and compares what the two produce: the final latents and the `shapes` reward of the same
seeds. Prints one JSON line:

    {"rollout_s_float32": ..., "rollout_s_autocast": ..., "speedup": ..., "dtype": "bfloat16",
     "final_latent_rel_err": ..., "mean_reward_float32": ..., "mean_reward_autocast": ...,
     "mean_abs_reward_diff": ..., "cpu_has_amx": ..., "cpu_has_avx512_bf16": ..., "threads": ...}

    .venv/bin/python benchmarks/autocast_rollout.py [--repeats 5] [model.path=...]

The speed-up needs hardware bfloat16 matrix units (AMX or AVX512-BF16 on a CPU); without them
autocast is usually slower than float32, and the line says which the CPU has.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from spotlight.config import DiTRecipe
from spotlight.config_io import load_config
from spotlight.policy import load_policy
from spotlight.prompts import train_and_eval_prompts
from spotlight.rewards import build_reward
from spotlight.rollout import rollout
from spotlight.sampling import qwen_image_sigmas
from spotlight.train import plan_iteration

RECIPE = Path(__file__).resolve().parents[1] / "configs" / "dit" / "tiny-shapes.yaml"


def _probe(name: str) -> bool | None:
    fn = getattr(torch.cpu, name, None)
    return None if fn is None else bool(fn())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--recipe", default=str(RECIPE))
    parser.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. train.group_size=8")
    args = parser.parse_args()

    cfg = load_config(DiTRecipe, args.recipe, args.overrides)
    policy = load_policy(cfg.model, trainable=False)
    train_prompts, _ = train_and_eval_prompts(cfg.data, cfg.reward.weights)
    prompts, seeds, sde_steps = plan_iteration(cfg, train_prompts, 0)
    sigmas = qwen_image_sigmas(cfg.sample.num_steps, policy.latent_shape[0])
    reward_fn = build_reward(cfg.reward.weights, **cfg.reward.options())
    s = cfg.sample

    def run(autocast: str):
        t = time.perf_counter()
        ro = rollout(
            policy, prompts, seeds, sigmas,
            noise_level=s.noise_level, sde_steps=sde_steps, sde_type=s.sde_type,
            guidance_scale=s.guidance_scale, negative_prompt=s.negative_prompt,
            batch_size=s.batch_size, autocast=autocast,
        )  # fmt: skip
        return time.perf_counter() - t, ro

    run("none"), run(args.dtype)  # warm-up: kernels, allocator
    times: dict[str, list[float]] = {"none": [], args.dtype: []}
    last = {}
    for _ in range(args.repeats):
        for mode in times:
            dt, last[mode] = run(mode)
            times[mode].append(dt)
    ref, low = last["none"], last[args.dtype]
    x32, xlo = ref.trajectory.final, low.trajectory.final
    r32 = reward_fn(ref.images, prompts).total_B.double()
    rlo = reward_fn(low.images, prompts).total_B.double()
    t32, tlo = statistics.median(times["none"]), statistics.median(times[args.dtype])
    print(
        json.dumps(
            {
                "rollout_s_float32": round(t32, 3),
                "rollout_s_autocast": round(tlo, 3),
                "speedup": round(t32 / tlo, 3),
                "dtype": args.dtype,
                "samples": len(prompts),
                "steps": s.num_steps,
                "final_latent_rel_err": round(float((xlo - x32).norm() / x32.norm()), 5),
                "mean_reward_float32": round(float(r32.mean()), 4),
                "mean_reward_autocast": round(float(rlo.mean()), 4),
                "mean_abs_reward_diff": round(float((rlo - r32).abs().mean()), 4),
                # torch's own probes, the ones `resolve_autocast` reads (private; absent: None)
                "cpu_has_amx": _probe("_is_amx_tile_supported"),
                "cpu_has_avx512_bf16": _probe("_is_avx512_bf16_supported"),
                "threads": torch.get_num_threads(),
            }
        )
    )


if __name__ == "__main__":
    main()
