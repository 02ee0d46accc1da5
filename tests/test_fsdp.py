"""FSDP (spotlight.parallel.fsdp.shard_transformer): 2 real gloo processes with a sharded transformer
against 1 process.

The trainer is launched with the real `accelerate launch` and an FSDP config (`distributed_type:
FSDP`, FSDP2, full shard, activation checkpointing), the shipped configs/accelerate/fsdp.yaml with
2 processes and no mixed precision: accelerate starts FSDP launches through torchrun whatever the
hardware, and exports the `FSDP_*` variables the trainer reads; without a GPU the processes run
gloo on the CPU. bf16 mixed precision is left out here: it would change the numbers (the
comparison is against a float32 single process), not the code path of the collectives.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from launch import cpu_fsdp_config, launch

from spotlight.core.checkpoint import load_checkpoint
from spotlight.core.distributed import FSDPSettings
from spotlight.core.tracking import read_metrics

REPO = Path(__file__).resolve().parents[1]


def fsdp_overrides(model_dir: Path, iterations: int) -> list[str]:
    """3 groups of 3: 9 samples, 4 on rank 0 and 5 on rank 1, so rank 0 pads its rollout with one
    sample to run as many forwards as rank 1 (sample.batch_size=1: one chunk per sample, so the
    padding does not change the other samples' numbers). Minibatches of 2 out of 9 samples: many of
    them hold samples of one rank only, and the other rank runs its zero-weight row. The held-out
    eval (3 prompts x 1 seed) is split 1 and 2, so rank 0 pads its slice too.
    """
    return [
        f"model.path={model_dir}",
        "model.height=32",
        "model.width=32",
        "sample.num_steps=3",
        "sample.eval_num_steps=3",
        "sample.batch_size=1",
        f"train.num_iterations={iterations}",
        "train.prompts_per_iteration=3",
        "train.group_size=3",
        "train.minibatch_size=2",
        "train.num_threads=1",
        "train.ema_decay=0",
        # Runs are stopped after 2 iterations by asking for 2; the cooldown follows num_iterations.
        "train.lr_cooldown=0",
        "reward.weights.shapes=0.0",
        "reward.weights.jpeg_compressibility=1.0",
        "log.checkpoint_every=2",
        "log.images_every=2",
        "eval.every=3",
        "eval.num_seeds=1",
        "data.num_heldout=3",
    ]


@pytest.mark.parametrize(
    "variant",
    [
        # DiffusionNFT with a LoRA adapter: the old-policy forward swaps in cloned shards; peft's
        # checkpoint keys are mapped to the sharded model's names. The moving average of the
        # weights is kept shard by shard, swapped in for the held-out eval, gathered and resumed.
        ["model.lora_rank=4", "train.ema_decay=0.5"],
        # Flow-GRPO, full fine-tuning, KL to the base weights: the reference is a clone of the shards.
        ["train.objective=flow_grpo", "sample.noise_level=1.2", "train.beta=0.01"],
    ],
    ids=["nft-lora", "flow_grpo-kl"],
)
def test_fsdp_two_processes_match_one_and_resume(tiny_model_dir, tmp_path, variant):
    """FSDP on 2 ranks (interrupted after iteration 2, resumed) == 1 process for 3 iterations.

    Tolerances as in test_distributed.py (rounding: sub-batch losses, gradients summed in another
    order, the global norm reduced from shard norms): metrics rtol 1e-4 / atol 1e-6, final weights
    atol 1e-6.
    """
    one, two = tmp_path / "one", tmp_path / "two"
    config = cpu_fsdp_config(tmp_path / "cpu-fsdp.yaml")
    # The reference in a fresh process (a LoRA adapter's init follows train.seed in every process).
    env = dict(os.environ, WANDB_MODE="offline", OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        "-m",
        "spotlight.cli",
        "train",
        *fsdp_overrides(tiny_model_dir, 3),
        *variant,
        "--run-dir",
        str(one),
        "--quiet",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]

    proc = launch(config, "train", *fsdp_overrides(tiny_model_dir, 2), *variant, "--run-dir", str(two))
    assert proc.returncode == 0, proc.stderr[-3000:]
    # The parameters were sharded: each rank held half of the transformer's (rows split 2 ways).
    found = re.search(
        r"fsdp: transformer sharded over 2 ranks, local parameters \[(\d+), (\d+)\] of (\d+)", proc.stdout
    )
    assert found, proc.stdout[-2000:]
    local0, local1, full = map(int, found.groups())
    assert local0 + local1 == full and abs(local0 - full / 2) <= 0.01 * full, (local0, local1, full)
    proc = launch(config, "train", *fsdp_overrides(tiny_model_dir, 3), *variant, "--run-dir", str(two))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming from" in proc.stdout and "(iteration 2)" in proc.stdout

    rows_one, rows_two = read_metrics(one), read_metrics(two)
    assert [r["step"] for r in rows_two] == [1, 2, 3]
    assert "eval/mean_reward" in rows_two[2]
    for a, b in zip(rows_one, rows_two):
        assert a["grpo/num_trained_samples"] == b["grpo/num_trained_samples"] == 9
        for key, value in a.items():
            if not key.startswith(("time/", "cost/")) and key != "eval/seconds":
                assert b[key] == pytest.approx(value, rel=1e-4, abs=1e-6), (a["step"], key)
    # The checkpoint is the one-process layout: same keys, same optimizer state layout.
    ckpt_one, ckpt_two = load_checkpoint(one), load_checkpoint(two)
    assert ckpt_one.step == ckpt_two.step == 3
    assert ckpt_two.tensors["trainable"].keys() == ckpt_one.tensors["trainable"].keys()
    assert ckpt_two.tensors.keys() == ckpt_one.tensors.keys()
    assert ("ema" in ckpt_two.tensors) == ("train.ema_decay=0.5" in variant)
    for group in ckpt_one.tensors:  # "trainable", and "ema" with train.ema_decay
        for key, value in ckpt_one.tensors[group].items():
            torch.testing.assert_close(ckpt_two.tensors[group][key], value, rtol=0, atol=1e-6, msg=f"{group} {key}")
    state_one, state_two = ckpt_one.optimizer_state, ckpt_two.optimizer_state
    assert state_two["state"].keys() == state_one["state"].keys()
    assert [g["params"] for g in state_two["param_groups"]] == [g["params"] for g in state_one["param_groups"]]
    for i, s in state_one["state"].items():
        torch.testing.assert_close(state_two["state"][i]["exp_avg"], s["exp_avg"], rtol=0, atol=1e-6)
    # The weights moved: the comparison is not between two untrained models.
    assert (
        any(v.abs().max() > 0 for k, v in ckpt_two.tensors["trainable"].items() if "lora_B" in k)
        or "model.lora_rank=4" not in variant
    )
    from safetensors.torch import load_file

    base = load_file(next((tiny_model_dir / "transformer").glob("*.safetensors")))
    assert (
        any(not torch.equal(base[k], v) for k, v in ckpt_two.tensors["trainable"].items() if k in base)
        or "model.lora_rank=4" in variant
    )


def test_fsdp_launch_with_fsdp_version_1_is_refused(monkeypatch):
    """accelerate's default fsdp_version is 1: refused, naming the setting."""
    from spotlight.core.distributed import init_data_parallel

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "1")
    with pytest.raises(ValueError, match="fsdp_version: 2"):
        init_data_parallel()


