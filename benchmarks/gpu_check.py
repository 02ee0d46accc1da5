"""GPU check: bf16 sampling, one GRPO step, SP backends and peak memory of a small real-shaped Qwen-Image.

Run it through `benchmarks/gpu_check.sh` on a GPU machine: that script installs the carried wheels
the machine lacks, keeps to a time limit and always prints one JSON line; its header says how to
run it on a lent machine in one call. This file prints one JSON line too. `--device cpu --tiny` runs
the same code paths at a tiny size on the CPU in well under a minute (`tests/test_gpu_check.py` does,
so this file cannot rot).

The model. "Small real-shaped": every width of the real Qwen-Image is kept and only the depths are
cut, so per-token costs, kernels and tensor shapes are the real ones. Nothing is downloaded; weights
are random, built from config files written to a temporary model folder (the same folder
`spotlight memory` reads):
- transformer: `QwenImageTransformer2DModel` with the published config (24 heads x 128 = 3072 wide,
  joint_attention_dim 3584, in_channels 64 = 16 latent channels packed 2x2, patch 2, rope 16/56/56)
  and `--layers` blocks (default 2 of the real 60);
- prompt encoder: Qwen2.5-VL at the 7B's text width (3584, 28 q / 4 kv heads, MLP 18944) with one
  layer, a word-level tokenizer trained here and a one-block vision tower (unused by prompts);
- VAE: `AutoencoderKLQwenImage` with the published config (8x down, 16 channels): a 512x512 image
  is 64x64 latents, 1024 image tokens; prompts are padded to 64 text tokens (model.max_text_tokens).
The recipe is `configs/dit/qwen-image-ocr.yaml` (512x512, bf16, LoRA rank 64 / alpha 128 on
`spotlight.policy.LORA_TARGETS`, Flow-GRPO objective, noise level 1.2, SDE window of 2 of 10 steps,
rollout batch 8, minibatch 8, beta 0) with 2 prompts x 4 seeds and the jpeg_compressibility reward
in place of the OCR reader (no reward model to load).

The figures (JSON fields; every check is a dict, {"error": ...} when it failed, {"skipped": why}
when it cannot run here; `check_s` is the check's own wall time):
- `env`: GPU name and count, memory, torch / CUDA / cuDNN / NCCL / diffusers / transformers / peft /
  xfuser / yunchang versions (xfuser's from package metadata: importing it happens in its check).
- `config`: the shapes above, parameter counts of the transformer and of the LoRA adapter.
- `sampling`: one bf16 rollout through `spotlight.rollout.rollout` (prompt encoding, the seeded
  SDE/ODE loop of `spotlight.sampling`, VAE decode) after a 2-step warm-up. `step_ms` is the wall
  time per denoising step (transformer forward + noise draw + SDE update), `forward_ms` the
  transformer forward alone (both with CUDA synchronised at each forward); `peak_denoise_gib` is
  the allocator's peak (torch.cuda.max_memory_allocated, reset before the rollout) at the end of
  the last forward, `peak_rollout_gib` after the decode (the VAE decode usually sets it).
- `train_step`, `train_step_gc`: one `GRPOTrainer.update` on that rollout (one optimizer step over
  the 2 SDE-window steps of 8 samples) without and with gradient checkpointing, after a warm-up
  update. `update_s` is its wall time; `resident_gib` what was allocated before it (weights,
  adapter, AdamW moments, rollout buffers); `peak_gib` the allocator's peak during it;
  `plan_trainer_gib` what `spotlight memory` (spotlight/core/memory_plan.py) estimates for the trainer on the same
  recipe, overrides and model folder, `peak_over_plan` = peak_gib / plan_trainer_gib (the plan
  leaves transient workspaces, activation gradients and kernel scratch, to its 10% headroom, so the
  peak may exceed it a little);
  `activations_gib` = peak - resident against the plan's `plan_groups_gib.activations`;
  `params_changed` that the adapter moved.
- `ulysses_degree1`: our Ulysses processor (spotlight/parallel/ulysses.py) at degree 1 against the
  stock processor on the same weights (bf16): `max_abs_err` (0 expected), forward times of both.
- `ulysses_multiproc`: our Ulysses at degree 2 in 2 processes (NCCL, one GPU each; gloo on CPU in
  tiny mode) against the single-process stock forward, `max_abs_err_bf16` and `max_abs_err_fp32`
  (same weights cast; fp32 should be ~0, bf16 differs by rounding of the sliced projections) and the
  bf16 `forward_ms`; skipped with one GPU (NCCL cannot put two ranks on one device).
- `diffusers_cp`: diffusers' context parallelism (`enable_parallelism(ContextParallelConfig(
  ulysses_degree=2))`) on the same model in 2 processes, the same figures; with one GPU only its
  import is checked (its config refuses degree 1).
- `xfuser`: xDiT's USP attention (`xfuser.model_executor.layers.usp.USP`) over the SP group of
  min(2, GPUs) processes against full attention, at the model's attention shape; import and
  set-up errors are recorded verbatim with the step that raised them.
- `sp_backend_xfuser`: `parallel.sp_backend=xfuser` as the workers run it: our Ulysses processor
  with xDiT's USP core (spotlight/parallel/xfuser_usp.py) bound to an NCCL world of min(2, GPUs)
  processes, against our backend on the same world and the stock forward, bf16 and fp32:
  `max_abs_err_vs_ours_*` (~0 expected: same math, same SDPA kernel), `max_abs_err_vs_stock_*`,
  bf16 `forward_ms` of both, `bind_ms` (xfuser's groups and runtime state built for the world: what
  each group re-formation costs on top of ours) and, at degree 1, the unbound path
  (`unbound_max_abs_err_vs_ours_*`, no process group, as a worker alone runs).
- `bf16_vs_fp32`: one transformer forward in fp32 and the same weights cast to bf16: max and mean
  absolute difference against the fp32 output's scale.
`peak_gib` fields are torch.cuda.max_memory_allocated in GiB after a reset at the check's start
(null on the CPU, which has no allocator statistic).

    python benchmarks/gpu_check.py                      # the GPU check (prefer gpu_check.sh)
    python benchmarks/gpu_check.py --device cpu --tiny  # the CPU smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.metadata
import json
import math
import os
import platform
import socket
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

GIB = 2**30
RECIPE = REPO / "configs" / "dit" / "qwen-image-ocr.yaml"
PROMPTS = [
    'a neon sign above a diner that says "open all night"',
    'a chalkboard menu in a cafe reading "soup of the day"',
]
NO_CUDA = {"skipped": "no CUDA device"}
CHECKS = (
    "sampling",
    "train_step",
    "train_step_gc",
    "ulysses_degree1",
    "bf16_vs_fp32",
    "ulysses_multiproc",
    "diffusers_cp",
    "xfuser",
    "sp_backend_xfuser",
)


@dataclass(frozen=True)
class Shape:
    """Sizes of the check's model and batch."""

    height: int
    num_layers: int
    heads: int
    head_dim: int
    rope: tuple[int, int, int]
    latent_channels: int
    vae: dict
    text_hidden: int
    text_heads: int
    text_kv_heads: int
    text_mlp: int
    mrope: tuple[int, int, int]
    text_tokens: int
    prompts: int
    group: int
    num_steps: int
    sde_window: int
    dtype: str = "bfloat16"

    @property
    def samples(self) -> int:
        return self.prompts * self.group

    @property
    def image_tokens(self) -> int:
        down = 2 ** len(self.vae["temperal_downsample"])
        return (self.height // down // 2) ** 2

    def overrides(self, folder: Path, device: str, gc_on: bool) -> list[str]:
        """Dotted overrides of the recipe for this shape and model folder."""
        return [
            f"model.path={folder}",
            f"model.height={self.height}",
            f"model.width={self.height}",
            f"model.max_text_tokens={self.text_tokens}",
            f"model.dtype={self.dtype}",
            f"model.device={device}",
            f"model.gradient_checkpointing={str(gc_on).lower()}",
            f"sample.num_steps={self.num_steps}",
            f"sample.sde_window_size={self.sde_window}",
            f"sample.sde_window_range=[0,{self.num_steps - self.sde_window}]",
            f"sample.batch_size={self.samples}",
            f"train.prompts_per_iteration={self.prompts}",
            f"train.group_size={self.group}",
            f"train.minibatch_size={self.samples}",
            "reward.weights={jpeg_compressibility: 1.0}",
        ]


def real_shape(num_layers: int) -> Shape:
    """The real Qwen-Image widths (spotlight.core.memory_plan's QWEN_IMAGE_TRANSFORMER / _VAE), few layers, 512x512."""
    from spotlight.core.memory_plan import QWEN_IMAGE_TRANSFORMER as T
    from spotlight.core.memory_plan import QWEN_IMAGE_VAE

    return Shape(
        height=512,
        num_layers=num_layers,
        heads=T["num_attention_heads"],
        head_dim=T["attention_head_dim"],
        rope=tuple(T["axes_dims_rope"]),
        latent_channels=QWEN_IMAGE_VAE["z_dim"],
        vae=dict(QWEN_IMAGE_VAE),
        text_hidden=T["joint_attention_dim"],
        text_heads=28,
        text_kv_heads=4,
        text_mlp=18944,
        mrope=(16, 24, 24),
        text_tokens=64,
        prompts=2,
        group=4,
        num_steps=10,
        sde_window=2,
    )


def tiny_shape() -> Shape:
    """The same structure at CPU size: 64x64 images, 64 image tokens, 4 heads of 16."""
    vae = dict(
        base_dim=24,
        z_dim=4,
        dim_mult=[1, 2, 4],
        num_res_blocks=1,
        temperal_downsample=[False, True],
        latents_mean=[0.0] * 4,
        latents_std=[1.0] * 4,
    )
    return Shape(
        height=64,
        num_layers=2,
        heads=4,
        head_dim=16,
        rope=(4, 6, 6),
        latent_channels=4,
        vae=vae,
        text_hidden=32,
        text_heads=2,
        text_kv_heads=2,
        text_mlp=64,
        mrope=(2, 3, 3),
        text_tokens=16,
        prompts=2,
        group=2,
        num_steps=4,
        sde_window=2,
    )


# -- the model folder (configs only) and random models built from it ------------------------------


def write_model_folder(shape: Shape, folder: Path) -> Path:
    """A Qwen-Image folder with tokenizer and the three config files, no weights."""
    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel
    from transformers import AutoTokenizer, Qwen2_5_VLConfig

    from spotlight.tiny import SPECIAL_TOKENS, train_tokenizer

    train_tokenizer(PROMPTS, folder / "tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(folder / "tokenizer")
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    text_cfg = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer),
            hidden_size=shape.text_hidden,
            intermediate_size=shape.text_mlp,
            num_hidden_layers=1,
            num_attention_heads=shape.text_heads,
            num_key_value_heads=shape.text_kv_heads,
            max_position_embeddings=1024,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": list(shape.mrope)},
            bos_token_id=ids["<|im_start|>"],
            eos_token_id=ids["<|im_end|>"],
            pad_token_id=ids["<|endoftext|>"],
        ),
        vision_config=dict(
            depth=1,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=shape.text_hidden,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            fullatt_block_indexes=[0],
        ),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    text_cfg.save_pretrained(folder / "text_encoder")
    with torch.device("meta"):
        QwenImageTransformer2DModel(
            patch_size=2,
            in_channels=4 * shape.latent_channels,
            out_channels=shape.latent_channels,
            num_layers=shape.num_layers,
            attention_head_dim=shape.head_dim,
            num_attention_heads=shape.heads,
            joint_attention_dim=shape.text_hidden,
            axes_dims_rope=shape.rope,
        ).save_config(folder / "transformer")
        AutoencoderKLQwenImage(**shape.vae).save_config(folder / "vae")
    return folder


