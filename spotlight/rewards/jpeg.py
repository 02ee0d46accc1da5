"""JPEG compressibility, the model-free reward of DDPO (Black et al. 2023) and Flow-GRPO.

Shape legend: B batch, H height, W width.

score = -(JPEG size in kB, 1 kB = 1000 bytes): simpler, smoother images score higher. It needs no
model, so it is the cheapest end-to-end check that an RL run moves a reward at all.
"""

from __future__ import annotations

import io

import numpy as np
import torch
from PIL import Image

from spotlight.rewards.registry import register_reward


def jpeg_sizes_kb(images_BHW3: np.ndarray, quality: int = 95) -> np.ndarray:
    """Size of each image encoded as JPEG.

    Args:
        images_BHW3: (B, H, W, 3) uint8 RGB.
        quality: PIL's JPEG quality, 1..95.

    Returns:
        (B,) float32 sizes in kB.
    """
    sizes = []
    for image_HW3 in images_BHW3:
        buffer = io.BytesIO()
        image = Image.fromarray(np.ascontiguousarray(image_HW3))
        image.save(buffer, format="JPEG", quality=quality)
        sizes.append(buffer.tell() / 1000)
    return np.array(sizes, dtype=np.float32)


@register_reward("jpeg_compressibility")
def make_jpeg_compressibility(jpeg_quality: int = 95):
    """Negative JPEG size in kB.

    Args:
        jpeg_quality: PIL's JPEG quality, 1..95 (Flow-GRPO uses 95).
    """
    if not 1 <= jpeg_quality <= 95:
        raise ValueError(f"reward.jpeg_quality is {jpeg_quality}; use 1 to 95")

    def jpeg_compressibility(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        # Round, not truncate, so that an image saved as PNG and reloaded scores the same.
        images_BHW3 = (images.detach().float().clamp(0, 1) * 255).round().to(torch.uint8)
        sizes_B = jpeg_sizes_kb(images_BHW3.permute(0, 2, 3, 1).cpu().numpy(), jpeg_quality)
        return -torch.from_numpy(sizes_B)

    return jpeg_compressibility