def test_fsdp_settings_from_accelerate_environment():
    """The variables `accelerate launch` exports for configs/accelerate/fsdp.yaml, and the refusals."""
    env = {
        "FSDP_VERSION": "2",
        "FSDP_RESHARD_AFTER_FORWARD": "true",
        "FSDP_ACTIVATION_CHECKPOINTING": "true",
        "FSDP_TRANSFORMER_CLS_TO_WRAP": "QwenImageTransformerBlock",
        "FSDP_OFFLOAD_PARAMS": "false",
        "ACCELERATE_MIXED_PRECISION": "bf16",
    }
    s = FSDPSettings.from_env(env)
    assert (s.block_classes, s.reshard_after_forward, s.activation_checkpointing, s.bf16) == (
        ("QwenImageTransformerBlock",),
        True,
        True,
        True,
    )
    assert not FSDPSettings.from_env(
        {**env, "FSDP_RESHARD_AFTER_FORWARD": "false", "ACCELERATE_MIXED_PRECISION": "no"}
    ).bf16
    with pytest.raises(ValueError, match="fsdp_version: 2"):
        FSDPSettings.from_env({**env, "FSDP_VERSION": "1"})
    with pytest.raises(ValueError, match="fsdp_offload_params"):
        FSDPSettings.from_env({**env, "FSDP_OFFLOAD_PARAMS": "true"})
    with pytest.raises(ValueError, match="fp16"):
        FSDPSettings.from_env({**env, "ACCELERATE_MIXED_PRECISION": "fp16"})


