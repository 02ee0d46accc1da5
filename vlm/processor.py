"""Image-only variants of the Qwen-VL processors, and loading one from a model folder.

transformers 5.24 type-checks every sub-processor of `Qwen2_5_VLProcessor` and
`Qwen3VLProcessor` at construction, the video processor included even when it is None, and that
check needs torchvision. torchvision has no build for the CPU torch of our machines, and the VLM
path feeds images only, so these subclasses declare just (image_processor, tokenizer). Everything
else (chat template, image token expansion, `image_grid_thw`, the multimodal token type ids,
saving and `from_pretrained`) is the real processor's code. They load a real checkpoint's folder
too: its video processor config is simply not read.
"""

from __future__ import annotations

from pathlib import Path

from transformers import Qwen2_5_VLProcessor, Qwen3VLProcessor


class Qwen2_5_VLImageProcessor(Qwen2_5_VLProcessor):
    """`Qwen2_5_VLProcessor` without its video processor (needs no torchvision)."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        # The parent passes video_processor=None positionally; ProcessorMixin pairs positional
        # arguments with the attributes named in *this* signature, so the None is dropped.
        super().__init__(
            image_processor=image_processor,
            tokenizer=tokenizer,
            video_processor=None,
            chat_template=chat_template,
            **kwargs,
        )


class Qwen3VLImageProcessor(Qwen3VLProcessor):
    """`Qwen3VLProcessor` without its video processor (needs no torchvision)."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(
            image_processor=image_processor,
            tokenizer=tokenizer,
            video_processor=None,
            chat_template=chat_template,
            **kwargs,
        )


PROCESSORS = {"qwen2_5_vl": Qwen2_5_VLImageProcessor, "qwen3_vl": Qwen3VLImageProcessor}
"""Processor class by the `model_type` of a model folder's config.json."""


def load_processor(path: str | Path, model_type: str, *, field: str = "model.path"):
    """Load the image-only processor of a model folder with `from_pretrained`.

    Args:
        path: the model folder (tokenizer, image processor config, chat template).
        model_type: the folder's `config.json` model_type ("qwen2_5_vl" or "qwen3_vl").
        field: the config entry that named the folder, for error messages.
    """
    if model_type not in PROCESSORS:
        raise ValueError(
            f"{field}: model_type {model_type!r} in {path} is not supported; use one of {sorted(PROCESSORS)}"
        )
    processor = PROCESSORS[model_type].from_pretrained(path)
    if processor.chat_template is None:
        raise ValueError(f"{field}: {path} has no chat template (chat_template.jinja or processor config)")
    return processor
