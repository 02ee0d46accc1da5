"""Experiment tracking: wandb when wanted, and always a plain `metrics.jsonl` in the run directory.

Shape legend: B images, H height, W width.

The JSON-lines file is the record a report or a test reads: it needs no account, no network and no
wandb install on the machine that reads it, and it survives a wandb outage. wandb gets the same
numbers for dashboards. Both use the training step as their x-axis (`step`), not wandb's internal
`_step` counter, which must increase monotonically and would drop the steps a run repeats after
resuming from an earlier checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import uuid
from pathlib import Path
from types import TracebackType

import numpy as np
import torch
from PIL import Image

from spotlight.core.config_io import to_dict
from spotlight.core.files import read_jsonl, read_jsonl_cut_off

METRICS_FILE = "metrics.jsonl"
WANDB_ID_FILE = "wandb_id.txt"
IMAGES_DIR = "images"
_MODES = ("online", "offline", "disabled")
_GAP_PX = 2
_IMAGE_STEP_RE = re.compile(r".*-(\d{6,})\.png")


def image_grid(images: torch.Tensor, nrow: int) -> Image.Image:
    """Tile images into one RGB picture, `nrow` images per row, 2 px white between them.

    Args:
        images: (B, 3, H, W) floats in [0, 1]; values outside are clamped, NaNs drawn black.
        nrow: Images per row, >= 1.

    Returns:
        The grid, min(nrow, B) images wide and ceil(B / nrow) high.
    """
    if images.ndim != 4 or images.shape[1] != 3 or images.shape[0] == 0:
        raise ValueError(f"images must be (B, 3, H, W) with B >= 1, got {tuple(images.shape)}")
    if nrow < 1:
        raise ValueError(f"nrow must be >= 1, got {nrow}")
    num_images, _, h, w = images.shape
    num_cols = min(nrow, num_images)
    num_rows = math.ceil(num_images / num_cols)
    grid_3HW = torch.ones(3, num_rows * (h + _GAP_PX) - _GAP_PX, num_cols * (w + _GAP_PX) - _GAP_PX)
    # A diverged policy can emit NaNs; draw them black rather than as undefined uint8 values.
    images_B3HW = images.detach().float().cpu().nan_to_num(0.0).clamp(0.0, 1.0)
    for i, image_3HW in enumerate(images_B3HW):
        row, col = divmod(i, num_cols)
        top, left = row * (h + _GAP_PX), col * (w + _GAP_PX)
        grid_3HW[:, top : top + h, left : left + w] = image_3HW
    pixels_HW3 = (grid_3HW * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
    return Image.fromarray(pixels_HW3)


def labelled_grid(images: torch.Tensor, nrow: int, captions: list[str], min_tile: int = 128) -> Image.Image:
    """`image_grid` made readable: each image upscaled (nearest neighbour, a whole factor) to at
    least `min_tile` pixels on its longer side, and its caption written under it, wrapped to the
    tile's width (at most 3 lines; a longer one ends in "...")."""
    from PIL import ImageDraw, ImageFont

    if len(captions) != images.shape[0]:
        raise ValueError(f"got {len(captions)} captions for {images.shape[0]} images; pass one per image")
    h, w = images.shape[-2:]
    scale = max(1, math.ceil(min_tile / max(h, w)))
    big = torch.nn.functional.interpolate(images.detach().float().cpu(), scale_factor=scale, mode="nearest")
    tiles = image_grid(big, nrow)
    font = ImageFont.load_default(size=12)
    tile_w, tile_h = w * scale, h * scale
    lines = [_wrap(c, font, tile_w - 4, max_lines=3) for c in captions]
    line_h = 14
    band = 4 + line_h * max(len(x) for x in lines)
    num_cols = min(nrow, len(captions))
    num_rows = math.ceil(len(captions) / num_cols)
    out = Image.new("RGB", (tiles.width, num_rows * (tile_h + band + _GAP_PX) - _GAP_PX), "white")
    draw = ImageDraw.Draw(out)
    for i, text in enumerate(lines):
        row, col = divmod(i, num_cols)
        left, top = col * (tile_w + _GAP_PX), row * (tile_h + band + _GAP_PX)
        out.paste(
            tiles.crop((left, row * (tile_h + _GAP_PX), left + tile_w, row * (tile_h + _GAP_PX) + tile_h)), (left, top)
        )
        for k, line in enumerate(text):
            draw.text((left + 2, top + tile_h + 2 + k * line_h), line, fill="black", font=font)
    return out


