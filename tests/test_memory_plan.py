"""`spotlight memory` against the memory of real training steps of the tiny recipes, measured on CPU.

What is measured, per component of the trainer's update:
- weights, gradients, optimizer state: the bytes of the tensors themselves (parameters and buffers of
  every model the step holds, the copies the trainer makes included; `p.grad` after the step;
  AdamW's state after it).
- activations: the bytes autograd saves for backward, seen by `saved_tensors_hooks`, deduplicated
  by storage and followed while alive (a weak reference on the storage); the figure is the peak of
  the live total over the step. Why this rather than a profiler peak: it is exactly the quantity
  the estimate models (what backward needs), it does not depend on allocator caching or on the
  transient workspace of single ops, and the CPU has no allocator peak statistic (`vlm/memory.py`).
  Hooks are per thread: the Rollplex prefix worker gets its own (`_HookedExecutor`).
- gradient checkpointing: the checkpoint's recomputation saves into its own hooks, which hide it
  from ours, so the recomputed block is measured by the same hooks in the same model without
  checkpointing (the largest single block's saved bytes) and added to what the checkpointed step
  keeps.
- buffers: the rollout's trajectory and prompt embeddings (DiT), the Rollplex boundary state (VLM).

The estimate is `spotlight.cli.memory_plan` on the same recipe and overrides: the code path `spotlight memory` runs.
"""

from __future__ import annotations

import copy
import math
import threading
import weakref

import pytest
import torch

from spotlight.cli import memory_plan
from spotlight.core.memory_plan import GROUPS

TOLERANCE = 0.25


class SavedMeter:
    """Peak bytes of the live storages autograd saved for backward (the models' own weights excluded)."""

    def __init__(self, modules):
        self.exclude = {t.untyped_storage()._cdata for m in modules for t in [*m.parameters(), *m.buffers()]}
        self._alive: dict[int, weakref.ref] = {}
        self._lock = threading.Lock()
        self.live = 0
        self.peak = 0

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage._cdata
        with self._lock:
            if key not in self.exclude and key not in self._alive:
                size = storage.nbytes()
                self._alive[key] = weakref.ref(storage, lambda _, key=key, size=size: self._free(key, size))
                self.live += size
                self.peak = max(self.peak, self.live)
        return t

    def _free(self, key: int, size: int) -> None:
        with self._lock:
            if self._alive.pop(key, None) is not None:
                self.live -= size

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def largest_call(self, modules) -> tuple[dict, list]:
        """Record, in out["max"], the most bytes one call of any of `modules` saved."""
        out = {"max": 0}
        start: dict[int, int] = {}

        def pre(module, args):
            start[id(module)] = self.live

        def post(module, args, output):
            out["max"] = max(out["max"], self.live - start[id(module)])

        handles = [h for m in modules for h in (m.register_forward_pre_hook(pre), m.register_forward_hook(post))]
        return out, handles


class _HookedExecutor:
    """The Rollplex prefix worker with our hooks entered in its thread (saved-tensor hooks are per thread)."""

    def __init__(self, inner, meter: SavedMeter):
        self.inner, self.meter = inner, meter

    def submit(self, fn, *args, **kwargs):
        def run():
            with self.meter.hooks():
                return fn(*args, **kwargs)

        return self.inner.submit(run)

    def shutdown(self, wait: bool = True) -> None:
        self.inner.shutdown(wait=wait)


def _bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        seen[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _module_bytes(*modules) -> int:
    return _bytes(t for m in modules if m is not None for t in [*m.parameters(), *m.buffers()])


def _optimizer_bytes(optimizer) -> int:
    return _bytes(v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor))


@pytest.fixture()
def copies(monkeypatch):
    """The nn.Modules the code under test deep-copies (reference and old-policy copies)."""
    made = []
    original = copy.deepcopy

    def spy(obj, *args, **kwargs):
        out = original(obj, *args, **kwargs)
        if isinstance(out, torch.nn.Module):
            made.append(out)
        return out

    monkeypatch.setattr(copy, "deepcopy", spy)
    return made


