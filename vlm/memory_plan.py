"""`spotlight memory` for VLM recipes: the trainer's update and rollout phases of a Qwen2.5-VL GRPO run.

Shape legend: D text width, F MLP width, Dv / Fv the vision tower's, L prompt tokens (left-padded,
image tokens included), T response tokens (rollout.max_new_tokens), V vocabulary, r LoRA rank,
a bytes per activation element, b rows per micro-batch, P prompts per iteration.

The model is built from its config on the meta device (`AutoModelForImageTextToText`, as
`VLMPolicy.load` loads it), or from the published Qwen2.5-VL-7B / 32B architecture when the folder is
absent (`spotlight.core.memory_plan.qwen2_5_vl_config`). The LoRA adapter is added with peft's `get_peft_model`,
as `VLMPolicy.add_lora` does: it keeps fp32 adapters on a bf16 model (peft's autocast_adapter_dtype).

Saved bytes per token of one decoder layer (transformers' Qwen2.5-VL; k and v are repeated to
every head because a padding mask rules out SDPA's native GQA):

    full fine-tune: 2 D (4 + a)                     the two RMSNorms: fp32 input + normalised output
                    + (5 D + 2 D + 4 F) a           q/k/v input, rotated q, k, v, attention output,
                                                    o_proj input, MLP input; gate, SiLU, up, product
    LoRA:           2 D 4                           frozen norms keep only their fp32 input
                    + (2 D + 2 D + 3 F) a           rotated q, k, v, output; gate, SiLU, up
                    + adapter inputs + 7 r          one copy per target in the adapter's dtype when
                                                    it differs from the model's (peft casts the input)

Vision tower per patch and block (when it trains): 2 Dv (4 + a) + 9 Dv a + 4 Fv a (v stays a view
of the fused qkv output, which keeps all three alive), plus the patch embedding's input and the
merger. The loss keeps log-softmax over V in fp32 for each response token.

Schedules (`train.schedule`): "serial" runs b rows x (L + T) tokens per micro-batch, the vision tower
per row; "rollplex" keeps the actor prefix (P prompts x L tokens, vision once per prompt) with its
graph through the update, and each micro-batch runs b x T suffix tokens whose attention saves k and
v over L + T. The reference prefix's keys and values are boundary state (buffers).

Under FSDP (configs/accelerate/fsdp.yaml, serial schedule) each of the k processes holds 1/k of the
weights, gradients and optimizer state and scores its own rows of every minibatch (1/k of them) in
micro-batches of at most `train.micro_batch_size`.
"""

from __future__ import annotations

import json
import math
import re
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from spotlight.core.memory_plan import (
    DTYPE_BYTES,
    Layout,
    Plan,
    Role,
    Term,
    count_str,
    meta_bytes,
    on_meta,
    qwen2_5_vl_config,
    suggest,
)

ASSUMED_TEXT_TOKENS = 40
"""Chat template + question tokens assumed when the model folder (and its processor) is absent."""


@dataclass
class VLMModel:
    """What the VLM estimate needs from the model: sizes, widths, sources."""

    bytes: int
    params: int
    vision_params: int
    layer_bytes: int
    """One decoder layer's weights (FSDP gathers one at a time)."""
    lora_params_per_rank: int
    lora_bytes_per_param: int
    layers: int
    dim: int
    ffn: int
    kv_dim: int
    vocab: int
    vision_depth: int
    vision_dim: int
    vision_ffn: int
    patch_channels: int
    source: str


