"""A process killed at any moment of a checkpoint save loses nothing: the run resumes from the
checkpoint being written if it was whole, else from the one before, and both verify.

The child process saves step 1, then saves again (step 2, or step 1 a second time, as a resumed
run does at its end) with a SIGKILL injected at one phase of `save_checkpoint`: while a tensor file
is half written, before the manifest, at the rename into place (and between the two renames that
replace an existing step dir), while `latest` is switched, and while older step dirs are pruned.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from spotlight.core.checkpoint import DAMAGED_DIR, load_checkpoint, newest_intact_checkpoint

CHILD = textwrap.dedent("""
    import os, signal, sys
    import torch
    import spotlight.core.checkpoint as ck

    run, phase, second_step = sys.argv[1], sys.argv[2], int(sys.argv[3])

    def save(step):
        ck.save_checkpoint(run, step, tensors={"trainable": {"w": torch.full((64,), float(step))}},
                           optimizer_state={"state": {}, "param_groups": []}, rng_state={}, meta={"step": step},
                           config_yaml="name: x\\n", keep_last=1)

    save(1)
    calls = {}

    def die_at(name, nth=1):
        real = getattr(ck if hasattr(ck, name) else os, name)
        def wrapper(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            if calls[name] == nth:
                if name == "_write_tensors":  # half a file on disk, then the kill
                    with open(args[0], "wb") as f:
                        f.write(b"\\0" * 100)
                os.kill(os.getpid(), signal.SIGKILL)
            return real(*args, **kwargs)
        setattr(ck if hasattr(ck, name) else ck.os, name, wrapper)

    where = {"tensor": ("_write_tensors", 1), "manifest": ("_write_manifest", 1), "rename": ("replace", 1),
             "second-rename": ("replace", 2), "latest": ("set_latest", 1), "latest-replace": ("replace", 2),
             "prune": ("_remove", 1)}
    die_at(*where[phase])
    save(second_step)
    print("not killed")
""")


@pytest.mark.parametrize(
    "phase, second_step",
    [
        ("tensor", 2),
        ("manifest", 2),
        ("rename", 2),
        ("latest", 2),
        ("latest-replace", 2),
        ("prune", 2),
        ("tensor", 1),
        ("rename", 1),
        ("second-rename", 1),
        ("latest", 1),
    ],
)
def test_a_kill_in_any_phase_of_a_save_loses_nothing(phase, second_step, tmp_path):
    run = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(run), phase, str(second_step)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == -signal.SIGKILL, (proc.stdout, proc.stderr)
    ckpt = newest_intact_checkpoint(run)
    assert ckpt is not None and ckpt.step in (1, second_step)
    assert torch.equal(ckpt.tensors["trainable"]["w"], torch.full((64,), float(ckpt.step)))
    assert not (run / "checkpoints" / DAMAGED_DIR).exists()  # a crash mid-save never looks like damage
    assert load_checkpoint(run).step == ckpt.step  # what `spotlight eval RUN_DIR` reads
    if phase in ("latest", "latest-replace", "prune"):
        assert ckpt.step == second_step  # the new checkpoint was whole: it is the one resumed