def _compare(plan, measured: dict[str, float], label: str) -> None:
    estimate = plan.role("trainer").by_group()
    lines = [f"{label}: group estimate / measured (MiB)"]
    for g in GROUPS:
        lines.append(f"  {g:12s} {estimate[g] / 2**20:10.2f} / {measured.get(g, 0) / 2**20:10.2f}")
    est_total, meas_total = sum(estimate.values()), sum(measured.values())
    lines.append(f"  {'total':12s} {est_total / 2**20:10.2f} / {meas_total / 2**20:10.2f}")
    report = "\n".join(lines)
    print(report)
    for g, value in measured.items():
        if value > 0.01 * meas_total:  # groups under 1% of the total only count through the total
            assert abs(estimate[g] - value) <= TOLERANCE * value, report
    assert abs(est_total - meas_total) <= TOLERANCE * meas_total, report


# -- DiT -------------------------------------------------------------------------------------------

DIT_RECIPE = "configs/dit/tiny-shapes.yaml"
DIT_CASES = {
    # The recipe as shipped: full fine-tune in fp32, DiffusionNFT on 256 samples in minibatches of
    # 128 (two optimizer steps per update, so the old-policy copy is made).
    "tiny-shapes": [],
    # The real recipes' settings on the tiny model: LoRA, bf16, Flow-GRPO on an SDE window.
    "tiny-shapes-lora-bf16": [
        "model.lora_rank=8",
        "model.dtype=bfloat16",
        "train.objective=flow_grpo",
        "sample.noise_level=1.2",
        "sample.sde_window_size=2",
        "train.prompts_per_iteration=4",
        "train.minibatch_size=32",
        "sample.batch_size=32",
    ],
}


def _measure_dit_update(cfg, policy, trainer, ro, adv, *, block_recompute: int = 0) -> tuple[dict, int]:
    """Components of one real GRPO update; returns them and the largest single block's saved bytes."""
    from spotlight.rollout import encode

    tr = policy.transformer
    meter = SavedMeter([tr, policy.text_encoder, *([trainer._ref_copy] if trainer._ref_copy is not None else [])])
    largest, handles = meter.largest_call(list(tr.transformer_blocks))
    try:
        with meter.hooks():
            trainer.update(ro, adv, iteration=0)
    finally:
        for h in handles:
            h.remove()
    embeds = encode(policy, ro.prompts, cfg.sample.guidance_scale, cfg.sample.negative_prompt)
    measured = {
        "gradients": _bytes(p.grad for p in trainer.params if p.grad is not None),
        "optimizer": _optimizer_bytes(trainer.optimizer),
        "activations": meter.peak + block_recompute,
        "buffers": _bytes([ro.trajectory.latents, ro.trajectory.log_probs])
        + _bytes([t for t in (embeds.embeds, embeds.neg_embeds) if t is not None]),
    }
    return measured, largest["max"]


