"""Watch the EC2 instance-metadata service (IMDSv2) for spot interruption and rebalance notices.

Protocol (AWS EC2 instance metadata, IMDSv2): `PUT /latest/api/token` with header `X-aws-ec2-metadata-token-ttl-seconds`
returns a session token; every GET carries it as `X-aws-ec2-metadata-token`.

    GET /latest/meta-data/spot/instance-action          404, or {"action": "terminate", "time": "...Z"}
    GET /latest/meta-data/events/recommendations/rebalance   404, or {"noticeTime": "...Z"}

`MetadataWatcher` polls both and calls its callbacks once per distinct notice with a typed
`Notice`. The callbacks are where the runtime acts: `drain_node_on_notice` asks Ray to drain the
node with reason *preemption* and the notice's deadline; another callback tells local workers to
commit their in-flight jobs.

Poll interval: 2 s by default. AWS suggests every 5 s; an interruption notice comes about 120 s
ahead, and a commit that starts 3 s earlier is worth two cheap GETs on a link-local address
every 2 s. Each request times out after 1 s (the service answers in milliseconds when present).

Off EC2 (or with the metadata endpoint disabled, or a container behind a hop limit of 1) the
endpoint does not answer. The watcher then logs one warning, saying preemptions will only be seen
when the node dies (Ray's death detection), and keeps polling every 30 s in case it comes up;
when it does, it carries on silently. An endpoint that has answered before and then misses a poll
(a timeout on a busy node) is retried at the normal interval for `transient_failures` polls in a
row before the watcher slows down: backing off 30 s after one slow answer would miss most of a
120 s notice.
"""

from __future__ import annotations

import http.client
import json
import logging
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Literal

logger = logging.getLogger(__name__)

DEFAULT_ENDPOINT = "http://169.254.169.254"
TOKEN_PATH = "/latest/api/token"
INSTANCE_ACTION_PATH = "/latest/meta-data/spot/instance-action"
REBALANCE_PATH = "/latest/meta-data/events/recommendations/rebalance"
TOKEN_TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
TOKEN_HEADER = "X-aws-ec2-metadata-token"
MAX_TOKEN_TTL_S = 21600  # the service's upper bound (6 h)


@dataclass(frozen=True)
class Notice:
    """A spot interruption notice or a rebalance recommendation, as read from the metadata service."""

    kind: Literal["interruption", "rebalance"]
    """`interruption`: the instance will be reclaimed at `deadline`. `rebalance`: it is at elevated risk."""
    action: str | None
    """interruption: `terminate`, `stop` or `hibernate`; rebalance: None."""
    deadline: datetime | None
    """interruption: when the instance will be reclaimed (UTC); rebalance: None (it has no deadline)."""
    received_at: datetime
    """When this watcher first saw the notice (UTC)."""
    notice_time: datetime | None = None
    """rebalance: when AWS emitted the recommendation (its `noticeTime`, UTC); interruption: None."""

    def seconds_left(self, now: datetime | None = None) -> float | None:
        """Seconds from `now` (default: the current time) to the deadline; None for a rebalance."""
        if self.deadline is None:
            return None
        return (self.deadline - (now or datetime.now(timezone.utc))).total_seconds()


class EndpointUnavailable(Exception):
    """The metadata endpoint did not answer, or refused to issue a token."""


