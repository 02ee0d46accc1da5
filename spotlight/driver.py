"""The DiT GRPO driver: rollout, reward, advantage, update, checkpoint; read it top to bottom.

Every random choice of iteration k (its prompts, the trajectory seeds, the SDE window, the
minibatch order) is derived from (train.seed, k), so a run resumed from the checkpoint after
iteration k repeats exactly what the uninterrupted run would have done.

With seed exploration (`explore.mode` inline or stale, see `explore.py`) the seeds of a group may
instead be chosen among explored candidates, which extend the default seeds of plan_iteration;
in stale mode the next batch is explored with the current weights while the trainer updates.

With `runtime.rollouts=cluster` the rollout runs as jobs on the spot runtime's pull queue, served by
workers on the cluster's on-demand and spot nodes through preemptions (`spot_runtime.py`); it gives
the bits the local rollout gives, so the run is the same run. Exploration always runs there.

Data parallel (`accelerate launch` or `torchrun`, see `core/distributed.py`): the global batch and its
seeds are the one-process ones; each rank rolls out a contiguous slice of the P * G samples, the
rewards are all-gathered before the group advantages, gradients are summed over ranks in the
update, each rank samples a slice of the held-out eval, and only rank 0 writes (metrics, images,
checkpoints, cost) and drives the explorers. Under FSDP the transformer is sharded
(`parallel/fsdp.py: shard_transformer`): every rank then runs every forward (padded rollouts and eval
slices), and checkpoints and the weights published to the explorers are gathered to rank 0.

Cost: every iteration charges its wall time to the run's ledger (`spotlight.core.cost`, `cost.json`): the
trainer's GPUs at the on-demand price, and the spot GPUs the Ray cluster holds at the spot price.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from rich.console import Console

from spot.localray import spot_gpus_held
from spotlight.config import DiTRecipe
from spotlight.core.advantages import group_advantages
from spotlight.core.checkpoint import capture_rng_state, restore_rng_state, save_checkpoint
from spotlight.core.config_io import dump_yaml, save_config
from spotlight.core.cost import CostLedger
from spotlight.core.distributed import DataParallel, init_data_parallel, load_resume_checkpoint, torch_threads
from spotlight.core.optim import run_cooldown_scale
from spotlight.core.rewards import RewardResult, gather_rewards
from spotlight.core.runlock import RunLock, remove_if_empty_run
from spotlight.core.seeds import derive_seed
from spotlight.core.time_budget import IterationBudget, progress_total
from spotlight.core.tracking import iteration_progress, print_run_summary, run_summary, run_tracker
from spotlight.evaluate import evaluate
from spotlight.explore import Exploration, NullExploration, start_exploration
from spotlight.mirror import CheckpointMirror
from spotlight.parallel.fsdp import (
    LocalWeightsSource,
    ShardedWeightsSource,
    gather_train_state,
    gather_trainable_weights,
    load_train_state,
    shard_transformer,
)
from spotlight.policy import load_policy
from spotlight.prompts import train_and_eval_prompts
from spotlight.rewards import build_reward
from spotlight.rollout import Rollout, resolve_autocast, rollout
from spotlight.sampling import Trajectory, qwen_image_sigmas, sde_step_indices
from spotlight.seed_selection import opens_before_rollout, publishes_before_rollout, publishes_before_update
from spotlight.spot_runtime import SpotRuntime, runtime_wanted, start_runtime
from spotlight.update import GRPOTrainer

logger = logging.getLogger(__name__)


def plan_iteration(cfg: DiTRecipe, train_prompts: list[str], iteration: int) -> tuple[list[str], list[int], list[int]]:
    """Prompts (P * G, prompt-major), default trajectory seeds and stochastic steps of one iteration.

    A pure function of (cfg, train_prompts, iteration): stale exploration calls it for iteration
    k + 1 during iteration k. Seed g of prompt slot p is derive_seed(train.seed, k, p, g), the
    first G candidates of `explore.candidate_seeds`.
    """
    rng = np.random.default_rng(derive_seed(cfg.train.seed, iteration))
    num_prompts, group = cfg.train.prompts_per_iteration, cfg.train.group_size
    chosen = rng.choice(len(train_prompts), size=num_prompts, replace=num_prompts > len(train_prompts))
    prompts = [train_prompts[i] for i in chosen for _ in range(group)]
    seeds = [derive_seed(cfg.train.seed, iteration, p, g) for p in range(num_prompts) for g in range(group)]
    start = 0
    if cfg.sample.sde_window_size:
        lo, hi = cfg.sample.sde_window_range
        start = int(rng.integers(lo, hi + 1))
    return prompts, seeds, sde_step_indices(cfg.sample.num_steps, cfg.sample.sde_window_size, start)


def run_training(cfg: DiTRecipe, run_dir: str | Path, *, resume: bool = True, progress: bool = True) -> dict:
    """Post-train the policy of `cfg` with GRPO, writing config, metrics, images and checkpoints to run_dir."""
    started = time.monotonic()
    run_dir = Path(run_dir)
    # One process unless launched by accelerate/torchrun; then only rank 0 writes and explores.
    dp = init_data_parallel()
    mirror, ledger, rt, lock = None, None, None, None
    exploration: Exploration | NullExploration = NullExploration()  # mode none, and ranks other than 0
    if cfg.runtime.rollouts == "cluster" and dp.world_size > 1:
        dp.close()
        raise ValueError(
            "runtime.rollouts=cluster runs with one trainer process (its rank would wait for the others' rollouts); "
            "launch one process, or keep runtime.rollouts=local under accelerate/torchrun"
        )
    created = not run_dir.exists()
    try:
        setup_error: BaseException | None = None
        if dp.is_main:
            try:
                cfg.validate()  # before anything is written: a bad recipe leaves no run dir behind
                mirror = CheckpointMirror(cfg.log.store_url, keep_last=cfg.log.keep_last) if cfg.log.store_url else None
                # One writer per run directory and store (a second trainer refuses; a dead one is taken over).
                lock = RunLock(
                    run_dir, "spotlight train", store=mirror.store if mirror else None, lease_s=cfg.log.store_lease_s
                )
                if mirror is not None:
                    mirror.guard = lock.check
                if mirror is not None and resume:
                    # A replacement machine starts with an empty run dir: bring the newest checkpoint (and the
                    # metrics and cost ledger up to it) back from the store before anything reads the run dir.
                    mirror.restore(run_dir)
                # The cost clock starts before anything loads: a node is paid for while it loads the model too.
                # A launch of N processes holds at least N GPUs: charge those when the recipe says fewer.
                ledger = CostLedger(
                    run_dir, replace(cfg.cost, trainer_gpus=max(cfg.cost.trainer_gpus, dp.world_size)), resume=resume
                )
                # The runtime's workers (none without cluster rollouts or exploration: Ray is then never
                # imported) load the model while the trainer does.
                rt = start_runtime(cfg, run_dir) if runtime_wanted(cfg) else None
                if cfg.explore.emulated_nodes and cfg.explore.mode != "none":
                    from spotlight.emulated import EmulatedExplorers

                    pool = EmulatedExplorers(cfg)
                else:
                    pool = rt.explorers() if rt is not None else None
                exploration = start_exploration(cfg, run_dir, pool)
            except BaseException as err:
                setup_error = err
        dp.started(setup_error)
        with torch_threads(cfg.train.num_threads):  # for the run only
            result = _train(
                cfg,
                run_dir,
                dp,
                exploration,
                rt,
                ledger,
                mirror,
                lock,
                resume=resume,
                progress=progress and dp.is_main,
                started=started,
            )
        dp.finish()
        return result
    finally:
        exploration.close()
        if rt is not None:
            rt.close()
        dp.close()
        if created and dp.is_main:
            remove_if_empty_run(run_dir)  # while the lock is held: no other trainer can have started there
        if lock is not None:
            lock.release()


def _train(
    cfg: DiTRecipe,
    run_dir: Path,
    dp: DataParallel,
    exploration: Exploration | NullExploration,
    rt: SpotRuntime | None,
    ledger: CostLedger | None,
    mirror: CheckpointMirror | None,
    lock: RunLock | None,
    *,
    resume: bool,
    progress: bool,
    started: float,
) -> dict:
    """The iteration loop; on ranks other than 0, runtime, ledger, mirror and lock are None and the
    exploration a `NullExploration`. `started`: `time.monotonic()` when `run_training` began."""
    run = _Run(cfg, run_dir, dp, exploration, rt, ledger, mirror, lock, progress=progress, started=started)
    run.resume(resume)
    run.announce()
    # prefetch_scope: a prefetch still under way when the loop ends (a stop before the last
    # iteration, an exception) is waited for and dropped, and its worker thread stopped.
    with run.tracking() as tracker, run.progress_bar() as bar, run.policy.prompt_cache.prefetch_scope():
        if rt is not None:
            rt.start_trace()  # a replayed trace's clock runs from the first iteration on
        for it in range(run.start_iter, cfg.train.num_iterations):
            if lock is not None:
                lock.check(fresh=False)  # a newer trainer took the store over: stop before writing more
            batch = run.iteration(it)
            if run.publish(it, batch, tracker, bar):
                break
    return run.finish()


@dataclass
class _Batch:
    """One iteration's rollout and what it scored."""

    prompts: list[str]
    ro: Rollout
    reward: RewardResult
    metrics: dict


