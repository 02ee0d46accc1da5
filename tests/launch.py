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


def launch_machines(
    config: Path | str, cwds: list[Path], *args: str, timeout: float = 240
) -> list[subprocess.CompletedProcess]:
    """`launch` over len(cwds) machines of one process each, all on 127.0.0.1: one `accelerate launch
    --num_machines N --machine_rank R` per machine, run at once, each in its own working directory
    (a machine's own disk). Every process has LOCAL_RANK 0, as on separate machines."""
    n, port = len(cwds), str(free_port())
    env = dict(os.environ, WANDB_MODE="offline", OMP_NUM_THREADS="1")
    procs = []
    for rank, cwd in enumerate(cwds):
        cmd = [
            str(ACCELERATE), "launch", "--config_file", str(REPO / config), "--num_machines", str(n), "--num_processes", str(n),
            "--machine_rank", str(rank), "--main_process_ip", "127.0.0.1", "--main_process_port", port,
            "-m", "spotlight.cli", *args,
        ]  # fmt: skip
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd))
    done = []
    try:
        for cmd_proc in procs:
            out, err = cmd_proc.communicate(timeout=timeout)
            done.append(subprocess.CompletedProcess(cmd_proc.args, cmd_proc.returncode, out, err))
    finally:
        for cmd_proc in procs:
            if cmd_proc.poll() is None:
                cmd_proc.kill()
    return done
