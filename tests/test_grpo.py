"""GRPO math and the policy update on a tiny real Qwen-Image transformer."""

from __future__ import annotations

import math

import pytest
import torch

from spotlight.config import DiTRecipe
from spotlight.core.advantages import group_advantages
from spotlight.core.config_io import from_dict
from spotlight.grpo import clipped_policy_loss, gaussian_mean_kl
from spotlight.rollout import rollout
from spotlight.sampling import qwen_image_sigmas
from spotlight.update import GRPOTrainer


def test_batch_and_group_std_advantages():
    r = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 6.0]])
    batch = group_advantages(r, std_mode="batch", eps=0.0)
    std = r.std(unbiased=False)
    expected = torch.stack([r[0] - 2.0, r[1] - 2.0]) / std
    torch.testing.assert_close(batch.adv_PG, expected)
    group = group_advantages(r, std_mode="group", eps=0.0)
    torch.testing.assert_close(group.adv_PG[0], (r[0] - 2.0) / r[0].std(unbiased=False))
    assert group.trainable_PG.all()


def test_nan_rewards_are_dropped_and_flat_groups_filtered():
    r = torch.tensor([[1.0, float("nan"), 3.0], [0.5, 0.5, 0.5], [2.0, float("nan"), float("nan")]])
    adv = group_advantages(r, std_mode="group", eps=0.0)
    assert adv.num_dropped_samples == 3
    assert adv.num_zero_variance_groups == 2  # the flat group and the group left with one sample
    assert adv.trainable_PG.tolist() == [[True, False, True], [False, False, False], [False, False, False]]
    torch.testing.assert_close(adv.adv_PG[0], torch.tensor([-1.0, 0.0, 1.0]))
    assert not torch.isnan(adv.adv_PG).any()


def test_advantage_clamp():
    r = torch.tensor([[0.0] * 99 + [100.0]])
    adv = group_advantages(r, std_mode="group", clip=5.0)
    assert adv.adv_PG.max() == 5.0


def test_clipped_loss_value_and_clipping():
    adv = torch.tensor([1.0, -2.0])
    logp = torch.zeros(2, requires_grad=True)
    loss, stats = clipped_policy_loss(logp, torch.zeros(2), adv, 0.2)
    torch.testing.assert_close(loss, -adv.mean())
    assert stats["clip_frac"] == 0.0
    # Ratio far above 1 + eps with a positive advantage: clipped, no gradient.
    logp = torch.tensor([1.0], requires_grad=True)
    loss, stats = clipped_policy_loss(logp, torch.zeros(1), torch.tensor([1.0]), 0.2)
    loss.backward()
    assert stats["clip_frac"] == 1.0 and logp.grad.item() == 0.0
    torch.testing.assert_close(loss, torch.tensor(-1.2))


def test_gaussian_mean_kl():
    mean, ref, std = torch.ones(2, 3), torch.zeros(2, 3), torch.full((2, 1), 0.5)
    torch.testing.assert_close(gaussian_mean_kl(mean, ref, std), torch.full((2,), 1 / (2 * 0.25)))


def _cfg(tiny_model_dir, **train):
    cfg = DiTRecipe()
    cfg.model.path = str(tiny_model_dir)
    cfg.model.height = cfg.model.width = 32
    cfg.sample.num_steps = 4
    cfg.sample.noise_level = 1.2
    cfg.train.objective = "flow_grpo"
    cfg.train.minibatch_size = 4
    for k, v in train.items():
        setattr(cfg.train, k, v)
    return cfg


def _rollout_and_adv(policy, cfg):
    prompts = ["one red circle"] * 4 + ["two blue squares"] * 4
    sigmas = qwen_image_sigmas(cfg.sample.num_steps, policy.latent_shape[0])
    ro = rollout(policy, prompts, list(range(8)), sigmas, noise_level=1.2)
    rewards = torch.arange(8, dtype=torch.float32).view(2, 4) % 3
    return ro, group_advantages(rewards)


