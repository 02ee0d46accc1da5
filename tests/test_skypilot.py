"""configs/skypilot/: the SkyPilot tasks parse, carry what SkyPilot requires, and run what spotlight needs.

SkyPilot itself is not installed in the project's venv: its releases (0.10 to 0.14.1) pin
`click<8.2`, and wandb and huggingface_hub (which transformers needs) require a newer click
(docs/spot.md, "SkyPilot").
So these tests check the tasks in three ways:

- The fields SkyPilot reads, against the subset of its task schema the tasks use (a typo in a key
  is rejected, as SkyPilot rejects it), and our own rules (the head on demand, the workers on
  spot in the head's region, no secret value in a file).
- The `setup` and `run` scripts run under bash with stand-ins for `ray`, `spotlight`, `python`,
  `pip` and `sleep` that record their arguments. The recorded commands then go through the real
  parsers: Ray's `ray start`, spotlight's CLI and recipe loader (every override must be a real
  field), and the preemption watcher's command line.
- With SkyPilot in another interpreter (`SPOTLIGHT_SKYPILOT_PYTHON=/path/to/python`), its own
  `Task.from_yaml_config`, `Task.validate` and config schema, offline (skipped otherwise).

Nothing here contacts a cloud or the network.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import click
import pytest
import ray
import yaml
from ray.scripts.scripts import start as ray_start_command

import spot.metadata
from spotlight.core.cost import ON_DEMAND, SPOT

ROOT = Path(__file__).resolve().parents[1]
SKY_DIR = ROOT / "configs" / "skypilot"
HEAD, WORKER, SKY_CONFIG = SKY_DIR / "head.yaml", SKY_DIR / "spot-worker.yaml", SKY_DIR / "sky-config.yaml"
SKYPILOT_RAY_PORTS = {6380, 8266, 8076, 52365}
"""Ports SkyPilot's own Ray cluster holds on every node it launches (GCS, dashboard, object manager,
dashboard agent): spotlight's Ray must not take them."""
HEAD_ENVS = {"STORE_URL": "s3://my-bucket/runs/exp1", "MODELS_URL": "s3://my-bucket/models"}
WORKER_ENVS = {"HEAD_IP": "10.0.1.23", "MODELS_URL": "s3://my-bucket/models"}
"""What a user passes with `--env` for each task's required (null) variables."""

