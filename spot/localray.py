"""Shared bits of the local multi-node Ray clusters (exploration's `LocalCluster`, the trace replayer).

Nodes carry custom resources naming their pool: `on_demand` (the head, where the trainer and the
queues run) and `spot` (capacity that can vanish).
"""

from __future__ import annotations

import logging
import os
import sys

from spotlight.core.cost import SPOT

logger = logging.getLogger(__name__)

_LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def import_ray_on_loopback():
    """`import ray` so that every node binds to 127.0.0.1 (ray reads the variable at import)."""
    already = "ray" in sys.modules
    os.environ[_LOOPBACK_ENV] = "0"
    import ray
    from ray._private import ray_constants

    if already and ray_constants.ENABLE_RAY_CLUSTER:
        logger.warning("ray was imported before %s=0 was set; nodes may bind to the outward address", _LOOPBACK_ENV)
    return ray


def kill_actor(ray, actor) -> None:
    """`ray.kill` without restart; an actor that is already gone (dead node, killed) is fine."""
    try:
        ray.kill(actor, no_restart=True)
    except Exception:
        pass


def spot_gpus_held() -> int:
    """Units of the `spot` resource in the connected Ray cluster: the spot GPUs held right now."""
    import ray

    return int(ray.cluster_resources().get(SPOT, 0))
