"""`spotlight export`: every format loads with the real diffusers, transformers and peft classes,
and the loaded model computes what our policy with the checkpoint computes.

DiT: a tiny LoRA run (rank 4, alpha 8: a scale other than 1 must survive the export) and a tiny
full-transformer run. VLM: a tiny warm-started Qwen2.5-VL trained one step with LoRA and without.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_cli import tiny_overrides

from spotlight.cli import main
from spotlight.core.checkpoint import load_checkpoint

JPEG = "reward.weights={jpeg_compressibility: 1.0}"  # varies per seed: every group trains


def export(capsys, run_dir: Path, to: Path, *extra: str) -> dict:
    capsys.readouterr()
    assert main(["export", str(run_dir), "--to", str(to), *extra]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def dit_runs(tiny_model_dir, tmp_path_factory):
    runs = {}
    for name, extra in {"lora": ["model.lora_rank=4", "model.lora_alpha=8", "train.lr=1e-2"], "full": []}.items():
        runs[name] = tmp_path_factory.mktemp(name) / "run"
        args = ["train", *tiny_overrides(tiny_model_dir, 1), JPEG, *extra, "--run-dir", str(runs[name]), "--quiet"]
        assert main(args) == 0
    return runs


def dit_velocity(transformer, tiny_model_dir) -> torch.Tensor:
    """The velocity our policy code computes with `transformer` in place of its own, on fixed inputs."""
    from spotlight.policy import DiTPolicy

    policy = DiTPolicy.load(tiny_model_dir, height=32, width=32, max_text_tokens=16)
    policy.transformer = transformer.eval()
    embeds, mask = policy.encode_prompts(["two red circles", "one blue square"])
    latents = torch.randn(2, *policy.latent_shape, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return policy.velocity(latents, torch.tensor([0.7, 0.3]), embeds, mask)


def trained_dit_velocity(run_dir: Path, tiny_model_dir) -> torch.Tensor:
    from spotlight.config import DiTRecipe
    from spotlight.core.config_io import load_config
    from spotlight.policy import load_policy, load_trainable_state

    ckpt = load_checkpoint(run_dir)
    cfg = load_config(
        DiTRecipe,
        None,
        [
            f"model.path={tiny_model_dir}",
            f"model.lora_rank={ckpt.meta['lora_rank']}",
            f"model.lora_alpha={ckpt.meta['lora_alpha']}",
        ],
    )
    policy = load_policy(cfg.model, trainable=False)
    load_trainable_state(policy, ckpt.tensors["trainable"])
    return dit_velocity(policy.transformer, tiny_model_dir)


def test_a_dit_lora_loads_with_diffusers_load_lora_weights(dit_runs, tiny_model_dir, tmp_path, capsys):
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline, QwenImageTransformer2DModel

    summary = export(capsys, dit_runs["lora"], tmp_path / "lora")
    assert summary["format"] == "diffusers-lora" and summary["lora_rank"] == 4
    assert sorted(p.name for p in (tmp_path / "lora").iterdir()) == ["pytorch_lora_weights.safetensors"]
    base = QwenImageTransformer2DModel.from_pretrained(tiny_model_dir / "transformer")
    pipe = QwenImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(), vae=None, text_encoder=None, tokenizer=None, transformer=base
    )
    untrained = dit_velocity(pipe.transformer, tiny_model_dir)
    pipe.load_lora_weights(tmp_path / "lora")  # diffusers' own loader
    ours = trained_dit_velocity(dit_runs["lora"], tiny_model_dir)
    assert not torch.allclose(
        ours, untrained, atol=1e-5
    )  # the adapter changed the model: the comparison means something
    torch.testing.assert_close(dit_velocity(pipe.transformer, tiny_model_dir), ours, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("run", ["lora", "full"])
def test_a_dit_exports_as_a_diffusers_transformer(run, dit_runs, tiny_model_dir, tmp_path, capsys):
    from diffusers import QwenImageTransformer2DModel

    summary = export(capsys, dit_runs[run], tmp_path / "transformer", "--format", "diffusers")
    assert summary["format"] == "diffusers"
    loaded = QwenImageTransformer2DModel.from_pretrained(tmp_path / "transformer")
    assert not getattr(loaded, "peft_config", None)  # the adapter is merged into the weights
    torch.testing.assert_close(
        dit_velocity(loaded, tiny_model_dir), trained_dit_velocity(dit_runs[run], tiny_model_dir), rtol=1e-5, atol=1e-5
    )


def test_export_mistakes_are_one_line(dit_runs, tmp_path, capsys):
    (tmp_path / "taken").mkdir()
    for args, message in [
        ([str(dit_runs["full"]), "--to", str(tmp_path / "x"), "--format", "diffusers-lora"], "no LoRA"),
        ([str(dit_runs["lora"]), "--to", str(tmp_path / "x"), "--format", "peft"], "a DiT run exports as"),
        ([str(dit_runs["lora"]), "--to", str(tmp_path / "taken")], "pass --force"),
        ([str(dit_runs["lora"]), "--to", str(tmp_path / "x"), "--weights", "ema"], "no moving average"),
    ]:
        capsys.readouterr()
        assert main(["export", *args]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err, err
    assert not (tmp_path / "x").exists()


# -- VLM ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vlm_runs(tmp_path_factory):
    from test_vlm_train import SPEC, TASK, _recipe

    from spotlight.core.config_io import load_config
    from vlm.config import WarmStartRecipe
    from vlm.driver import run_training
    from vlm.warmstart import warm_start

    base = tmp_path_factory.mktemp("vlm") / "base"
    # As test_vlm_train's base: it answers in the format, so groups get reward variance and train.
    cfg = load_config(
        WarmStartRecipe,
        None,
        [
            "num_steps=25",
            "vision_pretrain_steps=20",
            "batch_size=16",
            "lr=1e-2",
            *[f"task.{k}={v}" for k, v in TASK.items()],
            *[f"model.{k}={v}" for k, v in SPEC.items()],
        ],
    )
    warm_start(cfg, base, progress=False)
    runs = {"base": base}
    for name, extra in {"lora": ["model.lora_rank=4", "model.lora_alpha=8"], "full": []}.items():
        runs[name] = tmp_path_factory.mktemp(name) / "run"
        run_training(_recipe(base, "train.num_iterations=2", *extra), runs[name], progress=False)
    return runs


def vlm_logits(model, processor_folder: Path) -> torch.Tensor:
    """Logits of a fixed (image, question) prompt under `model`, through our policy's encoder."""
    from test_vlm_train import TASK

    from vlm.policy import VLMPolicy
    from vlm.task import TaskConfig, example_image, heldout_examples

    policy = VLMPolicy.load(processor_folder)
    task = TaskConfig(**TASK)
    examples = heldout_examples(task)[:2]
    batch = policy.encode([e.question for e in examples], [example_image(e, task) for e in examples])
    with torch.no_grad():
        return model.eval()(**batch.model_inputs()).logits