def _wrap(text: str, font, width: int, max_lines: int) -> list[str]:
    lines: list[str] = []
    for word in text.split():
        if lines and font.getlength(f"{lines[-1]} {word}") <= width:
            lines[-1] += f" {word}"
        else:
            lines.append(word)
    if len(lines) > max_lines:
        lines = lines[:max_lines]
        lines[-1] += " ..."
    return lines or [""]


def save_image_grid(
    images: torch.Tensor, path: str | os.PathLike, nrow: int, captions: list[str] | None = None
) -> Path:
    """Write the grid of `images` to `path` (format from its suffix, e.g. .png): `labelled_grid`
    with `captions`, else the plain `image_grid`.

    Returns:
        The path written.
    """
    path = Path(path)
    grid = image_grid(images, nrow) if captions is None else labelled_grid(images, nrow, captions)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        grid.save(path)
    except OSError as err:
        raise ValueError(
            f"cannot write the image {path} ({err.strerror or err}: {err.filename}); choose a writable path"
        ) from None
    except ValueError as err:  # PIL: no format for that suffix
        raise ValueError(f"cannot write the image {path}: {err}; give a .png path") from None
    return path


def read_metrics(run_dir: str | os.PathLike) -> list[dict]:
    """The rows of `run_dir/metrics.jsonl`, each {"step": int, <metric>: float, ...}, in order.

    A missing file gives []; a cut-off last line (the process was killed mid-write) is skipped.
    """
    return read_jsonl(Path(run_dir) / METRICS_FILE)


