"""Rectified-flow pretraining of the tiny shapes base model (the model GRPO then post-trains).

`spotlight pretrain configs/dit/tiny-pretrain.yaml --out DIR` reproduces the base shipped in
`spotlight/assets/tiny-shapes-base`: a tiny model folder (see `tiny.py`) whose transformer learns
to draw the shapes grammar's images (rendered on the fly by `rewards.shapes.render_prompt`) from
the train split of the prompts only; the held-out split stays unseen for evaluation.

Captions may be noisy (`caption_noise`): an image then shows a random count and shape for some
clauses of its caption, as web alt-text often does. Such a base draws the right objects with
weakly bound counts and shapes, the failure that verifiable-reward RL corrects in real
text-to-image models, rather than failing for lack of training.

Captions may also be dropped (`caption_dropout`, classifier-free guidance training): that share of
images is trained with the empty prompt " ", the negative prompt the sampler's true CFG uses, so a
base pretrained this way can sample with `sample.guidance_scale` > 1. The shipped base is
(`configs/dit/tiny-pretrain.yaml`: 10%).

Loss (Liu et al. 2022, rectified flow; Esser et al. 2024, logit-normal sigmas): with
x_sigma = (1 - sigma) x0 + sigma eps, the transformer regresses v = eps - x0, the velocity of the
sampler's convention x_{sigma'} = x_sigma + (sigma' - sigma) v.
"""

from __future__ import annotations

import math
import shutil
import time
from pathlib import Path

import numpy as np
import torch
from rich.progress import Progress

from spotlight.config import PretrainConfig, SampleConfig
from spotlight.core.distributed import torch_threads
from spotlight.core.runlock import RunLock
from spotlight.core.seeds import derive_seed
from spotlight.policy import DiTPolicy
from spotlight.rewards import shapes
from spotlight.tiny import build_tiny_model

UNCONDITIONAL_PROMPT = SampleConfig().negative_prompt
"""What a dropped caption becomes: the negative prompt the sampler's CFG uses by default (" ", as Qwen-Image's
pipeline)."""


def _lr_at(step: int, total: int, peak: float, warmup: int = 50) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def pretrain(cfg: PretrainConfig, out_dir: str | Path, *, progress: bool = True, force: bool = False) -> dict:
    """Build a tiny model folder at `out_dir` and pretrain its transformer; returns a summary.

    force: replace an existing `out_dir` (else a ValueError: a trained base is never overwritten by
    mistake). One pretraining per `out_dir` at a time (`runlock.RunLock` on `PARENT/.NAME.lock`)."""
    if not 0 <= cfg.caption_dropout <= 1:
        raise ValueError(f"caption_dropout must be in [0, 1], got {cfg.caption_dropout}")
    out_dir = Path(out_dir)
    if out_dir.exists() and not force:
        raise ValueError(f"--out {out_dir} exists; pass --force to replace it, or choose another --out")
    with RunLock(out_dir.parent, "spotlight pretrain", lock_file=out_dir.parent / f".{out_dir.name}.lock"):
        with torch_threads(cfg.num_threads):  # for the pretraining only
            return _pretrain(cfg, out_dir, progress)


def pretrain_prompts(cfg: PretrainConfig) -> list[str]:
    """The grammar prompts pretraining draws captions from: all but the held-out prompts of
    `split_seed` and of every seed in `also_hold_out_splits`."""
    train, heldout = shapes.split_prompts(cfg.split_seed, cfg.num_heldout)
    left_out = set(heldout)
    for seed in cfg.also_hold_out_splits:
        left_out.update(shapes.split_prompts(seed, cfg.num_heldout)[1])
    return [p for p in train if p not in left_out]


def _pretrain(cfg: PretrainConfig, out_dir: Path, progress: bool) -> dict:
    train_prompts = pretrain_prompts(cfg)
    work = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(work, ignore_errors=True)
    build_tiny_model(work, cfg.model, shapes.all_prompts())
    policy = DiTPolicy.load(work, height=cfg.model.image_size, width=cfg.model.image_size, max_text_tokens=16)
    model = policy.transformer.train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    rng = np.random.default_rng(cfg.seed)

    start = time.monotonic()
    losses: list[float] = []
    with Progress(disable=not progress) as bar:
        task = bar.add_task("pretraining", total=cfg.num_steps)
        for step in range(cfg.num_steps):
            prompts = [train_prompts[i] for i in rng.integers(len(train_prompts), size=cfg.batch_size)]
            drawn = (
                [shapes.noisy_caption_target(p, cfg.caption_noise, rng) for p in prompts]
                if cfg.caption_noise
                else prompts
            )
            images = shapes.render_batch(drawn, cfg.model.image_size, derive_seed(cfg.seed, step))
            x0 = policy.encode_images(images)
            eps = torch.randn_like(x0)
            sigma_B = torch.sigmoid(torch.randn(cfg.batch_size))
            s = sigma_B.view(-1, 1, 1)
            x_sigma = (1 - s) * x0 + s * eps
            if cfg.caption_dropout:
                # Classifier-free guidance training (Ho & Salimans 2022): some captions become the
                # negative prompt the sampler's CFG subtracts.
                dropped = rng.random(cfg.batch_size) < cfg.caption_dropout
                prompts = [UNCONDITIONAL_PROMPT if d else p for p, d in zip(prompts, dropped)]
            embeds, mask = policy.encode_prompts(prompts)
            v_pred = policy.velocity(x_sigma, sigma_B, embeds, mask)
            loss = torch.nn.functional.mse_loss(v_pred.float(), eps - x0)
            for group in opt.param_groups:
                group["lr"] = _lr_at(step, cfg.num_steps, cfg.lr)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            losses.append(loss.item())
            bar.update(task, advance=1, description=f"pretraining loss {np.mean(losses[-20:]):.4f}")
            if cfg.max_minutes and time.monotonic() - start > 60 * cfg.max_minutes:
                break

    # fp16 on disk keeps the shipped base at a few MB; it is loaded back as float32.
    model.eval().to(torch.float16).save_pretrained(work / "transformer")
    if out_dir.exists():
        shutil.rmtree(out_dir)
    work.rename(out_dir)
    return {"steps": len(losses), "final_loss": float(np.mean(losses[-20:])), "seconds": time.monotonic() - start}
