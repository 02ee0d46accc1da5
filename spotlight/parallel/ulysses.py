"""Ulysses sequence parallelism for Qwen-Image's joint (double-stream) attention, over any process group.

DeepSpeed-Ulysses (Jacobs et al. 2023, arXiv:2309.14509, section 3): every rank holds a slice of the
sequence and all attention heads; one all-to-all turns that into the full sequence and a slice of
the heads, attention runs locally per head, and the inverse all-to-all goes back to sequence
slices. Everything outside attention (projections, MLPs, modulation, norms) is per token, so it runs
on the local slice with no communication. Weights are replicated on every rank, which is what lets
a group be re-formed in place (the elastic part): no weight moves when the degree changes.

Choices (the Qwen-Image specifics, ours to make):
- **Image tokens are sharded, text tokens are replicated.** Every rank holds the whole text stream
  (a few hundred tokens against thousands of image tokens) and computes its q/k/v for all heads,
  then keeps the text of its own heads for attention: text needs no all-to-all on the way in. On
  the way out, the text output of each head slice rides in the same inverse all-to-all as the image
  output (two collectives per layer in all), so every rank again holds the full text stream. This
  is how yunchang's long-context attention (under xDiT) also treats the joint text tensors of MMDiT
  models; sharding text instead would save little compute and cost a text mask per shard.
- **Padding.** An image length L not divisible by the degree n is padded to P = n * ceil(L / n)
  with zero tokens at the end; their rotary frequencies are the identity, they are masked out as
  keys, and their outputs are dropped by `ulysses_forward`.
- **The group is read at call time.** The processors keep a reference to one `SPContext`; calling
  `SPContext.set_group(pg)` with a new process group (or `None` for degree 1) re-forms the model's
  parallelism with no other change to the model. At degree 1 no collective is issued.
- The processor finds everything else from its inputs: the full image length is the row count of
  the image rotary frequencies (Qwen-Image's forward computes them for the whole image), the local
  slice is `hidden_states`, so the stock transformer forward runs unchanged on a slice.

Forward only (rollouts, exploration): the collectives are not differentiable, so `ulysses_forward`
runs under `torch.no_grad`.

Two attention cores (`parallel.sp_backend`, chosen per `SPContext`): "ours" is the all-to-all pair
below around diffusers' `dispatch_attention_fn`; "xfuser" hands the same q/k/v and key mask to xDiT's
USP attention (`spotlight.parallel.xfuser_usp`, CUDA only). Everything else in the processor is
shared, so the two differ only in how heads and sequence are exchanged and in the attention kernel.

Shape legend: B batch, T text tokens, L image tokens, P padded image tokens (n * S), S image tokens
on this rank, H heads, h = H / n heads per rank, E head dim, n degree, C channels.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.attention_processor import Attention
from diffusers.models.transformers.transformer_qwenimage import apply_rotary_emb_qwen

SP_BACKENDS = ("ours", "xfuser")
"""Attention cores of the sequence-parallel forward (`parallel.sp_backend`)."""


class SPContext:
    """The sequence-parallel group that Ulysses processors read at call time (replaceable).

    Args:
        num_heads: attention heads of the model, checked against each group's size; None skips the
            early check (the processor still checks at call time).
        backend: the attention core, one of `SP_BACKENDS` (`parallel.sp_backend`): "ours", or
            "xfuser" (imports xfuser here, so a missing or unusable install fails before a model
            loads when the context is made first; CUDA only).
    """

    def __init__(self, num_heads: int | None = None, backend: str = "ours"):
        if backend not in SP_BACKENDS:
            raise ValueError(f"unknown sequence-parallel backend {backend!r}; choose one of {', '.join(SP_BACKENDS)}")
        self.num_heads = num_heads
        self.backend = backend
        self.xfuser = None
        """The xfuser attention core (`xfuser_usp.XfuserUSP`) with backend "xfuser", else None."""
        if backend == "xfuser":
            from spotlight.parallel.xfuser_usp import XfuserUSP

            self.xfuser = XfuserUSP()
        self._group: dist.ProcessGroup | None = None
        self._degree = 1
        self._rank = 0

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The current group; None means degree 1 (no collectives)."""
        return self._group

    @property
    def degree(self) -> int:
        """Ranks in the current group (1 without a group)."""
        return self._degree

    @property
    def rank(self) -> int:
        """This process's rank inside the current group (0 without a group)."""
        return self._rank

    def set_group(self, group: dist.ProcessGroup | None) -> None:
        """Switch to `group` (a fresh `new_group` / `init_process_group` after a membership change), or None.

        Raises:
            ValueError: this process is not a member of `group`, or the model's heads are not
                divisible by the group's size.
        """
        if group is None:
            self._group, self._degree, self._rank = None, 1, 0
            if self.xfuser is not None:
                self.xfuser.bind(None)
            return
        if group == dist.GroupMember.NON_GROUP_MEMBER:
            raise ValueError("this process is not a member of the group given to SPContext.set_group")
        degree = dist.get_world_size(group)
        if self.num_heads is not None:
            check_heads(self.num_heads, degree)
        if self.xfuser is not None:
            try:
                self.xfuser.bind(group)  # a group it refuses leaves both as they were
            except BaseException:
                if self.xfuser.degree is None:  # it failed half-way and unbound: so is the context
                    self._group, self._degree, self._rank = None, 1, 0
                raise
        self._group, self._degree, self._rank = group, degree, dist.get_rank(group)


