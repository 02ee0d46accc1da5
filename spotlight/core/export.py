"""What `spotlight export` does the same way on both paths: the output folder, and the policy a
checkpoint was trained as, rebuilt from its own config (spotlight/export.py: DiT formats;
vlm/export.py: VLM formats)."""

from __future__ import annotations

import shutil
from pathlib import Path

import yaml

from spotlight.core.checkpoint import Checkpoint, pick_weights


def prepare_out(out: str | Path, force: bool) -> Path:
    """`out` as a new empty folder: an existing one is refused without `force`, replaced with it."""
    out = Path(out)
    if out.exists() and not force:
        raise ValueError(f"--to {out} exists; pass --force to replace it, or choose another --to")
    if out.is_dir():
        shutil.rmtree(out)
    elif out.exists():
        out.unlink()
    out.mkdir(parents=True)
    return out


def rebuild_policy(ckpt: Checkpoint, recipe_cls, load_policy, load_trainable_state, weights: str, **model_fields):
    """The policy `ckpt` was trained as, on the CPU, from its own config and its weights: the
    recipe class and the policy functions of its path (DiT or VLM). Returns (config, policy, which
    weights: "raw" or "ema")."""
    from spotlight.core.config_io import load_config

    cfg = load_config(recipe_cls, base=yaml.safe_load(ckpt.config_yaml))
    cfg.model.device = "cpu"
    cfg.model.lora_rank = int(ckpt.meta.get("lora_rank", cfg.model.lora_rank))
    cfg.model.lora_alpha = float(ckpt.meta.get("lora_alpha", cfg.model.lora_alpha))
    for name, value in model_fields.items():
        setattr(cfg.model, name, value)
    state, which = pick_weights(ckpt, weights)
    policy = load_policy(cfg.model, trainable=False)
    load_trainable_state(policy, state)
    return cfg, policy, which
