"""Flow-matching sampling for Qwen-Image with per-step log-probabilities (pure functions).

Shape legend: B batch, L image tokens, C packed channels per token, N denoising steps.

Everything here is a plain function of tensors: no scheduler object counts steps behind the
caller's back (diffusers' `FlowMatchEulerDiscreteScheduler` does, and returns no log-prob), so the
rollout, the training recompute and a resumed trajectory all call the same `sde_step`.

Seeds fix whole trajectories: the initial noise and the noise of every SDE step of sample i are a
pure function of (seed_i, step), drawn from a generator of its own (counter-based, like JAX's
`fold_in`). A sample is therefore identical alone or in any batch, and a trajectory interrupted at
step k resumes from (latent_k, seed, k) with no RNG state beyond the seed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from spotlight.core.seeds import derive_seed

_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


@dataclass
class SDEStepOutput:
    """Result of one denoising step; every tensor is float32."""

    prev_sample: torch.Tensor
    """(B, ...) the sample at sigma_next."""
    log_prob: torch.Tensor
    """(B,) log-density of prev_sample, averaged over non-batch dimensions (0 for an ODE step)."""
    mean: torch.Tensor
    """(B, ...) mean of the Gaussian transition."""
    std: torch.Tensor
    """(B, 1, ...) standard deviation of the transition, broadcastable to the sample."""


def _per_sample(value: float | torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A float or a (B,) tensor as float32 of shape (B, 1, ..., 1) broadcastable to `like`."""
    t = torch.as_tensor(value, dtype=torch.float32, device=like.device)
    if t.ndim == 0:
        t = t.expand(like.shape[0])
    return t.reshape(-1, *([1] * (like.ndim - 1)))


def sde_step(
    velocity: torch.Tensor,
    sample: torch.Tensor,
    sigma: float | torch.Tensor,
    sigma_next: float | torch.Tensor,
    noise_level: float,
    *,
    noise: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    prev_sample: torch.Tensor | None = None,
) -> SDEStepOutput:
    """One Flow-GRPO SDE step from sigma to sigma_next (Liu et al. 2025, "Flow-GRPO", Eq. 9-10).

    With dt = sigma_next - sigma (< 0) and std_t = a * sqrt(sigma / (1 - sigma)):
        mean = x + dt * [v + std_t^2 / (2 sigma) * (x + (1 - sigma) v)]
        x'   = mean + std_t * sqrt(-dt) * eps
    At sigma = 1 the denominator uses sigma_next instead (it would be zero). `noise_level = 0` is
    the plain Euler ODE step x' = x + dt * v, whose log-prob is reported as 0.

    Args:
        velocity: (B, ...) model output v.
        sample: (B, ...) current sample x at sigma.
        sigma: float or (B,) current noise level.
        sigma_next: float or (B,) next noise level (smaller).
        noise_level: a, the SDE noise scale.
        noise: (B, ...) standard normal noise to use instead of drawing it.
        generator: generator for drawing the noise when `noise` is not given.
        prev_sample: (B, ...) an existing next sample whose log-prob is wanted (training recompute).

    Returns:
        SDEStepOutput with float32 prev_sample, log_prob (B,), mean and std.
    """
    x = sample.float()
    v = velocity.float()
    s = _per_sample(sigma, x)
    s_next = _per_sample(sigma_next, x)
    dt = s_next - s
    if noise_level == 0:
        mean = x + dt * v
        zeros = torch.zeros(x.shape[0], dtype=torch.float32, device=x.device)
        out = mean if prev_sample is None else prev_sample.float()
        return SDEStepOutput(out, zeros, mean, torch.zeros_like(s))

    denom = torch.where(s == 1.0, s_next, s)
    std_t = noise_level * torch.sqrt(s / (1 - denom))
    mean = x + dt * (v + std_t**2 / (2 * s) * (x + (1 - s) * v))
    return _gaussian_transition(mean, std_t * torch.sqrt(-dt), noise, generator, prev_sample)


def _gaussian_transition(
    mean: torch.Tensor,
    std: torch.Tensor,
    noise: torch.Tensor | None,
    generator: torch.Generator | None,
    prev_sample: torch.Tensor | None,
) -> SDEStepOutput:
    """Draws (or takes) the next sample of N(mean, std^2) and its log-density averaged per sample."""
    if prev_sample is None:
        if noise is None:
            noise = torch.randn(mean.shape, generator=generator, dtype=torch.float32, device=mean.device)
        prev_sample = mean + std * noise.float()
    prev_sample = prev_sample.float()
    log_density = -((prev_sample.detach() - mean) ** 2) / (2 * std**2) - torch.log(std) - _LOG_SQRT_2PI
    log_prob = log_density.mean(dim=tuple(range(1, mean.ndim)))
    return SDEStepOutput(prev_sample, log_prob, mean, std)


