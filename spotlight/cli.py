"""The `spotlight` command: train, eval, sample, pretrain, config, cost, report, export, memory, simulate, vlm.

train, eval, sample, pretrain and config take an optional recipe (a YAML file; none = the embedded
tiny-shapes default) followed by dotted overrides such as `train.lr=3e-4`; `cost` and `report` read
a run directory; `memory` sizes a recipe's GPU memory; `simulate` (spot/sim/cli.py) replays a policy on a
spot trace; `vlm ...` is the VLM path (vlm/cli.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

EXIT_INTERRUPTED = 130


def _quiet_libraries() -> None:
    os.environ.setdefault("WANDB_SILENT", "true")
    # A wandb service inherited from a parent process (a script or test runner that used wandb)
    # would hold this run's stream after a SIGKILL of this process, and the replacement trainer's
    # init with the same run id would fail ("run ID is in use"): each trainer starts its own.
    os.environ.pop("WANDB_SERVICE", None)
    from spotlight.policy import quiet_model_libraries

    quiet_model_libraries()


def recipe_kinds() -> list[tuple[type, str]]:
    """Every recipe class with the command it is for (`config_io.check_recipe_kind`): the command line
    is the one module that knows both paths."""
    from spotlight.config import DiTRecipe, PretrainConfig
    from vlm.config import VLMRecipe, WarmStartRecipe

    return [
        (DiTRecipe, "spotlight train"),
        (PretrainConfig, "spotlight pretrain"),
        (VLMRecipe, "spotlight vlm train"),
        (WarmStartRecipe, "spotlight vlm warmstart"),
    ]


def _split_recipe(args: argparse.Namespace) -> tuple[str | None, list[str]]:
    """The recipe is the first positional argument unless it looks like an override (has '=')."""
    items = list(args.items)
    recipe = None
    if items and "=" not in items[0]:
        recipe = items.pop(0)
    return recipe, items


def _load(cls, command: str, args: argparse.Namespace):
    """`cls` from the command's recipe and overrides; a recipe of another kind (a VLM recipe given
    to `spotlight train`) is refused with the command it is for."""
    from spotlight.core.config_io import check_recipe_kind, load_config

    recipe, overrides = _split_recipe(args)
    check_recipe_kind(recipe, cls, command, [(k, c) for k, c in recipe_kinds() if k is not cls])
    return load_config(cls, recipe, overrides), recipe


def _load_recipe(args: argparse.Namespace):
    from spotlight.config import DiTRecipe

    return _load(DiTRecipe, f"spotlight {args.command}", args)


def _policy_with_checkpoint(cfg, checkpoint: str | None, weights: str = "auto"):
    """The recipe's policy, with a run's or checkpoint's trained weights when given.

    weights: "ema" (the moving average a run with train.ema_decay saves), "raw" (the trained weights)
    or "auto" (the moving average where the checkpoint has one). Returns (policy, checkpoint, which).
    """
    from spotlight.core.checkpoint import expect_kind, load_checkpoint, pick_weights
    from spotlight.policy import load_policy, load_trainable_state

    if checkpoint is None:
        return load_policy(cfg.model, trainable=False), None, "base"
    ckpt = load_checkpoint(checkpoint)
    expect_kind(ckpt, "dit")
    state, which = pick_weights(ckpt, weights)
    # The adapter shape comes from the checkpoint, not from the (possibly different) recipe.
    cfg.model.lora_rank = int(ckpt.meta.get("lora_rank", 0))
    cfg.model.lora_alpha = float(ckpt.meta.get("lora_alpha", 0.0))
    policy = load_policy(cfg.model, trainable=False)
    try:
        load_trainable_state(policy, state)
    except RuntimeError as err:  # torch's key and shape listing runs to kilobytes: its first line names the problem
        first = str(err).strip().splitlines()[0]
        raise ValueError(
            f"{ckpt.path} does not fit the model at model.path={cfg.model.path or '(default)'}: {first}; "
            "give the recipe it was trained with"
        ) from None
    return policy, ckpt, which


def cmd_train(args: argparse.Namespace) -> int:
    from spotlight.driver import run_training

    cfg, _ = _load_recipe(args)
    run_dir = Path(args.run_dir or Path("runs") / cfg.name)
    run_training(cfg, run_dir, resume=not args.no_resume, progress=not args.quiet)
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from spotlight.core.tracking import save_image_grid
    from spotlight.evaluate import evaluate
    from spotlight.prompts import prompt_check, read_prompt_file, train_and_eval_prompts
    from spotlight.rewards import build_reward

    cfg, _ = _load_recipe(args)
    if args.prompts:
        prompts = read_prompt_file(args.prompts, check=prompt_check(cfg.reward.weights), field="--prompts")
    else:
        prompts = train_and_eval_prompts(cfg.data, cfg.reward.weights)[1]
    policy, ckpt, which = _policy_with_checkpoint(cfg, args.checkpoint, args.weights)
    reward_fn = build_reward(cfg.reward.weights, **cfg.reward.options())
    summary, images = evaluate(policy, prompts, reward_fn, cfg, progress=not args.json)
    summary["checkpoint"] = str(ckpt.path) if ckpt else None
    summary["step"] = ckpt.step if ckpt else 0
    summary["weights"] = which
    if args.grid:
        shown = images[:64]
        save_image_grid(shown, args.grid, nrow=8, captions=prompts[: len(shown)])  # the first seed of each prompt
    if args.json:
        print(json.dumps(summary))
    else:
        for key, value in summary.items():
            print(f"{key:>20}: {value}")
    return 0


def cmd_sample(args: argparse.Namespace) -> int:
    from spotlight.core.tracking import save_image_grid
    from spotlight.prompts import check_prompt, prompt_check, read_prompt_file
    from spotlight.rollout import resolve_autocast, rollout
    from spotlight.sampling import qwen_image_sigmas

    cfg, _ = _load_recipe(args)
    prompts = list(args.prompt or [])
    check = prompt_check(cfg.reward.weights)
    for text in prompts:  # as a prompt file's lines are checked
        check_prompt(text, check, f"--prompt {text!r}")
    if args.prompts:
        prompts += read_prompt_file(args.prompts, check=prompt_check(cfg.reward.weights), field="--prompts")
    if not prompts:
        raise ValueError("give at least one --prompt TEXT or --prompts FILE")
    policy, _, _ = _policy_with_checkpoint(cfg, args.checkpoint, args.weights)
    sigmas = qwen_image_sigmas(cfg.sample.eval_num_steps, policy.latent_shape[0])
    all_prompts = [p for p in prompts for _ in args.seeds]
    seeds = [s for _ in prompts for s in args.seeds]
    ro = rollout(
        policy,
        all_prompts,
        seeds,
        sigmas,
        noise_level=cfg.sample.eval_noise_level,
        guidance_scale=cfg.sample.guidance_scale,
        negative_prompt=cfg.sample.negative_prompt,
        batch_size=cfg.eval.batch_size,
        autocast=resolve_autocast(cfg.sample.autocast, policy.device, cfg.train.objective),
    )
    out = save_image_grid(
        ro.images, args.out, nrow=len(args.seeds), captions=[f"{p} (seed {s})" for p, s in zip(all_prompts, seeds)]
    )
    print(f"wrote {out}: {len(prompts)} prompt(s) as rows x {len(args.seeds)} seed(s) as columns")
    return 0


def cmd_pretrain(args: argparse.Namespace) -> int:
    from spotlight.config import PretrainConfig
    from spotlight.pretrain import pretrain

    cfg, _ = _load(PretrainConfig, "spotlight pretrain", args)
    summary = pretrain(cfg, args.out, progress=not args.quiet, force=args.force)
    print(json.dumps(summary))
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    from spotlight.config import DiTRecipe
    from spotlight.core.config_io import describe, dump_yaml

    cfg, _ = _load_recipe(args)
    print(describe(DiTRecipe) if args.describe else dump_yaml(cfg), end="")
    return 0


def cmd_cost(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from spotlight.core.cost import read_ledger, summarize

    if args.items:
        raise ValueError(f"cost takes a run directory and no overrides, got {' '.join(args.items)}")
    s = summarize(read_ledger(args.run_dir))
    if args.json:
        print(json.dumps({"run_dir": args.run_dir, **s}))
        return 0
    table = Table(title=f"spotlight cost: {args.run_dir}", caption=f"{s['first']} .. {s['last']} (UTC)")
    for name in ("pool", "GPU-seconds", "GPU-hours", "price source", "USD"):
        table.add_column(name, justify="left" if name in ("pool", "price source") else "right")

    def row(name: str, gpu_s: float | None, source: str, usd: float, **kw) -> None:
        hours = ("", "") if gpu_s is None else (f"{gpu_s:,.0f}", f"{gpu_s / 3600:,.3f}")
        table.add_row(name, *hours, source, f"{usd:,.2f}", **kw)

    for name, p in s["pools"].items():
        row(name, p["gpu_s"], p["source"], p["usd"])
    row("total", s["gpu_s_total"], "", s["usd_total"], end_section=True)
    row("on-demand only", s["gpu_s_total"], "every GPU-second at the on-demand price", s["usd_on_demand_only"])
    row("saved", None, f"{s['saved_fraction']:.1%} of on-demand only", s["usd_saved"])
    Console().print(table)
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from spotlight.report import write_report

    if args.items:
        raise ValueError(f"report takes a run directory and no overrides, got {' '.join(args.items)}")
    print(write_report(args.run_dir, args.out))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from spotlight.core.checkpoint import checkpoint_kind, load_checkpoint

    if args.items:
        raise ValueError(f"export takes a run directory or checkpoint and no overrides, got {' '.join(args.items)}")
    ckpt = load_checkpoint(args.run_dir)
    kind = checkpoint_kind(ckpt) or "dit"
    if kind == "vlm":
        from vlm.cli import export_vlm_checkpoint

        summary = export_vlm_checkpoint(
            ckpt, args.to, args.format or "transformers", weights=args.weights, force=args.force
        )
    else:
        from spotlight.export import export_dit

        fmt = args.format or ("diffusers-lora" if ckpt.meta.get("lora_rank") else "diffusers")
        summary = export_dit(ckpt, args.to, fmt, weights=args.weights, force=args.force)
    print(json.dumps({"checkpoint": str(ckpt.path), "kind": kind, **summary}))
    return 0


def recipe_kind(path: str | None) -> str:
    """ "vlm" for a VLM recipe (it has `rollout` or `task` sections), else "dit"."""
    if path is None:
        return "dit"
    from spotlight.core.config_io import read_recipe

    return "vlm" if {"rollout", "task"} & set(read_recipe(Path(path))) else "dit"


def memory_plan(recipe: str | None, overrides: list[str], *, gpus: int, gpu_mem_gib: float):
    """`spotlight memory`: the memory of every role of a DiT or VLM recipe on `gpus` GPUs of
    `gpu_mem_gib` GiB (a `spotlight.core.memory_plan.Plan`). Here because it dispatches to both paths.

    Raises:
        ValueError: an unknown recipe path, --gpus < 1 or --gpu-mem <= 0.
    """
    if gpus < 1:
        raise ValueError(f"--gpus must be >= 1, got {gpus}")
    if not gpu_mem_gib > 0:
        raise ValueError(f"--gpu-mem must be > 0 (GiB per GPU), got {gpu_mem_gib}")
    if recipe is not None and not Path(recipe).is_file():
        raise ValueError(f"recipe {recipe!r} does not exist")
    if recipe_kind(recipe) == "vlm":
        from vlm.memory_plan import plan_vlm

        return plan_vlm(recipe, overrides, gpus, gpu_mem_gib)
    from spotlight.memory_plan_dit import plan_dit

    return plan_dit(recipe, overrides, gpus, gpu_mem_gib)


def cmd_memory(args: argparse.Namespace) -> int:
    from spotlight.core.memory_plan import plan_json, print_plan

    recipe, overrides = _split_recipe(args)
    plan = memory_plan(recipe, overrides, gpus=args.gpus, gpu_mem_gib=args.gpu_mem)
    if args.json:
        print(plan_json(plan))
    else:
        print_plan(plan)
    return 0


RENAMED_COMMANDS = {"plan": "memory"}
"""Old command -> new name; the old one fails with a message that names the new one."""


WEIGHTS_OPTION = dict(
    choices=["auto", "ema", "raw"],
    default="auto",
    help="a checkpoint's moving average (ema, saved with train.ema_decay > 0) or trained weights (raw); "
    "auto: ema where saved",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="spotlight", description="RL post-training of generative models on spot GPUs."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_recipe_commands(sub)
    _add_run_dir_commands(sub)
    from vlm.cli import add_subcommands as add_vlm_commands  # `spotlight vlm train|eval|warmstart|config`

    add_vlm_commands(sub, recipe_kinds)
    from spot.sim.cli import add_subcommands as add_simulate_command  # `spotlight simulate`

    add_simulate_command(sub)
    return parser


def _add_recipe_commands(sub) -> None:
    """The commands that take a recipe and dotted overrides: train, eval, sample, pretrain, config, memory."""

    def command(name: str, help_text: str, fn) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument(
            "items", nargs="*", metavar="[RECIPE] [key=value ...]", help="recipe YAML, then dotted overrides"
        )
        p.set_defaults(fn=fn)
        return p

    p = command("train", "Post-train a DiT with GRPO (default: the tiny shapes recipe on CPU).", cmd_train)
    p.add_argument("--run-dir", help="run directory (default: runs/<recipe name>); an existing run resumes")
    p.add_argument("--no-resume", action="store_true", help="start from scratch even if run-dir has checkpoints")
    p.add_argument("--quiet", action="store_true", help="no progress bar or summary")

    p = command("eval", "Mean reward of a model on held-out prompts, with fixed seeds.", cmd_eval)
    p.add_argument("--checkpoint", help="run directory or checkpoint (default: the recipe's base model)")
    p.add_argument("--weights", **WEIGHTS_OPTION)
    p.add_argument("--prompts", help="prompt file, one per line (default: the recipe's eval prompts)")
    p.add_argument("--json", action="store_true", help="print one JSON line")
    p.add_argument("--grid", help="also write a PNG grid of the first seed of each prompt")

    p = command("sample", "Write a PNG grid of images for prompts (rows) and seeds (columns).", cmd_sample)
    p.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    p.add_argument("--prompts", help="prompt file, one per line")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3], help="seeds (default: 0 1 2 3)")
    p.add_argument("--checkpoint", help="run directory or checkpoint (default: the recipe's base model)")
    p.add_argument("--weights", **WEIGHTS_OPTION)
    p.add_argument("--out", default="samples.png", help="output PNG (default: samples.png)")

    p = command("pretrain", "Pretrain the tiny shapes base model with rectified flow.", cmd_pretrain)
    p.add_argument("--out", required=True, help="output model folder (refused if it exists, unless --force)")
    p.add_argument("--force", action="store_true", help="replace an existing --out folder")
    p.add_argument("--quiet", action="store_true", help="no progress bar")

    p = command("config", "Print the resolved recipe as YAML (or every field with --describe).", cmd_config)
    p.add_argument("--describe", action="store_true", help="list every field with its type, default and doc")

    help_text = (
        "Estimate GPU memory per role (trainer, rollout, explorer) of a DiT or VLM recipe, and settings that fit."
    )
    p = command("memory", help_text, cmd_memory)
    p.add_argument("--gpus", type=int, default=1, help="GPUs of the trainer's node (default: 1)")
    p.add_argument("--gpu-mem", type=float, default=80.0, help="memory of one GPU in GiB (default: 80)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _add_run_dir_commands(sub) -> None:
    """The commands that read a run directory: cost, export, report."""
    help_text = "Print a run's GPU cost per pool (on-demand, spot), its total and the saving over on-demand only."
    p = sub.add_parser("cost", help=help_text, description=help_text)
    p.add_argument("run_dir", metavar="RUN_DIR", help="run directory (its cost.json)")
    p.add_argument("--json", action="store_true", help="print one JSON line")
    p.set_defaults(fn=cmd_cost, items=[], loads_models=False)

    help_text = "Export a run's trained weights for diffusers (DiT) or transformers / peft (VLM)."
    p = sub.add_parser("export", help=help_text, description=help_text)
    p.add_argument(
        "run_dir", metavar="RUN_DIR", help="run directory (its newest checkpoint) or one checkpoint step directory"
    )
    p.add_argument("--to", required=True, help="output folder (refused if it exists, unless --force)")
    p.add_argument(
        "--format",
        choices=["diffusers-lora", "diffusers", "transformers", "peft"],
        help="DiT: diffusers-lora (QwenImagePipeline.load_lora_weights; default for LoRA runs) or diffusers "
        "(QwenImageTransformer2DModel.from_pretrained, the adapter merged); VLM: transformers "
        "(AutoModelForImageTextToText.from_pretrained, merged; default) or peft (PeftModel.from_pretrained)",
    )
    p.add_argument("--weights", **WEIGHTS_OPTION)
    p.add_argument("--force", action="store_true", help="replace an existing --to folder")
    p.set_defaults(fn=cmd_export, items=[])

    help_text = (
        "Write a self-contained HTML report (and its PNGs) of a run directory: "
        "curves, images, planner, nodes, cost, config."
    )
    p = sub.add_parser("report", help=help_text, description=help_text)
    p.add_argument(
        "run_dir",
        metavar="RUN_DIR",
        help="run directory (its metrics.jsonl, images/, explore.jsonl, cost.json, config.yaml)",
    )
    p.add_argument("--out", help="output folder (default: RUN_DIR/report); the page is OUT/index.html")
    p.set_defaults(fn=cmd_report, items=[], loads_models=False)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in RENAMED_COMMANDS:
        parser.error(f"`spotlight {argv[0]}` is now `spotlight {RENAMED_COMMANDS[argv[0]]}`")
    # Overrides may follow options (`eval --json train.seed=1`): argparse leaves those unparsed.
    args, extra = parser.parse_known_args(argv)
    stray = [e for e in extra if e.startswith("-") or "=" not in e]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    args.items += extra
    if getattr(args, "loads_models", True):
        _quiet_libraries()
    try:
        return args.fn(args)
    except ValueError as err:  # user mistakes: bad recipe, path, prompt file, checkpoint
        if os.environ.get("SPOTLIGHT_DEBUG"):
            raise
        print(f"spotlight {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(
            f"\nspotlight {args.command}: interrupted; checkpoints on disk are intact "
            "(they are written atomically). Run the same command again to resume.",
            file=sys.stderr,
        )
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
