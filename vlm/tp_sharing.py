"""Weight sharing between a training and a rollout tensor-parallel layout (the Rollplex paper).

Colocated RL keeps the policy twice on the same devices: sharded for training at TP degree t
and sharded for rollout (the inference engine) at TP degree r. Rollplex reports that most of the
rollout copy need not exist: per tensor, the rollout shard either *shares* the training storage,
is a strided *view* of it, or must be *rebuilt* (copied) after each optimizer step. This module
plans that per tensor (a pure function of names and shapes) and realises it on real tensors.

Splits (Megatron-LM, Shoeybi et al. 2019, §3): a linear layer y = x W^T with W of shape (O, I) is
*column-parallel* when W is split along O (dim 0; q/k/v, gate/up, the merger's first layer: each
rank computes its own output features), *row-parallel* when split along I (dim 1; o_proj, attn.proj,
down_proj, the merger's second layer: each rank holds a slice of the input features and the
partial outputs are summed). Embedding and lm_head are *vocab-parallel* (split along the vocab,
dim 0). Norms, the patch embedding and the biases of row-parallel layers are *replicated*. A fused
QKV (the vision tower's `attn.qkv`, rows [Q; K; V]) is split per head: shard i holds *its* q heads,
then *its* k heads, then *its* v heads, so a shard is not one contiguous range of rows.

What "shared" means here (colocated). Let t and r nest (one divides the other); k = max/min.

* t >= r (the reported case t=8, r=4, k=2): rollout rank g's shard is the union of the training
  shards of ranks g*k .. g*k+k-1 (its *group*). For every tensor that is not rebuilt, the group's
  training shards are allocated as ONE group buffer that is the rollout shard: the training shard
  of rank g*k+s is the s-th slot of it. Each slot is one contiguous memory range, so the
  all-gather that fills the peers' slots after an optimizer step (needed by any t -> r
  re-sharding, since a device holds only 1/t of the model) lands in place: no staging buffer and no
  re-layout. The simulation keeps one replica of the group buffer per rollout rank (after that
  all-gather the k devices of a group hold identical replicas) and leaves the all-gather out.
* t < r: a training shard is the union of k rollout shards; each rollout shard is a slice of it.
* t == r: every tensor is shared as is.

Classes (fractions are counted in parameters, not tensors):

* `share`: rollout and training tensors are both plain contiguous row-major tensors on the same
  storage, the smaller a contiguous range of the larger (same order, nested shard ranges). This
  holds for dim-0 splits (column- and vocab-parallel) and for replicated tensors.
* `view`: same storage, but one side is a strided view. Row-parallel weights split along dim 1,
  whose column ranges are not contiguous in a row-major matrix. The group buffer is kept
  *transposed* (input features outermost, shape (I/r, O)): each training shard's slot is again one
  contiguous range (so gathers land in place), and both sides read it through `.t()`, a
  transposed view that a GEMM consumes without a copy (cuBLAS' transpose flag). Generally a split
  along dim d is stored with d moved outermost; it is a share iff the dims before d are all 1.
* `rebuild`: no single strided view can express the rollout shard over the training storage.
  A fused QKV when t != r: for t=2, r=1 the rollout rows are [q0 q1 k0 k1 v0 v1] while the
  training shards are [q0 k0 v0] and [q1 k1 v1]; in any one allocation one side has rows at
  non-uniform strides (and with GQA the q and kv blocks differ in size too). These get their own
  rollout buffer, copied from the training shards by `ColocatedShards.refresh()` after each
  optimizer step.

What falls out for Qwen2.5-VL (`benchmarks/tp_sharing.py`): transformers keeps the text model's
q/k/v as three tensors, each column-parallel, so they are shares; only the vision tower's fused
qkv is rebuilt (under 1% of a 32B model). Rollplex reports 7.2% rebuilt, which matches (within a
few tenths of a percent) the share of parameters in fused text QKV (q+k+v of 64 layers are ~7.0%):
a layout where the text QKV is fused in [Q; K; V] order, as in vLLM's `qkv_proj`, rebuilds it. The
benchmark reports that variant too. With separate q/k/v training tensors, even a fused rollout
qkv could be a share, by allocating each layer's group buffer in the rollout's [Q_g; K_g; V_g]
order (each training q/k/v shard is then a contiguous range of it); that layout is not built here.

Shape legend: O output features, I input features, V vocabulary; a shard keeps the full tensor's
rank and divides the split dim by the TP degree.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

ShareKind = Literal["share", "view", "rebuild"]
SHARE_KINDS: tuple[ShareKind, ...] = ("share", "view", "rebuild")
SplitKind = Literal["column", "row", "vocab", "fused_qkv", "replicated"]


@dataclass(frozen=True)
class Segment:
    """A run of equal units (heads or rows) along the split dim; split evenly across ranks."""

    what: str
    """What a unit is, for error messages ("q heads", "kv heads", "rows", "vocab rows")."""
    num_units: int
    """Units in the full tensor; every TP degree must divide it."""
    unit_size: int
    """Elements per unit along the split dim (the head dim for heads, 1 for rows)."""

    @property
    def size(self) -> int:
        return self.num_units * self.unit_size


@dataclass(frozen=True)
class Split:
    """How one tensor is sharded: the split dim and its segments (one, or q/k/v for a fused QKV)."""

    kind: SplitKind
    """Megatron name of the split, for reports."""
    dim: int | None
    """The split dim; None for a replicated tensor."""
    segments: tuple[Segment, ...] = ()
    """Consecutive segments along `dim`; shard i is the concatenation of each segment's i-th piece."""


