"""Launching the CLI under the real `accelerate launch` on CPU (gloo) processes, for the tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import yaml

ACCELERATE = Path(sys.executable).with_name("accelerate")
REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_fsdp_config(path: Path) -> Path:
    """configs/accelerate/fsdp.yaml on 2 local processes in float32: accelerate starts FSDP launches
    through torchrun whatever the hardware; without a GPU the processes run gloo on the CPU. bf16
    mixed precision would change the numbers (the tests compare with a float32 single process),
    not the code path of the collectives."""
    cfg = yaml.safe_load((REPO / "configs/accelerate/fsdp.yaml").read_text())
    cfg.update(num_processes=2, mixed_precision="no")
    path.write_text(yaml.safe_dump(cfg))
    return path


def launch(config: Path | str, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    """`accelerate launch --config_file config -m spotlight.cli` with `args`, one thread per process."""
    cmd = [str(ACCELERATE), "launch", "--config_file", str(config), "--main_process_port", str(free_port()), "-m", "spotlight.cli", *args]
    env = dict(os.environ, WANDB_MODE="offline", OMP_NUM_THREADS="1")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
