"""Tiny Qwen-Image model folders built from config: the CPU default and the tests' models.

The folder has the layout of a real diffusers Qwen-Image checkpoint (see `policy.py`), built from
the same classes: `QwenImageTransformer2DModel`, a `Qwen2_5_VLForConditionalGeneration` prompt
encoder (random and frozen: the transformer learns to read its features), and a word-level
tokenizer trained here with `tokenizers` (nothing can be downloaded) and saved so that it loads
through `AutoTokenizer.from_pretrained`.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from spotlight.config import TinyModelConfig
from spotlight.latents import PixelShuffleCodec
from spotlight.policy import PROMPT_TEMPLATE

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "[UNK]",
]


def _rope_axes(head_dim: int) -> tuple[int, int, int]:
    # Qwen-Image's 3-axis rope (frame, height, width) must sum to the head dim; each axis even.
    frame = max(2, (head_dim // 4) // 2 * 2)
    rest = head_dim - frame
    h = rest // 2 // 2 * 2
    return frame, h, rest - h


def train_tokenizer(corpus: list[str], folder: Path) -> None:
    """Train a word-level tokenizer on `corpus` (plus the prompt template) and save it to `folder`."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    # Special tokens are matched first; then words and single punctuation marks are tokens.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Split(Regex(r"\w+|[^\w\s]"), behavior="isolated")]
    )
    trainer = trainers.WordLevelTrainer(special_tokens=SPECIAL_TOKENS, min_frequency=1)
    template_words = re.sub(r"<\|\w+\|>", " ", PROMPT_TEMPLATE.replace("{}", " "))
    tok.train_from_iterator([template_words, *corpus], trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        pad_token="<|endoftext|>",
        eos_token="<|im_end|>",
        additional_special_tokens=SPECIAL_TOKENS[1:7],
    )
    fast.padding_side = "right"
    fast.save_pretrained(folder)


def build_tiny_model(folder: str | Path, spec: TinyModelConfig, corpus: list[str]) -> Path:
    """Write a tiny Qwen-Image model folder (random weights) and return its path."""
    from diffusers import QwenImageTransformer2DModel
    from transformers import AutoTokenizer, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    folder = Path(folder)
    train_tokenizer(corpus, folder / "tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(folder / "tokenizer")
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}

    torch.manual_seed(spec.seed)
    head_dim_text = 16
    text_cfg = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer),
            hidden_size=spec.text_hidden,
            intermediate_size=2 * spec.text_hidden,
            num_hidden_layers=2,
            num_attention_heads=spec.text_hidden // head_dim_text,
            num_key_value_heads=spec.text_hidden // head_dim_text,
            max_position_embeddings=512,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
            bos_token_id=ids["<|im_start|>"],
            eos_token_id=ids["<|im_end|>"],
            pad_token_id=ids["<|endoftext|>"],
        ),
        vision_config=dict(
            depth=1,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=spec.text_hidden,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            fullatt_block_indexes=[0],
        ),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    Qwen2_5_VLForConditionalGeneration(text_cfg).save_pretrained(folder / "text_encoder")

    codec = PixelShuffleCodec(spec.codec_factor)
    codec.save(folder)
    transformer = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=codec.latent_channels * 4,
        out_channels=codec.latent_channels,
        num_layers=spec.num_layers,
        attention_head_dim=spec.head_dim,
        num_attention_heads=spec.num_heads,
        joint_attention_dim=spec.text_hidden,
        axes_dims_rope=_rope_axes(spec.head_dim),
    )
    transformer.save_pretrained(folder / "transformer")
    return folder
