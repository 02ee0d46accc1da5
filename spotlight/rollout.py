"""Rollouts: sample seeded trajectories with a DiT policy and decode them to images.

Shape legend: B samples, L image tokens, C packed channels, N steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from spotlight.policy import DTYPES, DiTPolicy
from spotlight.sampling import Trajectory, cfg_combine, sample


@dataclass
class PromptBatch:
    """Encoded prompts (and negative prompts when true CFG is on) for a batch of samples."""

    embeds: torch.Tensor
    """(B, T, D) prompt embeddings."""
    mask: torch.Tensor
    """(B, T) prompt mask."""
    neg_embeds: torch.Tensor | None = None
    """(B, T', D) negative prompt embeddings, only with CFG."""
    neg_mask: torch.Tensor | None = None
    """(B, T') negative prompt mask."""

    def select(self, index: torch.Tensor) -> PromptBatch:
        pick = lambda t: None if t is None else t[index]  # noqa: E731
        return PromptBatch(pick(self.embeds), pick(self.mask), pick(self.neg_embeds), pick(self.neg_mask))


def encode(policy: DiTPolicy, prompts: Sequence[str], guidance_scale: float, negative_prompt: str) -> PromptBatch:
    embeds, mask = policy.encode_prompts(list(prompts))
    if guidance_scale == 1.0:
        return PromptBatch(embeds, mask)
    neg_embeds, neg_mask = policy.encode_prompts([negative_prompt] * len(prompts))
    return PromptBatch(embeds, mask, neg_embeds, neg_mask)


def guided_velocity(
    policy: DiTPolicy, latents_BLC: torch.Tensor, sigma_B: torch.Tensor, batch: PromptBatch, guidance_scale: float
) -> torch.Tensor:
    """Velocity (B, L, C), with Qwen-Image's true CFG when guidance_scale > 1."""
    cond = policy.velocity(latents_BLC, sigma_B, batch.embeds, batch.mask)
    if batch.neg_embeds is None:
        return cond
    uncond = policy.velocity(latents_BLC, sigma_B, batch.neg_embeds, batch.neg_mask)
    return cfg_combine(cond, uncond, guidance_scale)


AUTOCAST_DTYPES = {"none": None, "bfloat16": DTYPES["bfloat16"], "float16": DTYPES["float16"]}
"""Resolved `sample.autocast` values and their torch dtypes (the weights' table, `policy.DTYPES`)."""


def cpu_has_bf16_matmul() -> bool:
    """Whether this CPU has bfloat16 matrix instructions (AMX tiles or AVX512-BF16), by torch's probes.

    The probes are private, but the only ones torch offers; a torch without them counts as "no".
    """
    probes = [getattr(torch.cpu, name, None) for name in ("_is_amx_tile_supported", "_is_avx512_bf16_supported")]
    return any(probe is not None and probe() for probe in probes)


def resolve_autocast(setting: str, device: torch.device | str, objective: str) -> str:
    """What a `sample.autocast` setting means here: "none", "bfloat16" or "float16".

    "auto" picks bfloat16 only where it is both safe and fast. Safe: the objective is "nft",
    which trains on the final samples, whatever computed them; Flow-GRPO compares the rollout's
    step log-probs with the update's float32 recomputation, so it keeps "none". Fast: a CUDA GPU
    with bfloat16, or a CPU with bfloat16 matrix instructions, AMX tiles or AVX512-BF16 (a CPU
    with neither emulates bfloat16; `benchmarks/autocast_rollout.py` measures the difference,
    docs/tiny-recipe-notes.md has the figures).
    """
    if setting != "auto":
        return setting
    if objective != "nft":
        return "none"
    device = torch.device(device)
    if device.type == "cuda":
        return "bfloat16" if torch.cuda.is_bf16_supported() else "none"
    if device.type == "cpu":
        return "bfloat16" if cpu_has_bf16_matmul() else "none"
    return "none"


def resolve_train_autocast(setting: str, device: torch.device | str, objective: str) -> str:
    """What a `train.autocast` setting means here: "none" or "bfloat16".

    "auto" is bfloat16 for the "nft" update on a CUDA GPU with bfloat16, as in the usual
    mixed-precision recipes (the weights, their gradients and Adam's state stay in the weights'
    dtype), and float32 on a CPU, where the bfloat16 update was not both faster and as good
    (`benchmarks/autocast_rollout.py`'s update_* figures; docs/tiny-recipe-notes.md). Flow-GRPO
    keeps "none": its ratio compares float32 step log-probs. Elsewhere "auto" means what it means
    for sampling (`resolve_autocast`).
    """
    if setting == "auto" and torch.device(device).type == "cpu":
        return "none"
    return resolve_autocast(setting, device, objective)


@dataclass
class Rollout:
    """Samples of one rollout, with what the GRPO update needs to recompute their log-probs."""

    prompts: list[str]
    """B prompts, one per sample."""
    seeds: list[int]
    """B trajectory seeds."""
    trajectory: Trajectory
    """Latents (N + 1, B, L, C), log-probs (N, B), schedule and stochastic steps."""
    images: torch.Tensor
    """(B, 3, H, W) decoded images in [0, 1]."""


@torch.no_grad()
def rollout(
    policy: DiTPolicy,
    prompts: Sequence[str],
    seeds: Sequence[int],
    sigmas: torch.Tensor,
    *,
    noise_level: float,
    sde_steps: Sequence[int] | None = None,
    sde_type: str = "flow_grpo",
    guidance_scale: float = 1.0,
    negative_prompt: str = " ",
    batch_size: int = 64,
    autocast: str = "none",
) -> Rollout:
    """Sample one trajectory per (prompt, seed) in chunks of `batch_size`; results do not depend on it.

    `autocast` ("bfloat16", "float16"; "none" to run in the weights' dtype; see
    `resolve_autocast` for "auto") runs the transformer under torch.autocast; the sampler's
    arithmetic and the decoder stay in float32.
    """
    if len(prompts) != len(seeds):
        raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
    if autocast == "auto":
        raise ValueError(
            'autocast "auto" must be resolved first: resolve_autocast(cfg.sample.autocast, device, objective)'
        )
    if autocast not in AUTOCAST_DTYPES:
        raise ValueError(f"autocast must be one of {sorted(AUTOCAST_DTYPES)}, got {autocast!r}")
    dtype = AUTOCAST_DTYPES[autocast]

    def velocity(x: torch.Tensor, s: torch.Tensor, batch: PromptBatch) -> torch.Tensor:
        if dtype is None:
            return guided_velocity(policy, x, s, batch, guidance_scale)
        with torch.autocast(policy.device.type, dtype=dtype):
            v = guided_velocity(policy, x, s, batch, guidance_scale)
        return v.to(x.dtype)

    chunks: list[Trajectory] = []
    for start in range(0, len(prompts), batch_size):
        p = list(prompts[start : start + batch_size])
        batch = encode(policy, p, guidance_scale, negative_prompt)
        chunks.append(
            sample(
                lambda x, s: velocity(x, s, batch),  # noqa: B023 - sample() calls it before the loop moves on
                seeds[start : start + batch_size],
                policy.latent_shape,
                sigmas,
                noise_level=noise_level,
                sde_steps=sde_steps,
                sde_type=sde_type,
                device=policy.device,
            )
        )
    traj = Trajectory(
        latents=torch.cat([c.latents for c in chunks], dim=1),
        log_probs=torch.cat([c.log_probs for c in chunks], dim=1),
        sigmas=sigmas,
        sde_steps=chunks[0].sde_steps,
    )
    return Rollout(list(prompts), list(seeds), traj, policy.decode(traj.final))