def load_vlm_model(cfg) -> VLMModel:
    """The recipe's model on the meta device: from its config.json, or the published architecture."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForImageTextToText

    from vlm.policy import DTYPES, LM_LORA, VISION_LORA

    folder = Path(cfg.model.path).expanduser()
    if (folder / "config.json").is_file():
        config = AutoConfig.from_pretrained(folder)
        source = f"{folder}/config.json (meta device)"
    else:
        size = "32B" if re.search(r"32b", folder.name, re.IGNORECASE) else "7B"
        config = qwen2_5_vl_config(size)
        source = f"published Qwen2.5-VL-{size} config ({folder} not on disk; size read from the folder name, else 7B)"
    dtype = DTYPES[cfg.model.dtype]
    model = on_meta(lambda: AutoModelForImageTextToText.from_config(config), dtype)
    nbytes = meta_bytes(model)[1]
    numel = meta_bytes(model, trainable=True)[0]  # parameters only
    vision_params = meta_bytes(model.model.visual, trainable=True)[0]
    layer_bytes = meta_bytes(model.model.language_model.layers[0])[1]
    target = f"({LM_LORA}|{VISION_LORA})" if cfg.model.train_vision else LM_LORA
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers' deprecation notice inside peft
        peft_model = get_peft_model(model, LoraConfig(r=1, lora_alpha=1, target_modules=target, lora_dropout=0.0))
    lora_numel, lora_bytes = meta_bytes(peft_model, trainable=True)
    text, vision = config.text_config, config.vision_config
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return VLMModel(
        bytes=nbytes,
        params=numel,
        vision_params=vision_params,
        layer_bytes=layer_bytes,
        lora_params_per_rank=lora_numel,
        lora_bytes_per_param=lora_bytes // max(1, lora_numel),
        layers=text.num_hidden_layers,
        dim=text.hidden_size,
        ffn=text.intermediate_size,
        kv_dim=text.num_key_value_heads * head_dim,
        vocab=text.vocab_size,
        vision_depth=vision.depth,
        vision_dim=vision.hidden_size,
        vision_ffn=vision.intermediate_size,
        patch_channels=vision.in_channels * vision.temporal_patch_size * vision.patch_size**2,
        source=source,
    )


def prompt_shape(cfg) -> tuple[int, int, str]:
    """(prompt tokens L, vision patches per image, source): from the folder's processor on task examples, or assumed."""
    from vlm.task import TrainStream, example_image

    folder = Path(cfg.model.path).expanduser()
    grid = cfg.task.grid_size
    if (folder / "config.json").is_file() and (folder / "tokenizer_config.json").is_file():
        from vlm.policy import VLMPolicy
        from vlm.processor import load_processor

        model_type = json.loads((folder / "config.json").read_text())["model_type"]
        policy = VLMPolicy(None, load_processor(folder, model_type))  # the processor only: no weights
        examples = TrainStream(cfg.task, seed=cfg.train.seed).batch(0, cfg.train.prompts_per_iteration)
        batch = policy.encode([e.question for e in examples], [example_image(e, cfg.task) for e in examples])
        patches = batch.pixel_values_NC.shape[0] // len(examples)
        return batch.input_ids_BL.shape[1], patches, f"the folder's processor on {len(examples)} task examples"
    # Qwen2.5-VL: one 14-pixel patch per 14 x 14, one LM token per 2 x 2 patches; the task's image is grid x 28 px.
    return (
        grid * grid + ASSUMED_TEXT_TOKENS,
        4 * grid * grid,
        f"{grid}x{grid} image tokens + {ASSUMED_TEXT_TOKENS} text tokens (assumed)",
    )


def layer_bytes_per_token(m: VLMModel, a: int, lora_rank: int, ad: int) -> float:
    """Bytes one decoder layer saves for backward per token (see the module docstring); ad: adapter bytes."""
    d, f = m.dim, m.ffn
    if not lora_rank:
        return 2 * d * (4 + a) + (5 * d + 2 * d + 4 * f) * a
    # The targets' inputs: q/k/v share theirs, gate/up theirs, o_proj and down_proj their own.
    inputs = (3 * d + d + 2 * d + f) * ad if ad != a else (d + d + d + f) * a
    return 2 * d * 4 + (2 * d + 2 * d + 3 * f) * a + inputs + 7 * lora_rank * ad


def vision_bytes_per_patch(m: VLMModel, a: int) -> float:
    """Bytes the vision tower saves per patch when it trains (LoRA on the tower counted as full)."""
    dv = m.vision_dim
    blocks = m.vision_depth * (2 * dv * (4 + a) + 9 * dv * a + 4 * m.vision_ffn * a)
    merger = dv * (4 + a) + 3 * dv * a
    return blocks + merger + m.patch_channels * a


