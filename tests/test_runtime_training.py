"""Training through preemptions: `spotlight train` with its rollouts on the spot runtime
(runtime.rollouts=cluster) gives, bit for bit, the weights of the same run with local rollouts,
while spot nodes are killed under it, warned first, or come and go along a replayed trace.

The small version of `benchmarks/spot_training.py`. A tiny model, 3 iterations of 3 prompts x 4
seeds, rollout jobs of 2 rows (and local rollout chunks of 2: see `recipe`). The kill and the notice are aimed: a thread
watches the queue and
hits a spot worker's node once it holds a rollout job past a commit, so the preemption lands on
work every time. The trace test runs the real command with `runtime.trace` (a local cluster in a
process of its own adding and killing nodes on the trace's clock).
"""

from __future__ import annotations

import json
import os

# Bind every Ray process to 127.0.0.1; read when `ray` is first imported (spot.localray.import_ray_on_loopback).
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from spotlight.config import DiTRecipe
from spotlight.core.checkpoint import load_checkpoint
from spotlight.core.config_io import from_dict
from spotlight.core.tracking import read_metrics

REPO = Path(__file__).resolve().parents[1]
ITERATIONS, COMMIT_EVERY, NUM_STEPS = 3, 2, 6
THREADS = 2
"""The trainer's torch threads, the same in-process and in the CLI's process: the update's CPU
reductions round differently with another thread count (a test that left the pytest process at
one thread once made the CLI run differ from the local one)."""


def recipe(model_dir: Path, **runtime) -> DiTRecipe:
    data = {
        "model": {"path": str(model_dir), "height": 32, "width": 32},
        # The local rollout's chunks are the jobs' size: this tiny model's matmuls round differently
        # at other batch sizes (the tiny recipe's do not: jobs of 16 against chunks of 128).
        "sample": {"num_steps": NUM_STEPS, "autocast": "none", "batch_size": 2},
        "reward": {"weights": {"jpeg_compressibility": 1.0}},  # varies per seed: every group trains
        "train": {
            "num_iterations": ITERATIONS,
            "prompts_per_iteration": 3,
            "group_size": 4,
            "minibatch_size": 6,
            "max_minutes": 0,
            "num_threads": THREADS,
        },
        "log": {"wandb_mode": "disabled", "images_every": 0, "checkpoint_every": ITERATIONS},
        "data": {"num_heldout": 8},
        "runtime": {"job_size": 2, "commit_every": COMMIT_EVERY, **runtime},
    }
    return from_dict(DiTRecipe, data)


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(run_dir).tensors["trainable"]


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def local_run(tiny_model_dir, tmp_path_factory):
    """The reference: the same recipe, rollouts in the trainer."""
    from spotlight.driver import run_training

    run_dir = tmp_path_factory.mktemp("local")
    run_training(recipe(tiny_model_dir), run_dir, progress=False)
    return run_dir


@pytest.fixture(scope="module")
def cluster():
    """An on-demand head and two spot nodes, each with a fake metadata endpoint in its labels."""
    from spot.cluster import IMDS_LABEL, LocalCluster
    from spot.fake_imds import FakeIMDS

    c = LocalCluster()
    c.imds = {}
    try:
        for name in ("spot-a", "spot-b"):
            c.imds[name] = FakeIMDS().start()
            c.add_node(name, labels={IMDS_LABEL: c.imds[name].url})
        yield c
    finally:
        c.shutdown()
        for imds in c.imds.values():
            imds.stop()