class Tracker:
    """Logs a run's metrics and image grids to `metrics.jsonl`, `images/` and wandb.

    The wandb run id is kept in `run_dir/wandb_id.txt`, so a restarted process continues the same
    wandb run. Use as a context manager, or call `finish()`.

    Args:
        run_dir: The run directory; created if missing. wandb writes under `run_dir/wandb/`.
        project: wandb project.
        run_name: wandb display name.
        mode: "online", "offline" (sync later with `wandb sync`) or "disabled" (no wandb at all;
            metrics.jsonl and images are still written).
        config: The resolved run config, shown in wandb.
        resume_step: Step of the checkpoint this run resumes from. Rows and images logged after it
            by the interrupted run are removed, so the resumed run does not record them twice.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        *,
        project: str,
        run_name: str,
        mode: str = "offline",
        config: dict,
        resume_step: int | None = None,
    ):
        if mode not in _MODES:
            raise ValueError(f"mode must be one of {_MODES}, got {mode!r}")
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.run_dir / METRICS_FILE
        self._truncate_history(resume_step)

        id_path = self.run_dir / WANDB_ID_FILE
        if id_path.exists():
            run_id = id_path.read_text(encoding="utf-8").strip()
        else:
            run_id = uuid.uuid4().hex[:12]
            id_path.write_text(run_id + "\n", encoding="utf-8")
        self.run_id = run_id
        self._run = None
        self._finished = False
        if mode == "disabled":
            # No wandb at all: not even its import (a second of start-up, and a package that GPU
            # images often lack).
            return
        import wandb

        self._run = wandb.init(
            project=project,
            name=run_name,
            dir=str(self.run_dir),
            mode=mode,
            config=config,
            id=run_id,
            resume="allow",
            # Quiet: no banner on the console. console="off" leaves stdout alone, where wandb's
            # capture would otherwise interleave with our progress bars.
            settings=wandb.Settings(silent=True, console="off"),
        )
        self._run.define_metric("step")
        self._run.define_metric("*", step_metric="step")

    def _truncate_history(self, resume_step: int | None) -> None:
        """Drop rows and images after `resume_step`, and a cut-off last row (atomic rewrite)."""
        rows, cut_off = read_jsonl_cut_off(self.metrics_path)
        if resume_step is not None:
            kept = [r for r in rows if r["step"] <= resume_step]
            for image in (self.run_dir / IMAGES_DIR).glob("*.png"):
                match = _IMAGE_STEP_RE.fullmatch(image.name)
                if match and int(match.group(1)) > resume_step:
                    image.unlink()
        else:
            kept = rows
        if cut_off or len(kept) != len(rows):
            tmp = self.metrics_path.with_name(f".{METRICS_FILE}.tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
            os.replace(tmp, self.metrics_path)

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Append {"step": step, **metrics} to metrics.jsonl and log it to wandb.

        Args:
            metrics: Name to number (python, numpy or one-element tensor); "step" is reserved.
            step: Training step.
        """
        row: dict[str, float | int] = {"step": int(step)}
        for name, value in metrics.items():
            if name == "step":
                raise ValueError('"step" is reserved for the step argument; rename the metric')
            try:
                row[name] = float(value)
            except (TypeError, ValueError) as e:
                raise ValueError(f"metric {name!r} must be a single number, got {value!r}") from e
        with open(self.metrics_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        if self._run is not None:
            self._run.log(row)

    def log_images(self, key: str, images: torch.Tensor, captions: list[str], step: int, nrow: int) -> Path:
        """Save a grid of images to `run_dir/images/{key}-{step:06d}.png` and log it to wandb.

        Args:
            key: wandb key, e.g. "samples/eval"; "/" becomes "_" in the file name.
            images: (B, 3, H, W) floats in [0, 1].
            captions: One per image (prompts, rewards); joined into the wandb caption.
            step: Training step.
            nrow: Images per row of the grid.

        Returns:
            The PNG path.
        """
        if len(captions) != images.shape[0]:
            raise ValueError(f"got {len(captions)} captions for {images.shape[0]} images; pass one per image")
        grid = labelled_grid(images, nrow, captions)
        path = self.run_dir / IMAGES_DIR / f"{key.replace('/', '_')}-{step:06d}.png"
        path.parent.mkdir(exist_ok=True)
        grid.save(path)
        caption = " | ".join(f"{i}: {c}" for i, c in enumerate(captions))
        if self._run is not None:
            import wandb

            self._run.log({key: wandb.Image(grid, caption=caption), "step": int(step)})
        return path

    def finish(self, exit_code: int = 0) -> None:
        """Close the wandb run (once; later calls do nothing). A non-zero code marks it failed."""
        if not self._finished:
            if self._run is not None:
                self._run.finish(exit_code=exit_code)
            self._finished = True

    def __enter__(self) -> Tracker:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.finish(exit_code=0 if exc_type is None else 1)


def run_tracker(run_dir: str | os.PathLike, cfg, *, is_main: bool, resume_step: int):
    """A training run's tracker (metrics.jsonl, wandb, images) from its recipe's `log` section, on
    the rank that writes (`is_main`); a context that does nothing on the others."""
    if not is_main:
        return contextlib.nullcontext()
    return Tracker(
        run_dir,
        project=cfg.log.wandb_project,
        run_name=cfg.name,
        mode=cfg.log.wandb_mode,
        config=to_dict(cfg),
        resume_step=resume_step,
    )


@contextlib.contextmanager
def iteration_progress(console, title: str, *, total: int, completed: int):
    """A training loop's progress bar on `console`: yields (bar, task id) for `bar.update(task, ...)`."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = [
        TextColumn(f"[bold]{title}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.description}"),
    ]
    with Progress(*columns, console=console) as bar:
        yield bar, bar.add_task("", total=total, completed=completed)


def run_summary(
    values: list[float], *, names: tuple[str, str], window: int, start_iter: int, seconds: float, last_ckpt
) -> dict:
    """What a training run prints and returns at its end: iterations, the mean of `values` (one per
    iteration) over its first and last few iterations (at most `window`, at most half the run) under
    `names`, its wall time and its last checkpoint."""
    window = max(1, min(window, len(values) // 2))
    first, last = names
    return {
        "iterations": start_iter + len(values),
        "iterations_this_run": len(values),
        first: float(np.mean(values[:window])) if values else None,
        last: float(np.mean(values[-window:])) if values else None,
        "seconds": round(seconds, 1),
        "checkpoint": str(last_ckpt) if last_ckpt else None,
    }


def print_run_summary(console, title: str, summary: dict, labels: dict[str, str] | None = None) -> None:
    """`summary` as a table on `console`; `labels` names (and selects) its rows, else every key is one."""
    from rich.table import Table

    table = Table(title=title, show_header=False)
    for key, label in (labels or {k: k.replace("_", " ") for k in summary}).items():
        value = summary[key]
        table.add_row(label, f"{value:.4f}" if isinstance(value, float) and key != "seconds" else str(value))
    console.print(table)
