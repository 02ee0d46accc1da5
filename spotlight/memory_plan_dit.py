"""The DiT side of `spotlight memory`: the Qwen-Image model's parts, its saved activations per block, and
the trainer / rollout / explorer roles (formulas in `spotlight.core.memory_plan`'s docstring)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from spotlight.core.memory_plan import (
    ASSUMED_TEXT_TOKENS,
    DTYPE_BYTES,
    INFERENCE_UNITS,
    QWEN_IMAGE_TRANSFORMER,
    QWEN_IMAGE_VAE,
    Layout,
    Plan,
    RewardModel,
    Role,
    Term,
    count_str,
    gib_str,
    meta_bytes,
    on_meta,
    qwen2_5_vl_config,
    reward_models,
    suggest,
)


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
    from diffusers import QwenImageTransformer2DModel
    from peft import LoraConfig
    from transformers import AutoConfig, Qwen2_5_VLForConditionalGeneration

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
    transformer = on_meta(lambda: QwenImageTransformer2DModel.from_config(tcfg), torch_dtype)
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
    text_encoder = on_meta(lambda: Qwen2_5_VLForConditionalGeneration(te_cfg), torch_dtype)

    vae_bytes, vae_width, downsample, latent_channels = _codec_sizes(folder, torch_dtype, sources)

    text = te_cfg.text_config
    return DiTModel(
        transformer_bytes=nbytes,
        transformer_params=numel,
        dead_params=dead_params,
        dead_lora_per_rank=dead_lora,
        lora_params_per_rank=lora_numel,
        lora_bytes_per_param=lora_bytes // max(1, lora_numel),
        block_bytes=block_bytes,
        text_encoder_bytes=meta_bytes(text_encoder)[1],
        text_encoder_layers=text.num_hidden_layers,
        text_encoder_width=text.hidden_size,
        text_encoder_vocab=text.vocab_size,
        vae_bytes=vae_bytes,
        vae_width=vae_width,
        downsample=downsample,
        latent_channels=latent_channels,
        num_layers=transformer.config.num_layers,
        dim=transformer.inner_dim,
        heads=transformer.config.num_attention_heads,
        joint_dim=transformer.config.joint_attention_dim,
        in_channels=transformer.config.in_channels,
        sources=sources,
    )


def _codec_sizes(folder: Path, torch_dtype: torch.dtype, sources: dict) -> tuple[int, int, int, int]:
    """(bytes, decoder width, downsampling, latent channels) of the folder's codec: the tiny folders'
    parameter-free space-to-depth one, or the Qwen-Image VAE (its config, or the published one)."""
    from diffusers import AutoencoderKLQwenImage

    from spotlight.latents import load_codec

    if (folder / "latent_codec.json").is_file():
        codec = load_codec(folder)
        sources["vae"] = f"{folder}/latent_codec.json (parameter-free codec)"
        return 0, 0, codec.downsample, codec.latent_channels
    if (folder / "vae" / "config.json").is_file():
        vcfg = AutoencoderKLQwenImage.load_config(folder / "vae")
        sources["vae"] = f"{folder}/vae/config.json (meta device)"
    else:
        vcfg = QWEN_IMAGE_VAE
        sources["vae"] = "published Qwen-Image VAE config (vae/ not on disk)"
    vae = on_meta(lambda: AutoencoderKLQwenImage.from_config(vcfg), torch_dtype)
    return meta_bytes(vae)[1], vae.config.base_dim, 2 ** len(vae.config.temperal_downsample), vae.config.z_dim


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


def dit_train_bytes_per_sample(
    m: DiTModel, a: int, lora_rank: int, gc: bool, img_tokens: int, txt_tokens: int
) -> float:
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


@dataclass
class _Sizes:
    """The sizes every DiT role is computed from, for one recipe under one layout."""

    a: int  # bytes per activation element
    k: int  # FSDP degree
    img_tokens: int
    txt_tokens: int
    channels: int
    cfg_factor: int  # 2 with CFG: a conditional and an unconditional forward
    num_samples: int  # P x G
    local_samples: int  # this data-parallel rank's
    per_forward: int  # samples per training forward
    img_per_gpu: int  # image tokens per GPU of an SP group
    lora_params: int
    trained: int  # parameters that train (the adapter, or the transformer)
    trainable: int  # of those, the ones with a gradient
    t_bytes: int  # bytes per trained parameter
    base: float  # the transformer's weights per GPU

    @staticmethod
    def of(cfg, m: DiTModel, layout: Layout, txt_tokens: int) -> _Sizes:
        tc = cfg.train
        lat_h, lat_w = cfg.model.height // m.downsample, cfg.model.width // m.downsample
        img_tokens = (lat_h // 2) * (lat_w // 2)
        num_samples = tc.prompts_per_iteration * tc.group_size
        lora_params = layout.lora_rank * m.lora_params_per_rank
        trained = lora_params if layout.lora_rank else m.transformer_params
        dead = layout.lora_rank * m.dead_lora_per_rank if layout.lora_rank else m.dead_params
        return _Sizes(
            a=DTYPE_BYTES[cfg.model.dtype],
            k=layout.fsdp,
            img_tokens=img_tokens,
            txt_tokens=txt_tokens,
            channels=m.latent_channels * 4,
            cfg_factor=2 if cfg.sample.guidance_scale > 1 else 1,
            num_samples=num_samples,
            local_samples=math.ceil(num_samples / layout.dp),
            per_forward=math.ceil(min(tc.minibatch_size, num_samples) / layout.dp),
            img_per_gpu=math.ceil(img_tokens / layout.sp),
            lora_params=lora_params,
            trained=trained,
            trainable=trained - dead,
            t_bytes=DTYPE_BYTES[cfg.model.dtype] if not layout.lora_rank else m.lora_bytes_per_param,
            base=m.transformer_bytes / layout.fsdp,
        )


def dit_roles(cfg, m: DiTModel, rewards: list[RewardModel], layout: Layout, txt_tokens: int) -> tuple[list[Role], dict]:
    """The trainer, rollout and explorer of a DiT recipe under `layout`."""
    z = _Sizes.of(cfg, m, layout, txt_tokens)
    weights, train_state = _trained_weights(cfg, m, layout, z)
    frozen_parts = [
        Term("weights", "prompt encoder (frozen)", m.text_encoder_bytes, f"Qwen2.5-VL in {cfg.model.dtype}"),
        Term("weights", "VAE (frozen)", m.vae_bytes, "decoder + encoder" if m.vae_bytes else "parameter-free codec"),
        *[
            Term("weights", f"reward model: {r.name}", r.bytes, f"{count_str(r.params)} params (source above)")
            for r in rewards
        ],
    ]
    copies = _weight_copies(cfg, m, z)
    per_sample = dit_train_bytes_per_sample(
        m, z.a, layout.lora_rank, layout.gradient_checkpointing, z.img_per_gpu, txt_tokens
    )
    # A sample split over an SP group: each GPU holds 1/sp of the image tokens of every sample of its group.
    acts = Term(
        "activations",
        "saved for backward",
        z.cfg_factor * z.per_forward * per_sample,
        f"{z.cfg_factor * z.per_forward} sample(s) per forward x {(z.img_per_gpu + txt_tokens)} tokens"
        + (" (checkpointed)" if layout.gradient_checkpointing else "")
        + f" x {m.num_layers} blocks",
    )
    buffers = _rollout_buffers(cfg, m, z)
    trainer = Role(
        "trainer",
        f"{layout.gpus} on-demand GPU(s), the update",
        [weights, *frozen_parts, *copies, *train_state, acts, *buffers],
    )
    # The rank samples in chunks of sample.batch_size, encodes its distinct prompts at once and
    # decodes all its samples at once (`rollout.rollout`).
    ro_batch = min(cfg.sample.batch_size, z.local_samples)
    ro_work = _sampling_term(
        cfg, m, z, ro_batch, math.ceil(z.local_samples / cfg.train.group_size), z.local_samples, layout.sp
    )
    rollout = Role(
        "rollout",
        f"the trainer's {layout.gpus} GPU(s), between updates",
        [weights, *frozen_parts, *[t for t in copies if "reference" in t.name], *train_state, ro_work, buffers[0]],
        "sampling with theta_k inside `spotlight train`; gradients stay allocated until the next zero_grad",
    )
    explorer = _explorer_role(cfg, m, z, layout, frozen_parts)
    shapes = {
        "image_tokens": z.img_tokens,
        "text_tokens": txt_tokens,
        "samples_per_forward": z.cfg_factor * z.per_forward,
        "samples_per_gpu": z.local_samples,
        "dtype": cfg.model.dtype,
        "lora_rank": layout.lora_rank,
        "gradient_checkpointing": layout.gradient_checkpointing,
        "sp": layout.sp,
        "fsdp": layout.fsdp,
        "data_parallel": layout.dp,
    }
    return [trainer, rollout, explorer], shapes


def _trained_weights(cfg, m: DiTModel, layout: Layout, z: _Sizes) -> tuple[Term, list[Term]]:
    """The transformer's weights per GPU, and its gradients and AdamW moments."""
    k = z.k
    if k > 1:
        master = z.trained * 4 / k  # FSDP mixed precision: sharded fp32 master of what trains
        frozen = 0 if not layout.lora_rank else z.base
        weights = Term(
            "weights",
            "transformer (FSDP shards + 2 gathered blocks)",
            frozen + master + 2 * m.block_bytes,
            f"frozen {cfg.model.dtype} / {k} + fp32 master of {count_str(z.trained)} trained params / {k}",
        )
        grads, moments = z.trainable * 4 / k, 2 * z.trainable * 4 / k
    else:
        weights = Term(
            "weights",
            "transformer" + (f" + LoRA r={layout.lora_rank}" if layout.lora_rank else ""),
            m.transformer_bytes + z.lora_params * m.lora_bytes_per_param * bool(layout.lora_rank),
            f"{count_str(m.transformer_params)} params x {z.a} B"
            + (f" + {count_str(z.lora_params)} adapter params" if layout.lora_rank else ""),
        )
        grads, moments = z.trainable * z.t_bytes, 2 * z.trainable * z.t_bytes
    per = f"{4 if k > 1 else z.t_bytes} B" + (f" / {k}" if k > 1 else "")
    train_state = [
        Term("gradients", "gradients", grads, f"{count_str(z.trainable)} trained params x {per}"),
        Term("optimizer", "AdamW moments", moments, f"2 x {count_str(z.trainable)} x {per}"),
    ]
    return weights, train_state