def cps_step(
    velocity: torch.Tensor,
    sample: torch.Tensor,
    sigma: float | torch.Tensor,
    sigma_next: float | torch.Tensor,
    eta: float,
    *,
    noise: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    prev_sample: torch.Tensor | None = None,
) -> SDEStepOutput:
    """One coefficient-preserving stochastic step (Wang et al. 2025, "Coefficients-Preserving
    Sampling for Reinforcement Learning with Flow Matching", arXiv 2509.05952, Eq. 8).

    The flow's state is x = (1 - sigma) x0 + sigma eps. The step predicts x0_hat = x - sigma v and
    eps_hat = x + (1 - sigma) v, then re-mixes them at sigma_next, replacing a fraction eta of the
    predicted noise by fresh noise so that the noise coefficient stays exactly sigma_next:
        mean = (1 - sigma_next) x0_hat + sigma_next sqrt(1 - eta^2) eps_hat
        x'   = mean + sigma_next eta eps
    Unlike the Flow-GRPO step, the total noise never exceeds what the schedule prescribes (that
    step's std near sigma = 1 overshoots the marginal at few steps; docs/tiny-recipe-notes.md).
    At sigma_next = 0 the step is deterministic; it cannot be a stochastic (trained) step.
    `eta = 0` is exactly the Euler ODE step, reported with log-prob 0.

    Args:
        velocity: (B, ...) model output v.
        sample: (B, ...) current sample x at sigma.
        sigma: float or (B,) current noise level.
        sigma_next: float or (B,) next noise level (smaller, > 0 when eta > 0).
        eta: fraction of fresh noise, in [0, 1].
        noise: (B, ...) standard normal noise to use instead of drawing it.
        generator: generator for drawing the noise when `noise` is not given.
        prev_sample: (B, ...) an existing next sample whose log-prob is wanted (training recompute).

    Returns:
        SDEStepOutput with float32 prev_sample, log_prob (B,), mean and std.
    """
    if not 0 <= eta <= 1:
        raise ValueError(f"the CPS step's eta (sample.noise_level) must be in [0, 1], got {eta}")
    if eta == 0:
        return sde_step(velocity, sample, sigma, sigma_next, 0.0, prev_sample=prev_sample)
    x = sample.float()
    v = velocity.float()
    s = _per_sample(sigma, x)
    s_next = _per_sample(sigma_next, x)
    if bool((s_next <= 0).any()):
        raise ValueError("a CPS step to sigma_next = 0 is deterministic and cannot be stochastic")
    x0_hat = x - s * v
    eps_hat = x + (1 - s) * v
    mean = (1 - s_next) * x0_hat + s_next * math.sqrt(1 - eta**2) * eps_hat
    return _gaussian_transition(mean, s_next * eta, noise, generator, prev_sample)


SDE_TYPES = ("flow_grpo", "cps")
"""Stochastic step kinds: `sde_step` (Flow-GRPO) and `cps_step` (coefficient-preserving)."""


def stochastic_step(sde_type: str, *args, **kwargs) -> SDEStepOutput:
    """Dispatches to `sde_step` ("flow_grpo") or `cps_step` ("cps") with the same arguments."""
    if sde_type == "flow_grpo":
        return sde_step(*args, **kwargs)
    if sde_type == "cps":
        return cps_step(*args, **kwargs)
    raise ValueError(f"unknown sde_type {sde_type!r}; choose one of {', '.join(SDE_TYPES)}")


def calculate_shift(
    image_seq_len: int,
    base_seq_len: int = 256,
    max_seq_len: int = 8192,
    base_shift: float = 0.5,
    max_shift: float = 0.9,
) -> float:
    """mu of the dynamic time shift: linear in the image token count (as Qwen-Image's pipeline)."""
    slope = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    return image_seq_len * slope + base_shift - slope * base_seq_len


def qwen_image_sigmas(num_steps: int, image_seq_len: int, *, shift_terminal: float = 0.02) -> torch.Tensor:
    """The num_steps + 1 sigmas (last 0) of Qwen-Image's scheduler for this image size.

    linspace(1, 1/N, N), exponential time shift exp(mu) / (exp(mu) + (1/t - 1)) with mu from
    `calculate_shift`, then stretched so the last non-zero sigma equals `shift_terminal`; computed
    in float32 like diffusers' `FlowMatchEulerDiscreteScheduler` configured as Qwen-Image's.
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    t = np.linspace(1.0, 1.0 / num_steps, num_steps).astype(np.float32)
    mu = calculate_shift(image_seq_len)
    shifted = math.exp(mu) / (math.exp(mu) + (1 / t - 1) ** 1.0)
    if shift_terminal and num_steps > 1:  # one step has no last non-zero sigma to stretch
        one_minus = 1 - shifted
        shifted = 1 - one_minus / (one_minus[-1] / (1 - shift_terminal))
    sigmas = torch.from_numpy(np.asarray(shifted)).to(torch.float32)
    return torch.cat([sigmas, torch.zeros(1)])


# ---------------------------------------------------------------------------------------------
# Trajectory-fixing seeds
# ---------------------------------------------------------------------------------------------

INITIAL_NOISE_STEP = -1
"""Step index whose noise is the initial latent."""


def seeded_noise(
    seeds: Sequence[int], step: int, shape: Sequence[int], device: torch.device | str = "cpu"
) -> torch.Tensor:
    """(B, *shape) standard normal noise: row i depends only on (seeds[i], step)."""
    gen = torch.Generator(device="cpu")
    rows = []
    for seed in seeds:
        gen.manual_seed(derive_seed(seed, step))
        rows.append(torch.randn(tuple(shape), generator=gen))
    return torch.stack(rows).to(device)


# ---------------------------------------------------------------------------------------------
# Sampling loop
# ---------------------------------------------------------------------------------------------

VelocityFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""(latents (B, L, C), sigma (B,)) -> velocity (B, L, C)."""


@dataclass
class Trajectory:
    """A batch of sampled trajectories."""

    latents: torch.Tensor
    """(N + 1, B, L, C) the sample before each step and the final sample (float32)."""
    log_probs: torch.Tensor
    """(N, B) log-prob of each step's transition under the sampling weights (0 on ODE steps)."""
    sigmas: torch.Tensor
    """(N + 1,) the schedule."""
    sde_steps: list[int]
    """Indices of the stochastic steps (the ones GRPO trains on)."""

    @property
    def final(self) -> torch.Tensor:
        return self.latents[-1]


def sde_step_indices(num_steps: int, window_size: int, window_start: int) -> list[int]:
    """Stochastic steps: all when window_size is 0, else [start, start + size) (MixGRPO-style window)."""
    if window_size <= 0:
        return list(range(num_steps))
    if not 0 <= window_start <= num_steps - window_size:
        raise ValueError(f"SDE window [{window_start}, {window_start + window_size}) does not fit {num_steps} steps")
    return list(range(window_start, window_start + window_size))


def cfg_combine(cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
    """Qwen-Image true CFG: uncond + s (cond - uncond), rescaled per token to the norm of cond."""
    comb = uncond + scale * (cond - uncond)
    cond_norm = torch.linalg.vector_norm(cond, dim=-1, keepdim=True)
    comb_norm = torch.linalg.vector_norm(comb, dim=-1, keepdim=True)
    return comb * (cond_norm / comb_norm.clamp_min(1e-12))


@torch.no_grad()
def sample(
    velocity_fn: VelocityFn,
    seeds: Sequence[int],
    latent_shape: Sequence[int],
    sigmas: torch.Tensor,
    *,
    noise_level: float,
    sde_steps: Sequence[int] | None = None,
    sde_type: str = "flow_grpo",
    start_step: int = 0,
    start_latents: torch.Tensor | None = None,
    device: torch.device | str = "cpu",
) -> Trajectory:
    """Sample trajectories whose every random draw is fixed by the per-sample seeds.

    Args:
        velocity_fn: (latents (B, L, C), sigma (B,)) -> velocity (B, L, C).
        seeds: B seeds, one per sample.
        latent_shape: (L, C) of one packed latent.
        sigmas: (N + 1,) schedule from `qwen_image_sigmas`.
        noise_level: SDE noise scale a on stochastic steps.
        sde_steps: stochastic step indices (default: all); the others are ODE steps.
        sde_type: "flow_grpo" (`sde_step`) or "cps" (`cps_step`) for the stochastic steps.
        start_step: resume a trajectory at this step (with `start_latents`).
        start_latents: (B, L, C) latents at `start_step`; default: seeded initial noise.
        device: device of the latents.

    Returns:
        Trajectory from start_step (latents has N + 1 - start_step entries).
    """
    num_steps = len(sigmas) - 1
    stochastic = set(range(num_steps) if sde_steps is None else sde_steps)
    x = start_latents
    if x is None:
        x = seeded_noise(seeds, INITIAL_NOISE_STEP, latent_shape, device)
    x = x.float()
    batch = len(seeds)
    latents = [x]
    log_probs = []
    for i in range(start_step, num_steps):
        sigma_B = sigmas[i].expand(batch).to(device)
        v = velocity_fn(x, sigma_B)
        if i in stochastic:
            eps = seeded_noise(seeds, i, latent_shape, device)
            out = stochastic_step(sde_type, v, x, sigmas[i], sigmas[i + 1], noise_level, noise=eps)
        else:
            out = sde_step(v, x, sigmas[i], sigmas[i + 1], 0.0)
        x = out.prev_sample
        latents.append(x)
        log_probs.append(out.log_prob)
    return Trajectory(
        latents=torch.stack(latents),
        log_probs=torch.stack(log_probs) if log_probs else torch.zeros(0, batch),
        sigmas=sigmas,
        sde_steps=sorted(s for s in stochastic if s >= start_step),
    )
