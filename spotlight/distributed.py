"""Data parallelism for the DiT and VLM trainers: one replica of the policy per process, the batch split.

Launched with `accelerate launch` (torchrun underneath) or `torchrun`, every process runs the same
driver. The global batch is the one-process batch: P prompts x G seeds, prompt-major. Rank r rolls
out the contiguous slice `shard(P * G)` of it (a group may span two ranks) with the same per-sample
seeds a single process would use, so the seeds never depend on the rank or the world size. Rewards
are all-gathered before the group advantages, so every rank computes the same global advantages.

In the update every rank walks the same global minibatches and computes the loss of its own samples
in each, weighted by their share of the minibatch; the gradients are then summed across ranks
(`all_reduce_grads`), which gives the gradient of the one-process minibatch loss. An explicit
all-reduce rather than DDP: a rank may hold none of a minibatch's samples (it then adds zero), and
the trainer keeps calling `policy.transformer` directly (reference and old-policy swaps, LoRA).
The VLM trainer (`vlm/train.py`) does the same with its token loss, whose divisors (the minibatch's
sequence and token counts) are the global ones (`vlm.train.UpdateShard`).

Only rank 0 writes: metrics, images, checkpoints, the cost ledger, the Ray explorers. With one
process (`WORLD_SIZE` unset or 1) every method is the identity and nothing is initialised, so the
single-process path is unchanged; `torch.distributed` is part of torch (accelerate is never imported).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from spotlight.rewards import RewardResult


@dataclass
class DataParallel:
    """This process's place among the data-parallel replicas; the identity when world_size is 1."""

    rank: int = 0
    """Index of this process, 0 .. world_size - 1."""
    world_size: int = 1
    """Number of processes."""
    device: torch.device = torch.device("cpu")
    """Where collectives run: this process's GPU with NCCL, the CPU with gloo."""
    owns_group: bool = False
    """Whether `init_data_parallel` created the process group (and `close` destroys it)."""

    @property
    def is_main(self) -> bool:
        """Rank 0: the process that writes metrics, images and checkpoints."""
        return self.rank == 0

    def shard(self, num_samples: int) -> tuple[int, int]:
        """[lo, hi) of this rank's contiguous share of num_samples (sizes differ by at most one)."""
        return num_samples * self.rank // self.world_size, num_samples * (self.rank + 1) // self.world_size

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank (picklable objects)."""
        if self.world_size == 1:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    @torch.no_grad()
    def broadcast_tensors(self, tensors: list[torch.Tensor]) -> None:
        """Overwrite `tensors` in place with rank 0's values."""
        if self.world_size == 1:
            return
        import torch.distributed as dist

        for t in tensors:
            dist.broadcast(t.data, src=0)

    def all_gather_rows(self, local: torch.Tensor) -> torch.Tensor:
        """Concatenation along dim 0 of every rank's `local` (rank order); row counts may differ."""
        if self.world_size == 1:
            return local
        import torch.distributed as dist

        count = torch.tensor([local.shape[0]], device=self.device)
        counts = [torch.zeros_like(count) for _ in range(self.world_size)]
        dist.all_gather(counts, count)
        most = int(max(c.item() for c in counts))
        padded = torch.zeros((most, *local.shape[1:]), dtype=local.dtype, device=self.device)
        padded[: local.shape[0]] = local
        parts = [torch.empty_like(padded) for _ in range(self.world_size)]
        dist.all_gather(parts, padded)
        return torch.cat([p[: int(c.item())] for p, c in zip(parts, counts)]).to(local.device)

    def all_reduce_grads(self, params: list[torch.Tensor]) -> None:
        """Sum the gradients of `params` over ranks, in place (one flat all-reduce).

        A parameter without a gradient on every rank keeps `grad = None`, as it would in one
        process (AdamW skips it); one with a gradient somewhere gets zeros from the other ranks.
        """
        if self.world_size == 1:
            return
        import torch.distributed as dist

        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        present = torch.tensor([p.grad is not None for p in params], dtype=grads[0].dtype, device=grads[0].device)
        flat = torch.cat([g.reshape(-1) for g in grads] + [present])
        dist.all_reduce(flat)
        offset = 0
        for p in params:
            n = p.numel()
            p.grad = flat[offset : offset + n].view_as(p).to(p.dtype).clone()
            offset += n
        for p, anywhere in zip(params, flat[offset:].tolist()):
            if anywhere == 0:
                p.grad = None

    def sum_lists(self, lists: dict[str, list[float]]) -> dict[str, list[float]]:
        """Elementwise sum over ranks of equally long lists of numbers (per-rank shares of a statistic)."""
        if self.world_size == 1:
            return lists
        import torch.distributed as dist

        keys = sorted(lists)
        sizes = [len(lists[k]) for k in keys]
        flat = torch.tensor([v for k in keys for v in lists[k]], dtype=torch.float64, device=self.device)
        dist.all_reduce(flat)
        out, offset = {}, 0
        for k, n in zip(keys, sizes):
            out[k] = flat[offset : offset + n].tolist()
            offset += n
        return out

    def close(self) -> None:
        """Destroy the process group if `init_data_parallel` created it."""
        if self.owns_group:
            import torch.distributed as dist

            dist.destroy_process_group()
            self.owns_group = False


def init_data_parallel() -> DataParallel:
    """The data-parallel layout of this process, from the launcher's environment.

    `accelerate launch` and `torchrun` set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
    MASTER_PORT; without them (a plain `spotlight train`) this is the one-process layout and
    nothing is initialised. The backend is NCCL when CUDA is present, else gloo (a MULTI_GPU
    accelerate config on a machine without GPUs gives gloo processes: configs/accelerate/cpu-2proc.yaml).
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        return DataParallel()
    if os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true":
        raise ValueError(
            "this accelerate config asks for FSDP, which spotlight's trainer does not shard yet: every rank "
            "holds the whole model; launch with configs/accelerate/multi-gpu-ddp.yaml (or cpu-2proc.yaml on CPU)"
        )
    import torch.distributed as dist

    device = torch.device("cpu")
    if torch.cuda.is_available():
        # model.device "cuda" then means this process's GPU.
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if dist.is_initialized():
        return DataParallel(rank=dist.get_rank(), world_size=dist.get_world_size(), device=device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return DataParallel(rank=dist.get_rank(), world_size=world_size, device=device, owns_group=True)


def gather_rewards(dp: DataParallel, local: RewardResult) -> RewardResult:
    """The rewards of the whole batch on every rank, from each rank's rewards of its slice."""
    if dp.world_size == 1:
        return local
    total_B = dp.all_gather_rows(local.total_B)
    components = {name: dp.all_gather_rows(value) for name, value in local.components.items()}
    return RewardResult(total_B, components, num_failed=int(torch.isnan(total_B).sum()))
