"""Small filesystem helpers shared by checkpoints (`spotlight.checkpoint`) and the store (`spot.store`)."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_path(path: Path) -> None:
    """fsync a file or directory (a directory: so that renames into it are durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
