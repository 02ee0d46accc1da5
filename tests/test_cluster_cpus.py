"""`runtime.local_cluster_cpus`: a local cluster's processes on CPUs of their own and the trainer on
the rest, so that emulated spot nodes do not compute on the trainer's CPUs (docs/spot.md,
"Exploration under a trace"). Real processes and a real local Ray cluster; Linux affinity masks."""

from __future__ import annotations

import os

# Bind every Ray process to 127.0.0.1; read when `ray` is first imported (spot.localray.import_ray_on_loopback).
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

import subprocess
import sys
import threading

import pytest
import torch

from spot.cluster import children_on, pin_process, split_cpus
from spotlight.config import DiTRecipe
from spotlight.core.config_io import from_dict

CPUS = sorted(os.sched_getaffinity(0))
needs_two = pytest.mark.skipif(len(CPUS) < 2, reason="needs 2 CPUs to split")


def allowed(pid: int) -> set[int] | None:
    """The CPUs process (or thread) `pid` may run on; None once it has ended."""
    try:
        return os.sched_getaffinity(pid)
    except ProcessLookupError:
        return None


def descendants(root: int) -> set[int]:
    """Live processes under `root` (by each process's parent in /proc)."""
    parent = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    # the command name is in parentheses and may hold spaces: the fields follow the last ')'
                    parent[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    out, frontier = set(), {root}
    while frontier:
        frontier = {p for p, pp in parent.items() if pp in frontier} - out
        out |= frontier
    return out


def test_split_names_the_setting_when_it_leaves_nothing():
    with pytest.raises(ValueError, match="runtime.local_cluster_cpus=0"):
        split_cpus(0, field="runtime.local_cluster_cpus")
    with pytest.raises(ValueError, match=f"runtime.local_cluster_cpus={len(CPUS)}"):
        split_cpus(len(CPUS), field="runtime.local_cluster_cpus")
    with pytest.raises(ValueError, match="ray_address"):
        from_dict(DiTRecipe, {"runtime": {"local_cluster_cpus": 1, "ray_address": "10.0.0.1:6379"}})


@needs_two
def test_children_inherit_the_block_mask_and_pinning_reaches_every_thread():
    trainer, cluster = split_cpus(1)
    assert trainer | cluster == set(CPUS) and not trainer & cluster and len(cluster) == 1
    with children_on(cluster):
        child = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import os, sys; print(sorted(os.sched_getaffinity(0))); sys.stdout.flush(); input()",
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
    try:
        assert child.stdout.readline().strip() == str(sorted(cluster))
        assert os.sched_getaffinity(0) == set(CPUS)  # the block's mask was the calling thread's, for the block
    finally:
        child.communicate("\n", timeout=10)
    started, stop = threading.Event(), threading.Event()
    tid = []
    worker = threading.Thread(target=lambda: (tid.append(threading.get_native_id()), started.set(), stop.wait()))
    worker.start()
    started.wait()
    try:
        pin_process(trainer)
        assert allowed(tid[0]) == trainer and os.sched_getaffinity(0) == trainer
    finally:
        pin_process(set(CPUS))
        stop.set()
        worker.join()
    assert os.sched_getaffinity(0) == set(CPUS)


@needs_two
def test_the_runtime_starts_its_cluster_on_its_cpus_and_gives_the_trainer_the_rest(tiny_model_dir, tmp_path):
    """Every process the runtime starts (Ray's, the spot nodes' workers) runs on the cluster's CPU;
    every thread of the trainer and its on-demand worker on the others, with one torch thread per
    CPU; close gives them back."""
    import ray

    from spotlight.spot_runtime import start_runtime

    cfg = from_dict(
        DiTRecipe,
        {
            "model": {"path": str(tiny_model_dir), "height": 32, "width": 32},
            "runtime": {"rollouts": "cluster", "spot_nodes": 1, "local_cluster_cpus": 1},
            "train": {"num_threads": 0},
        },
    )
    trainer, cluster = split_cpus(1)
    before, threads = descendants(os.getpid()), torch.get_num_threads()
    rt = start_runtime(cfg, tmp_path)
    try:
        rt.wait_ready(cfg.runtime.startup_timeout_s)  # the workers are up: they were forked by the nodes
        started = descendants(os.getpid()) - before
        assert len(started) >= 4, started  # GCS, raylets, workers at least
        # The on-demand worker uses the trainer's devices (idle while it waits): the trainer's CPUs.
        on_demand = {m.pid for m in rt.runtime.pool.workers.values() if m.pool == "on_demand"}
        assert len(on_demand) == cfg.runtime.on_demand_workers >= 1 and on_demand <= started
        assert {p: allowed(p) for p in on_demand} == {p: trainer for p in on_demand}
        off = {p: cpus for p in started - on_demand if (cpus := allowed(p)) not in (None, cluster)}
        assert not off, f"cluster processes outside CPU {sorted(cluster)}: {off}"
        assert ray.get(ray.remote(num_cpus=0)(lambda: os.sched_getaffinity(0)).remote()) == cluster
        tids = [int(t) for t in os.listdir("/proc/self/task")]
        elsewhere = {t: cpus for t in tids if (cpus := allowed(t)) not in (None, trainer)}
        assert elsewhere == {}
        assert torch.get_num_threads() == len(trainer)
    finally:
        rt.close()
    assert os.sched_getaffinity(0) == set(CPUS) and torch.get_num_threads() == threads