def vlm_roles(cfg, m: VLMModel, layout: Layout, prompt_tokens: int, patches: int) -> tuple[list[Role], dict]:
    """The trainer (update phase) and rollout (generation phase) of a VLM recipe under `layout`."""
    tc, rc = cfg.train, cfg.rollout
    a = DTYPE_BYTES[cfg.model.dtype]
    k, r = layout.fsdp, layout.lora_rank
    rows_total = tc.prompts_per_iteration * tc.group_size
    L, T = prompt_tokens, rc.max_new_tokens
    b = min(tc.micro_batch_size, math.ceil(min(tc.minibatch_size, rows_total) / k))  # FSDP processes split the rows
    vision_trains = cfg.model.train_vision
    lora_params = r * m.lora_params_per_rank
    trainable = lora_params if r else m.params - (0 if vision_trains else m.vision_params)

    resident = _resident_terms(cfg, m, layout, trainable, lora_params)
    acts, boundary = _update_terms(cfg, m, layout, L, T, b, patches)
    trainer = Role("trainer", "1 GPU per trainer process, the update", [*resident, *acts, *boundary])

    rows = min(rc.batch_size, rows_total)
    kv_cache = rows * (L + T) * m.layers * 2 * m.kv_dim * a
    prefill = rows * L * (5 * m.dim + 2 * m.kv_dim + 3 * m.ffn) * a + rows * m.vocab * 4
    gen = [
        Term("activations", "KV cache", kv_cache, f"{rows} rows x {L + T} tokens x {m.layers} layers x 2 x {m.kv_dim}"),
        Term("activations", "prefill working set", prefill, f"{rows} rows x {L} tokens, one layer at a time (rough)"),
    ]
    if tc.schedule == "rollplex":  # the prefixes run during the decode
        gen += [t for t in acts if t.name.startswith("actor prefix")] + boundary
    rollout = Role(
        "rollout",
        "the trainer's GPU, during generation",
        [*resident, *gen],
        "`generate` in the trainer's process; gradients stay allocated until the next zero_grad",
    )
    shapes = {
        "prompt_tokens": L,
        "response_tokens": T,
        "patches_per_image": patches,
        "rows_per_micro_batch": b,
        "rollout_rows": rows,
        "schedule": tc.schedule,
        "dtype": cfg.model.dtype,
        "lora_rank": r,
        "train_vision": vision_trains,
        "fsdp": k,
    }
    return [trainer, rollout], shapes


def _resident_terms(cfg, m: VLMModel, layout: Layout, trainable: int, lora_params: int) -> list[Term]:
    """What the trainer's GPU holds in every phase: weights (and the KL reference copy), gradients, moments."""
    tc, a, k, r = cfg.train, DTYPE_BYTES[cfg.model.dtype], layout.fsdp, layout.lora_rank
    vision_trains = cfg.model.train_vision
    ad = m.lora_bytes_per_param if r else a
    t_bytes = ad if r else a
    if k > 1:
        frozen = (m.bytes if r else (0 if vision_trains else m.vision_params * a)) / k
        weights = Term(
            "weights",
            "model (FSDP shards + 2 gathered layers)",
            frozen + trainable * 4 / k + 2 * m.layer_bytes,
            f"frozen {cfg.model.dtype} / {k} + fp32 master of {count_str(trainable)} trained params / {k}",
        )
        grads, moments, gb = trainable * 4 / k, 2 * trainable * 4 / k, f"4 B / {k}"
    else:
        weights = Term(
            "weights",
            "model" + (f" + LoRA r={r}" if r else ""),
            m.bytes + lora_params * ad * bool(r),
            f"{count_str(m.params)} params x {a} B"
            + (f" + {count_str(lora_params)} adapter params x {ad} B" if r else ""),
        )
        grads, moments, gb = trainable * t_bytes, 2 * trainable * t_bytes, f"{t_bytes} B"
    resident = [weights]
    if tc.beta > 0 and not r:
        resident.append(
            Term("weights", "KL reference copy (frozen)", m.bytes / k, "full fine-tune with train.beta > 0")
        )
    resident += [
        Term("gradients", "gradients", grads, f"{count_str(trainable)} trained params x {gb}"),
        Term("optimizer", "AdamW moments", moments, f"2 x {count_str(trainable)} x {gb}"),
    ]

    return resident