@pytest.mark.parametrize("mode", ["inline", "stale"])
def test_fsdp_explorers_sample_with_the_gathered_full_weights(tiny_model_dir, ray_address, tmp_path, monkeypatch, mode):
    """FSDP + Ray exploration: rank 0 publishes the weights every rank gathered, whole.

    2 FSDP ranks explore on a local Ray cluster (2 spot nodes). Each explored candidate's reward,
    as the run logged it, is then recomputed here by an in-process `DiTRunner` (the runtime
    workers' runner, no Ray here) loaded with the checkpoint of the weights version the run
    says it explored with: it must agree, and must not agree with the untrained weights (so an
    explorer left with its initial weights, or sent one rank's shards, would fail). Inline
    mode explores every batch after the first before its rollout, so it always has rows to check;
    stale mode's windows may all come back late under CPU load, so there the run itself is the
    check (the gather before each update is a collective every rank joins, or the run hangs).
    """
    from spotlight.config import DiTRecipe
    from spotlight.core.checkpoint import load_checkpoint
    from spotlight.core.config_io import load_config
    from spotlight.core.seeds import derive_seed
    from spotlight.driver import plan_iteration
    from spotlight.explore import LOG_FILE
    from spotlight.jobs import DiTRunner
    from spotlight.policy import trainable_state
    from spotlight.prompts import train_and_eval_prompts
    from spotlight.seed_selection import ExploreJob

    run = tmp_path / "run"
    overrides = [
        *fsdp_overrides(tiny_model_dir, 3),
        "train.lr=1e-3",
        "log.checkpoint_every=1",
        "log.keep_last=3",
        f"explore.mode={mode}",
        f"runtime.ray_address={ray_address}",
        "explore.planner=uniform",
        "explore.max_candidates=6",
        "explore.budget_fraction=1.0",
        "explore.batch_size=4",
    ]
    config = cpu_fsdp_config(tmp_path / "cpu-fsdp.yaml")
    proc = launch(config, "train", *overrides, "--run-dir", str(run), timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "spot group(s) explore" in proc.stdout and "fsdp: transformer sharded over 2 ranks" in proc.stdout
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3]

    cfg = load_config(DiTRecipe, run / "config.yaml")
    train_prompts, _ = train_and_eval_prompts(cfg.data, cfg.reward.weights)
    runner = DiTRunner(cfg)
    base = {k: v.clone() for k, v in trainable_state(runner.policy).items()}

    def explore(job: ExploreJob):
        state = runner.start(job, 0, None)
        while not runner.finished(state):
            state = runner.advance(state)
        return runner.output(state)

    rows = [json.loads(line) for line in (run / LOG_FILE).read_text().splitlines()]
    checked = 0
    for row in rows:
        if row["version"] is None:
            continue
        k, version = row["iteration"], row["version"]
        assert version == (k if mode == "inline" else k - 1)
        slots, cands = [], []
        for p, slot in enumerate(row["slots"]):
            done = [c for c, r in zip(slot["candidates"], slot["stale_rewards"]) if r is not None]
            slots += [p] * len(done)
            cands += done
        prompts = [row["slots"][p]["prompt"] for p in slots]
        job = ExploreJob(
            iteration=k,
            version=version,
            prompts=prompts,
            slots=slots,
            candidates=cands,
            seeds=[derive_seed(cfg.train.seed, k, p, c) for p, c in zip(slots, cands)],
            sde_steps=plan_iteration(cfg, train_prompts, k)[2],
        )
        logged = [r for slot in row["slots"] for r in slot["stale_rewards"] if r is not None]
        # Version v is the weights after v updates: the checkpoint of step v (v = 0: the base model).
        runner.load_weights(version, base)
        with_base = explore(job).rewards
        if version > 0:
            runner.load_weights(
                version, load_checkpoint(run / "checkpoints" / f"step-{version:08d}").tensors["trainable"]
            )
        with_version = explore(job).rewards
        # JPEG sizes of uint8 images: a pixel may round the other way (sharded vs whole summation).
        assert with_version == pytest.approx(logged, rel=1e-3), (k, version)
        if version > 0:
            assert with_base != pytest.approx(logged, rel=1e-3), "the trained weights do not change the rewards"
        checked += len(logged)
    if mode == "inline":
        assert checked > 0, "inline exploration never ran"
    # The weights were gathered for exactly the windows that had candidates (once each).
    copies = {r["step"] - 1: r["explore/weights_copies"] for r in read_metrics(run)}
    planned = {row["iteration"] for row in rows if any(slot["planned"] for slot in row["slots"])}
    opened = {k if mode == "inline" else k - 1 for k in planned}  # the iteration that gathered for batch k
    assert opened or mode == "stale"
    assert {k for k, n in copies.items() if n} == opened
    assert set(copies.values()) <= {0, 1}


def test_fsdp_gathers_no_weights_when_nothing_is_planned(tiny_model_dir, ray_address, tmp_path):
    """With a budget below one group the planner gives the explorers nothing, so no rank gathers
    the weights; the ranks still agree on every collective (the run would hang otherwise)."""
    run = tmp_path / "run"
    overrides = [
        *fsdp_overrides(tiny_model_dir, 3),
        f"runtime.ray_address={ray_address}",
        "explore.mode=stale",
        "explore.budget_fraction=1e-6",
    ]
    proc = launch(cpu_fsdp_config(tmp_path / "cpu-fsdp.yaml"), "train", *overrides, "--run-dir", str(run), timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "spot group(s) explore" in proc.stdout and "fsdp: transformer sharded over 2 ranks" in proc.stdout
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["explore/weights_copies"] for r in rows] == [0, 0, 0]
