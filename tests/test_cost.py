"""The GPU cost ledger (`spotlight.core.cost`), its EC2 price history path, and `spotlight cost`.

EC2 price history comes from a fixture in the shape `describe_spot_price_history` returns, fed
through botocore's Stubber on a real boto3 EC2 client: moto's spot price history is a placeholder
(every price "0.00001", dated 2006), so it cannot test price logic. moto's server is still used
once, as a real signed HTTP endpoint, to check that no credential reaches the run directory.
"""

from __future__ import annotations

import json
import logging
from datetime import datetime
from pathlib import Path

import boto3
import pytest
from botocore.stub import Stubber
from s3_server import SECRETS, fake_aws_environment

from spotlight.cli import main
from spotlight.core.cost import (
    COST_FILE,
    CostConfig,
    CostLedger,
    SpotPriceRecord,
    cost_usd,
    fetch_spot_price_history,
    price_steps,
    read_ledger,
)

FIXTURE = Path(__file__).parent / "data" / "spot_price_history_p5.4xlarge_us-east-1.json"


def ts(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


T0 = ts("2025-06-02T00:00:00Z")
HOUR = 3600.0


@pytest.fixture(autouse=True)
def aws_env():
    with fake_aws_environment():
        yield


def stubbed_ec2(calls: list[dict]):
    """A real boto3 EC2 client answering `calls` (the fixture's request/pages) in order."""
    client = boto3.client("ec2", region_name="us-east-1")
    stub = Stubber(client)
    for call in calls:
        request = {
            **call["request"],
            "StartTime": _dt(call["request"]["StartTime"]),
            "EndTime": _dt(call["request"]["EndTime"]),
        }
        token = None
        for page in call["pages"]:
            response = {
                **page,
                "SpotPriceHistory": [{**r, "Timestamp": _dt(r["Timestamp"])} for r in page["SpotPriceHistory"]],
            }
            stub.add_response(
                "describe_spot_price_history", response, {**request, **({"NextToken": token} if token else {})}
            )
            token = page["NextToken"]
    stub.activate()
    return client, stub


def _dt(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def fixture_calls() -> list[dict]:
    return json.loads(FIXTURE.read_text())["calls"]


def history_cfg(**kw) -> CostConfig:
    return CostConfig(spot_price="history", instance_type="p5.4xlarge", gpus_per_instance=1, region="us-east-1", **kw)


# -- pure pieces ------------------------------------------------------------------------------------


def test_cost_applies_the_price_in_effect_at_each_moment():
    prices = [[0.0, 2.0], [HOUR, 4.0], [3 * HOUR, 1.0]]
    # 2 GPUs from 0.5 h to 3.5 h: 0.5 h at 2, 2 h at 4, 0.5 h at 1.
    assert cost_usd([[0.5 * HOUR, 3.5 * HOUR, 2]], prices) == pytest.approx(2 * (0.5 * 2 + 2 * 4 + 0.5 * 1))
    # Before the first step the first price holds; an interval inside one step has one price.
    assert cost_usd([[-HOUR, 0.0, 1], [1.5 * HOUR, 2 * HOUR, 3]], prices) == pytest.approx(2 + 3 * 0.5 * 4)
    assert cost_usd([], prices) == 0.0


def test_price_steps_take_the_highest_az_per_gpu():
    r = lambda az, t, usd: SpotPriceRecord(az, "p5.48xlarge", t, usd)  # noqa: E731
    records = [r("a", 0, 16.0), r("b", 0, 24.0), r("a", 10, 32.0), r("b", 20, 8.0), r("a", 30, 32.0), r("a", 40, 8.0)]
    # per GPU (8): max(2, 3)=3, then a=4, b falls (still 4), a repeats (dropped), a falls to 1 (b=1).
    assert price_steps(records, 8) == [[0, 3.0], [10, 4.0], [40, 1.0]]


# -- EC2 price history through a stubbed client -------------------------------------------------------


def test_fetch_reads_every_page_of_the_recorded_history():
    first = fixture_calls()[0]
    client, stub = stubbed_ec2([first])
    records = fetch_spot_price_history(
        client, instance_type="p5.4xlarge", product_description="Linux/UNIX", start=T0, end=T0
    )
    stub.assert_no_pending_responses()  # both pages were asked for, the second with the NextToken
    assert [(r.availability_zone, r.usd_per_hour) for r in records] == [
        ("us-east-1b", 2.8457),
        ("us-east-1a", 3.1204),
        ("us-east-1d", 2.7712),
    ]
    assert records[0].time == ts("2025-06-01T18:40:33Z")


def test_fetch_asks_for_one_availability_zone():
    client = boto3.client("ec2", region_name="us-east-1")
    with Stubber(client) as stub:
        row = {
            "AvailabilityZone": "us-east-1a",
            "InstanceType": "p5.4xlarge",
            "ProductDescription": "Linux/UNIX",
            "SpotPrice": "3.120400",
            "Timestamp": _dt("2025-06-01T21:14:07Z"),
        }
        expected = {
            "InstanceTypes": ["p5.4xlarge"],
            "ProductDescriptions": ["Linux/UNIX"],
            "AvailabilityZone": "us-east-1a",
            "StartTime": _dt("2025-06-02T00:00:00Z"),
            "EndTime": _dt("2025-06-02T01:00:00Z"),
        }
        stub.add_response("describe_spot_price_history", {"SpotPriceHistory": [row]}, expected)
        records = fetch_spot_price_history(
            client,
            instance_type="p5.4xlarge",
            product_description="Linux/UNIX",
            start=T0,
            end=T0 + HOUR,
            availability_zone="us-east-1a",
        )
    assert [r.usd_per_hour for r in records] == [3.1204]


def test_ledger_prices_spot_seconds_with_the_history_in_effect_then(tmp_path):
    """Six hours, refreshed every three: each spot second at the highest AZ price of its moment."""
    client, stub = stubbed_ec2(fixture_calls())
    cfg = history_cfg(trainer_gpus=2, refresh_minutes=180)
    ledger = CostLedger(tmp_path, cfg, client=client, now=T0)
    ledger.charge(spot_gpus=2, now=T0 + 1 * HOUR)
    assert ledger.metrics()["cost/spot_usd_per_gpu_hour"] == pytest.approx(3.1204)  # us-east-1a's, the highest
    ledger.charge(spot_gpus=2, now=T0 + 3 * HOUR)  # reads [0 h, 3 h]: 1a rose at 01:32:51
    ledger.charge(spot_gpus=2, now=T0 + 5 * HOUR)
    ledger.charge(spot_gpus=0, now=T0 + 6 * HOUR)  # reads [3 h, 6 h]: 1a fell at 04:05:12, 1b's 3.0019 is highest
    stub.assert_no_pending_responses()

    rise, fall = ts("2025-06-02T01:32:51Z"), ts("2025-06-02T04:05:12Z")
    spot = 2 * ((rise - T0) * 3.1204 + (fall - rise) * 3.2411 + (T0 + 5 * HOUR - fall) * 3.0019) / HOUR
    on_demand = 2 * 6 * 6.88
    m = ledger.metrics()
    assert m["cost/usd_spot"] == pytest.approx(spot)
    assert m["cost/usd_on_demand"] == pytest.approx(on_demand)
    assert m["cost/usd_total"] == pytest.approx(spot + on_demand)
    assert m["cost/gpu_s_spot"] == pytest.approx(2 * 5 * HOUR) and m["cost/gpu_s_on_demand"] == pytest.approx(
        2 * 6 * HOUR
    )
    assert m["cost/usd_on_demand_only"] == pytest.approx((2 * 6 + 2 * 5) * 6.88)
    assert m["cost/spot_gpus_held"] == 0
    doc = read_ledger(tmp_path / COST_FILE)
    assert doc["pools"]["spot"]["usage"] == [[T0, T0 + 5 * HOUR, 2]]  # contiguous charges: one interval
    assert doc["pools"]["spot"]["source"].startswith("EC2 spot price history: p5.4xlarge")


def test_history_errors_say_what_to_change(tmp_path):
    client = boto3.client("ec2", region_name="us-east-1")
    with Stubber(client) as stub:
        stub.add_client_error("describe_spot_price_history", "UnauthorizedOperation", "You are not authorized", 403)
        with pytest.raises(ValueError, match="ec2:DescribeSpotPriceHistory.*cost.spot_price=discount"):
            CostLedger(tmp_path, history_cfg(), client=client, now=T0)
    with Stubber(client) as stub:
        stub.add_response("describe_spot_price_history", {"SpotPriceHistory": [], "NextToken": ""})
        with pytest.raises(ValueError, match="no spot price history for p5.4xlarge.*cost.instance_type"):
            CostLedger(tmp_path, history_cfg(), client=client, now=T0)


def test_a_failed_refresh_keeps_the_last_price(tmp_path, caplog):
    calls = fixture_calls()[:1]
    client, stub = stubbed_ec2(calls)
    stub.add_client_error("describe_spot_price_history", "RequestLimitExceeded", "Request limit exceeded.", 503)
    ledger = CostLedger(tmp_path, history_cfg(refresh_minutes=60), client=client, now=T0)
    ledger.charge(spot_gpus=1, now=T0 + 2 * HOUR)
    assert "keeping the last known spot price" in caplog.text
    assert ledger.metrics()["cost/usd_spot"] == pytest.approx(2 * 3.1204)


def test_cost_path_never_writes_credentials(tmp_path, caplog, monkeypatch):
    """History read from moto's server (a real signed endpoint) with DEBUG logs: no secret in the run dir or logs."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        _, port = server.get_host_and_port()
        caplog.set_level(logging.DEBUG)
        caplog.set_level(logging.DEBUG, logger="botocore")  # importing Ray's AWS provider sets it to WARNING
        monkeypatch.setenv("AWS_ENDPOINT_URL_EC2", f"http://127.0.0.1:{port}")  # boto3's standard endpoint override
        ledger = CostLedger(tmp_path, history_cfg(), now=T0)  # the client comes from the standard chain
        ledger.charge(spot_gpus=1, now=T0 + 60)
        assert main(["cost", str(tmp_path), "--json"]) == 0
    finally:
        server.stop()
    assert "Credential=***" in caplog.text  # the signed requests were logged, masked
    texts = {
        "logs": caplog.text,
        **{str(p): p.read_bytes().decode("latin-1") for p in tmp_path.rglob("*") if p.is_file()},
    }
    for where, text in texts.items():
        for secret in SECRETS:
            assert secret not in text, f"{secret} leaked into {where}"


# -- the ledger file ----------------------------------------------------------------------------------


def test_ledger_survives_resume_and_a_price_change(tmp_path):
    cfg = CostConfig(on_demand_usd_per_gpu_hour=4.0, spot_discount=0.75)
    ledger = CostLedger(tmp_path, cfg, now=T0)
    ledger.charge(spot_gpus=3, now=T0 + HOUR)
    assert not [p.name for p in tmp_path.iterdir() if p.name != COST_FILE]  # no temp file left behind
    # The process dies; a new one resumes an hour later with a new on-demand price.
    resumed = CostLedger(tmp_path, CostConfig(on_demand_usd_per_gpu_hour=8.0, spot_discount=0.75), now=T0 + 2 * HOUR)
    resumed.charge(spot_gpus=1, now=T0 + 3 * HOUR)
    s = read_ledger(tmp_path)  # the run directory works as well as the file
    pools = s["pools"]
    assert pools["on_demand"]["usage"] == [
        [T0, T0 + HOUR, 1],
        [T0 + 2 * HOUR, T0 + 3 * HOUR, 1],
    ]  # the gap is not charged
    m = resumed.metrics()
    assert m["cost/usd_on_demand"] == pytest.approx(4.0 + 8.0)
    assert m["cost/usd_spot"] == pytest.approx(3 * 1.0 + 1 * 2.0)
    assert m["cost/usd_on_demand_only"] == pytest.approx(4 * 4.0 + 2 * 8.0)
    # --no-resume starts a new ledger.
    fresh = CostLedger(tmp_path, cfg, resume=False, now=T0 + 4 * HOUR)
    assert fresh.metrics()["cost/usd_total"] == 0.0 and read_ledger(tmp_path)["pools"]["spot"]["usage"] == []


def test_a_damaged_ledger_is_set_aside_and_a_new_one_started(tmp_path, caplog):
    cfg = CostConfig(on_demand_usd_per_gpu_hour=4.0, spot_discount=0.75)
    CostLedger(tmp_path, cfg, now=T0).charge(spot_gpus=1, now=T0 + HOUR)
    damaged = (tmp_path / COST_FILE).read_bytes()[:50]
    (tmp_path / COST_FILE).write_bytes(damaged)
    with caplog.at_level("WARNING"):
        resumed = CostLedger(tmp_path, cfg, now=T0 + 2 * HOUR)
    assert "not a valid cost ledger" in caplog.text and "cost.json.damaged" in caplog.text
    assert (tmp_path / "cost.json.damaged").read_bytes() == damaged  # kept, not deleted
    resumed.charge(spot_gpus=0, now=T0 + 3 * HOUR)
    assert read_ledger(tmp_path)["pools"]["on_demand"]["usage"] == [[T0 + 2 * HOUR, T0 + 3 * HOUR, 1]]


def test_cost_command_prints_the_ledger(tmp_path, capsys):
    ledger = CostLedger(tmp_path, CostConfig(on_demand_usd_per_gpu_hour=4.0, spot_discount=0.75), now=T0)
    ledger.charge(spot_gpus=4, now=T0 + HOUR)
    assert main(["cost", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for text in (
        "on_demand",
        "spot",
        "75% off on-demand",
        "config: 4 USD/GPU-hour",
        "on-demand only",
        "20.00",
        "12.00",
        "60.0%",
    ):
        assert text in out, (text, out)
    assert main(["cost", str(tmp_path), "--json"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1
    s = json.loads(lines[0])
    assert s["usd_total"] == pytest.approx(8.0) and s["usd_on_demand_only"] == pytest.approx(20.0)
    assert s["pools"]["spot"]["gpu_s"] == pytest.approx(4 * HOUR) and s["saved_fraction"] == pytest.approx(0.6)


@pytest.mark.parametrize("content", [None, "{not json", '{"version": 1, "pools": {"on_demand": {}}}', '{"version": 7}'])
def test_cost_command_names_a_missing_or_malformed_ledger(tmp_path, capsys, content):
    if content is not None:
        (tmp_path / COST_FILE).write_text(content)
    assert main(["cost", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert str(tmp_path / COST_FILE) in err and ("no cost ledger" in err or "not a valid cost ledger" in err), err


def test_cost_config_mistakes_name_the_field(capsys):
    for override, name in (
        ("cost.spot_discount=1.5", "cost.spot_discount"),
        ("cost.trainer_gpus=0", "cost.trainer_gpus"),
        ("cost.spot_price=auction", "cost.spot_price"),
    ):
        assert main(["config", override]) == 2
        assert name in capsys.readouterr().err


def test_training_logs_its_cost_each_iteration(tiny_model_dir, tmp_path):
    """The driver charges every iteration; a resumed run continues the ledger (the repeated seconds stay)."""
    from spotlight.config import DiTRecipe
    from spotlight.core.config_io import from_dict
    from spotlight.core.tracking import read_metrics
    from spotlight.driver import run_training

    data = {
        "model": {"path": str(tiny_model_dir)},
        "sample": {"num_steps": 2, "eval_num_steps": 2},
        "train": {"num_iterations": 2, "prompts_per_iteration": 2, "group_size": 2, "minibatch_size": 4},
        "log": {"checkpoint_every": 1, "images_every": 0, "wandb_mode": "disabled"},
        "data": {"num_heldout": 8},
    }
    cfg = from_dict(DiTRecipe, data)
    run_training(cfg, tmp_path, progress=False)
    rows = read_metrics(tmp_path)
    totals = [r["cost/usd_total"] for r in rows]
    assert 0 < totals[0] < totals[1]
    assert all(r["cost/usd_spot"] == 0 and r["cost/gpu_s_spot"] == 0 for r in rows)  # no exploration, no spot GPUs
    first = read_ledger(tmp_path)
    data["train"]["num_iterations"] = 3
    run_training(from_dict(DiTRecipe, data), tmp_path, progress=False)
    after = read_ledger(tmp_path)
    assert (
        after["pools"]["on_demand"]["usage"][: len(first["pools"]["on_demand"]["usage"])]
        == first["pools"]["on_demand"]["usage"]
    )
    assert read_metrics(tmp_path)[-1]["cost/usd_total"] > totals[-1]


def test_spot_gpus_held_are_charged_while_exploring(tiny_model_dir, tmp_path):
    """A local cluster with 2 spot nodes: every interval charges the spot GPUs held, busy or not."""
    from spotlight.config import DiTRecipe
    from spotlight.core.config_io import from_dict
    from spotlight.core.tracking import read_metrics
    from spotlight.driver import run_training

    cfg = from_dict(
        DiTRecipe,
        {
            "model": {"path": str(tiny_model_dir)},
            "sample": {"num_steps": 2, "eval_num_steps": 2},
            "train": {
                "num_iterations": 2,
                "prompts_per_iteration": 2,
                "group_size": 2,
                "minibatch_size": 4,
                "max_minutes": 0,
            },
            "log": {"checkpoint_every": 2, "images_every": 0, "wandb_mode": "disabled"},
            "data": {"num_heldout": 8},
            "explore": {"mode": "stale", "max_candidates": 4},
            "runtime": {"spot_nodes": 2},
            "cost": {"on_demand_usd_per_gpu_hour": 3.6, "spot_discount": 0.5},
        },
    )
    run_training(cfg, tmp_path, progress=False)
    rows = read_metrics(tmp_path)
    assert all(0 < r["cost/spot_gpus_held"] <= 2 for r in rows)  # 2, unless Ray declared a node dead meanwhile
    previous = {"cost/gpu_s_on_demand": 0.0, "cost/gpu_s_spot": 0.0}
    for r in rows:  # each interval: the spot GPUs held at its end x its wall time, busy or not
        wall_s = r["cost/gpu_s_on_demand"] - previous["cost/gpu_s_on_demand"]  # one trainer GPU
        assert r["cost/gpu_s_spot"] - previous["cost/gpu_s_spot"] == pytest.approx(r["cost/spot_gpus_held"] * wall_s)
        assert r["cost/usd_spot"] == pytest.approx(r["cost/gpu_s_spot"] / 3600 * 1.8)  # half of 3.6 USD/GPU-hour
        previous = r
    assert read_ledger(tmp_path)["pools"]["spot"]["usage"][0][2] == rows[0]["cost/spot_gpus_held"] > 0
