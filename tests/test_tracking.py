"""Tracker: image grids, metrics.jsonl, offline wandb runs and resume truncation."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from spotlight.core.tracking import Tracker, image_grid, labelled_grid, read_metrics, save_image_grid


@pytest.fixture(autouse=True)
def _offline_wandb(tmp_path, monkeypatch):
    # wandb also writes to its config and cache dirs; keep them inside the test's tmp_path.
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "wandb-data"))


def test_image_grid_shape_gap_and_clamp():
    images = torch.zeros(5, 3, 8, 10)
    images[0] = 2.0  # clamped to white
    images[1] = -1.0  # clamped to black
    images[2, 0] = 1.0  # red
    grid = image_grid(images, nrow=3)
    assert grid.size == (3 * 10 + 2 * 2, 2 * 8 + 2)  # PIL size is (width, height)
    pixels = torch.from_numpy(np.array(grid))
    assert pixels.shape == (18, 34, 3)
    assert (pixels[:8, :10] == 255).all()
    assert (pixels[:8, 12:22] == 0).all()
    assert pixels[0, 24].tolist() == [255, 0, 0]
    assert (pixels[:, 10:12] == 255).all() and (pixels[8:10, :] == 255).all()  # the white gaps
    assert (pixels[10:, 24:] == 255).all()  # the empty sixth cell stays white
    assert image_grid(torch.rand(2, 3, 4, 4), nrow=8).size == (10, 4)
    with pytest.raises(ValueError, match="B, 3, H, W"):
        image_grid(torch.rand(3, 4, 4), nrow=2)


def test_labelled_grid_writes_each_caption_under_its_tile():
    images = torch.zeros(3, 3, 32, 32)  # black tiles: the white caption bands stand out
    grid = labelled_grid(images, nrow=3, captions=["one red circle", "", "x " * 80])
    pixels = np.asarray(grid.convert("L"))
    assert grid.width == 3 * 128 + 2 * 2
    assert (pixels[:128, :128] == 0).all()  # the tile, upscaled 4x
    band = pixels[128:, :]
    assert (band[:, :128] < 128).any()  # text under the first tile
    assert (band[:, 130:258] == 255).all()  # an empty caption writes nothing
    assert band.shape[0] <= 4 + 3 * 14  # a long caption is cut at three lines
    with pytest.raises(ValueError, match="captions"):
        labelled_grid(images, nrow=3, captions=["a"])


def test_save_image_grid(tmp_path):
    path = save_image_grid(torch.rand(4, 3, 6, 6), tmp_path / "sub" / "grid.png", nrow=2)
    with Image.open(path) as image:
        assert image.size == (14, 14) and image.mode == "RGB"


def test_tracker_logs_resumes_and_truncates(tmp_path):
    run_dir = tmp_path / "run"
    with Tracker(run_dir, project="spotlight-test", run_name="t", config={"lr": 1e-3}) as tracker:
        for step in range(1, 6):
            tracker.log({"reward": step / 10, "loss": torch.tensor(2.0 * step)}, step=step)
        png = tracker.log_images("samples/eval", torch.rand(3, 3, 8, 8), ["a cat", "a dog", "a fox"], step=4, nrow=2)
        tracker.log_images("samples/eval", torch.rand(2, 3, 8, 8), ["x", "y"], step=5, nrow=2)
        with pytest.raises(ValueError, match="step"):
            tracker.log({"step": 1.0}, step=6)
        with pytest.raises(ValueError, match="captions"):
            tracker.log_images("k", torch.rand(2, 3, 8, 8), ["only one"], step=6, nrow=2)
        first_id = tracker.run_id

    assert png == run_dir / "images" / "samples_eval-000004.png"
    with Image.open(png) as image:
        # 8 px images upscaled 16x to 128 px tiles, 2 per row, each with its caption in a band below.
        assert image.width == 2 * 128 + 2 and 2 * 128 + 2 * 18 <= image.height <= 2 * 128 + 2 * 50
    rows = read_metrics(run_dir)
    assert rows == [{"step": s, "reward": s / 10, "loss": 2.0 * s} for s in range(1, 6)]
    assert (run_dir / "wandb_id.txt").read_text().strip() == first_id
    offline_runs = list((run_dir / "wandb").glob(f"offline-run-*-{first_id}"))
    assert offline_runs and list(offline_runs[0].glob("*.wandb"))

    # The process was killed after step 5 and mid-write of step 6; it resumes from step 3.
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "rew')
    assert read_metrics(run_dir)[-1]["step"] == 5
    with Tracker(run_dir, project="spotlight-test", run_name="t", config={}, resume_step=3) as tracker:
        assert tracker.run_id == first_id  # same wandb run continues
        assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3]
        assert not (run_dir / "images" / "samples_eval-000004.png").exists()
        tracker.log({"reward": 0.99}, step=4)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 4]
    assert read_metrics(run_dir)[-1] == {"step": 4, "reward": 0.99}


def test_disabled_mode_still_writes_metrics(tmp_path):
    with Tracker(tmp_path, project="p", run_name="n", mode="disabled", config={}) as tracker:
        tracker.log({"x": 1}, step=0)
    assert read_metrics(tmp_path) == [{"step": 0, "x": 1.0}]
    assert not (tmp_path / "wandb").exists() or not list((tmp_path / "wandb").glob("offline-run-*"))
    with pytest.raises(ValueError, match="mode"):
        Tracker(tmp_path, project="p", run_name="n", mode="cloud", config={})
    assert read_metrics(tmp_path / "nothing-here") == []


def test_disabled_mode_never_imports_wandb(tmp_path):
    """A fresh interpreter: training with wandb off neither needs nor loads the package."""
    code = (
        "import sys, torch\n"
        "from spotlight.core.tracking import Tracker\n"
        f"with Tracker({str(tmp_path)!r}, project='p', run_name='n', mode='disabled', config={{}}) as t:\n"
        "    t.log({'x': 1}, step=0)\n"
        "    t.log_images('samples/eval', torch.rand(2, 3, 8, 8), ['a', 'b'], step=0, nrow=2)\n"
        "assert 'wandb' not in sys.modules, 'wandb was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    assert read_metrics(tmp_path) == [{"step": 0, "x": 1.0}]
    assert (tmp_path / "images" / "samples_eval-000000.png").is_file()
