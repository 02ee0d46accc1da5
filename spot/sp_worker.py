"""The persistent sequence-parallel worker: one Ray actor per device slot that keeps its model for life.

Shape legend: L image tokens, C packed channels, B batch, T text tokens, D text hidden size.

An `SPWorker` loads the policy once, installs Ulysses attention (`spotlight.parallel.ulysses`) and
then only changes which group it belongs to. A group is one *generation*: a fresh torch.distributed
world among the chosen members, rendezvoused on `PrefixStore("sp/gen<g>", TCPStore)` over one
long-lived TCPStore the driver hosts. Forming, shrinking, merging and growing groups is `join` with
a new generation number: the old world is destroyed, a new one is initialised, the model is not
touched (`SPContext.set_group`). Why a fresh world and not `new_group` inside an old one: a gloo
world whose member died is unusable (every later collective that involves the dead rank fails, and
`new_group` itself is a collective over the whole old world), and `shrink_group` is NCCL-only and
cannot grow. A fresh world needs only the survivors and the store: 2-5 ms here (gloo, 2 to 4
processes on one machine; `benchmarks/sp_reform.py` reports it as rendezvous_s).

Death inside a group (measured here, gloo on 127.0.0.1): when a member's process dies its sockets
are closed by the OS, and the peers that talk to it fail within ~10 ms of reaching their next
collective ("Connection reset by peer"): detection costs at most the rest of the step in flight. A peer blocked on a *live* rank (a ring all-gather) would wait for the whole gloo timeout,
so every member that sees a collective fail aborts its process group at once (`ProcessGroup.abort`
closes its sockets): the failure cascades to every survivor in milliseconds. The worker's `run`
then returns a report marked `broken`, and the driver re-forms the survivors (`spot.elastic`).

Weights: the versioned part of the policy (`trainable_state`: the LoRA adapter, or the whole
transformer) travels in two ways. A sibling on the same node `ray.put`s it once per version as
raw bytes (`pack_state`: one uint8 numpy array per tensor, so a same-node `ray.get` maps the
object store's shared memory instead of copying; Ray 2.60 pickles torch tensors by copy unless
RAY_ENABLE_ZERO_COPY_TORCH_TENSORS is set cluster-wide, and numpy covers bfloat16 as bytes) and a
newcomer copies from there into its own parameters. The copy carries its version and a checksum:
sha256 over every tensor's name, dtype, shape and bytes (one digest per tensor, computed in threads:
hashlib releases the GIL, so a large model hashes at the node's aggregate memory bandwidth rather
than one core's ~1 GB/s), checked by the newcomer on the bytes it reads. A copy whose version is
not the one asked for, or whose bytes do not hash to the checksum, is refused
(`WeightsMismatchError`). Without a sibling holding the version, the worker fetches the published
folder `weights/step-<version>/` from the store (`spot.store`, verified file by file).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch

from spot.jobqueue import ACCEPTED, STALE, STOP, WAIT, Lease
from spot.scheduler import DenoiseSpec, denoise_step, load_worker_policy

logger = logging.getLogger(__name__)

WEIGHTS_PREFIX = "weights"
"""Store folder of published weights: `weights/step-<version:08d>/` (so `Store.latest` finds the newest)."""
WEIGHTS_FILE, WEIGHTS_META = "trainable.safetensors", "weights.json"
RENDEZVOUS_TIMEOUT_S = 10.0


class WeightsMismatchError(ValueError):
    """A weights copy is not the version asked for, or its bytes do not match its checksum."""


# -- weights: packing, checksum, store (pure) -----------------------------------------------------

PackedState = dict[str, tuple[str, tuple[int, ...], np.ndarray]]
"""Tensor name -> (torch dtype name, shape, its bytes as a 1-D uint8 array)."""


def pack_state(state: dict[str, torch.Tensor]) -> PackedState:
    """The tensors' bytes as numpy arrays (any dtype, bfloat16 included), for a zero-copy `ray.put`."""
    packed = {}
    for name, t in state.items():
        flat = t.detach().to("cpu").contiguous().reshape(-1)
        packed[name] = (str(flat.dtype).removeprefix("torch."), tuple(t.shape), flat.view(torch.uint8).numpy())
    return packed


