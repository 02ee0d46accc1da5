"""Prompt-encoder outputs as per-step boundary state: each prompt encoded once per training step.

Shape legend: T_i valid text tokens of prompt i (template prefix dropped), D text hidden size.

Encoding the prompts is the response-independent prefix work of the DiT path (the Rollplex paper,
issue 8): the Qwen2.5-VL text encoder's hidden states depend only on the prompt and the encoder's
weights, never on the seed or the transformer's weights. A step needs them in several phases (the
rollout's chunks, the update's minibatches, the reference and old-policy forwards inside it), and
all G samples of a prompt share them. `PromptCache` computes them once per distinct prompt per
step and keeps them exactly for the step:

    cache.begin_step(prompts)   # the step's distinct prompts, encoded in one batch, held
    rollout, reward, update     # every lookup of a held prompt is served from memory
    stats = cache.end_step()    # counters of the step; its embeddings are dropped

Lifetime, and why not an LRU across steps. The text encoder is frozen (`DiTPolicy.load` turns its
gradients off and no recipe trains it), so an embedding would stay valid across weight updates and
a bounded LRU would be correct. We drop at the end of the step anyway:
- determinism: an embedding must be a function of its prompt. On CPU in float32 the encoder is
  batch-invariant (a prompt encodes to the same bits alone or in any batch; tested), but on a GPU
  in bfloat16 the kernels change with the batch's size and padding. Within a step the batch is the
  step's sorted distinct prompts, a function of (train.seed, k); across steps an LRU's misses would
  depend on the history, so a run resumed from a checkpoint (empty cache) would no longer repeat
  the uninterrupted run bit for bit;
- memory: the held state is bounded by the step's prompts (P entries of T_i x D floats), freed at
  the end of the step like Rollplex's boundary state, with nothing to size;
- nothing to win: at real dataset sizes a step's prompts rarely recur in the next few steps, and
  the encoder is a small share of a step (`benchmarks/dit_prompt_prefix.py` measures it).

Outside a step (evaluation, explorers, pretraining, `spotlight sample`) a lookup encodes the
distinct prompts of that call and keeps nothing; callers that repeat prompts across calls can open
their own scope with `with cache.step(prompts):`.

Invalidation. Should the encoder's weights ever change (trained, or a state dict loaded), the held
embeddings are stale: every lookup compares a fingerprint of the encoder's parameters (their
identities and in-place version counters, which an optimizer step or `load_state_dict` bumps) with
the one the entries were computed under, and drops them all on a mismatch.

Prefetch. The next step's prompts are known in advance (the driver's `plan_iteration` is a pure
function of (train.seed, k)), so the driver hands them to `begin_step` and the cache encodes them
while this step's rollout and update run, the way Rollplex runs its prefix inside the decode
window:

    cache.begin_step(prompts, next_prompts=nxt)   # takes the prefetched step, starts the next one

- where: one worker thread per cache (`concurrent.futures.ThreadPoolExecutor`, one worker), and on
  a CUDA device a side stream; the side stream first waits for an event recorded on the driver's
  stream when the prefetch was asked for (whatever it queued before, an in-place weight change
  included, happens first), the worker synchronises the side stream before it hands the result
  over, and embeddings that live on the device are `record_stream`ed on the consumer's stream (the
  allocator would otherwise hand their memory to the side stream while the driver still reads it).
  The shipped policy returns CPU tensors, so only the first two matter there;
- the same bits: the prefetch encodes exactly the batch `begin_step` would (the next step's sorted
  distinct prompts: the driver passes its own slice, `prompts[lo:hi]` of the next step, on every
  rank), and `begin_step` uses it only if the step's distinct prompts are that set and the
  encoder's fingerprint is the one it was started under; otherwise it is dropped (counted in
  `prefetch_discarded`, and in `invalidations` when the weights changed) and the step encodes as
  without prefetch. The first step of a run, or of a resumed run, has nothing prefetched and
  encodes the same batch itself; the last passes no next prompts. A second thread's torch ops use
  the process's intra-op thread count, and the tiny model's kernels give the same bits at 1 or 2
  threads and while the driver runs the transformer (tests/test_prompt_cache.py);
- one encoder call at a time: every call holds a lock (Qwen2.5-VL keeps `rope_deltas` on the
  module during its forward, and a fast tokenizer's padding state is shared), so a lookup the
  driver makes meanwhile (CFG's negative prompt, an evaluation) waits for the prefetch's forward;
- memory: the held step plus at most one prefetched step (a second prefetch first waits for and
  drops the first): two steps' prompts;
- errors: an exception in the worker is raised in the driver's thread by the `begin_step`,
  `prefetch` or `close` that reaches the prefetch; `close()` (the driver's `with
  cache.prefetch_scope():`) waits for a pending prefetch and stops the thread at the end of a run,
  and on an exception, where the prefetch's own error is logged rather than hiding the first;
- what it saves: the step's encoder seconds, less what `begin_step` still waits for
  (`StepStats.wait_s`, the metric time/prompt_encoder_wait_s), less the slowdown of the work it
  overlaps (on a CPU the two threads share the cores). `benchmarks/dit_prompt_prefix.py
  --prefetch` measures it (steps with and without prefetch alternated in one run, the same bits;
  docs/architecture.md has the figures). On a GPU the side stream overlaps it with the denoising
  kernels. `train.prefetch_prompts` turns it off.

`UncachedPrompts` is the naive baseline with the same interface: every lookup runs the encoder on
every row it is given, as a pipeline that encodes per phase and per sample would (the benchmark's
"uncached").
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

EncodeFn = Callable[[list[str]], list[torch.Tensor]]
"""Runs the text encoder once on a batch of prompts: one (T_i, D) tensor per prompt, in order."""

PREFETCH_THREAD = "spotlight-prompt-prefetch"
"""Name prefix of the prefetch worker thread."""


@dataclass
class StepStats:
    """What the prompt encoder did during one step."""

    num_prompts: int
    """Distinct prompts looked up during the step."""
    num_encoded: int
    """Prompt rows the text encoder ran on for the step (a row per prompt per encoder call; a
    prefetch counts for the step it was made for)."""
    num_forwards: int
    """Text-encoder forward calls for the step (a prefetch's counts for the step it was made for)."""
    encoder_s: float
    """Seconds spent in the text encoder for the step, a prefetch's included (it ran during the previous step)."""
    held_bytes: int
    """Bytes of prompt embeddings held at the end of the step (dropped right after)."""
    wait_s: float = 0.0
    """Seconds the step's thread waited for the encoder: for its prefetch to finish, or for the
    prefetch worker's forward before one of its own (the encoder runs one call at a time)."""
    prefetched: bool = False
    """The step's prompts were encoded ahead, during the previous step."""

    @property
    def calls_per_prompt(self) -> float:
        """Text-encoder calls per distinct prompt: 1 with the cache, 2G or more without."""
        return self.num_encoded / self.num_prompts if self.num_prompts else 0.0

    def metrics(self) -> dict[str, float]:
        """The training metrics, of this process (with data parallelism: of its slice of the samples).
        Outside time/, the same in a resumed run as in the uninterrupted one (whose step after the
        resumption point was prefetched): `prefetched` is not among them."""
        return {
            "prompt_encoder/calls_per_prompt": self.calls_per_prompt,
            "prompt_encoder/forwards": float(self.num_forwards),
            "time/prompt_encoder_s": self.encoder_s,
            "time/prompt_encoder_wait_s": self.wait_s,
        }


class _Counted(ABC):
    """Runs the encoder (one call at a time, from any thread) and counts what it did, in total and
    for the current step."""

    def __init__(self, encode_fn: EncodeFn):
        self._encode_fn = encode_fn
        self._encoder_lock = threading.Lock()
        self.total_encoded = 0
        """Prompt rows encoded since construction (prefetches included, used or not)."""
        self.total_forwards = 0
        """Encoder forward calls since construction (prefetches included, used or not)."""
        self._in_step = False
        self._step_prompts: set[str] = set()
        self._step_encoded = self._step_forwards = 0
        self._step_s = self._step_wait_s = 0.0
        self._step_prefetched = False

    def _run_encoder(self, prompts: list[str]) -> tuple[list[torch.Tensor], float, float]:
        """Embeddings, seconds in the encoder, seconds waited for the lock; any thread, counts totals only."""
        t0 = time.perf_counter()
        with self._encoder_lock:
            t1 = time.perf_counter()
            embs = self._encode_fn(prompts)
            seconds = time.perf_counter() - t1
            self.total_encoded += len(prompts)
            self.total_forwards += 1
        assert len(embs) == len(prompts), (len(embs), len(prompts))
        return embs, seconds, t1 - t0

    def _count(self, rows: int, seconds: float) -> None:
        if self._in_step:
            self._step_encoded += rows
            self._step_forwards += 1
            self._step_s += seconds

    def _encode(self, prompts: list[str]) -> list[torch.Tensor]:
        """One encoder call from the driver's thread, counted for the current step."""
        embs, seconds, waited = self._run_encoder(prompts)
        self._count(len(prompts), seconds)
        if self._in_step:
            self._step_wait_s += waited
        return embs

    def _start_counting(self) -> None:
        self._in_step = True
        self._step_prompts = set()
        self._step_encoded = self._step_forwards = 0
        self._step_s = self._step_wait_s = 0.0
        self._step_prefetched = False

    def _stop_counting(self, held_bytes: int) -> StepStats:
        stats = StepStats(
            len(self._step_prompts),
            self._step_encoded,
            self._step_forwards,
            self._step_s,
            held_bytes,
            self._step_wait_s,
            self._step_prefetched,
        )
        self._in_step = False
        self._step_prompts = set()
        return stats

    @property
    def in_step(self) -> bool:
        return self._in_step

    @contextmanager
    def step(self, prompts: Sequence[str]) -> Iterator[None]:
        """`begin_step(prompts)` ... `end_step()` around a block (the stats are dropped)."""
        self.begin_step(prompts)
        try:
            yield
        finally:
            self.end_step()

    @contextmanager
    def prefetch_scope(self) -> Iterator[None]:
        """Around a training loop: `close()` at its end, so that no prefetch outlives it.

        On an exception in the block, a failed prefetch's error is logged, not raised: the block's
        own error is the one that propagates.
        """
        try:
            yield
        except BaseException:
            self.close(raise_errors=False)
            raise
        self.close()

    def close(self, *, raise_errors: bool = True) -> None:  # noqa: B027 - optional hook, no-op default
        """Wait for a pending prefetch and drop it, and stop the worker thread (nothing to do here)."""

    @abstractmethod
    def begin_step(self, prompts: Sequence[str], next_prompts: Sequence[str] | None = None) -> None: ...

    @abstractmethod
    def end_step(self) -> StepStats: ...

    @abstractmethod
    def lookup(self, prompts: Sequence[str]) -> list[torch.Tensor]: ...


@dataclass
class _Prefetch:
    """An encode of a future step's prompts, under way on the worker thread."""

    order: list[str]
    """The step's sorted distinct prompts: the batch `begin_step` would encode."""
    fingerprint: Hashable
    """The encoder's fingerprint when the prefetch was asked for."""
    future: Future
    """Resolves to (embeddings, seconds in the encoder), or raises the worker's error."""


class PromptCache(_Counted):
    """Prompt embeddings held for one step: computed once per distinct prompt, dropped after the step;
    the next step's can be computed ahead on a worker thread (`begin_step(..., next_prompts=...)`).

    Args:
        encode_fn: runs the text encoder on a batch (see `EncodeFn`); embeddings must not be views
            of a larger tensor, or the held bytes would be the batch's.
        fingerprint_fn: a hashable that changes whenever the encoder's weights do.
        device_fn: the encoder's device; on a CUDA device a prefetch runs on a side stream. None: CPU.
    """

    def __init__(
        self,
        encode_fn: EncodeFn,
        fingerprint_fn: Callable[[], Hashable],
        device_fn: Callable[[], torch.device] | None = None,
    ):
        super().__init__(encode_fn)
        self._fingerprint_fn = fingerprint_fn
        self._device_fn = device_fn
        self._fingerprint: Hashable = None
        self._held: dict[str, torch.Tensor] = {}
        self._pending: _Prefetch | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self.invalidations = 0
        """Times embeddings were dropped because the encoder's weights changed (held or prefetched)."""
        self.prefetch_used = 0
        """Prefetched steps `begin_step` served from."""
        self.prefetch_discarded = 0
        """Prefetched steps dropped: other prompts than the step's, the encoder's weights changed, or closed."""

    @property
    def num_held(self) -> int:
        return len(self._held)

    @property
    def held_bytes(self) -> int:
        return sum(e.untyped_storage().nbytes() for e in self._held.values())

    @property
    def prefetching(self) -> list[str]:
        """The sorted distinct prompts of the prefetch under way or done but not yet taken ([] if none)."""
        return list(self._pending.order) if self._pending is not None else []

    def _check_encoder(self) -> None:
        """Drop every held embedding if the encoder's weights changed since they were computed."""
        fingerprint = self._fingerprint_fn()
        if fingerprint != self._fingerprint:
            if self._held:
                self.invalidations += 1
            self._held.clear()
            self._fingerprint = fingerprint

    def _fill(self, distinct: list[str]) -> None:
        """Encode the prompts not held yet, in one batch (sorted: the batch is a function of the set)."""
        missing = sorted(p for p in distinct if p not in self._held)
        if missing:
            self._held.update(zip(missing, self._encode(missing)))

    # -- prefetch ----------------------------------------------------------------------------------

    def prefetch(self, prompts: Sequence[str]) -> None:
        """Start encoding a future step's distinct prompts on the worker thread; `begin_step` of that
        step takes them. A prefetch already under way for other prompts is waited for and dropped first."""
        order = sorted(set(prompts))
        fingerprint = self._fingerprint_fn()
        if self._pending is not None:
            if self._pending.order == order and self._pending.fingerprint == fingerprint:
                return  # already under way
            self._drop_pending()
        if not order:
            return
        device = self._device_fn() if self._device_fn is not None else torch.device("cpu")
        ready = None
        if device.type == "cuda":
            # The side stream starts after whatever the driver's stream has queued so far.
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(device))
            if device not in self._streams:
                self._streams[device] = torch.cuda.Stream(device=device)
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=PREFETCH_THREAD)
        future = self._executor.submit(self._prefetch_job, order, device, ready)
        self._pending = _Prefetch(order, fingerprint, future)

    def _prefetch_job(self, order: list[str], device: torch.device, ready) -> tuple[list[torch.Tensor], float]:
        """On the worker thread: one encoder call, on a side stream for a CUDA device."""
        if ready is None:
            embs, seconds, _ = self._run_encoder(order)
            return embs, seconds
        stream = self._streams[device]
        with torch.cuda.stream(stream):
            stream.wait_event(ready)
            embs, seconds, _ = self._run_encoder(order)
        stream.synchronize()  # the results are complete before the driver sees them
        return embs, seconds

    def _take_pending(self) -> tuple[_Prefetch, list[torch.Tensor], float] | None:
        """The pending prefetch and its result, waited for (counted as the step's wait); its error is raised here."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        t0 = time.perf_counter()
        try:
            embs, seconds = pending.future.result()
        finally:
            if self._in_step:
                self._step_wait_s += time.perf_counter() - t0
        return pending, embs, seconds

    def _drop_pending(self) -> None:
        """Wait for the pending prefetch and drop it (memory stays bounded: one prefetched step)."""
        if self._take_pending() is not None:
            self.prefetch_discarded += 1

    def _use_prefetch(self, order: list[str]) -> None:
        """Hold the pending prefetch's embeddings if they are this step's batch under the current weights."""
        taken = self._take_pending()
        if taken is None:
            return
        pending, embs, seconds = taken
        if pending.order != order or pending.fingerprint != self._fingerprint:
            self.prefetch_discarded += 1
            self.invalidations += pending.fingerprint != self._fingerprint
            return
        if any(e.is_cuda for e in embs):
            consumer = torch.cuda.current_stream(embs[0].device)
            for e in embs:
                if e.is_cuda:
                    e.record_stream(consumer)  # made on the side stream, read on the driver's
        self._held.update(zip(order, embs))
        self._count(len(order), seconds)
        self._step_prefetched = True
        self.prefetch_used += 1

    def close(self, *, raise_errors: bool = True) -> None:
        """Wait for a pending prefetch and drop it, then stop the worker thread (a later prefetch
        starts a new one). A failed prefetch's error is raised (or logged, with raise_errors False)."""
        executor, self._executor = self._executor, None
        try:
            self._drop_pending()
        except Exception:
            if raise_errors:
                raise
            logger.warning("prompt prefetch failed; dropped at close", exc_info=True)
        finally:
            if executor is not None:
                executor.shutdown(wait=True)

    # -- steps ---------------------------------------------------------------------------------------

    def begin_step(self, prompts: Sequence[str], next_prompts: Sequence[str] | None = None) -> None:
        """Open a step: its distinct prompts encoded once (one batch), held until `end_step`.

        They come from the prefetch made for them if there is one (waited for if still running),
        else are encoded here. `next_prompts`: the next step's prompts, prefetched from now on
        (None: nothing to prefetch). A step left open (its driver raised) is closed first: its
        embeddings are not reused.
        """
        self._held.clear()
        self._start_counting()
        self._check_encoder()
        distinct = set(prompts)
        self._step_prompts |= distinct
        order = sorted(distinct)
        self._use_prefetch(order)
        self._fill(order)
        if next_prompts is not None:
            self.prefetch(next_prompts)

    def end_step(self) -> StepStats:
        """Close the step: return its counters and drop its embeddings (a prefetch under way goes on)."""
        assert self.in_step, "end_step without begin_step"
        stats = self._stop_counting(self.held_bytes)
        self._held.clear()
        return stats

    def lookup(self, prompts: Sequence[str]) -> list[torch.Tensor]:
        """One (T_i, D) embedding per prompt (rows may repeat a prompt: they share one tensor)."""
        self._check_encoder()
        distinct = set(prompts)
        if self.in_step:
            self._step_prompts |= distinct
            self._fill(sorted(distinct))
            return [self._held[p] for p in prompts]
        # Outside a step: encode this call's distinct prompts once, keep nothing.
        order = sorted(distinct)
        embs = dict(zip(order, self._encode(order)))
        return [embs[p] for p in prompts]


class UncachedPrompts(_Counted):
    """The naive baseline: every lookup encodes every row, repeated prompts included; nothing is held
    or prefetched.

    Args:
        encode_fn: runs the text encoder on a batch (see `EncodeFn`).
    """

    def begin_step(self, prompts: Sequence[str], next_prompts: Sequence[str] | None = None) -> None:
        self._start_counting()

    def end_step(self) -> StepStats:
        assert self.in_step, "end_step without begin_step"
        return self._stop_counting(0)

    def lookup(self, prompts: Sequence[str]) -> list[torch.Tensor]:
        if self.in_step:
            self._step_prompts |= set(prompts)
        return self._encode(list(prompts))
