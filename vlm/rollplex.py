"""The Rollplex schedule (the Rollplex paper): prefix work during decode, suffix-only scoring after.

Shape legend: P prompts, G samples per prompt, B = P * G rollout rows (prompt-major: row r is a
sample of prompt r // G), b rows of a micro-batch, L prompt tokens (left-padded), T response
tokens, H heads, D head dim, V vocabulary.

A scoring pass of the reference or the actor over [prompt, response] splits at the prompt's end:

- the **prefix** (vision tower on the image, prefill over the visual and text prompt tokens)
  depends only on the prompt and the weights. It runs once per *prompt*, not per sample: the G
  samples of a prompt share it. Its boundary state is each layer's keys and values (P, H, L, D)
  and the logits at the last prompt position (they predict the first response token).
- the **suffix** (the T response tokens) attends to the prefix keys and values through a
  transformers cache. Qwen-VL's multimodal rope gives text after an image the position
  max(prompt positions) + 1 on all three axes (`get_rope_index`'s rope_deltas), so the suffix
  positions continue from there, for the response's real tokens, as the full forward counts them.

The prefixes need only θ_k and the prompts, so they run while the rollout decodes: on CPU in a
worker thread (decode is latency bound; a second thread finds idle compute), on CUDA on a side
stream. With a frozen vision tower its features are computed once per prompt per step and shared
by the rollout, the reference and the actor. The actor prefix keeps its autograd graph when the
model trains: the update backpropagates each micro-batch's suffix into detached boundary leaves,
then the accumulated boundary gradient through the prefix graph once, before the step.

Barriers (§3.5), checked by `WeightsVersion`: θ_k is read-only while anything reads it (the
parameters' in-place version counters must not move during a read); a suffix waits for its
response (the rollout returned) and its prefix (the worker's future); θ_{k+1} is committed only
when no reader of θ_k is left. After a commit the θ_k prefix is stale: later minibatches of the
same iteration (several epochs or minibatches) recompute the prefix of their prompts.

The rollout's own prefill is not shared with the actor prefix (transformers' `generate` builds its
cache itself); a rollout engine that accepts a prefilled cache would remove that pass too.

Data parallel (`vlm.driver`): a rank's rollout rows are a contiguous slice of the B, so its prefixes
cover only the prompts of that slice (a prompt whose group spans two ranks gets a prefix on both;
each backpropagates its own rows' share, and the gradients are summed over ranks).
"""

from __future__ import annotations

import contextlib
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace

import torch

from vlm.policy import PromptBatch, VLMPolicy, select_image_outputs, token_logprobs
from vlm.rollout import Rollout
from vlm.update import update


class BarrierViolation(RuntimeError):
    """A schedule broke one of the synchronous-semantics barriers of the Rollplex paper."""


class WeightsVersion:
    """The version k of the trained weights θ_k and who is reading it.

    Args:
        params: the trained parameters (their `_version` counters detect in-place writes).
    """

    def __init__(self, params: list[torch.Tensor]):
        self.params = list(params)
        self.version = 0
        self._readers: dict[int, str] = {}
        self._committing = False
        self._lock = threading.Lock()
        self._next = 0

    @contextlib.contextmanager
    def read(self, who: str, version: int):
        """Read θ_version during the block; raises if it is not current or is written meanwhile."""
        with self._lock:
            if self._committing or version != self.version:
                raise BarrierViolation(f"{who} reads θ_{version}, but θ_{self.version} is current (or being committed)")
            token, self._next = self._next, self._next + 1
            self._readers[token] = who
        before = [p._version for p in self.params]
        try:
            yield
        finally:
            with self._lock:
                del self._readers[token]
            if [p._version for p in self.params] != before:
                raise BarrierViolation(f"θ_{version} was written while {who} read it")

    @property
    def readers(self) -> list[str]:
        with self._lock:
            return list(self._readers.values())

    def commit(self, optimizer: torch.optim.Optimizer) -> None:
        """Apply the optimizer step: θ_k becomes θ_{k+1}; only once no reader of θ_k is left."""
        with self._lock:
            if self._readers:
                raise BarrierViolation(
                    f"θ_{self.version + 1} committed while {sorted(self._readers.values())} still read θ_{self.version}"
                )
            self._committing = True
        try:
            optimizer.step()
        finally:
            with self._lock:
                self._committing = False
                self.version += 1