def _update_terms(cfg, m: VLMModel, layout: Layout, L: int, T: int, b: int, patches: int):
    """The update's saved activations, and (rollplex) the boundary state the prefixes leave behind."""
    tc, a, r = cfg.train, DTYPE_BYTES[cfg.model.dtype], layout.lora_rank
    ad = m.lora_bytes_per_param if r else a
    num_prompts = tc.prompts_per_iteration
    vision_trains = cfg.model.train_vision
    per_token = m.layers * layer_bytes_per_token(m, a, r, ad)
    final_norm = m.dim * (4 if r else 4 + a)
    head_in = 0 if r else m.dim * a  # lm_head keeps its input only when it trains
    kv_per_token = m.layers * 2 * m.dim * a  # k and v (repeated) that SDPA keeps
    logsoftmax = T * m.vocab * 4
    vision = patches * vision_bytes_per_patch(m, a) if vision_trains else 0
    if tc.schedule == "rollplex":
        prefix = num_prompts * (L * (per_token + final_norm) + head_in + vision)
        suffix = b * (T * (per_token - kv_per_token + final_norm + head_in) + (L + T) * kv_per_token + logsoftmax)
        acts = [
            Term(
                "activations",
                "actor prefix (graph kept)",
                prefix,
                f"{num_prompts} prompts x {L} tokens" + (f" + vision {patches} patches each" if vision else ""),
            ),
            Term(
                "activations",
                "suffix micro-batch",
                suffix,
                f"{b} rows x {T} tokens, k/v over {L + T}, log-softmax over {m.vocab}",
            ),
        ]
    else:
        per_row = (L + T) * (per_token + final_norm) + (T + 1) * head_in + logsoftmax + vision
        acts = [
            Term(
                "activations",
                "micro-batch",
                b * per_row,
                f"{b} rows x {L + T} tokens" + (f" + vision {patches} patches per row" if vision else ""),
            )
        ]
    boundary = []
    if tc.schedule == "rollplex":
        ref_kv = (num_prompts * L * m.layers * 2 * m.kv_dim * a + num_prompts * m.vocab * a) if tc.beta > 0 else 0
        features = num_prompts * (patches // 4) * m.dim * a
        boundary = [
            Term(
                "buffers",
                "reference prefix keys/values",
                ref_kv,
                f"{num_prompts} prompts x {L} tokens x {m.layers} layers",
            ),
            Term("buffers", "shared vision features", features, f"{num_prompts} images x {patches // 4} tokens"),
        ]
    return acts, boundary


def plan_vlm(recipe: str, overrides: list[str], gpus: int, gpu_mem_gib: float) -> Plan:
    """The VLM plan: roles, sources and suggestions."""
    from spotlight.core.config_io import load_config
    from vlm.config import VLMRecipe

    cfg = load_config(VLMRecipe, recipe, overrides)
    m = load_vlm_model(cfg)
    prompt_tokens, patches, token_source = prompt_shape(cfg)
    base = Layout(gpus=gpus, lora_rank=cfg.model.lora_rank)
    roles, shapes = vlm_roles(cfg, m, base, prompt_tokens, patches)
    shapes["prompt_tokens_source"] = token_source
    plan = Plan(recipe, "vlm", gpus, gpu_mem_gib, {"model": m.source}, shapes, roles)

    def roles_for(layout: Layout) -> list[Role]:
        return vlm_roles(cfg, m, replace(layout, sp=1), prompt_tokens, patches)[0]

    def roles_at(micro: int) -> list[Role]:
        return vlm_roles(
            replace(cfg, train=replace(cfg.train, micro_batch_size=micro)), m, base, prompt_tokens, patches
        )[0]

    rows = shapes["rows_per_micro_batch"]
    plan.suggestions = suggest(
        plan,
        roles_for,
        base,
        heads=1,
        sp_trains=False,
        gc_option=False,
        batch_knob=("train.micro_batch_size", rows, roles_at) if rows > 1 else None,
    )
    plan.suggestions.append("explorer: none (the VLM path has no seed exploration)")
    return plan
