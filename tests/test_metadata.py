"""Instance-metadata watcher against a real local IMDSv2 server (spot.fake_imds) on 127.0.0.1.

Not covered here without a cluster: the Ray drain RPC itself. `drain_request` (what is sent) is
tested below; the slow test at the end sends it to a local `ray.cluster_utils.Cluster`.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from datetime import datetime, timedelta, timezone

import pytest

from spot.fake_imds import FakeIMDS, format_time
from spot.metadata import (
    INSTANCE_ACTION_PATH,
    REBALANCE_PATH,
    TOKEN_HEADER,
    TOKEN_PATH,
    TOKEN_TTL_HEADER,
    MetadataWatcher,
    Notice,
    drain_node_on_notice,
    drain_request,
)


@pytest.fixture()
def imds():
    with FakeIMDS() as server:
        yield server


def _wait_for(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "spot.metadata" and r.levelno >= logging.WARNING]


def test_no_notice_means_404_and_nothing_delivered(imds):
    got = []
    watcher = MetadataWatcher(imds.url, callbacks=(got.append,))
    assert watcher.poll_once() == [] and got == []
    assert watcher.reachable is True
    assert ("GET", INSTANCE_ACTION_PATH, 404) in imds.requests and ("GET", REBALANCE_PATH, 404) in imds.requests


def test_interruption_delivered_once_with_its_deadline(imds):
    got: list[Notice] = []
    with MetadataWatcher(imds.url, poll_interval_s=0.02, callbacks=(got.append,)):
        deadline = imds.schedule_interruption(action="terminate", lead_s=120.0)
        _wait_for(lambda: got)
        polls = len(imds.requests)
        _wait_for(lambda: len(imds.requests) >= polls + 10)  # five more polls see the same notice
    assert len(got) == 1
    notice = got[0]
    assert (notice.kind, notice.action, notice.deadline) == ("interruption", "terminate", deadline)
    assert notice.deadline.tzinfo == timezone.utc and notice.received_at.tzinfo == timezone.utc
    assert 115 < notice.seconds_left() <= 120


def test_a_new_notice_is_delivered_again(imds):
    got = []
    watcher = MetadataWatcher(imds.url, callbacks=(got.append,))
    imds.schedule_interruption(action="stop", lead_s=60)
    watcher.poll_once()
    imds.clear()
    watcher.poll_once()
    imds.schedule_interruption(action="hibernate", lead_s=90)
    watcher.poll_once()
    watcher.poll_once()
    assert [n.action for n in got] == ["stop", "hibernate"]


def test_rebalance_recommendation(imds):
    got = []
    watcher = MetadataWatcher(imds.url, callbacks=(got.append,))
    emitted = imds.schedule_rebalance(datetime(2024, 5, 1, 12, 0, tzinfo=timezone.utc))
    assert watcher.poll_once() == got and watcher.poll_once() == []
    [notice] = got
    assert (notice.kind, notice.action, notice.deadline, notice.notice_time) == ("rebalance", None, None, emitted)
    assert notice.seconds_left() is None
    # An interruption that follows is a separate notice.
    imds.schedule_interruption(lead_s=120)
    assert [n.kind for n in watcher.poll_once()] == ["interruption"]


def test_subsecond_deadline_survives_the_wire(imds):
    """Compressed replays use leads of a second or two: the deadline keeps its milliseconds."""
    deadline = datetime(2030, 1, 1, 0, 0, 1, 500_000, tzinfo=timezone.utc)
    assert format_time(deadline) == "2030-01-01T00:00:01.500Z"
    assert format_time(deadline.replace(microsecond=0)) == "2030-01-01T00:00:01Z"
    imds.schedule_interruption(deadline=deadline)
    [notice] = MetadataWatcher(imds.url).poll_once()
    assert notice.deadline == deadline


def test_callbacks_run_in_order_and_one_failing_does_not_stop_the_rest(imds, caplog):
    calls = []

    def broken(notice):
        calls.append("broken")
        raise RuntimeError("boom")

    watcher = MetadataWatcher(imds.url, callbacks=(broken,))
    watcher.add_callback(lambda n: calls.append("commit"))
    imds.schedule_interruption()
    watcher.poll_once()
    watcher.poll_once()
    assert calls == ["broken", "commit"]
    assert any("callback" in r.getMessage() for r in caplog.records if r.levelno == logging.ERROR)


def test_malformed_notice_is_ignored_with_a_warning(imds, caplog):
    got = []
    watcher = MetadataWatcher(imds.url, callbacks=(got.append,))
    imds.set_document(INSTANCE_ACTION_PATH, {"action": "terminate"})  # no "time"
    imds.set_document(REBALANCE_PATH, {"noticeTime": "soon"})
    for _ in range(3):
        assert watcher.poll_once() == [] and got == []
    warnings = _warnings(caplog)
    assert len(warnings) == 2  # once per malformed answer, not once per poll
    assert "malformed interruption" in warnings[0] and "malformed rebalance" in warnings[1]


# -- IMDSv2 tokens -------------------------------------------------------------------------------


def _http(method: str, url: str, headers: dict[str, str]) -> int:
    req = urllib.request.Request(url, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=2) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code


def test_fake_imds_requires_a_valid_token(imds):
    imds.schedule_interruption()
    assert _http("GET", imds.url + INSTANCE_ACTION_PATH, {}) == 401
    assert _http("GET", imds.url + INSTANCE_ACTION_PATH, {TOKEN_HEADER: "forged"}) == 401
    assert _http("PUT", imds.url + TOKEN_PATH, {}) == 400
    assert _http("PUT", imds.url + TOKEN_PATH, {TOKEN_TTL_HEADER: "0"}) == 400
    assert _http("PUT", imds.url + TOKEN_PATH, {TOKEN_TTL_HEADER: "21601"}) == 400
    req = urllib.request.Request(imds.url + TOKEN_PATH, method="PUT", headers={TOKEN_TTL_HEADER: "1"})
    token = urllib.request.urlopen(req, timeout=2).read().decode()
    assert _http("GET", imds.url + INSTANCE_ACTION_PATH, {TOKEN_HEADER: token}) == 200
    time.sleep(1.05)
    assert _http("GET", imds.url + INSTANCE_ACTION_PATH, {TOKEN_HEADER: token}) == 401  # expired


def test_watcher_reuses_its_token_and_renews_it_before_expiry(imds, caplog):
    watcher = MetadataWatcher(imds.url, token_ttl_s=2)  # renewed once less than 0.5 s is left
    for _ in range(3):
        watcher.poll_once()
    assert imds.num_tokens_issued == 1
    time.sleep(1.6)
    watcher.poll_once()
    assert imds.num_tokens_issued == 2
    assert all(status != 401 for _, _, status in imds.requests)  # never sent an expired token
    assert watcher.reachable and _warnings(caplog) == []


def test_watcher_recovers_from_a_revoked_token(imds, caplog):
    got = []
    watcher = MetadataWatcher(imds.url, callbacks=(got.append,))
    watcher.poll_once()
    imds.revoke_tokens()
    imds.schedule_interruption()
    watcher.poll_once()
    assert len(got) == 1 and imds.num_tokens_issued == 2
    assert ("GET", INSTANCE_ACTION_PATH, 401) in imds.requests
    assert _warnings(caplog) == []


# -- unreachable endpoint --------------------------------------------------------------------------


def test_refused_endpoint_warns_once_then_recovers_silently(caplog):
    port = _free_port()
    got = []
    watcher = MetadataWatcher(f"http://127.0.0.1:{port}", timeout_s=0.5, callbacks=(got.append,))
    for _ in range(4):
        assert watcher.poll_once() == []
    assert watcher.reachable is False
    [warning] = _warnings(caplog)
    assert "unreachable" in warning and "death detection" in warning and str(port) in warning
    with FakeIMDS(port=port) as imds:
        imds.schedule_interruption(lead_s=120)
        assert len(watcher.poll_once()) == 1
    assert watcher.reachable is True and len(got) == 1
    assert len(_warnings(caplog)) == 1  # recovery is silent
    # It goes away again: still the one warning.
    watcher.poll_once()
    assert watcher.reachable is False and len(_warnings(caplog)) == 1


def test_silent_endpoint_times_out_and_warns_once(caplog):
    """A socket that accepts connections but never answers (a hung service, or a hop limit)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        watcher = MetadataWatcher(f"http://127.0.0.1:{listener.getsockname()[1]}", timeout_s=0.2)
        start = time.monotonic()
        for _ in range(3):
            assert watcher.poll_once() == []
        assert time.monotonic() - start < 3.0
    assert watcher.reachable is False and len(_warnings(caplog)) == 1


