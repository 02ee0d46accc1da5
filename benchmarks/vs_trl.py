"""TRL's GRPOTrainer against `spotlight vlm train` (serial and Rollplex schedules) on the same work.

What a user coming from TRL would run instead: `trl.GRPOTrainer` (trl 1.16, `pip install
'spotlight[bench]'`) on the same tiny Qwen2.5-VL folder (the real transformers classes and
processor, random weights built from config), the same prompts in the same order, the same
verifiable reward (accuracy + 0.1 format), group size, response length limit, temperature,
learning rate, optimizer (torch AdamW, constant rate, no weight decay, gradient norm clipped at
1), KL weight (k3 estimator added per token) and loss aggregation (token-level: TRL's `bnpo`,
our `train.loss_agg: token`), one optimizer step per rollout (on-policy). The vision tower is
frozen in all three. All three train side by side in one process: every TRL step runs inside
`trainer.train()`, and our two schedules' steps run between TRL's steps (TRL callbacks), the order
rotating, so machine noise falls on all of them alike.

The size is prefix-heavy but realistic: a 448x448 image (1,024 vision patches, 256 image tokens
after Qwen2.5-VL's 2x2 merge) and a short question make a ~275-token prompt; responses are
limited to 32 tokens, so the prompt is ~90% of each sequence (real VLM RL workloads: 79-98%, the
Rollplex paper). What the work is: P prompts x G samples per step; per sample a vision encode, a
prefill and up to 32 decode steps, a reference forward and a policy forward + backward.

Figures (JSON, one line):
- step_time_ratio_trl_over_ours_serial, step_time_ratio_trl_over_ours_rollplex: median step time
  of TRL over ours (after one warm-up step each; medians over --repeats steps).
- phase_seconds_median: rollout, scoring (reward + advantages), reference, update per system.
  TRL's phases are its own methods timed from outside: `_generate` (rollout), `_calculate_rewards`
  (scoring), the rest of `_generate_and_score_completions` (reference log-probs, advantages,
  bookkeeping), and the rest of the step (loss, backward, optimizer step).
- first_step_loss_abs_diff, first_step_grad_max_abs_diff (and _rel): both objectives on the same
  batch. TRL's own loss code (`GRPOTrainer._compute_loss`, its log-prob function, its reference
  forward) and our serial update (`vlm.update.update`, `Reference.logprobs`) score one rollout
  (the same tokens, images and advantages) from the same weights, moved away from the reference
  so that the KL term has a gradient; advantages are fixed nonzero draws (a random model's
  rewards are mostly flat, which would leave only the KL term). Tolerance stated in the JSON.
- advantage_max_abs_diff: TRL's advantages (group std with Bessel's correction, + 1e-4) against
  ours (population std, + 1e-4) on the same rewards: the one normalisation that differs; it
  scales each group's advantages by sqrt((G-1)/G), which the learning rate absorbs.
- response_tokens_mean: generated tokens per sample (the decode work; sampling noise differs
  between the two rollout engines, the lengths' expectation does not).
- peak_mem (MiB): live tensor bytes (`vlm.memory.TensorLedger`: every storage from its allocation
  to its last reference, on any device) during one step, on top of the permanent state (weights,
  reference copy, AdamW moments), per system.

    .venv/bin/python benchmarks/vs_trl.py --json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

from spotlight.core.advantages import group_advantages
from spotlight.core.config_io import load_config
from vlm.config import TaskConfig, TinyVLMConfig, VLMRecipe
from vlm.driver import make_schedule
from vlm.memory import TensorLedger, state_bytes
from vlm.policy import load_policy
from vlm.processor import load_processor
from vlm.rewards import CombinedReward
from vlm.rollout import HFRolloutEngine
from vlm.task import CELL_PX, TrainStream, corpus, example_image
from vlm.tiny import build_tiny_vlm
from vlm.update import Reference

MIB = 2**20
SYSTEMS = ("trl", "serial", "rollplex")


def build(folder: Path, args) -> VLMRecipe:
    task = TaskConfig(grid_size=args.grid_size, max_shapes=4)
    spec = TinyVLMConfig(
        text_hidden=args.hidden,
        text_layers=args.layers,
        text_heads=4,
        vision_hidden=args.hidden,
        vision_depth=args.vision_depth,
        vision_heads=4,
    )
    build_tiny_vlm(folder, spec, corpus(task), image_px=args.grid_size * CELL_PX)
    PG = args.prompts * args.group_size
    overrides = [
        f"model.path={folder}",
        "model.train_vision=false",
        "model.lora_rank=0",
        f"task.grid_size={args.grid_size}",
        "task.max_shapes=4",
        f"train.prompts_per_iteration={args.prompts}",
        f"train.group_size={args.group_size}",
        f"rollout.max_new_tokens={args.max_new_tokens}",
        "rollout.temperature=1.0",
        f"train.beta={args.beta}",
        f"train.lr={args.lr}",
        "train.weight_decay=0.0",
        "train.max_grad_norm=1.0",
        "train.loss_agg=token",
        "train.adv_std=group",
        "train.refill_prompts=0",
        "train.drop_flat_groups=false",
        "train.num_inner_epochs=1",
        f"train.minibatch_size={PG}",
        f"train.micro_batch_size={PG}",
        "reward.weights={accuracy: 1.0, format: 0.1}",
        "log.wandb_mode=disabled",
    ]
    return load_config(VLMRecipe, None, overrides)


def examples_of(cfg: VLMRecipe, step: int):
    return TrainStream(cfg.task, seed=cfg.train.seed).batch(step, cfg.train.prompts_per_iteration)


class Ours:
    """One of our schedules on its own copy of the weights: the step `vlm.driver._train` runs (one process)."""

    def __init__(self, cfg: VLMRecipe, schedule: str):
        self.cfg = cfg
        self.policy = load_policy(cfg.model)
        self.reference = Reference(self.policy, cfg.train.beta)
        params = [p for p in self.policy.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=cfg.train.lr, betas=(0.9, cfg.train.adam_beta2), weight_decay=0.0)
        self.schedule = make_schedule(
            schedule, self.policy, HFRolloutEngine(self.policy), self.reference, self.optimizer, cfg
        )
        self.reward_fn = CombinedReward(cfg.reward.weights)
        self.lengths: list[float] = []

    def step(self, it: int) -> dict[str, float]:
        cfg, G = self.cfg, self.cfg.train.group_size
        t0 = time.perf_counter()
        examples = examples_of(cfg, it)
        prompts = self.policy.encode([e.question for e in examples], [example_image(e, cfg.task) for e in examples])
        ro = self.schedule.rollout(prompts, seed=1000 + it)
        t1 = time.perf_counter()
        reward = self.reward_fn(ro.texts, [e.answer for e in examples for _ in range(G)])
        adv = group_advantages(
            reward.total_B.view(len(examples), G), std_mode=cfg.train.adv_std, clip=cfg.train.adv_clip
        )
        t2 = time.perf_counter()
        rows = list(range(ro.response_ids_BT.shape[0]))
        ref = self.schedule.reference_logprobs(ro, rows)
        t3 = time.perf_counter()
        self.schedule.update(ro, rows, adv.adv_PG.reshape(-1), None, ref, it)
        t4 = time.perf_counter()
        self.lengths.append(float(ro.response_mask_BT.sum(dim=1).float().mean()))
        return {"step": t4 - t0, "rollout": t1 - t0, "scoring": t2 - t1, "reference": t3 - t2, "update": t4 - t3}


def trl_dataset(cfg: VLMRecipe, steps: int):
    """Our prompts, step by step, as TRL reads them (conversational prompt, image column, answer)."""
    from datasets import Dataset

    rows = []
    for it in range(steps):
        for e in examples_of(cfg, it):
            rows.append(
                {
                    "prompt": [{"role": "user", "content": e.question}],
                    "image": example_image(e, cfg.task),
                    "answer": e.answer,
                }
            )
    return Dataset.from_list(rows)


def trl_reward(cfg: VLMRecipe):
    score = CombinedReward(cfg.reward.weights)

    def answer_reward(prompts, completions, answer, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return score(texts, list(answer)).total_B.tolist()

    return answer_reward


def make_trl(cfg: VLMRecipe, steps: int, out: Path, callbacks, banned: list[int]):
    from transformers import AutoModelForImageTextToText
    from trl import GRPOConfig, GRPOTrainer

    tc, PG = cfg.train, cfg.train.prompts_per_iteration * cfg.train.group_size
    model = AutoModelForImageTextToText.from_pretrained(cfg.model.path, dtype=torch.float32)
    model.model.visual.requires_grad_(False)  # frozen, as model.train_vision=false freezes ours
    args = GRPOConfig(
        output_dir=str(out),
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        per_device_train_batch_size=PG,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_generations=cfg.train.group_size,
        num_iterations=1,
        max_steps=steps,
        max_completion_length=cfg.rollout.max_new_tokens,
        temperature=cfg.rollout.temperature,
        top_p=1.0,
        top_k=0,
        learning_rate=tc.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        optim="adamw_torch",
        adam_beta1=0.9,
        adam_beta2=tc.adam_beta2,
        weight_decay=0.0,
        max_grad_norm=tc.max_grad_norm,
        beta=tc.beta,
        epsilon=tc.clip_range,
        loss_type="bnpo",
        scale_rewards="group",
        shuffle_dataset=False,
        seed=tc.seed,
        # TRL 1.16 multiplies the k3 term by the (differentiable) ratio by default (DeepSeek-V3.2's
        # unbiased KL gradient); GRPO as in DeepSeekMath Eq. 4, and ours, does not. Off here, so both
        # do the same update; its effect on the gradient is measured and reported.
        use_bias_correction_kl=False,
        # TRL's GRPOConfig turns activation checkpointing on by default (memory for time); a
        # one-process `spotlight vlm train` does not checkpoint (only its FSDP path does), so off.
        gradient_checkpointing=False,
        dataloader_num_workers=0,
        remove_unused_columns=False,
        bf16=False,
        fp16=False,
        log_completions=False,
        # Our sampler never emits vision or padding tokens (vlm.policy.mask_banned); TRL's generate
        # is told the same, so both sample from the same distribution.
        generation_kwargs={"suppress_tokens": banned},
    )
    # The image-only Qwen2.5-VL processor (vlm/processor.py: AutoProcessor would build the video
    # processor too, which needs torchvision, absent for the CPU torch build).
    processor = load_processor(cfg.model.path, "qwen2_5_vl")
    return GRPOTrainer(
        model=model,
        reward_funcs=[trl_reward(cfg)],
        args=args,
        train_dataset=trl_dataset(cfg, steps),
        processing_class=processor,
        callbacks=callbacks,
    )


class TRLPhases:
    """Wall time of TRL's own phases, measured by wrapping its methods on the trainer instance."""

    def __init__(self, trainer):
        self.now: dict[str, float] = {}
        self.lengths: list[float] = []
        named = (
            ("get_batch_samples", "data"),
            ("_generate", "rollout"),
            ("_calculate_rewards", "scoring"),
            ("_generate_and_score_completions", "prepare"),
        )
        for name, key in named:
            setattr(trainer, name, self._timed(getattr(trainer, name), key))

    def _timed(self, fn, key):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            out = fn(*a, **k)
            self.now[key] = self.now.get(key, 0.0) + time.perf_counter() - t0
            if key == "prepare":
                self.lengths.append(float(out["completion_mask"].sum(dim=1).float().mean()))
            return out

        return wrapper

    def split(self, step_s: float) -> dict[str, float]:
        """The phases of the step that took `step_s` between on_step_begin and on_step_end; the
        dataloader's fetch (images decoded, collated) runs before on_step_begin and is added to the
        step and to its rollout, as our step's prompt rendering and encoding are part of ours."""
        n, self.now = self.now, {}
        rollout, scoring, prepare, data = (
            n.get("rollout", 0.0),
            n.get("scoring", 0.0),
            n.get("prepare", 0.0),
            n.get("data", 0.0),
        )
        return {
            "step": step_s + data,
            "rollout": rollout + data,
            "scoring": scoring,
            "reference": prepare - rollout - scoring,
            "update": step_s - prepare,
        }


