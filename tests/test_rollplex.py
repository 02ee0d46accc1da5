"""The Rollplex schedule against the serial one, with tiny real Qwen2.5-VL / Qwen3-VL models."""

from __future__ import annotations

import threading

import pytest
import torch

from spotlight.core.config_io import load_config
from vlm.config import TaskConfig, TinyVLMConfig, VLMRecipe
from vlm.driver import make_schedule
from vlm.policy import load_policy, response_logprobs
from vlm.rollout import HFRolloutEngine
from vlm.rollplex import BarrierViolation, VisionCounter, WeightsVersion, prefix_forward, suffix_logprobs
from vlm.task import CELL_PX, TrainStream, corpus, example_image
from vlm.update import Reference

TASK = dict(grid_size=2, max_shapes=3, num_heldout=8)
SPEC = dict(text_hidden=32, text_layers=1, text_heads=2, vision_hidden=32, vision_depth=1, vision_heads=2)
P, G = 2, 3


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def folder(request, tmp_path_factory):
    from vlm.tiny import build_tiny_vlm

    spec = TinyVLMConfig(family=request.param, **SPEC)
    return build_tiny_vlm(
        tmp_path_factory.mktemp(request.param) / "model",
        spec,
        corpus(TaskConfig(**TASK)),
        image_px=TASK["grid_size"] * CELL_PX,
    )


def _recipe(folder, *overrides: str) -> VLMRecipe:
    tiny = [
        f"model.path={folder}",
        f"train.prompts_per_iteration={P}",
        f"train.group_size={G}",
        "rollout.max_new_tokens=4",
        "train.micro_batch_size=4",
        "log.wandb_mode=disabled",
        *[f"task.{k}={v}" for k, v in TASK.items()],
    ]
    return load_config(VLMRecipe, None, [*tiny, *overrides])


