"""A real S3 endpoint for tests: moto's server mode on 127.0.0.1, with fake credentials.

moto's `ThreadedMotoServer` speaks S3 over HTTP, so boto3 talks to it through sockets exactly as to
AWS (no in-process patching). Fake credentials go through the standard chain's first link, the
environment, and must never show up in logs, errors or written files (`SECRETS`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import pytest

FAKE_KEY_ID = "AKIASPOTFAKEKEYID0042"
FAKE_SECRET = "spotFakeSecretKey/do+not+leak+0123456789"
FAKE_TOKEN = "spotFakeSessionToken0123456789abcdef"
SECRETS = (FAKE_KEY_ID, FAKE_SECRET, FAKE_TOKEN)


@contextlib.contextmanager
def fake_aws_environment() -> Iterator[None]:
    """Fake credentials in the environment; no profile files, no instance metadata, no endpoint."""
    with pytest.MonkeyPatch.context() as mp:
        for name in (
            "AWS_PROFILE",
            "AWS_DEFAULT_PROFILE",
            "AWS_ENDPOINT_URL",
            "AWS_ENDPOINT_URL_S3",
            "AWS_ENDPOINT_URL_EC2",
            "AWS_REGION",
            "AWS_DEFAULT_REGION",
        ):
            mp.delenv(name, raising=False)
        mp.setenv("AWS_ACCESS_KEY_ID", FAKE_KEY_ID)
        mp.setenv("AWS_SECRET_ACCESS_KEY", FAKE_SECRET)
        mp.setenv("AWS_SESSION_TOKEN", FAKE_TOKEN)
        mp.setenv("AWS_CONFIG_FILE", os.devnull)
        mp.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
        mp.setenv("AWS_EC2_METADATA_DISABLED", "true")
        yield


@contextlib.contextmanager
def moto_s3(bucket: str) -> Iterator[str]:
    """Run moto's S3 server on a free port of 127.0.0.1 with `bucket` created; yields its URL."""
    from moto.server import ThreadedMotoServer

    from spot.s3 import S3Options, S3Store

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        _, port = server.get_host_and_port()
        endpoint = f"http://127.0.0.1:{port}"
        S3Store(bucket, "", S3Options(endpoint_url=endpoint, region="us-east-1")).client.create_bucket(Bucket=bucket)
        yield endpoint
    finally:
        server.stop()
