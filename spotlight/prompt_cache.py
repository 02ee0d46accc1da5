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

No prefetch. Rollplex runs its prefix inside the decode window; here the next step's prompts could
be encoded on a worker thread during the update. Not done: the encoder is under 0.2% of a cached
tiny step (`benchmarks/dit_prompt_prefix.py`, encoder_share_of_step), a saving below the noise of
a second thread competing for 2 cores, and on Qwen-Image its ~100-token forward is as small next
to the transformer's denoising of thousands of image tokens. `begin_step` is where it would go.

`UncachedPrompts` is the naive baseline with the same interface: every lookup runs the encoder on
every row it is given, as a pipeline that encodes per phase and per sample would (the benchmark's
"uncached").
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

EncodeFn = Callable[[list[str]], list[torch.Tensor]]
"""Runs the text encoder once on a batch of prompts: one (T_i, D) tensor per prompt, in order."""


@dataclass
class StepStats:
    """What the prompt encoder did during one step."""

    num_prompts: int
    """Distinct prompts looked up during the step."""
    num_encoded: int
    """Prompt rows the text encoder ran on during the step (a row per prompt per encoder call)."""
    num_forwards: int
    """Text-encoder forward calls during the step."""
    encoder_s: float
    """Seconds spent in the text encoder during the step."""
    held_bytes: int
    """Bytes of prompt embeddings held at the end of the step (dropped right after)."""

    @property
    def calls_per_prompt(self) -> float:
        """Text-encoder calls per distinct prompt: 1 with the cache, 2G or more without."""
        return self.num_encoded / self.num_prompts if self.num_prompts else 0.0

    def metrics(self) -> dict[str, float]:
        """The training metrics, of this process (with data parallelism: of its slice of the samples)."""
        return {
            "prompt_encoder/calls_per_prompt": self.calls_per_prompt,
            "prompt_encoder/forwards": float(self.num_forwards),
            "time/prompt_encoder_s": self.encoder_s,
        }


class _Counted(ABC):
    """Runs the encoder and counts what it did, in total and since the step began."""

    def __init__(self, encode_fn: EncodeFn):
        self._encode_fn = encode_fn
        self.total_encoded = 0
        """Prompt rows encoded since construction."""
        self.total_forwards = 0
        """Encoder forward calls since construction."""
        self._in_step = False
        self._step_prompts: set[str] = set()
        self._step_encoded = self._step_forwards = 0
        self._step_s = 0.0

    def _encode(self, prompts: list[str]) -> list[torch.Tensor]:
        t0 = time.perf_counter()
        embs = self._encode_fn(prompts)
        assert len(embs) == len(prompts), (len(embs), len(prompts))
        self.total_encoded += len(prompts)
        self.total_forwards += 1
        if self._in_step:
            self._step_encoded += len(prompts)
            self._step_forwards += 1
            self._step_s += time.perf_counter() - t0
        return embs

    def _start_counting(self) -> None:
        self._in_step = True
        self._step_prompts = set()
        self._step_encoded = self._step_forwards = 0
        self._step_s = 0.0

    def _stop_counting(self, held_bytes: int) -> StepStats:
        stats = StepStats(len(self._step_prompts), self._step_encoded, self._step_forwards, self._step_s, held_bytes)
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

    @abstractmethod
    def begin_step(self, prompts: Sequence[str]) -> None: ...

    @abstractmethod
    def end_step(self) -> StepStats: ...

    @abstractmethod
    def lookup(self, prompts: Sequence[str]) -> list[torch.Tensor]: ...


class PromptCache(_Counted):
    """Prompt embeddings held for one step: computed once per distinct prompt, dropped after the step.

    Args:
        encode_fn: runs the text encoder on a batch (see `EncodeFn`); embeddings must not be views
            of a larger tensor, or the held bytes would be the batch's.
        fingerprint_fn: a hashable that changes whenever the encoder's weights do.
    """

    def __init__(self, encode_fn: EncodeFn, fingerprint_fn: Callable[[], Hashable]):
        super().__init__(encode_fn)
        self._fingerprint_fn = fingerprint_fn
        self._fingerprint: Hashable = None
        self._held: dict[str, torch.Tensor] = {}
        self.invalidations = 0
        """Times the held embeddings were dropped because the encoder's weights changed."""

    @property
    def num_held(self) -> int:
        return len(self._held)

    @property
    def held_bytes(self) -> int:
        return sum(e.untyped_storage().nbytes() for e in self._held.values())

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

    def begin_step(self, prompts: Sequence[str]) -> None:
        """Open a step: encode its distinct prompts once (one batch) and hold them until `end_step`.

        A step left open (its driver raised) is closed first: its embeddings are not reused.
        """
        self._held.clear()
        self._start_counting()
        self._check_encoder()
        distinct = set(prompts)
        self._step_prompts |= distinct
        self._fill(sorted(distinct))

    def end_step(self) -> StepStats:
        """Close the step: return its counters and drop its embeddings."""
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
    """The naive baseline: every lookup encodes every row, repeated prompts included; nothing is held.

    Args:
        encode_fn: runs the text encoder on a batch (see `EncodeFn`).
    """

    def begin_step(self, prompts: Sequence[str]) -> None:
        self._start_counting()

    def end_step(self) -> StepStats:
        assert self.in_step, "end_step without begin_step"
        return self._stop_counting(0)

    def lookup(self, prompts: Sequence[str]) -> list[torch.Tensor]:
        if self.in_step:
            self._step_prompts |= set(prompts)
        return self._encode(list(prompts))
