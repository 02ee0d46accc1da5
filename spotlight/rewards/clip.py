"""CLIP-style text-image agreement: CLIPScore and PickScore, model-based rewards.

Shape legend: B batch, D embedding dimension.

Both embed the image and the prompt with a `CLIPModel` and compare the normalised embeddings:

- `clip_score`: the cosine similarity, in [-1, 1]. CLIPScore (Hessel et al. 2021) publishes
  2.5 * max(cosine, 0) of an OpenAI CLIP; we leave out the constant and the floor, since GRPO
  normalises rewards within each group and a constant factor changes nothing but the weight to
  give it in `build_reward`.
- `pickscore`: PickScore (Kirstain et al. 2023), a CLIP-H fine-tuned on human preferences of
  generated images, scores logit_scale * cosine, with the model's learnt temperature
  `exp(model.logit_scale)` (100 for PickScore_v1), so in [-logit_scale, logit_scale]: the number the
  PickScore and Flow-GRPO papers report. With `pickscore_normalize` the score is mapped to [0, 1]
  by the affine map s -> (s / logit_scale + 1) / 2 (that is, (cosine + 1) / 2); Flow-GRPO instead
  trains on s / 26, which is not bounded, so to compare with its reward curves divide the
  unnormalised score by 26.

Weights load only from local directories (`reward.clip_model_path`, `reward.clip_processor_path`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from spotlight.rewards.local_models import batch_slices, pick_device, require_local_dir, to_uint8_images
from spotlight.rewards.registry import register_reward

DOWNLOADS = {
    "clip_score": "a CLIP checkpoint with its processor, e.g. the Hugging Face repo openai/clip-vit-large-patch14",
    "pickscore": (
        "PickScore's weights, the Hugging Face repo yuvalkirstain/PickScore_v1, and its processor, the repo "
        "laion/CLIP-ViT-H-14-laion2B-s32B-b79K (set reward.clip_processor_path to that one)"
    ),
}


class ClipScorer:
    """A `CLIPModel` with its tokenizer and image processor, from local folders.

    Args:
        reward: the reward name, for error messages.
        model_path: folder of the `CLIPModel` (`save_pretrained` layout).
        processor_path: folder of its tokenizer and image processor; empty means model_path.
        device: where the model runs; empty means cuda when available, else cpu.
        batch_size: images per forward.
    """

    def __init__(self, reward: str, model_path: str, processor_path: str, device: str, batch_size: int):
        # Imported here: transformers takes seconds to import, and most runs use no CLIP reward.
        from transformers import AutoImageProcessor, AutoTokenizer, CLIPModel

        model_dir = require_local_dir(reward, "reward.clip_model_path", model_path, DOWNLOADS[reward])
        processor_dir = require_local_dir(
            reward,
            "reward.clip_processor_path" if processor_path else "reward.clip_model_path",
            processor_path or model_path,
            DOWNLOADS[reward],
        )
        self.device = pick_device(device)
        self.model = CLIPModel.from_pretrained(model_dir, local_files_only=True).to(self.device).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(processor_dir, local_files_only=True)
        self.image_processor = AutoImageProcessor.from_pretrained(processor_dir, local_files_only=True)
        self.max_length = self.model.config.text_config.max_position_embeddings
        self.batch_size = batch_size

    @property
    def logit_scale(self) -> float:
        """The learnt temperature exp(logit_scale) that CLIP multiplies its cosines by."""
        return float(self.model.logit_scale.detach().float().exp())

    @torch.inference_mode()
    def cosine(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        """(B,) cosine of each image's and its prompt's embeddings, float32 on the CPU.

        Args:
            images: (B, 3, H, W) float in [0, 1].
            prompts: B prompts.
        """
        arrays = to_uint8_images(images)
        parts = []
        for batch in batch_slices(len(prompts), self.batch_size):
            pixel_values = self.image_processor(images=arrays[batch], return_tensors="pt")["pixel_values"]
            text = self.tokenizer(
                prompts[batch], padding=True, truncation=True, max_length=self.max_length, return_tensors="pt"
            )
            out = self.model(
                input_ids=text["input_ids"].to(self.device),
                attention_mask=text["attention_mask"].to(self.device),
                pixel_values=pixel_values.to(self.device),
            )
            image_BD = F.normalize(out.image_embeds.float(), dim=-1)
            text_BD = F.normalize(out.text_embeds.float(), dim=-1)
            parts.append((image_BD * text_BD).sum(-1).cpu())
        return torch.cat(parts)


@register_reward("clip_score")
def make_clip_score(
    clip_model_path: str = "", clip_processor_path: str = "", clip_device: str = "", batch_size: int = 16
):
    """Cosine similarity of CLIP image and prompt embeddings.

    Args:
        clip_model_path: local directory of a `CLIPModel` saved with `save_pretrained`.
        clip_processor_path: local directory of its tokenizer and image processor; empty means
            `clip_model_path`.
        clip_device: where the model runs; empty means cuda when available, else cpu.
        batch_size: images per forward.
    """
    scorer = ClipScorer("clip_score", clip_model_path, clip_processor_path, clip_device, batch_size)

    def clip_score(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        return scorer.cosine(images, prompts)

    return clip_score


@register_reward("pickscore")
def make_pickscore(
    clip_model_path: str = "",
    clip_processor_path: str = "",
    clip_device: str = "",
    batch_size: int = 16,
    pickscore_normalize: bool = False,
):
    """PickScore: logit_scale * cosine of CLIP image and prompt embeddings (see the module docstring).

    Args:
        clip_model_path: local directory of PickScore's `CLIPModel` (yuvalkirstain/PickScore_v1).
        clip_processor_path: local directory of its tokenizer and image processor (PickScore ships
            its weights without them: laion/CLIP-ViT-H-14-laion2B-s32B-b79K); empty means clip_model_path.
        clip_device: where the model runs; empty means cuda when available, else cpu.
        batch_size: images per forward.
        pickscore_normalize: map the score to [0, 1] by s -> (s / logit_scale + 1) / 2.
    """
    scorer = ClipScorer("pickscore", clip_model_path, clip_processor_path, clip_device, batch_size)
    scale = scorer.logit_scale

    def pickscore(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        scores_B = scale * scorer.cosine(images, prompts)
        return (scores_B / scale + 1) / 2 if pickscore_normalize else scores_B

    return pickscore