def column(segment: Segment) -> Split:
    """Column-parallel: split the output features (dim 0 of a weight, and its bias)."""
    return Split("column", 0, (segment,))


def row(segment: Segment) -> Split:
    """Row-parallel: split the input features (dim 1 of a weight; its bias is replicated)."""
    return Split("row", 1, (segment,))


def vocab(num_rows: int) -> Split:
    """Vocab-parallel embedding or lm_head: split the vocabulary rows (dim 0)."""
    return Split("vocab", 0, (Segment("vocab rows", num_rows, 1),))


def fused_qkv(num_q_heads: int, num_kv_heads: int, head_dim: int) -> Split:
    """A fused [Q; K; V] projection split per head: shard i holds its q, its k and its v heads."""
    q, kv = Segment("q heads", num_q_heads, head_dim), Segment("kv heads", num_kv_heads, head_dim)
    return Split("fused_qkv", 0, (q, kv, kv))


REPLICATED = Split("replicated", None)


@dataclass(frozen=True)
class Rule:
    """Tensors whose name matches `pattern` (re.search) are split as `split`; first match wins."""

    pattern: str
    split: Split


def qwen2_5_vl_rules(config: Any) -> tuple[Rule, ...]:
    """The split of every parameter of transformers' `Qwen2_5_VLForConditionalGeneration`.

    Follows Megatron-style TP as inference engines apply it to Qwen2.5-VL: text q/k/v, gate/up and
    the vision MLP's gate/up column-parallel; o_proj, attn.proj, down_proj row-parallel; the vision
    tower's fused qkv split per head; the merger MLP column- then row-parallel; embed_tokens and
    lm_head vocab-parallel; norms, the patch embedding (a Conv3d) and row-parallel biases replicated.

    Args:
        config: a `Qwen2_5_VLConfig` (reads `text_config` and `vision_config`).
    """
    text, vision = config.text_config, config.vision_config
    head_dim = text.hidden_size // text.num_attention_heads
    vision_head_dim = vision.hidden_size // vision.num_heads
    merger_hidden = vision.hidden_size * vision.spatial_merge_size**2
    q_heads = Segment("q heads", text.num_attention_heads, head_dim)
    kv_heads = Segment("kv heads", text.num_key_value_heads, head_dim)
    mlp_rows = Segment("rows", text.intermediate_size, 1)
    vision_heads = Segment("heads", vision.num_heads, vision_head_dim)
    vision_mlp_rows = Segment("rows", vision.intermediate_size, 1)
    merger_rows = Segment("rows", merger_hidden, 1)
    block = r"\bvisual\.blocks\.\d+\."
    layer = r"\blanguage_model\.layers\.\d+\."
    return (
        Rule(block + r"attn\.qkv\.(weight|bias)$", fused_qkv(vision.num_heads, vision.num_heads, vision_head_dim)),
        Rule(block + r"attn\.proj\.weight$", row(vision_heads)),
        Rule(block + r"mlp\.(gate|up)_proj\.(weight|bias)$", column(vision_mlp_rows)),
        Rule(block + r"mlp\.down_proj\.weight$", row(vision_mlp_rows)),
        Rule(block + r"(norm1|norm2)\.weight$|" + block + r"(attn\.proj|mlp\.down_proj)\.bias$", REPLICATED),
        Rule(r"\bvisual\.merger\.mlp\.0\.(weight|bias)$", column(merger_rows)),
        Rule(r"\bvisual\.merger\.mlp\.2\.weight$", row(merger_rows)),
        Rule(r"\bvisual\.(merger\.ln_q\.weight|merger\.mlp\.2\.bias|patch_embed\.proj\.weight)$", REPLICATED),
        Rule(layer + r"self_attn\.q_proj\.(weight|bias)$", column(q_heads)),
        Rule(layer + r"self_attn\.[kv]_proj\.(weight|bias)$", column(kv_heads)),
        Rule(layer + r"self_attn\.o_proj\.weight$", row(q_heads)),
        Rule(layer + r"mlp\.(gate|up)_proj\.weight$", column(mlp_rows)),
        Rule(layer + r"mlp\.down_proj\.weight$", row(mlp_rows)),
        Rule(layer + r"(input_layernorm|post_attention_layernorm)\.weight$", REPLICATED),
        Rule(r"\blanguage_model\.norm\.weight$", REPLICATED),
        Rule(r"\blanguage_model\.embed_tokens\.weight$", vocab(text.vocab_size)),
        Rule(r"^lm_head\.weight$", vocab(text.vocab_size)),
    )


