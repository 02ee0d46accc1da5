"""Phase-aware memory accounting on any device: live tensor bytes, peak per phase, owner per state.

CPU has no allocator statistics like `torch.cuda.max_memory_allocated`, and neither tracemalloc
(torch allocates outside Python's allocator) nor RSS (glibc keeps freed pages) measures tensors.
`TensorLedger` counts what the CUDA allocator would: every tensor storage an op creates, from its
allocation until its last reference dies (a weak reference on the storage, whose Python object
torch keeps alive exactly as long as the storage). A `TorchDispatchMode` sees every op output,
forward and backward, so activations saved for backward, KV caches, logits, gradients and
optimizer moments created during a phase are all counted. Storages that exist before tracking
starts (weights, the reference copy, moments of earlier steps) are the *permanent* classes,
measured separately by `state_bytes`. Dispatch modes are per thread: a worker thread enters its
own `ledger.mode()`; the counters are shared under a lock.

Memory classes (the Rollplex paper): permanent (weights, optimizer moments: stream them on a real
cluster), regenerable (a rollout copy of the weights), boundary (Rollplex's prefix state: KV caches
and shared vision features of P prompts, alive from the rollout to the update), phase-local
(activations, logits, generate's KV cache: freed at the end of their phase).
"""

from __future__ import annotations

import contextlib
import threading
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class TensorLedger:
    """Live bytes of the tensor storages created while tracked, with a peak per named phase."""

    def __init__(self):
        self._lock = threading.Lock()
        self._alive: dict[int, weakref.ref] = {}
        self.live = 0
        self.peaks: dict[str, int] = {}
        self._phase: str | None = None

    def mode(self) -> TorchDispatchMode:
        """A dispatch mode for one thread that records into this ledger (enter it with `with`)."""
        return _LedgerMode(self)

    @contextlib.contextmanager
    def phase(self, name: str):
        """Record the peak of live bytes while the block runs (nested or concurrent phases: the outer wins)."""
        with self._lock:
            outer, self._phase = self._phase, self._phase or name
            self.peaks[self._phase] = max(self.peaks.get(self._phase, 0), self.live)
        try:
            yield
        finally:
            with self._lock:
                self._phase = outer

    def _record(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = storage._cdata
        with self._lock:
            if key in self._alive:
                return
            size = storage.nbytes()
            self._alive[key] = weakref.ref(storage, lambda _, key=key, size=size: self._free(key, size))
            self.live += size
            if self._phase is not None:
                self.peaks[self._phase] = max(self.peaks[self._phase], self.live)

    def _free(self, key: int, size: int) -> None:
        with self._lock:
            if self._alive.pop(key, None) is not None:
                self.live -= size


class _LedgerMode(TorchDispatchMode):
    def __init__(self, ledger: TensorLedger):
        super().__init__()
        self.ledger = ledger

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self.ledger._record(t)
        return out


def tensor_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors`."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            st = t.untyped_storage()
            seen[st._cdata] = st.nbytes()
    return sum(seen.values())


def state_bytes(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, reference: torch.nn.Module | None = None
) -> dict[str, int]:
    """The permanent classes: weights, the reference copy's weights, optimizer moments."""
    out = {"weights": tensor_bytes(model.parameters())}
    if reference is not None:
        out["reference_weights"] = tensor_bytes(reference.parameters())
    if optimizer is not None:
        out["optimizer_moments"] = tensor_bytes(v for s in optimizer.state.values() for v in s.values())
    return out