def make_loop(
    ours: dict[str, Ours], times: dict[str, list[dict]], phases: TRLPhases, memory: dict, warmup: int, mem_step: int
):
    """A TRL callback: our schedules' steps run before or after each TRL step (rotating), timed apart."""
    from transformers import TrainerCallback

    class Loop(TrainerCallback):
        def __init__(self):
            self.t0 = 0.0
            self.it = 0
            self.after: list[str] = []
            self.stack = contextlib.ExitStack()

        def _ours(self, names):
            for name in names:
                m = memory.get("ledger") if self.it == mem_step else None
                with m.mode() if m else contextlib.nullcontext(), m.phase(name) if m else contextlib.nullcontext():
                    t = ours[name].step(self.it)
                if self.it >= warmup and self.it != mem_step:
                    times[name].append(t)

        def on_step_begin(self, args, state, control, **kw):
            self.it = state.global_step
            order = list(SYSTEMS[self.it % 3 :] + SYSTEMS[: self.it % 3])
            cut = order.index("trl")
            self._ours(order[:cut])
            self.after = order[cut + 1 :]
            if self.it == mem_step:
                trainer = memory["trainer"]
                memory["trl_permanent"] = state_bytes(trainer.model, trainer.optimizer, trainer.ref_model)
                self.stack.enter_context(memory["ledger"].mode())
                self.stack.enter_context(memory["ledger"].phase("trl"))
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            seconds = time.perf_counter() - self.t0
            self.stack.close()
            split = phases.split(seconds)
            if self.it >= warmup and self.it != mem_step:
                times["trl"].append(split)
            self._ours(self.after)

    return Loop()