def _weight_copies(cfg, m: DiTModel, z: _Sizes) -> list[Term]:
    """The KL reference, the moving average and DiffusionNFT's old policy, where the recipe keeps them."""
    tc, k, lora = cfg.train, z.k, z.lora_params > 0
    copies = []
    if tc.beta > 0 and not lora:
        copies.append(
            Term("weights", "KL reference copy (frozen)", z.base, "full fine-tune with train.beta > 0: a frozen copy")
        )
    if tc.ema_decay > 0:
        copies.append(
            Term(
                "weights",
                "moving average (train.ema_decay)",
                z.trained * 4 / k if k > 1 else z.trained * z.t_bytes,
                f"a copy of the {count_str(z.trained)} trained params" + (f" (fp32 shards) / {k}" if k > 1 else ""),
            )
        )
    num_steps = tc.num_inner_epochs * math.ceil(z.num_samples / tc.minibatch_size)
    if tc.objective == "nft" and num_steps > 1:
        copies.append(
            Term(
                "weights",
                "old-policy copy (DiffusionNFT)",
                z.base + z.lora_params * m.lora_bytes_per_param / k,
                f"{num_steps} optimizer steps per update: v_old needs the sampling weights",
            )
        )
    return copies


def _rollout_buffers(cfg, m: DiTModel, z: _Sizes) -> list[Term]:
    """The rollout's trajectory and the prompt embeddings the update reads."""
    sc, n = cfg.sample, z.local_samples
    trajectory = (sc.num_steps + 1) * n * z.img_tokens * z.channels * 4 + sc.num_steps * n * 4
    embeds = n * z.cfg_factor * z.txt_tokens * m.joint_dim * z.a
    return [
        Term(
            "buffers",
            "rollout trajectory",
            trajectory,
            f"{sc.num_steps + 1} latents x {n} samples x {z.img_tokens}x{z.channels} fp32",
        ),
        Term("buffers", "prompt embeddings", embeds, f"{n} samples x {z.txt_tokens} tokens x {m.joint_dim}"),
    ]


