"""GRPO for tokens (pure functions on tensors).

Shape legend: P prompts, G responses per prompt, B = P * G responses, T response tokens.

References:
- Shao et al. 2024, DeepSeekMath (arXiv 2402.03300), Eq. 3: the GRPO objective, a PPO clipped
  surrogate (Schulman et al. 2017, arXiv 1707.06347, Eq. 7) per token with group-relative
  advantages, averaged per sequence then over sequences, minus beta * KL to the reference.
- Schulman 2020, "Approximating KL Divergence" (joschu.net/blog/kl-approx.html): the k3 estimator
  r - 1 - log r with r = pi_ref / pi, unbiased for KL(pi || pi_ref) under samples of pi,
  never negative, low variance; GRPO uses it per token (DeepSeekMath Eq. 4).
- Yu et al. 2025, DAPO (arXiv 2503.14476), Eq. 10 ("clip-higher"): an upper clip bound
  1 + eps_high above the lower 1 - eps_low, so unlikely tokens with a positive advantage can
  gain more probability per step, which keeps the policy's entropy from collapsing.
- DAPO Eq. 8: token-level aggregation (every token of the batch weighs the same), against
  GRPO's per-sequence mean, which lets a long response's tokens weigh less than a short one's.

Group advantages are the core's `spotlight.core.advantages.group_advantages` (the same math: one
scalar per response, broadcast to its tokens here).
"""

from __future__ import annotations

from typing import Literal

import torch

from spotlight.core.advantages import Advantages, group_advantages

__all__ = ["Advantages", "aggregate", "clipped_surrogate", "group_advantages", "grpo_token_loss", "k3_kl"]

Aggregation = Literal["token", "sequence"]


def aggregate(
    values_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    mode: Aggregation,
    *,
    num_sequences: int | None = None,
    num_tokens: float | None = None,
) -> torch.Tensor:
    """Reduce per-token values to a scalar over the masked tokens.

    Args:
        values_BT: (B, T) per-token values.
        mask_BT: (B, T) 1 for response tokens.
        mode: "token": sum / number of tokens (DAPO); "sequence": mean over sequences of each
            sequence's token mean (GRPO).
        num_sequences: for "sequence", the divisor instead of B (a micro-batch of a larger
            minibatch divides by the minibatch's sequence count, so the micro-batch losses add up).
        num_tokens: for "token", the divisor instead of mask_BT.sum() (likewise).
    """
    mask_BT = mask_BT.to(values_BT.dtype)
    if mode == "token":
        denom = mask_BT.sum() if num_tokens is None else num_tokens
        return (values_BT * mask_BT).sum() / max(float(denom), 1.0)
    if mode == "sequence":
        per_seq_B = (values_BT * mask_BT).sum(dim=1) / mask_BT.sum(dim=1).clamp_min(1.0)
        return per_seq_B.sum() / (values_BT.shape[0] if num_sequences is None else num_sequences)
    raise ValueError(f"loss aggregation must be 'token' or 'sequence', got {mode!r}")


def k3_kl(logp_BT: torch.Tensor, ref_logp_BT: torch.Tensor) -> torch.Tensor:
    """(B, T) per-token k3 estimate of KL(pi || pi_ref): exp(d) - d - 1 with d = ref_logp - logp.

    Non-negative (e^d >= 1 + d), zero exactly where the log-probs agree, and unbiased for the KL
    when the tokens were sampled from pi (Schulman 2020).
    """
    d_BT = ref_logp_BT - logp_BT
    return torch.exp(d_BT) - d_BT - 1.0


def clipped_surrogate(
    logp_BT: torch.Tensor,
    old_logp_BT: torch.Tensor,
    adv_B: torch.Tensor,
    clip_range: float,
    clip_range_high: float | None = None,
) -> torch.Tensor:
    """(B, T) PPO per-token loss max(-A r, -A clip(r, 1 - eps, 1 + eps_high)), r = exp(logp - old_logp).

    At r = 1 its gradient in logp is -A: the policy gradient with advantage A. `clip_range_high`
    None is PPO's symmetric range (eps_high = eps); larger is DAPO's clip-higher.
    """
    ratio_BT = torch.exp(logp_BT - old_logp_BT)
    adv_B1 = adv_B.unsqueeze(1)
    high = clip_range if clip_range_high is None else clip_range_high
    return torch.maximum(-adv_B1 * ratio_BT, -adv_B1 * ratio_BT.clamp(1.0 - clip_range, 1.0 + high))


def grpo_token_loss(
    logp_BT: torch.Tensor,
    old_logp_BT: torch.Tensor,
    ref_logp_BT: torch.Tensor | None,
    adv_B: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    clip_range: float,
    beta: float,
    agg: Aggregation,
    clip_range_high: float | None = None,
    num_sequences: int | None = None,
    num_tokens: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The GRPO loss of a batch of responses: aggregate(surrogate + beta * k3).

    Args:
        logp_BT: (B, T) log-probs under the weights being trained (with gradient).
        old_logp_BT: (B, T) log-probs under the weights that sampled (no gradient).
        ref_logp_BT: (B, T) log-probs under the reference, or None when beta is 0.
        adv_B: (B,) advantage of each response.
        mask_BT: (B, T) 1 for response tokens.
        clip_range: PPO epsilon (the lower bound 1 - eps; also the upper one unless clip_range_high).
        clip_range_high: DAPO's upper epsilon (ratio clipped at 1 + clip_range_high); None: clip_range.
        beta: KL weight.
        agg: "token" or "sequence" (see `aggregate`).
        num_sequences, num_tokens: divisors of the whole minibatch (see `aggregate`).

    Returns:
        The loss and float statistics (clip fraction, KL to the reference, ratio).
    """
    old_logp_BT = old_logp_BT.detach()
    per_token_BT = clipped_surrogate(logp_BT, old_logp_BT, adv_B, clip_range, clip_range_high)
    kl_BT = None
    if beta > 0:
        assert ref_logp_BT is not None, "beta > 0 needs reference log-probs"
        kl_BT = k3_kl(logp_BT, ref_logp_BT.detach())
        per_token_BT = per_token_BT + beta * kl_BT
    loss = aggregate(per_token_BT, mask_BT, agg, num_sequences=num_sequences, num_tokens=num_tokens)
    with torch.no_grad():
        high = clip_range if clip_range_high is None else clip_range_high
        m = mask_BT.bool()
        ratio = torch.exp(logp_BT - old_logp_BT)[m]
        stats = {
            "clip_frac": ((ratio < 1 - clip_range) | (ratio > 1 + high)).float().mean().item() if m.any() else 0.0,
            "ratio_mean": ratio.mean().item() if m.any() else 1.0,
            "kl_ref": kl_BT[m].mean().item() if kl_BT is not None and m.any() else 0.0,
        }
    return loss, stats