# The fields of a SkyPilot task (and of its `resources`) that a task here may use. A subset of
# SkyPilot's task schema, which rejects any other key; the SkyPilot test below checks the subset.
TASK_KEYS = {"name", "workdir", "num_nodes", "resources", "envs", "secrets", "file_mounts", "setup", "run", "config"}
RESOURCE_KEYS = {
    "infra",
    "instance_type",
    "accelerators",
    "cpus",
    "memory",
    "use_spot",
    "disk_size",
    "disk_tier",
    "any_of",
    "ordered",
    "job_recovery",
    "image_id",
    "ports",
    "labels",
}
STORAGE_KEYS = {"name", "source", "store", "mode", "persistent"}
STORAGE_MODES = {"MOUNT", "COPY", "MOUNT_CACHED"}
RECOVERY_STRATEGIES = {"FAILOVER", "EAGER_NEXT_REGION"}


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key given twice in one mapping (SkyPilot refuses it too)."""


def _mapping(loader, node, deep=False):
    keys = [loader.construct_object(k, deep=deep) for k, _ in node.value]
    twice = sorted({k for k in keys if keys.count(k) > 1})
    if twice:
        raise yaml.constructor.ConstructorError(None, None, f"duplicate key(s) {twice}", node.start_mark)
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)


def load_task(path: Path) -> dict:
    return yaml.load(path.read_text(), Loader=_UniqueKeyLoader)


def check_task(task: dict, where: str) -> None:
    """Raise ValueError on what SkyPilot would refuse in the fields a task here uses."""

    def unknown(keys, allowed, what):
        extra = sorted(set(keys) - allowed)
        if extra:
            raise ValueError(f"{where}: unknown {what} key(s) {extra}; SkyPilot accepts {sorted(allowed)}")

    unknown(task, TASK_KEYS, "task")
    if not re.fullmatch(r"[a-z][a-z0-9-]*", task.get("name", "")):
        raise ValueError(f"{where}: name {task.get('name')!r} must be lowercase letters, digits and dashes")
    for key in ("setup", "run"):
        if not isinstance(task.get(key), str):
            raise ValueError(f"{where}: {key} must be a shell script (a string)")
    envs = task.get("envs", {})
    for name, value in envs.items():
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name) or not (value is None or isinstance(value, str)):
            raise ValueError(f"{where}: envs.{name}={value!r}: a shell variable name and a string (or null: required)")
    res = task["resources"]
    unknown(res, RESOURCE_KEYS, "resources")
    for alternative in res.get("any_of", []) + res.get("ordered", []):
        unknown(alternative, RESOURCE_KEYS - {"any_of", "ordered"}, "resources.any_of")
    if not isinstance(res.get("use_spot", False), bool):
        raise ValueError(f"{where}: resources.use_spot must be true or false")
    if not (isinstance(res.get("disk_size"), int) and res["disk_size"] > 0):
        raise ValueError(f"{where}: resources.disk_size must be a positive number of GB")
    if not re.fullmatch(r"aws/[a-z]+-[a-z]+-\d+", res.get("infra", "")):
        raise ValueError(f"{where}: resources.infra must be aws/REGION (the head's region), got {res.get('infra')!r}")
    recovery = res.get("job_recovery")
    if recovery is not None:
        unknown(recovery, {"strategy", "max_restarts_on_errors", "recover_on_exit_codes"}, "resources.job_recovery")
        if recovery.get("strategy") not in RECOVERY_STRATEGIES:
            raise ValueError(f"{where}: job_recovery.strategy must be one of {sorted(RECOVERY_STRATEGIES)}")
    for dst, src in task.get("file_mounts", {}).items():
        if not dst.startswith(("/", "~")) or dst.endswith("/"):
            raise ValueError(f"{where}: file_mounts destination {dst!r} must be absolute, without a trailing slash")
        if isinstance(src, dict):
            unknown(src, STORAGE_KEYS, f"file_mounts.{dst}")
            if src.get("mode", "MOUNT") not in STORAGE_MODES:
                raise ValueError(f"{where}: file_mounts.{dst}.mode must be one of {sorted(STORAGE_MODES)}")
            src = src["source"]
        for var in re.findall(r"\$\{(\w+)\}", src):
            if var not in envs:
                raise ValueError(f"{where}: file_mounts.{dst} uses ${{{var}}}, which envs does not declare")


@pytest.fixture(scope="module")
def head() -> dict:
    return load_task(HEAD)


@pytest.fixture(scope="module")
def worker() -> dict:
    return load_task(WORKER)


def test_tasks_carry_what_skypilot_requires(head, worker):
    check_task(head, "head.yaml")
    check_task(worker, "spot-worker.yaml")


@pytest.mark.parametrize(
    "break_it",
    [
        lambda t: t.update(resource=t.pop("resources")),  # top-level typo
        lambda t: t["resources"].update(use_spots=t["resources"].pop("use_spot")),
        lambda t: t["resources"]["any_of"][0].update(instance=t["resources"]["any_of"][0].pop("instance_type")),
        lambda t: t["resources"]["job_recovery"].update(strategy="RETRY"),
        lambda t: t["resources"].update(infra="us-east-1"),
        lambda t: t["file_mounts"]["/models"].update(mode="SYNC"),
        lambda t: t["envs"].pop("MODELS_URL"),  # file_mounts' ${MODELS_URL}
    ],
    ids=["task-key", "resources-key", "any_of-key", "recovery-strategy", "infra", "mount-mode", "undeclared-env"],
)
def test_a_broken_task_is_rejected(worker, break_it):
    broken = copy.deepcopy(worker)
    break_it(broken)
    with pytest.raises(ValueError):
        check_task(broken, "broken")


def test_a_duplicate_key_is_rejected(tmp_path):
    twice = tmp_path / "twice.yaml"
    twice.write_text(HEAD.read_text() + "\nrun: echo again\n")
    with pytest.raises(yaml.constructor.ConstructorError, match="duplicate"):
        load_task(twice)


def test_head_is_on_demand_workers_are_spot_in_its_region(head, worker):
    assert head["resources"]["use_spot"] is False and "num_nodes" not in head  # one node: the trainer's
    assert worker["resources"]["use_spot"] is True
    assert worker["resources"]["infra"] == head["resources"]["infra"]  # the head's private address
    assert worker["resources"]["job_recovery"]["strategy"] == "FAILOVER"  # stays in that region
    assert head["resources"]["instance_type"] == "p5.4xlarge"  # cost.instance_type: the workers' price
    assert "p5.4xlarge" in {r["instance_type"] for r in worker["resources"]["any_of"]}


def test_secrets_have_no_value_and_required_envs_are_null(head, worker):
    assert head["secrets"] == {"WANDB_API_KEY": None}  # passed at launch, never in the file
    assert "WANDB_API_KEY" not in head["envs"] and "secrets" not in worker
    assert {k for k, v in head["envs"].items() if v is None} == set(HEAD_ENVS)
    assert {k for k, v in worker["envs"].items() if v is None} == set(WORKER_ENVS)
    for task in (head, worker):
        assert task["file_mounts"]["/models"] == {"source": "${MODELS_URL}", "mode": "COPY"}


def test_the_project_config_puts_all_nodes_in_one_security_group():
    config = load_task(SKY_CONFIG)
    assert set(config) == {"aws"} and set(config["aws"]) == {"security_group_name"}
    assert re.fullmatch(r"[A-Za-z0-9_-]+", config["aws"]["security_group_name"])


# -- running the scripts with stand-in commands -----------------------------------------------------

FAKE = """\
#!{python} -S
# Stand-in for `{{name}}`: records its arguments (and the Ray health-check variables) as one JSON line.
import json, os, sys
name, args = os.path.basename(sys.argv[0]), sys.argv[1:]
env = {{k: v for k, v in os.environ.items() if k.startswith("RAY_health_check")}}
with open(os.environ["FAKE_LOG"], "a") as f:
    f.write(json.dumps({{"cmd": name, "args": args, "env": env}}) + "\\n")
