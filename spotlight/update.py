"""The GRPO update of a DiT policy from one rollout: one minibatch loop, two objectives.

Shape legend: B samples, L image tokens, C packed channels, N steps, M minibatch samples.

`GRPOTrainer.update` walks seeded minibatches of the trainable samples; per minibatch it sums the
objective's loss over its terms and takes one optimizer step. `FlowGRPOObjective` (windowed SDE):
a term is a stored stochastic transition x_j -> x_{j+1}, whose log-prob is recomputed under the
current weights with the same `sde_step` the sampler used for the clipped surrogate of
`grpo.clipped_policy_loss` (Flow-GRPO's "gradient accumulation over timesteps").
`NFTObjective` (DiffusionNFT): a term is a noise level at which the final samples are re-noised.

Data parallel (`distributed.py`): the rollout holds this rank's contiguous slice of the samples,
the advantages are global. Every rank walks the same global minibatches; its loss over its own
samples is weighted by their share of the minibatch, so the gradients summed over ranks (and the
statistics) are those of the one-process minibatch.

FSDP (`dp.sharded`): the transformer's weights are shards, gathered block by block in every
forward and backward, so every rank must run the same forwards: a rank holding none of a
minibatch's samples runs it on one of its own rows with weight 0 (it adds zero, as the skip does
without FSDP). The old-policy and reference weights are clones of this rank's shards, swapped in
for their forwards (`distributed.swapped_shards`), not copies of the module.
"""

from __future__ import annotations

import copy
import math
from contextlib import contextmanager, nullcontext

import numpy as np
import torch

from spotlight.config import DiTRecipe
from spotlight.core.advantages import Advantages
from spotlight.core.distributed import DataParallel, swapped_shards
from spotlight.core.optim import apply_lr_schedule
from spotlight.core.seeds import derive_seed
from spotlight.grpo import (
    clipped_policy_loss,
    gaussian_mean_kl,
    nft_level_indices,
    nft_loss,
    nft_optimality,
)
from spotlight.policy import DiTPolicy
from spotlight.rollout import AUTOCAST_DTYPES, Rollout, encode, guided_velocity, resolve_train_autocast
from spotlight.sampling import stochastic_step