class _Run:
    """One `spotlight train` run in a trainer process: the model, the trainer and the loop's steps.

    Each iteration is `iteration` (the batch, its rollout, rewards, advantages and update, with
    exploration around them) and then `publish` (held-out eval, metrics, images, checkpoint, and
    whether to stop).
    """

    def __init__(self, cfg, run_dir, dp, exploration, rt, ledger, mirror, lock, *, progress: bool, started: float):
        self.cfg, self.run_dir, self.dp, self.exploration = cfg, run_dir, dp, exploration
        self.rt, self.ledger, self.mirror, self.started = rt, ledger, mirror, started
        self.console = Console(quiet=not progress)
        if dp.is_main:
            save_config(cfg, run_dir / "config.yaml")
        self.train_prompts, self.eval_prompts = train_and_eval_prompts(cfg.data, cfg.reward.weights)
        self.policy = load_policy(cfg.model, seed=cfg.train.seed)
        P, G = cfg.train.prompts_per_iteration, cfg.train.group_size
        if dp.sharded:
            if P * G < dp.world_size:
                raise ValueError(
                    f"FSDP on {dp.world_size} processes needs a sample per rank: raise train.prompts_per_iteration * "
                    f"train.group_size ({P * G})"
                )
            local, full = shard_transformer(self.policy, dp)
            counts = dp.all_gather_rows(torch.tensor([local])).tolist()
            self.console.print(
                f"fsdp: transformer sharded over {dp.world_size} ranks, local parameters {counts} of {full}"
            )
        self.trainer = GRPOTrainer(self.policy, cfg, dp)
        self.reward_fn = build_reward(cfg.reward.weights, **cfg.reward.options())
        self.sigmas = qwen_image_sigmas(cfg.sample.num_steps, self.policy.latent_shape[0])
        self.lo, self.hi = dp.shard(P * G)  # this rank's samples of every iteration (all of them in one process)
        # Under FSDP every rank rolls out as many samples (sizes differ by at most one): repeats of its last.
        self.num_pad = dp.num_padding(P * G)
        self.autocast = resolve_autocast(cfg.sample.autocast, self.policy.device, cfg.train.objective)
        self.start_iter, self.last_ckpt, self.history = 0, None, []
        # The budget runs on the trainer's clock: time spent waiting for emulated explorers
        # (explore.emulated_nodes) is capacity of other machines, not the trainer's.
        self.emulated_s = 0.0
        self.budget = IterationBudget(cfg.train.max_minutes, clock=lambda: time.monotonic() - self.emulated_s)
        self.cooling = cfg.train.lr_cooldown > 0 and cfg.train.max_minutes > 0

    # -- before the loop ----------------------------------------------------------------------------

    def resume(self, resume: bool) -> None:
        """Load the newest intact checkpoint (rank 0 picks it, every rank loads it)."""
        cfg, dp, policy, trainer = self.cfg, self.dp, self.policy, self.trainer
        ckpt = load_resume_checkpoint(dp, self.run_dir, resume)
        if ckpt is not None:
            self.last_ckpt = ckpt.path
            if trainer.ema is not None and "ema" in ckpt.tensors:
                # The moving average goes through the weights' loader (sharded under FSDP), then the
                # weights themselves; the optimizer state is loaded twice, the second time for good.
                load_train_state(dp, policy, trainer.optimizer, ckpt.tensors["ema"], ckpt.optimizer_state)
                trainer.reset_ema()
            load_train_state(dp, policy, trainer.optimizer, ckpt.tensors["trainable"], ckpt.optimizer_state)
            if trainer.ema is not None and "ema" not in ckpt.tensors:
                trainer.reset_ema()
                self.console.print(
                    f"train.ema_decay={cfg.train.ema_decay}: {ckpt.path} has no moving average; it starts from its "
                    "weights"
                )
            restore_rng_state(ckpt.rng_state)
            self.start_iter = ckpt.step
            if "explore" in ckpt.meta:
                self.exploration.load_state_dict(ckpt.meta["explore"])
            self.console.print(f"resuming from {ckpt.path} (iteration {self.start_iter})")
        self.exploration.truncate_log(self.start_iter)

    def announce(self) -> None:
        """Wait for the runtime's workers, and say how the run is laid out."""
        cfg, dp, console = self.cfg, self.dp, self.console
        P, G = cfg.train.prompts_per_iteration, cfg.train.group_size
        if self.rt is not None:
            ready = self.exploration.wait_ready(cfg.runtime.startup_timeout_s)
            workers = self.rt.wait_ready(cfg.runtime.startup_timeout_s)
            console.print(
                f"runtime: rollouts {cfg.runtime.rollouts}, {workers['spot']} spot and {workers['on_demand']} "
                "on-demand worker(s) ready"
                + (f"; explore.mode={cfg.explore.mode}: {ready} spot group(s) explore" if ready is not None else "")
            )
        elif self.exploration.active and cfg.explore.emulated_nodes:
            console.print(
                f"explore.mode={cfg.explore.mode} on {cfg.explore.emulated_nodes} EMULATED explorer node(s): their "
                "jobs run in this process while the trainer waits (time/emulated_explore_s, not counted in "
                "time/iteration_s)"
            )
        if dp.world_size > 1:
            console.print(
                f"data parallel: {dp.world_size} processes on {dp.device.type}, {self.hi - self.lo} of {P * G} "
                "samples on rank 0"
            )
        if cfg.sample.autocast == "auto" and self.autocast != "none":
            console.print(
                f"sample.autocast=auto: rollouts and evaluation sample in {self.autocast} (sample.autocast=none for "
                "float32)"
            )
        if cfg.train.autocast == "auto" and self.trainer.autocast != "none":
            console.print(
                f"train.autocast=auto: the update's forwards and backward run in {self.trainer.autocast} "
                "(train.autocast=none for float32)"
            )

    def tracking(self):
        """The run's tracker (metrics.jsonl, wandb, images) on rank 0; nothing on the others."""
        return run_tracker(self.run_dir, self.cfg, is_main=self.dp.is_main, resume_step=self.start_iter)

    @contextmanager
    def progress_bar(self):
        total = self.cfg.train.num_iterations
        with iteration_progress(self.console, "GRPO", total=total, completed=self.start_iter) as (bar, task):
            self.task = task
            yield bar

    # -- one iteration ------------------------------------------------------------------------------

    def iteration(self, it: int) -> _Batch:
        """Rollout, rewards, advantages and update of iteration `it`, with exploration around them."""
        cfg, dp, ex, G = self.cfg, self.dp, self.exploration, self.cfg.train.group_size
        self.budget.starts()
        t0 = time.monotonic()
        # 1. The batch: G seeded trajectories per prompt; with exploration, a prompt's seeds may be a
        #    high-contrast subset of its explored candidates. θ_k is published before the rollout for
        #    inline exploration of this batch, or (explore.window "iteration") for stale exploration
        #    of the next one, which then runs until the update ends.
        prompts, seeds, sde_steps = plan_iteration(cfg, self.train_prompts, it)
        nxt = plan_iteration(cfg, self.train_prompts, it + 1) if it + 1 < cfg.train.num_iterations else None
        when = dict(window=cfg.explore.window, iteration=it, has_next_batch=nxt is not None)
        early = self.explore_weights(publishes_before_rollout(cfg.explore.mode, **when))
        t_window = time.monotonic()
        seeds = ex.seeds_for(it, early, prompts[::G], seeds, sde_steps, nxt)
        early.settle()
        if cfg.explore.mode != "none":
            seeds = dp.broadcast_object(seeds)  # only rank 0 holds the explorers
        # 2. Rollout with the current weights.
        t_ro = time.monotonic()
        ro = self.rollout(it, prompts, seeds, sde_steps, nxt)
        t1 = time.monotonic()
        # 3. Rewards; a failed reward leaves NaN, which drops the sample from its group. Every rank
        #    gets the whole batch's rewards: the group statistics are global.
        reward = gather_rewards(dp, self.reward_fn(ro.images, prompts[self.lo : self.hi]))
        # 4. Group-relative advantages; zero-variance groups are filtered.
        P = cfg.train.prompts_per_iteration
        adv = group_advantages(reward.total_B.view(P, G), std_mode=cfg.train.adv_std, clip=cfg.train.adv_clip)
        t2 = time.monotonic()
        # 5. Stale exploration (explore.window "update", and iteration 0): publish θ_k, explore the
        #    next batch with it during the update.
        late = self.explore_weights(publishes_before_update(cfg.explore.mode, **when))
        ex.launch(it, late, reward.total_B, seeds, t2 - t_ro, nxt)
        late.settle()
        # 6. Policy update on the stochastic steps (noise levels, for nft).
        t_up = time.monotonic()
        stats = self.update(ro, adv, it)
        t3 = time.monotonic()
        encoder = self.policy.prompt_cache.end_step()
        # 7. Take the exploration results that are ready; never wait for an explorer. The window the
        #    next budget predicts is the time the explorers had: with the rollout on the cluster, its
        #    spot workers served it first, so they were free only from its end.
        if cfg.runtime.rollouts == "cluster":
            window_start = t1
        else:
            window_start = t_window if opens_before_rollout(cfg.explore.mode, **when) else t_up
        ex.collect(it, t3 - window_start)
        metrics = {
            **_reward_metrics(reward, adv, stats),
            "time/rollout_s": t1 - t_ro,
            "time/reward_s": t2 - t1,
            "time/update_s": t3 - t_up,
            **encoder.metrics(),
            **({"grpo/lr_scale": self.trainer.lr_scale} if self.cooling else {}),
            **ex.metrics(weights_copies=early.copies + late.copies),
            **(self.rt.metrics() if self.rt is not None else {}),
            "time/iteration_s": time.monotonic() - t0,
        }
        # Emulated explorers ran while the trainer waited (spotlight.emulated): not trainer time.
        metrics["time/iteration_s"] -= metrics.get("time/emulated_explore_s", 0.0)
        self.emulated_s += metrics.get("time/emulated_explore_s", 0.0)
        self.history.append(metrics)
        return _Batch(prompts, ro, reward, metrics)

    def rollout(self, it: int, prompts: list[str], seeds: list[int], sde_steps: list[int], nxt) -> Rollout:
        """This rank's samples of the batch, locally or as jobs on the spot runtime (the same bits).

        The step's prompts are encoded once here and held until the update is done: the rollout and
        the update (all G samples, every minibatch) read them (prompt_cache.py). With
        train.prefetch_prompts they were encoded during the previous step, and this rank's slice of
        the next step's prompts is encoded during this one.
        """
        cfg, dp, lo, hi = self.cfg, self.dp, self.lo, self.hi
        prefetch = nxt[0][lo:hi] if nxt is not None and cfg.train.prefetch_prompts else None
        self.policy.prompt_cache.begin_step(prompts[lo:hi], next_prompts=prefetch)
        if cfg.runtime.rollouts == "cluster":
            # Jobs on the pull queue, weights version it (θ_k).
            return self.rt.rollout(it, LocalWeightsSource(self.policy), prompts, seeds, sde_steps, self.sigmas)
        ro = rollout(
            self.policy,
            dp.padded_shard(prompts),
            dp.padded_shard(seeds),
            self.sigmas,
            noise_level=cfg.sample.noise_level,
            sde_steps=sde_steps,
            sde_type=cfg.sample.sde_type,
            guidance_scale=cfg.sample.guidance_scale,
            negative_prompt=cfg.sample.negative_prompt,
            batch_size=cfg.sample.batch_size,
            autocast=self.autocast,
        )
        return _first(ro, hi - lo) if self.num_pad else ro

    def update(self, ro: Rollout, adv, it: int) -> dict:
        """The policy update; over the last train.lr_cooldown of the run at a falling learning rate
        (run_cooldown_scale; rank 0's clock decides for every rank)."""
        if self.cooling:
            tc = self.cfg.train
            self.trainer.lr_scale = self.dp.broadcast_object(
                run_cooldown_scale(self.budget, it + 1, tc.num_iterations, tc.lr_cooldown, tc.lr_cooldown_floor)
            )
        return self.trainer.update(ro, adv, it)

    def explore_weights(self, needed: bool) -> LocalWeightsSource | ShardedWeightsSource:
        """The current trainable weights for the explorers, as `Exploration` takes them. Call its
        `settle()` on every rank after `Exploration` has had its chance to call it."""
        if self.dp.sharded:
            # Rank 0 holds only its shards: every rank must join the gather, but only when rank
            # 0's planner has candidates to sample (ShardedWeightsSource).
            return ShardedWeightsSource(self.dp, self.policy, needed)
        # One process or full replicas: copied only if a candidate is planned, and to the CPU, so
        # that the optimizer step that follows does not change what the explorers load.
        return LocalWeightsSource(self.policy)

    # -- after each iteration -----------------------------------------------------------------------

    def publish(self, it: int, batch: _Batch, tracker, bar) -> bool:
        """Held-out eval, metrics, images and checkpoint of θ_{it+1}; True when the run stops here."""
        cfg, dp, metrics, step = self.cfg, self.dp, batch.metrics, it + 1
        eval_summary = None
        if cfg.eval.every and step % cfg.eval.every == 0:
            # Held-out reward of θ_{k+1}; its time is outside time/iteration_s. Every rank samples its
            # slice of the held-out samples, rank 0 reports.
            with self.trainer.averaged_weights():  # what `spotlight eval` of the checkpoint would score
                eval_summary, _ = evaluate(self.policy, self.eval_prompts, self.reward_fn, cfg, progress=False, dp=dp)
        if dp.is_main:
            if eval_summary is not None:
                metrics["eval/mean_reward"] = eval_summary["mean_reward"]
                metrics["eval/seconds"] = eval_summary["seconds"]
            # Wall time of this process so far on the trainer's clock (a resumed run counts from its
            # restart): start-up, iterations, evaluations and checkpoints, without the waits for
            # emulated explorers. What benchmarks/time_to_target.py counts to a target.
            metrics["time/run_s"] = time.monotonic() - self.started - self.emulated_s
            self.charge_cost()
            metrics.update(self.ledger.metrics())
            tracker.log(metrics, step=step)
        # Stop before an iteration that would end after train.max_minutes, or once eval.stop_at is
        # reached. Rank 0 decides for every rank, so that all of them stop after the same iteration.
        out_of_time = step < cfg.train.num_iterations and dp.broadcast_object(not self.budget.next_fits())
        at_target = cfg.eval.stop_at is not None and dp.broadcast_object(
            eval_summary is not None and eval_summary["mean_reward"] >= cfg.eval.stop_at
        )
        last = step == cfg.train.num_iterations or out_of_time or at_target
        if cfg.log.images_every and (step % cfg.log.images_every == 0 or last):  # and at the end of every run
            # The first sample of each of the first 16 groups, from whichever rank rolled it out.
            P, G, lo, hi = cfg.train.prompts_per_iteration, cfg.train.group_size, self.lo, self.hi
            firsts = dp.all_gather_rows(batch.ro.images[[i - lo for i in range(0, min(P, 16) * G, G) if lo <= i < hi]])
            if dp.is_main:
                tracker.log_images("rollout", firsts, batch.prompts[::G][:16], step=step, nrow=4)
        if step % cfg.log.checkpoint_every == 0 or last:
            self.checkpoint(step, {k: v for k, v in metrics.items() if not k.startswith(("time/", "cost/"))})
        bar.update(
            self.task,
            advance=1,
            total=progress_total(self.budget, step, cfg.train.num_iterations, stopping=last),
            description=f"reward {metrics['reward/mean']:.3f}"
            + (f" · {self.rt.describe()}" if self.rt is not None else ""),
        )
        if out_of_time:
            self.console.print(
                f"train.max_minutes={cfg.train.max_minutes}: iteration {step + 1} would not end in time; stopping "
                f"after {step}"
            )
        elif at_target and step < cfg.train.num_iterations:
            self.console.print(
                f"eval.stop_at={cfg.eval.stop_at}: the held-out reward reached it; stopping after {step}."
            )
        return out_of_time or (at_target and step < cfg.train.num_iterations)

    def checkpoint(self, step: int, metrics: dict) -> None:
        """Gather the training state to rank 0 (a collective under FSDP) and save it there, with the
        moving average if there is one; publish it to the store."""
        dp, cfg, trainer = self.dp, self.cfg, self.trainer
        weights, optimizer_state = gather_train_state(dp, self.policy, trainer.optimizer) or (None, None)
        ema = None
        if trainer.ema is not None:
            with trainer.averaged_weights():  # under FSDP, a collective
                ema = gather_trainable_weights(dp, self.policy)
                ema = ema and {k: v.detach().clone() for k, v in ema.items()}  # not the live tensors
        if not dp.is_main:
            return
        explore_state = self.exploration.state_dict()
        step_dir = save_checkpoint(
            self.run_dir,
            step,
            tensors={"trainable": weights, **({"ema": ema} if ema is not None else {})},
            optimizer_state=optimizer_state,
            rng_state=capture_rng_state(),
            meta={
                "kind": "dit",
                "step": step,
                "metrics": metrics,
                "lora_rank": cfg.model.lora_rank,
                "lora_alpha": cfg.model.lora_alpha,
                **({"explore": explore_state} if explore_state else {}),
            },
            config_yaml=dump_yaml(cfg),
            keep_last=cfg.log.keep_last,
        )
        if self.mirror is not None:
            self.mirror.publish(step_dir, self.run_dir)
        self.last_ckpt = step_dir

    def charge_cost(self) -> None:
        # Spot GPUs held (not only busy): what the spot nodes of the cluster cost right now.
        if self.ledger is not None:
            self.ledger.charge(spot_gpus=spot_gpus_held() if self.rt is not None else 0)

    def finish(self) -> dict:
        self.charge_cost()  # the last checkpoint's time
        summary = run_summary(
            [m["reward/mean"] for m in self.history],
            names=("reward_first", "reward_last"),
            window=5,
            start_iter=self.start_iter,
            seconds=self.budget.elapsed_s(),
            last_ckpt=self.last_ckpt,
        )
        if self.ledger is None:
            return summary
        summary["usd_total"] = round(self.ledger.summary()["usd_total"], 4)
        print_run_summary(self.console, "spotlight train", summary, SUMMARY_LABELS)
        return summary