@dataclass
class PrefixState:
    """Boundary state of P prompts under one set of weights: all that a suffix needs."""

    kv: list[tuple[torch.Tensor, torch.Tensor]]
    """Per layer, keys and values (P, H, L, D) of the prompt tokens."""
    last_logits_PV: torch.Tensor
    """(P, V) logits at the last prompt position: they predict the first response token."""
    attention_mask_PL: torch.Tensor
    """(P, L) the prompts' attention mask (left padding)."""
    next_position_P: torch.Tensor
    """(P,) the rope position of the first response token."""
    version: int
    """The weights version that computed it."""

    def tensors(self) -> list[torch.Tensor]:
        return [t for kv in self.kv for t in kv] + [self.last_logits_PV]

    def with_tensors(self, tensors: list[torch.Tensor]) -> PrefixState:
        *kv, last = tensors
        return replace(self, kv=list(zip(kv[0::2], kv[1::2])), last_logits_PV=last)


def rope_positions(policy: VLMPolicy, prompts: PromptBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(3, P, L) multimodal rope positions of the prompts and (P,) the position after each prompt.

    A pure function of the token ids, the image grids and the config (the model's own forward
    caches rope_deltas on the module, which a concurrent `generate` also writes: we pass
    positions explicitly and never read that attribute).
    """
    positions_3PL, deltas_P1 = policy.base_model.model.get_rope_index(
        prompts.input_ids_BL,
        mm_token_type_ids=prompts.mm_token_type_ids_BL,
        image_grid_thw=prompts.image_grid_thw_B3,
        attention_mask=prompts.attention_mask_BL,
    )
    return positions_3PL, prompts.attention_mask_BL.sum(dim=1) + deltas_P1[:, 0].to(prompts.attention_mask_BL.device)


def prefix_forward(policy: VLMPolicy, model, prompts: PromptBatch, version: int) -> PrefixState:
    """The prefix pass of `model` over P prompts (vision tower unless `prompts.image_outputs` is set).

    Runs under the caller's grad mode: with gradient it keeps the graph back to the weights.
    """
    positions_3PL, next_position_P = rope_positions(policy, prompts)
    out = model(**prompts.model_inputs(), position_ids=positions_3PL, use_cache=True, logits_to_keep=1)
    kv = [(layer.keys, layer.values) for layer in out.cache.layers]
    return PrefixState(kv, out.logits[:, -1], prompts.attention_mask_BL, next_position_P, version)


def suffix_logprobs(
    policy: VLMPolicy,
    model,
    prefix: PrefixState,
    prompt_index_b: list[int],
    response_ids_bT: torch.Tensor,
    response_mask_bT: torch.Tensor,
    temperature: float,
) -> torch.Tensor:
    """(b, T) log-probs of responses under `model`, attending to their prompts' prefix state.

    Args:
        prompt_index_b: the prefix row (prompt) of each response.
    """
    from transformers import DynamicCache

    device = prefix.last_logits_PV.device
    index = torch.tensor(prompt_index_b, dtype=torch.long, device=device)
    response_ids_bT = response_ids_bT.to(device)
    mask_bT = response_mask_bT.to(device)
    cache = DynamicCache([(k.index_select(0, index), v.index_select(0, index)) for k, v in prefix.kv])
    attention_bLT = torch.cat(
        [prefix.attention_mask_PL.index_select(0, index), mask_bT.to(prefix.attention_mask_PL.dtype)], dim=1
    )
    # Response token t is the (t+1)-th real token after the prompt; padding gets 0 as in get_rope_index.
    step_bT = mask_bT.long().cumsum(dim=1) - 1
    positions_bT = torch.where(mask_bT.bool(), prefix.next_position_P.index_select(0, index).unsqueeze(1) + step_bT, 0)
    out = model(
        input_ids=response_ids_bT,
        attention_mask=attention_bLT,
        position_ids=positions_bT.unsqueeze(0).expand(3, -1, -1),
        cache=cache,
        use_cache=True,
        logits_to_keep=0,
    )
    # Token 0 is predicted by the prefix's last position, token t by suffix position t - 1.
    logits_bTV = torch.cat([prefix.last_logits_PV.index_select(0, index).unsqueeze(1), out.logits[:, :-1]], dim=1)
    return token_logprobs(logits_bTV, response_ids_bT, mask_bT, policy.banned_token_ids, temperature)


def vision_frozen(policy: VLMPolicy) -> bool:
    return not any(p.requires_grad for p in policy.base_model.model.visual.parameters())


def image_features(policy: VLMPolicy, prompts: PromptBatch):
    """The vision tower's output for each prompt's image (under the caller's grad mode)."""
    return policy.base_model.model.get_image_features(
        prompts.pixel_values_NC, prompts.image_grid_thw_B3, return_dict=True
    )


def detach_image_outputs(outputs):
    picked = select_image_outputs(outputs, range(len(outputs.pooler_output)))
    picked.pooler_output = tuple(t.detach() for t in picked.pooler_output)
    if getattr(picked, "deepstack_features", None) is not None:
        picked.deepstack_features = [tuple(t.detach() for t in f) for f in picked.deepstack_features]
    return picked


class RollplexSchedule:
    """The Rollplex phases with the `SerialSchedule` interface (see `vlm.driver`).

    Args:
        policy, engine, reference, optimizer, cfg: as for `SerialSchedule`.
        ledger: optional `vlm.memory.TensorLedger`; the prefix worker records into it too.
        overlap: run the prefixes during the decode (False: before it, for measuring the overlap's share).
    """

    def __init__(
        self,
        policy: VLMPolicy,
        engine,
        reference,
        optimizer: torch.optim.Optimizer,
        cfg,
        *,
        ledger=None,
        overlap: bool = True,
    ):
        self.policy, self.engine, self.reference, self.optimizer, self.cfg = policy, engine, reference, optimizer, cfg
        self.ledger, self.overlap = ledger, overlap
        self.lr_scale = 1.0  # the learning-rate factor the driver sets per update (train.lr_cooldown)
        self.trains = any(p.requires_grad for p in policy.model.parameters())
        self.guard = WeightsVersion([p for p in policy.model.parameters() if p.requires_grad])
        self.frozen_vision = vision_frozen(policy)
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollplex-prefix")
        cuda = policy.device.type == "cuda"
        # On a GPU the prefixes go to a side stream (the decode's kernels leave most SMs idle);
        # written for CUDA, exercised only where one is present.
        self.side_stream = torch.cuda.Stream(policy.device) if cuda else None
        self._clear()

    def _clear(self) -> None:
        self._pending: Future | None = None
        self._prompts: PromptBatch | None = None
        self._first_prompt = 0  # the global index of _prompts' first prompt (data parallelism)
        self._ref: PrefixState | None = None
        self._actor: PrefixState | None = None
        self._ready = False

    def _drop(self) -> None:
        """Release the boundary state of the last iteration (after its worker finished)."""
        if self._pending is not None:
            self._pending.result()
        self._clear()

    # 1. Rollout, with the reference and actor prefixes of θ_k running alongside.
    def rollout(self, prompts: PromptBatch, seed: int, rows: range | None = None, pad: int = 0) -> Rollout:
        assert pad == 0, "padding rows are for FSDP, which this schedule does not run under (vlm.driver)"
        rc = self.cfg.rollout
        self._drop()
        version = self.guard.version
        prompts = prompts.to(self.policy.device)
        self._first_prompt = 0 if rows is None else rows.start // self.cfg.train.group_size
        # Vision once per prompt: with the graph when the tower trains (the actor prefix needs it).
        with torch.set_grad_enabled(self.trains and not self.frozen_vision):
            features = image_features(self.policy, prompts)
        self._prompts = replace(prompts, image_outputs=features)
        if self.side_stream is not None:
            self.side_stream.wait_stream(torch.cuda.current_stream(self.policy.device))
        self._pending = self.worker.submit(self._prefixes, self._prompts, version)
        if not self.overlap:
            self._pending.result()
        # The rollout's rows carry the shared features only: no per-sample copy of the pixels.
        shared = replace(prompts, pixel_values_NC=None, image_outputs=detach_image_outputs(features))
        with self.guard.read("rollout", version):
            return self.engine.generate(
                shared, self.cfg.train.group_size, rc.max_new_tokens, rc.temperature, seed=seed, rows=rows
            )

    def _prefixes(self, prompts: PromptBatch, version: int):
        """Worker: the reference prefix (no gradient) and the actor prefix (graph kept if training)."""
        stream = torch.cuda.stream(self.side_stream) if self.side_stream is not None else contextlib.nullcontext()
        mode = self.ledger.mode() if self.ledger is not None else contextlib.nullcontext()
        with mode, stream, self.guard.read("prefix", version):
            ref = None
            # A LoRA reference is the same module with the adapter switched off, a module-wide
            # switch the concurrent decode would see: that prefix waits for the rollout instead.
            if self.cfg.train.beta > 0 and self.reference.copy is not None:
                ref_prompts = prompts if self.frozen_vision else replace(prompts, image_outputs=None)
                with torch.no_grad():
                    ref = prefix_forward(self.policy, self.reference.copy, ref_prompts, version)
            with torch.set_grad_enabled(self.trains):
                actor = prefix_forward(self.policy, self.policy.model, prompts, version)
            event = None
            if self.side_stream is not None:
                event = torch.cuda.Event()
                event.record(self.side_stream)
        return ref, actor, event

    def _wait(self) -> None:
        """Barrier: a suffix starts only once its response (the caller holds it) and prefix exist."""
        if self._ready:
            return
        assert self._pending is not None, "no rollout this iteration"
        self._ref, self._actor, event = self._pending.result()
        if event is not None:
            current = torch.cuda.current_stream(self.policy.device)
            current.wait_event(event)
            for state in (self._ref, self._actor):
                for t in state.tensors() if state is not None else []:
                    t.record_stream(current)
        self._ready = True

    # 2. Reference and old log-probs: suffix passes over the saved prefix state.
    @torch.no_grad()
    def reference_logprobs(self, batch: Rollout, rows: list[int]) -> torch.Tensor:
        self._wait()
        if self._ref is None:  # LoRA: the adapter-off prefix, now that the decode is over
            prompts = self._prompts if self.frozen_vision else replace(self._prompts, image_outputs=None)
            with self.policy.model.disable_adapter(), self.guard.read("reference prefix", self.guard.version):
                self._ref = prefix_forward(self.policy, self.policy.model, prompts, self.guard.version)
        model = self.policy.model if self.reference.copy is None else self.reference.copy
        ctx = self.policy.model.disable_adapter if self.reference.copy is None else contextlib.nullcontext
        with ctx():
            return self._suffix_batches(model, self._ref, batch, rows)

    @torch.no_grad()
    def old_logprobs(self, batch: Rollout, rows: list[int]) -> torch.Tensor:
        self._wait()
        assert self._actor.version == self.guard.version, "old log-probs need the prefix of the weights that sampled"
        state = self._actor.with_tensors([t.detach() for t in self._actor.tensors()])
        with self.guard.read("old", self._actor.version):
            return self._suffix_batches(self.policy.model, state, batch, rows)

    def _suffix_batches(self, model, state: PrefixState, batch: Rollout, rows: list[int]) -> torch.Tensor:
        G, mb, first = self.cfg.train.group_size, self.cfg.train.micro_batch_size, self._first_prompt
        parts = []
        for start in range(0, len(rows), mb):
            local = list(range(start, min(start + mb, len(rows))))
            logp = suffix_logprobs(
                self.policy,
                model,
                state,
                [rows[i] // G - first for i in local],
                batch.response_ids_BT[local],
                batch.response_mask_BT[local],
                self.cfg.rollout.temperature,
            )
            parts.append(logp.cpu())
        return torch.cat(parts)

    # 3. Update: suffix forward and backward per micro-batch, the prefix backward once per step.
    def update(
        self,
        batch: Rollout | None,
        rows: list[int],
        adv_B: torch.Tensor,
        old_logp_BT,
        ref_logp_BT,
        iteration: int,
        *,
        shard=None,
    ) -> dict[str, float]:
        self._wait()
        scorer = _SuffixScorer(self, batch, rows)
        stats = update(
            self.policy,
            self.optimizer,
            batch,
            adv_B,
            old_logp_BT,
            ref_logp_BT,
            self.cfg,
            iteration,
            scorer=scorer,
            shard=shard,
            lr_scale=self.lr_scale,
        )
        self._drop()
        return stats

    def boundary_bytes(self) -> int:
        """Bytes of the boundary state held now: prefix keys, values and logits, shared vision features."""
        from vlm.memory import tensor_bytes

        states = [s for s in (self._ref, self._actor) if s is not None]
        features = (
            []
            if self._prompts is None or self._prompts.image_outputs is None
            else list(self._prompts.image_outputs.pooler_output)
        )
        return tensor_bytes([t for s in states for t in s.tensors()] + features)

    def close(self) -> None:
        self._drop()
        self.worker.shutdown(wait=True)


class _SuffixScorer:
    """Training log-probs from prefix state: the `FullForward` interface of `vlm.update.update`."""

    def __init__(self, schedule: RollplexSchedule, batch: Rollout | None, rows: list[int]):
        self.s, self.batch, self.rows = schedule, batch, rows
        self.G = schedule.cfg.train.group_size
        self.graph: PrefixState | None = schedule._actor  # θ_k's, computed during the decode
        self.leaves: PrefixState | None = None
        # Global prompt index -> row of the prefix state.
        first = schedule._first_prompt
        self.prompt_row: dict[int, int] = {first + i: i for i in range(schedule._prompts.num_rows)}

    def begin_minibatch(self, mb_rows: list[int]) -> None:
        s = self.s
        if not mb_rows:  # data parallelism: none of this minibatch is on this rank
            self.leaves = None
            return
        if self.graph is None or self.graph.version != s.guard.version:
            # θ moved since that prefix: recompute it for this minibatch's prompts.
            prompts = sorted({self.rows[r] // self.G for r in mb_rows})
            sub = s._prompts.select([p - s._first_prompt for p in prompts])
            if not s.frozen_vision:
                sub = replace(sub, image_outputs=None)
            with s.guard.read("prefix", s.guard.version):
                self.graph = prefix_forward(s.policy, s.policy.model, sub, s.guard.version)
            self.prompt_row = {p: i for i, p in enumerate(prompts)}
        # The boundary: suffix backward passes stop at these leaves and accumulate their gradient.
        self.leaves = self.graph.with_tensors(
            [t.detach().requires_grad_(t.requires_grad) for t in self.graph.tensors()]
        )

    def logprobs(self, mb_rows: list[int]) -> torch.Tensor:
        ro = self.batch
        index = [self.prompt_row[self.rows[r] // self.G] for r in mb_rows]
        return suffix_logprobs(
            self.s.policy,
            self.s.policy.model,
            self.leaves,
            index,
            ro.response_ids_BT[mb_rows],
            ro.response_mask_BT[mb_rows],
            self.s.cfg.rollout.temperature,
        )

    def before_step(self) -> None:
        if self.leaves is None:
            return
        pairs = [
            (t, leaf.grad) for t, leaf in zip(self.graph.tensors(), self.leaves.tensors()) if leaf.grad is not None
        ]
        if pairs:
            torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        self.leaves = None

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        self.s.guard.commit(optimizer)
        self.graph = None  # stale: the next minibatch recomputes its prefix at θ_{k+1}


class VisionCounter:
    """Counts the images the vision towers really encode (a forward pre-hook on each tower).

    Args:
        towers: vision modules (`policy.base_model.model.visual`, the reference copy's).
    """

    def __init__(self, towers):
        self.images = 0
        self._lock = threading.Lock()
        self._handles = [t.register_forward_pre_hook(self._hook, with_kwargs=True) for t in towers]

    def _hook(self, module, args, kwargs) -> None:
        grid_thw = kwargs["grid_thw"] if "grid_thw" in kwargs else args[1]  # (images, 3)
        with self._lock:
            self.images += int(grid_thw.shape[0])

    def close(self) -> None:
        for h in self._handles:
            h.remove()