class GRPOTrainer:
    """Owns the optimizer and the reference policy; `update` is one GRPO step on a rollout."""

    def __init__(self, policy: DiTPolicy, cfg: DiTRecipe, dp: DataParallel | None = None):
        self.policy = policy
        self.cfg = cfg
        self.dp = dp or DataParallel()
        self.params = [p for p in policy.transformer.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("the transformer has no trainable parameters (model.lora_rank / model config?)")
        # Every replica starts from rank 0's weights, as DDP does (a LoRA init follows train.seed, but a caller
        # may pass any policy).
        # (A sharded transformer was synchronised before sharding: `distributed.shard_transformer`.)
        if not self.dp.sharded:
            self.dp.broadcast_tensors(self.params)
        self.optimizer = torch.optim.AdamW(
            self.params, lr=cfg.train.lr, betas=(0.9, cfg.train.adam_beta2), weight_decay=cfg.train.weight_decay
        )
        self.autocast = resolve_train_autocast(cfg.train.autocast, policy.device, cfg.train.objective)
        """Resolved `train.autocast` of the "nft" update: "none" or "bfloat16"."""
        # Moving average of the trainable weights (train.ema_decay), what evaluation and export
        # use: clones of this rank's parameters (its shards under FSDP), updated after every step.
        self.ema: list[torch.Tensor] | None = self._shards() if cfg.train.ema_decay > 0 else None
        # A factor on the learning rate the driver sets per update (train.lr_cooldown over the end of the run).
        self.lr_scale = 1.0
        # KL reference: the base weights. With LoRA they are the model with its adapter disabled;
        # a full fine-tune needs a frozen copy (memory: one more set of weights).
        self._ref_copy = None
        self._ref_shards = None
        if cfg.train.beta > 0 and not policy.has_lora and self.dp.sharded:
            self._ref_shards = self._shards()  # under FSDP: this rank's shards of the base weights
        elif cfg.train.beta > 0 and not policy.has_lora:
            self._ref_copy = copy.deepcopy(policy.transformer).requires_grad_(False).eval()

    def reset_ema(self) -> None:
        """Restart the moving average from the current weights (after loading a checkpoint's)."""
        if self.ema is not None:
            self.ema = self._shards()

    @contextmanager
    def averaged_weights(self):
        """Run with the moving average in place of the trained weights; without train.ema_decay, as is.

        `swapped_shards` swaps the values of `self.params`: under FSDP those are this rank's shards,
        otherwise the whole parameters (there are no FSDP modules to reshard then).
        """
        if self.ema is None:
            yield
            return
        with swapped_shards(self.policy.transformer, self.params, self.ema):
            yield

    def _shards(self) -> list[torch.Tensor]:
        """A clone of this rank's trainable parameters (its shards under FSDP): old policy, reference,
        moving average."""
        return [p.detach().clone() for p in self.params]

    @contextmanager
    def _swapped(self, transformer):
        """Use another transformer (same architecture) for the duration of a forward."""
        current = self.policy.transformer
        self.policy.transformer = transformer
        try:
            yield
        finally:
            self.policy.transformer = current

    @contextmanager
    def _reference(self):
        """Swap the reference weights in for the duration of a forward."""
        tr = self.policy.transformer
        if self._ref_copy is not None:
            with self._swapped(self._ref_copy):
                yield
        elif self._ref_shards is not None:
            with swapped_shards(tr, self.params, self._ref_shards):
                yield
        else:
            tr.disable_adapters()
            try:
                yield
            finally:
                tr.enable_adapters()

    def _amp(self):
        """The update's forwards under torch.autocast (train.autocast), or nothing."""
        dtype = AUTOCAST_DTYPES[self.autocast]
        return nullcontext() if dtype is None else torch.autocast(self.policy.device.type, dtype=dtype)

    def _mine(self, idx_M: torch.Tensor, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor, float]:
        """This rank's part [lo, hi) of the global minibatch idx_M: global indices, rollout rows, share of M.

        Under FSDP a rank with none of the minibatch gets its first row with share 0: its forward
        and backward take part in the collectives and add zero.
        """
        mine = idx_M[(idx_M >= lo) & (idx_M < hi)]
        if len(mine) == 0 and self.dp.sharded:
            return torch.tensor([lo]), torch.tensor([0]), 0.0
        return mine, mine - lo, len(mine) / len(idx_M)

    def _step(self, grad_norms: list[float]) -> None:
        """Sum the gradients over ranks, clip them and take one optimizer step."""
        self.dp.all_reduce_grads(self.params)
        norm = self.dp.clip_grad_norm_(self.params, self.cfg.train.max_grad_norm)
        grad_norms.append(norm.item())
        apply_lr_schedule(self.optimizer, self.cfg.train.lr, self.cfg.train.lr_warmup_steps, self.lr_scale)
        self.optimizer.step()
        if self.ema is not None:
            # ema <- decay * ema + (1 - decay) * weights, elementwise (so shard by shard under FSDP)
            with torch.no_grad():
                for e, p in zip(self.ema, self.params):
                    e.lerp_(p.detach(), 1 - self.cfg.train.ema_decay)

    def _summary(self, stats: dict[str, list[float]], grad_norms: list[float], num_trained: int) -> dict[str, float]:
        # Each rank's entries are its weighted shares: summed over ranks they are the global values.
        stats = self.dp.sum_lists(stats)
        out_stats = {k: float(np.mean(v)) for k, v in {**stats, "grad_norm": grad_norms}.items() if v}
        out_stats["num_trained_samples"] = float(num_trained)
        return out_stats

    def update(self, ro: Rollout, adv: Advantages, iteration: int) -> dict[str, float]:
        """One GRPO update on a rollout whose samples are ordered prompt-major (P groups of G).

        With data parallelism `ro` holds this rank's slice `dp.shard(P * G)` and `adv` the whole batch.
        The objective (`train.objective`) is a loss over one term of a minibatch (a stochastic step
        for "flow_grpo", a noise level for "nft"); this loop is the same for both: per inner epoch
        a seeded order of the trainable samples, per minibatch the terms' losses accumulated, then
        one optimizer step.
        """
        tcfg = self.cfg.train
        lo, hi = self.dp.shard(adv.adv_PG.numel())
        assert hi - lo == len(ro.prompts), (lo, hi, len(ro.prompts))
        trainable = torch.nonzero(adv.trainable_PG.reshape(-1)).squeeze(1)
        if len(trainable) == 0:
            return {"num_trained_samples": 0.0}
        batch = encode(self.policy, ro.prompts, self.cfg.sample.guidance_scale, self.cfg.sample.negative_prompt)
        objective_cls = NFTObjective if tcfg.objective == "nft" else FlowGRPOObjective
        objective = objective_cls(self, ro, adv, iteration, num_trainable=len(trainable))
        stats: dict[str, list[float]] = {k: [] for k in objective.keys}
        grad_norms: list[float] = []
        self.policy.transformer.train()
        for epoch in range(tcfg.num_inner_epochs):
            gen = torch.Generator().manual_seed(derive_seed(tcfg.seed, iteration, epoch, objective.order_stream))
            order = trainable[torch.randperm(len(trainable), generator=gen)]
            for start in range(0, len(order), tcfg.minibatch_size):
                idx_M, rows_M, share = self._mine(order[start : start + tcfg.minibatch_size], lo, hi)
                mb = batch.select(rows_M)
                self.optimizer.zero_grad(set_to_none=True)
                for term in objective.terms:
                    if len(idx_M) == 0:
                        # None of this minibatch is on this rank: it adds zero to the sums.
                        for key in objective.keys:
                            stats[key].append(0.0)
                        continue
                    loss, term_stats = objective.loss(epoch, term, idx_M, rows_M, mb)
                    (loss * share / len(objective.terms)).backward()
                    for key, value in term_stats.items():
                        stats[key].append(share * value)
                self._step(grad_norms)
                objective.stepped()
        self.policy.transformer.eval()
        return self._summary(stats, grad_norms, len(trainable))


class FlowGRPOObjective:
    """Flow-GRPO (Liu et al. 2025): per stochastic step j of the rollout, the clipped surrogate of
    the recomputed log-prob of x_j -> x_{j+1} (`grpo.clipped_policy_loss`), plus beta times the
    Gaussian KL of the step means to the reference's."""

    order_stream = 7  # derive_seed stream of the minibatch order

    def __init__(self, trainer: GRPOTrainer, ro: Rollout, adv: Advantages, iteration: int, *, num_trainable: int):
        self.trainer, self.cfg, self.traj = trainer, trainer.cfg, ro.trajectory
        # Advantages come from the rewards, on the CPU; the log-probs they weigh are on the policy's device.
        self.adv_B = adv.adv_PG.reshape(-1).to(trainer.policy.device)
        self.terms = self.traj.sde_steps
        self.keys = ["loss", "clip_frac", "approx_kl_old"] + (["kl_ref"] if self.cfg.train.beta > 0 else [])

    def _step(self, j: int, x_MLC, x_next_MLC, mb):
        cfg, traj, policy = self.cfg, self.traj, self.trainer.policy
        v = guided_velocity(policy, x_MLC, traj.sigmas[j].expand(len(x_MLC)), mb, cfg.sample.guidance_scale)
        return stochastic_step(
            cfg.sample.sde_type,
            v,
            x_MLC,
            traj.sigmas[j],
            traj.sigmas[j + 1],
            cfg.sample.noise_level,
            prev_sample=x_next_MLC,
        )

    def loss(self, epoch: int, j: int, idx_M, rows_M, mb) -> tuple[torch.Tensor, dict[str, float]]:
        cfg, traj = self.cfg, self.traj
        x_MLC, x_next_MLC = traj.latents[j][rows_M], traj.latents[j + 1][rows_M]
        out = self._step(j, x_MLC, x_next_MLC, mb)
        loss, s = clipped_policy_loss(out.log_prob, traj.log_probs[j][rows_M], self.adv_B[idx_M], cfg.train.clip_range)
        stats = {"clip_frac": s["clip_frac"], "approx_kl_old": s["approx_kl_old"]}
        if cfg.train.beta > 0:
            with torch.no_grad(), self.trainer._reference():
                ref = self._step(j, x_MLC, x_next_MLC, mb)
            kl = gaussian_mean_kl(out.mean, ref.mean, out.std).mean()
            loss = loss + cfg.train.beta * kl
            stats["kl_ref"] = kl.item()
        stats["loss"] = loss.item()
        return loss, stats

    def stepped(self) -> None:
        pass


class NFTObjective:
    """DiffusionNFT (Zheng et al. 2025, arXiv 2509.16117, Eq. 6-8) on the final samples.

    Each clean sample x0 is re-noised on the forward process, x_s = (1 - s) x0 + s eps, at noise
    levels s drawn from the rollout schedule; its flow-matching target is eps - x0. With v_old the
    velocity of the weights that sampled the rollout, the implicit positive and negative policies
    are v+ = (1 - beta) v_old + beta v and v- = (1 + beta) v_old - beta v, and the loss is
    r ||v+ - target||^2 + (1 - r) ||v- - target||^2 with the optimality r = 0.5 + 0.5 clip(A / A_max,
    -1, 1) from the group advantage A. The gradient moves v toward the targets of better-than-average
    samples and away from worse ones, by a denoising loss rather than a likelihood ratio: it needs no
    SDE log-probs, so rollouts may use any sampler (the ODE one included, which is what evaluation
    uses). A term is one of the train.nft_num_timesteps noise levels.
    """

    order_stream = 11  # derive_seed stream of the minibatch order

    def __init__(self, trainer: GRPOTrainer, ro: Rollout, adv: Advantages, iteration: int, *, num_trainable: int):
        self.trainer, self.cfg = trainer, trainer.cfg
        tcfg = self.cfg.train
        self.x0_BLC = ro.trajectory.final
        device = self.x0_BLC.device
        schedule = ro.trajectory.sigmas[:-1]
        num_groups, self.group_size = adv.adv_PG.shape
        self.r_B = nft_optimality(adv.adv_PG.reshape(-1).to(device), tcfg.nft_adv_max)
        # The sampling weights, for v_old after the first optimizer step (a copy only when needed;
        # under FSDP a clone of this rank's shards).
        num_steps = tcfg.num_inner_epochs * math.ceil(num_trainable / tcfg.minibatch_size)
        self.old = None
        if num_steps > 1:
            self.old = (
                trainer._shards()
                if trainer.dp.sharded
                else copy.deepcopy(trainer.policy.transformer).requires_grad_(False).eval()
            )
        self.first_step = True
        self.terms = range(tcfg.nft_num_timesteps)
        self.keys = ["loss", "nft_pos_err", "nft_neg_err"] + (["kl_ref"] if tcfg.beta > 0 else [])
        noise_gen = torch.Generator().manual_seed(derive_seed(tcfg.seed, iteration, 13))
        shape = (tcfg.num_inner_epochs, num_groups, tcfg.nft_num_timesteps)
        # Drawn on the CPU (the same levels and noise on every device), then moved to the latents.
        levels = nft_level_indices(len(schedule), shape, tcfg.nft_timestep_sampling, noise_gen)
        self.sigma_EPK = schedule[levels].to(device)
        self.eps_EPKLC = torch.randn(*shape, *self.x0_BLC.shape[1:], generator=noise_gen).to(device)

    def _velocity(self, x_s, sigma_M, mb) -> torch.Tensor:
        with self.trainer._amp():
            return guided_velocity(self.trainer.policy, x_s, sigma_M, mb, self.cfg.sample.guidance_scale).float()

    def loss(self, epoch: int, k: int, idx_M, rows_M, mb) -> tuple[torch.Tensor, dict[str, float]]:
        tcfg, trainer = self.cfg.train, self.trainer
        # Common random numbers: the samples of one group share their noise level and noise, so the
        # group-centred weights (2 r - 1) cancel the part of the flow-matching gradient that does
        # not depend on the sample.
        group_M = idx_M // self.group_size
        sigma_M = self.sigma_EPK[epoch, group_M, k]
        x0 = self.x0_BLC[rows_M]
        eps = self.eps_EPKLC[epoch, group_M, k]
        s = sigma_M.reshape(-1, 1, 1)
        x_s = (1 - s) * x0 + s * eps
        target = eps - x0
        v = self._velocity(x_s, sigma_M, mb)
        if self.first_step:
            # No optimizer step yet: the current weights are the sampling weights.
            v_old = v.detach()
        else:
            if trainer.dp.sharded:
                old_weights = swapped_shards(trainer.policy.transformer, trainer.params, self.old)
            else:
                old_weights = trainer._swapped(self.old)
            with torch.no_grad(), old_weights:
                v_old = self._velocity(x_s, sigma_M, mb)
        adaptive = tcfg.nft_weighting == "adaptive"
        loss, s_nft = nft_loss(v, v_old, target, self.r_B[idx_M], tcfg.nft_beta, sigma_B=sigma_M if adaptive else None)
        stats = {"nft_pos_err": s_nft["nft_pos_err"], "nft_neg_err": s_nft["nft_neg_err"]}
        if tcfg.beta > 0:
            # KL to the reference in velocity space (the Gaussian-step KL up to a per-noise-level
            # factor): ||v - v_ref||^2, averaged.
            with torch.no_grad(), trainer._reference():
                v_ref = self._velocity(x_s, sigma_M, mb)
            kl = (v - v_ref).square().mean()
            loss = loss + tcfg.beta * kl
            stats["kl_ref"] = kl.item()
        stats["loss"] = loss.item()
        return loss, stats

    def stepped(self) -> None:
        self.first_step = False
