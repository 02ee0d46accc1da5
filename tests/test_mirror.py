"""Checkpoints mirrored to a store, and a trainer restarted on an empty disk resuming from it.

The fault test runs the real `spotlight train` in a subprocess against a real S3 endpoint (moto's
server on 127.0.0.1), SIGKILLs it after a checkpoint reached the store, and restarts it with a new,
empty run directory (a replacement machine). The restarted run must end with the parameters of an
uninterrupted run and with every iteration's metrics row exactly once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from s3_server import SECRETS, fake_aws_environment, moto_s3
from test_cli import tiny_overrides

from spot.store import open_store
from spot.store_base import MANIFEST_NAME
from spotlight.core.checkpoint import find_latest_checkpoint, load_checkpoint, save_checkpoint
from spotlight.mirror import CheckpointMirror

BUCKET = "spot-mirror-test"


def fake_checkpoint(run_dir: Path, step: int) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    with (run_dir / "metrics.jsonl").open("a", encoding="utf-8") as f:
        f.write(json.dumps({"step": step, "reward/mean": step / 10}) + "\n")
    return save_checkpoint(
        run_dir,
        step,
        tensors={"trainable": {"w": torch.full((3,), float(step))}},
        optimizer_state=None,
        rng_state={},
        meta={"step": step},
        config_yaml="name: t\n",
        keep_last=2,
    )


def test_publish_keeps_the_newest_and_restore_brings_back_checkpoint_and_metrics(tmp_path):
    run_dir, store_dir = tmp_path / "run", tmp_path / "store"
    mirror = CheckpointMirror(str(store_dir), keep_last=2)
    for step in (2, 4, 6):
        mirror.publish(fake_checkpoint(run_dir, step), run_dir)
    store = open_store(store_dir)
    assert store.latest("checkpoints") == "checkpoints/step-00000006"
    assert {k.split("/")[1] for k in store.list("checkpoints/")} == {"step-00000004", "step-00000006"}

    fresh = tmp_path / "replacement"
    fetched = mirror.restore(fresh)
    assert fetched == fresh / "checkpoints" / "step-00000006"
    ckpt = load_checkpoint(fresh)  # verified against the checkpoint's own manifest
    assert ckpt.step == 6 and torch.equal(ckpt.tensors["trainable"]["w"], torch.full((3,), 6.0))
    rows = [json.loads(line) for line in (fresh / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 4, 6]
    # The run dir is now as new as the store: nothing more to fetch.
    assert mirror.restore(fresh) is None


def test_restore_prefers_a_newer_local_checkpoint_and_skips_an_unfinished_publish(tmp_path):
    run_dir, store_dir = tmp_path / "run", tmp_path / "store"
    mirror = CheckpointMirror(str(store_dir), keep_last=3)
    mirror.publish(fake_checkpoint(run_dir, 2), run_dir)
    fake_checkpoint(run_dir, 4)  # saved locally, never published
    assert mirror.restore(run_dir) is None
    assert find_latest_checkpoint(run_dir).name == "step-00000004"

    # A publish that died before its manifest is invisible: the store's newest is still step 2.
    store = open_store(store_dir)
    mirror.publish(fake_checkpoint(run_dir, 6), run_dir)
    store.delete(f"checkpoints/step-00000006/{MANIFEST_NAME}")
    fresh = tmp_path / "replacement"
    assert mirror.restore(fresh).name == "step-00000002"


def test_restore_skips_a_folder_damaged_in_the_store(tmp_path, caplog):
    run_dir, store_dir = tmp_path / "run", tmp_path / "store"
    mirror = CheckpointMirror(str(store_dir), keep_last=3)
    for step in (2, 4):
        mirror.publish(fake_checkpoint(run_dir, step), run_dir)
    damaged = store_dir / "checkpoints" / "step-00000004" / "trainable.safetensors"
    data = bytearray(damaged.read_bytes())
    data[-3] ^= 0x01  # same size: only the checksum tells
    damaged.write_bytes(bytes(data))
    fresh = tmp_path / "replacement"
    with caplog.at_level("WARNING"):
        assert mirror.restore(fresh).name == "step-00000002"
    assert "step-00000004 is damaged in the store" in caplog.text
    assert load_checkpoint(fresh).step == 2
    assert not (fresh / "checkpoints" / "step-00000004").exists()
    assert damaged.exists()  # the store's copy is left for a person to look at


def test_keep_last_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="keep_last"):
        CheckpointMirror(str(tmp_path), keep_last=0)


def _math(row: dict) -> dict:
    """A metrics row without its wall-clock figures (time, and the cost that follows from it)."""
    return {k: v for k, v in row.items() if not k.startswith(("time/", "cost/"))}


def _train_cmd(model_dir: Path, run_dir: Path, store_url: str, iterations: int) -> list[str]:
    # No end-of-run cooldown: the killed run asks for far more iterations than the others (it must
    # outlive a second trainer's start), and the schedule would then differ.
    overrides = [
        *tiny_overrides(model_dir, iterations),
        "log.checkpoint_every=2",
        f"log.store_url={store_url}",
        "train.lr_cooldown=0",
    ]
    return [
        sys.executable,
        "-m",
        "spotlight.cli",
        "train",
        "configs/dit/tiny-shapes.yaml",
        *overrides,
        "--run-dir",
        str(run_dir),
    ]


def test_trainer_killed_and_restarted_on_an_empty_disk_resumes_from_s3(tiny_model_dir, tmp_path):
    with fake_aws_environment(), moto_s3(BUCKET) as endpoint:
        env = dict(os.environ, WANDB_MODE="offline", AWS_ENDPOINT_URL_S3=endpoint, AWS_REGION="us-east-1")
        url = f"s3://{BUCKET}/runs/restart"
        os.environ["AWS_ENDPOINT_URL_S3"] = endpoint  # for this process's store, as for the trainers
        try:
            store = open_store(url)
            first = subprocess.Popen(
                _train_cmd(tiny_model_dir, tmp_path / "machine-1", url, 100_000),
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            # Kill the trainer (no cleanup, like a lost node) once a mid-run checkpoint is in the store.
            deadline = time.monotonic() + 240
            while store.latest("checkpoints") is None:
                assert first.poll() is None, first.stdout.read()
                assert time.monotonic() < deadline, "no checkpoint reached the store"
                time.sleep(0.2)
            # A replacement machine started while the first trainer still runs: the store's lease refuses it.
            early = subprocess.run(
                _train_cmd(tiny_model_dir, tmp_path / "machine-2", url, 100_000),
                env=env,
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert first.poll() is None, "the first trainer ended before it was killed"
            assert early.returncode == 2 and f"pid {first.pid}" in early.stderr and "lease" in early.stderr, (
                early.stderr
            )
            assert not (tmp_path / "machine-2").exists()  # the failed start left nothing behind
            first.send_signal(signal.SIGKILL)
            first_log = first.communicate()[0]
            iterations = int(store.latest("checkpoints").rsplit("-", 1)[1]) + 4  # two checkpoints past the kill

            second = subprocess.run(
                _train_cmd(tiny_model_dir, tmp_path / "machine-2", url, iterations),
                env=env,
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert second.returncode == 0, second.stderr
            unwrapped = "".join(second.stdout.split())  # rich wraps long lines
            assert f"resumingfrom{tmp_path / 'machine-2' / 'checkpoints'}" in unwrapped

            straight = subprocess.run(
                _train_cmd(tiny_model_dir, tmp_path / "straight", str(tmp_path / "local-store"), iterations),
                env=env,
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert straight.returncode == 0, straight.stderr
        finally:
            del os.environ["AWS_ENDPOINT_URL_S3"]

        resumed, uninterrupted = load_checkpoint(tmp_path / "machine-2"), load_checkpoint(tmp_path / "straight")
        assert resumed.step == uninterrupted.step == iterations
        for name, value in uninterrupted.tensors["trainable"].items():
            assert torch.equal(resumed.tensors["trainable"][name], value), name
        rows = [json.loads(line) for line in (tmp_path / "machine-2" / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == list(range(1, iterations + 1))  # none lost, none twice
        straight_rows = [
            json.loads(line) for line in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()
        ]
        assert [_math(r) for r in rows] == [_math(r) for r in straight_rows]
        assert store.latest("checkpoints") == f"checkpoints/step-{iterations:08d}"

        # No credential in anything the runs wrote or printed.
        written = [p for d in ("machine-1", "machine-2") for p in (tmp_path / d).rglob("*") if p.is_file()]
        for text in [first_log, second.stdout, second.stderr, *(p.read_bytes().decode("latin-1") for p in written)]:
            assert not any(secret in text for secret in SECRETS)
