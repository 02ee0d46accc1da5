"""How much of Qwen2.5-VL-32B's rollout copy can share the training storage across TP layouts.

Builds `Qwen2_5_VLForConditionalGeneration` with the 32B architecture on the meta device (no
weights, nothing downloaded), plans weight sharing between training TP `--train-tp` and rollout
TP `--rollout-tp` (`vlm.tp_sharing`, the Rollplex paper), and reports the fraction of parameters in
each class (share / view / rebuild; shared_fraction = share + view), the per-device bf16 bytes
of a rollout shard and of the rebuild buffers, and the same figures for a layout whose text q/k/v
are one fused [Q; K; V] tensor (vLLM's `qkv_proj`), the case Rollplex's 7.2% rebuild matches.
Rollplex reports 60.0% / 32.8% / 7.2% (92.8% shared) at t=8, r=4; nothing here is fitted to it.

    .venv/bin/python benchmarks/tp_sharing.py --json
    .venv/bin/python benchmarks/tp_sharing.py --train-tp 8 --rollout-tp 2
"""

from __future__ import annotations

import argparse
import json
import re

import torch

from vlm.tp_sharing import Rule, SharingPlan, fused_qkv, plan_sharing, qwen2_5_vl_rules

BF16_BYTES = 2
GIB = 2**30


def qwen2_5_vl_32b_config(vision_intermediate: int = 3456):
    """The published Qwen2.5-VL-32B architecture as a `Qwen2_5_VLConfig`.

    Sources (found with the project's search tool; the 32B config.json itself was not in reach):
    text dims are Qwen2.5-32B's config.json (hidden 5120, intermediate 27648, 64 layers, 40 q / 8
    kv heads, vocab 152064, untied lm_head), which Qwen2.5-VL-32B's decoder uses; the vision
    tower is the one Qwen2.5-VL shares across sizes (Qwen2.5-VL-7B-Instruct config.json: depth 32,
    hidden 1280, 16 heads, patch 14, spatial merge 2, temporal patch 2, window 112, full attention
    in blocks 7/15/23/31), with out_hidden_size = the decoder's 5120. Vision MLP width: the
    Qwen2.5-VL technical report lists 3456, config.json files (and transformers' default) 3420.
    3420 = 4 * 855 cannot be split 8 ways; 3456 = 27 * 128 is 3420 padded to a multiple of 128,
    which a TP-8 vision tower needs anyway, so 3456 is the default (`--vision-intermediate 3420`
    shows the planner's error). The tower is ~2% of the model, so this moves fractions < 0.1%.
    """
    from transformers import Qwen2_5_VLConfig

    return Qwen2_5_VLConfig(
        text_config=dict(
            hidden_size=5120,
            intermediate_size=27648,
            num_hidden_layers=64,
            num_attention_heads=40,
            num_key_value_heads=8,
            vocab_size=152064,
            tie_word_embeddings=False,
            rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]},  # sums to head_dim 128 / 2
        ),
        vision_config=dict(
            depth=32,
            hidden_size=1280,
            intermediate_size=vision_intermediate,
            num_heads=16,
            out_hidden_size=5120,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=112,
            fullatt_block_indexes=[7, 15, 23, 31],
            tokens_per_second=2,
        ),
        tie_word_embeddings=False,
    )


def meta_shapes(config) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape of `Qwen2_5_VLForConditionalGeneration(config)`, built on the meta device."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    with torch.device("meta"):
        model = Qwen2_5_VLForConditionalGeneration(config)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def fuse_text_qkv(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The same parameters with each text layer's q/k/v (weight and bias) fused into one `qkv_proj`."""
    pattern = re.compile(r"^(.*\blanguage_model\.layers\.\d+\.self_attn\.)([qkv])_proj\.(weight|bias)$")
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in shapes.items():
        match = pattern.match(name)
        if match is None:
            out[name] = shape
            continue
        fused = f"{match[1]}qkv_proj.{match[3]}"
        rows = out[fused][0] + shape[0] if fused in out else shape[0]
        out[fused] = (rows, *shape[1:])
    return out


def summary(plan: SharingPlan) -> dict[str, float]:
    out = {key: round(value, 4) for key, value in plan.fractions().items()}
    out["rebuild_buffer_gib"] = round(plan.rollout_shard_numel("rebuild") * BF16_BYTES / GIB, 3)
    out["rollout_shard_gib"] = round(plan.rollout_shard_numel() * BF16_BYTES / GIB, 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train-tp", type=int, default=8, help="training TP degree t")
    parser.add_argument("--rollout-tp", type=int, default=4, help="rollout TP degree r")
    parser.add_argument("--vision-intermediate", type=int, default=3456, help="vision MLP width (see docstring)")
    parser.add_argument("--json", action="store_true", help="print only the one JSON line")
    args = parser.parse_args()

    config = qwen2_5_vl_32b_config(args.vision_intermediate)
    shapes = meta_shapes(config)
    rules = qwen2_5_vl_rules(config)
    plan = plan_sharing(shapes, rules, args.train_tp, args.rollout_tp)
    text = config.text_config
    fused_rules = (
        Rule(
            r"\blanguage_model\.layers\.\d+\.self_attn\.qkv_proj\.(weight|bias)$",
            fused_qkv(text.num_attention_heads, text.num_key_value_heads, text.hidden_size // text.num_attention_heads),
        ),
        *rules,
    )
    fused_plan = plan_sharing(fuse_text_qkv(shapes), fused_rules, args.train_tp, args.rollout_tp)
    result = {
        "baseline": "a separate rollout copy of every weight (nothing shared)",
        **summary(plan),
        "train_tp": args.train_tp,
        "rollout_tp": args.rollout_tp,
        "params_b": round(plan.numel() / 1e9, 3),
        "rebuilt_tensors": sorted({re.sub(r"\.\d+\.", ".N.", p.name) for p in plan.tensors if p.kind == "rebuild"}),
        "if_text_qkv_fused": summary(fused_plan),
    }
    if not args.json:
        by_split: dict[str, dict[str, int]] = {}
        for p in plan.tensors:
            by_split.setdefault(p.split.kind, {}).setdefault(p.kind, 0)
            by_split[p.split.kind][p.kind] += p.numel
        for split_kind, counts in by_split.items():
            cells = ", ".join(f"{kind} {n / plan.numel():.2%}" for kind, n in counts.items())
            print(f"{split_kind:>10}: {cells}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
