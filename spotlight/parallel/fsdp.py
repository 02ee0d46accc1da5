"""The DiT policy under data parallelism and FSDP: its transformer sharded, its training state
gathered to rank 0 in the one-process layout and loaded back (a checkpoint's), and its weights
handed to the explorers (`LocalWeightsSource`, `ShardedWeightsSource`). The pieces both
paths share (process groups, `shard_module`, the sharded gathers) are `spotlight.core.distributed`.
"""

from __future__ import annotations

import torch

from spotlight.core.distributed import (
    DataParallel,
    gather_sharded_train_state,
    gather_sharded_weights,
    load_sharded_train_state,
    shard_module,
)


def shard_transformer(policy, dp: DataParallel) -> tuple[int, int]:
    """Shard the DiT policy's transformer in place (`shard_module`); returns (local, full) parameter counts.

    Activation checkpointing is diffusers' own checkpointing of each block's forward: the parameter
    names stay those of the one-process model (a checkpoint_wrapper would insert
    `_checkpoint_wrapped_module.`).
    """
    tr = policy.transformer
    return shard_module(tr, dp, enable_checkpointing=tr.enable_gradient_checkpointing, hint="QwenImageTransformerBlock")


def gather_trainable_weights(dp: DataParallel, policy) -> dict[str, torch.Tensor] | None:
    """The DiT policy's `trainable_state` dict (full tensors) on rank 0, None on the others.

    Under FSDP every rank must call this (`gather_sharded_weights`, a copy on rank 0's CPU); without
    FSDP it is rank 0's live state.
    """
    from spotlight.policy import trainable_state

    if not dp.sharded:
        return trainable_state(policy) if dp.is_main else None
    return gather_sharded_weights(dp, policy.transformer, policy.has_lora)


def gather_train_state(dp: DataParallel, policy, optimizer: torch.optim.Optimizer) -> tuple[dict, dict] | None:
    """The DiT policy's (trainable weights, optimizer state) in the one-process layout on rank 0,
    None on the others; under FSDP every rank must call this (`gather_sharded_train_state`).
    """
    from spotlight.policy import trainable_state

    if not dp.sharded:
        return (trainable_state(policy), optimizer.state_dict()) if dp.is_main else None
    return gather_sharded_train_state(dp, policy.transformer, policy.has_lora, optimizer)


def load_train_state(
    dp: DataParallel, policy, optimizer: torch.optim.Optimizer, weights: dict, optim_state: dict
) -> None:
    """Load `gather_train_state`'s layout (a checkpoint) into the DiT policy and optimizer; a collective under FSDP."""
    from spotlight.policy import load_trainable_state

    if not dp.sharded:
        load_trainable_state(policy, weights)
        optimizer.load_state_dict(optim_state)
        return
    load_sharded_train_state(dp, policy.transformer, policy.has_lora, optimizer, weights, optim_state)


class LocalWeightsSource:
    """The trainable weights for the explorers, copied to the CPU when called (one process or full
    replicas): the optimizer step that follows does not change what the explorers load."""

    def __init__(self, policy):
        self.policy = policy
        self.copies = 0

    def __call__(self) -> dict[str, torch.Tensor]:
        from spotlight.policy import trainable_state

        self.copies += 1
        return {k: v.detach().to("cpu", copy=True) for k, v in trainable_state(self.policy).items()}

    def settle(self) -> None:
        pass  # nothing to join: no other rank takes part


class ShardedWeightsSource:
    """The full trainable weights for the explorers under FSDP, gathered only when they are used.

    Gathering is a collective, but only rank 0 holds the explorers and knows whether its planner
    gave them candidates (with no live explorer, or a budget below a group, it does not). So rank
    0's call (from inside `Exploration`, only when there are jobs) first tells the other ranks
    "gather" and then gathers; `settle()`, which every rank calls once `Exploration` is done,
    tells them "no gather" if no call came, and on the other ranks listens and joins the gather
    when told. Every rank thus runs the same collectives in the same order: one broadcast, then
    the gather or nothing. With `needed` False (no window can open) nothing is exchanged at all.
    """

    def __init__(self, dp, policy, needed: bool):
        self.dp, self.policy, self.needed = dp, policy, needed
        self.copies = 0  # gathers: 0 or 1
        self._full: dict[str, torch.Tensor] | None = None

    def __call__(self) -> dict[str, torch.Tensor] | None:
        assert self.needed and self.dp.is_main, (
            "only rank 0's explorers take the weights, and only when a window may open"
        )
        if not self.copies:
            self.dp.broadcast_object(True)
            self._full = gather_trainable_weights(self.dp, self.policy)
            self.copies = 1
        return self._full

    def settle(self) -> None:
        if not self.needed:
            return
        if self.dp.is_main:
            if not self.copies:
                self.dp.broadcast_object(False)
        elif self.dp.broadcast_object(None):
            gather_trainable_weights(self.dp, self.policy)
            self.copies = 1
