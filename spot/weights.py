"""Weights as the runtime moves them: versioned, packed for a zero-copy `ray.put`, checksummed, and
published to a store (pure, no Ray).

The versioned part of a policy (what its runner's `weights()` returns: a LoRA adapter, or a whole
transformer) travels in two ways. A worker hands a sibling on its node one `ray.put` per version
as raw bytes (`pack_state`: one uint8 numpy array per tensor, so a same-node `ray.get` maps the
object store's shared memory instead of copying; Ray 2.60 pickles torch tensors by copy unless
RAY_ENABLE_ZERO_COPY_TORCH_TENSORS is set cluster-wide, and numpy covers bfloat16 as bytes), and
the newcomer copies from there into its own parameters. The copy carries its version and a
checksum: sha256 over every tensor's name, dtype, shape and bytes (one digest per tensor, computed
in threads: hashlib releases the GIL, so a large model hashes at the node's aggregate memory
bandwidth rather than one core's ~1 GB/s), checked on the bytes read. A copy whose version is not
the one asked for, or whose bytes do not hash to the checksum, is refused (`WeightsMismatchError`).
Without a sibling holding the version, a worker fetches the published folder
`weights/step-<version>/` from the store (`spot.store`, verified file by file).
"""

from __future__ import annotations

import hashlib
import json
import tempfile
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

WEIGHTS_PREFIX = "weights"
"""Store folder of published weights: `weights/step-<version:08d>/` (so `Store.latest` finds the newest)."""
WEIGHTS_FILE, WEIGHTS_META = "trainable.safetensors", "weights.json"


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
