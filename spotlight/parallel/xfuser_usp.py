"""`parallel.sp_backend=xfuser`: the attention core of our Ulysses processor through xDiT's USP.

xDiT (the `xfuser` package; Fang et al. 2024, "xDiT: an Inference Engine for Diffusion Transformers
with Massive Parallelism", arXiv:2411.01738) implements USP, the unified Ulysses + ring sequence
parallelism of Fang & Zhao 2024 ("USP: A Unified Sequence Parallelism Approach for Long Context
Generative AI", arXiv:2405.07719). What it has for Qwen-Image (read in xfuser 0.5.0 and 0.7.0):

- `models/transformers/transformer_qwen.py: xFuserQwenImageTransformerWrapper`, a subclass of
  diffusers' `QwenImageTransformer2DModel` that xDiT's own runner (`runner_models/qwen.py`, `xdit
  --model Qwen-Image`) loads in place of the stock class. It is not a drop-in here: it shards the
  text stream as well as the image (zero-padding both to a multiple of the degree), and its
  attention processor accepts the joint mask its forward builds but calls USP without it, so padded
  prompt tokens and the padding rows are attended to. Our prompts are padded to a fixed length
  (`model.max_text_tokens`), so its output is not the stock model's. It also takes its group from
  xfuser's process-wide state rather than from an argument.
- `model_executor/layers/usp.py: USP(...)`, the attention call itself: Ulysses all-to-all over
  xfuser's sequence-parallel group, optional ring, a registry of kernels (`backend`), and "joint"
  tensors that every rank holds whole (`joint_strategy="front"` puts them before the sequence),
  which is exactly our text-replicated, image-sharded split. A dense key mask reaches the kernel
  only through `attention_kwargs["attn_mask"]`, which only the SDPA and SDPA-math entries of its
  kernel registry (`core/distributed/attention_backend.py`) read; the SDPA-flash, memory-efficient
  and cuDNN entries (xfuser's defaults on NVIDIA GPUs without flash-attn 3/4) ignore it, and the
  flash-attn entries take packed key indices (`indices_k`) instead. `usp.attention(...)` is the
  same registry without parallelism.

So this backend keeps everything of `ulysses.UlyssesAttnProcessor` (projections, QK-norm, rotary
embedding, padding of the image to a multiple of the degree, the key mask) and replaces only the
all-to-all pair and the kernel with `USP(image q/k/v, joint text q/k/v, joint_strategy="front",
backend=SDPA, attn_mask=...)`; at degree 1 without a process group, `usp.attention` with the same
kernel. The differences that remain against ours: xfuser's all-to-all carries the text queries with
the image ones (each head owner computes the text rows `degree` times, ours once), and it runs on
xfuser's own process groups, which `bind` builds over the whole torch.distributed world from
xfuser's global state at every group change (a spot group is always a whole world: spot/worker.py).

The import is lazy: xfuser imports triton at import time (absent from CPU builds of torch), so this
module touches it only when a context asks for the backend.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
from types import SimpleNamespace

import torch
import torch.distributed as dist
from packaging.version import Version

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'spotlight-rl[gpu]' (in a checkout: pip install -e '.[gpu]')"
MIN_XFUSER = "0.5.0"
"""USP's `backend` and `attention_kwargs` arguments (the key mask) appeared in xfuser 0.5.0."""


def load_xfuser() -> SimpleNamespace:
    """xfuser's entry points this backend uses; ImportError naming `parallel.sp_backend` and the install.

    Returns a namespace with `version`, `usp` (the module with `USP` and `attention`), `sdpa` (the
    SDPA kernel's `AttentionBackendType`), `parallel_state`, `runtime_state` and `xFuserArgs`.
    """
    field = "parallel.sp_backend=xfuser"
    try:
        version = importlib.metadata.version("xfuser")
    except importlib.metadata.PackageNotFoundError:
        raise ImportError(f"{field} needs xfuser (xDiT), which is not installed: {INSTALL_HINT}") from None
    if Version(version) < Version(MIN_XFUSER):
        raise ImportError(
            f"{field} needs xfuser >= {MIN_XFUSER} (USP with a key mask); found {version}: {INSTALL_HINT}"
        )
    try:
        usp = importlib.import_module("xfuser.model_executor.layers.usp")
        backends = importlib.import_module("xfuser.core.distributed.attention_backend")
        parallel_state = importlib.import_module("xfuser.core.distributed.parallel_state")
        runtime_state = importlib.import_module("xfuser.core.distributed.runtime_state")
        config = importlib.import_module("xfuser.config")
    except Exception as err:
        raise ImportError(
            f"{field}: importing xfuser {version} failed ({type(err).__name__}: {err}); it needs a CUDA build of "
            f"torch (with triton) and its own dependencies: {INSTALL_HINT}"
        ) from err
    return SimpleNamespace(
        version=version,
        usp=usp,
        sdpa=backends.AttentionBackendType.SDPA,
        parallel_state=parallel_state,
        runtime_state=runtime_state,
        xFuserArgs=config.xFuserArgs,
    )