def build_transformer(folder: Path, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """The folder's transformer with random weights (initialised in fp32 on `device`, then cast)."""
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(seed)
    with torch.device(device):
        model = QwenImageTransformer2DModel.from_config(QwenImageTransformer2DModel.load_config(folder / "transformer"))
    return model.to(dtype).eval()


def build_policy(folder: Path, shape: Shape, device: torch.device):
    """A `DiTPolicy` as `spotlight.policy.load_policy` makes it (dtype cast, frozen encoder and VAE, LoRA)."""
    from diffusers import AutoencoderKLQwenImage
    from transformers import AutoConfig, AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    from spotlight.config import DiTRecipe
    from spotlight.core.config_io import load_config
    from spotlight.latents import QwenImageVAECodec
    from spotlight.policy import DTYPES, DiTPolicy

    cfg = load_config(DiTRecipe, RECIPE, shape.overrides(folder, device.type, False)).model
    dtype = DTYPES[cfg.dtype]
    transformer = build_transformer(folder, device, dtype)
    torch.manual_seed(1)
    with torch.device(device):
        text_encoder = Qwen2_5_VLForConditionalGeneration(AutoConfig.from_pretrained(folder / "text_encoder"))
        vae = AutoencoderKLQwenImage.from_config(AutoencoderKLQwenImage.load_config(folder / "vae"))
    policy = DiTPolicy(
        transformer,
        text_encoder.to(dtype).eval().requires_grad_(False),
        AutoTokenizer.from_pretrained(folder / "tokenizer"),
        QwenImageVAECodec(vae.to(dtype).eval().requires_grad_(False)),
        height=cfg.height,
        width=cfg.width,
        max_text_tokens=cfg.max_text_tokens,
    )
    policy.add_lora(cfg.lora_rank, cfg.lora_alpha or cfg.lora_rank)
    return policy


def forward_inputs(shape: Shape, device: torch.device, dtype: torch.dtype, batch: int = 2, seed: int = 3):
    """Transformer inputs (same on every process): latents, padded prompt embeddings, mask, sigma, shapes."""
    gen = torch.Generator().manual_seed(seed)
    side = math.isqrt(shape.image_tokens)
    latents = torch.randn(batch, shape.image_tokens, 4 * shape.latent_channels, generator=gen)
    embeds = torch.randn(batch, shape.text_tokens, shape.text_hidden, generator=gen)
    mask = torch.ones(batch, shape.text_tokens, dtype=torch.long)
    mask[0, shape.text_tokens * 3 // 4 :] = 0  # padded prompts, as DiTPolicy.encode_prompts makes them
    sigma = torch.linspace(0.9, 0.3, batch)
    return dict(
        hidden_states=latents.to(device, dtype),
        encoder_hidden_states=embeds.to(device, dtype),
        encoder_hidden_states_mask=mask.to(device),
        timestep=sigma.to(device, dtype),
        img_shapes=[[(1, side, side)]] * batch,
    )


def stock_forward(model, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs, return_dict=False)[0]


# -- measuring ---------------------------------------------------------------------------------------


class Clock:
    """Wall clock that waits for the GPU first."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()


def fresh_peak(device: torch.device) -> float | None:
    """Free cached blocks, reset the allocator's peak; returns GiB allocated now (None on CPU)."""
    gc.collect()
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return round(torch.cuda.memory_allocated() / GIB, 3)


def peak_gib(device: torch.device) -> float | None:
    return round(torch.cuda.max_memory_allocated() / GIB, 3) if device.type == "cuda" else None


class ForwardTimer:
    """Forward hooks on a module: start of every call, duration, allocator peak after the last one."""

    def __init__(self, module, clock: Clock, device: torch.device):
        self.clock, self.device = clock, device
        self.starts: list[float] = []
        self.durations: list[float] = []
        self.peak_after_last: float | None = None
        self._handles = [module.register_forward_pre_hook(self._pre), module.register_forward_hook(self._post)]

    def _pre(self, module, args):
        self.starts.append(self.clock.now())

    def _post(self, module, args, output):
        self.durations.append(self.clock.now() - self.starts[-1])
        self.peak_after_last = peak_gib(self.device)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def _r(x: float | None, digits: int = 4) -> float | None:
    return None if x is None else float(f"{x:.{digits}g}")


# -- the checks --------------------------------------------------------------------------------------


class Run:
    """State shared by the checks: device, shape, model folder, and the policy/rollout/trainer they reuse."""

    def __init__(self, args, folder: Path):
        self.args = args
        self.device = torch.device(args.device)
        self.cuda = self.device.type == "cuda"
        self.gpus = torch.cuda.device_count() if self.cuda else 0
        self.shape = tiny_shape() if args.tiny else real_shape(args.layers)
        self.folder = write_model_folder(self.shape, folder)
        self.clock = Clock(self.device)
        self.policy = None
        self.rollout = None
        self.trainer = None
        self.config_extra: dict = {}
        """Figures the checks learn about the model (the LoRA adapter's size), reported under `config`."""

    def recipe(self, gc_on: bool):
        from spotlight.config import DiTRecipe
        from spotlight.core.config_io import load_config

        return load_config(DiTRecipe, RECIPE, self.shape.overrides(self.folder, self.device.type, gc_on))

    def get_policy(self):
        if self.policy is None:
            self.policy = build_policy(self.folder, self.shape, self.device)
        return self.policy

    def release(self) -> None:
        """Drop the shared policy, rollout and trainer (the later checks build their own models)."""
        self.policy = self.rollout = self.trainer = None
        fresh_peak(self.device)


def check_env(run: Run) -> dict:
    def version(pkg: str) -> str:
        try:
            return importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    out = {
        "device": torch.cuda.get_device_name(0) if run.cuda else platform.processor() or platform.machine(),
        "gpu_count": run.gpus,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if run.cuda else None,
        "nccl": str(torch.cuda.nccl.version()) if run.cuda else None,
        **{pkg: version(pkg) for pkg in ("diffusers", "transformers", "peft", "xfuser", "yunchang")},
    }
    if run.cuda:
        out["gpu_mem_gib"] = round(torch.cuda.get_device_properties(0).total_memory / GIB, 2)
    return out


def check_config(run: Run) -> dict:
    s = run.shape
    out = {
        "mode": "tiny" if run.args.tiny else "small-real-shaped",
        "recipe": str(RECIPE.relative_to(REPO)),
        **asdict(s),
    }
    out.update(image_tokens=s.image_tokens, samples=s.samples)
    del out["vae"]
    with torch.device("meta"):
        from diffusers import QwenImageTransformer2DModel

        meta = QwenImageTransformer2DModel.from_config(
            QwenImageTransformer2DModel.load_config(run.folder / "transformer")
        )
    out["transformer_params"] = sum(p.numel() for p in meta.parameters())
    out["transformer_params_per_block"] = sum(p.numel() for p in meta.transformer_blocks[0].parameters())
    return out


def check_sampling(run: Run) -> dict:
    from spotlight.core.seeds import derive_seed
    from spotlight.rollout import rollout
    from spotlight.sampling import qwen_image_sigmas, sde_step_indices

    s, cfg = run.shape, run.recipe(False)
    policy = run.get_policy()
    run.config_extra = {"lora_params": sum(p.numel() for p in policy.transformer.parameters() if p.requires_grad)}
    prompts = [p for p in PROMPTS[: s.prompts] for _ in range(s.group)]
    seeds = [derive_seed(0, i) for i in range(s.samples)]
    sigmas = qwen_image_sigmas(s.num_steps, policy.latent_shape[0])
    kwargs = dict(noise_level=cfg.sample.noise_level, sde_type=cfg.sample.sde_type, batch_size=cfg.sample.batch_size)
    t0 = run.clock.now()
    rollout(
        policy, prompts, seeds, qwen_image_sigmas(2, policy.latent_shape[0]), **kwargs
    )  # warm-up (kernels, allocator)
    warmup_s = run.clock.now() - t0
    resident = fresh_peak(run.device)
    timer = ForwardTimer(policy.transformer, run.clock, run.device)
    try:
        t0 = run.clock.now()
        ro = rollout(policy, prompts, seeds, sigmas, sde_steps=sde_step_indices(s.num_steps, s.sde_window, 0), **kwargs)
        total = run.clock.now() - t0
    finally:
        timer.remove()
    run.rollout = ro
    n = len(timer.starts)
    return {
        "samples": s.samples,
        "steps": s.num_steps,
        "sde_steps": ro.trajectory.sde_steps,
        "dtype": cfg.model.dtype,
        "rollout_s": _r(total),
        "warmup_s": _r(warmup_s),
        "step_ms": _r(1e3 * (timer.starts[-1] - timer.starts[0]) / (n - 1)) if n > 1 else None,
        "forward_ms": _r(1e3 * sum(timer.durations) / n),
        "resident_gib": resident,
        "peak_denoise_gib": timer.peak_after_last,
        "peak_rollout_gib": peak_gib(run.device),
        "images": list(ro.images.shape),
        "images_finite": bool(torch.isfinite(ro.images).all()),
        "log_probs_finite": bool(torch.isfinite(ro.trajectory.log_probs).all()),
    }


def check_train(run: Run, gc_on: bool) -> dict:
    from spotlight.cli import memory_plan
    from spotlight.core.advantages import group_advantages
    from spotlight.rewards import build_reward
    from spotlight.update import GRPOTrainer

    s, cfg = run.shape, run.recipe(gc_on)
    policy = run.get_policy()
    if run.rollout is None:
        check_sampling(run)
    ro = run.rollout
    reward = build_reward(cfg.reward.weights, **cfg.reward.options())(ro.images, ro.prompts)
    adv = group_advantages(reward.total_B.view(s.prompts, s.group), std_mode=cfg.train.adv_std, clip=cfg.train.adv_clip)
    if gc_on:
        policy.transformer.enable_gradient_checkpointing()
    else:
        policy.transformer.disable_gradient_checkpointing()
    if run.trainer is None:
        run.trainer = GRPOTrainer(policy, cfg)
    trainer = run.trainer
    trainer.cfg = cfg
    t0 = run.clock.now()
    trainer.update(ro, adv, iteration=0)  # warm-up: kernels, AdamW state, checkpointing's first pass
    warmup_s = run.clock.now() - t0
    before = [p.detach().to("cpu", copy=True) for p in trainer.params]  # off the GPU: not in the figures
    resident = fresh_peak(run.device)
    t0 = run.clock.now()
    stats = trainer.update(ro, adv, iteration=1)
    update_s = run.clock.now() - t0
    peak = peak_gib(run.device)
    changed = max((p.detach().cpu() - b).abs().max().item() for p, b in zip(trainer.params, before))
    mem_gib = torch.cuda.get_device_properties(0).total_memory / GIB if run.cuda else 24.0
    plan = memory_plan(
        str(RECIPE), run.shape.overrides(run.folder, run.device.type, gc_on), gpus=1, gpu_mem_gib=mem_gib
    )
    groups = {g: b / GIB for g, b in plan.role("trainer").by_group().items()}
    est, acts = sum(groups.values()), peak - resident if peak is not None else None
    return {
        "gradient_checkpointing": gc_on,
        "samples": int(adv.trainable_PG.sum()),
        "trained_steps": len(ro.trajectory.sde_steps),
        "update_s": _r(update_s),
        "warmup_s": _r(warmup_s),
        "loss": _r(stats.get("loss")),
        "grad_norm": _r(stats.get("grad_norm")),
        "params_changed": changed > 0,
        "max_param_change": _r(changed),
        "resident_gib": resident,
        "peak_gib": peak,
        "plan_trainer_gib": round(est, 3),
        "plan_groups_gib": {g: round(v, 3) for g, v in groups.items()},
        "peak_over_plan": _r(peak / est) if peak is not None else None,
        "activations_gib": round(acts, 3) if acts is not None else None,
        "activations_over_plan": _r(acts / groups["activations"]) if acts is not None else None,
    }


def check_ulysses_degree1(run: Run) -> dict:
    from spotlight.parallel import install_ulysses, ulysses_forward

    dtype = getattr(torch, run.shape.dtype)
    fresh_peak(run.device)
    model = build_transformer(run.folder, run.device, dtype)
    inputs = forward_inputs(run.shape, run.device, dtype)
    stock_forward(model, inputs)  # warm-up
    t0 = run.clock.now()
    ref = stock_forward(model, inputs)
    t1 = run.clock.now()
    ctx = install_ulysses(model)
    ulysses_forward(model, ctx, **inputs)
    t2 = run.clock.now()
    out = ulysses_forward(model, ctx, **inputs)
    t3 = run.clock.now()
    return {
        "dtype": run.shape.dtype,
        "degree": ctx.degree,
        "max_abs_err": _r((out.float() - ref.float()).abs().max().item()),
        "ref_max_abs": _r(ref.float().abs().max().item()),
        "stock_forward_ms": _r(1e3 * (t1 - t0)),
        "ulysses_forward_ms": _r(1e3 * (t3 - t2)),
        "peak_gib": peak_gib(run.device),
    }


def check_bf16_vs_fp32(run: Run) -> dict:
    fresh_peak(run.device)
    model = build_transformer(run.folder, run.device, torch.float32)
    ref = stock_forward(model, forward_inputs(run.shape, run.device, torch.float32)).float()
    model.to(torch.bfloat16)
    out = stock_forward(model, forward_inputs(run.shape, run.device, torch.bfloat16)).float()
    diff = (out - ref).abs()
    rms = ref.square().mean().sqrt().item()
    return {
        "max_abs_diff": _r(diff.max().item()),
        "mean_abs_diff": _r(diff.mean().item()),
        "fp32_max_abs": _r(ref.abs().max().item()),
        "fp32_rms": _r(rms),
        "mean_abs_diff_over_rms": _r(diff.mean().item() / rms),
        "peak_gib": peak_gib(run.device),
    }


# -- multi-process checks: spawned workers, one result file per rank, a deadline --------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spawn_check(kind: str, nprocs: int, run: Run) -> dict:
    """Run `_worker(kind, ...)` in `nprocs` fresh processes; rank 0's result, or an error naming what failed."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    port = _free_port()
    with tempfile.TemporaryDirectory() as tmp:
        spec = dict(
            kind=kind, world=nprocs, port=port, folder=str(run.folder), shape=run.shape, device=run.device.type, out=tmp
        )
        procs = [ctx.Process(target=_worker, args=(rank, spec), daemon=True) for rank in range(nprocs)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + run.args.worker_timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [i for i, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        results = []
        for rank in range(nprocs):
            f = Path(tmp) / f"rank{rank}.json"
            results.append(json.loads(f.read_text()) if f.is_file() else None)
    if results[0] is None or hung:
        return {
            "error": f"{kind}: ranks {hung} still running after {run.args.worker_timeout:.0f} s (killed)"
            if hung
            else f"{kind}: rank 0 wrote no result (exit codes {[p.exitcode for p in procs]})",
            "ranks": results,
        }
    out = dict(results[0], processes=nprocs)
    others = [r for r in results[1:] if r is None or "error" in r]
    if others and "error" not in out:
        out["error"] = f"another rank failed: {others[0]}"
    return out


def _worker(rank: int, spec: dict) -> None:
    """One rank of a multi-process check; writes rank{rank}.json."""
    import torch.distributed as dist

    step, out = "start", {}
    try:
        cuda = spec["device"] == "cuda"
        device = torch.device("cuda", rank) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        shape, folder, world = spec["shape"], Path(spec["folder"]), spec["world"]
        init = f"tcp://127.0.0.1:{spec['port']}"
        if spec["kind"] == "xfuser":
            out = _xfuser_worker(rank, world, init, shape, device)
        elif spec["kind"] == "sp_backend_xfuser":
            out = _sp_backend_xfuser_worker(rank, world, init, folder, shape, device)
        else:
            _quiet()
            step = "init_process_group"
            dist.init_process_group("nccl" if cuda else "gloo", init_method=init, rank=rank, world_size=world)
            step = "build model"
            model = build_transformer(folder, device, torch.bfloat16)
            for t in [*model.parameters(), *model.buffers()]:
                dist.broadcast(t.data, src=0)  # rank 0's weights everywhere, whatever each RNG drew
            inputs = {dt: forward_inputs(shape, device, dt) for dt in (torch.bfloat16, torch.float32)}
            # References first: diffusers' parallelism cannot be switched off again. bf16 -> fp32 -> bf16
            # casts are exact, so both runs use the same weights.
            ref16 = stock_forward(model, inputs[torch.bfloat16]).float()
            ref32 = stock_forward(model.float(), inputs[torch.float32])
            model.to(torch.bfloat16)
            out = {"backend": dist.get_backend(), "degree": world}
            if spec["kind"] == "ulysses":
                from spotlight.parallel import SPContext, install_ulysses, ulysses_forward

                step = "ulysses_forward"
                ctx = install_ulysses(model, SPContext())
                ctx.set_group(dist.new_group(list(range(world))))
                forward = lambda x: ulysses_forward(model, ctx, **x)  # noqa: E731
            else:
                step = "import diffusers ContextParallelConfig"
                from diffusers import ContextParallelConfig

                step = "enable_parallelism"
                model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=world))
                step = "context-parallel forward"
                forward = lambda x: stock_forward(model, x)  # noqa: E731
            forward(inputs[torch.bfloat16])  # warm-up
            clock = Clock(device)
            t0 = clock.now()
            got16 = forward(inputs[torch.bfloat16]).float()
            out["forward_ms"] = _r(1e3 * (clock.now() - t0))
            model.float()
            got32 = forward(inputs[torch.float32])
            out.update(
                max_abs_err_bf16=_r((got16 - ref16).abs().max().item()),
                max_abs_err_fp32=_r((got32 - ref32).abs().max().item()),
                ref_max_abs=_r(ref32.abs().max().item()),
            )
            dist.destroy_process_group()
    except BaseException as exc:
        out = dict(out, error=f"{step}: {type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-1500:])
    (Path(spec["out"]) / f"rank{rank}.json").write_text(json.dumps(out))


def _xfuser_worker(rank: int, world: int, init: str, shape: Shape, device: torch.device) -> dict:
    """xDiT's USP attention over an SP group of `world` ranks against full attention; errors name their step."""
    import torch.nn.functional as F

    out: dict = {"degree": world}
    step = "import xfuser"
    try:
        import xfuser  # noqa: F401
        from xfuser.core.distributed import init_distributed_environment, initialize_model_parallel

        out["version"] = importlib.metadata.version("xfuser")
        step = "init_distributed_environment"
        init_distributed_environment(
            world_size=world, rank=rank, distributed_init_method=init, local_rank=rank, backend="nccl"
        )
        step = "initialize_model_parallel"
        initialize_model_parallel(sequence_parallel_degree=world, ulysses_degree=world)
        step = "runtime state"
        import xfuser.core.distributed.runtime_state as rs

        if world == 1:
            rs.initialize_runtime_state()  # ExternalRuntimeState: xDiT's way to run its parts outside its pipelines
        else:
            # ExternalRuntimeState builds a default (degree 1) config; give it one of this group's degree.
            from xfuser.config import xFuserArgs

            engine_config, _ = xFuserArgs(ulysses_degree=world).create_config()
            state = rs.ExternalRuntimeState.__new__(rs.ExternalRuntimeState)
            rs.RuntimeState.__init__(state, engine_config)
            rs._RUNTIME = state
        step = "import USP"
        from xfuser.model_executor.layers.usp import USP

        step = "USP attention"
        gen = torch.Generator().manual_seed(5)
        tokens = shape.image_tokens + shape.text_tokens
        q, k, v = (
            torch.randn(2, shape.heads, tokens, shape.head_dim, generator=gen).to(device, torch.bfloat16)
            for _ in range(3)
        )
        local = [t.chunk(world, dim=2)[rank].contiguous() for t in (q, k, v)]
        USP(*local)  # warm-up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        got_local = USP(*local)
        torch.cuda.synchronize()
        out["forward_ms"] = _r(1e3 * (time.perf_counter() - t0))
        if world > 1:
            import torch.distributed as dist

            parts = [torch.empty_like(got_local) for _ in range(world)]
            dist.all_gather(parts, got_local.contiguous())
            got = torch.cat(parts, dim=2)
        else:
            got = got_local
        ref = F.scaled_dot_product_attention(q, k, v)
        out.update(
            dtype="bfloat16",
            shape=list(q.shape),
            max_abs_err=_r((got.float() - ref.float()).abs().max().item()),
            ref_max_abs=_r(ref.float().abs().max().item()),
        )
    except BaseException as exc:
        out.update(error=f"{step}: {type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-1500:])
    return out


def _sp_backend_xfuser_worker(
    rank: int, world: int, init: str, folder: Path, shape: Shape, device: torch.device
) -> dict:
    """`parallel.sp_backend=xfuser` against ours on one NCCL world of `world` ranks; errors name their step."""
    import torch.distributed as dist

    from spotlight.parallel import SPContext, install_ulysses, ulysses_forward

    out: dict = {"degree": world}
    step = "init_process_group"
    try:
        _quiet()
        dist.init_process_group("nccl", init_method=init, rank=rank, world_size=world)
        step = "build model"
        model = build_transformer(folder, device, torch.bfloat16)
        for t in [*model.parameters(), *model.buffers()]:
            dist.broadcast(t.data, src=0)
        inputs = {dt: forward_inputs(shape, device, dt) for dt in (torch.bfloat16, torch.float32)}
        clock = Clock(device)
        ours_ctx = SPContext()
        step = "xfuser import (SPContext(backend='xfuser'))"
        xf_ctx = SPContext(backend="xfuser")
        out["version"] = xf_ctx.xfuser.x.version
        for dt, tag in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
            model.to(dt)
            x = inputs[dt]
            step = f"stock forward {tag}"
            ref = stock_forward(model, x).float()
            step = f"ours {tag}"
            install_ulysses(model, ours_ctx).set_group(dist.group.WORLD)
            ulysses_forward(model, ours_ctx, **x)  # warm-up
            t0 = clock.now()
            ours = ulysses_forward(model, ours_ctx, **x).float()
            t_ours = clock.now() - t0
            step = f"xfuser bind {tag}"
            install_ulysses(model, xf_ctx)
            t0 = clock.now()
            xf_ctx.set_group(dist.group.WORLD)
            bind_s = clock.now() - t0
            step = f"xfuser forward {tag}"
            ulysses_forward(model, xf_ctx, **x)  # warm-up
            t0 = clock.now()
            got = ulysses_forward(model, xf_ctx, **x).float()
            t_xf = clock.now() - t0
            out.update(
                {
                    f"max_abs_err_vs_ours_{tag}": _r((got - ours).abs().max().item()),
                    f"max_abs_err_vs_stock_{tag}": _r((got - ref).abs().max().item()),
                    f"ours_max_abs_err_vs_stock_{tag}": _r((ours - ref).abs().max().item()),
                    f"ref_max_abs_{tag}": _r(ref.abs().max().item()),
                }
            )
            if tag == "bf16":
                out.update(forward_ms=_r(1e3 * t_xf), ours_forward_ms=_r(1e3 * t_ours), bind_ms=_r(1e3 * bind_s))
            step = f"xfuser release {tag}"
            xf_ctx.set_group(None)
            if world == 1:
                step = f"xfuser unbound forward {tag}"
                got = ulysses_forward(model, xf_ctx, **x).float()
                out[f"unbound_max_abs_err_vs_ours_{tag}"] = _r((got - ours).abs().max().item())
        dist.destroy_process_group()
    except BaseException as exc:
        out.update(error=f"{step}: {type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-1500:])
    return out


def check_sp_backend_xfuser(run: Run) -> dict:
    if not run.cuda:
        return dict(NO_CUDA)
    return spawn_check("sp_backend_xfuser", min(2, run.gpus), run)


def check_ulysses_multiproc(run: Run) -> dict:
    if run.cuda and run.gpus < 2:
        return {"skipped": f"needs 2 GPUs (found {run.gpus}): NCCL cannot place two ranks on one device"}
    return spawn_check("ulysses", 2, run)


def check_diffusers_cp(run: Run) -> dict:
    if not run.cuda:
        return dict(NO_CUDA)
    try:
        from diffusers import ContextParallelConfig  # noqa: F401
    except Exception as exc:
        return {"error": f"import: {type(exc).__name__}: {exc}"}
    if run.gpus < 2:
        return {"import": "ok", "skipped": f"needs 2 GPUs (found {run.gpus}): ContextParallelConfig refuses degree 1"}
    return spawn_check("diffusers_cp", 2, run)


def check_xfuser(run: Run) -> dict:
    if not run.cuda:
        return dict(NO_CUDA)
    return spawn_check("xfuser", min(2, run.gpus), run)


# -- driver ------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cuda or cpu")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes (the CPU smoke run)")
    parser.add_argument("--layers", type=int, default=2, help="transformer blocks of the real-shaped model (real: 60)")
    parser.add_argument("--out", default="", help="also write the JSON here, rewritten after every check")
    parser.add_argument("--skip", default="", help=f"comma-separated checks to skip, of: {', '.join(CHECKS)}")
    parser.add_argument("--worker-timeout", type=float, default=180.0, help="seconds for each multi-process check")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device (use --device cpu --tiny)")
    skip = {c for c in args.skip.split(",") if c}
    if skip - set(CHECKS):
        raise SystemExit(f"--skip: unknown checks {sorted(skip - set(CHECKS))}; choose from {', '.join(CHECKS)}")
    _quiet()
    began = time.perf_counter()
    # A check, not a speed-up: each figure is compared with the reference named inside it.
    results: dict = {
        "baseline": "per check: float32 for bf16, our Ulysses for diffusers CP and xfuser, spotlight memory for memory"
    }

    def record(name: str, fn) -> None:
        t0 = time.perf_counter()
        print(f"gpu_check: {name} ...", file=sys.stderr, flush=True)
        try:
            value = fn()
        except Exception as exc:
            value = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-1500:]}
        if "skipped" not in value or "import" in value:
            value["check_s"] = _r(time.perf_counter() - t0)
        results[name] = value
        results.pop("wall_s", None)  # kept last
        results["wall_s"] = _r(time.perf_counter() - began)
        if args.out:
            tmp = Path(args.out + ".tmp")
            tmp.write_text(json.dumps(results) + "\n")
            os.replace(tmp, args.out)

    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        run = Run(args, Path(tmp) / "model")
        record("env", lambda: check_env(run))
        fns = {
            "sampling": lambda: check_sampling(run),
            "train_step": lambda: check_train(run, False),
            "train_step_gc": lambda: check_train(run, True),
            "ulysses_degree1": lambda: check_ulysses_degree1(run),
            "bf16_vs_fp32": lambda: check_bf16_vs_fp32(run),
            "ulysses_multiproc": lambda: check_ulysses_multiproc(run),
            "diffusers_cp": lambda: check_diffusers_cp(run),
            "xfuser": lambda: check_xfuser(run),
            "sp_backend_xfuser": lambda: check_sp_backend_xfuser(run),
        }
        for name in CHECKS:
            if name == "ulysses_degree1":
                run.release()  # the rest build their own models
            if name in skip:
                results[name] = {"skipped": "--skip"}
                continue
            record(name, fns[name])
        record("config", lambda: dict(check_config(run), **run.config_extra))
    print(json.dumps(results), flush=True)
    return results


def _quiet() -> None:
    import diffusers
    import transformers

    for lib in (diffusers, transformers):
        lib.utils.logging.disable_progress_bar()
        lib.utils.logging.set_verbosity_error()


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