def unpack_state(packed: PackedState) -> dict[str, torch.Tensor]:
    """Tensors viewing the packed bytes (no copy; read-only when they live in the object store)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "array is not writable": we only read them
        return {
            name: torch.from_numpy(raw).view(getattr(torch, dtype)).reshape(shape)
            for name, (dtype, shape, raw) in packed.items()
        }


def state_checksum(packed: PackedState, *, max_threads: int = 8) -> str:
    """sha256 over each tensor's name, dtype, shape and bytes, in name order (exact, cheap in threads)."""
    names = sorted(packed)

    def digest(name: str) -> bytes:
        dtype, shape, raw = packed[name]
        h = hashlib.sha256(f"{name}|{dtype}|{shape}|".encode())
        h.update(memoryview(raw))
        return h.digest()

    with ThreadPoolExecutor(max_workers=max(1, min(max_threads, len(names)))) as pool:
        digests = list(pool.map(digest, names))
    return hashlib.sha256(b"".join(digests)).hexdigest()


def weights_key(version: int) -> str:
    """Store folder of weights `version`."""
    return f"{WEIGHTS_PREFIX}/step-{version:08d}"


def publish_weights(store, version: int, state: dict[str, torch.Tensor]) -> str:
    """Publish weights `version` to a `spot.store.Store`; returns the folder key."""
    from safetensors.torch import save_file

    packed = pack_state(state)
    with tempfile.TemporaryDirectory(prefix=".weights-") as tmp:
        save_file({k: v.detach().to("cpu").contiguous() for k, v in state.items()}, str(Path(tmp) / WEIGHTS_FILE))
        meta = {"version": version, "checksum": state_checksum(packed)}
        (Path(tmp) / WEIGHTS_META).write_text(json.dumps(meta))
        store.publish_dir(weights_key(version), tmp)
    return weights_key(version)


def fetch_weights(store, version: int) -> dict[str, torch.Tensor]:
    """Weights `version` from the store, checked against the version and checksum they were published with."""
    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory(prefix=".weights-") as tmp:
        folder = store.fetch_dir(weights_key(version), Path(tmp) / "w")
        meta = json.loads((folder / WEIGHTS_META).read_text())
        state = load_file(str(folder / WEIGHTS_FILE))
    if meta["version"] != version:
        where = store.where(weights_key(version))
        raise WeightsMismatchError(f"{where} holds version {meta['version']}, not {version}")
    if state_checksum(pack_state(state)) != meta["checksum"]:
        raise WeightsMismatchError(f"{store.where(weights_key(version))}: tensors do not match their checksum")
    return state


@dataclass(frozen=True)
class SharedWeights:
    """A worker's weights in the node's object store, as a sibling hands them out."""

    version: int
    checksum: str
    num_bytes: int
    refs: list
    """[ObjectRef] of the `PackedState` (in a list, so that passing this along does not fetch it)."""


# -- the worker -----------------------------------------------------------------------------------


@dataclass
class GroupRunReport:
    """What one member's `SPWorker.run` did."""

    worker_id: str
    group_id: str
    rank: int
    degree: int
    steps: int = 0
    """Denoising steps this member computed (every member computes every step of its group)."""
    completed: int = 0
    """Results the queue accepted (rank 0)."""
    abandoned: int = 0
    """Jobs dropped because the queue had revoked the group's lease."""
    released: bool = False
    """It stopped on a notice: the job in flight was committed and handed back."""
    noticed: bool = False
    """This member had the notice (its node is going away, or the driver regroups)."""
    broken: str | None = None
    """A collective failed: a member died; the message of the error."""
    broken_at: float | None = None
    """time.monotonic() when this member saw the collective fail."""
    first_step_at: float | None = None
    """time.monotonic() when its first step finished (the clock is system-wide on Linux)."""


