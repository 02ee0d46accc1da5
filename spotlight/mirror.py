"""Mirror a run's checkpoints to a store, so that a trainer restarted elsewhere resumes from it.

A trainer on a spot or on-demand node can lose its disk with the node. With `log.store_url` set,
every checkpoint `spotlight train` saves is also published to the store (a local folder or
`s3://bucket/prefix`, `spot.store`) as `checkpoints/step-<N>/`, together with a snapshot of the
run's `metrics.jsonl` and cost ledger at that step. A run started with an empty run directory (a
new machine) fetches the newest complete checkpoint from the store, verified file by file, and
continues from it: the resumed run's parameters and metrics are those of an uninterrupted run.
(The GPU time a lost machine spent after its last checkpoint is missing from the restored ledger:
it was never published.)

Layout in the store::

    <store_url>/checkpoints/step-00000012/
        trainable.safetensors, optimizer.*, rng.json, meta.json, config.yaml, manifest.json
        metrics.jsonl            the run's metrics rows up to step 12
        cost.json                the run's cost ledger then (spotlight.core.cost)
        store-manifest.json      written last (spot.store_base): the folder is visible only when complete

Publishing is synchronous: a checkpoint step returns once the store holds the folder, so "resumed
from step N" never names a step the store does not have. The store keeps the `keep_last` newest
folders, like the run directory; older ones are unpublished first (manifest deleted), then removed.

Credentials come from the standard AWS chain only (environment, profile, instance role); an S3
endpoint other than AWS's (MinIO, moto) is set with the standard `AWS_ENDPOINT_URL_S3` variable.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from spot.store import open_store
from spot.store_base import MANIFEST_NAME, Store
from spotlight.core.checkpoint import find_latest_checkpoint, set_latest, step_of
from spotlight.core.files import StoreError

logger = logging.getLogger(__name__)

PREFIX = "checkpoints"
"""Folder of the store that holds the step folders."""
METRICS_FILE = "metrics.jsonl"
COST_FILE = "cost.json"  # spotlight.core.cost.COST_FILE


class CheckpointMirror:
    """Publishes a run's checkpoints to a store and brings the newest one back.

    Args:
        url: Store URL (a local path, file:///path or s3://bucket/prefix).
        keep_last: Step folders kept in the store, >= 1.
        store: An already opened store (tests); overrides `url`.
    """

    def __init__(self, url: str, *, keep_last: int = 3, store: Store | None = None):
        if keep_last < 1:
            raise ValueError(f"log.keep_last must be >= 1, got {keep_last}")
        self.store = store if store is not None else open_store(url)
        self.keep_last = keep_last
        self.guard: Callable[[], None] | None = None
        """Called before every write to the store; raises when this process may no longer write
        (`RunLock.check`: a newer trainer took the run over)."""

    def publish(self, step_dir: Path, run_dir: Path) -> str:
        """Publish the checkpoint `step_dir` plus the run's metrics so far; returns the folder key."""
        step = step_of(step_dir)
        assert step is not None, step_dir
        key = f"{PREFIX}/{step_dir.name}"
        if self.guard is not None:
            self.guard()
        # Stage links to the checkpoint's files plus a copy of the metrics, so the published folder
        # is one snapshot (one store manifest) and the local checkpoint stays as save_checkpoint left it.
        with tempfile.TemporaryDirectory(prefix=".publish-", dir=run_dir) as tmp:
            stage = Path(tmp)
            for f in step_dir.iterdir():
                if f.is_file():
                    try:
                        os.link(f, stage / f.name)
                    except OSError:  # a file system without hard links
                        shutil.copyfile(f, stage / f.name)
            for name in (METRICS_FILE, COST_FILE):
                if (run_dir / name).is_file():
                    shutil.copyfile(run_dir / name, stage / name)
            self.store.publish_dir(key, stage)
        if self.guard is not None:
            self.guard()  # taken over meanwhile: leave the newer holder's folders alone
        self._prune(step)
        return key

    def _prune(self, newest: int) -> None:
        steps = sorted(self._published_steps())
        for step in [s for s in steps if s <= newest][: -self.keep_last] + [s for s in steps if s > newest]:
            # Steps above the newest belong to a timeline a resumed run replaced (as save_checkpoint).
            folder = f"{PREFIX}/step-{step:08d}"
            try:
                self.store.delete(f"{folder}/{MANIFEST_NAME}")  # unpublish first
                for key in self.store.list(folder + "/"):
                    self.store.delete(key)
            except StoreError as e:
                logger.warning("could not remove the old checkpoint %s from the store: %s", self.store.where(folder), e)

    def _published_steps(self) -> list[int]:
        steps = set()
        for key in self.store.list(PREFIX + "/"):
            name, _, rest = key[len(PREFIX) + 1 :].partition("/")
            step = step_of(Path(name))
            if step is not None and rest == MANIFEST_NAME:
                steps.add(step)
        return list(steps)

    def restore(self, run_dir: Path) -> Path | None:
        """Fetch the store's newest checkpoint into `run_dir` when it is newer than the run dir's own.

        Returns:
            The fetched step dir, or None when the store has nothing newer (the run dir's own
            checkpoint, if any, is then the one to resume from).
        """
        local = find_latest_checkpoint(run_dir)
        for folder in self.store.complete_folders(PREFIX):
            step = step_of(Path(folder))
            if local is not None and (step_of(local) or 0) >= step:
                return None
            dest = run_dir / "checkpoints" / Path(folder).name
            if dest.exists():  # an incomplete leftover of this run dir (no manifest); the store's is whole
                shutil.rmtree(dest)
            try:
                self.store.fetch_dir(folder, dest)
            except StoreError as err:  # a damaged copy in the store: the one before it will do
                shutil.rmtree(dest, ignore_errors=True)
                logger.warning(
                    "%s is damaged in the store (%s); trying the previous one", self.store.where(folder), err
                )
                continue
            break
        else:
            return None
        set_latest(dest)
        if (dest / METRICS_FILE).is_file():
            # The store's rows up to `step` replace the run dir's; Tracker drops any row after the step.
            shutil.copyfile(dest / METRICS_FILE, run_dir / METRICS_FILE)
        if (dest / COST_FILE).is_file() and not (run_dir / COST_FILE).is_file():
            # Money spent after a checkpoint stays spent: a run dir's own ledger wins over the snapshot.
            shutil.copyfile(dest / COST_FILE, run_dir / COST_FILE)
        logger.info("fetched checkpoint %s from %s", dest.name, self.store.where(folder))
        return dest
