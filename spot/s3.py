"""The S3 back end of `spot.store`, through boto3; works with AWS, MinIO and moto's server.

Retries come in two layers. botocore retries each HTTP request (`S3Options.request_attempts`,
its "standard" mode: throttling, 5xx, dropped connections), which keeps one failed part of a
multipart upload from restarting the whole file. Around it, each store operation (a whole upload,
download, listing, the manifest write) is retried `S3Options.attempts` times with exponential
backoff and jitter, for failures botocore does not retry (a stream cut mid-download, an endpoint
down longer than its tries). Then a `StoreError` names the object's URL and the cause.

Credentials come only from boto3's standard chain (environment, shared profile, instance role):
`S3Options` has no field for them and `open_store` refuses URLs that carry them. botocore's DEBUG
log prints request headers, whose Authorization header holds the access key id and whose
X-Amz-Security-Token holds the session token; `S3Store` attaches a filter to botocore's loggers that
masks both, and the same masking is applied to every error message.
"""

from __future__ import annotations

import io
import logging
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import boto3
import botocore.config
import botocore.exceptions
from boto3.s3.transfer import TransferConfig
from s3transfer.exceptions import RetriesExceededError

from spot.store_base import Store, check_key, check_prefix, write_atomically
from spotlight.core.aws import install_log_redaction, redact
from spotlight.core.files import MissingKeyError, StoreError

logger = logging.getLogger(__name__)

MiB = 1 << 20
_MIN_PART = 5 * MiB  # S3's smallest part, except the last


