"""The store's contract, shared by its back ends: `Store`, its errors, keys, and atomic folders.

`spot.store` opens a store by URL and holds the local back end (`LocalStore`); `spot.s3` holds the
S3 one (`S3Store`). Both subclass `Store` from here, so `spot.s3` needs nothing from `spot.store`,
which imports it only to open an s3:// URL (no import cycle).

Objects are named by keys, '/'-separated relative paths ("checkpoints/step-00000012/lora.safetensors").

A published folder is complete when its manifest is. `publish_dir` first deletes the folder's old
manifest, then uploads every file, then writes `<folder>/store-manifest.json` (size and sha256 of
each file) last. One object is written atomically by both back ends (an S3 PUT; locally a temp
file, fsync, os.replace), so a reader that finds the manifest finds every file it names, and a
publish that dies midway leaves objects but no manifest: `latest` skips the folder and `fetch_dir`
refuses it. `fetch_dir` re-hashes every file against the manifest and moves the folder into place
only when all match, so a corrupt or overwritten object is refused with its key named.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from spotlight.core.files import MissingKeyError, StoreError, fsync_path

logger = logging.getLogger(__name__)

MANIFEST_NAME = "store-manifest.json"
"""Name of the object that makes a published folder visible; written last."""
FORMAT_VERSION = 1
TMP_PREFIX = ".tmp-"
"""Names starting with this are half-written local files; keys may not use it."""
_STEP_DIR_RE = re.compile(r"step-(\d+)")


class IncompleteError(StoreError):
    """A folder has no manifest (never published, or its publish did not finish) or a bad one."""


def check_key(key: str) -> str:
    """Return `key` if it is a valid object key, else raise ValueError saying what a key looks like."""
    parts = key.split("/") if isinstance(key, str) else [""]
    if (
        not key
        or "\\" in key
        or any(ord(c) < 32 for c in key)
        or any(p in ("", ".", "..") or p.startswith(TMP_PREFIX) for p in parts)
    ):
        raise ValueError(
            f"store key {key!r} must be a relative '/'-separated path with no empty, '.', '..' or "
            f"'{TMP_PREFIX}*' parts, e.g. 'checkpoints/step-00000012/lora.safetensors'"
        )
    return key


def check_prefix(prefix: str) -> str:
    """A listing prefix: "" or a key, optionally ending in '/'."""
    if prefix:
        check_key(prefix[:-1] if prefix.endswith("/") else prefix)
    return prefix


def _hash_file(path: Path) -> tuple[int, str]:
    """Size in bytes and sha256 hex digest of a file, read once."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


