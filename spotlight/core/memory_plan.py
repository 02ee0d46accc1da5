"""`spotlight memory`: GPU memory per role of a recipe, estimated before a GPU hour is spent.

Shape legend: D transformer width (heads x head dim), H heads, J prompt-encoder width, C packed
latent channels, L_img image tokens, L_txt text tokens, r LoRA rank, a bytes per activation element.

**Parameter counts** come from the model's config, never from weights: the real classes
(`QwenImageTransformer2DModel`, the Qwen2.5-VL prompt encoder, `AutoencoderKLQwenImage`, reward
models by their config's `architectures`) are built on the meta device from the config files in the
recipe's model folder, cast to the recipe's dtype, and the LoRA adapter is added with peft exactly
as `spotlight.policy` adds it. Where a folder is absent (the real 20B weights are not on this
machine) the published architecture in `PUBLISHED` below is built instead, and the plan says which
source each part came from.

**Per GPU, the trainer holds** (N GPUs, data parallel over N / sp, FSDP degree k, default 1):

    weights      = frozen params x dtype bytes (/ k) + trainable params x (dtype bytes, or 4 for the
                   fp32 master under FSDP mixed precision) (/ k) + FSDP's gathered working set
                   (2 blocks in the compute dtype: the one running and the prefetched one)
                 + frozen prompt encoder + VAE + reward models (not sharded)
                 + the KL reference copy (full fine-tune with beta > 0) and DiffusionNFT's
                   old-policy copy (objective nft with more than one optimizer step per update)
    gradients    = trainable params x dtype bytes (FSDP: x 4 / k, fp32 reduce)
    optimizer    = AdamW's 2 moments x trainable params x dtype bytes (torch keeps them in the
                   parameter's dtype; FSDP: fp32, / k)
    activations  = samples per forward x saved bytes per sample (below); CFG doubles the samples
    buffers      = the rollout's trajectory (N+1 steps x L_img x C x fp32) and prompt embeddings
                   of this GPU's samples

**Saved activations of one sample** (what autograd keeps for backward; fused attention saves
q, k, v, output and log-sum-exp, no L x L scores). Per transformer block and token, counted from
diffusers' `QwenImageTransformerBlock` (each stream: LayerNorm inputs, modulated inputs, the
q/k/v/out/MLP linear inputs, q and k before and after their RMSNorm, GELU input and output):

    full fine-tune:  25 D x a                    LoRA:  19 D x a + 6 r x a
    + (a < 4) 2 D x 4   (RMSNorm of q and k keeps an fp32 copy of its input)
    + small per-token statistics (LayerNorm mean/rstd, RMSNorm rsqrt per head, attention lse)

times (L_img + L_txt) tokens and num_layers blocks, plus outside the blocks (full: img_in,
txt_norm/txt_in, norm_out and proj_out inputs; LoRA: norm_out's input). With gradient
checkpointing a block keeps only its inputs (D x a per token) and one block is recomputed at a
time during backward: activations = num_layers x inputs + outside + one block. Sequence
parallelism divides the image tokens by sp (text stays replicated, as in `parallel/ulysses.py`).

**Rollout and explorer** (no gradients): the same frozen parts, plus the largest of the sampling
working set (~13 D x a per token and sample: residual streams, q/k/v and their joint copies, the
MLP's 4 D hidden; 12.9 measured on the tiny model), the prompt encoder's pass (every layer's hidden
states are kept, plus logits over the vocabulary) and the VAE decode (rough: 4 full-resolution
feature maps of the decoder's first width per image). In `spotlight train` the rollout runs in the
trainer's processes, so its row also carries the trainer's optimizer state and gradients (kept from
the last step until the next minibatch's zero_grad).

The check: `tests/test_memory_plan.py` runs real training steps of the tiny recipes on CPU and compares
these figures with measured ones (within 25%). This module holds the plan's data, the shared
meta-device and reward-model helpers, the suggestions and the output; the DiT estimate above is
`spotlight/memory_plan_dit.py`, the VLM one `vlm/memory_plan.py`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

GIB = 2**30
HEADROOM = 0.10
"""Share of GPU memory kept free for the CUDA context, allocator fragmentation and the transient
workspaces (activation gradients, kernel scratch) that the estimate leaves out."""
ASSUMED_TEXT_TOKENS = 128
"""Prompt tokens assumed when model.max_text_tokens is 0 and the prompts or tokenizer are not on disk."""
INFERENCE_UNITS = 13
"""Sampling working set per token and sample, in D x a (12.9 measured on the tiny model)."""
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
GROUPS = ("weights", "gradients", "optimizer", "activations", "buffers")

# Published architectures, used when the recipe's model folder is absent. Sources:
# - Qwen-Image transformer: Qwen/Qwen-Image transformer/config.json (60 layers, 24 heads x 128,
#   joint_attention_dim 3584 = the Qwen2.5-VL-7B encoder's width, in_channels 64 = 16 latent
#   channels packed 2x2, patch 2, rope axes 16/56/56), also diffusers' QwenImageTransformer2DModel
#   defaults (0.42.1).
# - Qwen-Image VAE: Qwen/Qwen-Image vae/config.json = AutoencoderKLQwenImage's defaults (base 96,
#   z 16, dim_mult 1/2/4/4, 2 res blocks, temporal downsample False/True/True: 8x spatially).
# - Qwen2.5-VL-7B (Qwen-Image's prompt encoder and the VLM recipe's model): Qwen/Qwen2.5-VL-7B-Instruct
#   config.json (text: hidden 3584, MLP 18944, 28 layers, 28 q / 4 kv heads, vocab 152064, untied
#   lm_head; vision: depth 32, hidden 1280, MLP 3420, 16 heads, patch 14, merge 2, window 112).
# - Qwen2.5-VL-32B: benchmarks/tp_sharing.py (Qwen2.5-32B text dims with the shared vision tower).
# - Reward models (parameter counts only): PickScore_v1 is CLIP ViT-H/14 (open_clip's model card:
#   986M); GOT-OCR-2.0 (Wei et al. 2024, arXiv:2409.01704, abstract: 580M); DETR-ResNet-50 (Carion
#   et al. 2020, arXiv:2005.12872, Table 1: 41M).
QWEN_IMAGE_TRANSFORMER = dict(
    patch_size=2,
    in_channels=64,
    out_channels=16,
    num_layers=60,
    attention_head_dim=128,
    num_attention_heads=24,
    joint_attention_dim=3584,
    guidance_embeds=False,
    axes_dims_rope=(16, 56, 56),
)
QWEN_IMAGE_VAE = dict(
    base_dim=96,
    z_dim=16,
    dim_mult=[1, 2, 4, 4],
    num_res_blocks=2,
    attn_scales=[],
    temperal_downsample=[False, True, True],
)
QWEN2_5_VL_VISION = dict(
    depth=32,
    hidden_size=1280,
    intermediate_size=3420,
    num_heads=16,
    patch_size=14,
    spatial_merge_size=2,
    temporal_patch_size=2,
    window_size=112,
    fullatt_block_indexes=[7, 15, 23, 31],
    tokens_per_second=2,
)
QWEN2_5_VL_TEXT = {
    "7B": dict(
        hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4
    ),
    "32B": dict(
        hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40, num_key_value_heads=8
    ),
}
REWARD_MODELS = {
    "clip_score": "clip_model_path",
    "pickscore": "clip_model_path",
    "ocr": "ocr_model_path",
    "geneval": "detector_model_path",
}
"""Model-based rewards and the option holding their folder (the other rewards need no model)."""
PUBLISHED_REWARD_PARAMS = {
    "clip_model_path": (986_000_000, "PickScore_v1 / CLIP ViT-H/14 (published: 986M)"),
    "ocr_model_path": (580_000_000, "GOT-OCR-2.0 (published: 580M)"),
    "detector_model_path": (41_000_000, "DETR-ResNet-50 (published: 41M)"),
}


def qwen2_5_vl_config(size: str = "7B"):
    """The published Qwen2.5-VL architecture of `size` ("7B" or "32B") as a `Qwen2_5_VLConfig`."""
    from transformers import Qwen2_5_VLConfig

    text = dict(QWEN2_5_VL_TEXT[size], vocab_size=152064, tie_word_embeddings=False)
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]}
    vision = dict(QWEN2_5_VL_VISION, out_hidden_size=text["hidden_size"])
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False)


# -- the plan's data -------------------------------------------------------------------------------


@dataclass
class Term:
    """One line of a role's memory."""

    group: str
    """One of GROUPS."""
    name: str
    """What it is."""
    bytes: float
    """Bytes per GPU."""
    how: str
    """How it was counted."""


