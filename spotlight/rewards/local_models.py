"""What the model-based rewards share: local-only weights, device choice, 8-bit images, batches.

Shape legend: B batch, H height, W width.

Reward models load only from a local directory: training machines may have no network, and a
silent download of gigabytes on every worker is worse than an error that says what to fetch.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch


def require_local_dir(reward: str, field: str, path: str, download: str) -> Path:
    """The directory `path`, or a ValueError that names the reward, the field and what to download.

    Args:
        reward: the registered reward name, e.g. "ocr".
        field: the config field that gives the path, e.g. "reward.ocr_model_path".
        path: its value.
        download: what a user fetches, e.g. "the Hugging Face repo microsoft/trocr-base-printed".
    """
    if not path or not Path(path).expanduser().is_dir():
        raise ValueError(
            f"reward {reward!r}: {field} is {path!r}, which is not a local directory. Download "
            f"{download} to local disk (e.g. `huggingface-cli download REPO --local-dir /models/NAME`) "
            f"and set {field} to that folder; nothing is downloaded at run time"
        )
    return Path(path).expanduser()


def pick_device(device: str) -> torch.device:
    """`device`, or cuda when available and cpu otherwise when it is empty."""
    return torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))


def to_uint8_images(images_B3HW: torch.Tensor) -> list[np.ndarray]:
    """(H, W, 3) uint8 RGB arrays of images in [0, 1], rounded as saving a PNG would.

    Reward models' processors were fit on 8-bit images, so we quantise as a saved image would be.
    """
    images_BHW3 = (images_B3HW.detach().float().clamp(0, 1) * 255).round().to(torch.uint8)
    return list(images_BHW3.permute(0, 2, 3, 1).cpu().numpy())


def batch_slices(num_items: int, batch_size: int) -> Iterator[slice]:
    """Consecutive slices of at most `batch_size` covering range(num_items)."""
    if batch_size < 1:
        raise ValueError(f"reward.batch_size is {batch_size}; use 1 or more")
    for start in range(0, num_items, batch_size):
        yield slice(start, min(start + batch_size, num_items))