@pytest.mark.parametrize("lora_rank,beta", [(0, 0.0), (0, 0.1), (4, 0.1)])
def test_update_changes_trainable_parameters(tiny_model_dir, lora_rank, beta):
    from spotlight.policy import load_policy, trainable_state

    cfg = _cfg(tiny_model_dir, beta=beta)
    cfg.model.lora_rank = lora_rank
    policy = load_policy(cfg.model)
    trainer = GRPOTrainer(policy, cfg)
    before = {k: v.clone() for k, v in trainable_state(policy).items()}
    frozen_before = {k: v.clone() for k, v in policy.transformer.named_parameters() if not v.requires_grad}
    ro, adv = _rollout_and_adv(policy, cfg)
    stats = trainer.update(ro, adv, iteration=0)
    after = trainable_state(policy)
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert len(changed) >= len(before) // 2, f"only {len(changed)}/{len(before)} tensors changed"
    assert stats["num_trained_samples"] == 8 and math.isfinite(stats["loss"])
    if beta:
        assert stats["kl_ref"] >= 0.0
    for k, v in policy.transformer.named_parameters():
        if not v.requires_grad:
            assert torch.equal(v, frozen_before[k]), f"frozen {k} changed"
    if lora_rank:
        assert frozen_before, "LoRA must freeze the base weights"


def test_first_update_ratio_is_one(tiny_model_dir):
    """The recompute reproduces the rollout's log-probs: the on-policy ratio starts at exactly ~1."""
    from spotlight.policy import load_policy
    from spotlight.sampling import sde_step

    cfg = _cfg(tiny_model_dir)
    policy = load_policy(cfg.model)
    ro, _ = _rollout_and_adv(policy, cfg)
    traj = ro.trajectory
    embeds, mask = policy.encode_prompts(ro.prompts)
    for j in traj.sde_steps:
        with torch.no_grad():
            v = policy.velocity(traj.latents[j], traj.sigmas[j].expand(8), embeds, mask)
        out = sde_step(v, traj.latents[j], traj.sigmas[j], traj.sigmas[j + 1], 1.2, prev_sample=traj.latents[j + 1])
        torch.testing.assert_close(out.log_prob, traj.log_probs[j], rtol=0, atol=1e-4)


def test_nft_loss_gradient_is_advantage_weighted_flow_matching():
    """At v = v_old the NFT gradient is 2 beta (2 r - 1) (v_old - target) / D per sample (Eq. 8)."""
    from spotlight.grpo import nft_loss, nft_optimality

    gen = torch.Generator().manual_seed(0)
    v_old, target = torch.randn(3, 4, 5, generator=gen), torch.randn(3, 4, 5, generator=gen)
    r = nft_optimality(torch.tensor([2.0, 0.0, -0.5]), adv_max=1.0)
    torch.testing.assert_close(r, torch.tensor([1.0, 0.5, 0.25]))
    v = v_old.clone().requires_grad_(True)
    loss, _ = nft_loss(v, v_old, target, r, beta=0.7)
    loss.backward()
    expected = 2 * 0.7 * (2 * r - 1).view(3, 1, 1) * (v_old - target) / (4 * 5) / 3
    torch.testing.assert_close(v.grad, expected)
    # An average sample (r = 1/2) carries no gradient (up to rounding).
    torch.testing.assert_close(v.grad[1], torch.zeros(4, 5), rtol=0, atol=1e-8)
    # With r = 1 the loss is plain flow matching of the positive policy: zero when v+ hits the target.
    v_hit = v_old + (target - v_old) / 0.7
    loss_hit, _ = nft_loss(v_hit, v_old, target, torch.ones(3), beta=0.7)
    assert loss_hit.item() < 1e-10


def test_nft_adaptive_weighting_scales_each_sample_by_noise_level_over_its_error():
    """DiffusionNFT's adaptive weighting: at v = v_old the gradient per sample is
    2 beta s (2 r - 1) (v_old - target) / (D mean|v_old - target|), the divisor held constant."""
    from spotlight.grpo import nft_loss, nft_optimality

    gen = torch.Generator().manual_seed(1)
    v_old, target = torch.randn(3, 4, 5, generator=gen), torch.randn(3, 4, 5, generator=gen)
    target[2] *= 10  # a sample with a large error weighs as much as the others, not 100x
    r = nft_optimality(torch.tensor([2.0, -1.0, 1.5]), adv_max=2.0)
    sigma = torch.tensor([0.9, 0.2, 0.5])
    v = v_old.clone().requires_grad_(True)
    loss, _ = nft_loss(v, v_old, target, r, beta=0.7, sigma_B=sigma)
    loss.backward()
    scale = (v_old - target).abs().mean(dim=(1, 2)).view(3, 1, 1)
    expected = 2 * 0.7 * (sigma * (2 * r - 1)).view(3, 1, 1) * (v_old - target) / (scale * 4 * 5) / 3
    torch.testing.assert_close(v.grad, expected)
    # Per sample, the loss at v = v_old is s * mean((v_old - target)^2) / mean|v_old - target|.
    plain, _ = nft_loss(v_old, v_old, target, r, beta=0.7)
    weighted = (sigma * (v_old - target).square().mean(dim=(1, 2)) / scale.flatten()).mean()
    torch.testing.assert_close(loss, weighted)
    assert not torch.isclose(loss, plain)