def test_background_thread_polls_slower_while_unreachable_and_picks_up_the_endpoint(caplog):
    port = _free_port()
    got = []
    attempts = []
    watcher = MetadataWatcher(
        f"http://127.0.0.1:{port}",
        poll_interval_s=0.02,
        unreachable_poll_interval_s=0.3,
        timeout_s=0.2,
        callbacks=(got.append,),
    )
    poll_once = watcher.poll_once
    watcher.poll_once = lambda: attempts.append(time.monotonic()) or poll_once()
    with watcher:
        _wait_for(lambda: len(attempts) >= 3)
        assert attempts[2] - attempts[1] >= 0.25  # the slow interval, not 0.02 s
        with FakeIMDS(port=port) as imds:
            imds.schedule_interruption()
            _wait_for(lambda: got)
    assert len(got) == 1 and len(_warnings(caplog)) == 1


def test_a_miss_after_the_endpoint_answered_is_retried_at_the_normal_interval(caplog):
    """A slow answer on a busy node is not an endpoint that went away: backing off 30 s after one
    timeout would let most of a 120 s notice pass unseen. The back-off starts only after
    `transient_failures` misses in a row."""
    port = _free_port()
    got = []
    watcher = MetadataWatcher(
        f"http://127.0.0.1:{port}",
        poll_interval_s=0.02,
        unreachable_poll_interval_s=60,
        transient_failures=2,
        timeout_s=0.2,
        callbacks=(got.append,),
    )
    assert watcher.poll_once() == [] and watcher.next_interval_s() == 60  # never answered: off EC2
    with FakeIMDS(port=port):
        watcher.poll_once()
    assert watcher.reachable is True and watcher.next_interval_s() == 0.02
    watcher.poll_once()  # the endpoint is gone (here: closed; on EC2: a timed-out poll)
    assert watcher.reachable is False and watcher.next_interval_s() == 0.02
    watcher.poll_once()
    assert watcher.next_interval_s() == 0.02
    watcher.poll_once()  # the third miss in a row: it is away, not slow
    assert watcher.next_interval_s() == 60
    with FakeIMDS(port=port) as imds:
        imds.schedule_interruption(lead_s=120)
        assert len(watcher.poll_once()) == 1
    assert watcher.next_interval_s() == 0.02 and len(got) == 1