@pytest.mark.parametrize("case", list(DIT_CASES))
def test_dit_plan_matches_a_measured_training_step(case, copies):
    from spotlight.config import DiTRecipe
    from spotlight.core.advantages import group_advantages
    from spotlight.core.config_io import load_config
    from spotlight.driver import plan_iteration
    from spotlight.policy import load_policy
    from spotlight.prompts import train_and_eval_prompts
    from spotlight.rollout import rollout
    from spotlight.sampling import qwen_image_sigmas
    from spotlight.update import GRPOTrainer

    overrides = DIT_CASES[case]
    cfg = load_config(DiTRecipe, DIT_RECIPE, overrides)
    torch.manual_seed(0)
    policy = load_policy(cfg.model)
    trainer = GRPOTrainer(policy, cfg)
    prompts, seeds, sde_steps = plan_iteration(cfg, train_and_eval_prompts(cfg.data, cfg.reward.weights)[0], 0)
    sigmas = qwen_image_sigmas(cfg.sample.num_steps, policy.latent_shape[0])
    ro = rollout(
        policy,
        prompts,
        seeds,
        sigmas,
        noise_level=cfg.sample.noise_level,
        sde_steps=sde_steps,
        sde_type=cfg.sample.sde_type,
        guidance_scale=cfg.sample.guidance_scale,
        negative_prompt=cfg.sample.negative_prompt,
        batch_size=cfg.sample.batch_size,
    )
    P, G = cfg.train.prompts_per_iteration, cfg.train.group_size
    adv = group_advantages(torch.randn(P, G, generator=torch.Generator().manual_seed(0)))
    assert int(adv.trainable_PG.sum()) == P * G

    # Without gradient checkpointing, then with it on the same policy, optimizer and rollout.
    block = 0  # with checkpointing: one block's recompute, as measured without it
    for gc in (False, True):
        if gc:
            policy.transformer.enable_gradient_checkpointing()
        measured, block = _measure_dit_update(cfg, policy, trainer, ro, adv, block_recompute=block if gc else 0)
        # Copies made during this update (DiffusionNFT's old policy) or at start (the KL reference).
        measured["weights"] = _module_bytes(policy.transformer, policy.text_encoder, *copies) + _bytes(
            trainer.ema or []
        )
        copies[:] = [c for c in copies if c is trainer._ref_copy]
        plan = memory_plan(
            DIT_RECIPE, [*overrides, f"model.gradient_checkpointing={str(gc).lower()}"], gpus=1, gpu_mem_gib=80
        )
        _compare(plan, measured, f"{case} gradient_checkpointing={gc}")


# -- VLM -------------------------------------------------------------------------------------------

VLM_RECIPE = "configs/vlm/tiny-count.yaml"
VLM_CASES = {
    # The recipe as shipped: full fine-tune in fp32 (vision included), KL reference copy, Rollplex.
    "tiny-count": [],
    "tiny-count-serial": ["train.schedule=serial"],
    # The real recipe's settings on the tiny model: LoRA (fp32 adapters on bf16), frozen vision, micro-batches.
    "tiny-count-lora-bf16": [
        "model.lora_rank=8",
        "model.dtype=bfloat16",
        "model.train_vision=false",
        "train.micro_batch_size=32",
    ],
}


@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory):
    """A tiny Qwen2.5-VL folder (random weights: memory does not depend on them) for the tiny-count task."""
    from spotlight.core.config_io import load_config
    from vlm.config import TinyVLMConfig, VLMRecipe
    from vlm.task import corpus
    from vlm.tiny import build_tiny_vlm

    task = load_config(VLMRecipe, VLM_RECIPE, []).task
    return build_tiny_vlm(
        tmp_path_factory.mktemp("plan") / "vlm", TinyVLMConfig(), corpus(task), image_px=task.grid_size * 28
    )


