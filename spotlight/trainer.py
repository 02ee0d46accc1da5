"""The GRPO update of a DiT policy from one rollout (Flow-GRPO, windowed SDE).

Shape legend: B samples, L image tokens, C packed channels, N steps, M minibatch samples.

For every minibatch, the log-prob of each stored stochastic transition x_j -> x_{j+1} is
recomputed under the current weights with the same `sde_step` the sampler used, the clipped
surrogate of `grpo.clipped_policy_loss` is taken per step, and gradients accumulate over the
trained steps before one optimizer step (Flow-GRPO's "gradient accumulation over timesteps").
"""

from __future__ import annotations

import copy
from contextlib import contextmanager

import numpy as np
import torch

from spotlight.config import DiTRecipe
from spotlight.grpo import Advantages, clipped_policy_loss, gaussian_mean_kl
from spotlight.policy import DiTPolicy
from spotlight.rollout import Rollout, encode, guided_velocity
from spotlight.sampling import derive_seed, sde_step


class GRPOTrainer:
    """Owns the optimizer and the reference policy; `update` is one GRPO step on a rollout."""

    def __init__(self, policy: DiTPolicy, cfg: DiTRecipe):
        self.policy = policy
        self.cfg = cfg
        self.params = [p for p in policy.transformer.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("the transformer has no trainable parameters (model.lora_rank / model config?)")
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
        # KL reference: the base weights. With LoRA they are the model with its adapter disabled;
        # a full fine-tune needs a frozen copy (memory: one more set of weights).
        self._ref_copy = None
        if cfg.train.beta > 0 and not policy.has_lora:
            self._ref_copy = copy.deepcopy(policy.transformer).requires_grad_(False).eval()

    @contextmanager
    def _reference(self):
        """Swap the reference weights in for the duration of a forward."""
        tr = self.policy.transformer
        if self._ref_copy is not None:
            self.policy.transformer = self._ref_copy
            try:
                yield
            finally:
                self.policy.transformer = tr
        else:
            tr.disable_adapters()
            try:
                yield
            finally:
                tr.enable_adapters()

    def update(self, ro: Rollout, adv: Advantages, iteration: int) -> dict[str, float]:
        """One GRPO update on a rollout whose samples are ordered prompt-major (P groups of G)."""
        cfg = self.cfg
        traj = ro.trajectory
        adv_B = adv.adv_PG.reshape(-1)
        trainable = torch.nonzero(adv.trainable_PG.reshape(-1)).squeeze(1)
        stats: dict[str, list[float]] = {"loss": [], "clip_frac": [], "approx_kl_old": [], "kl_ref": [], "grad_norm": []}
        if len(trainable) == 0:
            return {"num_trained_samples": 0.0}
        batch = encode(self.policy, ro.prompts, cfg.sample.guidance_scale, cfg.sample.negative_prompt)
        steps = traj.sde_steps
        self.policy.transformer.train()
        for epoch in range(cfg.train.num_inner_epochs):
            gen = torch.Generator().manual_seed(derive_seed(cfg.train.seed, iteration, epoch, 7))
            order = trainable[torch.randperm(len(trainable), generator=gen)]
            for start in range(0, len(order), cfg.train.minibatch_size):
                idx_M = order[start : start + cfg.train.minibatch_size]
                mb = batch.select(idx_M)
                self.optimizer.zero_grad(set_to_none=True)
                for j in steps:
                    x_MLC = traj.latents[j][idx_M]
                    x_next_MLC = traj.latents[j + 1][idx_M]
                    sigma_M = traj.sigmas[j].expand(len(idx_M))
                    v = guided_velocity(self.policy, x_MLC, sigma_M, mb, cfg.sample.guidance_scale)
                    out = sde_step(v, x_MLC, traj.sigmas[j], traj.sigmas[j + 1], cfg.sample.noise_level, prev_sample=x_next_MLC)
                    loss, s = clipped_policy_loss(out.log_prob, traj.log_probs[j][idx_M], adv_B[idx_M], cfg.train.clip_range)
                    if cfg.train.beta > 0:
                        with torch.no_grad(), self._reference():
                            v_ref = guided_velocity(self.policy, x_MLC, sigma_M, mb, cfg.sample.guidance_scale)
                            ref = sde_step(v_ref, x_MLC, traj.sigmas[j], traj.sigmas[j + 1], cfg.sample.noise_level, prev_sample=x_next_MLC)
                        kl = gaussian_mean_kl(out.mean, ref.mean, out.std).mean()
                        loss = loss + cfg.train.beta * kl
                        stats["kl_ref"].append(kl.item())
                    (loss / len(steps)).backward()
                    stats["loss"].append(loss.item())
                    stats["clip_frac"].append(s["clip_frac"])
                    stats["approx_kl_old"].append(s["approx_kl_old"])
                norm = torch.nn.utils.clip_grad_norm_(self.params, cfg.train.max_grad_norm)
                stats["grad_norm"].append(norm.item())
                self.optimizer.step()
        self.policy.transformer.eval()
        out_stats = {k: float(np.mean(v)) for k, v in stats.items() if v}
        out_stats["num_trained_samples"] = float(len(trainable))
        return out_stats
