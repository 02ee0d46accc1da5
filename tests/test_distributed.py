"""Data-parallel training (spotlight.core.distributed): 2 real gloo processes (on one machine, and as
two machines of one process each) against 1 process.

The end-to-end test launches the trainer with `accelerate launch` and the shipped 2-process CPU
config, and compares it with a single process on the same global batch and seeds (explore mode
"none"). The collectives are also tested on their own, with `torch.multiprocessing.spawn`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from launch import free_port, launch, launch_machines

from spotlight.cli import main
from spotlight.core.checkpoint import load_checkpoint
from spotlight.core.distributed import DataParallel
from spotlight.core.tracking import read_metrics

CPU_2PROC = "configs/accelerate/cpu-2proc.yaml"


def dp_overrides(model_dir: Path, iterations: int) -> list[str]:
    """The tiny recipe with 3 groups of 4: rank 0 holds samples 0-5 and rank 1 samples 6-11, so the
    middle group spans both ranks, and every minibatch of 4 mixes ranks.

    The JPEG reward is continuous, so every group carries signal (the shapes reward of a random tiny
    model is 0 for nearly every sample, which would leave nothing to train). sample.batch_size=2
    makes the one-process rollout run the same forward chunks as the ranks, so rollouts and rewards
    agree exactly and the comparison isolates the update. lr 1e-4 without warm-up: the tolerances
    below are sized to one such step. No end-of-run cooldown: the tests stop a run after 2
    iterations by asking for 2, and the cooldown follows num_iterations.
    """
    return [
        f"model.path={model_dir}",
        "model.height=32",
        "model.width=32",
        "sample.num_steps=3",
        "sample.eval_num_steps=3",
        "sample.batch_size=2",
        f"train.num_iterations={iterations}",
        "train.prompts_per_iteration=3",
        "train.group_size=4",
        "train.minibatch_size=4",
        "train.num_threads=1",
        "train.lr=1e-4",
        "train.lr_warmup_steps=0",
        "train.lr_cooldown=0",
        "reward.weights.shapes=0.0",
        "reward.weights.jpeg_compressibility=1.0",
        "log.checkpoint_every=2",
        "log.images_every=2",
        "eval.every=3",
        "eval.num_seeds=1",
        "data.num_heldout=8",
    ]


@pytest.mark.parametrize(
    "objective", [[], ["train.objective=flow_grpo", "sample.noise_level=1.2"]], ids=["nft", "flow_grpo"]
)
def test_two_processes_match_one_and_resume(tiny_model_dir, tmp_path, objective):
    """2 ranks (interrupted after iteration 2, resumed) == 1 process for 3 iterations, up to rounding.

    Tolerances: the ranks compute each minibatch's loss on sub-batches and the gradients are summed
    in another order, so losses and gradients differ by float32 rounding (measured: metrics 5e-8
    relative, parameters 7.5e-8 absolute after 3 AdamW steps). Metrics: rtol 1e-4, with atol 1e-6
    for values that are near-zero sums of O(1) terms (Flow-GRPO's surrogate -A * ratio averages to
    ~1e-6 with ratio ~ 1 and zero-mean advantages; its two runs differ by ~1e-8 there). Parameters: atol 1e-6, 1% of one
    lr=1e-4 AdamW step; Adam divides by sqrt(v), so a relative gradient error d moves a weight by
    about lr * d per step.
    """
    one, two = tmp_path / "one", tmp_path / "two"
    threads = torch.get_num_threads()
    try:  # torchrun gives each rank one thread; the reference runs with one too
        assert main(["train", *dp_overrides(tiny_model_dir, 3), *objective, "--run-dir", str(one), "--quiet"]) == 0
    finally:
        torch.set_num_threads(threads)

    proc = launch(CPU_2PROC, "train", *dp_overrides(tiny_model_dir, 2), *objective, "--run-dir", str(two))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "data parallel: 2 processes on cpu, 6 of 12 samples on rank 0" in proc.stdout
    proc = launch(CPU_2PROC, "train", *dp_overrides(tiny_model_dir, 3), *objective, "--run-dir", str(two))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming from" in proc.stdout and "(iteration 2)" in proc.stdout

    # Only rank 0 wrote: one metrics row per iteration, its images and checkpoints.
    rows_one, rows_two = read_metrics(one), read_metrics(two)
    assert [r["step"] for r in rows_two] == [1, 2, 3]
    assert (two / "images" / "rollout-000002.png").is_file()
    # The held-out eval was split between the ranks (8 samples: 4 each) and gathered.
    assert "eval/mean_reward" in rows_one[2] and "eval/mean_reward" in rows_two[2]
    for a, b in zip(rows_one, rows_two):
        assert a["grpo/num_trained_samples"] == b["grpo/num_trained_samples"] == 12
        for key, value in a.items():
            if not key.startswith(("time/", "cost/")) and key != "eval/seconds":
                assert b[key] == pytest.approx(value, rel=1e-4, abs=1e-6), (a["step"], key)
    # The cost ledger charged one on-demand GPU per process (cost.trainer_gpus is 1 in the recipe).
    for run, gpus in ((one, 1), (two, 2)):
        usage = json.loads((run / "cost.json").read_text())["pools"]["on_demand"]["usage"]
        assert {g for _, _, g in usage} == {gpus}, run
    ckpt_one, ckpt_two = load_checkpoint(one), load_checkpoint(two)
    assert ckpt_one.step == ckpt_two.step == 3
    for key, value in ckpt_one.tensors["trainable"].items():
        torch.testing.assert_close(ckpt_two.tensors["trainable"][key], value, rtol=0, atol=1e-6, msg=key)
    # The weights moved: the comparison is not between two untrained models.
    from safetensors.torch import load_file

    base = load_file(next((tiny_model_dir / "transformer").glob("*.safetensors")))
    assert any(not torch.equal(base[k], v) for k, v in ckpt_two.tensors["trainable"].items() if k in base)


def test_two_machines_match_one_process_and_a_run_dir_they_do_not_share_is_named(tiny_model_dir, tmp_path):
    """A launch over 2 machines of one process each (two `accelerate launch --num_machines 2`, both on
    127.0.0.1, each in its own working directory: every process has LOCAL_RANK 0, RANK 0 and 1)
    trains as 1 process does, and resumes from a run dir on a filesystem both share. A run dir only
    machine 0 has (a relative path: each machine's own disk), or of which machine 1 has a damaged
    copy, cannot be resumed from by rank 1: both machines stop with the same error naming the rank
    and the checkpoint, instead of rank 0 waiting in a collective for a rank that died. Tolerances
    as in the 2-process test above."""
    one, shared = tmp_path / "one", tmp_path / "shared"  # absolute paths: the shared filesystem
    machines = [tmp_path / "machine-0", tmp_path / "machine-1"]
    for m in machines:
        m.mkdir()
    threads = torch.get_num_threads()
    try:
        assert main(["train", *dp_overrides(tiny_model_dir, 3), "--run-dir", str(one), "--quiet"]) == 0
    finally:
        torch.set_num_threads(threads)

    for iterations in (2, 3):
        procs = launch_machines(
            CPU_2PROC, machines, "train", *dp_overrides(tiny_model_dir, iterations), "--run-dir", str(shared)
        )
        assert [p.returncode for p in procs] == [0, 0], procs[0].stderr[-2000:] + procs[1].stderr[-2000:]
    assert "data parallel: 2 processes on cpu, 6 of 12 samples on rank 0" in procs[0].stdout
    assert "resuming from" in procs[0].stdout and "(iteration 2)" in procs[0].stdout
    for a, b in zip(read_metrics(one), read_metrics(shared), strict=True):
        for key, value in a.items():
            if not key.startswith(("time/", "cost/")) and key != "eval/seconds":
                assert b[key] == pytest.approx(value, rel=1e-4, abs=1e-6), (a["step"], key)
    ckpt_one, ckpt_two = load_checkpoint(one), load_checkpoint(shared)
    assert ckpt_one.step == ckpt_two.step == 3
    for key, value in ckpt_one.tensors["trainable"].items():
        torch.testing.assert_close(ckpt_two.tensors["trainable"][key], value, rtol=0, atol=1e-6, msg=key)

    # The same run, in a directory on machine 0's disk only.
    shutil.copytree(shared, machines[0] / "run")
    procs = launch_machines(
        CPU_2PROC, machines, "train", *dp_overrides(tiny_model_dir, 4), "--run-dir", "run", timeout=180
    )
    assert all(p.returncode != 0 for p in procs)
    for p in procs:
        assert "rank(s) [1] of 2 cannot read the checkpoint" in p.stderr and "step-00000003" in p.stderr, p.stderr[
            -2000:
        ]
    assert not (machines[1] / "run").exists()  # rank 1 writes nothing to a run dir
    assert load_checkpoint(machines[0] / "run").step == 3

    # A partial copy on machine 1: the step dir is there, one of its files is damaged. Rank 1's
    # verification fails (sha256), and again both machines stop with one error naming rank 1.
    shutil.copytree(shared, machines[1] / "run")
    damaged = next((machines[1] / "run" / "checkpoints" / "step-00000003").glob("*.safetensors"))
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 0xFF
    damaged.write_bytes(bytes(data))
    procs = launch_machines(
        CPU_2PROC, machines, "train", *dp_overrides(tiny_model_dir, 4), "--run-dir", "run", timeout=180
    )
    assert all(p.returncode != 0 for p in procs)
    for p in procs:
        assert "rank(s) [1] of 2 cannot read the checkpoint" in p.stderr, p.stderr[-2000:]
    assert "sha256 does not match" in procs[1].stderr, procs[1].stderr[-2000:]
    assert load_checkpoint(machines[0] / "run").step == 3  # nothing was written


# -- the collectives, on 2 gloo processes -------------------------------------------------------


def _collectives(rank: int, world_size: int, port: int, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    dp = DataParallel(rank=rank, world_size=world_size)
    results = {"shard": dp.shard(5)}
    # Rank 0's explored seeds reach every rank (what the driver does with Ray exploration).
    results["seeds"] = dp.broadcast_object([11, 22, 33] if rank == 0 else None)
    # Uneven row counts (5 samples on 2 ranks: 2 and 3).
    lo, hi = dp.shard(5)
    results["rows"] = dp.all_gather_rows(torch.arange(lo, hi, dtype=torch.float32).view(-1, 1)).view(-1).tolist()
    # Gradients: summed; a parameter with no gradient on any rank keeps None.
    a, b, c = (torch.nn.Parameter(torch.zeros(2)) for _ in range(3))
    a.grad = torch.full((2,), float(rank + 1))
    if rank == 1:
        b.grad = torch.ones(2)
    dp.all_reduce_grads([a, b, c])
    results["grads"] = [a.grad.tolist(), b.grad.tolist(), c.grad]
    results["sums"] = dp.sum_lists({"x": [rank, 1.0], "y": [0.5]})
    w = torch.full((3,), float(rank))
    dp.broadcast_tensors([w])
    results["broadcast"] = w.tolist()
    torch.save(results, f"{out}/{rank}.pt")
    dist.destroy_process_group()


def test_collectives_on_two_gloo_processes(tmp_path):
    mp.spawn(_collectives, args=(2, free_port(), str(tmp_path)), nprocs=2)
    r0, r1 = (torch.load(tmp_path / f"{r}.pt") for r in range(2))
    assert (r0["shard"], r1["shard"]) == ((0, 2), (2, 5))
    for r in (r0, r1):
        assert r["seeds"] == [11, 22, 33]
        assert r["rows"] == [0.0, 1.0, 2.0, 3.0, 4.0]
        assert r["grads"] == [[3.0, 3.0], [1.0, 1.0], None]
        assert r["sums"] == {"x": [1.0, 2.0], "y": [1.0]}
        assert r["broadcast"] == [0.0, 0.0, 0.0]


def test_one_process_layout_is_the_identity(monkeypatch):
    from spotlight.core.distributed import init_data_parallel

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    dp = init_data_parallel()
    assert (dp.rank, dp.world_size, dp.is_main, dp.shard(12)) == (0, 1, True, (0, 12))
    x = torch.randn(3, 2)
    assert dp.all_gather_rows(x) is x and dp.broadcast_object("s") == "s"


def test_fsdp_launch_is_refused_with_the_config_to_use(monkeypatch):
    from spotlight.core.distributed import init_data_parallel

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(ValueError, match="multi-gpu-ddp.yaml"):
        init_data_parallel()