class MetadataWatcher:
    """Poll the instance-metadata service and call back once per notice.

    Use `poll_once()` to poll synchronously, or `start()`/`stop()` (or `with`) to poll on a daemon
    thread. Callbacks run on the polling thread, in the order they were added; one that raises is
    logged and does not stop the others or the watcher.

    Args:
        endpoint: base URL of the metadata service.
        poll_interval_s: time between polls while the endpoint answers.
        unreachable_poll_interval_s: time between polls while it does not.
        transient_failures: misses in a row, after the endpoint has answered once, still retried at
            `poll_interval_s` (a slow answer on a busy node is not an endpoint that went away).
        timeout_s: timeout of each HTTP request.
        token_ttl_s: lifetime requested for each IMDSv2 token; it is renewed before it expires.
        callbacks: called with each new `Notice`.
    """

    def __init__(
        self,
        endpoint: str = DEFAULT_ENDPOINT,
        *,
        poll_interval_s: float = 2.0,
        unreachable_poll_interval_s: float = 30.0,
        transient_failures: int = 10,
        timeout_s: float = 1.0,
        token_ttl_s: int = MAX_TOKEN_TTL_S,
        callbacks: tuple[Callable[[Notice], object], ...] = (),
    ):
        if not 1 <= token_ttl_s <= MAX_TOKEN_TTL_S:
            raise ValueError(f"token_ttl_s must be in [1, {MAX_TOKEN_TTL_S}], got {token_ttl_s}")
        if poll_interval_s <= 0 or unreachable_poll_interval_s <= 0 or timeout_s <= 0:
            raise ValueError("poll intervals and timeout_s must be > 0")
        if transient_failures < 0:
            raise ValueError(f"transient_failures must be >= 0, got {transient_failures}")
        self.endpoint = endpoint.rstrip("/")
        self.poll_interval_s = poll_interval_s
        self.unreachable_poll_interval_s = unreachable_poll_interval_s
        self.transient_failures = transient_failures
        self.timeout_s = timeout_s
        self.token_ttl_s = token_ttl_s
        self._callbacks: list[Callable[[Notice], object]] = list(callbacks)
        # An empty ProxyHandler: http_proxy in the environment must not route a link-local
        # address through a proxy.
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        self._token: str | None = None
        self._token_expires = 0.0  # time.monotonic() after which the token is no longer used
        self._seen_bodies: set[tuple[str, bytes]] = set()
        self._seen: set[tuple] = set()  # (kind, content) of delivered notices
        self._warned_unreachable = False
        self._answered = False  # the endpoint answered at least once
        self._failures = 0  # polls in a row that did not reach it
        self.reachable: bool | None = None
        """None before the first poll; afterwards whether the last poll reached the endpoint."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def add_callback(self, callback: Callable[[Notice], object]) -> None:
        self._callbacks.append(callback)

    # -- polling -----------------------------------------------------------------------------

    def poll_once(self) -> list[Notice]:
        """Poll both paths once; call back for, and return, the notices not seen before."""
        try:
            raw = [
                ("interruption", self._get(INSTANCE_ACTION_PATH)),
                ("rebalance", self._get(REBALANCE_PATH)),
            ]
        except EndpointUnavailable as e:
            if self.reachable is not False:
                if not self._warned_unreachable:
                    logger.warning(
                        "instance metadata endpoint %s is unreachable (%s): no spot interruption "
                        "notices; falling back to death detection (a preempted node is seen when it "
                        "dies). Polling again every %g s.",
                        self.endpoint,
                        e,
                        self.unreachable_poll_interval_s,
                    )
                    self._warned_unreachable = True
                else:
                    logger.debug("instance metadata endpoint %s unreachable again: %s", self.endpoint, e)
            self.reachable = False
            self._failures += 1
            self._token = None
            return []
        if self.reachable is False:
            logger.debug("instance metadata endpoint %s reachable again", self.endpoint)
        self.reachable, self._answered, self._failures = True, True, 0
        now = datetime.now(timezone.utc)
        fresh = []
        for kind, body in raw:
            if body is None:
                continue
            if (kind, body) in self._seen_bodies:  # the usual case: the same answer as last poll
                continue
            self._seen_bodies.add((kind, body))  # a malformed one too, so it is logged only once
            notice, key = _parse_notice(kind, body, now)
            if notice is not None and key not in self._seen:
                self._seen.add(key)
                fresh.append(notice)
        for notice in fresh:
            self._deliver(notice)
        return fresh

    def _deliver(self, notice: Notice) -> None:
        if notice.kind == "interruption":
            logger.info("spot interruption notice: %s at %s", notice.action, notice.deadline.isoformat())
        else:
            logger.info("spot rebalance recommendation issued at %s", notice.notice_time.isoformat())
        for cb in self._callbacks:
            try:
                cb(notice)
            except Exception:
                logger.exception("notice callback %r failed", cb)

    def _get(self, path: str) -> bytes | None:
        """GET a metadata path with a valid token: the body, or None on 404."""
        for attempt in range(2):
            status, body = self._request("GET", path, {TOKEN_HEADER: self._valid_token()})
            if status == 401 and attempt == 0:  # token expired or revoked early: get a new one
                self._token = None
                continue
            break
        if status == 404:
            return None
        if status != 200:
            raise EndpointUnavailable(f"GET {path} answered HTTP {status}")
        return body

    def _valid_token(self) -> str:
        # Renew ahead of expiry: a quarter of the TTL, at most a minute, so a token never expires
        # between the check here and its use on the service.
        margin = min(60.0, self.token_ttl_s / 4)
        if self._token is None or time.monotonic() >= self._token_expires - margin:
            requested = time.monotonic()
            status, body = self._request("PUT", TOKEN_PATH, {TOKEN_TTL_HEADER: str(self.token_ttl_s)})
            if status != 200 or not body:
                raise EndpointUnavailable(f"token request answered HTTP {status}")
            self._token = body.decode()
            self._token_expires = requested + self.token_ttl_s
        return self._token

    def _request(self, method: str, path: str, headers: dict[str, str]) -> tuple[int, bytes]:
        req = urllib.request.Request(self.endpoint + path, method=method, headers=headers)
        try:
            with self._opener.open(req, timeout=self.timeout_s) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()
        except (OSError, http.client.HTTPException) as e:  # refused, timed out, reset, garbled
            reason = getattr(e, "reason", e)
            raise EndpointUnavailable(f"{method} {path}: {reason}") from None

    # -- background thread -------------------------------------------------------------------

    def start(self) -> MetadataWatcher:
        assert self._thread is None, "watcher already started"
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="imds-watcher", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def __enter__(self) -> MetadataWatcher:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.poll_once()
            self._stop.wait(self.next_interval_s())

    def next_interval_s(self) -> float:
        """Seconds to the next poll: the normal interval while the endpoint answers, and for
        `transient_failures` misses in a row after it has answered once; the slow one otherwise."""
        if self.reachable or (self._answered and self._failures <= self.transient_failures):
            return self.poll_interval_s
        return self.unreachable_poll_interval_s


def _parse_time(raw: object) -> datetime:
    """An ISO 8601 UTC time as the service writes it ("2024-05-01T12:00:00Z")."""
    if not isinstance(raw, str):
        raise ValueError(f"expected an ISO 8601 time string, got {raw!r}")
    t = datetime.fromisoformat(raw.replace("Z", "+00:00"))  # Python 3.10 does not accept "Z"
    if t.tzinfo is None:
        t = t.replace(tzinfo=timezone.utc)
    return t.astimezone(timezone.utc)


def _parse_notice(kind: str, body: bytes, now: datetime) -> tuple[Notice | None, tuple]:
    """The notice in a 200 answer (None if malformed) and its identity (kind + content)."""
    try:
        doc = json.loads(body)
        if not isinstance(doc, dict):
            raise ValueError("not a JSON object")
        if kind == "interruption":
            action = doc["action"]
            deadline = _parse_time(doc["time"])
            return Notice("interruption", action, deadline, now), (kind, action, deadline)
        notice_time = _parse_time(doc["noticeTime"])
        return Notice("rebalance", None, None, now, notice_time), (kind, notice_time)
    except (KeyError, ValueError) as e:  # JSONDecodeError is a ValueError
        logger.warning("ignoring a malformed %s answer %r: %s", kind, body[:200], e)
        return None, ()


# -- Ray drain ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class DrainRequest:
    """The arguments of a GCS `DrainNode` call for a preemption notice."""

    node_id: str
    """Hex id of the Ray node to drain."""
    reason: int
    """`autoscaler_pb2.DRAIN_NODE_REASON_PREEMPTION`."""
    reason_message: str
    """Shown by Ray on the node and in the errors of actors that die with it."""
    deadline_timestamp_ms: int
    """Unix time in ms at which the node will be reclaimed."""


def drain_request(notice: Notice, node_id: str) -> DrainRequest:
    """Build the drain request for an interruption notice (pure; no cluster needed)."""
    import ray
    from ray.core.generated import autoscaler_pb2

    if notice.kind != "interruption" or notice.deadline is None:
        raise ValueError(f"only an interruption notice has a deadline to drain by, got a {notice.kind} notice")
    # Checked here: NodeID.from_hex turns a malformed string into the nil id with only a log line.
    hex_len = 2 * ray.NodeID.size()
    if not re.fullmatch(f"[0-9a-f]{{{hex_len}}}", node_id) or node_id == ray.NodeID.nil().hex():
        raise ValueError(f"node_id must be the hex id of a Ray node, got {node_id!r}")
    return DrainRequest(
        node_id=node_id,
        reason=autoscaler_pb2.DRAIN_NODE_REASON_PREEMPTION,
        reason_message=f"spot instance {notice.action} at {notice.deadline.isoformat()} (instance metadata notice)",
        deadline_timestamp_ms=int(notice.deadline.timestamp() * 1000),
    )


def drain_node_on_notice(
    notice: Notice,
    *,
    node_id: str | None = None,
    gcs_address: str | None = None,
    rpc_timeout_s: float = 10.0,
) -> bool:
    """Ask Ray to drain this node because of a spot interruption notice.

    A rebalance recommendation drains nothing (it has no deadline and the instance may well
    survive); this returns False for it. Bind the arguments with `functools.partial` to use it as
    a `MetadataWatcher` callback. Once drained, no new tasks or actors are placed on the node and
    actors on it die with `ActorDiedError.preempted == True`.

    Ray 2.60 has no public Python API for this: the `ray drain-node` CLI (hidden) and autoscaler v2
    call `GcsClient.drain_node` from `ray._raylet`, and so do we. It takes the node id in hex
    (its docstring says binary; `ray._private.node` notes that binary yields a nil id the GCS
    silently accepts).

    Args:
        notice: the notice a `MetadataWatcher` delivered.
        node_id: hex id of the node to drain; default the node this process runs on.
        gcs_address: "host:port" of the GCS; default the cluster this process is connected to.
        rpc_timeout_s: bound on the RPC, so a hung GCS cannot block the watcher thread.

    Returns:
        True when the GCS accepted the drain, False for a rebalance recommendation.

    Raises:
        RuntimeError: the GCS rejected the request (the message says why).
    """
    import ray
    from ray._raylet import GcsClient

    if notice.kind != "interruption":
        return False
    if node_id is None or gcs_address is None:
        if not ray.is_initialized():
            raise ValueError("not connected to Ray: pass node_id and gcs_address, or call ray.init() first")
        ctx = ray.get_runtime_context()
        node_id = node_id or ctx.get_node_id()
        gcs_address = gcs_address or ctx.gcs_address
    req = drain_request(notice, node_id)
    accepted, rejection = GcsClient(address=gcs_address).drain_node(
        req.node_id, req.reason, req.reason_message, req.deadline_timestamp_ms, timeout=rpc_timeout_s
    )
    if not accepted:
        raise RuntimeError(f"Ray refused to drain node {node_id}: {rejection}")
    logger.info("requested a Ray drain of node %s (preemption, deadline %s)", node_id, notice.deadline)
    return True


def build_parser():
    """The command line of `python -m spot.metadata` (see `main`)."""
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m spot.metadata", description="Watch IMDSv2 for spot notices; drain this Ray node on one."
    )
    p.add_argument("--endpoint", default=DEFAULT_ENDPOINT, help="metadata service base URL")
    p.add_argument("--poll-s", type=float, default=2.0, help="seconds between polls")
    p.add_argument("--address", default="auto", help="Ray cluster address to attach to (for the drain)")
    p.add_argument("--no-drain", action="store_true", help="log notices only; do not attach to Ray")
    p.add_argument("--max-notices", type=int, default=0, help="exit after this many notices (0: never)")
    return p


def main(argv: list[str] | None = None) -> int:
    """`python -m spot.metadata`: run the watcher on this node until killed (the cluster file's way).

    With Ray (`--address`), each interruption notice drains this node with reason preemption and
    the notice's deadline; with `--no-drain`, notices are only logged. `--max-notices N` exits after
    N notices (for tests and one-shot checks).
    """
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    notices: list[Notice] = []
    done = threading.Event()
    callbacks: list[Callable[[Notice], object]] = []
    if not args.no_drain:
        import ray

        ray.init(address=args.address, logging_level=logging.WARNING, log_to_driver=False)
        callbacks.append(drain_node_on_notice)

    def count(notice: Notice) -> None:
        notices.append(notice)
        if args.max_notices and len(notices) >= args.max_notices:
            done.set()

    with MetadataWatcher(args.endpoint, poll_interval_s=args.poll_s, callbacks=(*callbacks, count)):
        done.wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
