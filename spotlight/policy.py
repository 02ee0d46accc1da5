"""The DiT policy: Qwen-Image's transformer, prompt encoder and latent codec, loaded from one folder.

Shape legend: B batch, T text tokens, D text hidden size, L image tokens, C packed channels.

A model folder is laid out like a diffusers Qwen-Image checkpoint: `transformer/`,
`text_encoder/` (Qwen2.5-VL), `tokenizer/`, and `vae/`; a tiny folder carries
`latent_codec.json` in place of `vae/` (see `latents.py`). The real model and the tiny CPU
default therefore go through the same `from_pretrained` calls and the same forward.
"""

from __future__ import annotations

from pathlib import Path

import torch

from spotlight.core.seeds import seeded_init
from spotlight.latents import load_codec, pack_latents, unpack_latents
from spotlight.prompt_cache import PromptCache

# Qwen-Image's prompt template (QwenImagePipeline.prompt_template_encode). The hidden states of the
# template's system prefix are dropped; the pipeline hard-codes 34 tokens for Qwen's tokenizer, we
# count the prefix with the folder's own tokenizer so tiny tokenizers work too.
PROMPT_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
    "<|im_start|>assistant\n"
)

# Flow-GRPO's LoRA targets for Qwen-Image: attention projections of both streams and the MLPs.
LORA_TARGETS = [
    "to_q",
    "to_k",
    "to_v",
    "to_out.0",
    "add_q_proj",
    "add_k_proj",
    "add_v_proj",
    "to_add_out",
    "img_mlp.net.0.proj",
    "img_mlp.net.2",
    "txt_mlp.net.0.proj",
    "txt_mlp.net.2",
]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class DiTPolicy:
    """Transformer + frozen prompt encoder + codec, with the calls the sampler and trainer need."""

    def __init__(self, transformer, text_encoder, tokenizer, codec, *, height: int, width: int, max_text_tokens: int):
        self.transformer = transformer
        self.text_encoder = text_encoder
        self.tokenizer = tokenizer
        self.codec = codec
        self.height = height
        self.width = width
        self.max_text_tokens = max_text_tokens
        down = codec.downsample
        if height % (2 * down) or width % (2 * down):
            raise ValueError(f"model.height/width ({height}x{width}) must be multiples of {2 * down} for this model")
        self.latent_h, self.latent_w = height // down, width // down
        self._drop_idx = len(tokenizer(PROMPT_TEMPLATE.split("{}")[0]).input_ids)
        self.prompt_cache = PromptCache(self._encode_uncached, self._encoder_fingerprint, self._encoder_device)
        """Prompt embeddings of the current training step (`prompt_cache.py`); the driver opens and
        closes the step and has the next step's prompts prefetched. `benchmarks/dit_prompt_prefix.py`
        swaps in `UncachedPrompts`."""

    @classmethod
    def load(
        cls,
        model_path: str | Path,
        *,
        height: int,
        width: int,
        max_text_tokens: int = 0,
        dtype: str = "float32",
        device: str = "cpu",
        field: str = "model.path",
    ) -> DiTPolicy:
        """Load a Qwen-Image model folder (`field` names the config entry in error messages)."""
        from diffusers import QwenImageTransformer2DModel
        from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

        path = Path(model_path).expanduser()
        if not path.is_dir():
            raise ValueError(f"{field}: model folder {str(path)!r} does not exist")
        for sub in ("transformer", "text_encoder", "tokenizer"):
            if not (path / sub).is_dir():
                raise ValueError(f"{field}: {str(path / sub)!r} is missing; expected a diffusers Qwen-Image folder")
        torch_dtype = DTYPES[dtype]
        transformer = QwenImageTransformer2DModel.from_pretrained(path / "transformer", torch_dtype=torch_dtype)
        text_encoder = Qwen2_5_VLForConditionalGeneration.from_pretrained(
            path / "text_encoder", torch_dtype=torch_dtype
        )
        text_encoder.requires_grad_(False)
        tokenizer = AutoTokenizer.from_pretrained(path / "tokenizer")
        codec = load_codec(path, torch_dtype, device)
        return cls(
            transformer.to(device),
            text_encoder.to(device).eval(),
            tokenizer,
            codec,
            height=height,
            width=width,
            max_text_tokens=max_text_tokens,
        )

    @property
    def device(self) -> torch.device:
        return next(self.transformer.parameters()).device

    @property
    def latent_shape(self) -> tuple[int, int]:
        """(L, C) of one packed latent."""
        return (self.latent_h // 2) * (self.latent_w // 2), self.codec.latent_channels * 4

    # -- prompts -------------------------------------------------------------------------------

    @torch.no_grad()
    def _encode_uncached(self, prompts: list[str]) -> list[torch.Tensor]:
        """Per prompt (T_i, D) hidden states, as QwenImagePipeline._get_qwen_prompt_embeds; one encoder call."""
        texts = [PROMPT_TEMPLATE.format(p) for p in prompts]
        tokens = self.tokenizer(texts, padding=True, return_tensors="pt").to(self.device)
        out = self.text_encoder(
            input_ids=tokens.input_ids, attention_mask=tokens.attention_mask, output_hidden_states=True
        )
        hidden_BTD = out.hidden_states[-1]
        lengths = tokens.attention_mask.sum(dim=1).tolist()
        # Right padding: the valid tokens of each row come first. A copy per prompt, so that a held
        # embedding does not keep the whole batch's hidden states alive.
        return [hidden_BTD[i, self._drop_idx : n].to("cpu", torch.float32, copy=True) for i, n in enumerate(lengths)]

    def _encoder_device(self) -> torch.device:
        return next(self.text_encoder.parameters()).device

    def _encoder_fingerprint(self) -> tuple:
        """Changes whenever the text encoder's weights do (replaced, trained, or loaded in place)."""
        return id(self.text_encoder), tuple((id(p), p._version) for p in self.text_encoder.parameters())

    def encode_prompts(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompt embeddings (B, T, D) and mask (B, T), through `prompt_cache`.

        Inside a training step each distinct prompt is encoded once and shared by its samples and
        every phase; outside one, once per call. T is `max_text_tokens` when set (fixed padding
        keeps a sample's computation independent of the other prompts in its batch), else the
        longest prompt in the batch (the pipeline's way).
        """
        embs = self.prompt_cache.lookup(prompts)
        longest = max(e.shape[0] for e in embs)
        length = self.max_text_tokens or longest
        if longest > length:
            raise ValueError(f"a prompt has {longest} tokens, more than model.max_text_tokens={length}; raise it")
        dim = embs[0].shape[1]
        embeds = torch.zeros(len(embs), length, dim)
        mask = torch.zeros(len(embs), length, dtype=torch.long)
        for i, e in enumerate(embs):
            embeds[i, : e.shape[0]] = e
            mask[i, : e.shape[0]] = 1
        dtype = next(self.transformer.parameters()).dtype
        return embeds.to(self.device, dtype), mask.to(self.device)

    # -- transformer -----------------------------------------------------------------------------

    def velocity(
        self, latents_BLC: torch.Tensor, sigma_B: torch.Tensor, embeds: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """Predicted velocity (B, L, C); timestep is sigma in [0, 1], as the pipeline passes t / 1000."""
        dtype = embeds.dtype
        batch = latents_BLC.shape[0]
        out = self.transformer(
            hidden_states=latents_BLC.to(dtype),
            encoder_hidden_states=embeds,
            encoder_hidden_states_mask=mask,
            # Trajectories keep their schedule on the CPU (it is tiny); the timestep follows the latents.
            timestep=sigma_B.to(latents_BLC.device, dtype),
            img_shapes=[[(1, self.latent_h // 2, self.latent_w // 2)]] * batch,
            return_dict=False,
        )[0]
        return out

    # -- latents <-> images ----------------------------------------------------------------------

    def decode(self, latents_BLC: torch.Tensor) -> torch.Tensor:
        """Images (B, 3, H, W) in [0, 1] from packed latents."""
        with torch.no_grad():
            return self.codec.decode(unpack_latents(latents_BLC, self.latent_h, self.latent_w)).float().cpu()

    def encode_images(self, images_B3HW: torch.Tensor) -> torch.Tensor:
        """Packed latents (B, L, C) of images in [0, 1] (pretraining)."""
        with torch.no_grad():
            return pack_latents(self.codec.encode(images_B3HW.to(self.device)).float())

    # -- LoRA ------------------------------------------------------------------------------------

    def add_lora(self, rank: int, alpha: float) -> None:
        """Attach a peft LoRA adapter (trainable) and freeze the base weights."""
        from peft import LoraConfig

        self.transformer.requires_grad_(False)
        self.transformer.add_adapter(
            LoraConfig(r=rank, lora_alpha=alpha, init_lora_weights="gaussian", target_modules=LORA_TARGETS)
        )

    @property
    def has_lora(self) -> bool:
        return bool(getattr(self.transformer, "peft_config", None))


def quiet_model_libraries() -> None:
    """diffusers' and transformers' progress bars and warnings off: model loading prints a bar per
    folder, and our own progress is enough (the CLI and the runtime's workers call this)."""
    import diffusers
    import transformers

    diffusers.utils.logging.disable_progress_bar()
    diffusers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()


def default_model_path() -> Path:
    """The tiny shapes base model shipped inside the package (`spotlight pretrain` rebuilds it)."""
    return Path(__file__).parent / "assets" / "tiny-shapes-base"


def load_policy(model_cfg, *, trainable: bool = True, seed: int | None = None) -> DiTPolicy:
    """The policy a `ModelConfig` describes: folder, size, dtype, device, LoRA or full weights.

    `seed` (the run's `train.seed`) seeds a LoRA adapter's initial weights (`seeded_init`).
    """
    path = model_cfg.path or default_model_path()
    policy = DiTPolicy.load(
        path,
        height=model_cfg.height,
        width=model_cfg.width,
        max_text_tokens=model_cfg.max_text_tokens,
        dtype=model_cfg.dtype,
        device=model_cfg.device,
    )
    if model_cfg.lora_rank:
        with seeded_init(seed, model_cfg.device):
            policy.add_lora(model_cfg.lora_rank, model_cfg.lora_alpha or model_cfg.lora_rank)
    if model_cfg.gradient_checkpointing:
        policy.transformer.enable_gradient_checkpointing()
    if not trainable:
        policy.transformer.requires_grad_(False)
    return policy


def trainable_state(policy: DiTPolicy) -> dict[str, torch.Tensor]:
    """The weights post-training changes: the LoRA adapter, or the whole transformer. Live tensors, as
    the VLM's `vlm.policy.trainable_state`: clone them to keep a snapshot."""
    if policy.has_lora:
        from peft.utils import get_peft_model_state_dict

        return get_peft_model_state_dict(policy.transformer)
    return policy.transformer.state_dict()


def load_trainable_state(policy: DiTPolicy, state: dict[str, torch.Tensor]) -> None:
    """Load weights saved by `trainable_state` (strict: every key must match)."""
    if policy.has_lora:
        from peft.utils import set_peft_model_state_dict

        result = set_peft_model_state_dict(policy.transformer, state)
        unexpected = result.unexpected_keys  # peft loads with strict=False; we want strict
        if unexpected:
            raise ValueError(f"LoRA state has keys this model lacks (different lora_rank or model?): {unexpected[:3]}")
        return
    policy.transformer.load_state_dict(state)
