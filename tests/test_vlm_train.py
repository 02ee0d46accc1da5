"""The serial VLM GRPO loop, recipes, warm start and the `vlm` CLI, with a tiny real Qwen2.5-VL."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from spotlight.core.checkpoint import load_checkpoint
from spotlight.core.config_io import load_config
from spotlight.core.cost import read_ledger
from vlm.config import VLMRecipe, WarmStartRecipe
from vlm.driver import run_training
from vlm.policy import VLMPolicy
from vlm.warmstart import warm_start

REPO = Path(__file__).resolve().parents[1]
TASK = dict(grid_size=2, max_shapes=3, num_heldout=8)
SPEC = dict(text_hidden=32, text_layers=1, text_heads=2, vision_hidden=32, vision_depth=1, vision_heads=2)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny warm-started base: it answers in the format, so GRPO groups get reward variance."""
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
    out = tmp_path_factory.mktemp("vlm") / "base"
    summary = warm_start(cfg, out, progress=False)
    assert summary["heldout_format_rate"] > 0.5, summary
    return out


def _recipe(base: Path, *overrides: str) -> VLMRecipe:
    tiny = [
        f"model.path={base}",
        "train.prompts_per_iteration=2",
        "train.group_size=3",
        "rollout.max_new_tokens=4",
        "train.lr=1e-2",
        "log.wandb_mode=disabled",
        "train.max_minutes=0",
        "train.micro_batch_size=4",
        *[f"task.{k}={v}" for k, v in TASK.items()],
    ]
    return load_config(VLMRecipe, None, [*tiny, *overrides])


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(run_dir).tensors["trainable"]


def test_recipes_equal_the_defaults():
    tiny = load_config(VLMRecipe, REPO / "configs/vlm/tiny-count.yaml")
    assert tiny.train.refill_prompts == 16  # the recipe turns dynamic sampling on; the field's default is off
    assert not tiny.model.train_vision  # and keeps the warm start's pretrained tower frozen
    tiny.train.refill_prompts = 0
    tiny.model.train_vision = True
    assert tiny == VLMRecipe()
    assert load_config(WarmStartRecipe, REPO / "configs/vlm/tiny-warmstart.yaml") == WarmStartRecipe()
    with pytest.raises(ValueError, match="did you mean 'train.beta'"):
        load_config(VLMRecipe, None, ["train.bta=0"])


def test_a_grpo_step_changes_trained_weights_and_keeps_frozen_ones(base, tmp_path):
    run = tmp_path / "run"
    recipe = _recipe(base, "train.num_iterations=1", "model.train_vision=false", "train.adam_beta2=0.95")
    summary = run_training(recipe, run, progress=False)
    assert summary["iterations"] == 1
    assert all(tuple(g["betas"]) == (0.9, 0.95) for g in load_checkpoint(run).optimizer_state["param_groups"])
    trained = _weights(run)
    start = dict(VLMPolicy.load(base).model.named_parameters())
    assert not any(".visual." in n for n in trained)
    assert any(not torch.equal(v, start[n]) for n, v in trained.items())
    row = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert {"reward/accuracy", "grpo/loss", "grpo/kl_ref", "time/rollout_s"} <= row.keys()
    assert row["grpo/zero_variance_groups"] < 2  # some group had a signal
    assert (run / "config.yaml").is_file()
    # The run keeps a cost ledger, as DiT runs do: `spotlight cost` reads it.
    assert row["cost/usd_total"] > 0 and row["cost/gpu_s_spot"] == 0
    assert read_ledger(run)["pools"]["on_demand"]["usage"]


def test_a_second_vlm_trainer_on_one_run_dir_refuses(base, tmp_path):
    from spotlight.core.runlock import RunDirBusy, RunLock

    run = tmp_path / "run"
    with RunLock(run, "spotlight vlm train"):
        with pytest.raises(RunDirBusy, match="spotlight vlm train"):
            run_training(_recipe(base, "train.num_iterations=1"), run, progress=False)
    assert sorted(p.name for p in run.iterdir()) == [".lock"]  # the refused trainer wrote nothing