def _sampling_term(cfg, m: DiTModel, z: _Sizes, batch: int, prompts: int, decoded: int, sp: int) -> Term:
    """The no-grad working set: the largest of a sampling forward, the prompt encoder's pass and the VAE decode."""
    a = z.a
    tokens = math.ceil(z.img_tokens / sp) + z.txt_tokens
    sample_ws = batch * tokens * INFERENCE_UNITS * m.dim * a  # CFG's two forwards run one after the other
    enc_tokens = z.txt_tokens + 34  # + the template's system prefix, which the encoder reads too
    encode = prompts * enc_tokens * ((m.text_encoder_layers + 1) * m.text_encoder_width + m.text_encoder_vocab) * a
    decode = decoded * cfg.model.height * cfg.model.width * m.vae_width * a * 4
    size, which = max((sample_ws, "sampling"), (encode, "prompt encoding"), (decode, "VAE decode"))
    how = (
        f"largest of: sampling {gib_str(sample_ws)} ({batch} x {tokens} tokens), prompt encoding {gib_str(encode)} "
        f"({prompts} prompts, all hidden states + logits), VAE decode {gib_str(decode)} ({decoded} images, rough)"
    )
    return Term("activations", f"no-grad working set ({which})", size, how)


def _explorer_role(cfg, m: DiTModel, z: _Sizes, layout: Layout, frozen_parts: list[Term]) -> Role:
    """One spot GPU's explorer: stale weights, no gradients, a batch of candidates."""
    sc, ex_batch = cfg.sample, cfg.explore.batch_size
    explorer_weights = Term(
        "weights",
        "transformer" + (" + LoRA" if layout.lora_rank else ""),
        m.transformer_bytes + z.lora_params * m.lora_bytes_per_param * bool(layout.lora_rank),
        "stale theta_{k-1}, no gradients",
    )
    ex_traj = (sc.num_steps + 1) * ex_batch * z.img_tokens * z.channels * 4
    return Role(
        "explorer",
        "each spot GPU (one Explorer actor)",
        [
            explorer_weights,
            *frozen_parts,
            _sampling_term(cfg, m, z, ex_batch, min(ex_batch, cfg.train.prompts_per_iteration), ex_batch, layout.sp),
            Term(
                "buffers",
                "candidate trajectories",
                ex_traj,
                f"{sc.num_steps + 1} latents x {ex_batch} candidates, fp32",
            ),
        ],
        "no explorers run with explore.mode=none" if cfg.explore.mode == "none" else "",
    )