def test_stop_returns_promptly():
    watcher = MetadataWatcher(f"http://127.0.0.1:{_free_port()}", unreachable_poll_interval_s=60, timeout_s=0.2)
    watcher.start()
    time.sleep(0.1)
    start = time.monotonic()
    watcher.stop()
    assert time.monotonic() - start < 1.0 and not any(t.name == "imds-watcher" for t in threading.enumerate())


def test_constructor_rejects_bad_settings():
    with pytest.raises(ValueError, match="token_ttl_s"):
        MetadataWatcher(token_ttl_s=0)
    with pytest.raises(ValueError, match="transient_failures"):
        MetadataWatcher(transient_failures=-1)
    with pytest.raises(ValueError, match="poll intervals"):
        MetadataWatcher(poll_interval_s=0)


# -- Ray drain -------------------------------------------------------------------------------------

NODE_HEX = "ab" * 28


def _interruption(lead_s: float = 120.0) -> Notice:
    now = datetime.now(timezone.utc)
    return Notice("interruption", "terminate", now + timedelta(seconds=lead_s), now)


def test_drain_request_carries_preemption_reason_and_deadline():
    from ray.core.generated import autoscaler_pb2

    deadline = datetime(2030, 1, 1, 0, 2, tzinfo=timezone.utc)
    notice = Notice("interruption", "terminate", deadline, received_at=deadline - timedelta(seconds=120))
    req = drain_request(notice, NODE_HEX)
    assert req.reason == autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION")
    assert req.deadline_timestamp_ms == 1_893_456_120_000  # 2030-01-01T00:02:00Z
    assert req.node_id == NODE_HEX and "terminate" in req.reason_message


