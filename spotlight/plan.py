"""`spotlight plan`: GPU memory per role of a recipe, estimated before a GPU hour is spent.

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

The check: `tests/test_plan.py` runs real training steps of the tiny recipes on CPU and compares
these figures with measured ones (within 25%). The VLM side is `vlm/plan.py`.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import torch
import yaml

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
    patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128, num_attention_heads=24,
    joint_attention_dim=3584, guidance_embeds=False, axes_dims_rope=(16, 56, 56),
)  # fmt: skip
QWEN_IMAGE_VAE = dict(base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[], temperal_downsample=[False, True, True])
QWEN2_5_VL_VISION = dict(
    depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, patch_size=14, spatial_merge_size=2,
    temporal_patch_size=2, window_size=112, fullatt_block_indexes=[7, 15, 23, 31], tokens_per_second=2,
)  # fmt: skip
QWEN2_5_VL_TEXT = {
    "7B": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4),
    "32B": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40, num_key_value_heads=8),
}
REWARD_MODELS = {"clip_score": "clip_model_path", "pickscore": "clip_model_path", "ocr": "ocr_model_path", "geneval": "detector_model_path"}
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
    """FSDP sharding degree of the trained model (1 = full replicas, as the trainers run today)."""
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
                "name": r.name, "where": r.where, "note": r.note, "total_gib": round(r.total / GIB, 3), "fits": self.fits(r),
                "groups_gib": {g: round(b / GIB, 3) for g, b in r.by_group().items()},
                "terms": [{"group": t.group, "name": t.name, "gib": round(t.bytes / GIB, 4), "bytes": int(t.bytes), "how": t.how} for t in r.terms],
            }
            for r in self.roles
        ]  # fmt: skip
        return out


# -- models on the meta device ---------------------------------------------------------------------


def meta_bytes(module: torch.nn.Module, *, trainable: bool | None = None) -> tuple[int, int]:
    """(elements, bytes) of a module's parameters and buffers; `trainable` selects requires_grad ones."""
    tensors = [p for p in module.parameters() if trainable is None or p.requires_grad == trainable]
    if trainable is None:
        tensors += list(module.buffers())
    return sum(t.numel() for t in tensors), sum(t.numel() * t.element_size() for t in tensors)


def _on_meta(build: Callable[[], torch.nn.Module], dtype: torch.dtype) -> torch.nn.Module:
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


@dataclass
class DiTModel:
    """What the DiT estimate needs from the model folder: sizes, widths, sources."""

    transformer_bytes: int
    transformer_params: int
    dead_params: int
    """Parameters that get no gradient in a full fine-tune (the last block's text output path)."""
    dead_lora_per_rank: int
    """The adapter parameters on that path, per unit of rank."""
    lora_params_per_rank: int
    """Adapter parameters per unit of rank (an adapter's size is linear in r)."""
    lora_bytes_per_param: int
    """Adapter dtype bytes (diffusers' add_adapter casts the adapter to the base layer's dtype)."""
    block_bytes: int
    """One transformer block's weights (FSDP gathers one at a time)."""
    text_encoder_bytes: int
    text_encoder_layers: int
    text_encoder_width: int
    text_encoder_vocab: int
    vae_bytes: int
    vae_width: int
    """Channels of the VAE decoder's full-resolution stage (0 for the parameter-free codec)."""
    downsample: int
    latent_channels: int
    num_layers: int
    dim: int
    heads: int
    joint_dim: int
    in_channels: int
    sources: dict[str, str]