@dataclass
class S3Options:
    """How to reach S3 and move data; never credentials (those come from the standard AWS chain)."""

    endpoint_url: str | None = None
    """S3 endpoint, e.g. "http://127.0.0.1:9000" for MinIO or moto; None: AWS (or AWS_ENDPOINT_URL_S3)."""
    region: str | None = None
    """AWS region; None: from the standard chain (AWS_REGION, AWS_DEFAULT_REGION, the profile)."""
    multipart_threshold: int = 64 * MiB
    """Files at least this big move in parts (multipart upload, ranged download)."""
    multipart_chunksize: int = 64 * MiB
    """Size of one part; at least 5 MiB, S3's minimum."""
    max_concurrency: int = 8
    """Parts in flight at once for one file."""
    request_attempts: int = 5
    """Tries per HTTP request, botocore's standard retry mode; each part of a transfer retries alone."""
    attempts: int = 3
    """Tries per store operation (a whole upload, download, listing) once a request gave up."""
    backoff_s: float = 1.0
    """Wait before the second try of an operation; doubled for each later try, with jitter."""
    max_backoff_s: float = 30.0
    """Longest wait between two tries of an operation."""
    connect_timeout_s: float = 10.0
    """Seconds to open a connection."""
    read_timeout_s: float = 60.0
    """Seconds to wait for data on an open connection."""

    def __post_init__(self) -> None:
        if self.endpoint_url is not None:
            parts = urlsplit(self.endpoint_url)
            if parts.scheme not in ("http", "https") or not parts.netloc:
                raise ValueError("endpoint_url must look like http://host:port or https://host")
            # Anywhere in the URL: a secret key may hold '/', which ends the netloc early.
            if "@" in self.endpoint_url or parts.query:
                # Not echoed: the offending part may be a secret.
                raise ValueError(
                    "endpoint_url must not carry credentials or a query; credentials come only "
                    "from the standard AWS chain (environment, profile, instance role)"
                )
        if self.multipart_chunksize < _MIN_PART:
            raise ValueError(
                f"multipart_chunksize must be >= {_MIN_PART} (5 MiB, S3's minimum part), got {self.multipart_chunksize}"
            )
        if self.multipart_threshold < 1:
            raise ValueError(f"multipart_threshold must be >= 1 byte, got {self.multipart_threshold}")
        for name in ("max_concurrency", "request_attempts", "attempts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.backoff_s <= self.max_backoff_s:
            raise ValueError(f"need 0 <= backoff_s <= max_backoff_s, got {self.backoff_s} and {self.max_backoff_s}")


_TRANSIENT_CODES = {
    "InternalError",
    "ServiceUnavailable",
    "SlowDown",
    "RequestTimeout",
    "Throttling",
    "ThrottlingException",
    "RequestLimitExceeded",
}
_TRANSIENT_ERRORS = (
    botocore.exceptions.ConnectionError,  # endpoint down, connect timeout
    botocore.exceptions.HTTPClientError,  # connection closed, read timeout, stream cut
    botocore.exceptions.IncompleteReadError,
    RetriesExceededError,  # s3transfer's ranged download gave up
)


def _chain(e: BaseException) -> list[BaseException]:
    """`e` and the exceptions it wraps (boto3 wraps a ClientError in S3UploadFailedError)."""
    seen: list[BaseException] = []
    while e is not None and e not in seen:
        seen.append(e)
        e = e.__cause__ or e.__context__
    return seen


def _client_error(e: BaseException) -> botocore.exceptions.ClientError | None:
    return next((x for x in _chain(e) if isinstance(x, botocore.exceptions.ClientError)), None)


def _is_missing(e: BaseException) -> bool:
    err = _client_error(e)
    return err is not None and (err.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"))


def _is_transient(e: BaseException) -> bool:
    if any(isinstance(x, _TRANSIENT_ERRORS) for x in _chain(e)):
        return True
    err = _client_error(e)
    if err is None:
        return False
    status = err.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
    return status >= 500 or status == 429 or err.response.get("Error", {}).get("Code") in _TRANSIENT_CODES


def _describe(e: BaseException) -> str:
    if isinstance(e, botocore.exceptions.NoCredentialsError):
        return (
            "no AWS credentials in the standard chain (set AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE, or run with an instance role)"
        )
    return f"{type(e).__name__}: {e}"


class S3Store(Store):
    """Objects under `s3://bucket/prefix`; see the module docstring for retries and credentials."""

    def __init__(self, bucket: str, prefix: str = "", options: S3Options | None = None):
        self.options = options or S3Options()
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        if self.prefix:
            check_key(self.prefix)
        self.url = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        opts = self.options
        config = botocore.config.Config(
            retries={"mode": "standard", "total_max_attempts": opts.request_attempts},
            connect_timeout=opts.connect_timeout_s,
            read_timeout=opts.read_timeout_s,
            max_pool_connections=max(10, opts.max_concurrency),
            # MinIO and other stand-ins serve buckets as paths, not as host names.
            s3={"addressing_style": "path"} if opts.endpoint_url else None,
        )
        # A session of our own: boto3's default one is shared and not thread-safe to create clients from.
        session = boto3.session.Session(region_name=opts.region)
        self.client = session.client("s3", endpoint_url=opts.endpoint_url, config=config)
        self.transfer = TransferConfig(
            multipart_threshold=opts.multipart_threshold,
            multipart_chunksize=opts.multipart_chunksize,
            max_concurrency=opts.max_concurrency,
            num_download_attempts=opts.request_attempts,
            preferred_transfer_client="classic",  # the CRT client ignores part of this config
        )
        install_log_redaction()

    def __repr__(self) -> str:
        return f"S3Store({self.url!r}, endpoint_url={self.options.endpoint_url!r})"

    def _key(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _call(self, what: str, key: str, fn: Callable[[], Any]) -> Any:
        """`fn()`, retried on transient errors; failures become StoreError naming the object."""
        opts = self.options
        for attempt in range(1, opts.attempts + 1):
            try:
                return fn()
            except Exception as e:
                if _is_missing(e):
                    raise MissingKeyError(f"{self.where(key)}: no such object") from e
                if not _is_transient(e) or attempt == opts.attempts:
                    tries = f"{attempt} operation tr{'y' if attempt == 1 else 'ies'}"
                    raise StoreError(redact(f"{self.where(key)}: {what} failed after {tries}: {_describe(e)}")) from e
                delay = min(opts.max_backoff_s, opts.backoff_s * 2 ** (attempt - 1)) * random.uniform(0.5, 1.0)
                logger.warning(
                    "%s: %s failed (%s), try %d of %d; retrying in %.2f s",
                    self.where(key),
                    what,
                    redact(_describe(e)),
                    attempt,
                    opts.attempts,
                    delay,
                )
                time.sleep(delay)
        raise AssertionError("unreachable")

    def put_file(self, key: str, path: str | os.PathLike) -> None:
        full = self._key(key)
        self._call(
            f"put_file from {path}",
            key,
            lambda: self.client.upload_file(os.fspath(path), self.bucket, full, Config=self.transfer),
        )
        logger.debug("put_file %s <- %s", self.where(key), path)

    def put_bytes(self, key: str, data: bytes) -> None:
        full = self._key(key)
        # A fresh stream for every try: a failed one may have been read partway.
        self._call(
            "put_bytes",
            key,
            lambda: self.client.upload_fileobj(io.BytesIO(data), self.bucket, full, Config=self.transfer),
        )
        logger.debug("put_bytes %s (%d bytes)", self.where(key), len(data))

    def get_file(self, key: str, path: str | os.PathLike) -> Path:
        full, dest = self._key(key), Path(path)

        def download() -> None:
            write_atomically(dest, lambda f: self.client.download_fileobj(self.bucket, full, f, Config=self.transfer))

        self._call(f"get_file to {dest}", key, download)
        logger.debug("get_file %s -> %s", self.where(key), dest)
        return dest

    def get_bytes(self, key: str) -> bytes:
        full = self._key(key)
        return self._call("get_bytes", key, lambda: self.client.get_object(Bucket=self.bucket, Key=full)["Body"].read())

    def exists(self, key: str) -> bool:
        full = self._key(key)

        def head() -> bool:
            try:
                self.client.head_object(Bucket=self.bucket, Key=full)
            except botocore.exceptions.ClientError as e:
                if _is_missing(e):
                    return False
                raise
            return True

        return self._call("exists", key, head)

    def delete(self, key: str) -> None:
        full = self._key(key)
        self._call("delete", key, lambda: self.client.delete_object(Bucket=self.bucket, Key=full))
        logger.debug("deleted %s", self.where(key))

    def list_sizes(self, prefix: str = "") -> dict[str, int]:
        check_prefix(prefix)
        base = f"{self.prefix}/" if self.prefix else ""

        def listing() -> dict[str, int]:
            sizes = {}
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=base + prefix):
                for obj in page.get("Contents", []):
                    sizes[obj["Key"][len(base) :]] = obj["Size"]
            return sizes

        return self._call("list", prefix, listing)