def test_drain_request_rejects_bad_input():
    for bad in ("", "zz" * 28, "ab" * 27, "AB" * 28, "ff" * 28):  # wrong chars, length, case; the nil id
        with pytest.raises(ValueError, match="hex id of a Ray node"):
            drain_request(_interruption(), bad)
    rebalance = Notice("rebalance", None, None, datetime.now(timezone.utc), datetime.now(timezone.utc))
    with pytest.raises(ValueError, match="only an interruption"):
        drain_request(rebalance, NODE_HEX)


def test_drain_node_on_notice_without_ray():
    import ray

    assert not ray.is_initialized()
    rebalance = Notice("rebalance", None, None, datetime.now(timezone.utc), datetime.now(timezone.utc))
    assert drain_node_on_notice(rebalance) is False  # nothing to drain, no cluster touched
    with pytest.raises(ValueError, match="not connected to Ray"):
        drain_node_on_notice(_interruption())


@pytest.mark.slow
def test_drain_node_on_notice_on_a_local_cluster(imds):
    """End to end: notice from the fake IMDS -> watcher -> drain -> actor dies as preempted."""
    import functools

    from spot.localray import import_ray_on_loopback

    ray = import_ray_on_loopback()  # every raylet on 127.0.0.1 (spot.localray)
    from ray._raylet import GcsClient
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    try:
        worker = cluster.add_node(num_cpus=1, resources={"spot": 1})
        ray.init(address=cluster.address)

        @ray.remote(num_cpus=0, resources={"spot": 0.1})
        class Probe:
            def node(self):
                return ray.get_runtime_context().get_node_id()

        probe = Probe.remote()
        assert ray.get(probe.node.remote()) == worker.node_id
        drained = []
        callback = functools.partial(drain_node_on_notice, node_id=worker.node_id, gcs_address=cluster.gcs_address)
        watcher = MetadataWatcher(imds.url, callbacks=(lambda n: drained.append(callback(n)),))
        imds.schedule_interruption(lead_s=30)
        watcher.poll_once()
        assert drained == [True]
        assert worker.node_id in GcsClient(address=cluster.gcs_address).get_draining_nodes()
        cluster.remove_node(worker, allow_graceful=False)
        with pytest.raises(ray.exceptions.ActorDiedError) as err:
            for _ in range(60):
                ray.get(probe.node.remote(), timeout=30)
                time.sleep(0.5)
        assert err.value.preempted
    finally:
        ray.shutdown()
        cluster.shutdown()
        os.environ.pop("RAY_ADDRESS", None)


def test_command_line_watcher_reports_a_notice_and_exits(imds):
    """`python -m spot.metadata` (what configs/cluster/aws-spot.yaml starts on each spot node), without Ray."""
    imds.schedule_interruption(action="stop", lead_s=120.0)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "spot.metadata",
            "--endpoint",
            imds.url,
            "--poll-s",
            "0.05",
            "--no-drain",
            "--max-notices",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "spot interruption notice: stop at" in proc.stderr
