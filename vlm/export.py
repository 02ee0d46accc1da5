"""`spotlight export` of a VLM run: the formats transformers and peft load.

    transformers   the trained model, the adapter merged if there is one, with its processor:
                   `AutoModelForImageTextToText.from_pretrained(DIR)`, `AutoProcessor.from_pretrained(DIR)`
    peft           the LoRA adapter alone (LoRA runs): `PeftModel.from_pretrained(base, DIR)`, with
                   `base` the run's `model.path` (recorded as `base_model_name_or_path`)

As for the DiT (`spotlight/export.py`): the policy is rebuilt from the checkpoint's config and its
weights, and transformers' and peft's own `save_pretrained` write the files.
"""

from __future__ import annotations

from pathlib import Path

from spotlight.core.checkpoint import Checkpoint
from spotlight.core.export import prepare_out, rebuild_policy

VLM_FORMATS = ("transformers", "peft")


def export_vlm(ckpt: Checkpoint, out: str | Path, fmt: str, *, weights: str = "auto", force: bool = False) -> dict:
    """Write `ckpt` (a VLM checkpoint) to `out` in `fmt`; returns a summary for the command to print."""
    from vlm.config import VLMRecipe
    from vlm.policy import load_policy, load_trainable_state

    if fmt not in VLM_FORMATS:
        raise ValueError(f"--format {fmt}: a VLM run exports as {' or '.join(VLM_FORMATS)}")
    if fmt == "peft" and not ckpt.meta.get("lora_rank"):
        raise ValueError(f"--format peft: {ckpt.path} trained the model itself (no LoRA); use --format transformers")
    saved = {"train_vision": bool(ckpt.meta["train_vision"])} if "train_vision" in ckpt.meta else {}
    cfg, policy, which = rebuild_policy(ckpt, VLMRecipe, load_policy, load_trainable_state, weights, **saved)
    out = prepare_out(out, force)
    if fmt == "peft":
        policy.model.save_pretrained(out)
    else:
        model = policy.model.merge_and_unload() if policy.has_lora else policy.model
        model.save_pretrained(out)
        policy.processor.save_pretrained(out)
    return {"format": fmt, "weights": which, "step": ckpt.step, "lora_rank": cfg.model.lora_rank, "to": str(out)}