def check_heads(num_heads: int, degree: int) -> None:
    """Raise ValueError unless Ulysses can split `num_heads` heads over `degree` ranks."""
    if num_heads % degree:
        raise ValueError(
            f"Ulysses needs the attention heads divisible by the sequence-parallel degree: "
            f"{num_heads} heads, degree {degree}; choose a degree that divides {num_heads}"
        )


def local_image_freqs(freqs_LF: torch.Tensor, rank: int, local_len: int) -> torch.Tensor:
    """This rank's rows (S, F) of the image rotary frequencies (L, F), padded with the identity rotation.

    Args:
        freqs_LF: complex rotary frequencies of the whole image, F = E / 2.
        rank: rank in the group; its rows are [rank * S, rank * S + S).
        local_len: S, image tokens per rank.
    """
    start = rank * local_len
    rows = freqs_LF[start : start + local_len]
    missing = local_len - rows.shape[0]
    if missing:
        rows = torch.cat([rows, rows.new_ones(missing, freqs_LF.shape[1])])
    return rows


def joint_mask(
    text_mask_BT: torch.Tensor | None, batch: int, txt_len: int, padded_len: int, valid_len: int, device: torch.device
) -> torch.Tensor | None:
    """Boolean key mask (B, 1, 1, T + P) for [text, image] attention, or None when every key is valid.

    Text keys follow `text_mask_BT`; image keys past `valid_len` are padding.
    """
    if text_mask_BT is None and padded_len == valid_len:
        return None
    if text_mask_BT is None:
        text_mask_BT = torch.ones(batch, txt_len, dtype=torch.bool, device=device)
    image_keys_P = torch.arange(padded_len, device=device) < valid_len
    mask_BK = torch.cat([text_mask_BT.to(torch.bool), image_keys_P.expand(batch, padded_len)], dim=1)
    return mask_BK[:, None, None, :]


