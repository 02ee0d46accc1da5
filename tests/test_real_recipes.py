"""The real-model recipes load and run one training step end to end, on tiny random components.

Each test takes a real recipe from `configs/` unchanged and substitutes tiny components through
dotted overrides only, as a user would on the command line: the model folder (a tiny Qwen-Image in
the diffusers layout with a real tiny `AutoencoderKLQwenImage`, or a tiny Qwen2.5-VL), the reward
models (tiny reader, detector, CLIP from `spotlight.rewards.tiny`), the prompt files, the device,
the resolution and the batch sizes. Everything else (LoRA rank, SDE type, noise level and window,
objective, clip range, beta, the rewards named by the recipe) is the recipe's. The step runs
through the `spotlight` command's own `main`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from spotlight.cli import main as spotlight_main

ROOT = Path(__file__).resolve().parents[1]
OCR_PROMPTS = ROOT / "configs/prompts/ocr-example.txt"
GENEVAL_PROMPTS = ROOT / "configs/prompts/geneval-example.txt"
GENEVAL_LABELS = ["apple", "cup", "dog", "teddy bear"]


def _prompt_lines(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if line and not line.startswith("#")]


@pytest.fixture(scope="module")
def tiny_qwen_image(tmp_path_factory) -> Path:
    """A tiny Qwen-Image folder in the real layout: transformer/, text_encoder/, tokenizer/ and vae/."""
    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel

    from spotlight.config import TinyModelConfig
    from spotlight.tiny import build_tiny_model

    corpus = _prompt_lines(OCR_PROMPTS) + _prompt_lines(GENEVAL_PROMPTS) + ["a photo of a cat"]
    spec = TinyModelConfig(image_size=32, codec_factor=2, num_layers=1, num_heads=2, head_dim=16, text_hidden=32)
    folder = build_tiny_model(tmp_path_factory.mktemp("qwen_image") / "model", spec, corpus)
    # The real model decodes with its VAE: swap the tiny pixel codec for a tiny real one (4 latent
    # channels, 8x down-sampling) and the transformer for one that reads its packed latents.
    (folder / "latent_codec.json").unlink()
    AutoencoderKLQwenImage(
        base_dim=24,
        z_dim=4,
        dim_mult=[1, 2, 4],
        num_res_blocks=1,
        temperal_downsample=[False, True],
        latents_mean=[0.0] * 4,
        latents_std=[1.0] * 4,
    ).save_pretrained(folder / "vae")
    QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=16,
        out_channels=4,
        num_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=spec.text_hidden,
        axes_dims_rope=(4, 6, 6),
    ).save_pretrained(folder / "transformer")
    return folder


@pytest.fixture(scope="module")
def tiny_reward_models(tmp_path_factory) -> dict[str, Path]:
    from spotlight.rewards.ocr import quoted_text
    from spotlight.rewards.tiny import build_tiny_clip, build_tiny_detector, build_tiny_got_ocr

    root = tmp_path_factory.mktemp("reward_models")
    texts = [quoted_text(p) for p in _prompt_lines(OCR_PROMPTS)]
    return {
        "ocr": build_tiny_got_ocr(root / "ocr", texts),  # the recipe's reader is GOT-OCR 2.0
        "detector": build_tiny_detector(root / "detector", GENEVAL_LABELS),
        "clip": build_tiny_clip(root / "clip", _prompt_lines(OCR_PROMPTS)),
    }


DIT_RECIPES = {
    # recipe: (reward overrides given the tiny reward model folders, prompt file, the recipe's reward)
    "qwen-image-ocr": (
        lambda m: [f"reward.ocr_model_path={m['ocr']}", "reward.ocr_max_new_tokens=16"],
        OCR_PROMPTS,
        "ocr",
    ),
    # Thresholds 0: a random detector's scores are low, and the counting and colour code should run.
    "qwen-image-geneval": (
        lambda m: [
            f"reward.detector_model_path={m['detector']}",
            "reward.detector_threshold=0",
            "reward.detector_count_threshold=0",
        ],
        GENEVAL_PROMPTS,
        "geneval",
    ),
    "qwen-image": (
        lambda m: [f"reward.clip_model_path={m['clip']}", f"reward.clip_processor_path={m['clip']}"],
        OCR_PROMPTS,
        "pickscore",
    ),
}


@pytest.mark.parametrize("recipe", sorted(DIT_RECIPES))
def test_dit_recipe_runs_one_step(recipe, tiny_qwen_image, tiny_reward_models, tmp_path):
    from spotlight.config import DiTRecipe
    from spotlight.core.checkpoint import load_checkpoint
    from spotlight.core.config_io import load_config
    from spotlight.core.tracking import read_metrics

    reward_overrides, prompts, reward_name = DIT_RECIPES[recipe]
    recipe_path = ROOT / "configs/dit" / f"{recipe}.yaml"
    overrides = [
        f"model.path={tiny_qwen_image}",
        "model.height=32",
        "model.width=32",
        "model.dtype=float32",
        "model.device=cpu",
        f"data.train_prompts={prompts}",
        f"data.eval_prompts={prompts}",
        "sample.batch_size=4",
        "train.prompts_per_iteration=2",
        "train.group_size=2",
        "train.minibatch_size=4",
        "train.num_iterations=1",
        "log.wandb_mode=disabled",
        "log.images_every=0",
        "eval.every=0",
        # A random reward model can score every sample alike, and a group with equal rewards trains
        # nothing; a little JPEG compressibility keeps the step's parameter change observable.
        "reward.weights.jpeg_compressibility=0.001",
        *reward_overrides(tiny_reward_models),
    ]
    # The recipe's own training settings are what runs (only sizes, paths and device were overridden).
    cfg = load_config(DiTRecipe, recipe_path, overrides)
    original = load_config(DiTRecipe, recipe_path)
    assert cfg.model.lora_rank == original.model.lora_rank == 64 and cfg.model.gradient_checkpointing
    assert (cfg.sample.noise_level, cfg.sample.sde_window_size, cfg.train.objective, cfg.train.beta) == (
        original.sample.noise_level,
        original.sample.sde_window_size,
        original.train.objective,
        original.train.beta,
    )
    assert reward_name in original.reward.weights

    run_dir = tmp_path / "run"
    assert spotlight_main(["train", str(recipe_path), *overrides, "--run-dir", str(run_dir), "--quiet"]) == 0

    [metrics] = read_metrics(run_dir)
    value = metrics[f"reward/{reward_name}"]
    assert math.isfinite(value)
    if reward_name in ("ocr", "geneval"):
        assert 0 <= value <= 1
    assert metrics["reward/num_failed"] == 0
    # One optimizer step moved the LoRA adapter off its zero-initialised B matrices.
    ckpt = load_checkpoint(run_dir)
    assert ckpt.step == 1
    lora_b = {k: v for k, v in ckpt.tensors["trainable"].items() if "lora_B" in k}
    assert lora_b and any(v.abs().sum() > 0 for v in lora_b.values())


def test_vlm_recipe_runs_one_step(tmp_path):
    from spotlight.core.checkpoint import load_checkpoint
    from spotlight.core.config_io import load_config
    from spotlight.core.tracking import read_metrics
    from vlm.config import TinyVLMConfig, VLMRecipe
    from vlm.task import CELL_PX, corpus
    from vlm.tiny import build_tiny_vlm

    recipe_path = ROOT / "configs/vlm/qwen2.5-vl-7b.yaml"
    original = load_config(VLMRecipe, recipe_path)
    # The recipe's own task (an 8x8 grid): the tiny processor is sized for its images.
    model_dir = build_tiny_vlm(
        tmp_path / "model",
        TinyVLMConfig(text_layers=1, vision_depth=1),
        corpus(original.task),
        image_px=original.task.grid_size * CELL_PX,
    )
    overrides = [
        f"model.path={model_dir}",
        "model.dtype=float32",
        "model.device=cpu",
        "train.prompts_per_iteration=2",
        "train.group_size=2",
        "rollout.max_new_tokens=4",
        "train.minibatch_size=4",
        "train.micro_batch_size=2",
        "train.num_iterations=1",
        "log.wandb_mode=disabled",
        "eval.every=0",
        "task.num_heldout=8",
        # A random model never writes `answer : <word>`, so every group would be flat and skipped:
        # keep them, so that the reference pass (LoRA off) and the update run.
        "train.drop_flat_groups=false",
    ]
    cfg = load_config(VLMRecipe, recipe_path, overrides)
    assert cfg.model.lora_rank == 64 and not cfg.model.train_vision and cfg.train.schedule == "rollplex"
    assert cfg.train.beta == original.train.beta > 0

    run_dir = tmp_path / "run"
    assert spotlight_main(["vlm", "train", str(recipe_path), *overrides, "--run-dir", str(run_dir), "--quiet"]) == 0

    [metrics] = read_metrics(run_dir)
    assert metrics["grpo/rows_updated"] == 4
    assert all(math.isfinite(metrics[k]) for k in ("reward/mean", "reward/accuracy", "reward/format"))
    ckpt = load_checkpoint(run_dir)
    assert ckpt.step == 1 and any("lora_" in k for k in ckpt.tensors["trainable"])
    saved = json.loads(json.dumps(ckpt.meta))
    assert saved["lora_rank"] == 64 and saved["train_vision"] is False