if name == "ray" and args[:1] == ["status"]:
    sys.exit(1)  # no spotlight Ray on this node yet
if name == "ray" and args[:1] == ["health-check"]:
    counter = os.environ["FAKE_LOG"] + ".checks"
    done = int(open(counter).read()) if os.path.exists(counter) else 0
    open(counter, "w").write(str(done + 1))
    sys.exit(0 if done < int(os.environ.get("FAKE_HEALTHY_CHECKS", "1000")) else 1)
if name in ("python", "python3") and args[:2] == ["-m", "venv"]:
    os.makedirs(os.path.join(args[2], "bin"))
    open(os.path.join(args[2], "bin", "activate"), "w").write("# stand-in venv\\n")
"""


def run_script(script: str, tmp_path: Path, envs: dict[str, str], *, healthy_checks: int = 1000) -> list[dict]:
    """Runs a task's `setup` or `run` under bash as SkyPilot would, with stand-in commands; returns
    the commands they ran, in order."""
    bin_dir, home = tmp_path / "bin", tmp_path / "home"
    bin_dir.mkdir(exist_ok=True)
    home.mkdir(exist_ok=True)
    for name in ("ray", "spotlight", "python", "python3", "pip", "sleep"):
        fake = bin_dir / name
        fake.write_text(FAKE.format(python=sys.executable))
        fake.chmod(0o755)
    log = tmp_path / "commands.jsonl"
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "HOME": str(home),
        "FAKE_LOG": str(log),
        "FAKE_HEALTHY_CHECKS": str(healthy_checks),
        **envs,
    }
    done = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in log.read_text().splitlines()]


def run_task(task: dict, tmp_path: Path, envs: dict[str, str], *, healthy_checks: int = 1000) -> list[dict]:
    """Runs a task's `setup`, then its `run`, on one stand-in node; returns the commands `run` ran."""
    run_script(task["setup"], tmp_path, envs)
    (tmp_path / "commands.jsonl").unlink()
    return run_script(task["run"], tmp_path, envs, healthy_checks=healthy_checks)


def task_env(task: dict, required: dict[str, str], **skypilot: str) -> dict[str, str]:
    """The environment SkyPilot gives a task's commands: its envs, the --env values, its own variables."""
    envs = {k: v for k, v in task["envs"].items() if v is not None}
    return {**envs, **required, **skypilot}


