"""The VLM policy update and the log-prob passes it needs: the reference model, the batched
log-probs of a rollout, and one data-parallel rank's share of an update.

Both schedules use them (`vlm.driver.SerialSchedule`, `vlm.rollplex.RollplexSchedule`): the GRPO
token loss (`vlm.grpo.grpo_token_loss`) over the rollout's minibatches, gradients summed over ranks
before clipping (`train.max_grad_norm`), one optimizer step per minibatch.
"""

from __future__ import annotations

import contextlib
import copy
import math
from dataclasses import dataclass

import numpy as np
import torch

from spotlight.core.distributed import DataParallel, swapped_shards
from spotlight.core.optim import apply_lr_schedule
from spotlight.core.seeds import derive_seed
from vlm.config import VLMRecipe
from vlm.grpo import grpo_token_loss
from vlm.policy import VLMPolicy, response_logprobs
from vlm.rollout import Rollout


class Reference:
    """The frozen reference policy of the KL term: the adapter switched off (LoRA) or a frozen copy.

    Under FSDP (`sharded`) a full fine-tune's reference is a clone of this rank's shards of the
    trained weights, swapped in for the reference passes, not a copy of the module.
    """

    def __init__(self, policy: VLMPolicy, beta: float, *, sharded: bool = False):
        self.policy = policy
        self.copy = None
        self.params, self.shards = [], []
        if beta > 0 and not policy.has_lora and sharded:
            self.params = [p for p in policy.model.parameters() if p.requires_grad]
            self.shards = [p.detach().clone() for p in self.params]
        elif beta > 0 and not policy.has_lora:
            self.copy = copy.deepcopy(policy.model).requires_grad_(False)

    @torch.no_grad()
    def logprobs(self, ro: Rollout, temperature: float, micro_batch_size: int) -> torch.Tensor:
        """(B, T) reference log-probs of the rollout's responses."""
        if self.shards:
            ctx = swapped_shards(self.policy.model, self.params, self.shards)
        else:
            ctx = self.policy.model.disable_adapter() if self.copy is None else contextlib.nullcontext()
        with ctx:
            return batched_logprobs(self.policy, ro, temperature, micro_batch_size, model=self.copy)


def batched_logprobs(
    policy: VLMPolicy, ro: Rollout, temperature: float, micro_batch_size: int, *, model=None
) -> torch.Tensor:
    """(B, T) response log-probs in micro-batches (call under no_grad)."""
    parts = []
    for start in range(0, ro.prompts.num_rows, micro_batch_size):
        rows = list(range(start, min(start + micro_batch_size, ro.prompts.num_rows)))
        parts.append(
            response_logprobs(
                policy,
                ro.prompts.select(rows),
                ro.response_ids_BT[rows],
                ro.response_mask_BT[rows],
                temperature,
                model=model,
            ).cpu()
        )
    return torch.cat(parts)


class FullForward:
    """Training log-probs of the serial schedule: the whole model over [prompt, response] per micro-batch."""

    def __init__(self, policy: VLMPolicy, ro: Rollout, temperature: float):
        self.policy, self.ro, self.temperature = policy, ro, temperature

    def begin_minibatch(self, rows: list[int]) -> None:
        """Called before the micro-batches of a minibatch (`rows` index the rollout)."""

    def logprobs(self, rows: list[int]) -> torch.Tensor:
        """(b, T) log-probs of the given rows, with gradient."""
        ro = self.ro
        return response_logprobs(
            self.policy, ro.prompts.select(rows), ro.response_ids_BT[rows], ro.response_mask_BT[rows], self.temperature
        )

    def before_step(self) -> None:
        """Called after the minibatch's backward passes, before clipping."""

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()


@dataclass
class UpdateShard:
    """This process's part of an iteration's update batch: all of it in one process.

    The N rows of the update (the iteration's rollout rows that reach it, in rollout order) are split
    among the data-parallel ranks in contiguous runs. Every rank walks the same global minibatches
    and scores its own rows of each, with the divisors of the whole minibatch (its sequence and
    token counts), so the gradients summed over ranks are the one-process minibatch gradient.
    """

    dp: DataParallel
    """The data-parallel layout (the identity in one process)."""
    offset: int
    """Position, among the N rows of the update, of this rank's first row."""
    num_tokens_N: torch.Tensor
    """(N,) response tokens of every row of the update, every rank's: the loss divisors are global."""
    owner_N: torch.Tensor | None = None
    """FSDP: (N,) the rank holding each row of the update (the ranks' micro-batch counts)."""
    spare: Rollout | None = None
    """FSDP: one row of this rank's rollout, scored with weight 0 in the micro-batches a rank runs
    beyond its own so that every rank runs as many forwards and backwards."""

    @classmethod
    def whole(cls, ro: Rollout) -> UpdateShard:
        """One process holding all the rows of `ro`."""
        return cls(DataParallel(), 0, ro.response_mask_BT.sum(dim=1))


