"""`spotlight export`: a trained DiT in the formats other tools load.

A checkpoint is our own safetensors plus a manifest (`spotlight.core.checkpoint`). Users load trained
Qwen-Image weights with diffusers, so a run exports to:

    diffusers-lora   DIR/pytorch_lora_weights.safetensors, written by diffusers' own
                     `QwenImagePipeline.save_lora_weights` (its key layout, with the adapter's rank
                     and alpha as metadata): `pipe.load_lora_weights(DIR)` (LoRA runs)
    diffusers        the trained transformer, the adapter merged if there is one, as
                     `QwenImageTransformer2DModel.save_pretrained(DIR)`:
                     `QwenImageTransformer2DModel.from_pretrained(DIR)`, or a pipeline's
                     `transformer=` argument

The policy is rebuilt from the checkpoint's own config (its `model.path` must still be readable),
the weights loaded as `spotlight eval` loads them (`--weights raw|ema|auto`), and then handed to
diffusers' writers; nothing here re-implements a file format. The VLM formats (`transformers`,
`peft`) are in `vlm/export.py`.
"""

from __future__ import annotations

from pathlib import Path

from spotlight.core.checkpoint import Checkpoint
from spotlight.core.export import prepare_out, rebuild_policy

DIT_FORMATS = ("diffusers-lora", "diffusers")


def export_dit(ckpt: Checkpoint, out: str | Path, fmt: str, *, weights: str = "auto", force: bool = False) -> dict:
    """Write `ckpt` (a DiT checkpoint) to `out` in `fmt`; returns a summary for the command to print."""
    from spotlight.config import DiTRecipe
    from spotlight.policy import load_policy, load_trainable_state

    if fmt not in DIT_FORMATS:
        raise ValueError(f"--format {fmt}: a DiT run exports as {' or '.join(DIT_FORMATS)}")
    if fmt == "diffusers-lora" and not ckpt.meta.get("lora_rank"):
        raise ValueError(
            f"--format diffusers-lora: {ckpt.path} trained the whole transformer (no LoRA); use --format diffusers"
        )
    cfg, policy, which = rebuild_policy(
        ckpt, DiTRecipe, load_policy, load_trainable_state, weights, gradient_checkpointing=False
    )
    out = prepare_out(out, force)
    transformer = policy.transformer
    if fmt == "diffusers-lora":
        from diffusers import QwenImagePipeline
        from peft.utils import get_peft_model_state_dict

        QwenImagePipeline.save_lora_weights(
            out,
            transformer_lora_layers=get_peft_model_state_dict(transformer),
            transformer_lora_adapter_metadata=transformer.peft_config["default"].to_dict(),
        )
    else:
        if policy.has_lora:
            transformer.fuse_lora()  # W + (alpha / r) B A, then the adapter layers are removed
            transformer.unload_lora()
        transformer.save_pretrained(out)
    return {"format": fmt, "weights": which, "step": ckpt.step, "lora_rank": cfg.model.lora_rank, "to": str(out)}