@pytest.mark.parametrize("case", list(VLM_CASES))
def test_vlm_plan_matches_a_measured_training_step(case, tiny_vlm):
    from spotlight.core.config_io import load_config
    from spotlight.core.seeds import derive_seed
    from vlm.config import VLMRecipe
    from vlm.driver import make_schedule
    from vlm.memory import tensor_bytes
    from vlm.policy import load_policy
    from vlm.rollout import ENGINES
    from vlm.task import TrainStream, example_image
    from vlm.update import Reference

    overrides = [f"model.path={tiny_vlm}", *VLM_CASES[case]]
    cfg = load_config(VLMRecipe, VLM_RECIPE, overrides)
    tc, P, G = cfg.train, cfg.train.prompts_per_iteration, cfg.train.group_size
    torch.manual_seed(0)
    policy = load_policy(cfg.model)
    engine = ENGINES[cfg.rollout.engine](policy, batch_size=cfg.rollout.batch_size)
    reference = Reference(policy, tc.beta)
    params = [p for p in policy.model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=tc.lr)
    schedule = make_schedule(tc.schedule, policy, engine, reference, optimizer, cfg)
    meter = SavedMeter([policy.model, *([reference.copy] if reference.copy is not None else [])])
    if tc.schedule == "rollplex":
        schedule.worker = _HookedExecutor(schedule.worker, meter)
    examples = TrainStream(cfg.task, seed=tc.seed).batch(0, P)
    prompts = policy.encode([e.question for e in examples], [example_image(e, cfg.task) for e in examples])
    rows = list(range(P * G))
    boundary = 0
    with meter.hooks():
        ro = schedule.rollout(prompts, seed=derive_seed(tc.seed, 0, 0))
        ref_logp = schedule.reference_logprobs(ro, rows) if tc.beta > 0 else None
        if tc.schedule == "rollplex":  # the boundary state other than the actor prefix (counted as activations)
            boundary = schedule.boundary_bytes() - tensor_bytes(schedule._actor.tensors())
        on_policy = tc.num_inner_epochs == 1 and tc.minibatch_size >= P * G
        old_logp = None if on_policy else schedule.old_logprobs(ro, rows)
        schedule.update(ro, rows, torch.randn(P * G, generator=torch.Generator().manual_seed(0)), old_logp, ref_logp, 0)
    schedule.close()
    measured = {
        "weights": _module_bytes(policy.model, reference.copy),
        "gradients": _bytes(p.grad for p in params if p.grad is not None),
        "optimizer": _optimizer_bytes(optimizer),
        "activations": meter.peak,
        "buffers": boundary,
    }
    plan = memory_plan(VLM_RECIPE, overrides, gpus=1, gpu_mem_gib=80)
    assert plan.shapes["response_tokens"] >= ro.response_ids_BT.shape[1]
    _compare(plan, measured, case)


# -- the command -----------------------------------------------------------------------------------


def test_real_recipe_plans_say_where_the_architecture_came_from():
    plan = memory_plan("configs/dit/qwen-image.yaml", [], gpus=8, gpu_mem_gib=80)
    assert "published" in plan.sources["transformer"] and "published" in plan.sources["text_encoder"]
    trainer = plan.role("trainer")
    # Qwen-Image: ~20.4B transformer parameters in bf16; LoRA rank 64 on Flow-GRPO's targets.
    assert 37 < trainer.by_group()["weights"] / 2**30 < 70
    assert trainer.by_group()["optimizer"] < trainer.by_group()["weights"] / 10
    full = memory_plan("configs/dit/qwen-image.yaml", ["model.lora_rank=0"], gpus=8, gpu_mem_gib=80)
    assert not full.fits(full.role("trainer"))
    assert any("FSDP over >=" in s for s in full.suggestions), full.suggestions


def test_cli_memory_json_and_errors(capsys):
    import json

    from spotlight.cli import main

    assert main(["memory", DIT_RECIPE, "--gpus", "1", "--gpu-mem", "24", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["kind"] == "dit" and {r["name"] for r in out["roles"]} == {"trainer", "rollout", "explorer"}
    assert all(r["fits"] for r in out["roles"])
    assert main(["memory", "configs/dit/nope.yaml", "--gpus", "1", "--gpu-mem", "80"]) == 2
    assert "configs/dit/nope.yaml" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--gpu-mem"):
        memory_plan(DIT_RECIPE, [], gpus=1, gpu_mem_gib=0)
    with pytest.raises(ValueError, match="--gpus"):
        memory_plan(DIT_RECIPE, [], gpus=0, gpu_mem_gib=80)
    assert math.isclose(memory_plan(DIT_RECIPE, [], gpus=1, gpu_mem_gib=10).gpu_mem_gib, 10)
    # The command's old name fails and names the new one.
    with pytest.raises(SystemExit) as exited:
        main(["plan", DIT_RECIPE])
    assert exited.value.code == 2 and "`spotlight plan` is now `spotlight memory`" in capsys.readouterr().err
