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
The VLM trainer (`vlm/driver.py`) does the same with its token loss, whose divisors (the minibatch's
sequence and token counts) are the global ones (`vlm.update.UpdateShard`).

Only rank 0 writes: metrics, images, checkpoints, the cost ledger, the Ray explorers. With one
process (`WORLD_SIZE` unset or 1) every method is the identity and nothing is initialised, so the
single-process path is unchanged; `torch.distributed` is part of torch (accelerate is never imported).

FSDP (an accelerate config with `distributed_type: FSDP`, `fsdp_version: 2`; configs/accelerate/fsdp.yaml)
shards the DiT's transformer instead of replicating it: torch's FSDP2 `fully_shard` on every
`QwenImageTransformerBlock` and then on the root, so each rank holds 1/world_size of the weights,
gradients and AdamW state. The settings come from the variables `accelerate launch` exports
(`FSDPSettings.from_env`). FSDP's collectives need every rank to make the same forward and backward
calls, so under FSDP: a rank with none of a minibatch's samples runs it on a zero-weight row
(`GRPOTrainer`), rollouts are padded to the same number of samples on every rank (`num_padding`),
the backward's reduce-scatter sums (divide factor 1) instead of `all_reduce_grads`, the gradient
norm is the global one (`clip_grad_norm_`), evaluation runs on every rank, and checkpoints are
gathered to rank 0 in the one-process layout (`gather_train_state`, `load_train_state`). The
frozen text encoder and VAE stay whole on every rank: they take no gradients and no optimizer
state, run only under no_grad, and sharding them would add an all-gather per layer to every
prompt encoding and decode for memory that a bf16 7B encoder (~15 GiB) leaves to spare.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from spotlight.core.checkpoint import Checkpoint, CheckpointError, load_checkpoint, newest_intact_checkpoint


@contextmanager
def torch_threads(num_threads: int | None):
    """Run the body with `num_threads` torch CPU threads (0 or None: as they are), then give the
    process its thread count back: a run started from a notebook or a test leaves the next one's
    arithmetic as it found it (CPU reductions round differently at another thread count)."""
    before = torch.get_num_threads()
    if num_threads:
        torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass
class FSDPSettings:
    """How to shard the transformer, from the `FSDP_*` variables `accelerate launch` sets from `fsdp_config`."""

    block_classes: tuple[str, ...] = (
        "QwenImageTransformerBlock",
        "Qwen2_5_VLDecoderLayer",
        "Qwen2_5_VLVisionBlock",
        "Qwen3VLTextDecoderLayer",
        "Qwen3VLVisionBlock",
    )
    """Class names of the modules sharded one by one (`fsdp_transformer_layer_cls_to_wrap`)."""
    reshard_after_forward: bool = True
    """Free the gathered weights of a block after its forward (`fsdp_reshard_after_forward`; FULL_SHARD)."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in the backward (`fsdp_activation_checkpointing`)."""
    bf16: bool = False
    """Compute in bfloat16 from float32 shards, reduce gradients in float32 (accelerate's `mixed_precision: bf16`)."""

    @classmethod
    def from_env(cls, env: dict[str, str]) -> FSDPSettings:
        """The settings of an FSDP launch; ValueError for the options spotlight does not implement."""
        if env.get("FSDP_VERSION", "1") != "2":
            raise ValueError(
                f"this accelerate config asks for FSDP version {env.get('FSDP_VERSION', '1')} (accelerate's default "
                "is 1); "
                "spotlight shards with FSDP2: set fsdp_config.fsdp_version: 2 (configs/accelerate/fsdp.yaml), "
                "or launch with configs/accelerate/multi-gpu-ddp.yaml (cpu-2proc.yaml on CPU) for full replicas"
            )
        if env.get("FSDP_OFFLOAD_PARAMS", "false").lower() == "true":
            raise ValueError("fsdp_offload_params: true is not supported by spotlight's FSDP; set it to false")
        precision = env.get("ACCELERATE_MIXED_PRECISION", "no").lower()
        if precision not in ("no", "bf16"):
            raise ValueError(f"mixed_precision: {precision} is not supported with FSDP; use bf16 or 'no'")
        classes = tuple(c.strip() for c in env.get("FSDP_TRANSFORMER_CLS_TO_WRAP", "").split(",") if c.strip())
        return cls(
            block_classes=classes or cls.block_classes,
            reshard_after_forward=env.get("FSDP_RESHARD_AFTER_FORWARD", "true").lower()
            not in ("false", "no_shard", "shard_grad_op"),
            activation_checkpointing=env.get("FSDP_ACTIVATION_CHECKPOINTING", "false").lower() == "true",
            bf16=precision == "bf16",
        )