def load_dit_model(model_path: str, dtype: str) -> DiTModel:
    """Build the recipe's transformer, prompt encoder and codec on the meta device (or the published ones)."""
    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel
    from peft import LoraConfig
    from transformers import AutoConfig, Qwen2_5_VLForConditionalGeneration

    from spotlight.latents import load_codec
    from spotlight.policy import DTYPES, LORA_TARGETS, default_model_path

    torch_dtype = DTYPES[dtype]
    folder = Path(model_path).expanduser() if model_path else default_model_path()
    sources = {}

    if (folder / "transformer" / "config.json").is_file():
        tcfg = QwenImageTransformer2DModel.load_config(folder / "transformer")
        sources["transformer"] = f"{folder}/transformer/config.json (meta device)"
    else:
        tcfg = QWEN_IMAGE_TRANSFORMER
        sources["transformer"] = f"published Qwen-Image transformer config ({folder}/transformer not on disk)"
    transformer = _on_meta(lambda: QwenImageTransformer2DModel.from_config(tcfg), torch_dtype)
    nbytes = meta_bytes(transformer)[1]
    numel = meta_bytes(transformer, trainable=True)[0]  # parameters only (a full fine-tune trains them all)
    block_bytes = meta_bytes(transformer.transformer_blocks[0])[1]
    # The last block's text stream after attention never reaches the output (only image tokens go
    # to proj_out): its weights get no gradient, hence no AdamW state either.
    last = transformer.transformer_blocks[-1]
    dead = [last.attn.to_add_out, last.txt_mlp]
    dead_params = sum(meta_bytes(mod, trainable=True)[0] for mod in dead)
    # The adapter as `DiTPolicy.add_lora` attaches it, at rank 1: its size is linear in the rank.
    # On meta, peft skips its cast to the base dtype; the real path casts, hence the .to(dtype).
    transformer.requires_grad_(False)
    with torch.device("meta"):
        transformer.add_adapter(LoraConfig(r=1, lora_alpha=1, target_modules=LORA_TARGETS))
    transformer.to(torch_dtype)
    lora_numel, lora_bytes = meta_bytes(transformer, trainable=True)
    dead_lora = sum(meta_bytes(mod, trainable=True)[0] for mod in dead)

    if (folder / "text_encoder" / "config.json").is_file():
        te_cfg = AutoConfig.from_pretrained(folder / "text_encoder")
        sources["text_encoder"] = f"{folder}/text_encoder/config.json (meta device)"
    else:
        te_cfg = qwen2_5_vl_config("7B")
        sources["text_encoder"] = "published Qwen2.5-VL-7B config (text_encoder/ not on disk)"
    text_encoder = _on_meta(lambda: Qwen2_5_VLForConditionalGeneration(te_cfg), torch_dtype)

    if (folder / "latent_codec.json").is_file():
        codec = load_codec(folder)  # the tiny folders' parameter-free space-to-depth codec
        sources["vae"] = f"{folder}/latent_codec.json (parameter-free codec)"
        vae_bytes, vae_width, downsample, latent_channels = 0, 0, codec.downsample, codec.latent_channels
    else:
        if (folder / "vae" / "config.json").is_file():
            vcfg = AutoencoderKLQwenImage.load_config(folder / "vae")
            sources["vae"] = f"{folder}/vae/config.json (meta device)"
        else:
            vcfg = QWEN_IMAGE_VAE
            sources["vae"] = "published Qwen-Image VAE config (vae/ not on disk)"
        vae = _on_meta(lambda: AutoencoderKLQwenImage.from_config(vcfg), torch_dtype)
        vae_bytes, vae_width = meta_bytes(vae)[1], vae.config.base_dim
        downsample, latent_channels = 2 ** len(vae.config.temperal_downsample), vae.config.z_dim

    text = te_cfg.text_config
    return DiTModel(
        transformer_bytes=nbytes, transformer_params=numel, dead_params=dead_params, dead_lora_per_rank=dead_lora,
        lora_params_per_rank=lora_numel, lora_bytes_per_param=lora_bytes // max(1, lora_numel), block_bytes=block_bytes,
        text_encoder_bytes=meta_bytes(text_encoder)[1], text_encoder_layers=text.num_hidden_layers,
        text_encoder_width=text.hidden_size, text_encoder_vocab=text.vocab_size,
        vae_bytes=vae_bytes, vae_width=vae_width, downsample=downsample, latent_channels=latent_channels,
        num_layers=transformer.config.num_layers, dim=transformer.inner_dim, heads=transformer.config.num_attention_heads,
        joint_dim=transformer.config.joint_attention_dim, in_channels=transformer.config.in_channels, sources=sources,
    )  # fmt: skip