def write_atomically(dest: Path, write: Callable[[IO[bytes]], Any]) -> None:
    """Write `dest` through a temp sibling: `write(f)`, fsync, os.replace, fsync the directory."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f"{TMP_PREFIX}{dest.name}-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(dest.parent)


class Store(ABC):
    """Objects under one URL, plus folders published atomically (see the module docstring)."""

    url: str
    """Where the store lives, "file:///abs/path" or "s3://bucket/prefix"; never holds credentials."""

    def where(self, key: str) -> str:
        """The URL of one object, for messages."""
        return f"{self.url}/{key}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    @abstractmethod
    def put_file(self, key: str, path: str | os.PathLike) -> None:
        """Store the file at `path` as `key`, replacing any object there."""

    @abstractmethod
    def put_bytes(self, key: str, data: bytes) -> None:
        """Store `data` as `key`, replacing any object there."""

    @abstractmethod
    def get_file(self, key: str, path: str | os.PathLike) -> Path:
        """Write object `key` to `path` (created or replaced whole, never half); returns the path.

        Raises:
            MissingKeyError: There is no such object.
        """

    @abstractmethod
    def get_bytes(self, key: str) -> bytes:
        """The content of object `key`; MissingKeyError if there is none."""

    @abstractmethod
    def exists(self, key: str) -> bool:
        """Whether object `key` exists."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove object `key`; removing a missing object is not an error."""

    @abstractmethod
    def list_sizes(self, prefix: str = "") -> dict[str, int]:
        """Key to size in bytes of every object whose key starts with `prefix` (a string prefix, as S3's)."""

    def list(self, prefix: str = "") -> list[str]:
        """Sorted keys of the objects whose key starts with `prefix` ("ckpt/" lists a folder)."""
        return sorted(self.list_sizes(prefix))

    def publish_dir(self, key_prefix: str, local_dir: str | os.PathLike) -> dict:
        """Upload the files under `local_dir` as folder `key_prefix`, visible only once complete.

        Republishing a folder replaces it: it is invisible from the first step until the new manifest
        lands, and objects the new manifest does not name are removed afterwards.

        Args:
            key_prefix: The folder's key, e.g. "checkpoints/step-00000012".
            local_dir: A directory; every regular file under it is published, relative paths kept.

        Returns:
            The manifest that was written.
        """
        folder = check_key(key_prefix)
        src = Path(local_dir)
        if not src.is_dir():
            raise ValueError(f"{src}: not a directory; publish_dir publishes a folder")
        files = sorted(p for p in src.rglob("*") if p.is_file())
        rels = [check_key(p.relative_to(src).as_posix()) for p in files]
        if MANIFEST_NAME in rels:
            raise ValueError(f"{src / MANIFEST_NAME}: the store writes this name itself; rename the file")
        manifest_key = f"{folder}/{MANIFEST_NAME}"
        entries = {}
        try:
            # Unpublish first, so that no reader pairs the old manifest with half-replaced files.
            self.delete(manifest_key)
            for path, rel in zip(files, rels):
                size, sha256 = _hash_file(path)
                entries[rel] = {"size": size, "sha256": sha256}
                self.put_file(f"{folder}/{rel}", path)
            manifest = {"format_version": FORMAT_VERSION, "files": entries}
            self.put_bytes(manifest_key, json.dumps(manifest, indent=1, sort_keys=True).encode())
        except StoreError as e:
            raise StoreError(f"{self.where(folder)}: publish_dir failed, no new version is visible; {e}") from e
        # Leftovers of an earlier publish of this folder, or of one that died midway. They are not
        # in the manifest, so failing to remove them now is harmless: the next publish retries.
        try:
            for key in self.list(folder + "/"):
                rel = key[len(folder) + 1 :]
                if rel != MANIFEST_NAME and rel not in entries:
                    self.delete(key)
        except StoreError as e:
            logger.warning("published %s, but left objects of an older version: %s", self.where(folder), e)
        logger.info(
            "published %s (%d files, %d bytes)",
            self.where(folder),
            len(entries),
            sum(e["size"] for e in entries.values()),
        )
        return manifest

    def read_manifest(self, key_prefix: str) -> dict[str, tuple[int, str]]:
        """Relative path to (size, sha256) of each file of a published folder.

        Raises:
            IncompleteError: The folder has no manifest, or a malformed one.
        """
        key = f"{check_key(key_prefix)}/{MANIFEST_NAME}"
        try:
            raw = self.get_bytes(key)
        except MissingKeyError as e:
            raise IncompleteError(
                f"{self.where(key_prefix)}: not a complete published folder, {MANIFEST_NAME} is "
                "missing (nothing was published there, or the publish did not finish)"
            ) from e
        try:
            manifest = json.loads(raw)
            if manifest["format_version"] != FORMAT_VERSION:
                raise ValueError(f"format_version {manifest['format_version']!r}, this reads {FORMAT_VERSION}")
            files = {check_key(rel): (int(e["size"]), str(e["sha256"])) for rel, e in manifest["files"].items()}
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise IncompleteError(f"{self.where(key)}: malformed manifest ({e})") from e
        return files

    def fetch_dir(self, key_prefix: str, local_dir: str | os.PathLike) -> Path:
        """Download a published folder to `local_dir`, verifying every file against its manifest.

        The files land in a temp sibling of `local_dir`, which is renamed into place only when all
        of them match; on any error nothing is left at `local_dir`.

        Args:
            key_prefix: The folder's key, e.g. what `latest` returned.
            local_dir: A directory that does not exist yet, or an empty one.

        Raises:
            IncompleteError: The folder is not completely published.
            StoreError: An object is missing, or its size or sha256 differs from the manifest.
        """
        dest = Path(local_dir)
        if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
            raise ValueError(f"{dest}: exists and is not an empty directory; fetch_dir needs a new or empty one")
        files = self.read_manifest(key_prefix)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f"{TMP_PREFIX}{dest.name}-{uuid.uuid4().hex[:8]}")
        try:
            tmp.mkdir()
            for rel, (expected_size, expected_sha256) in files.items():
                key = f"{key_prefix}/{rel}"
                try:
                    size, sha256 = _hash_file(self.get_file(key, tmp / rel))
                except MissingKeyError as e:
                    raise StoreError(f"{e}; it is listed in the manifest, folder refused") from e
                if size != expected_size:
                    raise StoreError(
                        f"{self.where(key)}: {size} bytes, the manifest says {expected_size} "
                        "(object truncated or overwritten); folder refused"
                    )
                if sha256 != expected_sha256:
                    raise StoreError(
                        f"{self.where(key)}: sha256 does not match the manifest (object corrupt or "
                        "overwritten); folder refused"
                    )
            fsync_path(tmp)
            os.replace(tmp, dest)  # also replaces an empty directory
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        fsync_path(dest.parent)
        logger.info("fetched %s to %s (%d files)", self.where(key_prefix), dest, len(files))
        return dest

    def latest(self, prefix: str) -> str | None:
        """The key of the highest-numbered complete folder `<prefix>/step-<N>`, or None."""
        return next(self.complete_folders(prefix), None)

    def complete_folders(self, prefix: str) -> Iterator[str]:
        """The keys of the complete folders `<prefix>/step-<N>`, highest step first.

        A folder is complete when its manifest parses and every file it names is listed with the
        manifest's size (one listing call); checksums are verified by `fetch_dir`. Incomplete
        folders are skipped with a warning, folders not named `step-<N>` are ignored.
        """
        base = f"{check_key(prefix.rstrip('/'))}/" if prefix.rstrip("/") else ""
        sizes = self.list_sizes(base)
        folders: dict[int, str] = {}
        for key in sizes:
            name, _, rest = key[len(base) :].partition("/")
            match = _STEP_DIR_RE.fullmatch(name)
            if match and rest == MANIFEST_NAME:
                folders[int(match.group(1))] = base + name
        for step in sorted(folders, reverse=True):
            folder = folders[step]
            try:
                files = self.read_manifest(folder)
            except IncompleteError as e:
                logger.warning("skipping %s: %s", folder, e)
                continue
            missing = [rel for rel, (size, _) in files.items() if sizes.get(f"{folder}/{rel}") != size]
            if missing:
                logger.warning(
                    "skipping %s: %d file(s) missing or of the wrong size, e.g. %s",
                    self.where(folder),
                    len(missing),
                    missing[0],
                )
                continue
            yield folder