def test_lora_step_trains_only_the_adapter(base, tmp_path):
    run = tmp_path / "lora"
    run_training(_recipe(base, "train.num_iterations=1", "model.lora_rank=4", "train.beta=0.1"), run, progress=False)
    trained = _weights(run)
    assert trained and all("lora_" in n for n in trained)
    assert any(v.abs().sum() > 0 for n, v in trained.items() if "lora_B" in n)  # B starts at zero


def test_resume_is_exact(base, tmp_path):
    overrides = ("train.num_inner_epochs=2", "train.minibatch_size=4", "train.micro_batch_size=3")
    straight = tmp_path / "straight"
    run_training(_recipe(base, "train.num_iterations=2", *overrides), straight, progress=False)
    resumed = tmp_path / "resumed"
    run_training(_recipe(base, "train.num_iterations=1", *overrides), resumed, progress=False)
    run_training(_recipe(base, "train.num_iterations=2", *overrides), resumed, progress=False)
    a, b = _weights(straight), _weights(resumed)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert load_checkpoint(resumed).step == 2
    assert len((resumed / "metrics.jsonl").read_text().splitlines()) == 2
    # The run did move away from the base (the comparison above is not of two untouched models).
    start = dict(VLMPolicy.load(base).model.named_parameters())
    assert any(not torch.equal(v, start[k]) for k, v in a.items())