def strike_when_past_a_commit(cluster, monkeypatch, act, *, wait_node_lost: bool = False) -> list:
    """From the second iteration's rollout on, once a spot worker holds a rollout job past a
    commit, call act(cluster, node name) once (on a thread, so the rollout goes on). Returns the
    list it appends (node, job, committed step, progress) to.

    wait_node_lost: after the struck rollout, wait until the runtime counts the node lost and hit.
    Ray declares a killed node dead after its health checks (2-4 s here, longer on a loaded host);
    the job resumes sooner, from its worker's death or its lease's timeout, and the tiny run can end
    before the declaration, leaving the preemption uncounted (a longer run counts it an iteration
    later)."""
    import ray

    from spotlight.spot_runtime import SpotRuntime

    struck: list = []
    rollout = SpotRuntime.rollout

    def watch(rt: SpotRuntime) -> None:
        pool = rt.runtime.pool
        deadline = time.monotonic() + 60
        while not struck and time.monotonic() < deadline:
            for job, group, _, committed, progress in ray.get(rt.runtime.queue.snapshot.remote())["leases"]:
                g = pool.groups.get(group)
                # Past a commit, and steps still to go (at the last step the result may already be on its way).
                if g is None or g.pool != "spot" or committed < COMMIT_EVERY or not committed < progress < NUM_STEPS:
                    continue
                name = next(n for n in cluster.node_names() if cluster.node_id(n) == pool.node_of(g.members[0]))
                struck.append((name, job, committed, progress))
                act(cluster, name)
                return
            time.sleep(0.002)

    def rollout_and_strike(self, version, *args, **kwargs):
        if version == 1 and not struck:
            threading.Thread(target=watch, args=(self,), daemon=True).start()
        out = rollout(self, version, *args, **kwargs)
        deadline = time.monotonic() + 30
        pool = self.runtime.pool
        while wait_node_lost and struck and not set(pool.nodes_lost) & pool.nodes_hit and time.monotonic() < deadline:
            time.sleep(0.05)
        return out

    monkeypatch.setattr(SpotRuntime, "rollout", rollout_and_strike)
    return struck


def test_a_spot_node_killed_mid_rollout_changes_nothing_in_the_weights(
    tiny_model_dir, local_run, cluster, tmp_path, monkeypatch
):
    from spotlight.driver import run_training

    struck = strike_when_past_a_commit(
        cluster, monkeypatch, lambda c, name: c.remove_node(name), wait_node_lost=True
    )  # SIGKILL, no notice
    # Steps of at least 0.15 s (emulated slower device): the kill lands while the struck job still has
    # steps to go. At full speed its last steps take milliseconds, and on a loaded host the job could
    # end between the watcher's look and the kill (then no work is hit, and none is counted).
    run_training(
        recipe(tiny_model_dir, rollouts="cluster", ray_address=cluster.address, emulated_step_s=0.15),
        tmp_path,
        progress=False,
    )
    assert struck, "no spot worker held a rollout job past a commit"
    last = read_metrics(tmp_path)[-1]
    assert last["runtime/preemptions_total"] == 1 and last["runtime/preemptions_hitting_work_total"] == 1
    assert last["runtime/rollout_jobs_submitted_total"] == last["runtime/rollout_jobs_done_total"] == ITERATIONS * 6
    assert last["runtime/duplicated_results_total"] == 0
    assert last["runtime/rollout_jobs_resumed_total"] >= 1 and last["runtime/rollout_leases_revoked_total"] == 1
    # The steps past the last commit and the one in flight, at most the commit interval.
    assert 1 <= last["runtime/rollout_steps_recomputed_total"] <= COMMIT_EVERY
    assert same(weights(tmp_path), weights(local_run))


def test_a_notice_commits_mid_rollout_and_nothing_is_recomputed(
    tiny_model_dir, local_run, cluster, tmp_path, monkeypatch
):
    from spotlight.driver import run_training

    def warn_then_kill(c, name):
        c.imds[name].schedule_interruption(lead_s=2.0)  # the node's metadata endpoint announces the reclaim
        threading.Timer(2.0, c.remove_node, args=(name,)).start()

    struck = strike_when_past_a_commit(cluster, monkeypatch, warn_then_kill)
    # Steps of at least 0.15 s (emulated slower device) and a 20 ms metadata poll: the notice is seen
    # while the struck job still has steps to go (its 6 steps take tens of ms on this tiny model, so
    # at full speed the job could end before a 0.5 s poll sees the notice).
    run_training(
        recipe(
            tiny_model_dir, rollouts="cluster", ray_address=cluster.address, notice_poll_s=0.02, emulated_step_s=0.15
        ),
        tmp_path,
        progress=False,
    )
    assert struck, "no spot worker held a rollout job past a commit"
    time.sleep(0.1)
    last = read_metrics(tmp_path)[-1]
    assert last["runtime/rollout_leases_released_total"] >= 1 and last["runtime/rollout_leases_revoked_total"] == 0
    assert last["runtime/rollout_steps_recomputed_total"] == 0
    assert last["runtime/rollout_jobs_submitted_total"] == last["runtime/rollout_jobs_done_total"]
    assert same(weights(tmp_path), weights(local_run))