@pytest.mark.parametrize(
    "beta,weighting,levels",
    [(0.0, "flow", "uniform"), (0.1, "flow", "uniform"), (0.0, "adaptive", "uniform"), (0.0, "flow", "stratified")],
)
def test_nft_update_on_ode_rollouts(tiny_model_dir, beta, weighting, levels):
    """The NFT objective trains on ODE samples (no log-probs) and moves the parameters."""
    from spotlight.policy import load_policy, trainable_state

    cfg = _cfg(
        tiny_model_dir,
        objective="nft",
        beta=beta,
        nft_num_timesteps=2,
        nft_weighting=weighting,
        nft_timestep_sampling=levels,
    )
    policy = load_policy(cfg.model)
    trainer = GRPOTrainer(policy, cfg)
    before = {k: v.clone() for k, v in trainable_state(policy).items()}
    prompts = ["one red circle"] * 4 + ["two blue squares"] * 4
    sigmas = qwen_image_sigmas(cfg.sample.num_steps, policy.latent_shape[0])
    ro = rollout(policy, prompts, list(range(8)), sigmas, noise_level=0.0)
    assert torch.equal(ro.trajectory.log_probs, torch.zeros_like(ro.trajectory.log_probs))
    adv = group_advantages(torch.arange(8, dtype=torch.float32).view(2, 4) % 3)
    stats = trainer.update(ro, adv, iteration=0)
    after = trainable_state(policy)
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert len(changed) >= len(before) // 2
    assert math.isfinite(stats["loss"]) and stats["num_trained_samples"] == 8
    assert ("kl_ref" in stats) == (beta > 0)


def test_stratified_noise_levels_span_the_schedule_with_uniform_marginals():
    """Stratified draws: the k-th of K levels lies in the k-th K-th of the schedule, every level is
    drawn as often as under independent draws, and a group's levels spread out (fewer repeats)."""
    from spotlight.grpo import nft_level_indices

    N, K = 10, 3
    strat = nft_level_indices(N, (4000, 16, K), "stratified", torch.Generator().manual_seed(0))
    iid = nft_level_indices(N, (4000, 16, K), "uniform", torch.Generator().manual_seed(0))
    for k in range(K):
        # floor(N u) with u in [k/K, (k+1)/K): indices floor(N k / K) .. ceil(N (k + 1) / K) - 1
        assert strat[..., k].min() == N * k // K and strat[..., k].max() == -(-N * (k + 1) // K) - 1
    for idx in (strat, iid):
        freq = torch.bincount(idx.flatten(), minlength=N).double() / idx.numel()
        assert torch.allclose(freq, torch.full((N,), 1 / N, dtype=torch.float64), atol=0.004)

    def repeats(idx):
        return (idx[..., :, None] == idx[..., None, :]).sum(dim=(-1, -2)).sub(K).gt(0).double().mean()

    assert repeats(strat) < 0.06 < 0.2 < repeats(iid)  # iid: 1 - 10*9*8/1000 = 0.28
    assert torch.equal(strat[:2], nft_level_indices(N, (2, 16, K), "stratified", torch.Generator().manual_seed(0)))
    with pytest.raises(ValueError, match="sobol"):
        nft_level_indices(N, (1, K), "sobol", torch.Generator())
    with pytest.raises(ValueError, match="nft_timestep_sampling"):
        from_dict(DiTRecipe, {"train": {"nft_timestep_sampling": "sobol"}})


def test_lora_init_follows_the_run_seed(tiny_model_dir):
    """The DiT adapter's initial weights are a function of train.seed (`spotlight.core.seeds.seeded_init`)."""
    from spotlight.config import ModelConfig
    from spotlight.policy import load_policy, trainable_state

    cfg = ModelConfig(path=str(tiny_model_dir), height=32, width=32, lora_rank=4)
    state = torch.random.get_rng_state()
    a, b, c = (trainable_state(load_policy(cfg, seed=s)) for s in (3, 3, 4))
    assert torch.equal(state, torch.random.get_rng_state())
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)