def dit_text_tokens(cfg, folder: Path) -> tuple[int, str]:
    """Prompt tokens the transformer sees: fixed padding, the longest training prompt, or an assumption."""
    if cfg.model.max_text_tokens:
        return cfg.model.max_text_tokens, "model.max_text_tokens"
    prompts_file = Path(cfg.data.train_prompts).expanduser()
    if (folder / "tokenizer").is_dir() and prompts_file.is_file():
        from transformers import AutoTokenizer

        from spotlight.policy import PROMPT_TEMPLATE

        tokenizer = AutoTokenizer.from_pretrained(folder / "tokenizer")
        prefix = len(tokenizer(PROMPT_TEMPLATE.split("{}")[0]).input_ids)
        prompts = [line.strip() for line in prompts_file.read_text().splitlines() if line.strip()]
        longest = max(len(tokenizer(PROMPT_TEMPLATE.format(p)).input_ids) - prefix for p in prompts)
        return longest, f"longest prompt of {prompts_file}"
    return ASSUMED_TEXT_TOKENS, "assumed (set model.max_text_tokens for an exact plan)"


# -- DiT activations -----------------------------------------------------------------------------


def dit_block_bytes_per_token(m: DiTModel, a: int, lora_rank: int) -> float:
    """Bytes one transformer block saves for backward per token (either stream), see the module docstring."""
    d, h = m.dim, m.heads
    stats = 4 * (2 * 4 + 3 * h)  # fp32: mean/rstd of 4 LayerNorms, rsqrt of q/k per head, attention lse
    upcast = 2 * d * 4 if a < 4 else 0  # q/k RMSNorm: pow() keeps an fp32 copy
    if lora_rank:
        return (19 * d + 6 * lora_rank) * a + upcast + stats
    return 25 * d * a + upcast + stats


def dit_train_bytes_per_sample(m: DiTModel, a: int, lora_rank: int, gc: bool, img_tokens: int, txt_tokens: int) -> float:
    """Saved activations of one sample's training forward (tokens already divided by SP where it applies)."""
    tokens = img_tokens + txt_tokens
    block = dit_block_bytes_per_token(m, a, lora_rank) * tokens + 14 * m.dim * a  # + per-sample modulation
    if lora_rank:
        outside = img_tokens * m.dim * a  # norm_out's LayerNorm input; the frozen rest saves nothing
    else:
        outside = img_tokens * (m.in_channels + 3 * m.dim) * a + txt_tokens * 2 * m.joint_dim * a
    if gc:
        # The checkpoint saves each block's inputs; backward recomputes one block at a time.
        return m.num_layers * (tokens * m.dim * a + m.dim * a) + outside + block
    return m.num_layers * block + outside


# -- DiT roles -------------------------------------------------------------------------------------


def _gib(b: float) -> str:
    return f"{b / GIB:.2f} GiB"