def perturbed(params: list[torch.Tensor]) -> None:
    """Move trainable weights away from the reference (a fixed draw), so that the KL term has a gradient."""
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in params:
            p.add_(0.02 * torch.randn(p.shape, generator=gen))


def our_first_step(
    cfg: VLMRecipe, ro, adv_B: torch.Tensor, *, banned: bool
) -> tuple[float, list[torch.Tensor], torch.Tensor]:
    """Our serial update's loss and raw gradients on the batch `ro`, and its reference log-probs.

    banned=False scores over the whole vocabulary, as TRL does; ours (True) renormalises over the
    tokens the sampler may emit (no vision or padding tokens: vlm.policy.mask_banned)."""
    ours = Ours(cfg, "serial")
    if not banned:
        ours.policy.banned_token_ids = []
    params = [p for p in ours.policy.model.parameters() if p.requires_grad]
    perturbed(params)
    grads: list[torch.Tensor] = []
    ours.optimizer.register_step_pre_hook(lambda *_: grads.extend(p.grad.clone() for p in params))
    rows = list(range(ro.response_ids_BT.shape[0]))
    ref_BT = ours.schedule.reference_logprobs(ro, rows)
    cfg.train.max_grad_norm, saved = 1e30, cfg.train.max_grad_norm  # raw gradients (TRL clips in its optimizer step)
    try:
        stats = ours.schedule.update(ro, rows, adv_B, None, ref_BT, 0)
    finally:
        cfg.train.max_grad_norm = saved
    return stats["loss"], grads, ref_BT


