"""Warm start of the tiny VLM: a pretrained vision tower, then a short supervised run that
teaches the answer format and leaves the model often wrong.

1. **Vision pretraining** (`pretrain_vision`, `vision_pretrain_steps`). A real VLM ships a vision
   encoder pretrained on far more images than any post-training run sees; the tiny one starts
   random. It learns here to name every grid cell's content (empty, or colour x kind) through a
   linear head on its merged tokens, which is then dropped. Without this stage the tiny model never
   learns to tell shapes apart: trained end to end from random weights on the answers alone, 3,000
   supervised steps left `count_kind` at its prior (0.45) while `count_color` reached 0.99, though
   the same tower learns kinds perfectly in 200 steps when asked directly (docs/vlm-recipe-notes.md).
2. **Supervised run** (`num_steps`) on the task's gold targets, the tower frozen by default
   (`freeze_vision`) as a pretrained encoder is. A GRPO run needs a base that answers in the format
   (`answer : <word>`), or no sample earns a reward and every group is flat; and it needs room to
   improve. The format is learnt in a few dozen steps, grounding the answers in the image takes far
   longer.

The result is a model folder (model + processor via `save_pretrained`), what `model.path` of a VLM
recipe loads.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from spotlight.core.config_io import save_config
from spotlight.core.distributed import torch_threads
from spotlight.core.seeds import derive_seed
from vlm.config import WarmStartRecipe
from vlm.evaluate import evaluate
from vlm.policy import VLMPolicy, response_logprobs
from vlm.task import CELL_PX, KINDS, TrainStream, cell_labels, corpus, example_image
from vlm.tiny import build_tiny_vlm


def target_tokens(policy: VLMPolicy, targets: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids (B, T) of each target followed by the end-of-turn token, right-padded, and their mask."""
    rows = [policy.tokenizer(t, add_special_tokens=False).input_ids + [policy.eos_token_id] for t in targets]
    width = max(len(r) for r in rows)
    ids_BT = torch.full((len(rows), width), policy.pad_token_id, dtype=torch.long)
    mask_BT = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids_BT[i, : len(r)] = torch.tensor(r)
        mask_BT[i, : len(r)] = 1
    return ids_BT, mask_BT


VISION_PRETRAIN_STREAM = 1000
"""Offset of the vision pretraining's data seed from the supervised run's (`cfg.seed`)."""


def pretrain_vision(policy: VLMPolicy, cfg: WarmStartRecipe, bar: Progress | None = None) -> list[float]:
    """Train the vision tower (and merger) to classify each grid cell through a linear head on its
    merged token; the head is dropped. Returns the losses."""
    model = policy.base_model.model
    tower = model.visual
    colors, grid = list(cfg.task.colors), cfg.task.grid_size
    out_dim = policy.model.config.get_text_config().hidden_size
    with torch.random.fork_rng():
        torch.manual_seed(derive_seed(cfg.seed, VISION_PRETRAIN_STREAM))
        head = torch.nn.Linear(out_dim, 1 + len(colors) * len(KINDS))
    params = list(tower.parameters()) + list(head.parameters())
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    stream = TrainStream(cfg.task, seed=cfg.seed + VISION_PRETRAIN_STREAM)
    task = bar.add_task("", total=cfg.vision_pretrain_steps, phase="vision") if bar is not None else None
    losses = []
    for step in range(cfg.vision_pretrain_steps):
        examples = stream.batch(step, cfg.batch_size)
        prompts = policy.encode([e.question for e in examples], [example_image(e, cfg.task) for e in examples])
        tokens = model.get_image_features(
            prompts.pixel_values_NC, prompts.image_grid_thw_B3, return_dict=True
        ).pooler_output
        if any(t.shape[0] != grid * grid for t in tokens):
            raise ValueError(
                f"vision pretraining needs one merged token per grid cell ({grid * grid} per image), got "
                f"{tokens[0].shape[0]}: task.grid_size and the model's patch size do not match"
            )
        labels = torch.tensor([cell_labels(e, cfg.task) for e in examples]).reshape(-1)
        loss = torch.nn.functional.cross_entropy(head(torch.cat(tokens)), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        losses.append(loss.item())
        if bar is not None:
            bar.update(task, advance=1, description=f"loss {loss.item():.3f}")
    return losses


def warm_start(cfg: WarmStartRecipe, out: str | Path, *, progress: bool = True, force: bool = False) -> dict:
    """Build a tiny VLM for `cfg.task`, train it on gold answers for `cfg.num_steps`, save it to `out`.

    force: replace an existing `out` (else a ValueError: a model is never overwritten by mistake).

    Returns:
        A summary with the held-out evaluation of the saved model.
    """
    out = Path(out)
    if out.exists() and not force:
        raise ValueError(
            f"--out {out} exists{'' if out.is_dir() else ' (a file)'}; pass --force to replace it, or choose another "
            "--out"
        )
    if out.exists():
        shutil.rmtree(out) if out.is_dir() else out.unlink()
    with torch_threads(cfg.num_threads):  # for the warm start only
        return _warm_start(cfg, out, progress)


def _warm_start(cfg: WarmStartRecipe, out: Path, progress: bool) -> dict:
    console = Console(quiet=not progress)
    began = time.monotonic()
    build_tiny_vlm(out, cfg.model, corpus(cfg.task), image_px=cfg.task.grid_size * CELL_PX)
    policy = VLMPolicy.load(out, field="--out")
    policy.model.train()
    stream = TrainStream(cfg.task, seed=cfg.seed)
    losses: list[float] = []
    columns = [
        TextColumn("[bold]warm start: {task.fields[phase]}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.description}"),
    ]
    with Progress(*columns, console=console) as bar:
        vision_losses = pretrain_vision(policy, cfg, bar)
        if cfg.freeze_vision:
            policy.freeze_vision()
        params = [p for p in policy.model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
        task = bar.add_task("", total=cfg.num_steps, phase="answers")
        for step in range(cfg.num_steps):
            examples = stream.batch(step, cfg.batch_size)
            prompts = policy.encode([e.question for e in examples], [example_image(e, cfg.task) for e in examples])
            ids_BT, mask_BT = target_tokens(policy, [e.target for e in examples])
            logp_BT = response_logprobs(policy, prompts, ids_BT, mask_BT, 1.0)
            loss = -(logp_BT.sum() / mask_BT.sum())  # token-mean cross-entropy
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            losses.append(loss.item())
            bar.update(task, advance=1, description=f"loss {loss.item():.3f}")
    policy.model.eval()
    policy.model.save_pretrained(out)
    policy.processor.save_pretrained(out)
    save_config(cfg, out / "warmstart.yaml")
    summary = evaluate(policy, cfg.task)
    return {
        "out": str(out),
        "steps": cfg.num_steps,
        "vision_pretrain_steps": cfg.vision_pretrain_steps,
        "vision_loss_last": sum(vision_losses[-5:]) / len(vision_losses[-5:]) if vision_losses else None,
        "loss_first": losses[0] if losses else None,
        "loss_last": sum(losses[-5:]) / len(losses[-5:]) if losses else None,
        "heldout_accuracy": summary["accuracy"],
        "heldout_format_rate": summary["format_rate"],
        "eval": {k: v for k, v in summary.items() if k.startswith("accuracy/")},
        "seconds": round(time.monotonic() - began, 1),
    }
