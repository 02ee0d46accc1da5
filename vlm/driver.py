"""The serial VLM GRPO driver: rollout, reward, advantage, reference and old log-probs, update.

Read it top to bottom. Every random choice of iteration k (its examples, the sampling seeds, the
minibatch order) derives from (train.seed, k), so a run resumed from the checkpoint after
iteration k repeats exactly what the uninterrupted run would have done.

`train.schedule` picks how the phases run (the Rollplex paper). `serial` (`SerialSchedule`, below):
each phase runs the whole model over [prompt, response] in turn, as veRL and TRL do. `rollplex`
(`vlm.rollplex.RollplexSchedule`): the response-independent prefix of the reference and actor
passes runs while the rollout decodes, and the later phases run only the response suffix; the
losses and gradients are the serial ones up to float order.

Data parallel (`accelerate launch` or `torchrun`, see `spotlight/core/distributed.py`), either schedule:
the global batch and its seeds are the one-process ones; each rank rolls out a contiguous slice of
the P * G rows (a group may span two ranks; sample g of prompt p keeps its seed whatever the rank),
the rewards are all-gathered before the group advantages, every rank walks the same global
minibatches with the loss divisors of the whole minibatch, gradients are summed over ranks before
clipping, only rank 0 writes (config, metrics, checkpoints), and the held-out eval is split over
the ranks (`vlm.evaluate.evaluate`'s `dp`).

FSDP (configs/accelerate/fsdp.yaml, serial schedule): the model is sharded
(`distributed.shard_module`: every decoder layer and vision block, then the root), so every
forward is a collective and every rank runs as many: the rollout is padded to the same row count
and decodes with transformers' `synced_gpus`; the reference and old log-prob passes score as many
rows on every rank (repeats of a row, dropped); in the update a rank with fewer micro-batches of a
minibatch runs zero-weight ones (`UpdateShard.spare`); the held-out eval's slices are padded alike; the
KL reference of a full fine-tune is a clone of each rank's shards swapped in
(`distributed.swapped_shards`); checkpoints are gathered to rank 0 in the one-process layout.
The Rollplex schedule is refused: its prefix passes run in a worker thread while the rollout
decodes, and two threads' all-gathers would not run in the same order on every rank.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from rich.console import Console

from spotlight.core.checkpoint import capture_rng_state, restore_rng_state, save_checkpoint
from spotlight.core.config_io import dump_yaml, save_config
from spotlight.core.cost import CostLedger
from spotlight.core.distributed import (
    DataParallel,
    gather_sharded_train_state,
    init_data_parallel,
    load_resume_checkpoint,
    load_sharded_train_state,
    shard_module,
    torch_threads,
)
from spotlight.core.optim import run_cooldown_scale
from spotlight.core.rewards import gather_rewards
from spotlight.core.runlock import RunLock, remove_if_empty_run
from spotlight.core.seeds import derive_seed
from spotlight.core.time_budget import IterationBudget, progress_total
from spotlight.core.tracking import iteration_progress, print_run_summary, run_summary, run_tracker
from vlm.config import VLMRecipe
from vlm.evaluate import evaluate
from vlm.grpo import group_advantages
from vlm.policy import VLMPolicy, load_policy, load_trainable_state, response_logprobs, trainable_state
from vlm.rewards import CombinedReward
from vlm.rollout import ENGINES, Rollout, RolloutEngine, prompts_of
from vlm.rollplex import RollplexSchedule
from vlm.task import TrainStream, example_image
from vlm.update import Reference, UpdateShard, batched_logprobs, update


class SerialSchedule:
    """The phases one after another, each over the whole sequence (veRL, TRL): the baseline schedule.

    `rows` index the iteration's whole rollout (row // G is the prompt); `batch` is the rollout of
    those rows. With data parallelism `rollout` gets this rank's rows of the P * G and the prompts
    they belong to, and `update` this rank's `UpdateShard` (`batch` None: none of the update's rows).
    """

    def __init__(
        self,
        policy: VLMPolicy,
        engine: RolloutEngine,
        reference: Reference,
        optimizer: torch.optim.Optimizer,
        cfg: VLMRecipe,
    ):
        self.policy, self.engine, self.reference, self.optimizer, self.cfg = policy, engine, reference, optimizer, cfg
        self.lr_scale = 1.0  # the learning-rate factor the driver sets per update (train.lr_cooldown)

    def rollout(self, prompts, seed: int, rows: range | None = None, pad: int = 0) -> Rollout:
        rc = self.cfg.rollout
        return self.engine.generate(
            prompts, self.cfg.train.group_size, rc.max_new_tokens, rc.temperature, seed=seed, rows=rows, pad=pad
        )

    def reference_logprobs(self, batch: Rollout, rows: list[int]) -> torch.Tensor:
        return self.reference.logprobs(batch, self.cfg.rollout.temperature, self.cfg.train.micro_batch_size)

    @torch.no_grad()
    def old_logprobs(self, batch: Rollout, rows: list[int]) -> torch.Tensor:
        return batched_logprobs(self.policy, batch, self.cfg.rollout.temperature, self.cfg.train.micro_batch_size)

    def update(
        self,
        batch: Rollout | None,
        rows: list[int],
        adv_B: torch.Tensor,
        old_logp_BT,
        ref_logp_BT,
        iteration: int,
        *,
        shard: UpdateShard | None = None,
    ) -> dict[str, float]:
        return update(
            self.policy,
            self.optimizer,
            batch,
            adv_B,
            old_logp_BT,
            ref_logp_BT,
            self.cfg,
            iteration,
            shard=shard,
            lr_scale=self.lr_scale,
        )

    def close(self) -> None:
        pass


def make_schedule(
    name: str,
    policy: VLMPolicy,
    engine: RolloutEngine,
    reference: Reference,
    optimizer: torch.optim.Optimizer,
    cfg: VLMRecipe,
):
    """The `train.schedule` of the recipe."""
    if name == "rollplex":
        return RollplexSchedule(policy, engine, reference, optimizer, cfg)
    if name == "serial":
        return SerialSchedule(policy, engine, reference, optimizer, cfg)
    raise ValueError(f"train.schedule must be 'serial' or 'rollplex', got {name!r}")


def checkpoint_layers(policy: VLMPolicy) -> None:
    """transformers' per-layer activation checkpointing (FSDP's `fsdp_activation_checkpointing`).

    transformers recomputes a layer in the backward only while that layer's own `training` flag is
    set. The policy stays in eval mode (no dropout: the rollout, the reference and the update see
    one function), so only the layers' flags are set; their submodules, where dropout would act,
    stay in eval mode. Without gradients (rollout, reference) a layer runs as is.
    """
    from transformers.modeling_layers import GradientCheckpointingLayer

    policy.base_model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    for m in policy.model.modules():
        if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing:
            m.training = True


def shard_policy(policy: VLMPolicy, dp: DataParallel, cfg: VLMRecipe) -> tuple[int, int]:
    """Shard the policy's model with FSDP2 (`distributed.shard_module`); returns (local, full) parameter counts.

    The root is the transformers model, under peft's wrapper with LoRA (peft's `generate` calls it
    directly); the vision tower is a unit of its own (`generate` encodes the images outside the
    model's forward).
    """
    import warnings

    from torch.distributed.fsdp import FSDPModule

    # The logits come back as a view (transformers' `logits_to_keep` slice); nothing here modifies
    # them in place (`vlm.policy.token_logprobs`), which is what FSDP warns about.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    hint = "Qwen2_5_VLDecoderLayer,Qwen2_5_VLVisionBlock (Qwen3-VL: Qwen3VLTextDecoderLayer,Qwen3VLVisionBlock)"
    counts = shard_module(
        policy.base_model,
        dp,
        enable_checkpointing=lambda: checkpoint_layers(policy),
        hint=hint,
        units=[policy.base_model.model.visual],
    )
    # FSDP2 takes the first sharded module to run forward as the root, and `generate` runs the
    # vision tower before the model: one forward of the whole model (a one-token score) goes first.
    first = TrainStream(cfg.task, seed=cfg.train.seed).batch(0, 1)[0]
    with torch.no_grad():
        response_logprobs(
            policy,
            policy.encode([first.question], [example_image(first, cfg.task)]),
            torch.tensor([[policy.eos_token_id]]),
            torch.ones(1, 1, dtype=torch.long),
            cfg.rollout.temperature,
        )
    # The root keeps its weights gathered after a forward: shard them again before the optimizer
    # and the reference take the parameters (the shards).
    for m in policy.model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()
    return counts


def run_training(cfg: VLMRecipe, run_dir: str | Path, *, resume: bool = True, progress: bool = True) -> dict:
    """Post-train the policy of `cfg` with GRPO, writing config, metrics and checkpoints to run_dir."""
    # One process unless launched by accelerate/torchrun; then only rank 0 writes.
    run_dir = Path(run_dir)
    dp = init_data_parallel()
    created = not run_dir.exists()
    lock, ledger = None, None
    try:
        setup_error: BaseException | None = None
        if dp.is_main:
            try:
                cfg.validate()  # before anything is written: a bad recipe leaves no run dir behind
                lock = RunLock(run_dir, "spotlight vlm train")  # one writer per run directory
                # The cost clock starts before anything loads (spotlight.core.cost); N processes hold N GPUs.
                ledger = CostLedger(
                    run_dir, replace(cfg.cost, trainer_gpus=max(cfg.cost.trainer_gpus, dp.world_size)), resume=resume
                )
            except BaseException as err:
                setup_error = err
        dp.started(setup_error)
        with torch_threads(cfg.train.num_threads):  # for the run only
            result = _train(cfg, run_dir, dp, ledger, resume=resume, progress=progress and dp.is_main)
        dp.finish()
        return result
    finally:
        dp.close()
        if created and dp.is_main:
            remove_if_empty_run(run_dir)  # while the lock is held: no other trainer can have started there
        if lock is not None:
            lock.release()


def _train(
    cfg: VLMRecipe, run_dir: Path, dp: DataParallel, ledger: CostLedger | None, *, resume: bool, progress: bool
) -> dict:
    """The iteration loop (every rank runs it; rank 0 writes, and charges the ledger)."""
    run = _Run(cfg, run_dir, dp, ledger, progress=progress)
    run.resume(resume)
    tracking = run_tracker(run_dir, cfg, is_main=dp.is_main, resume_step=run.start_iter)
    total = cfg.train.num_iterations
    with (
        tracking as tracker,
        iteration_progress(run.console, "VLM GRPO", total=total, completed=run.start_iter) as (
            bar,
            task,
        ),
    ):
        for it in range(run.start_iter, total):
            metrics = run.iteration(it)
            stop = run.publish(it, metrics, tracker)
            last = stop or it + 1 == total
            bar.update(
                task,
                advance=1,
                total=progress_total(run.budget, it + 1, total, stopping=last),
                description=f"reward {metrics['reward/mean']:.3f}",
            )
            if stop:
                run.console.print(
                    f"train.max_minutes={cfg.train.max_minutes}: iteration {it + 2} would not end in time; stopping "
                    f"after {it + 1}"
                )
                break
    run.schedule.close()
    summary = run_summary(
        [m["reward/accuracy"] if "reward/accuracy" in m else m["reward/mean"] for m in run.history],
        names=("train_accuracy_first", "train_accuracy_last"),
        window=10,
        start_iter=run.start_iter,
        seconds=run.budget.elapsed_s(),
        last_ckpt=run.last_ckpt,
    )
    print_run_summary(run.console, "spotlight vlm train", summary)
    return summary


class _Run:
    """One `spotlight vlm train` run in a trainer process: the policy, its schedule and the loop's
    steps (`iteration`: rollout, rewards, advantages, log-prob passes and update; then `publish`)."""

    def __init__(self, cfg: VLMRecipe, run_dir: Path, dp: DataParallel, ledger: CostLedger | None, *, progress: bool):
        self.cfg, self.run_dir, self.dp, self.ledger = cfg, run_dir, dp, ledger
        self.console = Console(quiet=not progress)
        tc, P, G = cfg.train, cfg.train.prompts_per_iteration, cfg.train.group_size
        # Prompts rolled out per iteration: P, plus the refill candidates of dynamic sampling.
        self.num_rollout = num_rollout = P + tc.refill_prompts
        if num_rollout * G < dp.world_size:
            raise ValueError(
                f"train.prompts_per_iteration * train.group_size = {P * G} samples for {dp.world_size} processes: "
                "give every process at least one"
            )
        if dp.sharded and tc.schedule == "rollplex":
            raise ValueError(
                "train.schedule=rollplex does not run under FSDP: its prefix passes run in a worker thread while the "
                "rollout decodes, and FSDP's all-gathers must run in one order on every rank; set "
                "train.schedule=serial, or launch with configs/accelerate/multi-gpu-ddp.yaml (full replicas, both "
                "schedules)"
            )
        if dp.is_main:
            save_config(cfg, run_dir / "config.yaml")
        self.policy = policy = load_policy(cfg.model, seed=tc.seed)
        if dp.sharded:  # rank 0's trainable weights, then sharded
            local, full = shard_policy(policy, dp, cfg)
            counts = dp.all_gather_rows(torch.tensor([local])).tolist()
            self.console.print(f"fsdp: model sharded over {dp.world_size} ranks, local parameters {counts} of {full}")
        params = [p for p in policy.model.parameters() if p.requires_grad]
        if not dp.sharded:
            # Every replica starts from rank 0's weights, as DDP does (the LoRA init follows train.seed
            # already; this also covers a policy loaded otherwise).
            dp.broadcast_tensors(params)
        engine = ENGINES[cfg.rollout.engine](policy, batch_size=cfg.rollout.batch_size, synced_gpus=dp.sharded)
        reference = Reference(policy, tc.beta, sharded=dp.sharded)
        self.optimizer = torch.optim.AdamW(params, lr=tc.lr, betas=(0.9, tc.adam_beta2), weight_decay=tc.weight_decay)
        self.reward_fn = CombinedReward(cfg.reward.weights)
        self.stream = TrainStream(cfg.task, seed=tc.seed)
        self.schedule = make_schedule(tc.schedule, policy, engine, reference, self.optimizer, cfg)
        # With a single epoch and a single minibatch the update runs at the weights that sampled, so
        # the old log-probs are the new ones detached (same weights, same inputs): skip that pass.
        self.on_policy = tc.num_inner_epochs == 1 and tc.minibatch_size >= P * G
        self.lo, self.hi = dp.shard(num_rollout * G)  # this rank's rows of every rollout (all in one process)
        self.mine = prompts_of(range(self.lo, self.hi), G)  # and the prompts they belong to
        self.num_pad = dp.num_padding(num_rollout * G)  # FSDP: rows sampled and dropped, as many on every rank
        # Where each rank's rows start and end (FSDP: the update's micro-batch counts of every rank).
        self.bounds = [num_rollout * G * r // dp.world_size for r in range(dp.world_size + 1)]
        if dp.world_size > 1:
            self.console.print(
                f"data parallel: {dp.world_size} processes on {dp.device.type}, {self.hi - self.lo} of "
                f"{num_rollout * G} samples on rank 0"
            )
        self.start_iter, self.last_ckpt, self.history = 0, None, []
        self.budget = IterationBudget(tc.max_minutes)
        self.cooling = tc.lr_cooldown > 0 and tc.max_minutes > 0

    def resume(self, resume: bool) -> None:
        """Load the newest intact checkpoint (rank 0 picks it, every rank loads it)."""
        dp, policy = self.dp, self.policy
        ckpt = load_resume_checkpoint(dp, self.run_dir, resume)
        if ckpt is None:
            return
        self.last_ckpt = ckpt.path
        if dp.sharded:  # a collective: rank 0's state is broadcast, each rank keeps its shards
            load_sharded_train_state(
                dp, policy.model, policy.has_lora, self.optimizer, ckpt.tensors["trainable"], ckpt.optimizer_state
            )
        else:
            load_trainable_state(policy, ckpt.tensors["trainable"])
            self.optimizer.load_state_dict(ckpt.optimizer_state)
        restore_rng_state(ckpt.rng_state)
        self.start_iter = ckpt.step
        self.console.print(f"resuming from {ckpt.path} (iteration {self.start_iter})")

    def iteration(self, it: int) -> dict:
        """Rollout, rewards, advantages, log-prob passes and update of iteration `it`; its metrics."""
        cfg, dp, tc, G = self.cfg, self.dp, self.cfg.train, self.cfg.train.group_size
        lo, hi = self.lo, self.hi
        self.budget.starts()
        t0 = time.monotonic()
        # 1. Rollout: G seeded responses per prompt with the current weights; each rank samples its
        #    rows. All P prompts are encoded together, so the left padding is the one-process one.
        #    The refill candidates of dynamic sampling are slots P.. of the iteration: the first P
        #    prompts are the ones a run without refill sees.
        examples = self.stream.batch(it, self.num_rollout)
        prompts = self.policy.encode([e.question for e in examples], [example_image(e, cfg.task) for e in examples])
        if len(self.mine) < self.num_rollout:
            prompts = prompts.select(list(self.mine))
        ro = self.schedule.rollout(prompts, seed=derive_seed(tc.seed, it, 0), rows=range(lo, hi), pad=self.num_pad)
        t1 = time.monotonic()
        # 2. Verifiable rewards and group-relative advantages (flat groups carry no signal). Every
        #    rank gets the whole batch's rewards: the group statistics are global.
        answers = [e.answer for e in examples for _ in range(G)]
        reward = gather_rewards(dp, self.reward_fn(ro.texts, answers[lo:hi]))
        adv = group_advantages(reward.total_B.view(self.num_rollout, G), std_mode=tc.adv_std, clip=tc.adv_clip)
        num_tokens_B = dp.all_gather_rows(ro.response_mask_BT.sum(dim=1))
        rows = self.update_rows(adv)
        # 3.-4. Reference and old log-probs, then the update (nothing without rows to train on).
        t2 = t3 = time.monotonic()
        stats: dict[str, float] = {}
        if rows:
            stats, (t2, t3) = self.update(it, ro, rows, adv, num_tokens_B)
        t4 = time.monotonic()
        metrics = {
            "reward/mean": float(reward.total_B.mean()),
            **{f"reward/{k}": float(v.mean()) for k, v in reward.components.items()},
            "grpo/zero_variance_groups": adv.num_zero_variance_groups,
            "grpo/rows_updated": len(rows),
            "response/length": float(num_tokens_B.float().mean()),
            **{f"grpo/{k}": v for k, v in stats.items()},
            **({"grpo/lr_scale": self.schedule.lr_scale} if self.cooling and rows else {}),
            "time/rollout_s": t1 - t0,
            "time/reference_s": t2 - t1,
            "time/old_logprobs_s": t3 - t2,
            "time/update_s": t4 - t3,
            "time/iteration_s": t4 - t0,
        }
        self.history.append(metrics)
        return metrics

    def update_rows(self, adv) -> list[int]:
        """The rollout rows the update trains on: all P * G, or (train.drop_flat_groups,
        train.refill_prompts) only the groups with a reward spread, the first P of them with refill."""
        tc, P, G = self.cfg.train, self.cfg.train.prompts_per_iteration, self.cfg.train.group_size
        if not (tc.drop_flat_groups or tc.refill_prompts):
            return list(range(P * G))
        keep_P = adv.trainable_PG.any(dim=1)
        if tc.refill_prompts:  # flat groups are replaced by refill candidates
            keep_P &= torch.cumsum(keep_P.long(), 0) <= P
        return keep_P.repeat_interleave(G).nonzero().squeeze(1).tolist()

    def update(self, it: int, ro: Rollout, rows: list[int], adv, num_tokens_B) -> tuple[dict, tuple[float, float]]:
        """The reference and old log-prob passes and the update on `rows`; (stats, (time after the
        reference pass, time after the old log-probs))."""
        dp, tc, lo, hi, schedule = self.dp, self.cfg.train, self.lo, self.hi, self.schedule
        local = [r for r in rows if lo <= r < hi]  # this rank's rows of the update: a contiguous run of `rows`
        batch = None  # the rollout of those rows (None: this rank holds none of them)
        if local:
            batch = ro if len(local) == hi - lo else ro.select([r - lo for r in local])
        scored, owner_N = batch, None
        if dp.sharded:  # every rank scores as many rows: the busiest rank's count (repeats, dropped after)
            owner_N = torch.tensor([int(np.searchsorted(self.bounds, r, side="right")) - 1 for r in rows])
            width = int(torch.bincount(owner_N, minlength=dp.world_size).max())
            mine_rows = [r - lo for r in local] or [0]  # a rank without rows of the update scores its first
            scored = ro.select(mine_rows + mine_rows[-1:] * (width - len(mine_rows)))
        # Reference log-probs (KL term), then old log-probs (the ratio's denominator).
        ref_logp_BT = schedule.reference_logprobs(scored, local) if tc.beta > 0 and scored is not None else None
        t2 = time.monotonic()
        # On policy (one optimizer step on fresh samples) old == current weights, ratio 1.
        old_logp_BT = None if self.on_policy or scored is None else schedule.old_logprobs(scored, local)
        t3 = time.monotonic()
        if dp.sharded:  # this rank's rows only
            ref_logp_BT = ref_logp_BT[: len(local)] if ref_logp_BT is not None else None
            old_logp_BT = old_logp_BT[: len(local)] if old_logp_BT is not None else None
        # Gradients summed over ranks. Over the last train.lr_cooldown of the run at a falling
        # learning rate (rank 0's clock decides for every rank).
        if self.cooling:
            schedule.lr_scale = dp.broadcast_object(
                run_cooldown_scale(self.budget, it + 1, tc.num_iterations, tc.lr_cooldown, tc.lr_cooldown_floor)
            )
        shard = UpdateShard(
            dp,
            rows.index(local[0]) if local else 0,
            num_tokens_B[rows],
            owner_N=owner_N,
            spare=ro.select([0]) if dp.sharded else None,
        )
        adv_B = adv.adv_PG.reshape(-1)
        stats = schedule.update(batch, local, adv_B[local], old_logp_BT, ref_logp_BT, it, shard=shard)
        return stats, (t2, t3)

    def publish(self, it: int, metrics: dict, tracker) -> bool:
        """Held-out eval, metrics and checkpoint after iteration `it`; True when the time budget ends the run."""
        cfg, dp, tc, step = self.cfg, self.dp, self.cfg.train, it + 1
        # The held-out eval, split over the ranks (every rank takes part; rank 0 logs it).
        if cfg.eval.every and step % cfg.eval.every == 0:
            summary = evaluate(
                self.policy,
                cfg.task,
                batch_size=cfg.eval.batch_size,
                max_new_tokens=cfg.rollout.max_new_tokens,
                synced_gpus=dp.sharded,
                dp=dp,
            )
            metrics.update(
                {f"eval/{k}": v for k, v in summary.items() if k.startswith("accuracy") or k == "format_rate"}
            )
        if dp.is_main:
            if self.ledger is not None:
                self.ledger.charge(spot_gpus=0)  # the VLM path runs on its trainer's GPUs only
                metrics.update(self.ledger.metrics())
            tracker.log(metrics, step=step)
        # Stop before an iteration that would end after train.max_minutes. Rank 0's clock decides for
        # every rank, so that all of them stop after the same iteration.
        out_of_time = step < tc.num_iterations and dp.broadcast_object(not self.budget.next_fits())
        if step % cfg.log.checkpoint_every == 0 or step == tc.num_iterations or out_of_time:
            saved = self.checkpoint(step, {k: v for k, v in metrics.items() if not k.startswith("time/")})
            self.last_ckpt = saved or self.last_ckpt
        return out_of_time

    def checkpoint(self, step: int, metrics: dict) -> Path | None:
        """Save on rank 0 (under FSDP every rank calls this: the state is gathered to rank 0)."""
        cfg, dp, policy = self.cfg, self.dp, self.policy
        if dp.sharded:
            state = gather_sharded_train_state(dp, policy.model, policy.has_lora, self.optimizer)
        else:
            state = (trainable_state(policy), self.optimizer.state_dict()) if dp.is_main else None
        if state is None:
            return None
        return save_checkpoint(
            self.run_dir,
            step,
            tensors={"trainable": state[0]},
            optimizer_state=state[1],
            rng_state=capture_rng_state(),
            meta={
                "kind": "vlm",
                "step": step,
                "metrics": metrics,
                "lora_rank": cfg.model.lora_rank,
                "lora_alpha": cfg.model.lora_alpha,
                "train_vision": cfg.model.train_vision,
            },
            config_yaml=dump_yaml(cfg),
            keep_last=cfg.log.keep_last,
        )
