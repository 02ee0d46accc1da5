"""A training rollout of the tiny default recipe in float32 against the same rollout under autocast.

Times `spotlight.rollout.rollout` (P x G samples, the recipe's steps, batch and sampler: the
trainer's call) with `autocast="none"` and with `--dtype` (default bfloat16), alternately in one
run, and compares what the two produce: the final latents and the `shapes` reward of the same
seeds. Then times the trainer's "nft" update of that rollout with `train.autocast` none and
bfloat16, alternately, and compares their weight changes. Prints one JSON line:

    {"rollout_s_float32": ..., "rollout_s_autocast": ..., "speedup": ..., "dtype": "bfloat16",
     "final_latent_rel_err": ..., "mean_reward_float32": ..., "mean_reward_autocast": ...,
     "mean_abs_reward_diff": ..., "update_s_float32": ..., "update_s_bfloat16": ...,
     "update_speedup": ..., "update_step_cosine": ..., "train_autocast_auto": ...,
     "cpu_has_amx": ..., "cpu_has_avx512_bf16": ..., "threads": ...}

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
from spotlight.core.advantages import group_advantages
from spotlight.core.config_io import load_config
from spotlight.driver import plan_iteration
from spotlight.policy import load_policy, load_trainable_state, trainable_state
from spotlight.prompts import train_and_eval_prompts
from spotlight.rewards import build_reward
from spotlight.rollout import resolve_train_autocast, rollout
from spotlight.sampling import qwen_image_sigmas
from spotlight.update import GRPOTrainer

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
    policy = load_policy(cfg.model, seed=cfg.train.seed)
    train_prompts, _ = train_and_eval_prompts(cfg.data, cfg.reward.weights)
    prompts, seeds, sde_steps = plan_iteration(cfg, train_prompts, 0)
    sigmas = qwen_image_sigmas(cfg.sample.num_steps, policy.latent_shape[0])
    reward_fn = build_reward(cfg.reward.weights, **cfg.reward.options())
    s = cfg.sample

    def run(autocast: str):
        t = time.perf_counter()
        ro = rollout(
            policy,
            prompts,
            seeds,
            sigmas,
            noise_level=s.noise_level,
            sde_steps=sde_steps,
            sde_type=s.sde_type,
            guidance_scale=s.guidance_scale,
            negative_prompt=s.negative_prompt,
            batch_size=s.batch_size,
            autocast=autocast,
        )
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
    update = time_updates(cfg, policy, ref, r32.float(), args.repeats) if cfg.train.objective == "nft" else {}
    print(
        json.dumps(
            {
                "baseline": "the same rollout in float32 (no autocast)",
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
                **update,
                # torch's own probes, the ones `resolve_autocast` reads (private; absent: None)
                "cpu_has_amx": _probe("_is_amx_tile_supported"),
                "cpu_has_avx512_bf16": _probe("_is_avx512_bf16_supported"),
                "threads": torch.get_num_threads(),
            }
        )
    )


def time_updates(cfg: DiTRecipe, policy, ro, rewards_B: torch.Tensor, repeats: int) -> dict:
    """The trainer's "nft" update of one rollout with train.autocast none and bfloat16, alternately.

    Every timed update starts from the same weights and a fresh optimizer, so all of them do the
    same work; update_step_cosine compares the two modes' weight changes (1: the same step).
    """
    base = {k: v.clone() for k, v in trainable_state(policy).items()}
    P, G = cfg.train.prompts_per_iteration, cfg.train.group_size
    adv = group_advantages(rewards_B.view(P, G), std_mode=cfg.train.adv_std, clip=cfg.train.adv_clip)

    def one(mode: str) -> tuple[float, torch.Tensor]:
        load_trainable_state(policy, base)
        cfg.train.autocast = mode
        trainer = GRPOTrainer(policy, cfg)
        t = time.perf_counter()
        trainer.update(ro, adv, iteration=0)
        dt = time.perf_counter() - t
        return dt, torch.cat([(v - base[k]).flatten() for k, v in trainable_state(policy).items()])

    one("none"), one("bfloat16")  # warm-up
    times: dict[str, list[float]] = {"none": [], "bfloat16": []}
    deltas = {}
    for _ in range(repeats):
        for mode in times:
            dt, deltas[mode] = one(mode)
            times[mode].append(dt)
    load_trainable_state(policy, base)
    u32, u16 = statistics.median(times["none"]), statistics.median(times["bfloat16"])
    cos = torch.nn.functional.cosine_similarity(deltas["none"], deltas["bfloat16"], dim=0)
    return {
        "update_s_float32": round(u32, 3),
        "update_s_bfloat16": round(u16, 3),
        "update_speedup": round(u32 / u16, 3),
        "update_step_cosine": round(float(cos), 4),
        "train_autocast_auto": resolve_train_autocast("auto", policy.device, "nft"),
    }


if __name__ == "__main__":
    main()
