"""The store: the same tests on a local directory and on S3 served by moto over real HTTP.

moto runs in server mode (`ThreadedMotoServer`, bound to 127.0.0.1): boto3 talks to it through
sockets exactly as to AWS, no in-process patching. Fake credentials are set in the environment,
the standard chain's first link, and must never show up in logs, errors or written files.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import uuid
from pathlib import Path

import pytest
from s3_server import FAKE_KEY_ID, FAKE_SECRET, SECRETS, fake_aws_environment, moto_s3

from spot.s3 import S3Options, S3Store
from spot.store import LocalStore, open_store
from spot.store_base import MANIFEST_NAME, IncompleteError
from spotlight.core.aws import redact
from spotlight.core.files import MissingKeyError, StoreError

REPO = Path(__file__).resolve().parents[1]
BUCKET = "spot-store-test"
MiB = 1 << 20


@pytest.fixture(scope="module", autouse=True)
def aws_env():
    with fake_aws_environment():
        yield


@pytest.fixture(scope="module")
def moto_endpoint():
    with moto_s3(BUCKET) as endpoint:
        yield endpoint


def s3_options(endpoint: str, **overrides) -> S3Options:
    """Small parts so that multipart really happens, and quick retries."""
    settings = dict(
        endpoint_url=endpoint,
        region="us-east-1",
        multipart_threshold=1 * MiB,
        multipart_chunksize=5 * MiB,
        request_attempts=2,
        attempts=2,
        backoff_s=0.05,
        max_backoff_s=0.2,
        connect_timeout_s=2,
        read_timeout_s=10,
    )
    settings.update(overrides)
    return S3Options(**settings)


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    if request.param == "local":
        return open_store(tmp_path / "store")
    endpoint = request.getfixturevalue("moto_endpoint")
    return open_store(f"s3://{BUCKET}/{uuid.uuid4().hex[:12]}", s3=s3_options(endpoint))


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_folder(path: Path, files: dict[str, bytes]) -> Path:
    for rel, data in files.items():
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        (path / rel).write_bytes(data)
    return path


def read_folder(path: Path) -> dict[str, bytes]:
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


CKPT = {"lora.safetensors": b"\x01" * 1000, "meta.json": b'{"step": 1}', "sub/rng.json": b"[1, 2]", "empty.txt": b""}


def test_objects_round_trip(store, tmp_path):
    store.put_bytes("a/b/one.bin", b"one")
    assert store.get_bytes("a/b/one.bin") == b"one"
    store.put_bytes("a/b/one.bin", b"uno")  # replaced
    assert store.get_bytes("a/b/one.bin") == b"uno"

    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(3000))
    store.put_file("a/bc/two.bin", src)
    out = store.get_file("a/bc/two.bin", tmp_path / "out" / "two.bin")
    assert out.read_bytes() == src.read_bytes()
    store.put_bytes("z.txt", b"")
    assert store.get_bytes("z.txt") == b""

    assert store.exists("a/b/one.bin") and not store.exists("a/b/nope")
    assert store.list() == ["a/b/one.bin", "a/bc/two.bin", "z.txt"]
    assert store.list("a/b") == ["a/b/one.bin", "a/bc/two.bin"]  # a string prefix, as S3's
    assert store.list("a/b/") == ["a/b/one.bin"]
    assert store.list_sizes("a/bc/") == {"a/bc/two.bin": 3000}
    assert store.list("nothing/") == []

    store.delete("a/b/one.bin")
    store.delete("a/b/one.bin")  # deleting a missing object is fine
    assert not store.exists("a/b/one.bin")
    with pytest.raises(MissingKeyError, match=f"{store.url}/a/b/one.bin: no such object"):
        store.get_bytes("a/b/one.bin")
    with pytest.raises(MissingKeyError, match="a/b/one.bin"):
        store.get_file("a/b/one.bin", tmp_path / "missing.bin")
    assert not (tmp_path / "missing.bin").exists()


def test_bad_keys_are_refused(store):
    for key in ["", "/abs", "a//b", "a/../b", "./a", "a/", "a\\b", "a/.tmp-x", "a\nb"]:
        with pytest.raises(ValueError, match="store key"):
            store.put_bytes(key, b"x")
    with pytest.raises(ValueError, match="store key"):
        store.list("../")
    assert store.list() == []


def test_publish_and_fetch_dir(store, tmp_path):
    src = make_folder(tmp_path / "ckpt", CKPT)
    manifest = store.publish_dir("run/step-00000001", src)
    assert sorted(manifest["files"]) == sorted(CKPT)
    assert store.exists(f"run/step-00000001/{MANIFEST_NAME}")

    out = store.fetch_dir("run/step-00000001", tmp_path / "fetched" / "step-00000001")
    assert read_folder(out) == CKPT
    with pytest.raises(ValueError, match="not an empty directory"):
        store.fetch_dir("run/step-00000001", out)

    # Republishing replaces the folder, leftovers of the old one included.
    (src / "lora.safetensors").write_bytes(b"\x02" * 10)
    (src / "sub" / "rng.json").unlink()
    store.publish_dir("run/step-00000001", src)
    assert store.list("run/step-00000001/") == sorted(
        f"run/step-00000001/{n}" for n in ("lora.safetensors", "meta.json", "empty.txt", MANIFEST_NAME)
    )
    assert read_folder(store.fetch_dir("run/step-00000001", tmp_path / "again")) == read_folder(src)

    (src / MANIFEST_NAME).write_text("{}")
    with pytest.raises(ValueError, match="rename the file"):
        store.publish_dir("run/step-00000002", src)


def test_latest_ignores_incomplete_folders(store, tmp_path):
    assert store.latest("run") is None
    src = make_folder(tmp_path / "ckpt", CKPT)
    for step in (1, 3, 2):
        store.publish_dir(f"run/step-{step:08d}", src)
    store.publish_dir("run/notes", src)  # not a step folder
    store.publish_dir("other/step-00000009", src)  # another prefix
    store.put_bytes("run/step-00000007/lora.safetensors", b"half an upload")  # no manifest
    store.publish_dir("run/step-00000005", src)
    store.delete("run/step-00000005/meta.json")  # a manifest naming a missing file
    store.publish_dir("run/step-00000006", src)
    store.put_bytes(f"run/step-00000006/{MANIFEST_NAME}", b"{not json")

    assert store.latest("run") == "run/step-00000003"
    assert store.latest("run/") == "run/step-00000003"
    assert store.latest("") is None
    with pytest.raises(IncompleteError, match=f"{store.url}/run/step-00000007: not a complete"):
        store.fetch_dir("run/step-00000007", tmp_path / "out")
    with pytest.raises(IncompleteError, match="malformed manifest"):
        store.fetch_dir("run/step-00000006", tmp_path / "out")
    with pytest.raises(StoreError, match="meta.json: no such object"):
        store.fetch_dir("run/step-00000005", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_corrupted_object_is_refused(store, tmp_path):
    src = make_folder(tmp_path / "ckpt", CKPT)
    store.publish_dir("run/step-00000004", src)
    store.put_bytes("run/step-00000004/lora.safetensors", b"\x01" * 999 + b"\x00")  # same size
    assert store.latest("run") == "run/step-00000004"  # sizes match: only hashing can tell
    key_url = f"{store.url}/run/step-00000004/lora.safetensors"
    with pytest.raises(StoreError, match=f"{key_url}: sha256 does not match the manifest"):
        store.fetch_dir("run/step-00000004", tmp_path / "out")
    store.put_bytes("run/step-00000004/lora.safetensors", b"\x01" * 10)  # truncated
    with pytest.raises(StoreError, match=f"{key_url}: 10 bytes, the manifest says 1000"):
        store.fetch_dir("run/step-00000004", tmp_path / "out")
    assert store.latest("run") is None
    expected = ["ckpt", "store"] if isinstance(store, LocalStore) else ["ckpt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == expected  # no half-fetched folder, no temp


def test_large_file_goes_in_parts(store, tmp_path):
    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(6 * MiB + 123))  # > 5 MiB parts: two parts
    store.put_file("big/model.safetensors", big)
    assert store.get_file("big/model.safetensors", tmp_path / "back.bin").read_bytes() == big.read_bytes()
    if isinstance(store, S3Store):
        head = store.client.head_object(Bucket=store.bucket, Key=f"{store.prefix}/big/model.safetensors")
        assert head["ETag"].strip('"').endswith("-2")  # S3's mark of a 2-part multipart upload


_PUBLISH_THEN_DIE = """
import os, signal, sys
from spot.s3 import S3Options
from spot.store import open_store