# -- entry point ---------------------------------------------------------------------------------


def plan_dit(recipe: str | None, overrides: list[str], gpus: int, gpu_mem_gib: float) -> Plan:
    """The DiT plan: roles, sources and suggestions for `recipe` on `gpus` GPUs of `gpu_mem_gib`."""
    from spotlight.config import DiTRecipe
    from spotlight.core.config_io import load_config
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
    plan.suggestions = suggest(
        plan,
        roles_for,
        base,
        heads=m.heads,
        sp_trains=False,
        gc_option=True,
        batch_knob=("train.minibatch_size per GPU", per_forward, roles_at) if per_forward > 1 else None,
    )
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
        out.append(
            f"rollout: `rollout.rollout` decodes all {n} samples of a GPU at once ({gib_str(work.bytes)} of VAE "
            "activations, rough); "
            f"decoding in chunks of sample.batch_size={chunk} would need about {gib_str(work.bytes * chunk / n)}, "
            "or use more GPUs"
        )
    if explorer.total <= usable:
        return out
    fixed = sum(t.bytes for t in explorer.terms if t.group == "weights")
    if fixed > usable:
        return out + [
            f"explorer: its weights alone need {gib_str(fixed)} > {gib_str(usable)}: use larger spot GPUs "
            "(SP replicates weights)"
        ]
    for sp in [d for d in (2, 4, 8) if m.heads % d == 0]:
        ex = dit_roles(cfg, m, rewards, replace(base, sp=sp), txt_tokens)[0][2]
        if ex.total <= usable:
            return out + [
                f"explorer: SP degree {sp} (parallel.sp_degree: spot/worker.py groups) brings its working set under "
                f"the limit: {gib_str(ex.total)}"
            ]
    for batch in range(cfg.explore.batch_size - 1, 0, -1):
        smaller = replace(cfg, explore=replace(cfg.explore, batch_size=batch))
        ex = dit_roles(smaller, m, rewards, base, txt_tokens)[0][2]
        if ex.total <= usable:
            return out + [f"explorer: explore.batch_size={batch} fits ({gib_str(ex.total)})"]
    return out + ["explorer: no SP degree or explore.batch_size fits: use larger spot GPUs"]