def _record_lrs(trainer: GRPOTrainer) -> list[float]:
    """The learning rate of every optimizer step `trainer` takes from now on."""
    seen: list[float] = []
    step = trainer.optimizer.step

    def recording_step(*args, **kwargs):
        seen.append(trainer.optimizer.param_groups[0]["lr"])
        return step(*args, **kwargs)

    trainer.optimizer.step = recording_step
    return seen


def test_lr_warmup_ramps_and_resumes_from_the_optimizer_state(tiny_model_dir):
    """train.lr_warmup_steps: step k (from 1) uses lr * min(1, k / W); a fresh trainer loading the
    optimizer state continues the ramp (the step count lives in that state)."""
    from spotlight.policy import load_policy

    cfg = _cfg(tiny_model_dir, lr=1e-3, lr_warmup_steps=3)  # minibatch 4 of 8 samples: 2 steps per update
    policy = load_policy(cfg.model)
    trainer = GRPOTrainer(policy, cfg)
    ro, adv = _rollout_and_adv(policy, cfg)
    seen = _record_lrs(trainer)
    trainer.update(ro, adv, iteration=0)
    assert seen == pytest.approx([1e-3 / 3, 2e-3 / 3])

    resumed = GRPOTrainer(policy, cfg)
    resumed.optimizer.load_state_dict(trainer.optimizer.state_dict())
    seen = _record_lrs(resumed)
    resumed.update(ro, adv, iteration=1)
    assert seen == pytest.approx([1e-3, 1e-3])  # steps 3 and 4: the ramp is over


def test_lr_warmup_must_not_be_negative():
    with pytest.raises(ValueError, match="train.lr_warmup_steps must be >= 0, got -1"):
        from_dict(DiTRecipe, {"train": {"lr_warmup_steps": -1}})


def test_adam_beta2_sets_the_second_moment_decay(tiny_model_dir):
    """train.adam_beta2: after the first optimizer step Adam's second moment is (1 - beta2) g^2."""
    from spotlight.policy import load_policy

    cfg = _cfg(tiny_model_dir, lr=1e-3, adam_beta2=0.9, minibatch_size=8)  # one optimizer step per update
    policy = load_policy(cfg.model)
    trainer = GRPOTrainer(policy, cfg)
    grads: dict[torch.nn.Parameter, torch.Tensor] = {}
    step = trainer.optimizer.step

    def recording_step(*args, **kwargs):
        grads.update((p, p.grad.detach().clone()) for p in trainer.params if p.grad is not None)
        return step(*args, **kwargs)

    trainer.optimizer.step = recording_step
    ro, adv = _rollout_and_adv(policy, cfg)
    trainer.update(ro, adv, iteration=0)
    assert len(grads) > len(trainer.params) // 2 and any(g.abs().sum() > 0 for g in grads.values())
    for p, g in grads.items():
        torch.testing.assert_close(
            trainer.optimizer.state[p]["exp_avg_sq"], 0.1 * g.square(), rtol=1e-5, atol=0
        )  # g^2 is tiny
    with pytest.raises(ValueError, match="train.adam_beta2 must be in \\(0, 1\\), got 1.0"):
        from_dict(DiTRecipe, {"train": {"adam_beta2": 1.0}})


