"""Supervised warm start of the tiny VLM: learn the answer format, stay often wrong.

A GRPO run needs a base that answers in the format (`answer : <word>`), or no sample earns a
reward and every group is flat; and it needs room to improve. A short supervised run on the
task's gold targets gives both: the format is learnt in a few dozen steps, grounding the answers
in the image takes far longer. The result is a model folder (model + processor via
`save_pretrained`), what `model.path` of a VLM recipe loads.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from spotlight.config_io import save_config
from vlm.config import WarmStartRecipe
from vlm.evaluate import evaluate
from vlm.policy import VLMPolicy, response_logprobs
from vlm.task import CELL_PX, TrainStream, corpus, example_image
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


def warm_start(cfg: WarmStartRecipe, out: str | Path, *, progress: bool = True) -> dict:
    """Build a tiny VLM for `cfg.task`, train it on gold answers for `cfg.num_steps`, save it to `out`.

    Returns:
        A summary with the held-out evaluation of the saved model.
    """
    console = Console(quiet=not progress)
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    out = Path(out)
    began = time.monotonic()
    build_tiny_vlm(out, cfg.model, corpus(cfg.task), image_px=cfg.task.grid_size * CELL_PX)
    policy = VLMPolicy.load(out, field="--out")
    policy.model.train()
    optimizer = torch.optim.AdamW(policy.model.parameters(), lr=cfg.lr, weight_decay=0.0)
    stream = TrainStream(cfg.task, seed=cfg.seed)
    losses: list[float] = []
    columns = [TextColumn("[bold]warm start"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("{task.description}")]
    with Progress(*columns, console=console) as bar:
        task = bar.add_task("", total=cfg.num_steps)
        for step in range(cfg.num_steps):
            examples = stream.batch(step, cfg.batch_size)
            prompts = policy.encode([e.question for e in examples], [example_image(e, cfg.task) for e in examples])
            ids_BT, mask_BT = target_tokens(policy, [e.target for e in examples])
            logp_BT = response_logprobs(policy, prompts, ids_BT, mask_BT, 1.0)
            loss = -(logp_BT.sum() / mask_BT.sum())  # token-mean cross-entropy
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(policy.model.parameters(), 1.0)
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
        "loss_first": losses[0] if losses else None,
        "loss_last": sum(losses[-5:]) / len(losses[-5:]) if losses else None,
        "heldout_accuracy": summary["accuracy"],
        "heldout_format_rate": summary["format_rate"],
        "eval": {k: v for k, v in summary.items() if k.startswith("accuracy/")},
        "seconds": round(time.monotonic() - began, 1),
    }
