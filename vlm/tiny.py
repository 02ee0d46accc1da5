"""Tiny VLM folders built from config: the CPU default and the tests' models.

The folder is what `save_pretrained` writes for a real checkpoint: the model
(`Qwen2_5_VLForConditionalGeneration` or `Qwen3VLForConditionalGeneration`, random weights) and
its real processor (`Qwen2_5_VLProcessor` / `Qwen3VLProcessor` with a Qwen2-VL image processor,
a chat template and a tokenizer). Nothing can be downloaded here, so the tokenizer is a word-level
one trained with `tokenizers` on the task's text; it is saved and loaded back through
`from_pretrained` like any other, so the tiny and the real models take the same code path.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch

from vlm.config import TinyVLMConfig
from vlm.processor import PROCESSORS, load_processor

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

# ChatML with Qwen-VL's vision markers; the processor expands <|image_pad|> to one token per
# merged vision patch. Written here for the tiny tokenizer (real checkpoints ship their own).
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
ROLE_WORDS = "system user assistant"


def build_processor(folder: str | Path, corpus: list[str], *, family: str = "qwen2_5_vl", image_px: int = 84) -> Path:
    """Train a word-level tokenizer on `corpus` and save it with an image processor and chat template.

    Args:
        folder: where to save (created).
        corpus: the task's text; every word the model may read or write.
        family: "qwen2_5_vl" or "qwen3_vl" (selects the processor class).
        image_px: side of the task's square images; the image processor keeps that size.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    # Special tokens are matched first; then words and single punctuation marks are tokens.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Split(Regex(r"\w+|[^\w\s]"), behavior="isolated")]
    )
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins tokens with single spaces
    trainer = trainers.WordLevelTrainer(special_tokens=SPECIAL_TOKENS, min_frequency=1)
    tok.train_from_iterator([ROLE_WORDS, *corpus], trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        pad_token="<|endoftext|>",
        eos_token="<|im_end|>",
        additional_special_tokens=SPECIAL_TOKENS[1:7],
    )
    # One LM token per merged block of 2x2 patches: 28 pixels for Qwen2.5-VL (patch 14), 32 for
    # Qwen3-VL (patch 16). The pixel bounds keep the task's images at (about) their size.
    patch = 16 if family == "qwen3_vl" else 14
    block = 2 * patch
    side = max(block, round(image_px / block) * block)
    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=block * block, max_pixels=side * side, patch_size=patch, temporal_patch_size=2, merge_size=2
    )
    cls = PROCESSORS[family]
    processor = cls(image_processor=image_processor, tokenizer=tokenizer, chat_template=CHAT_TEMPLATE)
    folder = Path(folder)
    processor.save_pretrained(folder)
    return folder


def _special_ids(tokenizer) -> dict[str, int]:
    return {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}


def build_model(spec: TinyVLMConfig, tokenizer) -> torch.nn.Module:
    """A randomly initialised tiny VLM of `spec.family` whose vocabulary is `tokenizer`'s."""
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen3VLConfig,
        Qwen3VLForConditionalGeneration,
    )

    ids = _special_ids(tokenizer)
    head_dim = spec.text_hidden // spec.text_heads
    # Multimodal rope splits head_dim / 2 frequencies over (time, height, width), ~ 1 : 1.5 : 1.5.
    hw = head_dim // 2 * 3 // 8
    mrope = [head_dim // 2 - 2 * hw, hw, hw]
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=spec.text_hidden,
        intermediate_size=2 * spec.text_hidden,
        num_hidden_layers=spec.text_layers,
        num_attention_heads=spec.text_heads,
        num_key_value_heads=spec.text_heads,
        head_dim=head_dim,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": mrope},
        bos_token_id=ids["<|im_start|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        tie_word_embeddings=True,
    )
    tokens = dict(
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    torch.manual_seed(spec.seed)
    if spec.family == "qwen3_vl":
        text["rope_parameters"]["mrope_interleaved"] = True
        vision = dict(
            depth=spec.vision_depth,
            hidden_size=spec.vision_hidden,
            intermediate_size=2 * spec.vision_hidden,
            num_heads=spec.vision_heads,
            out_hidden_size=spec.text_hidden,
            patch_size=16,
            spatial_merge_size=2,
            temporal_patch_size=2,
            num_position_embeddings=64,
            deepstack_visual_indexes=[0],
        )
        cfg = Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **tokens)
        return Qwen3VLForConditionalGeneration(cfg)
    vision = dict(
        depth=spec.vision_depth,
        hidden_size=spec.vision_hidden,
        intermediate_size=2 * spec.vision_hidden,
        num_heads=spec.vision_heads,
        out_hidden_size=spec.text_hidden,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=112,
        fullatt_block_indexes=list(range(spec.vision_depth)),
    )
    cfg = Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **tokens)
    return Qwen2_5_VLForConditionalGeneration(cfg)


def build_tiny_vlm(folder: str | Path, spec: TinyVLMConfig, corpus: list[str], *, image_px: int = 84) -> Path:
    """Write a tiny VLM folder (random model + processor) and return its path.

    The folder is assembled in a temporary sibling and renamed into place, so a concurrent reader
    (another test, another run using it as a cache) never sees half of it.
    """
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        build_processor(tmp, corpus, family=spec.family, image_px=image_px)
        processor = load_processor(tmp, spec.family)
        build_model(spec, processor.tokenizer).save_pretrained(tmp)
        if folder.exists():
            shutil.rmtree(folder)
        tmp.rename(folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder
