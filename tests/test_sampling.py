"""The pure sampler: the Flow-GRPO SDE step, Qwen-Image's schedule, trajectory-fixing seeds."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from spotlight.sampling import (
    calculate_shift,
    cfg_combine,
    cps_step,
    qwen_image_sigmas,
    sample,
    sde_step,
    sde_step_indices,
    seeded_noise,
)


def _reference_step(v, x, sigma, sigma_next, a, x_next):
    """Independent float64 evaluation of the Flow-GRPO SDE sampler, Liu et al. 2025, written from the formulas."""
    v, x, x_next = (np.asarray(t, dtype=np.float64) for t in (v, x, x_next))
    dt = sigma_next - sigma
    denom_sigma = sigma_next if sigma == 1.0 else sigma
    std_t = a * math.sqrt(sigma / (1.0 - denom_sigma))
    mean = x + dt * (v + std_t**2 / (2 * sigma) * (x + (1 - sigma) * v))
    std = std_t * math.sqrt(-dt)
    logp = -((x_next - mean) ** 2) / (2 * std**2) - math.log(std) - 0.5 * math.log(2 * math.pi)
    return mean, std, logp.reshape(logp.shape[0], -1).mean(axis=1)


@pytest.mark.parametrize("sigma,sigma_next", [(1.0, 0.93), (0.7, 0.55), (0.3, 0.0)])
def test_sde_step_matches_formula_and_gaussian_density(sigma, sigma_next):
    gen = torch.Generator().manual_seed(0)
    v, x, eps = (torch.randn(3, 5, 6, generator=gen) for _ in range(3))
    out = sde_step(v, x, sigma, sigma_next, 1.2, noise=eps)
    mean, std, logp = _reference_step(v, x, sigma, sigma_next, 1.2, out.prev_sample)
    np.testing.assert_allclose(out.mean.numpy(), mean, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out.std.flatten().numpy(), std, rtol=1e-6)
    np.testing.assert_allclose(out.prev_sample.numpy(), mean + std * eps.double().numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out.log_prob.numpy(), logp, rtol=1e-5, atol=1e-5)
    # And against torch's own Gaussian density.
    normal = torch.distributions.Normal(out.mean.double(), out.std.double())
    expected = normal.log_prob(out.prev_sample.double()).mean(dim=(1, 2))
    torch.testing.assert_close(out.log_prob.double(), expected, rtol=1e-5, atol=1e-5)
    assert out.log_prob.dtype == torch.float32 and out.log_prob.shape == (3,)


def test_prev_sample_recompute_and_generator():
    v, x = torch.randn(2, 4, 3), torch.randn(2, 4, 3)
    drawn = sde_step(v, x, 0.8, 0.6, 0.9, generator=torch.Generator().manual_seed(3))
    again = sde_step(v, x, 0.8, 0.6, 0.9, generator=torch.Generator().manual_seed(3))
    assert torch.equal(drawn.prev_sample, again.prev_sample)
    recomputed = sde_step(v, x, 0.8, 0.6, 0.9, prev_sample=drawn.prev_sample)
    torch.testing.assert_close(recomputed.log_prob, drawn.log_prob)
    # A sample far from the mean is less likely.
    far = sde_step(v, x, 0.8, 0.6, 0.9, prev_sample=drawn.prev_sample + 1.0)
    assert (far.log_prob < drawn.log_prob).all()


def test_tensor_sigmas_match_per_sample_floats():
    v, x, eps = torch.randn(3, 4, 2), torch.randn(3, 4, 2), torch.randn(3, 4, 2)
    sig, sig_next = torch.tensor([1.0, 0.5, 0.2]), torch.tensor([0.9, 0.4, 0.0])
    batched = sde_step(v, x, sig, sig_next, 1.0, noise=eps)
    for i in range(3):
        single = sde_step(v[i : i + 1], x[i : i + 1], float(sig[i]), float(sig_next[i]), 1.0, noise=eps[i : i + 1])
        torch.testing.assert_close(batched.prev_sample[i : i + 1], single.prev_sample)
        torch.testing.assert_close(batched.log_prob[i : i + 1], single.log_prob)


def test_noise_level_zero_is_euler():
    v, x = torch.randn(2, 3, 4), torch.randn(2, 3, 4)
    out = sde_step(v, x, 0.6, 0.4, 0.0)
    torch.testing.assert_close(out.prev_sample, x + (0.4 - 0.6) * v)
    assert torch.equal(out.log_prob, torch.zeros(2))


@pytest.mark.parametrize("num_steps,seq_len", [(10, 64), (28, 1024), (4, 4096), (2, 256)])
def test_sigmas_match_diffusers_qwen_image_scheduler(num_steps, seq_len):
    from diffusers import FlowMatchEulerDiscreteScheduler

    # Qwen-Image's scheduler_config.json.
    scheduler = FlowMatchEulerDiscreteScheduler(
        base_image_seq_len=256,
        base_shift=0.5,
        max_image_seq_len=8192,
        max_shift=0.9,
        num_train_timesteps=1000,
        shift=1.0,
        shift_terminal=0.02,
        time_shift_type="exponential",
        use_dynamic_shifting=True,
    )
    # QwenImagePipeline: sigmas = linspace(1, 1/N, N), mu from its own calculate_shift defaults.
    sigmas_in = np.linspace(1.0, 1 / num_steps, num_steps)
    scheduler.set_timesteps(sigmas=sigmas_in, mu=calculate_shift(seq_len))
    ours = qwen_image_sigmas(num_steps, seq_len)
    assert ours.shape == (num_steps + 1,) and ours[-1] == 0
    torch.testing.assert_close(ours, scheduler.sigmas.float(), rtol=0, atol=1e-6)


def test_single_step_schedule():
    # diffusers divides 0 by 0 here (NaN); one step is a single jump from pure noise to 0.
    torch.testing.assert_close(qwen_image_sigmas(1, 256), torch.tensor([1.0, 0.0]))


def test_seeded_noise_depends_only_on_seed_and_step():
    a = seeded_noise([5, 6, 7], 2, (4, 3))
    b = seeded_noise([7, 5], 2, (4, 3))
    assert torch.equal(a[2], b[0]) and torch.equal(a[0], b[1])
    assert not torch.equal(seeded_noise([5], 3, (4, 3))[0], a[0])


def _velocity_fn(policy, prompts):
    embeds, mask = policy.encode_prompts(prompts)
    return lambda x, s: policy.velocity(x, s, embeds, mask)


def test_seed_fixes_trajectory_across_batch_compositions(tiny_policy):
    prompts = ["two red circles", "one blue square and three green triangles", "four yellow squares"]
    sigmas = qwen_image_sigmas(6, tiny_policy.latent_shape[0])
    full = sample(_velocity_fn(tiny_policy, prompts), [11, 22, 33], tiny_policy.latent_shape, sigmas, noise_level=1.2)
    alone = sample(_velocity_fn(tiny_policy, prompts[1:2]), [22], tiny_policy.latent_shape, sigmas, noise_level=1.2)
    other = sample(
        _velocity_fn(tiny_policy, [prompts[2], "one red circle", prompts[1]]),
        [33, 99, 22],
        tiny_policy.latent_shape,
        sigmas,
        noise_level=1.2,
    )
    torch.testing.assert_close(alone.latents[:, 0], full.latents[:, 1], rtol=0, atol=1e-5)
    torch.testing.assert_close(other.latents[:, 2], full.latents[:, 1], rtol=0, atol=1e-5)
    torch.testing.assert_close(other.log_probs[:, 0], full.log_probs[:, 2], rtol=0, atol=1e-4)
    # Different seeds give different images.
    assert (full.final[0] - full.final[2]).abs().mean() > 1e-3


def test_prompt_padding_length_does_not_change_the_velocity(tiny_policy):
    """model.max_text_tokens only sets the fixed padding: the masked pad tokens change nothing
    (so the recipe pads to the grammar's longest prompt, not more)."""
    prompts = ["one red circle", "three yellow triangles and four green squares"]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, *tiny_policy.latent_shape, generator=gen)
    sigma = torch.tensor([0.9, 0.3])
    out = {}
    for length in (16, 10):
        tiny_policy.max_text_tokens = length
        embeds, mask = tiny_policy.encode_prompts(prompts)
        assert embeds.shape[1] == length
        with torch.no_grad():
            out[length] = tiny_policy.velocity(x, sigma, embeds, mask)
    torch.testing.assert_close(out[10], out[16], rtol=0, atol=1e-4)
    tiny_policy.max_text_tokens = 9
    with pytest.raises(ValueError, match="more than model.max_text_tokens=9"):
        tiny_policy.encode_prompts(prompts)


def test_autocast_rollout_is_close_to_float32_and_batch_invariant(tiny_policy):
    from spotlight.rollout import rollout

    prompts = ["two red circles", "one blue square and three green triangles", "four yellow squares", "one red circle"]
    seeds = [11, 22, 33, 44]
    sigmas = qwen_image_sigmas(6, tiny_policy.latent_shape[0])
    full = rollout(tiny_policy, prompts, seeds, sigmas, noise_level=0.0, autocast="none")
    low = rollout(tiny_policy, prompts, seeds, sigmas, noise_level=0.0, autocast="bfloat16", batch_size=4)
    # The sampler's arithmetic and the images stay float32; only the transformer ran in bfloat16.
    assert low.trajectory.latents.dtype == torch.float32 and low.images.dtype == torch.float32
    err = (low.trajectory.final - full.trajectory.final).norm() / full.trajectory.final.norm()
    assert 1e-6 < err < 0.05, err  # it did run in bfloat16, and stayed close
    # A sample's trajectory does not depend on the batch it is sampled in, under autocast too.
    split = rollout(tiny_policy, prompts[::-1], seeds[::-1], sigmas, noise_level=0.0, autocast="bfloat16", batch_size=3)
    torch.testing.assert_close(split.trajectory.final.flip(0), low.trajectory.final, rtol=0, atol=1e-2)
    with pytest.raises(ValueError, match="autocast must be one of"):
        rollout(tiny_policy, prompts, seeds, sigmas, noise_level=0.0, autocast="int8")
    with pytest.raises(ValueError, match="must be resolved first"):
        rollout(tiny_policy, prompts, seeds, sigmas, noise_level=0.0, autocast="auto")