def trained_vlm_logits(run_dir: Path, base: Path) -> torch.Tensor:
    import yaml

    from spotlight.core.config_io import load_config
    from vlm.config import VLMRecipe
    from vlm.policy import load_policy, load_trainable_state

    ckpt = load_checkpoint(run_dir)
    cfg = load_config(VLMRecipe, base=yaml.safe_load(ckpt.config_yaml))
    policy = load_policy(cfg.model, trainable=False)
    load_trainable_state(policy, ckpt.tensors["trainable"])
    return vlm_logits(policy.model, base)


@pytest.mark.parametrize("run", ["lora", "full"])
def test_a_vlm_exports_for_transformers_from_pretrained(run, vlm_runs, tmp_path, capsys):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    summary = export(capsys, vlm_runs[run], tmp_path / "model")
    assert summary["kind"] == "vlm" and summary["format"] == "transformers"
    loaded = AutoModelForImageTextToText.from_pretrained(tmp_path / "model")
    AutoProcessor.from_pretrained(tmp_path / "model")  # the processor travels with it
    ours = trained_vlm_logits(vlm_runs[run], vlm_runs["base"])
    base_logits = vlm_logits(AutoModelForImageTextToText.from_pretrained(vlm_runs["base"]), vlm_runs["base"])
    assert not torch.allclose(ours, base_logits, atol=1e-5)  # one step changed the model
    torch.testing.assert_close(vlm_logits(loaded, tmp_path / "model"), ours, rtol=1e-5, atol=1e-5)


def test_a_vlm_lora_exports_as_a_peft_adapter(vlm_runs, tmp_path, capsys):
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    summary = export(capsys, vlm_runs["lora"], tmp_path / "adapter", "--format", "peft")
    assert summary["format"] == "peft"
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (tmp_path / "adapter").iterdir()}
    model = PeftModel.from_pretrained(
        AutoModelForImageTextToText.from_pretrained(vlm_runs["base"]), tmp_path / "adapter"
    )
    torch.testing.assert_close(
        vlm_logits(model, vlm_runs["base"]),
        trained_vlm_logits(vlm_runs["lora"], vlm_runs["base"]),
        rtol=1e-5,
        atol=1e-5,
    )
    capsys.readouterr()
    assert main(["export", str(vlm_runs["full"]), "--to", str(tmp_path / "x"), "--format", "peft"]) == 2
    assert "no LoRA" in capsys.readouterr().err