def test_ema_follows_every_optimizer_step_and_swaps_in_for_evaluation(tiny_model_dir):
    """train.ema_decay=d: after each optimizer step, ema = d * ema + (1 - d) * weights, from the
    starting weights; `averaged_weights` runs with it in place and restores the trained weights."""
    from spotlight.policy import load_policy

    cfg = _cfg(tiny_model_dir, lr=1e-3, ema_decay=0.75)  # minibatch 4 of 8 samples: 2 steps per update
    policy = load_policy(cfg.model)
    trainer = GRPOTrainer(policy, cfg)
    start = [p.detach().clone() for p in trainer.params]
    after_steps: list[list[torch.Tensor]] = []
    step = trainer.optimizer.step

    def recording_step(*args, **kwargs):
        out = step(*args, **kwargs)
        after_steps.append([p.detach().clone() for p in trainer.params])
        return out

    trainer.optimizer.step = recording_step
    ro, adv = _rollout_and_adv(policy, cfg)
    trainer.update(ro, adv, iteration=0)
    assert len(after_steps) == 2
    expected = [0.75 * (0.75 * w0 + 0.25 * w1) + 0.25 * w2 for w0, w1, w2 in zip(start, *after_steps)]
    for e, x in zip(trainer.ema, expected):
        torch.testing.assert_close(e, x, rtol=1e-6, atol=1e-6)  # lerp rounds differently
    assert any(not torch.equal(e, p) for e, p in zip(trainer.ema, trainer.params))  # it lags the weights
    with trainer.averaged_weights():
        for p, e in zip(trainer.params, trainer.ema):
            assert torch.equal(p, e)
    for p, w in zip(trainer.params, after_steps[-1]):
        assert torch.equal(p, w)
    # Off (ema_decay 0, the real recipes' setting): no copy, and averaged_weights is the trained weights.
    plain = GRPOTrainer(policy, _cfg(tiny_model_dir, ema_decay=0.0))
    assert plain.ema is None
    with plain.averaged_weights():
        assert all(torch.equal(p, w) for p, w in zip(plain.params, after_steps[-1]))


@pytest.mark.parametrize("decay", [-0.1, 1.0])
def test_ema_decay_outside_0_1_is_refused(decay):
    with pytest.raises(ValueError, match=rf"train.ema_decay must be in \[0, 1\).*got {decay}"):
        from_dict(DiTRecipe, {"train": {"ema_decay": decay}})


def test_train_autocast_runs_the_nft_update_in_bfloat16_with_float32_weights(tiny_model_dir):
    """Mixed precision: the update's forwards run in bfloat16, the weights and their steps stay
    float32, and the step points where the float32 update's does."""
    from spotlight.policy import load_policy, trainable_state

    prompts = ["one red circle"] * 4 + ["two blue squares"] * 4
    adv = group_advantages(torch.arange(8, dtype=torch.float32).view(2, 4) % 3)
    deltas, seen = {}, {}
    for mode in ("none", "bfloat16"):
        cfg = _cfg(tiny_model_dir, objective="nft", nft_num_timesteps=2, autocast=mode, minibatch_size=8)
        cfg.sample.noise_level = 0.0
        policy = load_policy(cfg.model)
        trainer = GRPOTrainer(policy, cfg)
        assert trainer.autocast == mode
        sigmas = qwen_image_sigmas(cfg.sample.num_steps, policy.latent_shape[0])
        ro = rollout(policy, prompts, list(range(8)), sigmas, noise_level=0.0)
        before = {k: v.clone() for k, v in trainable_state(policy).items()}
        dtypes = seen.setdefault(mode, set())
        hook = policy.transformer.proj_out.register_forward_hook(lambda m, i, o: dtypes.add(o.dtype))  # noqa: B023
        trainer.update(ro, adv, iteration=0)
        hook.remove()
        after = trainable_state(policy)
        assert all(v.dtype == torch.float32 for v in after.values())
        deltas[mode] = torch.cat([(after[k] - before[k]).flatten() for k in before])
    assert seen == {"none": {torch.float32}, "bfloat16": {torch.bfloat16}}
    cos = torch.nn.functional.cosine_similarity(deltas["none"], deltas["bfloat16"], dim=0).item()
    assert cos > 0.8, cos  # bfloat16 rounding, not a different update
    assert deltas["bfloat16"].abs().max() > 0


def test_train_autocast_auto_and_refusals():
    from spotlight.rollout import resolve_train_autocast

    assert resolve_train_autocast("auto", "cpu", "nft") == "none"  # float32 updates on every CPU
    assert resolve_train_autocast("auto", "cpu", "flow_grpo") == "none"
    assert resolve_train_autocast("bfloat16", "cpu", "nft") == "bfloat16"
    assert resolve_train_autocast("none", "cpu", "nft") == "none"
    with pytest.raises(ValueError, match="train.autocast='bfloat16' needs train.objective=nft"):
        from_dict(
            DiTRecipe, {"train": {"objective": "flow_grpo", "autocast": "bfloat16"}, "sample": {"noise_level": 1.2}}
        )
    with pytest.raises(ValueError, match="train.autocast"):
        from_dict(DiTRecipe, {"train": {"autocast": "float16"}})