@dataclass(frozen=True)
class TensorPlan:
    """One tensor's split and sharing class."""

    name: str
    shape: tuple[int, ...]
    split: Split
    kind: ShareKind

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class SharingPlan:
    """The per-tensor plan for one (training TP, rollout TP) pair."""

    train_tp: int
    rollout_tp: int
    tensors: tuple[TensorPlan, ...]

    def numel(self, kind: ShareKind | None = None) -> int:
        """Parameters in tensors of class `kind` (all parameters if None)."""
        return sum(p.numel for p in self.tensors if kind is None or p.kind == kind)

    def fractions(self) -> dict[str, float]:
        """Fraction of parameters per class, plus `shared_fraction` = share + view."""
        total = self.numel()
        out: dict[str, float] = {kind: self.numel(kind) / total for kind in SHARE_KINDS}
        out["shared_fraction"] = out["share"] + out["view"]
        return out

    def rollout_shard_numel(self, kind: ShareKind | None = None) -> int:
        """Elements one rollout rank holds (replicated tensors whole), of class `kind` if given."""
        return sum(
            p.numel if p.split.dim is None else p.numel // self.rollout_tp
            for p in self.tensors
            if kind is None or p.kind == kind
        )

    def by_name(self) -> dict[str, TensorPlan]:
        return {p.name: p for p in self.tensors}


def classify(split: Split, shape: Sequence[int], train_tp: int, rollout_tp: int) -> ShareKind:
    """The sharing class of one tensor (see the module docstring for the storage layout).

    Args:
        split: how the tensor is sharded.
        shape: the full tensor's shape.
        train_tp, rollout_tp: TP degrees; one divides the other.
    """
    if split.dim is None or train_tp == rollout_tp:
        return "share"
    if len(split.segments) > 1:
        return "rebuild"
    # The buffer keeps the split dim outermost; that is the model's own row-major layout (a share)
    # only if every dim before it has size 1.
    return "share" if math.prod(shape[: split.dim]) == 1 else "view"


def plan_sharing(
    shapes: Mapping[str, Sequence[int]], rules: Sequence[Rule], train_tp: int, rollout_tp: int
) -> SharingPlan:
    """Classify every tensor as share / view / rebuild for training TP `train_tp`, rollout TP `rollout_tp`.

    Args:
        shapes: parameter name -> full shape (e.g. from `model.named_parameters()` on the meta device).
        rules: the split rule table (e.g. `qwen2_5_vl_rules(config)`); first matching pattern wins.
        train_tp, rollout_tp: TP degrees; one must divide the other so that shard ranges nest.

    Raises:
        ValueError: a degree below 1 or degrees that do not nest; a name no rule matches; a rule
            whose segments do not add up to the tensor's split dim; a degree that does not divide
            a segment's heads or rows (the message names the tensor and the degree).
    """
    for role, degree in (("training", train_tp), ("rollout", rollout_tp)):
        if degree < 1:
            raise ValueError(f"{role} TP degree must be at least 1, got {degree}")
    if max(train_tp, rollout_tp) % min(train_tp, rollout_tp):
        raise ValueError(f"training TP {train_tp} and rollout TP {rollout_tp} do not nest: one must divide the other")
    compiled = [(re.compile(rule.pattern), rule.split) for rule in rules]
    tensors = []
    for name, shape in shapes.items():
        shape = tuple(int(s) for s in shape)
        split = next((s for pattern, s in compiled if pattern.search(name)), None)
        if split is None:
            raise ValueError(f"{name}: no split rule matches this tensor; add one to the rule table")
        _check_split(name, shape, split, (("training", train_tp), ("rollout", rollout_tp)))
        tensors.append(TensorPlan(name, shape, split, classify(split, shape, train_tp, rollout_tp)))
    return SharingPlan(train_tp, rollout_tp, tuple(tensors))