def seq_to_heads(x_3BSHE: torch.Tensor, group: dist.ProcessGroup, degree: int) -> torch.Tensor:
    """All-to-all: stacked q/k/v (3, B, S, H, E) sharded by sequence -> (3, B, P, h, E) sharded by heads."""
    three, batch, local_len, heads, head_dim = x_3BSHE.shape
    # Chunk j of dim 0 (heads j*h..j*h+h of our sequence slice) goes to rank j.
    send = x_3BSHE.reshape(three, batch, local_len, degree, heads // degree, head_dim).permute(3, 0, 1, 2, 4, 5)
    recv = torch.empty_like(send, memory_format=torch.contiguous_format)
    dist.all_to_all_single(recv, send.contiguous(), group=group)
    # recv[i] is rank i's sequence slice of our heads; slices in rank order form the padded sequence.
    return recv.permute(1, 2, 0, 3, 4, 5).reshape(three, batch, degree * local_len, heads // degree, head_dim)


def heads_to_seq(
    img_BPhE: torch.Tensor, txt_BThE: torch.Tensor, group: dist.ProcessGroup, degree: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse all-to-all: image (B, P, h, E) -> (B, S, H, E); text (B, T, h, E) -> (B, T, H, E) on every rank.

    The text rides along: every rank sends its text heads to every rank, which amounts to an
    all-gather over heads inside the same collective.
    """
    batch, padded_len, local_heads, head_dim = img_BPhE.shape
    txt_len = txt_BThE.shape[1]
    local_len = padded_len // degree
    img_nBShE = img_BPhE.reshape(batch, degree, local_len, local_heads, head_dim).transpose(0, 1)
    txt_nBThE = txt_BThE.unsqueeze(0).expand(degree, -1, -1, -1, -1)
    send = torch.cat([img_nBShE, txt_nBThE], dim=2).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    # recv[i] holds heads i*h..i*h+h: move that axis next to the heads and merge.
    out_BKHE = recv.permute(1, 2, 0, 3, 4).reshape(batch, local_len + txt_len, degree * local_heads, head_dim)
    return out_BKHE[:, :local_len], out_BKHE[:, local_len:]


class UlyssesAttnProcessor:
    """Drop-in for diffusers' `QwenDoubleStreamAttnProcessor2_0` that attends across an SP group.

    `hidden_states` is this rank's image slice (B, S, C) of a sequence padded to P = n * S;
    `encoder_hidden_states` is the whole text stream (B, T, C), the same on every rank;
    `image_rotary_emb` is Qwen-Image's (image (L, E/2), text (T, E/2)) complex frequencies for
    the whole image. Returns (image output (B, S, C), text output (B, T, C)) like the stock processor.
    """

    _attention_backend = None  # set by diffusers' `set_attention_backend`, as on the stock processor
    _parallel_config = None  # diffusers' own context parallelism is not used here

    def __init__(self, ctx: SPContext):
        self.ctx = ctx

    def __call__(
        self,
        attn: Attention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_hidden_states_mask: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if encoder_hidden_states is None or image_rotary_emb is None:
            raise ValueError(
                "UlyssesAttnProcessor needs encoder_hidden_states and image_rotary_emb (Qwen-Image blocks)"
            )
        if attention_mask is not None:
            raise ValueError("UlyssesAttnProcessor builds the joint mask from encoder_hidden_states_mask; pass that")
        degree, rank = self.ctx.degree, self.ctx.rank
        check_heads(attn.heads, degree)
        head_dim = attn.inner_dim // attn.heads
        batch, local_len = hidden_states.shape[:2]
        txt_len = encoder_hidden_states.shape[1]
        img_freqs_LF, txt_freqs_TF = image_rotary_emb
        valid_len = img_freqs_LF.shape[0]
        if -(-valid_len // degree) != local_len:
            raise ValueError(
                f"hidden_states holds {local_len} image tokens but a {valid_len}-token image at degree {degree} "
                f"needs {-(-valid_len // degree)} per rank: run the transformer through ulysses_forward"
            )

        # Projections, QK-norm and rotary embedding are per token: image on the local slice, text whole.
        img_q = _heads(attn.to_q(hidden_states), head_dim)
        img_k = _heads(attn.to_k(hidden_states), head_dim)
        img_v = _heads(attn.to_v(hidden_states), head_dim)
        txt_q = _heads(attn.add_q_proj(encoder_hidden_states), head_dim)
        txt_k = _heads(attn.add_k_proj(encoder_hidden_states), head_dim)
        txt_v = _heads(attn.add_v_proj(encoder_hidden_states), head_dim)
        if attn.norm_q is not None:
            img_q = attn.norm_q(img_q)
        if attn.norm_k is not None:
            img_k = attn.norm_k(img_k)
        if attn.norm_added_q is not None:
            txt_q = attn.norm_added_q(txt_q)
        if attn.norm_added_k is not None:
            txt_k = attn.norm_added_k(txt_k)
        img_freqs_SF = local_image_freqs(img_freqs_LF, rank, local_len)
        img_q = apply_rotary_emb_qwen(img_q, img_freqs_SF, use_real=False)
        img_k = apply_rotary_emb_qwen(img_k, img_freqs_SF, use_real=False)
        txt_q = apply_rotary_emb_qwen(txt_q, txt_freqs_TF, use_real=False)
        txt_k = apply_rotary_emb_qwen(txt_k, txt_freqs_TF, use_real=False)

        # Keys are [text, padded image]: the mask drops padded prompt tokens and the image padding.
        mask = joint_mask(
            encoder_hidden_states_mask, batch, txt_len, degree * local_len, valid_len, hidden_states.device
        )
        if self.ctx.xfuser is not None:
            txt_out, img_out = self.ctx.xfuser.attend(txt_q, txt_k, txt_v, img_q, img_k, img_v, mask, degree)
        else:
            txt_out, img_out = self._attend(txt_q, txt_k, txt_v, img_q, img_k, img_v, mask)

        img_out = attn.to_out[0](img_out.flatten(2, 3).contiguous())
        if len(attn.to_out) > 1:
            img_out = attn.to_out[1](img_out)  # dropout
        txt_out = attn.to_add_out(txt_out.flatten(2, 3).contiguous())
        return img_out, txt_out

    def _attend(
        self, txt_q, txt_k, txt_v, img_q, img_k, img_v, mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Our core: text (B, T, H, E) and image slice (B, S, H, E) q/k/v -> text and image outputs, same shapes."""
        degree, rank, group = self.ctx.degree, self.ctx.rank, self.ctx.group
        txt_len = txt_q.shape[1]
        if degree > 1:
            local_heads = txt_q.shape[2] // degree
            img_q, img_k, img_v = seq_to_heads(torch.stack([img_q, img_k, img_v]), group, degree).unbind(0)
            # Text is replicated: keep our heads, no communication.
            own = slice(rank * local_heads, (rank + 1) * local_heads)
            txt_q, txt_k, txt_v = txt_q[:, :, own], txt_k[:, :, own], txt_v[:, :, own]
        joint_q = torch.cat([txt_q, img_q], dim=1)
        out_BKhE = dispatch_attention_fn(
            joint_q,
            torch.cat([txt_k, img_k], dim=1),
            torch.cat([txt_v, img_v], dim=1),
            attn_mask=mask,
            dropout_p=0.0,
            is_causal=False,
            backend=self._attention_backend,
        ).to(joint_q.dtype)
        txt_out, img_out = out_BKhE[:, :txt_len], out_BKhE[:, txt_len:]
        if degree > 1:
            img_out, txt_out = heads_to_seq(img_out, txt_out, group, degree)
        return txt_out, img_out


def _heads(x_BSD: torch.Tensor, head_dim: int) -> torch.Tensor:
    return x_BSD.unflatten(-1, (-1, head_dim))


def install_ulysses(transformer, ctx: SPContext | None = None) -> SPContext:
    """Give every joint-attention block of a `QwenImageTransformer2DModel` a Ulysses processor.

    Args:
        transformer: the model; its processors are replaced in place.
        ctx: the context the processors will read; a new one (degree 1) when None.

    Returns:
        The context: call `set_group` on it to change the degree.
    """
    if transformer.config.zero_cond_t:
        raise ValueError("ulysses: zero_cond_t Qwen-Image models (per-token modulate_index) are not supported")
    ctx = ctx or SPContext()
    ctx.num_heads = transformer.config.num_attention_heads
    transformer.set_attn_processor(UlyssesAttnProcessor(ctx))
    return ctx


@torch.no_grad()
def ulysses_forward(
    transformer,
    ctx: SPContext,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    encoder_hidden_states_mask: torch.Tensor | None,
    timestep: torch.Tensor,
    img_shapes: Sequence,
) -> torch.Tensor:
    """One transformer forward, sequence-parallel over `ctx`'s group; every rank gets the whole output.

    Every rank of the group passes the same full inputs; each runs the stock forward on its slice
    of the (padded) image tokens and the output slices are all-gathered.

    Args:
        transformer: a `QwenImageTransformer2DModel` prepared with `install_ulysses(transformer, ctx)`.
        ctx: the sequence-parallel context (its current group is used).
        hidden_states: packed latents (B, L, C_in).
        encoder_hidden_states: prompt embeddings (B, T, D).
        encoder_hidden_states_mask: prompt mask (B, T), 1 for valid tokens, or None.
        timestep: sigma (B,), as the pipeline passes t / 1000.
        img_shapes: Qwen-Image's per-sample [(frames, h, w)] lists, for the whole image.

    Returns:
        Velocity (B, L, C_out), identical on every rank of the group.
    """
    processors = transformer.attn_processors.values()
    if not all(isinstance(p, UlyssesAttnProcessor) and p.ctx is ctx for p in processors):
        raise ValueError("ulysses_forward: call install_ulysses(transformer, ctx) first")
    degree, rank = ctx.degree, ctx.rank
    full_len = hidden_states.shape[1]
    local_len = -(-full_len // degree)
    padded_BPC = F.pad(hidden_states, (0, 0, 0, degree * local_len - full_len))
    out_BSC = transformer(
        hidden_states=padded_BPC[:, rank * local_len : (rank + 1) * local_len],
        encoder_hidden_states=encoder_hidden_states,
        encoder_hidden_states_mask=encoder_hidden_states_mask,
        timestep=timestep,
        img_shapes=img_shapes,
        return_dict=False,
    )[0]
    if degree == 1:
        return out_BSC
    slices = [torch.empty_like(out_BSC) for _ in range(degree)]
    dist.all_gather(slices, out_BSC.contiguous(), group=ctx.group)
    return torch.cat(slices, dim=1)[:, :full_len]
