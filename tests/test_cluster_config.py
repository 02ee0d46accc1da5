"""configs/cluster/aws-spot.yaml passes Ray's own checks, offline, and carries what spotlight needs.

Ray's `prepare_config` + `validate_config` are the first steps of `ray up` (before any AWS call).
The instance types are checked against moto's EC2 catalog in-process (`mock_aws`: nothing leaves
this machine), which is also where the autoscaler's resource fill-out reads them from.
"""

from __future__ import annotations

import copy
import os
import re
import shlex
from pathlib import Path

import pytest
import ray
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

import spot.metadata
from spotlight.core.cost import ON_DEMAND, SPOT

CLUSTER_YAML = Path(__file__).resolve().parents[1] / "configs" / "cluster" / "aws-spot.yaml"


@pytest.fixture(scope="module")
def raw() -> dict:
    return yaml.safe_load(CLUSTER_YAML.read_text())


@pytest.fixture(scope="module")
def prepared(raw) -> dict:
    config = prepare_config(copy.deepcopy(raw))
    validate_config(config)  # raises on a schema error
    return config


def spot_types(config: dict) -> dict:
    return {k: v for k, v in config["available_node_types"].items() if k != config["head_node_type"]}


def test_ray_validates_the_cluster_file(prepared):
    assert prepared["provider"]["type"] == "aws"
    assert prepared["provider"]["cache_stopped_nodes"] is False  # a one-time spot instance cannot be stopped
    assert sum(t["max_workers"] for t in spot_types(prepared).values()) <= prepared["max_workers"]


def test_head_is_on_demand_and_workers_are_spot_with_the_pool_resources(prepared):
    head = prepared["available_node_types"][prepared["head_node_type"]]
    assert "InstanceMarketOptions" not in head["node_config"]
    assert head["resources"][ON_DEMAND] == 1 and SPOT not in head["resources"]
    assert head["resources"]["GPU"] == 0  # the trainer owns the head's GPU outside Ray
    workers = spot_types(prepared)
    assert workers
    for name, t in workers.items():
        market = t["node_config"]["InstanceMarketOptions"]
        assert market["MarketType"] == "spot", name
        assert market["SpotOptions"]["InstanceInterruptionBehavior"] == "terminate", name
        # One `spot` unit per GPU: the cluster's `spot` total is the spot GPUs held (spotlight.core.cost).
        assert t["resources"][SPOT] == t["resources"]["GPU"] >= 1, name
        assert ON_DEMAND not in t["resources"], name
    for t in prepared["available_node_types"].values():
        assert t["node_config"]["MetadataOptions"]["HttpTokens"] == "required"  # IMDSv2, as spot.metadata speaks


def test_declared_resources_match_what_the_autoscaler_detects(prepared, monkeypatch):
    """Ray's own resource fill-out (`ray up` runs it), against moto's EC2 instance catalog in-process."""
    import boto3
    from moto import mock_aws
    from ray.autoscaler._private.aws.node_provider import AWSNodeProvider

    for name, value in (
        ("AWS_ACCESS_KEY_ID", "testing"),
        ("AWS_SECRET_ACCESS_KEY", "testing"),
        ("AWS_CONFIG_FILE", os.devnull),
        ("AWS_SHARED_CREDENTIALS_FILE", os.devnull),
    ):
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    bare = copy.deepcopy(prepared)
    for t in bare["available_node_types"].values():
        del t["resources"]
    types = sorted({t["node_config"]["InstanceType"] for t in bare["available_node_types"].values()})
    with mock_aws():
        detected = AWSNodeProvider.fillout_available_node_types_resources(bare)["available_node_types"]
        ec2 = boto3.client("ec2", region_name=prepared["provider"]["region"])
        gpu_info = {
            t["InstanceType"]: t["GpuInfo"] for t in ec2.describe_instance_types(InstanceTypes=types)["InstanceTypes"]
        }
    validate_config({**bare, "available_node_types": detected})
    for name, t in prepared["available_node_types"].items():
        found = detected[name]["resources"]
        assert t["resources"]["CPU"] == found["CPU"], name
        if name == prepared["head_node_type"]:
            assert found["GPU"] >= 1 and t["resources"]["GPU"] == 0  # a GPU for the trainer, hidden from Ray
        else:
            assert t["resources"]["GPU"] == found["GPU"], name
        memory_mib = min(g["MemoryInfo"]["SizeInMiB"] for g in gpu_info[t["node_config"]["InstanceType"]]["Gpus"])
        assert memory_mib >= 80 * 1024, name  # Qwen-Image's DiT and prompt encoder on one GPU


def test_start_commands_set_health_checks_and_start_the_preemption_watcher(prepared):
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        start = next(c for c in prepared[key] if "ray start" in c)
        assert "RAY_health_check_period_ms=1000" in start and "RAY_health_check_failure_threshold=2" in start, key
    watcher = next(c for c in prepared["worker_start_ray_commands"] if "spot.metadata" in c)
    args = re.search(r"python -m spot\.metadata ([^>]*)>", watcher).group(1)
    parsed = spot.metadata.build_parser().parse_args(shlex.split(args))  # exits (fails) on a bad flag
    assert parsed.address == "auto" and not parsed.no_drain
    assert not any("spot.metadata" in c for c in prepared["head_start_ray_commands"])  # the head is on-demand


def test_nodes_install_spotlight_with_this_ray(prepared):
    setup = " ".join(prepared["worker_setup_commands"])  # setup_commands merged in by prepare_config
    assert "pip install" in setup and "~/spotlight" in setup
    assert f"ray[default]=={ray.__version__}" in setup  # the cluster's Ray must match the launcher's
    assert prepared["file_mounts"] == {"~/spotlight": "."}
