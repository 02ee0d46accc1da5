"""The CUDA paths: the sampler and the GRPO updates against the same code on the CPU, the tiny
recipe through the CLI, the VLM trainer.

Marked `gpu` (CI has no GPU and does not run them); run them on a GPU host with
`python -m pytest -m gpu tests/test_cuda.py`. They exist because the update once crashed on CUDA
(the trajectory's schedule and the advantages stay on the CPU) while every CPU test passed.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from test_grpo import _cfg
from test_vlm_train import _recipe, _weights, base  # noqa: F401 (base: the warm-started VLM fixture)

from spotlight.core.advantages import group_advantages
from spotlight.core.tracking import read_metrics
from spotlight.rollout import rollout
from spotlight.sampling import qwen_image_sigmas
from spotlight.update import GRPOTrainer
from vlm.driver import run_training

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS = ["one red circle"] * 4 + ["two blue squares"] * 4
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _exact_float32_matmuls():
    """TF32 would make CUDA and the CPU differ by ~1e-3 for reasons that are not ours."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _policy(cfg, device, state=None):
    """The recipe's policy on `device`; with `state`, holding those weights (a LoRA adapter is
    drawn from the device's own generator, so the same seed gives another adapter on CUDA)."""
    from spotlight.policy import load_policy

    cfg.model.device = device
    policy = load_policy(cfg.model, seed=0)
    if state is not None:
        policy.transformer.load_state_dict(state)
    return policy


def test_seeds_fix_the_trajectory_on_cuda_as_on_the_cpu(tiny_model_dir):
    cfg = _cfg(tiny_model_dir)
    runs = {}
    for device in ("cpu", "cuda"):
        policy = _policy(cfg, device)
        sigmas = qwen_image_sigmas(cfg.sample.num_steps, policy.latent_shape[0])
        runs[device] = rollout(policy, PROMPTS, list(range(8)), sigmas, noise_level=1.2)
    cpu, gpu = runs["cpu"], runs["cuda"]
    assert gpu.trajectory.latents.device.type == "cuda"
    torch.testing.assert_close(gpu.trajectory.latents.cpu(), cpu.trajectory.latents, rtol=0, atol=1e-4)
    torch.testing.assert_close(gpu.trajectory.log_probs.cpu(), cpu.trajectory.log_probs, rtol=0, atol=1e-4)
    torch.testing.assert_close(gpu.images.cpu(), cpu.images, rtol=0, atol=1e-4)


@pytest.mark.parametrize(
    "objective,lora_rank,autocast",
    [("flow_grpo", 0, "none"), ("flow_grpo", 4, "none"), ("nft", 0, "none"), ("nft", 4, "bfloat16")],
)
def test_update_on_cuda_moves_the_weights_as_on_the_cpu(tiny_model_dir, objective, lora_rank, autocast):
    """One update per device from the same weights and samples: the same direction of change."""
    from spotlight.policy import trainable_state

    deltas, init = {}, None
    for device in ("cpu", "cuda"):
        cfg = _cfg(tiny_model_dir, objective=objective, beta=0.1, nft_num_timesteps=2, nft_weighting="adaptive")
        cfg.train.autocast = autocast if device == "cuda" else "none"
        cfg.model.lora_rank = lora_rank
        policy = _policy(cfg, device, state=init)
        if init is None:
            init = {k: v.detach().clone() for k, v in policy.transformer.state_dict().items()}
        trainer = GRPOTrainer(policy, cfg)
        before = {k: v.detach().clone() for k, v in trainable_state(policy).items()}
        sigmas = qwen_image_sigmas(cfg.sample.num_steps, policy.latent_shape[0])
        ro = rollout(policy, PROMPTS, list(range(8)), sigmas, noise_level=0.0 if objective == "nft" else 1.2)
        adv = group_advantages(torch.arange(8, dtype=torch.float32).view(2, 4) % 3)
        stats = trainer.update(ro, adv, iteration=0)
        assert stats["num_trained_samples"] == 8 and math.isfinite(stats["loss"]) and stats["kl_ref"] >= 0
        after = trainable_state(policy)
        assert all(v.device.type == device for v in after.values())
        deltas[device] = torch.cat([(after[k] - before[k]).float().flatten().cpu() for k in before])
    cpu, gpu = deltas["cpu"], deltas["cuda"]
    assert gpu.abs().max() > 0, "the CUDA update changed nothing"
    cosine = torch.nn.functional.cosine_similarity(cpu, gpu, dim=0).item()
    print(f"{objective} lora={lora_rank} autocast={autocast}: cosine(delta_cpu, delta_cuda) = {cosine:.4f}")
    # Adam's first step is lr * g / (|g| + eps): elements whose gradient is near zero may flip sign
    # between devices, the rest agree. bfloat16 autocast perturbs more.
    assert cosine > (0.8 if autocast == "bfloat16" else 0.95), f"cosine(delta_cpu, delta_cuda) = {cosine:.4f}"