def test_warm_start_then_cli_eval_prints_heldout_accuracy(tmp_path):
    env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONPATH": str(REPO)}
    task = [f"task.{k}={v}" for k, v in TASK.items()]
    sizes = [f"model.{k}={v}" for k, v in SPEC.items()]
    base = tmp_path / "base"
    # `python -m spotlight.cli vlm` is the `spotlight vlm` entry point; the summary is one JSON line.
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "spotlight.cli",
            "vlm",
            "warmstart",
            "num_steps=3",
            "vision_pretrain_steps=2",
            "batch_size=4",
            *task,
            *sizes,
            "--out",
            str(base),
            "--quiet",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 3 and 0 <= summary["heldout_accuracy"] <= 1
    assert summary["loss_last"] < summary["loss_first"]
    run = tmp_path / "run"
    run_training(_recipe(base, "train.num_iterations=1"), run, progress=False)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "spotlight.cli",
            "vlm",
            "eval",
            "--checkpoint",
            str(run),
            "--json",
            f"model.path={base}",
            *task,
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["step"] == 1 and result["num_examples"] == TASK["num_heldout"] and 0 <= result["accuracy"] <= 1
    bad = subprocess.run(
        [sys.executable, "-m", "spotlight.cli", "vlm", "eval", f"model.path={tmp_path / 'missing'}"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert bad.returncode == 2 and "model.path" in bad.stderr and "missing" in bad.stderr


def test_vision_pretraining_learns_the_cells_and_the_supervised_run_keeps_the_tower(tmp_path):
    from vlm.policy import VLMPolicy
    from vlm.task import CELL_PX, corpus
    from vlm.tiny import build_tiny_vlm
    from vlm.warmstart import pretrain_vision

    cfg = load_config(
        WarmStartRecipe,
        None,
        [
            "num_steps=3",
            "vision_pretrain_steps=60",
            "batch_size=16",
            "lr=1e-2",
            *[f"task.{k}={v}" for k, v in TASK.items()],
            *[f"model.{k}={v}" for k, v in SPEC.items()],
        ],
    )
    build_tiny_vlm(tmp_path / "alone", cfg.model, corpus(cfg.task), image_px=cfg.task.grid_size * CELL_PX)
    policy = VLMPolicy.load(tmp_path / "alone")
    losses = pretrain_vision(policy, cfg)
    assert sum(losses[-5:]) / 5 < 0.5 * losses[0], losses  # the cells' colour and kind are being learnt
    pretrained = {k: v.clone() for k, v in policy.base_model.model.visual.state_dict().items()}

    summary = warm_start(cfg, tmp_path / "base", progress=False)
    saved = VLMPolicy.load(tmp_path / "base").base_model.model.visual.state_dict()
    assert summary["vision_pretrain_steps"] == 60 and summary["vision_loss_last"] < losses[0]
    # The same pretraining (same seeds), then frozen through the supervised steps.
    assert all(torch.equal(saved[k], v) for k, v in pretrained.items())


def test_vision_pretraining_needs_one_token_per_cell(tmp_path):
    from vlm.policy import VLMPolicy
    from vlm.task import CELL_PX, corpus
    from vlm.tiny import build_tiny_vlm
    from vlm.warmstart import pretrain_vision

    cfg = load_config(
        WarmStartRecipe,
        None,
        [
            "vision_pretrain_steps=1",
            *[f"task.{k}={v}" for k, v in TASK.items()],
            *[f"model.{k}={v}" for k, v in SPEC.items()],
        ],
    )
    build_tiny_vlm(tmp_path / "m", cfg.model, corpus(cfg.task), image_px=cfg.task.grid_size * CELL_PX)
    policy = VLMPolicy.load(tmp_path / "m")
    cfg.task.grid_size = 3  # images of 3 x 3 cells, but the processor was built for 2 x 2 (56 px)
    with pytest.raises(ValueError, match="one merged token per grid cell"):
        pretrain_vision(policy, cfg)


def test_skipping_the_old_pass_on_policy_changes_nothing(base):
    from spotlight.core.seeds import derive_seed
    from vlm.policy import load_policy, trainable_state
    from vlm.rollout import HFRolloutEngine
    from vlm.task import TrainStream, example_image
    from vlm.update import batched_logprobs, update

    cfg = _recipe(base, "train.beta=0")
    results = []
    for skip in (True, False):
        policy = load_policy(cfg.model)
        examples = TrainStream(cfg.task, seed=0).batch(0, 2)
        prompts = policy.encode([e.question for e in examples], [example_image(e, cfg.task) for e in examples])
        ro = HFRolloutEngine(policy).generate(prompts, 3, 4, 1.0, seed=derive_seed(0, 0))
        adv_B = torch.tensor([1.0, -1.0, 0.5, -0.5, 0.0, 0.0])
        with torch.no_grad():
            old = None if skip else batched_logprobs(policy, ro, 1.0, 4)
        optimizer = torch.optim.AdamW([p for p in policy.model.parameters() if p.requires_grad], lr=1e-2)
        before = {k: v.clone() for k, v in trainable_state(policy).items()}
        update(policy, optimizer, ro, adv_B, old, None, cfg, 0)
        results.append({k: v.clone() for k, v in trainable_state(policy).items()})
    skipped, computed = results
    assert any(not torch.equal(before[k], computed[k]) for k in before)
    assert all(torch.allclose(skipped[k], computed[k], atol=1e-6) for k in skipped)


def test_lr_warmup_ramps_and_resumes_from_the_optimizer_state(base):
    """train.lr_warmup_steps: step k (from 1) at lr * min(1, k / W); an optimizer loading the state
    continues the ramp. 6 rows in minibatches of 2: 3 optimizer steps per update."""
    from spotlight.core.seeds import derive_seed
    from vlm.policy import load_policy
    from vlm.rollout import HFRolloutEngine
    from vlm.task import TrainStream, example_image
    from vlm.update import update

    cfg = _recipe(
        base,
        "train.beta=0",
        "train.lr=1e-3",
        "train.lr_warmup_steps=4",
        "train.minibatch_size=2",
        "train.micro_batch_size=2",
    )
    policy = load_policy(cfg.model)
    examples = TrainStream(cfg.task, seed=0).batch(0, 2)
    prompts = policy.encode([e.question for e in examples], [example_image(e, cfg.task) for e in examples])
    ro = HFRolloutEngine(policy).generate(prompts, 3, 4, 1.0, seed=derive_seed(0, 0))
    adv_B = torch.tensor([1.0, -1.0, 0.5, -0.5, 0.3, -0.3])
    params = [p for p in policy.model.parameters() if p.requires_grad]

    def lrs_of_an_update(optimizer) -> list[float]:
        seen, step = [], optimizer.step
        optimizer.step = lambda *a, **k: (seen.append(optimizer.param_groups[0]["lr"]), step(*a, **k))[1]
        update(policy, optimizer, ro, adv_B, None, None, cfg, 0)
        return seen

    first = torch.optim.AdamW(params, lr=cfg.train.lr)
    assert lrs_of_an_update(first) == pytest.approx([0.25e-3, 0.5e-3, 0.75e-3])
    resumed = torch.optim.AdamW(params, lr=cfg.train.lr)
    resumed.load_state_dict(first.state_dict())
    assert lrs_of_an_update(resumed) == pytest.approx([1e-3, 1e-3, 1e-3])  # steps 4-6: the ramp is over
    with pytest.raises(ValueError, match="train.lr_warmup_steps must be >= 0"):
        load_config(VLMRecipe, None, ["train.lr_warmup_steps=-1"])


def test_dropping_flat_groups_updates_only_groups_with_signal(base, tmp_path):
    run = tmp_path / "drop"
    run_training(
        _recipe(base, "train.num_iterations=2", "train.drop_flat_groups=true", "train.prompts_per_iteration=4"),
        run,
        progress=False,
    )
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        assert row["grpo/rows_updated"] == (4 - row["grpo/zero_variance_groups"]) * 3


def test_refill_replaces_flat_groups_with_extra_prompts(base, tmp_path):
    run = tmp_path / "refill"
    run_training(_recipe(base, "train.num_iterations=2", "train.refill_prompts=4"), run, progress=False)
    for row in [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]:
        with_signal = 6 - row["grpo/zero_variance_groups"]  # of the P + refill = 6 groups rolled out
        assert row["grpo/rows_updated"] == min(2, with_signal) * 3


def test_new_train_fields_default_off_and_are_validated():
    tc = VLMRecipe().train
    assert tc.clip_range_high == 0.0 and tc.refill_prompts == 0
    with pytest.raises(ValueError, match="clip_range_high"):
        load_config(VLMRecipe, None, ["train.clip_range_high=-0.1"])
    with pytest.raises(ValueError, match="refill_prompts"):
        load_config(VLMRecipe, None, ["train.refill_prompts=-1"])
    assert tc.adam_beta2 == 0.999  # AdamW's own default: unchanged behaviour
    with pytest.raises(ValueError, match="train.adam_beta2 must be in \\(0, 1\\), got 1.0"):
        load_config(VLMRecipe, None, ["train.adam_beta2=1.0"])


@pytest.mark.parametrize("schedule", ["serial", "rollplex"])
def test_the_learning_rate_cools_down_over_the_end_of_the_run(base, tmp_path, schedule):
    # The DiT trainer's cooldown (spotlight.core.optim.run_cooldown_scale). A host that finishes
    # num_iterations well within the time budget cools down over the last lr_cooldown of the
    # iterations: progress after iteration k of 4 is k/4, so with lr_cooldown 0.5 and floor 0.1
    # the factors are 1, 1, 0.55, 0.1, and the last optimizer step ran at a tenth of train.lr.
    run = tmp_path / "run"
    recipe = _recipe(
        base, "train.num_iterations=4", "train.max_minutes=60", "train.lr_cooldown=0.5", f"train.schedule={schedule}"
    )
    run_training(recipe, run, progress=False)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["grpo/lr_scale"] for r in rows] == pytest.approx([1.0, 1.0, 0.55, 0.1])
    groups = load_checkpoint(run).optimizer_state["param_groups"]
    assert all(g["lr"] == pytest.approx(1e-2 * 0.1) for g in groups)
    # Without a time budget there is no cooldown (and no metric for it).
    plain = tmp_path / "plain"
    run_training(_recipe(base, "train.num_iterations=2", "train.lr_cooldown=0.5"), plain, progress=False)
    assert all("grpo/lr_scale" not in json.loads(line) for line in (plain / "metrics.jsonl").read_text().splitlines())
    assert all(g["lr"] == pytest.approx(1e-2) for g in load_checkpoint(plain).optimizer_state["param_groups"])
    with pytest.raises(ValueError, match="train.lr_cooldown"):
        load_config(VLMRecipe, None, ["train.lr_cooldown=1.0"])


def test_max_minutes_stops_before_the_iteration_that_would_overrun(base, tmp_path):
    run = tmp_path / "run"
    minutes = 0.1  # 6 s: a few tiny iterations, far fewer than the 500 asked for
    summary = run_training(
        _recipe(base, "train.num_iterations=500", f"train.max_minutes={minutes}"), run, progress=False
    )
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert 1 <= summary["iterations"] == len(rows) < 500
    assert load_checkpoint(run).step == len(rows)  # the last iteration done is checkpointed
    # Its iterations fit the budget (one second of slack for a noisy machine).
    assert sum(r["time/iteration_s"] for r in rows) <= 60 * minutes + 1.0