def first_step_agreement(cfg: VLMRecipe, trainer) -> dict:
    """TRL's loss code and our serial update on one batch: the same rollout, advantages and weights."""
    from transformers import AutoModelForImageTextToText
    from trl.trainer import add_fused_lm_head

    sampler = Ours(cfg, "serial")
    examples = examples_of(cfg, 0)
    prompts = sampler.policy.encode([e.question for e in examples], [example_image(e, cfg.task) for e in examples])
    ro = sampler.schedule.rollout(prompts, seed=7)
    B, T = ro.response_ids_BT.shape
    adv_B = torch.randn(B, generator=torch.Generator().manual_seed(4))
    loss_same, grads_same, ref_same = our_first_step(cfg, ro, adv_B, banned=False)
    loss_ours, _, _ = our_first_step(cfg, ro, adv_B, banned=True)

    # TRL: its own log-prob function (the fused LM head GRPOTrainer.__init__ installs), reference
    # forward and loss (GRPOTrainer._compute_loss) on the same batch and weights.
    model = AutoModelForImageTextToText.from_pretrained(cfg.model.path, dtype=torch.float32)
    model.model.visual.requires_grad_(False)
    ref_model = AutoModelForImageTextToText.from_pretrained(cfg.model.path, dtype=torch.float32).eval()
    add_fused_lm_head(model, temperature=trainer.temperature, outputs=("log_probs", "entropy"))
    add_fused_lm_head(ref_model, temperature=trainer.temperature)
    params = [p for p in model.parameters() if p.requires_grad]
    perturbed(params)
    pb = ro.prompts
    inputs = {
        "prompt_ids": pb.input_ids_BL,
        "prompt_mask": pb.attention_mask_BL,
        "completion_ids": ro.response_ids_BT,
        "completion_mask": ro.response_mask_BT.long(),
        "pixel_values": pb.pixel_values_NC,
        "image_grid_thw": pb.image_grid_thw_B3,
        "num_images": [1] * B,
        "mm_token_type_ids": torch.cat(
            [pb.mm_token_type_ids_BL, torch.zeros(B, T, dtype=pb.mm_token_type_ids_BL.dtype)], dim=1
        ),
        "advantages": adv_B,
        "num_items_in_batch": ro.response_mask_BT.sum(),
    }
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    mm = {k: inputs[k] for k in ("pixel_values", "image_grid_thw", "num_images", "mm_token_type_ids")}
    with torch.no_grad():
        inputs["ref_per_token_logps"], _, _ = trainer._get_per_token_logps_and_entropies(ref_model, ids, mask, T, **mm)
    model.train()
    trainer.current_gradient_accumulation_steps = 1
    loss = trainer._compute_loss(model, inputs)
    loss.backward()
    diff = max((a - p.grad).abs().max().item() for a, p in zip(grads_same, params, strict=True))
    scale = max(a.abs().max().item() for a in grads_same)
    # TRL's default KL gradient (ratio-weighted k3) on the same batch, for the record.
    trl_grads = [p.grad.clone() for p in params]
    model.zero_grad(set_to_none=True)
    trainer.args.use_bias_correction_kl = True
    try:
        trainer._compute_loss(model, inputs).backward()
    finally:
        trainer.args.use_bias_correction_kl = False
    kl_effect = max((a - p.grad).abs().max().item() for a, p in zip(trl_grads, params, strict=True)) / scale
    sampler.schedule.close()
    return {
        "first_step_loss_ours": loss_same,
        "first_step_loss_trl": loss.item(),
        "first_step_loss_abs_diff": abs(loss_same - loss.item()),
        "first_step_grad_max_abs_diff": diff,
        "first_step_grad_max_rel_diff": diff / scale,
        "first_step_ref_logp_max_abs_diff": (inputs["ref_per_token_logps"] - ref_same)
        .mul(ro.response_mask_BT)
        .abs()
        .max()
        .item(),
        "banned_tokens_loss_effect": abs(loss_ours - loss_same),
        "trl_default_kl_bias_correction_grad_rel_effect": kl_effect,
    }