def _check_split(name: str, shape: tuple[int, ...], split: Split, degrees: Sequence[tuple[str, int]]) -> None:
    if split.dim is None:
        return
    if split.dim >= len(shape) or sum(seg.size for seg in split.segments) != shape[split.dim]:
        raise ValueError(
            f"{name}: shape {shape} does not match its {split.kind} split along dim {split.dim} "
            f"({' + '.join(f'{s.num_units} {s.what} x {s.unit_size}' for s in split.segments)})"
        )
    for role, degree in degrees:
        for seg in split.segments:
            if seg.num_units % degree:
                raise ValueError(f"{name}: {seg.num_units} {seg.what} are not divisible by {role} TP degree {degree}")


# ---------------------------------------------------------------------------------------------
# Real tensors: shards, and rollout shards that alias the training storage.
# ---------------------------------------------------------------------------------------------


def _pieces(tensor: torch.Tensor, split: Split, degree: int) -> list[torch.Tensor]:
    """Views of each segment's part in `tensor`, itself a shard at `degree` (or the full tensor, degree 1)."""
    assert split.dim is not None
    out, offset = [], 0
    for seg in split.segments:
        size = seg.size // degree
        out.append(tensor.narrow(split.dim, offset, size))
        offset += size
    return out


def shard(full: torch.Tensor, split: Split, degree: int, rank: int) -> torch.Tensor:
    """Megatron shard `rank` of `degree` of a full tensor (a view when the shard is one range, else a copy).

    Args:
        full: the full tensor, e.g. (O, I) for a linear weight.
        split: its split; the split dim shrinks by `degree`.
        degree: the TP degree.
        rank: the TP rank, in [0, degree).
    """
    if split.dim is None:
        return full
    parts = []
    for piece in _pieces(full, split, 1):
        size = piece.shape[split.dim] // degree
        parts.append(piece.narrow(split.dim, rank * size, size))
    return parts[0] if len(parts) == 1 else torch.cat(parts, split.dim)