def _count(n: float) -> str:
    """1.23B, 424.7M, 0.33M: parameter counts for people."""
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def dit_roles(cfg, m: DiTModel, rewards: list[RewardModel], layout: Layout, txt_tokens: int) -> tuple[list[Role], dict]:
    """The trainer, rollout and explorer of a DiT recipe under `layout`."""
    tc, sc = cfg.train, cfg.sample
    a = DTYPE_BYTES[cfg.model.dtype]
    k = layout.fsdp
    lat_h, lat_w = cfg.model.height // m.downsample, cfg.model.width // m.downsample
    img_tokens = (lat_h // 2) * (lat_w // 2)
    channels = m.latent_channels * 4
    cfg_factor = 2 if sc.guidance_scale > 1 else 1
    num_samples = tc.prompts_per_iteration * tc.group_size
    local_samples = math.ceil(num_samples / layout.dp)
    per_forward = math.ceil(min(tc.minibatch_size, num_samples) / layout.dp)
    img_per_gpu = math.ceil(img_tokens / layout.sp)

    # Weights and what training adds to them.
    lora_params = layout.lora_rank * m.lora_params_per_rank
    trained = lora_params if layout.lora_rank else m.transformer_params
    trainable = trained - (layout.lora_rank * m.dead_lora_per_rank if layout.lora_rank else m.dead_params)  # with a gradient
    t_bytes = a if not layout.lora_rank else m.lora_bytes_per_param
    base = m.transformer_bytes / k
    if k > 1:
        master = trained * 4 / k  # FSDP mixed precision: sharded fp32 master of what trains
        frozen = 0 if not layout.lora_rank else base
        weights = Term("weights", "transformer (FSDP shards + 2 gathered blocks)", frozen + master + 2 * m.block_bytes,
                       f"frozen {cfg.model.dtype} / {k} + fp32 master of {_count(trained)} trained params / {k}")
        grads, moments = trainable * 4 / k, 2 * trainable * 4 / k
    else:
        weights = Term("weights", "transformer" + (f" + LoRA r={layout.lora_rank}" if layout.lora_rank else ""),
                       m.transformer_bytes + lora_params * m.lora_bytes_per_param * bool(layout.lora_rank),
                       f"{_count(m.transformer_params)} params x {a} B" + (f" + {_count(lora_params)} adapter params" if layout.lora_rank else ""))
        grads, moments = trainable * t_bytes, 2 * trainable * t_bytes
    frozen_parts = [
        Term("weights", "prompt encoder (frozen)", m.text_encoder_bytes, f"Qwen2.5-VL in {cfg.model.dtype}"),
        Term("weights", "VAE (frozen)", m.vae_bytes, "decoder + encoder" if m.vae_bytes else "parameter-free codec"),
        *[Term("weights", f"reward model: {r.name}", r.bytes, f"{_count(r.params)} params (source above)") for r in rewards],
    ]
    copies = []
    if tc.beta > 0 and not layout.lora_rank:
        copies.append(Term("weights", "KL reference copy (frozen)", base, "full fine-tune with train.beta > 0: a frozen copy"))
    num_steps = tc.num_inner_epochs * math.ceil(num_samples / tc.minibatch_size)
    if tc.objective == "nft" and num_steps > 1:
        copies.append(Term("weights", "old-policy copy (DiffusionNFT)", base + lora_params * m.lora_bytes_per_param / k,
                           f"{num_steps} optimizer steps per update: v_old needs the sampling weights"))
    train_state = [
        Term("gradients", "gradients", grads, f"{_count(trainable)} trained params x {4 if k > 1 else t_bytes} B" + (f" / {k}" if k > 1 else "")),
        Term("optimizer", "AdamW moments", moments, f"2 x {_count(trainable)} x {4 if k > 1 else t_bytes} B" + (f" / {k}" if k > 1 else "")),
    ]
    per_sample = dit_train_bytes_per_sample(m, a, layout.lora_rank, layout.gradient_checkpointing, img_per_gpu, txt_tokens)
    # A sample split over an SP group: each GPU holds 1/sp of the image tokens of every sample of its group.
    acts = Term("activations", "saved for backward", cfg_factor * per_forward * per_sample,
                f"{cfg_factor * per_forward} sample(s) per forward x {(img_per_gpu + txt_tokens)} tokens"
                + (" (checkpointed)" if layout.gradient_checkpointing else "") + f" x {m.num_layers} blocks")
    trajectory = (sc.num_steps + 1) * local_samples * img_tokens * channels * 4 + sc.num_steps * local_samples * 4
    embeds = local_samples * cfg_factor * txt_tokens * m.joint_dim * a
    buffers = [
        Term("buffers", "rollout trajectory", trajectory, f"{sc.num_steps + 1} latents x {local_samples} samples x {img_tokens}x{channels} fp32"),
        Term("buffers", "prompt embeddings", embeds, f"{local_samples} samples x {txt_tokens} tokens x {m.joint_dim}"),
    ]
    trainer = Role("trainer", f"{layout.gpus} on-demand GPU(s), the update", [weights, *frozen_parts, *copies, *train_state, acts, *buffers])

    def sampling(batch: int, prompts: int, decoded: int, sp: int) -> Term:
        """The no-grad working set: the largest of a sampling forward, the prompt encoder's pass and the VAE decode."""
        tokens = math.ceil(img_tokens / sp) + txt_tokens
        sample_ws = batch * tokens * INFERENCE_UNITS * m.dim * a  # CFG's two forwards run one after the other
        enc_tokens = txt_tokens + 34  # + the template's system prefix, which the encoder reads too
        encode = prompts * enc_tokens * ((m.text_encoder_layers + 1) * m.text_encoder_width + m.text_encoder_vocab) * a
        decode = decoded * cfg.model.height * cfg.model.width * m.vae_width * a * 4
        size, which = max((sample_ws, "sampling"), (encode, "prompt encoding"), (decode, "VAE decode"))
        how = (f"largest of: sampling {_gib(sample_ws)} ({batch} x {tokens} tokens), prompt encoding {_gib(encode)} "
               f"({prompts} prompts, all hidden states + logits), VAE decode {_gib(decode)} ({decoded} images, rough)")
        return Term("activations", f"no-grad working set ({which})", size, how)

    # The rank samples in chunks of sample.batch_size, encodes its distinct prompts at once and
    # decodes all its samples at once (`rollout.rollout`).
    ro_batch = min(sc.batch_size, local_samples)
    ro_work = sampling(ro_batch, math.ceil(local_samples / tc.group_size), local_samples, layout.sp)
    rollout_terms = [weights, *frozen_parts, *[t for t in copies if "reference" in t.name], *train_state, ro_work, buffers[0]]
    rollout = Role("rollout", f"the trainer's {layout.gpus} GPU(s), between updates", rollout_terms,
                   "sampling with theta_k inside `spotlight train`; gradients stay allocated until the next zero_grad")
    explorer_weights = Term("weights", "transformer" + (" + LoRA" if layout.lora_rank else ""),
                            m.transformer_bytes + lora_params * m.lora_bytes_per_param * bool(layout.lora_rank), "stale theta_{k-1}, no gradients")
    ex_batch = cfg.explore.batch_size
    ex_traj = (sc.num_steps + 1) * ex_batch * img_tokens * channels * 4
    explorer = Role("explorer", "each spot GPU (one Explorer actor)",
                    [explorer_weights, *frozen_parts, sampling(ex_batch, min(ex_batch, tc.prompts_per_iteration), ex_batch, layout.sp),
                     Term("buffers", "candidate trajectories", ex_traj, f"{sc.num_steps + 1} latents x {ex_batch} candidates, fp32")],
                    "no explorers run with explore.mode=none" if cfg.explore.mode == "none" else "")
    shapes = {
        "image_tokens": img_tokens, "text_tokens": txt_tokens, "samples_per_forward": cfg_factor * per_forward,
        "samples_per_gpu": local_samples, "dtype": cfg.model.dtype, "lora_rank": layout.lora_rank,
        "gradient_checkpointing": layout.gradient_checkpointing, "sp": layout.sp, "fsdp": layout.fsdp, "data_parallel": layout.dp,
    }  # fmt: skip
    return [trainer, rollout, explorer], shapes


# -- suggestions -----------------------------------------------------------------------------------


def _degrees(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def suggest(plan: Plan, roles_for: Callable[[Layout], list[Role]], base: Layout, *, heads: int, sp_trains: bool,
            gc_option: bool, batch_knob: tuple[str, int, Callable[[int], list[Role]]] | None) -> list[str]:
    """Settings under which the trainer's GPUs (its update and rollout phases) fit.

    Tries every combination of gradient checkpointing (where the recipe has it), LoRA rank 64 (for a
    full fine-tune), FSDP degree and SP degree, and reports the fitting ones with the fewest changes.
    """
    usable = plan.usable_bytes
    out: list[str] = []
    trainer_side = [r for r in plan.roles if r.name in ("trainer", "rollout")]
    peak = max(r.total for r in trainer_side)
    if peak <= usable:
        out.append(f"fits as configured: the trainer's GPUs peak at {_gib(peak)} of {_gib(usable)} usable")
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
                            changes = (gc != base.gradient_checkpointing) + (rank != base.lora_rank) + (fsdp > 1) + (sp > 1)
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
                parts.append(f"FSDP over >= {fsdp} GPUs (configs/accelerate/fsdp.yaml; the trainers do not run FSDP yet)")
            if sp > 1:
                caveat = "" if sp_trains else "; the trainer has no SP yet (parallel/ulysses.py is forward-only)"
                parts.append(f"SP degree {sp} brings activations under the limit{caveat}")
            out.append(" + ".join(parts) + f": peak {_gib(total)}")
            shown += 1
            if shown == 3:
                break
        if not candidates:
            out.append(f"no combination of LoRA / FSDP (<= {base.gpus} GPUs) / SP fits the trainer: use larger GPUs or more of them")
        if batch_knob is not None:
            name, current, roles_at = batch_knob
            fitting = [b for b in range(current - 1, 0, -1) if max(r.total for r in roles_at(b) if r.name in ("trainer", "rollout")) <= usable]
            if fitting:
                out.append(f"or {name}={fitting[0]} (fewer samples per forward) fits as configured otherwise")
    return out


# -- entry points ----------------------------------------------------------------------------------


def recipe_kind(path: str | None) -> str:
    """"vlm" for a VLM recipe (it has `rollout` or `task` sections), else "dit"."""
    if path is None:
        return "dit"
    data = yaml.safe_load(Path(path).read_text()) or {}
    return "vlm" if isinstance(data, dict) and ({"rollout", "task"} & set(data)) else "dit"


def plan_dit(recipe: str | None, overrides: list[str], gpus: int, gpu_mem_gib: float) -> Plan:
    """The DiT plan: roles, sources and suggestions for `recipe` on `gpus` GPUs of `gpu_mem_gib`."""
    from spotlight.config import DiTRecipe
    from spotlight.config_io import load_config
    from spotlight.policy import default_model_path

    cfg = load_config(DiTRecipe, recipe, overrides)
    m = load_dit_model(cfg.model.path, cfg.model.dtype)
    rewards = reward_models(cfg.reward.weights, cfg.reward.options())
    folder = Path(cfg.model.path).expanduser() if cfg.model.path else default_model_path()
    txt_tokens, txt_source = dit_text_tokens(cfg, folder)
    base = Layout(gpus=gpus, gradient_checkpointing=cfg.model.gradient_checkpointing, lora_rank=cfg.model.lora_rank)
    roles, shapes = dit_roles(cfg, m, rewards, base, txt_tokens)
    shapes["text_tokens_source"] = txt_source
    sources = dict(m.sources, **{f"reward:{r.name}": r.source for r in rewards})
    plan = Plan(str(recipe or "(embedded tiny-shapes default)"), "dit", gpus, gpu_mem_gib, sources, shapes, roles)

    def roles_for(layout: Layout) -> list[Role]:
        return dit_roles(cfg, m, rewards, layout, txt_tokens)[0]

    def roles_at(minibatch: int) -> list[Role]:
        smaller = replace(cfg, train=replace(cfg.train, minibatch_size=minibatch * base.dp))
        return dit_roles(smaller, m, rewards, base, txt_tokens)[0]

    per_forward = shapes["samples_per_forward"] // (2 if cfg.sample.guidance_scale > 1 else 1)
    plan.suggestions = suggest(plan, roles_for, base, heads=m.heads, sp_trains=False, gc_option=True,
                               batch_knob=("train.minibatch_size per GPU", per_forward, roles_at) if per_forward > 1 else None)
    plan.suggestions += _dit_notes(plan, cfg, m, rewards, base, txt_tokens)
    return plan


def _dit_notes(plan: Plan, cfg, m: DiTModel, rewards: list[RewardModel], base: Layout, txt_tokens: int) -> list[str]:
    """What to change when the rollout's VAE decode or an explorer does not fit."""
    out = []
    usable = plan.usable_bytes
    rollout, explorer = plan.role("rollout"), plan.role("explorer")
    work = next(t for t in rollout.terms if t.group == "activations")
    if not plan.fits(rollout) and "VAE decode" in work.name and work.bytes > usable / 4:
        n = plan.shapes["samples_per_gpu"]
        chunk = min(cfg.sample.batch_size, n)
        out.append(f"rollout: `rollout.rollout` decodes all {n} samples of a GPU at once ({_gib(work.bytes)} of VAE activations, rough); "
                   f"decoding in chunks of sample.batch_size={chunk} would need about {_gib(work.bytes * chunk / n)}, or use more GPUs")
    if explorer.total <= usable:
        return out
    fixed = sum(t.bytes for t in explorer.terms if t.group == "weights")
    if fixed > usable:
        return out + [f"explorer: its weights alone need {_gib(fixed)} > {_gib(usable)}: use larger spot GPUs (SP replicates weights)"]
    for sp in [d for d in (2, 4, 8) if m.heads % d == 0]:
        ex = dit_roles(cfg, m, rewards, replace(base, sp=sp), txt_tokens)[0][2]
        if ex.total <= usable:
            return out + [f"explorer: SP degree {sp} (spot/sp_worker.py groups) brings its working set under the limit: {_gib(ex.total)}"]
    for batch in range(cfg.explore.batch_size - 1, 0, -1):
        smaller = replace(cfg, explore=replace(cfg.explore, batch_size=batch))
        ex = dit_roles(smaller, m, rewards, base, txt_tokens)[0][2]
        if ex.total <= usable:
            return out + [f"explorer: explore.batch_size={batch} fits ({_gib(ex.total)})"]
    return out + ["explorer: no SP degree or explore.batch_size fits: use larger spot GPUs"]


def plan_recipe(recipe: str | None, overrides: list[str], *, gpus: int, gpu_mem_gib: float) -> Plan:
    """Estimate the memory of every role of a DiT or VLM recipe on `gpus` GPUs of `gpu_mem_gib` GiB.

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
        from vlm.plan import plan_vlm

        return plan_vlm(recipe, overrides, gpus, gpu_mem_gib)
    return plan_dit(recipe, overrides, gpus, gpu_mem_gib)


def print_plan(plan: Plan, console=None) -> None:
    """A small table per role and a one-screen summary."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    console.print(f"[bold]spotlight plan[/bold] {plan.recipe} ({plan.kind}): {plan.gpus} GPU(s) x {plan.gpu_mem_gib:g} GiB, "
                  f"{_gib(plan.usable_bytes)} usable ({HEADROOM:.0%} headroom)")
    for part, source in plan.sources.items():
        console.print(f"  {part}: {source}")
    console.print("  " + ", ".join(f"{k}={v}" for k, v in plan.shapes.items()))
    for role in plan.roles:
        fits = "[green]fits[/green]" if plan.fits(role) else "[red]does not fit[/red]"
        table = Table(title=f"{role.name}: {role.where} — {_gib(role.total)}, {fits}", caption=role.note or None, title_justify="left")
        for col, justify in (("group", "left"), ("component", "left"), ("GiB", "right"), ("how", "left")):
            table.add_column(col, justify=justify, overflow="fold")
        for t in role.terms:
            if t.bytes:
                table.add_row(t.group, t.name, f"{t.bytes / GIB:.2f}", t.how)
        console.print(table)
    console.print("[bold]summary[/bold]")
    for role in plan.roles:
        groups = ", ".join(f"{g} {b / GIB:.1f}" for g, b in role.by_group().items() if b)
        console.print(f"  {role.name:9s} {role.total / GIB:8.2f} GiB  {'fits' if plan.fits(role) else 'DOES NOT FIT'}  ({groups})")
    for s in plan.suggestions:
        console.print(f"  - {s}")


def plan_json(plan: Plan) -> str:
    return json.dumps(plan.to_json())