def advantage_difference(G: int) -> float:
    """TRL's group normalisation against ours on the same rewards (one group of G)."""
    rewards = torch.rand(4, G, generator=torch.Generator().manual_seed(5))
    ours = group_advantages(rewards, std_mode="group", clip=1e9).adv_PG
    trl = (rewards - rewards.mean(dim=1, keepdim=True)) / (
        rewards.std(dim=1, keepdim=True) + 1e-4
    )  # TRL 1.16's formula
    return (ours - trl).abs().max().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON line (the default output too)")
    parser.add_argument("--grid-size", type=int, default=16, help="image side in 28-pixel cells (16: 448x448)")
    parser.add_argument(
        "--hidden", type=int, default=128, help="hidden size of the language model and the vision tower"
    )
    parser.add_argument("--layers", type=int, default=2, help="decoder layers")
    parser.add_argument("--vision-depth", type=int, default=4, help="vision transformer blocks")
    parser.add_argument("--prompts", type=int, default=2, help="prompts per step (P)")
    parser.add_argument("--group-size", type=int, default=8, help="samples per prompt (G)")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="response length limit")
    parser.add_argument("--beta", type=float, default=0.04, help="KL weight (TRL's documented example value)")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per system (alternating)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (2: this machine's cores)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    os.environ.setdefault("WANDB_MODE", "disabled")
    import trl

    warmup = 1
    mem_step = warmup + args.repeats  # one more step, under the tensor ledger (not timed)
    steps = mem_step + 1
    with tempfile.TemporaryDirectory() as tmp:
        cfg = build(Path(tmp) / "model", args)
        ours = {name: Ours(cfg, name) for name in ("serial", "rollplex")}
        times: dict[str, list[dict]] = {name: [] for name in SYSTEMS}
        memory: dict = {"ledger": TensorLedger()}
        trainer = make_trl(cfg, steps, Path(tmp) / "trl", callbacks=[], banned=ours["serial"].policy.banned_token_ids)
        phases = TRLPhases(trainer)
        memory["trainer"] = trainer
        agreement = first_step_agreement(cfg, trainer)
        loop = make_loop(ours, times, phases, memory, warmup, mem_step)
        trainer.add_callback(loop)
        with contextlib.redirect_stdout(sys.stderr):  # the Trainer prints its run summary: stdout keeps one JSON line
            trainer.train()
        permanent = {"trl": memory["trl_permanent"]}
        for name, o in ours.items():
            permanent[name] = state_bytes(o.policy.model, o.optimizer, o.reference.copy)
            o.schedule.close()
        peaks = memory["ledger"].peaks
        trl_lengths = phases.lengths
        prompt_tokens = float(
            ours["serial"]
            .policy.encode([examples_of(cfg, 0)[0].question], [example_image(examples_of(cfg, 0)[0], cfg.task)])
            .attention_mask_BL.sum()
        )

    median = {name: {k: statistics.median(t[k] for t in times[name]) for k in times[name][0]} for name in SYSTEMS}
    peak_mem = {name: round((sum(permanent[name].values()) + peaks.get(name, 0)) / MIB, 2) for name in SYSTEMS}
    lengths = {"trl": statistics.mean(trl_lengths), **{n: statistics.mean(o.lengths) for n, o in ours.items()}}
    out = {
        "baseline": (
            f"trl {trl.__version__} GRPOTrainer (transformers generate, on-policy, beta {args.beta}, loss_type bnpo)"
        ),
        "step_time_ratio_trl_over_ours_serial": round(median["trl"]["step"] / median["serial"]["step"], 3),
        "step_time_ratio_trl_over_ours_rollplex": round(median["trl"]["step"] / median["rollplex"]["step"], 3),
        "phase_seconds_median": {n: {k: round(v, 4) for k, v in m.items()} for n, m in median.items()},
        **{k: (round(v, 8) if isinstance(v, float) else v) for k, v in agreement.items()},
        "first_step_tolerance": (
            "loss abs diff <= 1e-5, gradient max rel diff <= 1e-4 (float32, different kernels' summation order)"
        ),
        "advantage_max_abs_diff": round(advantage_difference(args.group_size), 4),
        "response_tokens_mean": {k: round(v, 2) for k, v in lengths.items()},
        "prompt_tokens": prompt_tokens,
        "prefix_fraction": round(prompt_tokens / (prompt_tokens + lengths["serial"]), 3),
        "peak_mem": {
            "unit": "MiB",
            **peak_mem,
            "permanent": {n: round(sum(p.values()) / MIB, 2) for n, p in permanent.items()},
        },
        "setup": {
            "image_px": args.grid_size * CELL_PX,
            "prompts": args.prompts,
            "group_size": args.group_size,
            "max_new_tokens": args.max_new_tokens,
            "hidden": args.hidden,
            "layers": args.layers,
            "vision_depth": args.vision_depth,
            "repeats": args.repeats,
            "warmup": warmup,
            "torch_threads": torch.get_num_threads(),
            "dtype": "float32",
            "vision_tower": "frozen",
            "lr": args.lr,
        },
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