@dataclass
class Role:
    """A process kind of the recipe and what one of its GPUs holds at its peak."""

    name: str
    """trainer, rollout or explorer."""
    where: str
    """Which GPUs run it."""
    terms: list[Term]
    """The memory lines."""
    note: str = ""
    """Anything that qualifies the figure."""

    @property
    def total(self) -> float:
        return sum(t.bytes for t in self.terms)

    def by_group(self) -> dict[str, float]:
        """Bytes per group (weights, gradients, optimizer, activations, buffers)."""
        return {g: sum(t.bytes for t in self.terms if t.group == g) for g in GROUPS}


@dataclass
class Layout:
    """How the recipe uses the GPUs; the switches the suggestions try."""

    gpus: int
    """GPUs of the role (the trainer's node for the trainer and its rollout)."""
    sp: int = 1
    """Sequence-parallel degree (Ulysses: image tokens split, text replicated)."""
    fsdp: int = 1
    """FSDP sharding degree of the trained model (1 = full replicas)."""
    gradient_checkpointing: bool = False
    """Recompute block activations in backward."""
    lora_rank: int = 0
    """LoRA rank; 0 trains every weight."""

    @property
    def dp(self) -> int:
        """Data-parallel degree: sequence-parallel groups among the GPUs."""
        return max(1, self.gpus // self.sp)


@dataclass
class Plan:
    """The estimate for one recipe on `gpus` GPUs of `gpu_mem_gib` each."""

    recipe: str
    kind: str
    """dit or vlm."""
    gpus: int
    gpu_mem_gib: float
    sources: dict[str, str]
    """Model part -> where its architecture came from."""
    shapes: dict[str, Any]
    """Tokens, batch sizes and switches the estimate used."""
    roles: list[Role]
    suggestions: list[str] = field(default_factory=list)

    @property
    def usable_bytes(self) -> float:
        return self.gpu_mem_gib * GIB * (1 - HEADROOM)

    def role(self, name: str) -> Role:
        return next(r for r in self.roles if r.name == name)

    def fits(self, role: Role) -> bool:
        return role.total <= self.usable_bytes

    def to_json(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if k != "roles"}
        out["usable_gib"] = round(self.usable_bytes / GIB, 2)
        out["headroom"] = HEADROOM
        out["roles"] = [
            {
                "name": r.name,
                "where": r.where,
                "note": r.note,
                "total_gib": round(r.total / GIB, 3),
                "fits": self.fits(r),
                "groups_gib": {g: round(b / GIB, 3) for g, b in r.by_group().items()},
                "terms": [
                    {
                        "group": t.group,
                        "name": t.name,
                        "gib": round(t.bytes / GIB, 4),
                        "bytes": int(t.bytes),
                        "how": t.how,
                    }
                    for t in r.terms
                ],
            }
            for r in self.roles
        ]
        return out


# -- models on the meta device ---------------------------------------------------------------------


def meta_bytes(module: torch.nn.Module, *, trainable: bool | None = None) -> tuple[int, int]:
    """(elements, bytes) of a module's parameters and buffers; `trainable` selects requires_grad ones."""
    tensors = [p for p in module.parameters() if trainable is None or p.requires_grad == trainable]
    if trainable is None:
        tensors += list(module.buffers())
    return sum(t.numel() for t in tensors), sum(t.numel() * t.element_size() for t in tensors)


def on_meta(build: Callable[[], torch.nn.Module], dtype: torch.dtype) -> torch.nn.Module:
    with torch.device("meta"):
        module = build()
    return module.to(dtype)


def hf_model_params(folder: Path) -> tuple[int, int, str]:
    """(parameters, bytes, source) of a transformers model folder, built from its config.json on meta."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(folder)
    arch = (config.architectures or ["AutoModel"])[0]
    cls = getattr(transformers, arch, None)
    with torch.device("meta"):
        model = cls._from_config(config) if cls is not None else transformers.AutoModel.from_config(config)
    numel, nbytes = meta_bytes(model)
    return numel, nbytes, f"{folder}/config.json ({arch}, meta device)"


@dataclass
class RewardModel:
    name: str
    params: int
    bytes: int
    source: str


def reward_models(weights: dict[str, float], options: dict[str, Any]) -> list[RewardModel]:
    """The model-based rewards of a recipe, counted from their folders or the published sizes (fp32)."""
    out, seen = [], set()
    for reward in weights:
        key = REWARD_MODELS.get(reward)
        if key is None or key in seen:
            continue
        seen.add(key)
        folder = Path(str(options.get(key, ""))).expanduser()
        if (folder / "config.json").is_file():
            numel, nbytes, source = hf_model_params(folder)
        else:
            numel, what = PUBLISHED_REWARD_PARAMS[key]
            nbytes, source = 4 * numel, f"{what}, fp32; {key} {str(folder)!r} not on disk"
        out.append(RewardModel(reward, numel, nbytes, source))
    return out


# -- shared helpers ------------------------------------------------------------------------------


def gib_str(b: float) -> str:
    return f"{b / GIB:.2f} GiB"


def count_str(n: float) -> str:
    """1.23B, 424.7M, 0.33M: parameter counts for people."""
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


# -- suggestions -----------------------------------------------------------------------------------


def _degrees(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def suggest(
    plan: Plan,
    roles_for: Callable[[Layout], list[Role]],
    base: Layout,
    *,
    heads: int,
    sp_trains: bool,
    gc_option: bool,
    batch_knob: tuple[str, int, Callable[[int], list[Role]]] | None,
) -> list[str]:
    """Settings under which the trainer's GPUs (its update and rollout phases) fit.

    Tries every combination of gradient checkpointing (where the recipe has it), LoRA rank 64 (for a
    full fine-tune), FSDP degree and SP degree, and reports the fitting ones with the fewest changes.
    """
    usable = plan.usable_bytes
    out: list[str] = []
    trainer_side = [r for r in plan.roles if r.name in ("trainer", "rollout")]
    peak = max(r.total for r in trainer_side)
    if peak <= usable:
        out.append(f"fits as configured: the trainer's GPUs peak at {gib_str(peak)} of {gib_str(usable)} usable")
    else:
        candidates = []
        for gc in sorted({base.gradient_checkpointing, True} if gc_option else {base.gradient_checkpointing}):
            for rank in sorted({base.lora_rank, 64 if base.lora_rank == 0 else base.lora_rank}):
                for fsdp in _degrees(base.gpus):
                    for sp in [d for d in _degrees(base.gpus) if heads % d == 0]:
                        layout = replace(base, gradient_checkpointing=gc, lora_rank=rank, fsdp=fsdp, sp=sp)
                        roles = [r for r in roles_for(layout) if r.name in ("trainer", "rollout")]
                        total = max(r.total for r in roles)
                        if total <= usable:
                            changes = (
                                (gc != base.gradient_checkpointing) + (rank != base.lora_rank) + (fsdp > 1) + (sp > 1)
                            )
                            candidates.append((changes, fsdp, sp, layout, total))
        candidates.sort(key=lambda c: c[:3])
        shown = 0
        for _, fsdp, sp, layout, total in candidates:
            parts = []
            if layout.gradient_checkpointing != base.gradient_checkpointing:
                parts.append("model.gradient_checkpointing=true")
            if layout.lora_rank != base.lora_rank:
                parts.append(f"LoRA (model.lora_rank={layout.lora_rank}) instead of a full fine-tune")
            if fsdp > 1:
                parts.append(f"FSDP over >= {fsdp} GPUs (configs/accelerate/fsdp.yaml; VLM: train.schedule=serial)")
            if sp > 1:
                caveat = "" if sp_trains else "; the trainer has no SP yet (parallel/ulysses.py is forward-only)"
                parts.append(f"SP degree {sp} brings activations under the limit{caveat}")
            out.append(" + ".join(parts) + f": peak {gib_str(total)}")
            shown += 1
            if shown == 3:
                break
        if not candidates:
            out.append(
                f"no combination of LoRA / FSDP (<= {base.gpus} GPUs) / SP fits the trainer: use larger GPUs or more "
                "of them"
            )
        if batch_knob is not None:
            name, current, roles_at = batch_knob
            fitting = [
                b
                for b in range(current - 1, 0, -1)
                if max(r.total for r in roles_at(b) if r.name in ("trainer", "rollout")) <= usable
            ]
            if fitting:
                out.append(f"or {name}={fitting[0]} (fewer samples per forward) fits as configured otherwise")
    return out


# -- output ----------------------------------------------------------------------------------


def print_plan(plan: Plan, console=None) -> None:
    """A small table per role and a one-screen summary."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    console.print(
        f"[bold]spotlight memory[/bold] {plan.recipe} ({plan.kind}): {plan.gpus} GPU(s) x {plan.gpu_mem_gib:g} GiB, "
        f"{gib_str(plan.usable_bytes)} usable ({HEADROOM:.0%} headroom)"
    )
    for part, source in plan.sources.items():
        console.print(f"  {part}: {source}")
    console.print("  " + ", ".join(f"{k}={v}" for k, v in plan.shapes.items()))
    for role in plan.roles:
        fits = "[green]fits[/green]" if plan.fits(role) else "[red]does not fit[/red]"
        table = Table(
            title=f"{role.name}: {role.where} — {gib_str(role.total)}, {fits}",
            caption=role.note or None,
            title_justify="left",
        )
        for col, justify in (("group", "left"), ("component", "left"), ("GiB", "right"), ("how", "left")):
            table.add_column(col, justify=justify, overflow="fold")
        for t in role.terms:
            if t.bytes:
                table.add_row(t.group, t.name, f"{t.bytes / GIB:.2f}", t.how)
        console.print(table)
    console.print("[bold]summary[/bold]")
    for role in plan.roles:
        groups = ", ".join(f"{g} {b / GIB:.1f}" for g, b in role.by_group().items() if b)
        console.print(
            f"  {role.name:9s} {role.total / GIB:8.2f} GiB  {'fits' if plan.fits(role) else 'DOES NOT FIT'}  ({groups})"
        )
    for s in plan.suggestions:
        console.print(f"  - {s}")


def plan_json(plan: Plan) -> str:
    return json.dumps(plan.to_json())
