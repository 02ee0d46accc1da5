"""A local stand-in for the EC2 instance-metadata service (IMDSv2), for tests and trace replay.

A real HTTP server on 127.0.0.1 (a free port unless one is given) that speaks the paths
`spot.metadata` polls, with IMDSv2's token rules:

    PUT /latest/api/token            needs X-aws-ec2-metadata-token-ttl-seconds in [1, 21600];
                                     answers a token valid that long (400 otherwise)
    GET /latest/meta-data/...        needs a valid X-aws-ec2-metadata-token header (401 otherwise)
        spot/instance-action         404, or {"action": ..., "time": ...} once scheduled
        events/recommendations/rebalance   404, or {"noticeTime": ...} once scheduled
        instance-id                  the id given to the constructor

A trace replayer runs one per simulated node and points that node's watcher at its `url`::

    with FakeIMDS() as imds:
        watcher = MetadataWatcher(imds.url, ...)
        imds.schedule_interruption(lead_s=2.0)   # the notice appears now, the deadline is 2 s away
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from spot.metadata import (
    INSTANCE_ACTION_PATH,
    MAX_TOKEN_TTL_S,
    REBALANCE_PATH,
    TOKEN_HEADER,
    TOKEN_PATH,
    TOKEN_TTL_HEADER,
)

INSTANCE_ID_PATH = "/latest/meta-data/instance-id"
SPOT_ACTIONS = ("terminate", "stop", "hibernate")


def format_time(t: datetime) -> str:
    """ISO 8601 in UTC with a `Z`, as the service writes it; milliseconds only when non-zero
    (real notices are whole seconds, compressed replays need finer leads)."""
    t = t.astimezone(timezone.utc)
    if t.microsecond // 1000:
        return t.strftime("%Y-%m-%dT%H:%M:%S.") + f"{t.microsecond // 1000:03d}Z"
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


class FakeIMDS:
    """An IMDSv2 endpoint on 127.0.0.1 whose notices tests (or a replayer) schedule and clear.

    Args:
        port: port to bind; 0 picks a free one.
        instance_id: served at /latest/meta-data/instance-id.
    """

    def __init__(self, port: int = 0, *, instance_id: str = "i-0123456789abcdef0"):
        self.instance_id = instance_id
        self._lock = threading.Lock()
        self._tokens: dict[str, float] = {}  # token -> time.monotonic() it expires
        self._documents: dict[str, dict] = {}  # path -> JSON body served with 200
        self.requests: list[tuple[str, str, int]] = []
        """(method, path, status) of every request served, in order."""
        self._server = ThreadingHTTPServer(("127.0.0.1", port), _make_handler(self))
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> FakeIMDS:
        assert self._thread is None, "already started"
        self._thread = threading.Thread(target=self._server.serve_forever, name="fake-imds", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join()
            self._thread = None
        self._server.server_close()

    def __enter__(self) -> FakeIMDS:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- scenario ----------------------------------------------------------------------------

    def schedule_interruption(
        self, *, action: str = "terminate", lead_s: float = 120.0, deadline: datetime | None = None
    ) -> datetime:
        """Publish an interruption notice now, for `deadline` (default: `lead_s` from now).

        Returns the deadline as the watcher will read it (rounded to the millisecond).
        """
        if action not in SPOT_ACTIONS:
            raise ValueError(f"action must be one of {SPOT_ACTIONS}, got {action!r}")
        when = format_time(deadline or datetime.now(timezone.utc) + timedelta(seconds=lead_s))
        self.set_document(INSTANCE_ACTION_PATH, {"action": action, "time": when})
        return datetime.fromisoformat(when.replace("Z", "+00:00"))

    def schedule_rebalance(self, notice_time: datetime | None = None) -> datetime:
        """Publish a rebalance recommendation emitted at `notice_time` (default: now)."""
        when = format_time(notice_time or datetime.now(timezone.utc))
        self.set_document(REBALANCE_PATH, {"noticeTime": when})
        return datetime.fromisoformat(when.replace("Z", "+00:00"))

    def clear(self) -> None:
        """Withdraw both notices (the paths answer 404 again)."""
        with self._lock:
            self._documents.clear()

    def set_document(self, path: str, body: dict | None) -> None:
        """Serve `body` as JSON at `path` as given (None: 404), e.g. a malformed notice."""
        with self._lock:
            if body is None:
                self._documents.pop(path, None)
            else:
                self._documents[path] = body

    def revoke_tokens(self) -> None:
        """Invalidate every issued token, as if they had expired."""
        with self._lock:
            self._tokens.clear()

    @property
    def num_tokens_issued(self) -> int:
        with self._lock:
            return sum(1 for m, p, s in self.requests if m == "PUT" and p == TOKEN_PATH and s == 200)

    # -- request handling (called on server threads) ------------------------------------------

    def _issue_token(self, ttl_header: str | None) -> tuple[int, bytes]:
        try:
            ttl = int(ttl_header) if ttl_header is not None else None
        except ValueError:
            ttl = None
        if ttl is None or not 1 <= ttl <= MAX_TOKEN_TTL_S:
            return 400, b"missing or invalid " + TOKEN_TTL_HEADER.encode()
        token = secrets.token_urlsafe(32)
        with self._lock:
            self._tokens[token] = time.monotonic() + ttl
        return 200, token.encode()

    def _answer_get(self, path: str, token: str | None) -> tuple[int, bytes]:
        with self._lock:
            expires = self._tokens.get(token or "")
            if expires is None or time.monotonic() >= expires:
                return 401, b""
            body = self._documents.get(path)
        if path == INSTANCE_ID_PATH:
            return 200, self.instance_id.encode()
        if body is None:
            return 404, b"Not Found"
        return 200, json.dumps(body).encode()

    def _log(self, method: str, path: str, status: int) -> None:
        with self._lock:
            self.requests.append((method, path, status))


def _make_handler(imds: FakeIMDS) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_PUT(self):
            if self.path == TOKEN_PATH:
                status, body = imds._issue_token(self.headers.get(TOKEN_TTL_HEADER))
            else:
                status, body = 404, b"Not Found"
            self._send("PUT", status, body)

        def do_GET(self):
            status, body = imds._answer_get(self.path, self.headers.get(TOKEN_HEADER))
            self._send("GET", status, body)

        def _send(self, method: str, status: int, body: bytes) -> None:
            imds._log(method, self.path, status)
            self.send_response(status)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format, *args):  # keep test output quiet
            pass

    return Handler