def _rollout_pieces(
    train_shards: Sequence[torch.Tensor], split: Split, train_tp: int, rollout_tp: int, rank: int
) -> list[torch.Tensor]:
    """Views into the training shards that, concatenated along the split dim, form rollout shard `rank`."""
    assert split.dim is not None
    if train_tp >= rollout_tp:
        k = train_tp // rollout_tp
        sources = [_pieces(train_shards[i], split, train_tp) for i in range(rank * k, (rank + 1) * k)]
        return [src[s] for s in range(len(split.segments)) for src in sources]
    k = rollout_tp // train_tp
    out = []
    for piece in _pieces(train_shards[rank // k], split, train_tp):
        size = piece.shape[split.dim] // k
        out.append(piece.narrow(split.dim, (rank % k) * size, size))
    return out


def _byte_span(tensor: torch.Tensor) -> tuple[int, int]:
    """[start, end) bytes that `tensor`'s elements can touch."""
    start = tensor.data_ptr()
    if tensor.numel() == 0:
        return start, start
    extent = 1 + sum((size - 1) * abs(stride) for size, stride in zip(tensor.shape, tensor.stride(), strict=True))
    return start, start + extent * tensor.element_size()


def aliases(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True if `a` and `b` live in the same storage and their byte spans overlap."""
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    (a0, a1), (b0, b1) = _byte_span(a), _byte_span(b)
    return a0 < b1 and b0 < a1


def _nested_pairs(train_tp: int, rollout_tp: int) -> list[tuple[int, int]]:
    """(training rank, rollout rank) pairs whose shard ranges nest."""
    if train_tp >= rollout_tp:
        k = train_tp // rollout_tp
        return [(i, i // k) for i in range(train_tp)]
    k = rollout_tp // train_tp
    return [(j // k, j) for j in range(rollout_tp)]


@dataclass
class ColocatedShards:
    """Training shards (t per tensor) and rollout shards (r per tensor) of one model, simulated in one process.

    Build with `colocate`. Share/view rollout shards alias the training storage, so an in-place
    optimizer update of the training shards is already visible to rollout; `refresh()` copies
    the rebuild tensors only.
    """

    plan: SharingPlan
    train: dict[str, list[torch.Tensor]]
    """name -> one tensor per training rank."""
    rollout: dict[str, list[torch.Tensor]]
    """name -> one tensor per rollout rank."""

    def refresh(self) -> int:
        """Rebuild the `rebuild` rollout shards from the training shards, in place. Returns elements copied."""
        copied = 0
        for p in self.plan.tensors:
            if p.kind != "rebuild":
                continue
            for rank, dst in enumerate(self.rollout[p.name]):
                pieces = _rollout_pieces(self.train[p.name], p.split, self.plan.train_tp, self.plan.rollout_tp, rank)
                copied += _copy_pieces(dst, pieces, p.split)
        return copied


def _copy_pieces(dst: torch.Tensor, pieces: Sequence[torch.Tensor], split: Split) -> int:
    assert split.dim is not None
    offset = 0
    for piece in pieces:
        size = piece.shape[split.dim]
        dst.narrow(split.dim, offset, size).copy_(piece)
        offset += size
    assert offset == dst.shape[split.dim]
    return dst.numel()


def _outermost(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    """A copy of `tensor` stored with `dim` outermost, returned in `tensor`'s own dim order (a view of that copy)."""
    # clone, not contiguous(): the latter returns the input itself when it is already laid out so.
    return tensor.movedim(dim, 0).clone(memory_format=torch.contiguous_format).movedim(0, dim)


def colocate(full: Mapping[str, torch.Tensor], plan: SharingPlan) -> ColocatedShards:
    """Build training and rollout shards from full tensors, sharing storage wherever `plan` says so.

    Share/view tensors: for each of the min(t, r) larger shards one buffer is allocated (the split
    dim outermost, see the module docstring), and the smaller shards are views into it. Rebuild
    tensors: training shards are allocated per rank, and rollout shards get their own buffers,
    filled from the training shards as `refresh()` does.

    Args:
        full: name -> full tensor, for every tensor in `plan` (copied, not modified).
        plan: from `plan_sharing`.
    """
    t, r = plan.train_tp, plan.rollout_tp
    k = max(t, r) // min(t, r)
    train: dict[str, list[torch.Tensor]] = {}
    rollout: dict[str, list[torch.Tensor]] = {}
    for p in plan.tensors:
        tensor = full[p.name].detach()
        if tuple(tensor.shape) != p.shape:
            raise ValueError(f"{p.name}: the plan has shape {p.shape}, the tensor {tuple(tensor.shape)}")
        if p.kind == "rebuild":
            assert p.split.dim is not None
            train[p.name] = [shard(tensor, p.split, t, i).clone() for i in range(t)]
            shape = list(p.shape)
            shape[p.split.dim] //= r
            rollout[p.name] = [tensor.new_empty(shape) for _ in range(r)]  # filled by refresh() below
            continue
        if p.split.dim is None:
            # Replicated: one buffer per group, read by every rank of it.
            buffers = [tensor.clone() for _ in range(min(t, r))]
            small = [buffers[i // k] for i in range(max(t, r))]
        else:
            dim = p.split.dim
            buffers = [_outermost(shard(tensor, p.split, min(t, r), g), dim) for g in range(min(t, r))]
            small = []
            for buffer in buffers:
                size = buffer.shape[dim] // k
                small += [buffer.narrow(dim, s * size, size) for s in range(k)]
        train[p.name], rollout[p.name] = (small, buffers) if t >= r else (buffers, small)
    shards = ColocatedShards(plan, train, rollout)
    shards.refresh()
    for p in plan.tensors:
        for i, j in _nested_pairs(t, r):
            shared = aliases(train[p.name][i], rollout[p.name][j])
            assert shared == (p.kind != "rebuild"), (p.name, p.kind, i, j)
    return shards