@dataclass
class DataParallel:
    """This process's place among the data-parallel replicas; the identity when world_size is 1."""

    rank: int = 0
    """Index of this process, 0 .. world_size - 1."""
    world_size: int = 1
    """Number of processes."""
    device: torch.device = torch.device("cpu")  # noqa: RUF009 - a torch.device is immutable
    """Where collectives run: this process's GPU with NCCL, the CPU with gloo."""
    owns_group: bool = False
    """Whether `init_data_parallel` created the process group (and `close` destroys it)."""
    fsdp: FSDPSettings | None = None
    """Set when the transformer is sharded with FSDP2 (`shard_transformer`), None for full replicas."""

    @property
    def is_main(self) -> bool:
        """Rank 0: the process that writes metrics, images and checkpoints."""
        return self.rank == 0

    @property
    def sharded(self) -> bool:
        """Whether the transformer is sharded (FSDP): then every rank must run every forward and backward."""
        return self.fsdp is not None

    def num_padding(self, num_samples: int) -> int:
        """Samples this rank adds to its shard of num_samples so that every rank runs as many (FSDP)."""
        if not self.sharded:
            return 0
        lo, hi = self.shard(num_samples)
        return -(-num_samples // self.world_size) - (hi - lo)

    def padded_shard(self, items: list) -> list:
        """This rank's slice of `items` (`shard`), under FSDP followed by `num_padding` repeats of its last item."""
        lo, hi = self.shard(len(items))
        return items[lo:hi] + items[hi - 1 : hi] * self.num_padding(len(items))

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
        Under FSDP the backward has already summed them (a reduce-scatter with divide factor 1).
        """
        if self.world_size == 1 or self.sharded:
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

    def clip_grad_norm_(self, params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        """Clip the gradients of `params` to a global norm of max_norm; returns the norm before clipping.

        Under FSDP the gradients are shards (DTensors): the norm of the local shards is reduced over
        ranks (`full_tensor`), so every rank clips by the norm of the whole gradient.
        """
        if not self.sharded:
            return torch.nn.utils.clip_grad_norm_(params, max_norm)
        grads = [p.grad for p in params if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads).full_tensor()
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return norm

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

    def started(self, error: BaseException | None) -> None:
        """Every rank learns whether rank 0's start-up (lock, ledger, runtime) raised `error`:
        rank 0 raises it, the others a ValueError quoting it (else they would wait for rank 0 in
        their first collective)."""
        failed = self.broadcast_object(None if error is None else str(error))
        if error is not None:
            raise error
        if failed is not None:
            raise ValueError(f"rank 0 could not start the run: {failed}")

    def finish(self) -> None:
        """After a successful run: wait until every rank is done before the group is torn down.

        Without it a rank that finished first can destroy its gloo pairs while the other still
        completes the last collective; the likely cause of one SIGABRT in CI on the 2-rank FSDP
        test ("terminate called without an active exception" from the rank left behind). Not on
        an error path:
        a rank that raised would wait here for ranks that never arrive.
        """
        if self.world_size > 1 and self.owns_group:
            import torch.distributed as dist

            dist.barrier()

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
    nothing is initialised. An FSDP config (ACCELERATE_USE_FSDP) adds `FSDPSettings`; the trainer
    then shards its model with `shard_module`. The backend is NCCL when CUDA is present, else gloo
    (a MULTI_GPU accelerate config on a machine without GPUs gives gloo processes:
    configs/accelerate/cpu-2proc.yaml).
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        return DataParallel()
    fsdp = None
    if os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true":
        fsdp = FSDPSettings.from_env(dict(os.environ))
    import torch.distributed as dist

    device = torch.device("cpu")
    if torch.cuda.is_available():
        # model.device "cuda" then means this process's GPU.
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if dist.is_initialized():
        return DataParallel(rank=dist.get_rank(), world_size=dist.get_world_size(), device=device, fsdp=fsdp)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return DataParallel(rank=dist.get_rank(), world_size=world_size, device=device, owns_group=True, fsdp=fsdp)


def load_resume_checkpoint(dp: DataParallel, run_dir: str | os.PathLike, resume: bool = True) -> Checkpoint | None:
    """The checkpoint a run resumes from, loaded and verified on every rank, or None (a fresh run).

    Rank 0 picks the newest intact checkpoint in `run_dir` (a damaged newer one is moved aside:
    `checkpoint.newest_intact_checkpoint`) and every other rank loads that one (checksums
    verified), so under a launch over several machines the run directory must be on a filesystem
    they share. A collective (every rank calls it, with the same `resume`): if some rank cannot
    load it (the path is missing there, a partial copy, a corrupt file), every rank raises the same
    ValueError naming those ranks, instead of the others waiting for a rank that died alone in
    their next collective."""
    ckpt, error = None, None
    if resume and dp.is_main:
        try:
            ckpt = newest_intact_checkpoint(run_dir)
        except (OSError, CheckpointError) as err:
            if dp.world_size == 1:
                raise
            error = err
    picked = dp.broadcast_object((None if ckpt is None else ckpt.path, None if error is None else str(error)))
    if picked[1] is not None:
        raise CheckpointError(picked[1]) from error
    latest = picked[0]
    if latest is None:
        return None
    if not dp.is_main:
        try:
            ckpt = load_checkpoint(latest)
        except (OSError, CheckpointError) as err:
            error = err
    if dp.world_size > 1:
        failed = dp.all_gather_rows(torch.tensor([int(error is not None)], device=dp.device)).tolist()
        lacking = [rank for rank, f in enumerate(failed) if f]
        if lacking:
            raise ValueError(
                f"rank(s) {lacking} of {dp.world_size} cannot read the checkpoint {latest} that rank 0 resumes from"
                + (f" (rank {dp.rank}: {error})" if error is not None else "")
                + ": every rank loads it, so on several machines --run-dir must be a path on a filesystem "
                "they all share"
            ) from error
    return ckpt


# -- FSDP: sharding the transformer ---------------------------------------------------------------


def shard_module(
    module: torch.nn.Module,
    dp: DataParallel,
    *,
    enable_checkpointing: Callable[[], None],
    hint: str,
    units: Sequence[torch.nn.Module] = (),
) -> tuple[int, int]:
    """Shard `module` in place with FSDP2 as `dp.fsdp` says; returns (local, full) parameter counts.

    Every rank first takes rank 0's trainable weights (accelerate's `fsdp_sync_module_states`; the
    trainers' LoRA init already follows train.seed, this covers any policy); the frozen base is
    loaded from the same files everywhere. Then each block (the modules of `fsdp_transformer_layer_cls_to_wrap`'s
    classes
    that `module` contains) and the root are `fully_shard`ed: afterwards every parameter is a
    DTensor holding 1/world_size of its rows on this rank. The gradient reduction sums (divide
    factor 1): the trainers weight each rank's loss by its share of the minibatch, as with
    `all_reduce_grads`, so the sum is the one-process gradient.

    Args:
        enable_checkpointing: turns on the model's own per-block activation checkpointing.
        hint: the block classes to name when the config lists none that `module` contains.
        units: submodules that are called on their own, outside `module`'s forward, sharded as
            units of their own after the blocks (their direct weights would otherwise stay sharded
            there: only a unit's own forward gathers them).
    """
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    settings = dp.fsdp
    assert settings is not None
    dp.broadcast_tensors([p for p in module.parameters() if p.requires_grad])
    blocks = [m for m in module.modules() if type(m).__name__ in settings.block_classes]
    if not blocks:
        raise ValueError(
            f"fsdp_transformer_layer_cls_to_wrap names {list(settings.block_classes)}, none of which the model "
            f"({type(module).__name__}) contains; list {hint} (configs/accelerate/fsdp.yaml lists the classes of "
            "every model spotlight trains)"
        )
    if settings.activation_checkpointing:
        enable_checkpointing()
    # bf16: compute in bf16 from float32 shards (the optimizer's master weights), reduce in float32.
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if settings.bf16
        else MixedPrecisionPolicy()
    )
    for block in [*blocks, *units]:
        fully_shard(block, reshard_after_forward=settings.reshard_after_forward, mp_policy=mp)
    fully_shard(module, mp_policy=mp)  # the root keeps its (small) weights gathered between forward and backward
    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            # A plain SUM: gloo has no PREMUL_SUM, and with factor 1 there is nothing to multiply.
            m.set_force_sum_reduction_for_comms(True)
    local = sum(p.to_local().numel() for p in module.parameters())
    return local, sum(p.numel() for p in module.parameters())


@contextmanager
def swapped_shards(transformer, params: list[torch.Tensor], values: list[torch.Tensor]):
    """Run with `values` (clones of this rank's shards of `params`) as the sharded weights, then restore.

    The FSDP form of swapping in another set of weights (the old policy, the KL reference): a
    deepcopy of a sharded module is not one, and a whole copy per rank is what FSDP avoids. The
    modules are resharded first, so the next forward gathers the swapped shards, and again at
    the end, so that the backward of an earlier forward gathers the restored ones.
    """
    from torch.distributed.fsdp import FSDPModule

    modules = [m for m in transformer.modules() if isinstance(m, FSDPModule)]
    with torch.no_grad():
        for m in modules:
            m.reshard()
        current = [p.detach().clone() for p in params]
        for p, v in zip(params, values):
            p.copy_(v)
    try:
        yield
    finally:
        with torch.no_grad():
            for m in modules:
                m.reshard()
            for p, c in zip(params, current):
                p.copy_(c)


def _trainable_names(model: torch.nn.Module) -> list[str]:
    """Names of the trainable parameters, in the optimizer's order (the trainers' `params`)."""
    return [n for n, p in model.named_parameters() if p.requires_grad]


def _peft_to_model_keys(model: torch.nn.Module) -> dict[str, str]:
    """peft's key (`get_peft_model_state_dict`, adapter name dropped) of each LoRA parameter -> its model name."""
    from peft.utils import get_peft_model_state_dict

    names = [n for n, _ in model.named_parameters()]
    tagged = get_peft_model_state_dict(model, state_dict={n: torch.tensor(i) for i, n in enumerate(names)})
    return {key: names[int(tag)] for key, tag in tagged.items()}


def gather_sharded_weights(dp: DataParallel, model: torch.nn.Module, has_lora: bool) -> dict[str, torch.Tensor] | None:
    """The trainable weights of an FSDP-sharded `model`, whole, on rank 0's CPU (None on the others).

    A collective: every rank must call it. The layout is the one-process `trainable_state`'s: peft's
    keys with LoRA, else the trainable parameters by name. The result is a copy.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    # Full tensors on rank 0's CPU (the others get {}); only the trainable weights: with LoRA the
    # frozen base is not gathered.
    weights = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    )
    if not dp.is_main:
        return None
    if has_lora:
        from peft.utils import get_peft_model_state_dict

        return get_peft_model_state_dict(model, state_dict=weights)
    # Persistent buffers and a tied weight's second name are in a state dict, not among the parameters.
    names = set(_trainable_names(model))
    return {k: v for k, v in weights.items() if k in names}


def gather_sharded_train_state(
    dp: DataParallel, model: torch.nn.Module, has_lora: bool, optimizer: torch.optim.Optimizer
) -> tuple[dict, dict] | None:
    """(trainable weights, optimizer state) of an FSDP-sharded `model` in the one-process layout on
    rank 0, None on the others: `gather_sharded_weights` and `optimizer.state_dict()`'s layout
    (parameters by index). A collective: every rank must call it.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    weights = gather_sharded_weights(dp, model, has_lora)
    optim = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not dp.is_main:
        return None
    index = {name: i for i, name in enumerate(_trainable_names(model))}
    optim = {
        "state": {index[name]: s for name, s in optim["state"].items()},
        "param_groups": [{**g, "params": [index[name] for name in g["params"]]} for g in optim["param_groups"]],
    }
    return weights, optim


def load_sharded_train_state(
    dp: DataParallel,
    model: torch.nn.Module,
    has_lora: bool,
    optimizer: torch.optim.Optimizer,
    weights: dict,
    optim_state: dict,
) -> None:
    """Load `gather_sharded_train_state`'s layout (a checkpoint) into an FSDP-sharded `model` and its
    optimizer; a collective: rank 0's dicts are broadcast and each rank keeps its shards.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    names = _trainable_names(model)
    if has_lora:
        to_model = _peft_to_model_keys(model)
        unexpected = sorted(set(weights) - set(to_model))
        if unexpected:
            raise ValueError(f"LoRA state has keys this model lacks (different lora_rank or model?): {unexpected[:3]}")
        weights = {to_model[k]: v for k, v in weights.items()}
    unknown, missing = sorted(set(weights) - set(names)), sorted(set(names) - set(weights))
    if unknown or missing:
        raise ValueError(
            "checkpoint does not hold this model's trainable weights (different model or LoRA setting?): "
            f"{len(unknown)} unknown {unknown[:3]}, {len(missing)} missing {missing[:3]}"
        )
    optim = {
        "state": {names[i]: s for i, s in optim_state["state"].items()},
        "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in optim_state["param_groups"]],
    }
    # Not strict: only the trainable weights are in the checkpoint (not a LoRA's frozen base, a
    # frozen vision tower, buffers or a tied weight's second name; the keys were checked above), and
    # parameters that never had a gradient (the DiT's last block's text stream, whose output the
    # model drops) have no AdamW state, as in `optimizer.state_dict()` of one process.
    from_rank0 = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
    set_model_state_dict(model, weights if dp.is_main else {}, options=from_rank0)
    set_optimizer_state_dict(model, optimizer, optim if dp.is_main else {}, options=from_rank0)
    # set_optimizer_state_dict first creates a state for every parameter (one AdamW step with zero
    # gradients and lr 0); drop those of the parameters the checkpoint has none for, so that they
    # stay stateless as in the uninterrupted run and the next checkpoint has the same entries.
    saved = set(dp.broadcast_object(sorted(optim["state"]) if dp.is_main else None))
    # The optimizer's parameters (the shards; between forwards the model may hold gathered ones).
    for name, p in zip(names, (p for group in optimizer.param_groups for p in group["params"])):
        if name not in saved:
            optimizer.state.pop(p, None)