def test_auto_autocast_is_bfloat16_only_for_nft_on_fast_hardware():
    from spotlight.rollout import resolve_autocast

    fast = torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()
    assert resolve_autocast("auto", "cpu", "nft") == ("bfloat16" if fast else "none")
    # Flow-GRPO's ratio needs the rollout's log-probs computed as the update computes them.
    assert resolve_autocast("auto", "cpu", "flow_grpo") == "none"
    assert resolve_autocast("float16", "cpu", "nft") == "float16"
    assert resolve_autocast("none", "cpu", "nft") == "none"


def test_window_and_resume_from_step(tiny_policy):
    prompts = ["one red circle", "two blue squares"]
    fn = _velocity_fn(tiny_policy, prompts)
    sigmas = qwen_image_sigmas(8, tiny_policy.latent_shape[0])
    steps = sde_step_indices(8, 3, 2)
    assert steps == [2, 3, 4]
    traj = sample(fn, [1, 2], tiny_policy.latent_shape, sigmas, noise_level=1.0, sde_steps=steps)
    assert traj.sde_steps == steps
    nonzero = (traj.log_probs != 0).any(dim=1).nonzero().flatten().tolist()
    assert nonzero == steps
    resumed = sample(
        fn,
        [1, 2],
        tiny_policy.latent_shape,
        sigmas,
        noise_level=1.0,
        sde_steps=steps,
        start_step=4,
        start_latents=traj.latents[4],
    )
    torch.testing.assert_close(resumed.final, traj.final, rtol=0, atol=1e-6)
    torch.testing.assert_close(resumed.log_probs, traj.log_probs[4:], rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="does not fit"):
        sde_step_indices(8, 3, 6)


def test_cfg_combine_keeps_conditional_norm():
    cond, uncond = torch.randn(2, 5, 8), torch.randn(2, 5, 8)
    out = cfg_combine(cond, uncond, 4.0)
    torch.testing.assert_close(out.norm(dim=-1), cond.norm(dim=-1))
    direction = uncond + 4.0 * (cond - uncond)
    cos = torch.nn.functional.cosine_similarity(out, direction, dim=-1)
    torch.testing.assert_close(cos, torch.ones_like(cos))


@pytest.mark.parametrize("sigma,sigma_next,eta", [(1.0, 0.93, 1.0), (0.7, 0.55, 0.6), (0.3, 0.1, 0.3)])
def test_cps_step_matches_formula_and_gaussian_density(sigma, sigma_next, eta):
    gen = torch.Generator().manual_seed(1)
    v, x, eps = (torch.randn(3, 5, 6, generator=gen, dtype=torch.float64) for _ in range(3))
    out = cps_step(v, x, sigma, sigma_next, eta, noise=eps)
    # Independent float64 evaluation of Wang et al. 2025, Eq. 8, from the formula.
    x0_hat, eps_hat = x - sigma * v, x + (1 - sigma) * v
    mean = (1 - sigma_next) * x0_hat + sigma_next * math.sqrt(1 - eta**2) * eps_hat
    std = sigma_next * eta
    torch.testing.assert_close(out.mean.double(), mean, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.prev_sample.double(), mean + std * eps, rtol=1e-5, atol=1e-5)
    expected = torch.distributions.Normal(mean, std).log_prob(out.prev_sample.double()).mean(dim=(1, 2))
    torch.testing.assert_close(out.log_prob.double(), expected, rtol=1e-5, atol=1e-5)


def test_cps_step_preserves_the_noise_coefficient():
    """With the exact velocity of a known x0, the next sample is (1 - s') x0 + s' * (unit noise)."""
    gen = torch.Generator().manual_seed(2)
    x0, eps = torch.randn(4000, 8, generator=gen), torch.randn(4000, 8, generator=gen)
    sigma, sigma_next = 0.8, 0.5
    x = (1 - sigma) * x0 + sigma * eps
    out = cps_step(eps - x0, x, sigma, sigma_next, 0.7, generator=gen)
    residual = (out.prev_sample - (1 - sigma_next) * x0) / sigma_next
    assert abs(residual.std().item() - 1.0) < 0.01 and abs(residual.mean().item()) < 0.01
    # The Flow-GRPO step at these settings adds more than the schedule's noise.
    fg = sde_step(eps - x0, x, sigma, sigma_next, 1.2, generator=gen)
    assert ((fg.prev_sample - (1 - sigma_next) * x0) / sigma_next).std().item() > 1.05


def test_cps_step_edge_cases():
    v, x = torch.randn(2, 3, 4), torch.randn(2, 3, 4)
    euler = cps_step(v, x, 0.6, 0.4, 0.0)
    torch.testing.assert_close(euler.prev_sample, x + (0.4 - 0.6) * v)
    assert torch.equal(euler.log_prob, torch.zeros(2))
    with pytest.raises(ValueError, match="sigma_next = 0"):
        cps_step(v, x, 0.3, 0.0, 0.5)
    with pytest.raises(ValueError, match="eta"):
        cps_step(v, x, 0.6, 0.4, 1.5)