def test_cli_trains_resumes_and_evaluates_the_tiny_recipe_on_cuda(tmp_path, capsys):
    """The README's job on a GPU through the CLI's own entry point: train, resume, eval."""
    from spotlight.cli import main
    from spotlight.core.checkpoint import load_checkpoint

    recipe = str(REPO / "configs/dit/tiny-shapes.yaml")
    small = [
        "model.device=cuda",
        "explore.mode=none",
        "log.wandb_mode=disabled",
        "train.max_minutes=0",
        "train.prompts_per_iteration=4",
        "train.group_size=4",
        "log.images_every=1",
        "log.checkpoint_every=1",
        "data.num_heldout=8",
        "eval.num_seeds=2",
    ]
    run = tmp_path / "run"
    assert main(["train", recipe, "--run-dir", str(run), "--quiet", "train.num_iterations=2", *small]) == 0
    assert main(["train", recipe, "--run-dir", str(run), "--quiet", "train.num_iterations=3", *small]) == 0
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3], rows
    losses = [r["grpo/loss"] for r in rows if "grpo/loss" in r]  # absent where every group was flat
    assert losses and all(math.isfinite(x) for x in losses), rows
    assert load_checkpoint(run).step == 3
    assert list((run / "images").glob("*.png"))
    capsys.readouterr()
    assert main(["eval", recipe, "--checkpoint", str(run), "--json", *small]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["step"] == 3 and summary["num_prompts"] == 8 and 0 <= summary["mean_reward"] <= 1
    print(f"tiny-shapes on cuda, 3 iterations: held-out mean_reward {summary['mean_reward']:.4f}")


def test_vlm_grpo_steps_on_cuda(base, tmp_path):  # noqa: F811 (the fixture imported above)
    """The VLM trainer on CUDA: two iterations move the weights and write a checkpoint."""
    from vlm.policy import VLMPolicy

    run = tmp_path / "vlm"
    summary = run_training(_recipe(base, "train.num_iterations=2", "model.device=cuda"), run, progress=False)
    assert summary["iterations"] == 2
    trained = _weights(run)
    start = dict(VLMPolicy.load(base).model.named_parameters())
    assert any(not torch.equal(v, start[n]) for n, v in trained.items())
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 2


def test_prompt_prefetch_on_a_side_stream_gives_the_same_bits(tiny_model_dir):
    """The next step's prompts encoded on the prompt cache's worker thread and side stream while the
    driver's stream runs a rollout: the embeddings the driver's own encode of that batch gives, and
    the same rollout as without the prefetch (spotlight/prompt_cache.py, "Prefetch")."""
    cfg = _cfg(tiny_model_dir)
    policy = _policy(cfg, "cuda")
    cache = policy.prompt_cache
    nxt = ["three green triangles", "two blue squares", "two blue squares", "one red circle"]
    reference = policy._encode_uncached(sorted(set(nxt)))
    sigmas = qwen_image_sigmas(cfg.sample.num_steps, policy.latent_shape[0])
    with cache.step(PROMPTS):
        alone = rollout(policy, PROMPTS, list(range(8)), sigmas, noise_level=1.2)
    for _ in range(3):
        cache.begin_step(PROMPTS, next_prompts=nxt)
        assert len(cache._streams) == 1  # the prefetch runs on a side stream
        overlapped = rollout(policy, PROMPTS, list(range(8)), sigmas, noise_level=1.2)
        cache.end_step()
        assert torch.equal(overlapped.images, alone.images)
        assert torch.equal(overlapped.trajectory.latents, alone.trajectory.latents)
        cache.begin_step(nxt)
        held = cache.lookup(sorted(set(nxt)))
        assert cache.end_step().prefetched
        assert all(torch.equal(a, b) for a, b in zip(held, reference, strict=True))
    cache.close()