def ray_start_params(args: list[str]) -> dict:
    """`ray start`'s options as Ray's own command line parses them (an unknown flag raises)."""
    assert args[0] == "start"
    return ray_start_command.make_context("ray start", args[1:]).params


def test_setup_installs_spotlight_with_this_ray_on_every_node(head, worker, tmp_path):
    assert head["setup"] == worker["setup"]  # one environment on every node of the Ray cluster
    commands = run_script(head["setup"], tmp_path, task_env(head, HEAD_ENVS))
    assert commands[0]["cmd"] == "python3"  # the venv, made once
    installs = [c["args"] for c in commands if c["cmd"] == "pip" and "-e" in c["args"]]
    assert len(installs) == 1 and installs[0][installs[0].index("-e") + 1] == "."  # this checkout (the workdir)
    assert f"ray[default]=={ray.__version__}" in installs[0]  # every node's Ray the same, and the tests'
    assert head["workdir"] == worker["workdir"] == "."


def test_head_starts_the_ray_head_and_trains_against_it(head, tmp_path, monkeypatch):
    ips = "10.0.1.23\n"
    env = task_env(head, HEAD_ENVS, SKYPILOT_NODE_IPS=ips, SKYPILOT_NODE_RANK="0", SKYPILOT_NUM_GPUS_PER_NODE="1")
    env["TRAIN_ARGS"] = "train.num_iterations=200 train.lr=5e-5"
    commands = run_task(head, tmp_path, env)
    assert not any(c["cmd"] == "ray" and c["args"][:1] == ["stop"] for c in commands)  # SkyPilot's Ray runs here too
    starts = [c for c in commands if c["cmd"] == "ray" and c["args"][:1] == ["start"]]
    assert len(starts) == 1
    params = ray_start_params(starts[0]["args"])
    assert params["head"] and params["port"] == 6379 and params["num_gpus"] == 0  # the trainer owns the GPU
    assert json.loads(params["resources"]) == {ON_DEMAND: 1}
    assert params["port"] not in SKYPILOT_RAY_PORTS and params["dashboard_agent_listen_port"] not in SKYPILOT_RAY_PORTS
    assert starts[0]["env"] == {"RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "2"}

    trains = [c for c in commands if c["cmd"] == "spotlight"]
    assert len(trains) == 1 and commands.index(trains[0]) > commands.index(starts[0])
    monkeypatch.chdir(ROOT)
    cfg, run_dir = load_spotlight_train(trains[0]["args"])
    assert cfg.runtime.rollouts == "cluster" and cfg.explore.mode == "stale"
    assert cfg.runtime.ray_address == "10.0.1.23:6379"  # the head's own address, as the workers use it
    assert cfg.runtime.imds_endpoint == "http://169.254.169.254"
    assert cfg.log.store_url == HEAD_ENVS["STORE_URL"] and cfg.log.wandb_mode == "online"
    assert cfg.cost.spot_price == "history"
    assert cfg.train.num_iterations == 200 and cfg.train.lr == 5e-5  # TRAIN_ARGS pass through
    assert run_dir == str(tmp_path / "home" / "runs" / "qwen-image")


def load_spotlight_train(argv: list[str]):
    """(recipe, run dir) of a `spotlight train` command line, loaded as the CLI loads it."""
    from spotlight import cli

    parser = cli.build_parser()
    args, extra = parser.parse_known_args(argv)
    assert args.command == "train" and not [e for e in extra if e.startswith("-") or "=" not in e], argv
    args.items += extra
    cfg, _ = cli._load_recipe(args)  # raises ValueError on an unknown field or a bad value
    return cfg, args.run_dir


def test_a_bad_override_or_ray_flag_in_the_head_is_caught(head, tmp_path, monkeypatch):
    env = task_env(head, HEAD_ENVS, SKYPILOT_NODE_IPS="10.0.1.23", SKYPILOT_NODE_RANK="0")
    env["TRAIN_ARGS"] = "train.lrr=5e-5"
    commands = run_task(head, tmp_path, env)
    monkeypatch.chdir(ROOT)
    with pytest.raises(ValueError, match="train.lrr"):
        load_spotlight_train(next(c["args"] for c in commands if c["cmd"] == "spotlight"))
    typo = {**head, "run": head["run"].replace("--num-gpus=0", "--num-gpu=0")}
    assert typo["run"] != head["run"]
    (tmp_path / "typo").mkdir()
    commands = run_task(typo, tmp_path / "typo", env)
    start = next(c for c in commands if c["cmd"] == "ray" and c["args"][:1] == ["start"])
    with pytest.raises(click.NoSuchOption):
        ray_start_params(start["args"])


@pytest.mark.parametrize("gpus", ["1", "8"])
def test_worker_joins_the_head_watches_for_notices_and_leaves_with_it(worker, tmp_path, gpus):
    env = task_env(
        worker, WORKER_ENVS, SKYPILOT_NODE_IPS="10.0.2.7", SKYPILOT_NODE_RANK="0", SKYPILOT_NUM_GPUS_PER_NODE=gpus
    )
    # The head answers the wait and two keep-alive checks, then never again: the loop must end.
    commands = run_task(worker, tmp_path, env, healthy_checks=3)
    head = f"{WORKER_ENVS['HEAD_IP']}:6379"
    assert not any(c["cmd"] == "ray" and c["args"][:1] == ["stop"] for c in commands)
    starts = [c for c in commands if c["cmd"] == "ray" and c["args"][:1] == ["start"]]
    assert len(starts) == 1
    params = ray_start_params(starts[0]["args"])
    assert params["address"] == head and not params["head"]
    assert params["num_gpus"] == int(gpus) and json.loads(params["resources"]) == {
        SPOT: int(gpus)
    }  # a `spot` unit per GPU
    assert params["dashboard_agent_listen_port"] not in SKYPILOT_RAY_PORTS
    checks = [c for c in commands if c["cmd"] == "ray" and c["args"][:1] == ["health-check"]]
    assert all(c["args"] == ["health-check", f"--address={head}"] for c in checks)
    assert len(checks) == 3 + 10  # ten misses in a row end the job
    sleeps = [float(c["args"][0]) for c in commands if c["cmd"] == "sleep"]
    assert sum(sleeps[-10:]) >= 240  # longer than a spot notice's 120 s

    # The watcher runs in the background: give it a moment to record itself.
    log = tmp_path / "commands.jsonl"
    deadline = time.monotonic() + 10
    while True:
        everything = [json.loads(line) for line in log.read_text().splitlines()]
        if any(c["cmd"] == "python" for c in everything):
            break
        assert time.monotonic() < deadline, "the preemption watcher never started"
        time.sleep(0.05)
    watcher = next(c for c in everything if c["cmd"] == "python")
    assert everything.index(watcher) > everything.index(starts[0])  # once this node has joined
    assert watcher["args"][:2] == ["-m", "spot.metadata"]
    parsed = spot.metadata.build_parser().parse_args(watcher["args"][2:])  # exits (fails) on a bad flag
    assert parsed.address == head and not parsed.no_drain  # drains this node of the head's cluster
    assert parsed.endpoint == spot.metadata.DEFAULT_ENDPOINT


# -- SkyPilot's own checks, where it is installed -----------------------------------------------------

SKYPILOT_CHECK = textwrap.dedent(
    """
    import json, socket, sys

    attempts = []

    def no_network(*args, **kwargs):
        attempts.append(repr(args))
        raise OSError(f"network contact attempted: {args}")

    socket.getaddrinfo = no_network
    _connect = socket.socket.connect
    socket.socket.connect = lambda s, a: _connect(s, a) if s.family == socket.AF_UNIX else no_network(a)

    import sky, yaml
    from sky.utils import common_utils, schemas

    spec = json.load(sys.stdin)
    out = {"version": sky.__version__}
    task_schema, resources_schema = schemas.get_task_schema(), schemas.get_resources_schema()
    out["task_keys"] = sorted(task_schema["properties"])
    out["resource_keys"] = sorted(resources_schema["properties"])
    out["tasks"] = {}
    for path, envs, secrets in spec["tasks"]:
        config = yaml.safe_load(open(path))
        try:
            sky.Task.from_yaml_config(dict(config))
            required = "accepted without its --env values"
        except ValueError as e:
            required = str(e)
        task = sky.Task.from_yaml_config(
            config, env_overrides=list(envs.items()), secrets_overrides=list(secrets.items()) or None
        )
        task.validate()
        out["tasks"][path] = {
            "required": required,
            "resources": sorted(
                [r.instance_type, bool(r.use_spot), r.region, r.disk_size, (r.job_recovery or {}).get("strategy")]
                for r in task.resources
            ),
            "storage": {dst: [s.source, s.mode.value] for dst, s in task.storage_mounts.items()},
            "secrets": sorted(task.secrets),
        }
    common_utils.validate_schema(yaml.safe_load(open(spec["config"])), schemas.get_config_schema(), "config: ")
    try:
        sky.Task.from_yaml_config(spec["broken"], env_overrides=list(spec["broken_envs"].items()))
        out["broken"] = "accepted"
    except ValueError as e:
        out["broken"] = str(e)
    out["network"] = attempts
    print(json.dumps(out))
    """
)

# SkyPilot checks instance types against its catalog, which it downloads when missing. These rows
# (AWS's published specs of the two instance types the tasks use, no prices) keep it offline.
CATALOG = """\
InstanceType,AcceleratorName,AcceleratorCount,vCPUs,MemoryGiB,GpuInfo,Price,SpotPrice,Region,AvailabilityZone
p5.4xlarge,H100,1.0,16.0,256.0,,,,us-east-1,use1-az1
p5.48xlarge,H100,8.0,192.0,2048.0,,,,us-east-1,use1-az1
"""


@pytest.mark.skipif(
    not os.environ.get("SPOTLIGHT_SKYPILOT_PYTHON"),
    reason="SPOTLIGHT_SKYPILOT_PYTHON (an interpreter with skypilot) not set",
)
def test_skypilot_accepts_the_tasks(worker, tmp_path):
    home = tmp_path / "home"
    catalog = home / ".sky" / "catalogs"
    python = os.environ["SPOTLIGHT_SKYPILOT_PYTHON"]
    version = subprocess.run(
        [python, "-c", "from sky.skylet import constants; print(constants.CATALOG_SCHEMA_VERSION)"],
        capture_output=True,
        text=True,
        env={"HOME": str(home), "PATH": os.environ["PATH"]},
    )
    assert version.returncode == 0, version.stderr
    (catalog / version.stdout.strip() / "aws").mkdir(parents=True)
    (catalog / version.stdout.strip() / "aws" / "vms.csv").write_text(CATALOG)
    broken = copy.deepcopy(worker)
    broken["resources"]["use_spots"] = broken["resources"].pop("use_spot")
    spec = {
        "tasks": [[str(HEAD), HEAD_ENVS, {"WANDB_API_KEY": "not-a-key"}], [str(WORKER), WORKER_ENVS, {}]],
        "config": str(SKY_CONFIG),
        "broken": broken,
        "broken_envs": WORKER_ENVS,
    }
    # No AWS credentials and no instance metadata: SkyPilot falls back to its defaults.
    env = {
        "HOME": str(home),
        "PATH": os.environ["PATH"],
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_CONFIG_FILE": os.devnull,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    }
    done = subprocess.run(
        [python, "-c", SKYPILOT_CHECK],
        input=json.dumps(spec),
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert TASK_KEYS <= set(out["task_keys"]) and RESOURCE_KEYS <= set(out["resource_keys"])  # our subset is real
    head_out, worker_out = out["tasks"][str(HEAD)], out["tasks"][str(WORKER)]
    assert "STORE_URL" in head_out["required"] and "HEAD_IP" in worker_out["required"]  # null envs: --env needed
    assert head_out["resources"] == [["p5.4xlarge", False, "us-east-1", 500, None]]
    assert worker_out["resources"] == sorted(
        [t, True, "us-east-1", 300, "FAILOVER"] for t in ("p5.4xlarge", "p5.48xlarge")
    )
    for t in (head_out, worker_out):
        assert t["storage"] == {"/models": [WORKER_ENVS["MODELS_URL"], "COPY"]}
    assert head_out["secrets"] == ["WANDB_API_KEY"]
    assert "use_spots" in out["broken"]
    assert out["network"] == []  # SkyPilot tried no connection and no name lookup
