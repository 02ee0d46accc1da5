"""One writer per run directory and per store (spotlight.core.runlock): a second trainer refuses with the
holder named, a dead holder is taken over, and a fenced old holder stops writing.

The CLI tests run the real `spotlight train` twice on one run directory (the second refuses while
the first lives; after a SIGKILL of the first it takes over and finishes, every metrics row once);
the same with the store mirror on the moto S3 server is in tests/test_mirror.py.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from test_cli import tiny_overrides

from spot.store import open_store
from spotlight.core.checkpoint import load_checkpoint
from spotlight.core.runlock import LOCK_FILE, STORE_LEASE, Fenced, RunDirBusy, RunLock, remove_if_empty_run
from spotlight.core.tracking import read_metrics
from spotlight.mirror import CheckpointMirror


def test_a_second_holder_is_refused_and_names_the_first(tmp_path):
    first = RunLock(tmp_path / "run", "spotlight train")
    with pytest.raises(RunDirBusy) as err:
        RunLock(tmp_path / "run", "spotlight train")
    message = str(err.value)
    assert f"pid {os.getpid()}" in message and socket.gethostname() in message and "--run-dir" in message
    first.release()
    with RunLock(tmp_path / "run", "spotlight train") as again:
        assert again.token == first.token + 1 and again.took_over is None  # released: nothing taken over


def test_a_holder_that_died_is_taken_over(tmp_path):
    """The kernel drops a dead process's flock; its record (not released) names what was taken over."""
    code = (
        "import os, signal, sys; from spotlight.core.runlock import RunLock; "
        f"lock = RunLock({str(tmp_path / 'run')!r}, 'spotlight train'); print('held', flush=True); "
        "os.kill(os.getpid(), signal.SIGKILL)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL and "held" in proc.stdout
    dead = json.loads((tmp_path / "run" / LOCK_FILE).read_text())
    with RunLock(tmp_path / "run", "spotlight train") as lock:
        assert lock.took_over["pid"] == dead["pid"] and lock.token == dead["token"] + 1


def test_the_store_lease_refuses_until_it_expires_then_fences_the_old_holder(tmp_path):
    store = open_store(tmp_path / "store")
    now = [1000.0]
    # A trainer on another machine holds the store (its flock is not visible here).
    other = {
        "command": "spotlight train",
        "host": "other-host",
        "pid": 1,
        "started": 990.0,
        "token": 7,
        "released": False,
        "renewed": 995.0,
        "lease_s": 60.0,
    }
    store.put_bytes(STORE_LEASE, json.dumps(other).encode())
    with pytest.raises(RunDirBusy, match="other-host.*expires in 55 s"):
        RunLock(tmp_path / "replacement", "spotlight train", store=store, lease_s=60, clock=lambda: now[0])
    assert not (tmp_path / "replacement" / "checkpoints").exists()
    now[0] = 1056.0  # the lease expired: the other machine stopped renewing
    new = RunLock(tmp_path / "replacement", "spotlight train", store=store, lease_s=60, clock=lambda: now[0])
    assert new.token == 8 and new.took_over["host"] == "other-host"
    assert json.loads(store.get_bytes(STORE_LEASE))["token"] == 8
    new.release()
    assert json.loads(store.get_bytes(STORE_LEASE))["released"] is True


def test_an_old_holder_is_fenced_and_its_mirror_publishes_nothing(tmp_path):
    store_dir = tmp_path / "store"
    old_mirror = CheckpointMirror(str(store_dir))
    old = RunLock(tmp_path / "machine-1", "spotlight train", store=old_mirror.store, lease_s=60)
    old_mirror.guard = old.check
    # The old machine stops answering; the lease is taken over after it expired (written here as the new holder would).
    lease = json.loads(old_mirror.store.get_bytes(STORE_LEASE))
    old_mirror.store.put_bytes(
        STORE_LEASE, json.dumps({**lease, "host": "machine-2", "pid": 2, "token": lease["token"] + 1}).encode()
    )
    from test_mirror import fake_checkpoint

    step_dir = fake_checkpoint(tmp_path / "machine-1", 4)
    with pytest.raises(Fenced, match="machine-2.*stops without writing"):
        old_mirror.publish(step_dir, tmp_path / "machine-1")
    assert old_mirror.store.latest("checkpoints") is None
    with pytest.raises(Fenced):
        old.check(fresh=False)  # what the training loop asks each iteration
    old.release()
    assert json.loads(old_mirror.store.get_bytes(STORE_LEASE))["host"] == "machine-2"  # not overwritten


def test_the_lease_is_renewed_while_the_run_lives(tmp_path):
    store = open_store(tmp_path / "store")
    with RunLock(tmp_path / "run", "spotlight train", store=store, lease_s=0.3):
        first = json.loads(store.get_bytes(STORE_LEASE))["renewed"]
        time.sleep(0.5)
        assert json.loads(store.get_bytes(STORE_LEASE))["renewed"] > first


def test_a_failed_start_leaves_no_run_dir_but_a_used_one_stays(tmp_path):
    (tmp_path / "fresh").mkdir()
    (tmp_path / "fresh" / "config.yaml").write_text("name: x\n")
    assert remove_if_empty_run(tmp_path / "fresh") and not (tmp_path / "fresh").exists()
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "metrics.jsonl").write_text('{"step": 1}\n')
    assert not remove_if_empty_run(tmp_path / "used") and (tmp_path / "used").exists()


def _train(model_dir, run_dir, iterations):
    args = [*tiny_overrides(model_dir, iterations), "log.checkpoint_every=1", "--run-dir", str(run_dir), "--quiet"]
    return [sys.executable, "-m", "spotlight.cli", "train", *args]


def test_two_trainers_on_one_run_dir_then_a_takeover_after_sigkill(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    env = dict(os.environ, WANDB_MODE="offline")
    # Far more iterations than it will run: it must still be alive when the second one starts.
    first = subprocess.Popen(
        _train(tiny_model_dir, run_dir, 100_000), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        latest = run_dir / "checkpoints" / "latest"
        deadline = time.monotonic() + 180
        while not latest.exists() and time.monotonic() < deadline and first.poll() is None:
            time.sleep(0.1)
        assert latest.exists() and first.poll() is None, "the first trainer wrote no checkpoint in time"
        second = subprocess.run(
            _train(tiny_model_dir, run_dir, 100_000), env=env, capture_output=True, text=True, timeout=300
        )
        assert second.returncode == 2, second.stderr
        err = second.stderr.strip()
        assert len(err.splitlines()) == 1 and f"pid {first.pid}" in err and "kill" in err, err
        assert first.poll() is None
    finally:
        first.send_signal(signal.SIGKILL)
        first.communicate()
    # The replacement takes over the dead trainer's run dir and finishes (a few iterations past its checkpoint).
    iterations = load_checkpoint(run_dir).step + 3
    third = subprocess.run(
        _train(tiny_model_dir, run_dir, iterations), env=env, capture_output=True, text=True, timeout=600
    )
    assert third.returncode == 0, third.stderr
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, iterations + 1))  # each row exactly once
    assert load_checkpoint(run_dir).step == iterations
    assert json.loads((run_dir / LOCK_FILE).read_text())["released"] is True
