"""Small filesystem helpers: fsync for checkpoints (`spotlight.core.checkpoint`), the store
(`spot.store`, `spot.store_base`) and the cost ledger (`spotlight.core.cost`); a JSON-lines reader for a
run's metrics (`spotlight.core.tracking`, `spot.sim.profile`); the errors a store raises, which the
run lock (`spotlight.core.runlock`) catches.

They live in the core, the lowest layer, so that every package can use them.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)


class StoreError(RuntimeError):
    """A store operation failed; the message names the URL of the object and the cause."""


class MissingKeyError(StoreError):
    """The object does not exist."""


def fsync_path(path: Path) -> None:
    """fsync a file or directory (a directory: so that renames into it are durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """The rows of a JSON-lines file, in order; see `read_jsonl_cut_off`."""
    return read_jsonl_cut_off(path)[0]


def read_jsonl_cut_off(path: str | os.PathLike) -> tuple[list[dict], bool]:
    """The rows of a JSON-lines file, and whether its last line was cut off.

    A missing file gives no rows; blank lines are skipped. A last line that is not JSON is skipped
    with a warning: an appending process died mid-write, and the rows before it are fine.

    Raises:
        ValueError: A line other than the last is not JSON; the message names the file and line.
    """
    path = Path(path)
    if not path.exists():
        return [], False
    lines = path.read_text(encoding="utf-8").splitlines()
    rows = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            if i == len(lines) - 1:
                # The process died mid-write; that one row is lost, the file is otherwise fine.
                logger.warning("%s: ignoring a cut-off last line", path)
                return rows, True
            raise ValueError(f"{path}:{i + 1} is not JSON ({e}); fix or delete that line") from e
    return rows, False