class XfuserUSP:
    """The attention core of `UlyssesAttnProcessor` through xfuser, bound to one group at a time.

    `SPContext(backend="xfuser")` makes one and calls `bind` from `set_group`. Unbound (degree 1, no
    process group) it runs `usp.attention`; bound, `USP` over xfuser's groups built on that world.
    """

    def __init__(self):
        self.x = load_xfuser()
        self.degree: int | None = None
        """Degree of the world xfuser's state describes now; None: unbound."""

    # -- groups --------------------------------------------------------------------------------

    def bind(self, group: dist.ProcessGroup | None) -> None:
        """Describe `group` (a whole torch.distributed world) in xfuser's process-wide state; None unbinds.

        xfuser lays its groups out over the ranks of the default world, so `group` must span all of
        it. Every member must call this together (xfuser creates process groups).
        """
        if group is None:
            self.release()
            return
        degree, world = dist.get_world_size(group), dist.get_world_size()
        if degree != world:  # refused before anything changes: the current binding stays
            raise ValueError(
                f"parallel.sp_backend=xfuser: xfuser's sequence-parallel group is the whole torch.distributed world "
                f"(its state is per process), but this group has {degree} of the world's {world} ranks; the spot "
                "runtime's groups are whole worlds, and parallel.sp_backend=ours takes any group"
            )
        self.release()
        try:
            self._setup(degree, dist.get_backend(group))
        except BaseException:
            self._teardown()  # whatever xfuser made before it failed, so that the next bind starts clean
            raise
        self.degree = degree

    def _setup(self, degree: int, backend: str) -> None:
        ps = self.x.parallel_state
        local = torch.cuda.current_device() if torch.cuda.is_available() else 0
        ps.init_distributed_environment(world_size=degree, rank=dist.get_rank(), local_rank=local, backend=backend)
        ps.initialize_model_parallel(sequence_parallel_degree=degree, ulysses_degree=degree, backend=backend)
        if ps.get_ulysses_parallel_world_size() != degree:
            raise RuntimeError(
                f"parallel.sp_backend=xfuser: xfuser set up a Ulysses group of {ps.get_ulysses_parallel_world_size()} "
                f"rank(s) for degree {degree} (its long-context groups need yunchang and a GPU)"
            )
        # USP reads a few run-time switches from xfuser's runtime state. Its public constructor for use
        # outside xDiT's pipelines (ExternalRuntimeState) assumes degree 1, so build one for this degree.
        config, _ = self.x.xFuserArgs(ulysses_degree=degree, attention_backend="SDPA").create_config()
        rs = self.x.runtime_state

        class _State(rs.ExternalRuntimeState):
            def __init__(self, engine_config):
                rs.RuntimeState.__init__(self, engine_config)  # ExternalRuntimeState skips the env check

        rs._RUNTIME = _State(config)

    def release(self) -> None:
        """Drop xfuser's groups and runtime state (our world stays; a no-op when unbound)."""
        if self.degree is not None:
            self.degree = None
            self._teardown()

    def _teardown(self) -> None:
        ps = self.x.parallel_state
        try:
            ps.destroy_model_parallel()
            world, ps._WORLD = ps._WORLD, None  # xfuser's copy of the world: its own groups, not the default one
            if world is not None:
                world.destroy()
        except Exception as err:
            logger.warning("releasing xfuser's process groups: %s", err)
            for name in ("_MODEL_REPLICA", "_DP", "_CFG", "_SP", "_TP", "_PP", "_FS", "_VAE", "_WORLD"):
                if hasattr(ps, name):
                    setattr(ps, name, None)  # what initialize_model_parallel asserts to be unset
        self.x.runtime_state._RUNTIME = None

    # -- attention -----------------------------------------------------------------------------

    def attend(
        self, txt_q, txt_k, txt_v, img_q, img_k, img_v, mask: torch.Tensor | None, degree: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Text (B, T, H, E) and image slice (B, S, H, E) q/k/v -> (text, image) outputs of the same shapes.

        `mask` is the (B, 1, 1, T + P) boolean key mask over [text, padded image] (or None); `degree`
        the caller's (`SPContext.degree`), which must be the bound one.
        """
        if degree != (self.degree or 1):
            raise RuntimeError(f"xfuser is bound to degree {self.degree or 1} but the context runs degree {degree}")
        txt_len = txt_q.shape[1]
        kwargs = {"attn_mask": mask} if mask is not None else None
        heads = lambda t: t.transpose(1, 2)  # noqa: E731 - xfuser takes (B, H, S, E)
        if self.degree is None:
            out_BHKE = self.x.usp.attention(
                heads(torch.cat([txt_q, img_q], dim=1)),
                heads(torch.cat([txt_k, img_k], dim=1)),
                heads(torch.cat([txt_v, img_v], dim=1)),
                backend=self.x.sdpa,
                attention_kwargs=kwargs,
            )
        else:
            out_BHKE = self.x.usp.USP(
                heads(img_q),
                heads(img_k),
                heads(img_v),
                joint_query=heads(txt_q),
                joint_key=heads(txt_k),
                joint_value=heads(txt_v),
                joint_strategy="front",
                backend=self.x.sdpa,
                attention_kwargs=kwargs,
            )
        out = heads(out_BHKE).to(txt_q.dtype)
        return out[:, :txt_len], out[:, txt_len:]