def update(
    policy: VLMPolicy,
    optimizer: torch.optim.Optimizer,
    ro: Rollout | None,
    adv_B: torch.Tensor,
    old_logp_BT: torch.Tensor | None,
    ref_logp_BT: torch.Tensor | None,
    cfg: VLMRecipe,
    iteration: int,
    *,
    scorer: FullForward | None = None,
    shard: UpdateShard | None = None,
    lr_scale: float = 1.0,
) -> dict[str, float]:
    """The policy update of one iteration: epochs x shuffled minibatches, micro-batch gradient accumulation.

    `old_logp_BT` None means on-policy (one epoch, one minibatch): the ratio's denominator is the
    forward's own log-probs, detached. `scorer` computes the training log-probs and applies the
    step (default `FullForward`; the Rollplex schedule passes its prefix + suffix scorer).
    `shard` places `ro` among the ranks' rows (default: one process, `ro` is the whole batch);
    `ro` None means this rank holds none of the rows but takes part in every gradient sum. `lr_scale`
    multiplies the learning rate (the end-of-run cooldown, `spotlight.core.optim.run_cooldown_scale`).

    Returns the mean minibatch loss and gradient norm, and clip_frac, ratio_mean and kl_ref as
    token means over the whole update (every rank's tokens, whatever the micro-batching).
    """
    tc = cfg.train
    shard = UpdateShard.whole(ro) if shard is None else shard
    scorer = FullForward(policy, ro, cfg.rollout.temperature) if scorer is None else scorer
    num_rows = len(shard.num_tokens_N)
    lo, hi = shard.offset, shard.offset + (ro.prompts.num_rows if ro is not None else 0)
    sums = {"clip_frac": 0.0, "ratio_mean": 0.0, "kl_ref": 0.0, "tokens": 0.0}
    losses, grad_norms = [], []
    # The optimizer's parameters: under FSDP the model's own may be the gathered (unsharded) ones
    # between forwards, while the gradients land on the shards.
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for epoch in range(tc.num_inner_epochs):
        order = np.random.default_rng(derive_seed(tc.seed, iteration, 1, epoch)).permutation(num_rows).tolist()
        for mb_start in range(0, num_rows, tc.minibatch_size):
            mb_all = order[mb_start : mb_start + tc.minibatch_size]
            mb_rows = [i - lo for i in mb_all if lo <= i < hi]  # this rank's rows of the minibatch (maybe none)
            num_tokens = float(shard.num_tokens_N[mb_all].sum())
            optimizer.zero_grad(set_to_none=True)
            scorer.begin_minibatch(mb_rows)
            loss_total = 0.0
            for mc_start in range(0, len(mb_rows), tc.micro_batch_size):
                rows = mb_rows[mc_start : mc_start + tc.micro_batch_size]
                mask_BT = ro.response_mask_BT[rows]
                logp_BT = scorer.logprobs(rows)
                old_BT = logp_BT.detach() if old_logp_BT is None else old_logp_BT[rows].to(logp_BT.device)
                loss, s = grpo_token_loss(
                    logp_BT,
                    old_BT,
                    ref_logp_BT[rows].to(logp_BT.device) if ref_logp_BT is not None else None,
                    adv_B[rows].to(logp_BT.device),
                    mask_BT.to(logp_BT.device),
                    clip_range=tc.clip_range,
                    clip_range_high=tc.clip_range_high or None,
                    beta=tc.beta,
                    agg=tc.loss_agg,
                    num_sequences=len(mb_all),
                    num_tokens=num_tokens,
                )
                loss.backward()
                loss_total += loss.item()
                tokens = float(mask_BT.sum())
                for k, v in s.items():  # token means of the micro-batch -> token sums
                    sums[k] += v * tokens
                sums["tokens"] += tokens
            if shard.owner_N is not None:  # FSDP: as many forwards and backwards as the busiest rank
                _pad_backwards(policy, shard, mb_all, len(mb_rows), cfg)
            scorer.before_step()
            shard.dp.all_reduce_grads(params)  # the one-process minibatch gradient, before clipping (FSDP: done)
            grad_norm = shard.dp.clip_grad_norm_(params, tc.max_grad_norm)
            apply_lr_schedule(optimizer, tc.lr, tc.lr_warmup_steps, lr_scale)
            scorer.step(optimizer)
            losses.append(loss_total)
            grad_norms.append(float(grad_norm))
    # Each rank's entries are its shares: summed over ranks they are the global values.
    totals = shard.dp.sum_lists({"loss": losses, **{k: [v] for k, v in sums.items()}})
    tokens = max(totals.pop("tokens")[0], 1.0)
    stats = {k: v[0] / tokens for k, v in totals.items() if k != "loss"}
    return {**stats, "loss": float(np.mean(totals["loss"])), "grad_norm": float(np.mean(grad_norms))}


def _pad_backwards(policy: VLMPolicy, shard: UpdateShard, mb_all: list[int], num_mine: int, cfg: VLMRecipe) -> None:
    """Under FSDP every rank runs as many micro-batch forwards and backwards as the busiest rank of
    the minibatch `mb_all`: this rank, holding `num_mine` of its rows, adds the missing ones on a
    spare row with weight 0 (they take part in the collectives and add nothing)."""
    mbs = cfg.train.micro_batch_size
    counts = torch.bincount(shard.owner_N[mb_all], minlength=shard.dp.world_size).tolist()
    spare = FullForward(policy, shard.spare, cfg.rollout.temperature)
    for _ in range(max(math.ceil(c / mbs) for c in counts) - math.ceil(num_mine / mbs)):
        (spare.logprobs([0]).sum() * 0.0).backward()
