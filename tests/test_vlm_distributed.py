"""Data-parallel VLM training (vlm.driver with spotlight.core.distributed): 2 real gloo processes against 1.

The end-to-end test launches `spotlight vlm train` with `accelerate launch` and the shipped 2-process
CPU config, for both schedules, and compares it with a single process on the same global batch and
seeds. The update of a rank that holds none of the update's rows (its groups were all flat) is
tested on its own with `torch.multiprocessing.spawn`.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from launch import cpu_fsdp_config, free_port, launch

from spotlight.cli import main
from spotlight.core.checkpoint import load_checkpoint
from spotlight.core.config_io import load_config
from spotlight.core.distributed import DataParallel
from spotlight.core.tracking import read_metrics
from vlm.config import VLMRecipe, WarmStartRecipe

TASK = dict(grid_size=2, max_shapes=3, num_heldout=8)
CPU_2PROC = "configs/accelerate/cpu-2proc.yaml"
SPEC = dict(text_hidden=32, text_layers=1, text_heads=2, vision_hidden=32, vision_depth=1, vision_heads=2)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny warm-started Qwen2.5-VL that answers in the format, so groups get reward variance."""
    from vlm.warmstart import warm_start

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
    out = tmp_path_factory.mktemp("vlm-dp") / "base"
    warm_start(cfg, out, progress=False)
    return out


def dp_overrides(base: Path, iterations: int) -> list[str]:
    """3 groups of 4: rank 0 holds rows 0-5 and rank 1 rows 6-11, so the middle group spans both
    ranks; 2 epochs of minibatches of 4 (old log-probs, several optimizer steps, minibatches that mix
    ranks), micro-batches of 3. rollout.batch_size=6 makes the one-process rollout run the same
    generate calls as the ranks, so the responses agree token for token and the comparison isolates
    the scoring and the update. lr 1e-4 as in the DiT test (see the tolerances below).
    """
    return [
        f"model.path={base}",
        "train.prompts_per_iteration=3",
        "train.group_size=4",
        "rollout.max_new_tokens=4",
        "rollout.batch_size=6",
        "train.num_inner_epochs=2",
        "train.minibatch_size=4",
        "train.micro_batch_size=3",
        "train.lr=1e-4",
        "train.num_threads=1",
        "train.max_minutes=0",
        f"train.num_iterations={iterations}",
        "log.wandb_mode=disabled",
        "log.checkpoint_every=2",
        *[f"task.{k}={v}" for k, v in TASK.items()],
    ]


@pytest.mark.parametrize(
    "schedule, extra, interrupted",
    [("rollplex", [], True), ("serial", ["train.drop_flat_groups=true", "eval.every=3"], False)],
    ids=["rollplex-resumed", "serial-drop-flat"],
)
def test_two_processes_match_one(base, tmp_path, schedule, extra, interrupted):
    """2 ranks == 1 process for 3 iterations, up to rounding; rollplex interrupted after 2 and resumed.

    Tolerances: the ranks score each minibatch in other micro-batches, the response widths differ
    (each rank's rollout is as long as its own longest response) and the gradients are summed in
    another order, so log-probs, losses and gradients differ by float32 rounding (measured: metrics
    at most 1.7e-7 (rollplex) and 1.4e-6 (serial, a grad norm of 2.2) absolute; the largest relative
    gaps are on small values: 5e-5 on a loss of 1.8e-3 (9e-8 absolute), 1.3e-5 on a KL of 2e-4;
    weights 1.5e-7 after 6 AdamW steps). Metrics: rtol 1e-4, with atol 1e-6 for near-zero means of
    O(1) terms (the surrogate averages -A * ratio with zero-mean advantages and ratio ~ 1). Weights: atol 1e-6, 1%
    of one lr=1e-4 AdamW step; Adam divides by sqrt(v), so a gradient entry that is rounding noise
    (the key biases get none in exact arithmetic: softmax ignores a per-query constant) moves by up to
    lr whatever its size, and a relative gradient error d moves a weight by about lr * d per step.
    """
    one, two = tmp_path / "one", tmp_path / "two"
    args = [*dp_overrides(base, 3), f"train.schedule={schedule}", *extra]
    threads = torch.get_num_threads()
    try:  # torchrun gives each rank one thread; the reference runs with one too (train.num_threads)
        assert main(["vlm", "train", *args, "--run-dir", str(one), "--quiet"]) == 0
    finally:
        torch.set_num_threads(threads)

    if interrupted:
        proc = launch(
            CPU_2PROC,
            "vlm",
            "train",
            *dp_overrides(base, 2),
            f"train.schedule={schedule}",
            *extra,
            "--run-dir",
            str(two),
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "data parallel: 2 processes on cpu, 6 of 12 samples on rank 0" in proc.stdout
    proc = launch(CPU_2PROC, "vlm", "train", *args, "--run-dir", str(two))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "data parallel: 2 processes on cpu, 6 of 12 samples on rank 0" in proc.stdout
    if interrupted:
        assert proc.stdout.count("resuming from") == 1 and "(iteration 2)" in proc.stdout

    # Only rank 0 wrote: one metrics row per iteration, the files and checkpoints of one process.
    rows_one, rows_two = read_metrics(one), read_metrics(two)
    assert [r["step"] for r in rows_two] == [1, 2, 3]
    assert sorted(os.listdir(two)) == sorted(os.listdir(one))
    assert sorted(os.listdir(two / "checkpoints")) == sorted(os.listdir(one / "checkpoints"))
    assert any(r["grpo/zero_variance_groups"] < 3 for r in rows_one)  # some group had a signal
    if "eval.every=3" in extra:  # split over the 2 ranks, gathered: the one-process figure
        assert "eval/accuracy" in rows_two[2]
    assert_same_run(one, two, base, lora=False)


def assert_same_run(one: Path, two: Path, base: Path, *, lora: bool) -> None:
    """Run `two` ended where run `one` did: every metric but times and costs (rtol 1e-4, atol 1e-6), the
    final trainable weights and AdamW moments (atol 1e-6); and the weights moved from the base."""
    rows_one, rows_two = read_metrics(one), read_metrics(two)
    for a, b in zip(rows_one, rows_two, strict=True):
        assert a.keys() == b.keys()
        for key, value in a.items():
            if not key.startswith(("time/", "cost/")):  # wall time, and the GPU-seconds charged for it
                assert b[key] == pytest.approx(value, rel=1e-4, abs=1e-6), (a["step"], key)
    ckpt_one, ckpt_two = load_checkpoint(one), load_checkpoint(two)
    assert ckpt_one.step == ckpt_two.step == 3
    w_one, w_two = ckpt_one.tensors["trainable"], ckpt_two.tensors["trainable"]
    assert w_one.keys() == w_two.keys()
    for key, value in w_one.items():
        torch.testing.assert_close(w_two[key], value, rtol=0, atol=1e-6, msg=key)
    s_one, s_two = ckpt_one.optimizer_state, ckpt_two.optimizer_state
    assert s_two["state"].keys() == s_one["state"].keys()
    for i, s in s_one["state"].items():
        torch.testing.assert_close(s_two["state"][i]["exp_avg"], s["exp_avg"], rtol=0, atol=1e-6)
    # The weights moved: the comparison is not between two untrained models.
    if lora:
        assert any(v.abs().max() > 0 for k, v in w_two.items() if "lora_B" in k)
    else:
        from vlm.policy import VLMPolicy

        start = dict(VLMPolicy.load(base).model.named_parameters())
        assert any(not torch.equal(start[k], v) for k, v in w_two.items())


# -- a rank that holds none of the update's rows ------------------------------------------------


def _update_first_group_only(dp: DataParallel, base: str, schedule: str) -> list[list[torch.Tensor]]:
    """One iteration of 2 prompts x 3 samples where only prompt 0's group reaches the update (as if
    prompt 1's were flat under drop_flat_groups): on 2 ranks, rank 1 rolls out prompt 1 and then
    holds none of the update's rows. Returns the gradients each optimizer step saw.
    """
    from vlm.driver import make_schedule
    from vlm.policy import load_policy
    from vlm.rollout import HFRolloutEngine, prompts_of
    from vlm.task import TrainStream, example_image
    from vlm.update import Reference, UpdateShard

    P, G = 2, 3
    cfg = load_config(
        VLMRecipe,
        None,
        [
            f"model.path={base}",
            f"train.prompts_per_iteration={P}",
            f"train.group_size={G}",
            "rollout.max_new_tokens=4",
            "train.num_inner_epochs=2",
            "train.minibatch_size=2",
            "train.micro_batch_size=1",
            "train.beta=0.1",
            "log.wandb_mode=disabled",
            *[f"task.{k}={v}" for k, v in TASK.items()],
        ],
    )
    policy = load_policy(cfg.model)
    params = [p for p in policy.model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    grads: list[list[torch.Tensor]] = []
    optimizer.register_step_pre_hook(lambda *_: grads.append([p.grad.clone() for p in params]))
    sched = make_schedule(schedule, policy, HFRolloutEngine(policy), Reference(policy, cfg.train.beta), optimizer, cfg)
    examples = TrainStream(cfg.task, seed=0).batch(0, P)
    prompts = policy.encode([e.question for e in examples], [example_image(e, cfg.task) for e in examples])
    lo, hi = dp.shard(P * G)
    ro = sched.rollout(prompts.select(list(prompts_of(range(lo, hi), G))), seed=5, rows=range(lo, hi))
    rows = [0, 1, 2]
    local = [r for r in rows if lo <= r < hi]
    batch = ro.select([r - lo for r in local]) if local else None
    ref = sched.reference_logprobs(batch, local) if batch is not None else None
    old = sched.old_logprobs(batch, local) if batch is not None else None
    shard = UpdateShard(dp, 0, dp.all_gather_rows(ro.response_mask_BT.sum(dim=1))[rows])
    adv_B = torch.tensor([1.0, -0.6, -0.4, 0.0, 0.0, 0.0])
    sched.update(batch, local, adv_B[local], old, ref, 0, shard=shard)
    sched.close()
    return grads


def _empty_rank(rank: int, world_size: int, port: int, base: str, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    dp = DataParallel(rank=rank, world_size=world_size)
    results = {s: _update_first_group_only(dp, base, s) for s in ("serial", "rollplex")}
    torch.save(results, f"{out}/{rank}.pt")
    dist.destroy_process_group()


def test_a_rank_without_rows_of_the_update_adds_nothing_and_steps_with_the_others(base, tmp_path):
    """Each optimizer step's summed gradient equals the one-process gradient on every rank
    (rounding: 1e-6 on gradients of norm ~1), though rank 1 scored none of the rows."""
    mp.spawn(_empty_rank, args=(2, free_port(), str(base), str(tmp_path)), nprocs=2)
    ranks = [torch.load(tmp_path / f"{r}.pt") for r in range(2)]
    for schedule in ("serial", "rollplex"):
        reference = _update_first_group_only(DataParallel(), str(base), schedule)
        assert len(reference) == 4  # 2 epochs x 2 minibatches of the 3 rows
        assert any(g.abs().max() > 1e-3 for g in reference[0])
        for result in ranks:
            assert len(result[schedule]) == len(reference)
            for step_a, step_b in zip(reference, result[schedule]):
                assert max((a - b).abs().max().item() for a, b in zip(step_a, step_b)) <= 1e-6, schedule


def _split_eval(rank: int, world_size: int, port: int, base: str, out: str) -> None:
    import torch.distributed as dist

    from vlm.config import TaskConfig
    from vlm.evaluate import evaluate
    from vlm.policy import VLMPolicy
    from vlm.task import heldout_examples

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    task = TaskConfig(**TASK)
    summary = evaluate(
        VLMPolicy.load(base),
        task,
        examples=heldout_examples(task)[:7],
        batch_size=2,
        dp=DataParallel(rank=rank, world_size=world_size),
    )
    torch.save(summary, f"{out}/{rank}.pt")
    dist.destroy_process_group()


def test_the_heldout_eval_is_split_over_ranks_and_gathered(base, tmp_path):
    """2 ranks decode 3 and 4 of 7 examples; both return the one-process summary of all 7."""
    from vlm.config import TaskConfig
    from vlm.evaluate import evaluate
    from vlm.policy import VLMPolicy
    from vlm.task import heldout_examples

    mp.spawn(_split_eval, args=(2, free_port(), str(base), str(tmp_path)), nprocs=2)
    task = TaskConfig(**TASK)
    reference = evaluate(VLMPolicy.load(base), task, examples=heldout_examples(task)[:7], batch_size=2)
    assert 0 < reference["format_rate"]  # the base answers in the format: the scores are not all zero
    for rank in range(2):
        summary = torch.load(tmp_path / f"{rank}.pt")
        assert summary["num_examples"] == 7
        for key, value in reference.items():
            if key.startswith("accuracy") or key == "format_rate":
                assert summary[key] == value, (rank, key)
    # Each rank decoded its own slice: its samples are the first examples of that slice.
    examples = heldout_examples(task)[:7]
    assert torch.load(tmp_path / "0.pt")["samples"][0]["question"] == examples[0].question
    assert torch.load(tmp_path / "1.pt")["samples"][0]["question"] == examples[3].question


# -- FSDP ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "variant",
    [
        # Full fine-tuning with the KL term: the reference is each rank's shards swapped in.
        ["train.beta=0.1"],
        # LoRA (peft's wrapper around the sharded model; its `generate` bypasses the wrapper), no KL.
        ["model.lora_rank=4", "train.lr=1e-3", "train.beta=0.0"],
    ],
    ids=["full-kl", "lora"],
)
def test_fsdp_two_processes_match_one_and_resume(base, tmp_path, variant):
    """FSDP on 2 ranks (serial schedule, flat groups dropped; interrupted after iteration 2,
    resumed) == 1 process for 3 iterations.

    What FSDP adds is exercised here: the model is sharded (each rank holds half the parameters),
    the rollout decodes with synced_gpus, a rank with fewer micro-batches of a minibatch (or none
    of the update's rows) runs zero-weight ones, activation checkpointing is on (the shipped file),
    the held-out eval runs on both ranks, and the checkpoint is gathered to the one-process layout
    and loaded back into the shards. Tolerances as in test_two_processes_match_one (measured:
    metrics 7e-7 absolute, weights 3e-8 (full) and 2.6e-7 (LoRA, lr 1e-3)).
    """
    one, two = tmp_path / "one", tmp_path / "two"
    extra = ["train.schedule=serial", "train.drop_flat_groups=true", "eval.every=3", *variant]
    env = dict(os.environ, WANDB_MODE="offline", OMP_NUM_THREADS="1")
    # The reference in a fresh process (a LoRA adapter's init follows train.seed in every process).
    cmd = [
        sys.executable,
        "-m",
        "spotlight.cli",
        "vlm",
        "train",
        *dp_overrides(base, 3),
        *extra,
        "--run-dir",
        str(one),
        "--quiet",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    config = cpu_fsdp_config(tmp_path / "fsdp.yaml")
    proc = launch(config, "vlm", "train", *dp_overrides(base, 2), *extra, "--run-dir", str(two))
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = re.search(r"fsdp: model sharded over 2 ranks, local parameters \[(\d+), (\d+)\] of (\d+)", proc.stdout)
    assert found, proc.stdout[-2000:]
    local0, local1, full = map(int, found.groups())
    assert local0 + local1 == full and abs(local0 - full / 2) <= 0.01 * full, (local0, local1, full)
    proc = launch(config, "vlm", "train", *dp_overrides(base, 3), *extra, "--run-dir", str(two))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("resuming from") == 1 and "(iteration 2)" in proc.stdout

    rows_one, rows_two = read_metrics(one), read_metrics(two)
    assert [r["step"] for r in rows_two] == [1, 2, 3]
    assert "eval/accuracy" in rows_two[2]
    assert any(0 < r["grpo/rows_updated"] < 12 for r in rows_one), "no flat group was dropped"
    assert_same_run(one, two, base, lora="model.lora_rank=4" in variant)


def test_fsdp_refuses_the_rollplex_schedule(base, tmp_path):
    config = cpu_fsdp_config(tmp_path / "fsdp.yaml")
    proc = launch(
        config,
        "vlm",
        "train",
        *dp_overrides(base, 1),
        "train.schedule=rollplex",
        "--run-dir",
        str(tmp_path / "run"),
        timeout=120,
    )
    assert proc.returncode != 0
    assert "train.schedule=rollplex does not run under FSDP" in proc.stderr + proc.stdout