def _reward_metrics(reward: RewardResult, adv, stats: dict) -> dict:
    valid = reward.total_B[~torch.isnan(reward.total_B)]
    return {
        "reward/mean": float(valid.mean()) if len(valid) else float("nan"),
        "reward/std": float(valid.std(unbiased=False)) if len(valid) else float("nan"),
        "reward/num_failed": reward.num_failed,
        "grpo/zero_variance_groups": adv.num_zero_variance_groups,
        "grpo/dropped_samples": adv.num_dropped_samples,
        **{f"reward/{k}": float(v[~torch.isnan(v)].mean()) for k, v in reward.components.items()},
        **{f"grpo/{k}": v for k, v in stats.items()},
    }


def _first(ro: Rollout, num: int) -> Rollout:
    """The first `num` samples of a rollout (the rest is FSDP padding)."""
    traj = ro.trajectory
    kept = Trajectory(traj.latents[:, :num], traj.log_probs[:, :num], traj.sigmas, traj.sde_steps)
    return Rollout(ro.prompts[:num], ro.seeds[:num], kept, ro.images[:num])


SUMMARY_LABELS = {
    "iterations": "iterations done",
    "iterations_this_run": "iterations this run",
    "reward_first": "mean reward, first iterations",
    "reward_last": "mean reward, last iterations",
    "seconds": "wall time (s)",
    "usd_total": "GPU cost so far (USD, spotlight cost)",
    "checkpoint": "last checkpoint",
}
