"""Resume past a damaged newest checkpoint: the run goes on from the newest intact one, and ends
bit-identical to an uninterrupted run (spotlight.core.checkpoint.newest_intact_checkpoint)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_cli import tiny_overrides, without_time

from spotlight.cli import main
from spotlight.core.checkpoint import DAMAGED_DIR, load_checkpoint
from spotlight.core.tracking import read_metrics


def truncate(step_dir: Path) -> None:
    f = step_dir / "trainable.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def flip_a_byte(step_dir: Path) -> None:
    f = step_dir / "trainable.safetensors"
    data = bytearray(f.read_bytes())
    data[-7] ^= 0x40  # inside the tensor data: same size, other sha256
    f.write_bytes(bytes(data))


def cut_manifest(step_dir: Path) -> None:
    f = step_dir / "manifest.json"
    f.write_text(f.read_text()[:40])


def no_manifest(step_dir: Path) -> None:
    (step_dir / "manifest.json").unlink()


@pytest.fixture(scope="module")
def uninterrupted(tiny_model_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("full")
    assert main(["train", *tiny_overrides(tiny_model_dir, 4), "--run-dir", str(run_dir), "--quiet"]) == 0
    return run_dir


@pytest.mark.parametrize("damage", [truncate, flip_a_byte, cut_manifest, no_manifest])
def test_resume_skips_a_damaged_newest_checkpoint_and_ends_as_if_uninterrupted(
    damage, tiny_model_dir, uninterrupted, tmp_path, caplog
):
    run_dir = tmp_path / "run"
    args = ["train", *tiny_overrides(tiny_model_dir, 4), "--run-dir", str(run_dir), "--quiet"]
    assert main(args) == 0  # checkpoints at steps 2 and 4
    damage(run_dir / "checkpoints" / "step-00000004")
    with caplog.at_level("WARNING"):
        assert main(args) == 0  # resumes from step 2 and trains iterations 3 and 4 again
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "step-00000004 is damaged" in warned and "resuming from" in warned and "step-00000002" in warned
    # Set aside, not deleted.
    assert (run_dir / "checkpoints" / DAMAGED_DIR / "step-00000004").is_dir()
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3, 4]  # each row once
    assert without_time(read_metrics(run_dir)) == without_time(read_metrics(uninterrupted))
    a, b = load_checkpoint(uninterrupted), load_checkpoint(run_dir)
    assert a.step == b.step == 4
    assert a.tensors["trainable"].keys() == b.tensors["trainable"].keys()
    for key, value in a.tensors["trainable"].items():
        assert torch.equal(value, b.tensors["trainable"][key]), key


def test_every_checkpoint_damaged_is_one_line_and_nothing_deleted(tiny_model_dir, tmp_path, capsys):
    run_dir = tmp_path / "run"
    args = ["train", *tiny_overrides(tiny_model_dir, 4), "--run-dir", str(run_dir), "--quiet"]
    assert main(args) == 0
    for step in (2, 4):
        flip_a_byte(run_dir / "checkpoints" / f"step-{step:08d}")
    rows = (run_dir / "metrics.jsonl").read_text()
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no intact checkpoint" in err and "--no-resume" in err
    assert sorted(p.name for p in (run_dir / "checkpoints" / DAMAGED_DIR).iterdir()) == [
        "step-00000002",
        "step-00000004",
    ]
    assert (run_dir / "metrics.jsonl").read_text() == rows  # the run's history is untouched
