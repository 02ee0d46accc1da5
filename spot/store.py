"""Where checkpoints and published weights live: a local directory or S3, behind one `Store`.

    store = open_store("s3://bucket/runs/exp1", s3=S3Options(region="us-east-1"))
    store.publish_dir("checkpoints/step-00000012", "run/checkpoints/step-00000012")
    folder = store.latest("checkpoints")     # "checkpoints/step-00000012", or None
    store.fetch_dir(folder, "/tmp/resume/step-00000012")

The URL picks the back end: a path or `file:///path` (the default) is a local directory
(`LocalStore`, here); `s3://bucket/prefix` is S3 through boto3 (`spot.s3.S3Store`, imported only
then). What every store does, keys and folders published atomically, is `spot.store_base.Store`.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlsplit

from spot.store_base import TMP_PREFIX, Store, check_key, check_prefix, write_atomically
from spotlight.core.files import MissingKeyError, StoreError, fsync_path

if TYPE_CHECKING:
    from spot.s3 import S3Options

logger = logging.getLogger(__name__)

_BUCKET_RE = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")


class LocalStore(Store):
    """Objects as files under a root directory; each written through a temp file, fsync, os.replace."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root).expanduser().absolute()
        self.url = self.root.as_uri()

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def _fail(self, key: str, what: str, e: OSError) -> StoreError:
        return StoreError(f"{self.where(key)}: {what} failed: {e}")

    def put_file(self, key: str, path: str | os.PathLike) -> None:
        dest = self._path(key)
        try:
            with open(path, "rb") as src:
                write_atomically(dest, lambda f: shutil.copyfileobj(src, f, 1 << 22))
        except OSError as e:
            raise self._fail(key, f"put_file from {path}", e) from e
        logger.debug("put_file %s <- %s", self.where(key), path)

    def put_bytes(self, key: str, data: bytes) -> None:
        try:
            write_atomically(self._path(key), lambda f: f.write(data))
        except OSError as e:
            raise self._fail(key, "put_bytes", e) from e
        logger.debug("put_bytes %s (%d bytes)", self.where(key), len(data))

    def get_file(self, key: str, path: str | os.PathLike) -> Path:
        src, dest = self._path(key), Path(path)
        try:
            with open(src, "rb") as f:
                write_atomically(dest, lambda out: shutil.copyfileobj(f, out, 1 << 22))
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as e:
            if not src.is_file():
                raise MissingKeyError(f"{self.where(key)}: no such object") from e
            raise self._fail(key, f"get_file to {dest}", e) from e
        except OSError as e:
            raise self._fail(key, f"get_file to {dest}", e) from e
        logger.debug("get_file %s -> %s", self.where(key), dest)
        return dest

    def get_bytes(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as e:
            raise MissingKeyError(f"{self.where(key)}: no such object") from e
        except OSError as e:
            raise self._fail(key, "get_bytes", e) from e

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def delete(self, key: str) -> None:
        path = self._path(key)
        if not path.is_file():
            return
        try:
            path.unlink(missing_ok=True)
            fsync_path(path.parent)
        except OSError as e:
            raise self._fail(key, "delete", e) from e
        logger.debug("deleted %s", self.where(key))

    def list_sizes(self, prefix: str = "") -> dict[str, int]:
        head = check_prefix(prefix).rpartition("/")[0]
        base = self.root / head if head else self.root
        sizes = {}
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = [d for d in dirnames if not d.startswith(TMP_PREFIX)]
            for name in filenames:
                path = Path(dirpath, name)
                key = path.relative_to(self.root).as_posix()
                if name.startswith(TMP_PREFIX) or not key.startswith(prefix):
                    continue
                try:
                    sizes[key] = path.stat().st_size
                except FileNotFoundError:  # deleted while we walked
                    continue
        return sizes


def open_store(url: str | os.PathLike, *, s3: S3Options | None = None) -> Store:
    """The store at `url`: a path or "file:///path" (local directory) or "s3://bucket/prefix".

    Args:
        url: Where the store lives. It must not hold credentials: S3 credentials come only from
            the standard AWS chain (environment, profile, instance role).
        s3: Endpoint, region, multipart and retry settings for an S3 URL; ignored for a local one.
    """
    url = os.fspath(url)
    parts = urlsplit(url)
    if parts.scheme == "":
        return LocalStore(url)
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost") or parts.query or parts.fragment:
            raise ValueError(f"{url}: a file URL is file:///absolute/path, with no host, query or fragment")
        return LocalStore(unquote(parts.path))
    if parts.scheme == "s3":
        # The URL is not echoed: what is wrong with it may be a secret. A secret key may hold '/',
        # which ends the netloc early, so '@' is looked for in the whole URL.
        if "@" in url:
            raise ValueError(
                "an S3 store URL must not carry credentials (a 'user:secret@' part); they come only "
                "from the standard AWS chain: AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE "
                "or an instance role"
            )
        if parts.query or parts.fragment:
            raise ValueError(
                f"s3://{parts.netloc}{parts.path}: remove the '?...' or '#...' part; settings go in "
                "S3Options, credentials come only from the standard AWS chain"
            )
        if not parts.netloc:
            raise ValueError(f"{url}: no bucket; write s3://bucket or s3://bucket/prefix")
        if not _BUCKET_RE.fullmatch(parts.netloc):
            raise ValueError(
                "the bucket in an s3:// URL must be 3-63 lowercase letters, digits, '.' or '-' "
                "(write s3://bucket/prefix)"
            )
        from spot.s3 import S3Store  # boto3 is imported only by S3 users

        return S3Store(parts.netloc, check_prefix(unquote(parts.path).strip("/")), s3)
    raise ValueError(f"unsupported store URL scheme {parts.scheme!r}; use a path, file:///path or s3://bucket/prefix")