url, endpoint, src = sys.argv[1:]
store = open_store(url, s3=S3Options(endpoint_url=endpoint or None, region="us-east-1"))
put_file, done = store.put_file, []

def put_file_then_die(key, path):
    put_file(key, path)
    done.append(key)
    if len(done) == 2:  # as a preempted node: no cleanup, no finally blocks
        os.kill(os.getpid(), signal.SIGKILL)

store.put_file = put_file_then_die
store.publish_dir("run/step-00000002", src)
"""


def test_publish_killed_midway_is_never_visible(store, tmp_path):
    src = make_folder(tmp_path / "ckpt", CKPT)
    store.publish_dir("run/step-00000001", src)
    endpoint = store.options.endpoint_url if isinstance(store, S3Store) else ""
    child = subprocess.run(
        [sys.executable, "-c", _PUBLISH_THEN_DIE, store.url, endpoint, str(src)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr
    assert len(store.list("run/step-00000002/")) == 2  # it really died midway
    assert store.latest("run") == "run/step-00000001"
    with pytest.raises(IncompleteError, match="step-00000002: not a complete published folder"):
        store.fetch_dir("run/step-00000002", tmp_path / "out")
    assert not (tmp_path / "out").exists()

    store.publish_dir("run/step-00000002", src)  # a retry after the restart completes it
    assert store.latest("run") == "run/step-00000002"
    assert read_folder(store.fetch_dir("run/step-00000002", tmp_path / "out")) == CKPT


class Forwarder:
    """TCP forwarding from a port of its own to the moto server; `cut()` is an S3 outage."""

    def __init__(self, target_port: int):
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.target_port = target_port
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:  # cut
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            self.sockets += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def cut(self) -> None:
        for s in [self.server, *self.sockets]:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()


def test_s3_outage_midway_retries_then_fails_with_nothing_visible(moto_endpoint, tmp_path, caplog):
    prefix = f"s3://{BUCKET}/{uuid.uuid4().hex[:12]}"
    healthy = open_store(prefix, s3=s3_options(moto_endpoint))
    src = make_folder(tmp_path / "ckpt", CKPT)
    healthy.publish_dir("run/step-00000001", src)

    forwarder = Forwarder(int(moto_endpoint.rsplit(":", 1)[1]))
    flaky = open_store(prefix, s3=s3_options(f"http://127.0.0.1:{forwarder.port}", attempts=3))
    put_file = flaky.put_file

    def put_file_then_outage(key, path):
        put_file(key, path)
        forwarder.cut()

    flaky.put_file = put_file_then_outage
    caplog.set_level(logging.WARNING, logger="spot.s3")
    start = time.monotonic()
    with pytest.raises(StoreError) as info:
        flaky.publish_dir("run/step-00000002", src)
    assert time.monotonic() - start < 15
    message = str(info.value)
    assert message.startswith(
        f"{prefix}/run/step-00000002: publish_dir failed, no new version is visible; {prefix}/run/step-00000002/"
    )  # then the object whose upload failed
    assert "failed after 3 operation tries" in message
    assert "Could not connect to the endpoint URL" in message
    assert sum("retrying in" in r.getMessage() for r in caplog.records) == 2

    assert len(healthy.list("run/step-00000002/")) == 1  # one object landed before the outage
    assert healthy.latest("run") == "run/step-00000001"
    with pytest.raises(IncompleteError):
        healthy.fetch_dir("run/step-00000002", tmp_path / "out")


def test_s3_endpoint_down_fails_fast_and_clearly(tmp_path):
    url = f"s3://{BUCKET}/down"
    store = open_store(url, s3=s3_options(f"http://127.0.0.1:{closed_port()}", request_attempts=1))
    src = make_folder(tmp_path / "ckpt", CKPT)
    start = time.monotonic()
    for op in (
        lambda: store.publish_dir("run/step-00000001", src),
        lambda: store.latest("run"),
        lambda: store.get_bytes("x.bin"),
    ):
        with pytest.raises(StoreError, match=rf"^{url}/.*failed after 2 operation tries: EndpointConnectionError"):
            op()
    assert time.monotonic() - start < 10  # 3 operations x 2 tries, sub-second backoff


def test_credentials_never_leak(moto_endpoint, tmp_path, caplog):
    caplog.set_level(logging.DEBUG)  # root: botocore's DEBUG request dumps included
    caplog.set_level(logging.DEBUG, logger="botocore")  # importing Ray's AWS provider sets it to WARNING
    url = f"s3://{BUCKET}/{uuid.uuid4().hex[:12]}"
    store = open_store(url, s3=s3_options(moto_endpoint))
    src = make_folder(tmp_path / "ckpt", CKPT)
    store.publish_dir("run/step-00000001", src)
    store.fetch_dir(store.latest("run"), tmp_path / "fetched")
    store.put_bytes("run/step-00000001/meta.json", b"corrupt")
    errors = []
    for op in (
        lambda: store.get_bytes("missing"),
        lambda: store.fetch_dir("run/step-00000001", tmp_path / "refused"),
        lambda: open_store(url, s3=s3_options(f"http://127.0.0.1:{closed_port()}", request_attempts=1)).exists("x"),
    ):
        with pytest.raises(StoreError) as info:
            op()
        errors.append(info.value)
    for bad_url in (f"s3://{FAKE_KEY_ID}:{FAKE_SECRET}@{BUCKET}/x", f"s3://{BUCKET}/x?secret={FAKE_SECRET}"):
        with pytest.raises(ValueError) as info:
            open_store(bad_url)
        errors.append(info.value)
    with pytest.raises(ValueError) as info:
        S3Options(endpoint_url=f"http://{FAKE_KEY_ID}:{FAKE_SECRET}@127.0.0.1:9000")
    errors.append(info.value)

    assert "Credential=***" in caplog.text  # the request dumps were logged, masked
    texts = {
        "logs": caplog.text,
        "repr": repr(store),
        "errors": "".join("".join(traceback.format_exception(e)) for e in errors),
    }
    texts.update({str(p): p.read_bytes().decode("latin-1") for p in tmp_path.rglob("*") if p.is_file()})
    texts.update({k: store.get_bytes(k).decode("latin-1") for k in store.list()})
    for where, text in texts.items():
        for secret in SECRETS:
            assert secret not in text, f"{secret} leaked into {where}"


def test_redact_masks_header_forms():
    dump = (
        "headers={'Authorization': b'AWS4-HMAC-SHA256 Credential=AKIAXYZ/20250101/us-east-1/s3/"
        "aws4_request, Signature=ab', 'X-Amz-Security-Token': b'tok123'}\nx-amz-security-token:tok123"
    )
    clean = redact(dump)
    assert "AKIAXYZ" not in clean and "tok123" not in clean and "Credential=***/20250101" in clean


def test_open_store_urls(tmp_path, moto_endpoint):
    local = open_store(tmp_path / "a")
    assert isinstance(local, LocalStore) and local.url == (tmp_path / "a").as_uri()
    assert open_store((tmp_path / "a").as_uri()).root == tmp_path / "a"
    s3 = open_store(f"s3://{BUCKET}/runs/exp1/", s3=s3_options(moto_endpoint))
    assert isinstance(s3, S3Store) and s3.url == f"s3://{BUCKET}/runs/exp1" and s3.prefix == "runs/exp1"
    for bad, match in (
        ("gs://bucket/x", "unsupported store URL scheme"),
        ("s3:///x", "no bucket"),
        ("file://host/x", "no host"),
        ("s3://bucket/../x", "store key"),
        ("s3://My_Bucket/x", "bucket in an s3:// URL"),
    ):
        with pytest.raises(ValueError, match=match):
            open_store(bad)
    with pytest.raises(ValueError, match="multipart_chunksize"):
        S3Options(multipart_chunksize=1 * MiB)
