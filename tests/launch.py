"""Launching the CLI under the real `accelerate launch` on CPU (gloo) processes, for the tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
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
    cmd = [
        str(ACCELERATE),
        "launch",
        "--config_file",
        str(config),
        "--main_process_port",
        str(free_port()),
        "-m",
        "spotlight.cli",
        *args,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env(), cwd=REPO)


def _env() -> dict[str, str]:
    return dict(os.environ, WANDB_MODE="offline", OMP_NUM_THREADS="1")


def launch_machines(
    config: Path | str, cwds: list[Path], *args: str, timeout: float = 240
) -> list[subprocess.CompletedProcess]:
    """`launch` over len(cwds) machines of one process each, all on 127.0.0.1: one `accelerate launch
    --num_machines N --machine_rank R` per machine, run at once, each in its own working directory
    (a machine's own disk). Every process has LOCAL_RANK 0, as on separate machines. Their output
    goes to files, not pipes: a machine blocked on a full pipe would stall the others' collectives."""
    n, port = len(cwds), str(free_port())
    procs, logs = [], []
    try:
        for rank, cwd in enumerate(cwds):
            cmd = [
                str(ACCELERATE),
                "launch",
                "--config_file",
                str(REPO / config),
                "--num_machines",
                str(n),
                "--num_processes",
                str(n),
                "--machine_rank",
                str(rank),
                "--main_process_ip",
                "127.0.0.1",
                "--main_process_port",
                port,
                "-m",
                "spotlight.cli",
                *args,
            ]
            out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
            logs.append((out, err))
            procs.append(subprocess.Popen(cmd, stdout=out, stderr=err, text=True, env=_env(), cwd=cwd))
        for p in procs:
            p.wait(timeout=timeout)
        done = []
        for p, (out, err) in zip(procs, logs):
            out.seek(0), err.seek(0)
            done.append(subprocess.CompletedProcess(p.args, p.returncode, out.read(), err.read()))
        return done
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for out, err in logs:
            out.close(), err.close()