def _is_collective_failure(err: Exception) -> bool:
    """Whether `err` is a collective failing because a peer is gone (gloo raises plain RuntimeErrors
    naming its transport; NCCL raises DistBackendError), rather than a bug in the step."""
    import torch.distributed as dist

    if isinstance(err, dist.DistError):
        return True
    text = str(err)
    return isinstance(err, RuntimeError) and any(
        mark in text for mark in ("gloo", "Connection closed", "Connection reset", "abort", "Timed out")
    )


class _SPPolicy:
    """The policy seen by `denoise_step`, with the transformer forward run through `ulysses_forward`."""

    def __init__(self, policy, ctx):
        self.policy = policy
        self.ctx = ctx
        self.latent_shape = policy.latent_shape
        self.device = policy.device

    def velocity(self, latents_BLC, sigma_B, embeds, mask):
        from spotlight.parallel import ulysses_forward

        p = self.policy
        dtype = embeds.dtype
        shapes = [[(1, p.latent_h // 2, p.latent_w // 2)]] * latents_BLC.shape[0]
        return ulysses_forward(p.transformer, self.ctx, latents_BLC.to(dtype), embeds, mask, sigma_B.to(dtype), shapes)


class SPWorker:
    """Ray actor for one device slot: loads the policy once, then serves in SP groups of any degree.

    Run it with `max_concurrency` >= 3: `run` loops on one thread while `notify`, `abort`,
    `share_weights` (a newcomer's copy) and `marks` are served on the others.

    Args:
        worker_id: its name in the pool.
        model: `spotlight.config.ModelConfig` of the policy (the base folder is read from local disk).
        spec: how trajectories are sampled.
        commit_every: m; rank 0 commits the latent after every m-th step.
        step_s: minimum wall time of one step (the rest is slept), to emulate a slower device in tests.
        num_threads: torch CPU threads.
        poll_s: wait between pulls when the queue has nothing for the group.
    """

    def __init__(
        self,
        worker_id: str,
        model,
        spec: DenoiseSpec,
        *,
        commit_every: int = 4,
        step_s: float = 0.0,
        num_threads: int = 1,
        poll_s: float = 0.02,
    ):
        from spotlight.parallel import install_ulysses

        t0 = time.monotonic()
        self.policy, self.sigmas = load_worker_policy(model, spec, commit_every=commit_every, num_threads=num_threads)
        self.worker_id = worker_id
        self.spec = spec
        self.commit_every = commit_every
        self.step_s = step_s
        self.poll_s = poll_s
        self.ctx = install_ulysses(self.policy.transformer)
        self.sp_policy = _SPPolicy(self.policy, self.ctx)
        self.backend = "nccl" if str(self.policy.device).startswith("cuda") else "gloo"
        self.version: int | None = None
        """Weights version held; None until `fetch_weights` or `copy_weights_from`."""
        self._shared: SharedWeights | None = None
        self._lock = threading.Lock()
        self._notice = threading.Event()
        self._noticed = False
        self._store_client = None
        self._gen: int | None = None
        self.first_step_at: float | None = None
        self.load_s = time.monotonic() - t0

    # -- identity ------------------------------------------------------------------------------

    def info(self) -> dict:
        """pid, Ray node id, weights version, generation; returns once the model is loaded."""
        import ray

        return {
            "worker_id": self.worker_id, "pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id(),
            "version": self.version, "generation": self._gen, "load_s": self.load_s,
            "num_heads": self.ctx.num_heads,
        }  # fmt: skip

    # -- weights -------------------------------------------------------------------------------

    def share_weights(self) -> SharedWeights:
        """This worker's weights in the object store: `ray.put` once per version, then the same ref."""
        import ray
        from spotlight.policy import trainable_state

        with self._lock:
            if self.version is None:
                raise WeightsMismatchError(f"worker {self.worker_id} holds no versioned weights yet")
            if self._shared is None or self._shared.version != self.version:
                packed = pack_state(trainable_state(self.policy))
                num_bytes = sum(raw.nbytes for _, _, raw in packed.values())
                self._shared = SharedWeights(self.version, state_checksum(packed), num_bytes, [ray.put(packed)])
            return self._shared

    def copy_weights_from(self, sibling, version: int) -> dict:
        """Take weights `version` from a sibling's shared copy; refuse a wrong version or a bad checksum.

        Raises:
            WeightsMismatchError: the sibling holds another version, or the bytes do not hash to its checksum.
        """
        import ray
        from spotlight.policy import load_trainable_state

        t0 = time.monotonic()
        shared: SharedWeights = ray.get(sibling.share_weights.remote())
        if shared.version != version:
            raise WeightsMismatchError(
                f"worker {self.worker_id} asked for weights version {version}, the sibling holds {shared.version}"
            )
        packed = ray.get(shared.refs[0])  # same node: views of the object store's shared memory
        zero_copy = all(not raw.flags.writeable for _, _, raw in packed.values())  # read-only: mapped, not copied
        if state_checksum(packed) != shared.checksum:
            raise WeightsMismatchError(f"weights version {version} from a sibling do not match their checksum")
        load_trainable_state(self.policy, unpack_state(packed))  # copies into this worker's parameters
        del packed
        self._set_version(version)
        seconds = time.monotonic() - t0
        return {"source": "sibling", "num_bytes": shared.num_bytes, "zero_copy": zero_copy, "seconds": seconds}

    def fetch_weights(self, store_url: str, version: int) -> dict:
        """Take weights `version` from the store (the fallback when no sibling holds it)."""
        from spot.store import open_store
        from spotlight.policy import load_trainable_state

        t0 = time.monotonic()
        load_trainable_state(self.policy, fetch_weights(open_store(store_url), version))
        self._set_version(version)
        return {"source": "store", "seconds": time.monotonic() - t0}

    def _set_version(self, version: int) -> None:
        with self._lock:
            self.version = version
            self._shared = None

    # -- groups --------------------------------------------------------------------------------

    def join(
        self, generation: int, rank: int, degree: int, host: str, port: int, version: int, timeout_s: float
    ) -> float:
        """Leave the current group and enter generation `generation` as `rank` of `degree`; returns seconds.

        Every member of the generation calls this at the same time; the call returns once all have
        connected (degree 1 needs no process group).
        """
        import torch.distributed as dist

        t0 = time.monotonic()
        if self.version != version:
            raise WeightsMismatchError(
                f"worker {self.worker_id} holds weights {self.version}, generation {generation} runs {version}"
            )
        self.leave()
        self._notice.clear()
        self._noticed = False
        if degree > 1:
            if self._store_client is None:
                self._store_client = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
            # The rendezvous waits on the store: a member that never comes fails it after this long.
            self._store_client.set_timeout(timedelta(seconds=min(timeout_s, RENDEZVOUS_TIMEOUT_S)))
            store = dist.PrefixStore(f"sp/gen{generation}", self._store_client)
            dist.init_process_group(
                self.backend, store=store, rank=rank, world_size=degree, timeout=timedelta(seconds=timeout_s)
            )
            self.ctx.set_group(dist.group.WORLD)
        self._gen = generation
        return time.monotonic() - t0

    def leave(self) -> None:
        """Drop the current process group (the model keeps its weights and processors)."""
        import torch.distributed as dist

        self.ctx.set_group(None)
        if dist.is_initialized():
            dist.destroy_process_group()
        self._gen = None

    def notify(self, leaving: bool = True) -> None:
        """Commit the group's job at the next step and stop; `leaving`: this worker's node is going away."""
        self._noticed = self._noticed or leaving
        self._notice.set()

    def abort(self) -> None:
        """Abort the current process group (closes its connections, so blocked peers fail and return)."""
        import torch.distributed as dist

        pg = dist.group.WORLD if dist.is_initialized() else None
        if pg is not None:  # None: `run` left the group meanwhile (abort comes from another thread)
            pg.abort()

    # -- work ----------------------------------------------------------------------------------

    def run(self, queue, group_id: str) -> GroupRunReport:
        """Serve the queue as one member of group `group_id` until STOP, a notice, or a failed collective.

        Rank 0 pulls a lease (as worker `group_id`) and broadcasts it with the encoded prompt; every
        rank runs each step through `ulysses_forward`; rank 0 commits every m steps.
        """
        import ray
        from spotlight.rollout import encode

        ctx = self.ctx
        report = GroupRunReport(self.worker_id, group_id, ctx.rank, ctx.degree)
        self.first_step_at = None
        try:
            while True:
                if self._agree(self._notice.is_set(), False)[0]:
                    report.released, report.noticed = True, self._noticed
                    return report
                msg: Any = None
                if ctx.rank == 0:
                    lease = ray.get(queue.pull.remote(group_id, self.version))
                    msg = lease
                    if isinstance(lease, Lease):
                        spec = self.spec
                        batch = encode(self.policy, [lease.job.prompt], spec.guidance_scale, spec.negative_prompt)
                        msg = (lease, batch)
                msg = self._broadcast(msg)
                if msg == STOP:
                    return report
                if msg == WAIT:
                    time.sleep(self.poll_s)
                    continue
                self._run_job(queue, *msg, report)
                if report.released:
                    return report
        except Exception as err:
            if ctx.degree == 1:
                raise
            # Whatever failed, abort our process group: peers blocked on us then fail now instead of
            # after the collective timeout.
            self.abort()
            self.leave()
            if not _is_collective_failure(err):
                raise  # a bug, not a lost member: the driver sees it
            # A member died (its sockets closed) or a peer aborted.
            report.broken_at = time.monotonic()
            report.broken = str(err).splitlines()[0][:300]
            logger.info("worker %s: group %s broken: %s", self.worker_id, group_id, report.broken)
            return report

    def _run_job(self, queue, lease: Lease, batch, report: GroupRunReport) -> None:
        import ray

        job, spec, rank0 = lease.job, self.spec, self.ctx.rank == 0
        step, latent = lease.step, lease.latent_LC
        stale = False
        while True:
            notice, stale = self._agree(self._notice.is_set(), stale)
            if stale:
                report.abandoned += 1
                return
            if notice:
                # Commit the last finished step and hand the job back: nothing is lost.
                if rank0:
                    ray.get(queue.commit.remote(lease.lease_id, step, latent, release=True))
                report.released, report.noticed = True, self._noticed
                return
            t0 = time.monotonic()
            latent = denoise_step(self.sp_policy, batch, self.sigmas, spec, job.seed, step, latent)
            step += 1
            report.steps += 1
            pad = self.step_s - (time.monotonic() - t0)
            if pad > 0:
                time.sleep(pad)
            if report.first_step_at is None:
                report.first_step_at = time.monotonic()
                self.first_step_at = report.first_step_at
            if step == spec.num_steps:
                if rank0:
                    ack = ray.get(queue.complete.remote(lease.lease_id, step, latent))
                    report.completed += ack == ACCEPTED
                    report.abandoned += ack == STALE
                return
            if rank0:
                if step % self.commit_every == 0:
                    stale = ray.get(queue.commit.remote(lease.lease_id, step, latent)) == STALE
                else:
                    queue.progress.remote(lease.lease_id, step)  # fire and forget: renews the lease

    def first_step(self) -> float | None:
        """time.monotonic() when the current (or last) `run` finished its first step; readable during `run`."""
        return self.first_step_at

    def _agree(self, notice: bool, stale: bool) -> tuple[bool, bool]:
        """Both flags OR-ed over the group (one tiny all-reduce), so every rank takes the same branch."""
        import torch.distributed as dist

        if self.ctx.degree == 1:
            return notice, stale
        flags = torch.tensor([int(notice), int(stale)])
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.ctx.group)
        return bool(flags[0]), bool(flags[1])

    def _broadcast(self, msg):
        import torch.distributed as dist

        if self.ctx.degree == 1:
            return msg
        box = [msg]
        dist.broadcast_object_list(box, src=0, group=self.ctx.group)
        return box[0]