def _setup(cfg: VLMRecipe, schedule: str):
    torch.manual_seed(0)  # LoRA's initialisation
    policy = load_policy(cfg.model)
    reference = Reference(policy, cfg.train.beta)
    # Move the policy away from the reference, so the KL term has a gradient.
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in policy.model.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn(p.shape, generator=gen).to(p.device))
    params = [p for p in policy.model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    sched = make_schedule(schedule, policy, HFRolloutEngine(policy), reference, optimizer, cfg)
    examples = TrainStream(cfg.task, seed=0).batch(0, P)
    prompts = policy.encode([e.question for e in examples], [example_image(e, cfg.task) for e in examples])
    return policy, reference, optimizer, params, sched, prompts


def _step(cfg: VLMRecipe, schedule: str):
    """One iteration with fixed advantages; the gradients seen by each optimizer step."""
    policy, reference, optimizer, params, sched, prompts = _setup(cfg, schedule)
    grads = []
    optimizer.register_step_pre_hook(lambda *_: grads.append([p.grad.clone() for p in params]))
    towers = [policy.base_model.model.visual] + ([reference.copy.model.visual] if reference.copy is not None else [])
    counter = VisionCounter(towers)
    ro = sched.rollout(prompts, seed=5)
    rows = list(range(P * G))
    adv_B = torch.tensor([1.0, -1.0, 0.5, -0.5, 0.3, -0.2])
    ref = sched.reference_logprobs(ro, rows) if cfg.train.beta > 0 else None
    on_policy = cfg.train.num_inner_epochs == 1 and cfg.train.minibatch_size >= P * G
    old = None if on_policy else sched.old_logprobs(ro, rows)
    stats = sched.update(ro, rows, adv_B, old, ref, 0)
    sched.close()
    counter.close()
    return {
        "tokens": ro.response_ids_BT,
        "ref": ref,
        "old": old,
        "loss": stats["loss"],
        "grads": grads,
        "images": counter.images,
    }


def test_prefix_plus_suffix_logprobs_equal_the_full_forward(folder):
    cfg = _recipe(folder)
    policy = load_policy(cfg.model)
    examples = TrainStream(cfg.task, seed=0).batch(0, 3)  # questions of different lengths: left padding
    prompts = policy.encode([e.question for e in examples], [example_image(e, cfg.task) for e in examples])
    assert (prompts.attention_mask_BL == 0).any()
    ro = HFRolloutEngine(policy).generate(prompts, 2, 5, 1.0, seed=3)
    ro.response_mask_BT[0, 2:] = 0  # a response that ended early: padding after its end
    with torch.no_grad():
        full_BT = response_logprobs(policy, ro.prompts, ro.response_ids_BT, ro.response_mask_BT, 0.8)
        state = prefix_forward(policy, policy.model, prompts, version=0)  # once per prompt, shared by its 2 samples
        split_BT = suffix_logprobs(
            policy, policy.model, state, [0, 0, 1, 1, 2, 2], ro.response_ids_BT, ro.response_mask_BT, 0.8
        )
    assert state.kv[0][0].shape[0] == 3
    torch.testing.assert_close(split_BT, full_BT, atol=1e-5, rtol=0)
    assert (split_BT[0, 2:] == 0).all()


@pytest.mark.parametrize(
    "overrides",
    [
        (),  # full fine-tuning, vision tower trained: gradients reach it through the prefix graph
        ("model.train_vision=false", "train.num_inner_epochs=2", "train.minibatch_size=4", "train.micro_batch_size=3"),
        ("model.lora_rank=4", "train.beta=0.1"),
    ],
    ids=["full", "frozen-vision-offpolicy", "lora"],
)
@pytest.mark.parametrize(
    "device",
    # On CUDA the prefixes run on a side stream, concurrently with the decode (`pytest -m gpu`).
    [
        "cpu",
        pytest.param(
            "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
        ),
    ],
)
def test_rollplex_step_equals_serial(folder, overrides, device):
    cfg = _recipe(folder, f"model.device={device}", *overrides)
    serial, rollplex = _step(cfg, "serial"), _step(cfg, "rollplex")
    assert torch.equal(serial["tokens"], rollplex["tokens"])
    torch.testing.assert_close(rollplex["ref"], serial["ref"], atol=1e-6, rtol=0)
    if serial["old"] is not None:
        torch.testing.assert_close(rollplex["old"], serial["old"], atol=1e-6, rtol=0)
    assert abs(serial["loss"] - rollplex["loss"]) <= 1e-6
    assert len(serial["grads"]) == len(rollplex["grads"]) >= 1
    for i, (step_a, step_b) in enumerate(zip(serial["grads"], rollplex["grads"])):
        diff = max((a - b).abs().max().item() for a, b in zip(step_a, step_b))
        scale = max(a.abs().max().item() for a in step_a)
        # The first optimizer step sees the same parameters: only float rounding of the split forward differs.
        # Later steps start from parameters AdamW moved by m/sqrt(v), which turns a 1e-8 rounding difference in
        # a near-zero gradient into a visible one, so they are held to float32 noise relative to the gradients'
        # scale instead (measured: up to 5.5e-6 of the scale, qwen3_vl off-policy).
        assert diff <= (1e-6 if i == 0 else 2e-5 * scale), (i, diff, scale)
    assert any(g.abs().max() > 1e-4 for g in serial["grads"][0])  # the comparison is not of zeros


def test_frozen_tower_encodes_each_image_once_per_step(folder):
    cfg = _recipe(folder, "model.train_vision=false")
    serial, rollplex = _step(cfg, "serial"), _step(cfg, "rollplex")
    assert rollplex["images"] == P  # rollout, reference and actor share one encoding per prompt
    assert serial["images"] == 3 * P * G  # rollout, reference, update: every sample, every phase
    trained = _step(_recipe(folder), "rollplex")
    assert trained["images"] == 2 * P  # a trained tower: the actor's (with graph) and the reference's


def test_barrier_violations_raise(folder):
    cfg = _recipe(folder)
    policy, _, optimizer, params, sched, prompts = _setup(cfg, "rollplex")
    # Hold the prefix worker inside its forward: the update must not commit θ_1 meanwhile.
    entered, release = threading.Event(), threading.Event()

    def hold(module, args):
        if threading.current_thread().name.startswith("rollplex-prefix"):
            entered.set()
            release.wait(30)

    layer = policy.base_model.model.language_model.layers[0]
    handle = layer.register_forward_pre_hook(hold)
    try:
        sched.rollout(prompts, seed=5)
        assert entered.wait(30)
        assert "prefix" in sched.guard.readers
        with pytest.raises(BarrierViolation, match=r"committed while \['prefix'\]"):
            sched.guard.commit(optimizer)
    finally:
        release.set()
        handle.remove()
        sched.close()

    guard = WeightsVersion(params)
    with pytest.raises(BarrierViolation, match="written while"):
        with guard.read("reference prefix", 0):
            with torch.no_grad():
                params[0].add_(1.0)  # θ_0 must stay read-only during the overlap
    guard.commit(optimizer)
    with pytest.raises(BarrierViolation, match="reads θ_0"):
        with guard.read("stale prefix", 0):
            pass
