"""The `vlm` commands: warmstart, train, eval, config (`spotlight vlm ...`, or `python -m spotlight.cli vlm ...`).

Each takes an optional recipe (a YAML file; none = the dataclass defaults) followed by dotted
overrides such as `train.lr=3e-4`.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path


def _split_recipe(items: list[str]) -> tuple[str | None, list[str]]:
    """The recipe is the first item unless it looks like an override (has '=')."""
    items = list(items)
    recipe = items.pop(0) if items and "=" not in items[0] else None
    return recipe, items


def export_vlm_checkpoint(ckpt, to: str, fmt: str, *, weights: str, force: bool) -> dict:
    """`spotlight export` of a VLM checkpoint (vlm/export.py)."""
    from vlm.export import export_vlm

    return export_vlm(ckpt, to, fmt, weights=weights, force=force)


def _load(cls, args: argparse.Namespace):
    from spotlight.core.config_io import check_recipe_kind, load_config

    recipe, overrides = _split_recipe(args.items)
    kinds = args.recipe_kinds()
    check_recipe_kind(recipe, cls, next(c for k, c in kinds if k is cls), [(k, c) for k, c in kinds if k is not cls])
    return load_config(cls, recipe, overrides)


def cmd_warmstart(args: argparse.Namespace) -> int:
    from vlm.config import WarmStartRecipe
    from vlm.warmstart import warm_start

    cfg = _load(WarmStartRecipe, args)
    out = args.out or "runs/vlm-tiny-base"
    print(json.dumps(warm_start(cfg, out, progress=not args.quiet, force=args.force)))
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from vlm.config import VLMRecipe
    from vlm.driver import run_training

    cfg = _load(VLMRecipe, args)
    run_dir = Path(args.run_dir or Path("runs") / cfg.name)
    run_training(cfg, run_dir, resume=not args.no_resume, progress=not args.quiet)
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from spotlight.core.checkpoint import expect_kind, load_checkpoint
    from vlm.config import VLMRecipe
    from vlm.evaluate import evaluate
    from vlm.policy import load_policy, load_trainable_state

    cfg = _load(VLMRecipe, args)
    ckpt = None
    if args.checkpoint:
        ckpt = load_checkpoint(args.checkpoint)
        expect_kind(ckpt, "vlm")
        # The adapter shape comes from the checkpoint, not from the (possibly different) recipe.
        cfg.model.lora_rank = int(ckpt.meta.get("lora_rank", 0))
        cfg.model.lora_alpha = float(ckpt.meta.get("lora_alpha", 0.0))
        cfg.model.train_vision = bool(ckpt.meta.get("train_vision", True))
    policy = load_policy(cfg.model, trainable=bool(ckpt))
    if ckpt is not None:
        load_trainable_state(policy, ckpt.tensors["trainable"])
        policy.model.requires_grad_(False)
    summary = evaluate(policy, cfg.task, batch_size=cfg.eval.batch_size, max_new_tokens=cfg.rollout.max_new_tokens)
    summary["checkpoint"] = str(ckpt.path) if ckpt else None
    summary["step"] = ckpt.step if ckpt else 0
    if args.json:
        print(json.dumps(summary))
    else:
        for key, value in summary.items():
            print(f"{key:>24}: {value}")
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    from spotlight.core.config_io import describe, dump_yaml
    from vlm.config import VLMRecipe, WarmStartRecipe

    cls = WarmStartRecipe if args.warmstart else VLMRecipe
    print(describe(cls) if args.describe else dump_yaml(_load(cls, args)), end="")
    return 0


def add_subcommands(subparsers, recipe_kinds: Callable[[], list[tuple[type, str]]]) -> argparse.ArgumentParser:
    """Add the `vlm` command (with its own subcommands) to an argparse subparsers object.

    `recipe_kinds()` lists every recipe class with the command it is for, the DiT ones included
    (`spotlight.cli.recipe_kinds`): a DiT recipe given to a VLM command fails naming its command.
    """
    vlm = subparsers.add_parser(
        "vlm", help="VLM GRPO (Qwen2.5-VL / Qwen3-VL).", description="VLM GRPO (Qwen2.5-VL / Qwen3-VL)."
    )
    sub = vlm.add_subparsers(dest="vlm_command", required=True, metavar="COMMAND")

    def command(name: str, help_text: str, fn) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument(
            "items", nargs="*", metavar="[RECIPE] [key=value ...]", help="recipe YAML, then dotted overrides"
        )
        p.set_defaults(fn=fn, recipe_kinds=recipe_kinds)
        return p

    p = command(
        "warmstart",
        "Build the tiny VLM, pretrain its vision tower, and teach it the answer format (supervised, short).",
        cmd_warmstart,
    )
    p.add_argument(
        "--out", help="output model folder (default: runs/vlm-tiny-base; refused if it exists, unless --force)"
    )
    p.add_argument("--force", action="store_true", help="replace an existing --out")
    p.add_argument("--quiet", action="store_true", help="no progress bar")

    p = command("train", "Post-train a VLM with GRPO (default: the tiny shapes-question recipe on CPU).", cmd_train)
    p.add_argument("--run-dir", help="run directory (default: runs/<recipe name>); an existing run resumes")
    p.add_argument("--no-resume", action="store_true", help="start from scratch even if run-dir has checkpoints")
    p.add_argument("--quiet", action="store_true", help="no progress bar or summary")

    p = command("eval", "Held-out accuracy (greedy answers) of the recipe's model or a checkpoint.", cmd_eval)
    p.add_argument("--checkpoint", help="run directory or checkpoint (default: the recipe's base model)")
    p.add_argument("--json", action="store_true", help="print one JSON line")

    p = command("config", "Print the resolved recipe as YAML (or every field with --describe).", cmd_config)
    p.add_argument("--describe", action="store_true", help="list every field with its type, default and doc")
    p.add_argument("--warmstart", action="store_true", help="the warm-start recipe instead of the GRPO one")
    return vlm