def test_the_cli_trains_on_a_replayed_trace(tiny_model_dir, local_run, tmp_path):
    """`spotlight train ... runtime.rollouts=cluster runtime.trace=FILE`: a cluster in a process of its
    own adds and kills spot nodes along the trace (here about every second); the run ends with the
    local run's weights and says what the runtime went through."""
    trace = tmp_path / "trace.csv"  # Bamboo's format: seconds,instances
    trace.write_text(
        "".join(f"{t},{n}\n" for t, n in [(0, 2), (4, 1), (7, 2), (10, 1), (13, 2), (16, 1), (19, 2)]) + "22,2\n"
    )
    run_dir = tmp_path / "run"
    overrides = [
        f"model.path={tiny_model_dir}",
        "sample.num_steps=6",
        "sample.autocast=none",
        "sample.batch_size=2",
        "reward.weights={jpeg_compressibility: 1.0}",
        f"train.num_iterations={ITERATIONS}",
        "train.prompts_per_iteration=3",
        "train.group_size=4",
        "train.minibatch_size=6",
        "train.max_minutes=0",
        f"train.num_threads={THREADS}",
        "log.wandb_mode=disabled",
        "log.images_every=0",
        f"log.checkpoint_every={ITERATIONS}",
        "data.num_heldout=8",
        "runtime.job_size=2",
        f"runtime.commit_every={COMMIT_EVERY}",
        "runtime.rollouts=cluster",
        f"runtime.trace={trace}",
        "runtime.trace_nodes=2",
        "runtime.trace_window_s=22",
        "runtime.trace_compress=4",
        "runtime.trace_start_s=0",
        "runtime.trace_notice_s=1",
    ]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "spotlight.cli",
            "train",
            "configs/dit/tiny-shapes.yaml",
            *overrides,
            "--run-dir",
            str(run_dir),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env=dict(os.environ, WANDB_MODE="disabled"),
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "runtime: rollouts cluster" in proc.stdout and "preemptions" in proc.stdout
    applied = (run_dir / "replay.jsonl").read_text()
    assert '"kind": "add"' in applied and '"kind": "notice"' in applied
    last = read_metrics(run_dir)[-1]
    assert last["runtime/rollout_jobs_submitted_total"] == last["runtime/rollout_jobs_done_total"]
    assert last["runtime/duplicated_results_total"] == 0
    # The lease log: every job completed exactly once; a job that moved says where and why.
    leases = [json.loads(line) for line in (run_dir / "leases.jsonl").read_text().splitlines()]
    completed = [r["job"] for r in leases if r["end"] == "completed"]
    assert sorted(completed) == list(range(ITERATIONS * 6))
    moved = [r for r in leases if r["end"] != "completed" or r["from_step"] > 0]
    assert same(weights(run_dir), weights(local_run)), f"leases that did not run a whole job: {moved}"


def test_rollout_jobs_cut_the_rows_in_order_and_never_exceed_the_forward_batch():
    """runtime.job_size rows per job (0: a group), capped at sample.batch_size: the forward batch a
    user sized to the device's memory (a GPU recipe's 8 against the default 32)."""
    from spotlight.jobs import rollout_jobs

    prompts, seeds = [f"p{i // 4}" for i in range(12)], list(range(100, 112))

    def sizes(**over) -> list[int]:
        cfg = from_dict(DiTRecipe, {"train": {"group_size": 4}, **over})
        jobs = rollout_jobs(cfg, prompts, seeds, [])
        assert [s for j in jobs for s in j.seeds] == seeds and [p for j in jobs for p in j.prompts] == prompts
        return [len(j.seeds) for j in jobs]

    assert sizes(runtime={"job_size": 5}) == [5, 5, 2]
    assert sizes(runtime={"job_size": 0}) == [4, 4, 4]
    assert sizes(runtime={"job_size": 32}, sample={"batch_size": 8}) == [8, 4]
    assert sizes() == [12]  # the default 32 rows, under the tiny recipe's forward batch of 128
