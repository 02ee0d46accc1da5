"""GRPO losses for flow-matching policies (pure functions on tensors); the group advantages that
drive them are `spotlight.core.advantages`.

Shape legend: P prompts, G samples per prompt (the group), B = P * G samples.

References: Shao et al. 2024 (DeepSeekMath, GRPO: group-relative advantages); Liu et al. 2025
(Flow-GRPO: per-step Gaussian policy of the SDE sampler, clipped ratio, KL between step means);
Yu et al. 2025 (DAPO: groups with identical rewards carry no gradient and are filtered);
Zheng et al. 2025 (DiffusionNFT: the same group advantages drive a forward-process loss).
"""

from __future__ import annotations

import torch


def clipped_policy_loss(
    logp_B: torch.Tensor, old_logp_B: torch.Tensor, adv_B: torch.Tensor, clip_range: float
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO/GRPO surrogate mean(max(-A r, -A clip(r, 1 - e, 1 + e))) with r = exp(logp - old_logp)."""
    ratio = torch.exp(logp_B - old_logp_B)
    unclipped = -adv_B * ratio
    clipped = -adv_B * torch.clamp(ratio, 1 - clip_range, 1 + clip_range)
    loss = torch.maximum(unclipped, clipped).mean()
    with torch.no_grad():
        stats = {
            "clip_frac": (torch.abs(ratio - 1) > clip_range).float().mean().item(),
            "approx_kl_old": (0.5 * (logp_B - old_logp_B) ** 2).mean().item(),
        }
    return loss, stats


def gaussian_mean_kl(mean_B: torch.Tensor, ref_mean_B: torch.Tensor, std_B: torch.Tensor) -> torch.Tensor:
    """(B,) KL between two Gaussian steps of equal std: ||mu - mu_ref||^2 / (2 std^2), averaged per sample."""
    per_elem = (mean_B - ref_mean_B) ** 2 / (2 * std_B**2)
    return per_elem.mean(dim=tuple(range(1, mean_B.ndim)))


def nft_loss(
    velocity: torch.Tensor,
    old_velocity: torch.Tensor,
    target: torch.Tensor,
    optimality_B: torch.Tensor,
    beta: float,
    *,
    sigma_B: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """DiffusionNFT's negative-aware flow-matching loss (Zheng et al. 2025, arXiv 2509.16117, Eq. 8).

    With the implicit positive and negative policies v+ = (1 - beta) v_old + beta v and
    v- = (1 + beta) v_old - beta v, the per-sample loss is r ||v+ - target||^2 + (1 - r) ||v- - target||^2
    (squared errors averaged over non-batch dimensions), averaged over the batch. At v = v_old its
    gradient in v is 2 beta (2 r - 1) (v_old - target) / D per sample: advantage-weighted flow
    matching, with r = 1/2 (an average sample) contributing nothing.

    With `sigma_B` (the noise level of each sample) the errors get DiffusionNFT's adaptive
    weighting instead: each is measured in x0 space, where the prediction x0 = x_s - s v misses
    by s (target - v), and divided by its own mean absolute value (no gradient through the
    divisor). Per sample that is s ||v± - target||^2 / mean|v± - target|: every sample's term has
    the scale of s times its error, so high noise levels, where the layout of an image is
    decided, weigh more, and no sample dominates by the size of its error.

    Args:
        velocity: (B, ...) v of the weights being trained.
        old_velocity: (B, ...) v_old of the weights that sampled the data (no gradient).
        target: (B, ...) flow-matching target eps - x0 of the re-noised clean sample.
        optimality_B: (B,) r in [0, 1].
        beta: implicit policy step size (> 0).
        sigma_B: (B,) noise levels s for the adaptive weighting; None: plain squared errors.
    """
    v_old = old_velocity.detach()
    dims = tuple(range(1, velocity.ndim))

    def err(v_implicit: torch.Tensor) -> torch.Tensor:
        diff = v_implicit - target
        sq = diff.square().mean(dim=dims)
        if sigma_B is None:
            return sq
        scale = diff.detach().abs().mean(dim=dims).clamp_min(1e-5)
        return sigma_B.to(sq.dtype) * sq / scale

    pos_err = err((1 - beta) * v_old + beta * velocity)
    neg_err = err((1 + beta) * v_old - beta * velocity)
    loss = (optimality_B * pos_err + (1 - optimality_B) * neg_err).mean()
    return loss, {"nft_pos_err": pos_err.mean().item(), "nft_neg_err": neg_err.mean().item()}


def nft_optimality(adv_B: torch.Tensor, adv_max: float) -> torch.Tensor:
    """DiffusionNFT's optimality probability r = 0.5 + 0.5 clip(A / adv_max, -1, 1)."""
    return 0.5 + 0.5 * (adv_B / adv_max).clamp(-1, 1)


def nft_level_indices(
    num_levels: int, shape: tuple[int, ...], sampling: str, generator: torch.Generator
) -> torch.Tensor:
    """Indices into a schedule of `num_levels` noise levels, of shape `shape` (..., K): K per group.

    Both ways every index is marginally uniform, so the loss estimate has the same expectation.
    uniform: independent draws. stratified: a group's k-th draw is floor(N u_k) with u_k uniform
    on [k/K, (k+1)/K), so its K levels spread over the whole schedule and repeat only where one
    level straddles two parts (stratified sampling of the diffusion time, like the low-discrepancy
    sampler of Kingma et al. 2021, arXiv 2107.00630: the same expectation, less variance).
    """
    if sampling == "uniform":
        return torch.randint(num_levels, shape, generator=generator)
    if sampling != "stratified":
        raise ValueError(f"unknown noise-level sampling {sampling!r}: expected 'uniform' or 'stratified'")
    K = shape[-1]
    u = (torch.arange(K) + torch.rand(shape, generator=generator, dtype=torch.float64)) / K
    return (u * num_levels).long().clamp(max=num_levels - 1)
