"""CLIP-style text-image agreement, a model-based reward (CLIPScore, Hessel et al. 2021).

Shape legend: B batch, D embedding dimension.

score = cosine similarity of the CLIP image embedding and the CLIP text embedding of the prompt,
in [-1, 1]. CLIPScore and PickScore (Kirstain et al. 2023, a fine-tuned CLIP-H, loadable here as
it is a `CLIPModel`) publish this cosine times the model's logit scale (about 100) or a constant
2.5; we leave the scale out, since GRPO normalises rewards within each group and a constant
factor changes nothing but the weight to give it in `build_reward`.

Weights load only from a local directory (`reward.clip_model_path`): training machines may have
no network, and a silent download of gigabytes on every worker is worse than a clear error.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from spotlight.rewards import register_reward


@register_reward("clip_score")
def make_clip_score(
    clip_model_path: str = "", clip_processor_path: str = "", clip_device: str = ""
):
    """Cosine similarity of CLIP image and prompt embeddings.

    Args:
        clip_model_path: local directory of a `CLIPModel` saved with `save_pretrained`.
        clip_processor_path: local directory of its tokenizer and image processor; empty means
            `clip_model_path`. (PickScore ships its weights without them: point this at the
            processor of the CLIP-H it was fine-tuned from.)
        clip_device: where the model runs; empty means cuda when available, else cpu.
    """
    # Imported here: transformers takes seconds to import, and most runs use no CLIP reward.
    from transformers import AutoImageProcessor, AutoTokenizer, CLIPModel

    for option, path in (
        ("reward.clip_model_path", clip_model_path),
        ("reward.clip_processor_path", clip_processor_path or clip_model_path),
    ):
        if not path or not Path(path).is_dir():
            raise ValueError(
                f"{option} is {path!r}, which is not a local directory; set it to a directory "
                "holding a CLIP checkpoint saved with save_pretrained (no hub download is tried)"
            )
    processor_path = clip_processor_path or clip_model_path
    device = torch.device(clip_device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = CLIPModel.from_pretrained(clip_model_path, local_files_only=True).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(processor_path, local_files_only=True)
    image_processor = AutoImageProcessor.from_pretrained(processor_path, local_files_only=True)
    max_length = model.config.text_config.max_position_embeddings

    @torch.inference_mode()
    def clip_score(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        # The processors were fit on 8-bit images; quantise as saving the image would.
        images_BHW3 = (images.float().clamp(0, 1) * 255).round().to(torch.uint8)
        pixel_values = image_processor(
            images=list(images_BHW3.permute(0, 2, 3, 1).cpu().numpy()), return_tensors="pt"
        )["pixel_values"]
        text = tokenizer(
            prompts, padding=True, truncation=True, max_length=max_length, return_tensors="pt"
        )
        out = model(
            input_ids=text["input_ids"].to(device),
            attention_mask=text["attention_mask"].to(device),
            pixel_values=pixel_values.to(device),
        )
        image_BD = F.normalize(out.image_embeds.float(), dim=-1)
        text_BD = F.normalize(out.text_embeds.float(), dim=-1)
        return (image_BD * text_BD).sum(-1).cpu()

    return clip_score
