"""`benchmarks/gpu_check.sh`: the CPU smoke run in CI (so the GPU script cannot rot), and the GPU run.

Both run the real script as a subprocess and read the one JSON line it prints. On the CPU it runs
`--device cpu --tiny`: the same code paths (rollout, GRPO update with and without gradient
checkpointing, `spotlight memory` on the same recipe and model folder, Ulysses at degree 1 and in two
gloo processes, bf16 vs fp32) at a tiny size; the GPU-only checks must say so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
CPU_CHECKS = ["sampling", "train_step", "train_step_gc", "ulysses_degree1", "bf16_vs_fp32", "ulysses_multiproc"]
GPU_ONLY = ["diffusers_cp", "xfuser", "sp_backend_xfuser"]
FIELDS = {"baseline", "env", "config", "wall_s", *CPU_CHECKS, *GPU_ONLY}


def run_gpu_check(tmp_path: Path, *args: str, timeout: float) -> dict:
    env = dict(os.environ, PYTHON=sys.executable, OUT=str(tmp_path))
    proc = subprocess.run(
        ["bash", str(REPO / "benchmarks" / "gpu_check.sh"), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    log = (tmp_path / "gpu_check.log").read_text() if (tmp_path / "gpu_check.log").is_file() else ""
    assert proc.returncode == 0, proc.stderr + log[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines, f"no output; log:\n{log[-3000:]}"
    result = json.loads(lines[-1])
    assert json.loads((tmp_path / "gpu_check.json").read_text()) == result
    assert "error" not in result, result["error"]
    assert set(result) == FIELDS, set(result) ^ FIELDS
    return result


def test_cpu_smoke_run_has_every_field_and_the_cpu_checks_pass(tmp_path):
    r = run_gpu_check(tmp_path, "--device", "cpu", "--tiny", timeout=300)
    for name in CPU_CHECKS:
        assert "error" not in r[name] and "skipped" not in r[name], (name, r[name])
    for name in GPU_ONLY:
        assert r[name] == {"skipped": "no CUDA device"}, (name, r[name])
    assert r["env"]["gpu_count"] == 0 and r["env"]["torch"] == torch.__version__
    assert r["config"]["mode"] == "tiny" and r["config"]["lora_params"] > 0

    sampling = r["sampling"]
    assert sampling["images_finite"] and sampling["log_probs_finite"]
    assert sampling["images"] == [r["config"]["samples"], 3, r["config"]["height"], r["config"]["height"]]
    assert sampling["sde_steps"] == [0, 1] and sampling["step_ms"] > 0
    for name, gc_on in (("train_step", False), ("train_step_gc", True)):
        step = r[name]
        assert step["gradient_checkpointing"] is gc_on
        assert step["params_changed"] and step["trained_steps"] == 2
        assert step["plan_trainer_gib"] > 0 and step["peak_gib"] is None  # no allocator peak on the CPU
    # Checkpointing saves only block inputs: the plan's activations shrink.
    assert r["train_step_gc"]["plan_groups_gib"]["activations"] <= r["train_step"]["plan_groups_gib"]["activations"]

    assert r["ulysses_degree1"]["max_abs_err"] == 0.0
    multi = r["ulysses_multiproc"]
    assert multi["backend"] == "gloo" and multi["degree"] == 2 and multi["processes"] == 2
    assert multi["max_abs_err_fp32"] <= 1e-5 * max(1.0, multi["ref_max_abs"])
    assert multi["max_abs_err_bf16"] <= 2e-2 * multi["ref_max_abs"]
    assert 0 < r["bf16_vs_fp32"]["mean_abs_diff_over_rms"] < 0.05


@pytest.mark.gpu
def test_gpu_run(tmp_path):
    r = run_gpu_check(tmp_path, timeout=600)
    for name in ["sampling", "train_step", "train_step_gc", "ulysses_degree1", "bf16_vs_fp32"]:
        assert "error" not in r[name], (name, r[name])
    assert r["sampling"]["images_finite"] and r["sampling"]["peak_rollout_gib"] > 0
    for name in ("train_step", "train_step_gc"):
        step = r[name]
        assert step["params_changed"] and step["peak_gib"] > step["resident_gib"]
        # The plan within a factor of two of the allocator's peak (its headroom covers the transients).
        assert 0.5 < step["peak_over_plan"] < 2.0, step
    assert r["train_step_gc"]["activations_gib"] < r["train_step"]["activations_gib"]
    assert r["ulysses_degree1"]["max_abs_err"] == 0.0
    if r["env"]["gpu_count"] >= 2:
        assert "error" not in r["ulysses_multiproc"], r["ulysses_multiproc"]
        assert r["ulysses_multiproc"]["max_abs_err_fp32"] <= 1e-4 * max(1.0, r["ulysses_multiproc"]["ref_max_abs"])
    # diffusers' CP and xfuser are optional backends: their figures or their errors, never missing.
    assert r["diffusers_cp"] and r["xfuser"] and r["sp_backend_xfuser"]
    xf = r["sp_backend_xfuser"]
    if "error" not in xf:  # parallel.sp_backend=xfuser: the same math as ours
        assert xf["max_abs_err_vs_ours_fp32"] <= 1e-4 * max(1.0, xf["ref_max_abs_fp32"]), xf
        assert xf["max_abs_err_vs_ours_bf16"] <= 2e-2 * xf["ref_max_abs_bf16"], xf
