"""Latent spaces: Qwen-Image 2x2 token packing and the image <-> latent codecs.

Shape legend: B batch, C latent channels, H/W latent height/width, L = (H/2)(W/2) tokens.

Two codecs share one interface (`encode`, `decode`, `latent_channels`, `downsample`):
- `QwenImageVAECodec` wraps diffusers' `AutoencoderKLQwenImage` (the real model);
- `PixelShuffleCodec` is the tiny default: an exact, parameter-free space-to-depth map. A tiny
  VAE would have to be trained first (no weights can be downloaded), would cost minutes of CPU
  and would blur the small shapes that the `shapes` reward checks; space-to-depth keeps the
  transformer's input a (B, C, H, W) latent packed 2x2 exactly like the real path, with 16x
  fewer tokens than pixels.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F


def pack_latents(latents_BCHW: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) -> (B, (H/2)(W/2), 4C), Qwen-Image's 2x2 token packing."""
    b, c, h, w = latents_BCHW.shape
    x = latents_BCHW.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(latents_BLC: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """(B, (H/2)(W/2), 4C) -> (B, C, H, W), the inverse of `pack_latents`."""
    b, _, c4 = latents_BLC.shape
    x = latents_BLC.view(b, height // 2, width // 2, c4 // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, c4 // 4, height, width)


class PixelShuffleCodec:
    """Images (B, 3, H, W) in [0, 1] <-> latents (B, 3 f^2, H/f, W/f) in [-1, 1], exactly invertible."""

    kind = "pixel_shuffle"

    def __init__(self, factor: int = 4):
        self.factor = factor

    @property
    def latent_channels(self) -> int:
        return 3 * self.factor**2

    @property
    def downsample(self) -> int:
        return self.factor

    def encode(self, images_B3HW: torch.Tensor) -> torch.Tensor:
        return F.pixel_unshuffle(images_B3HW * 2 - 1, self.factor)

    def decode(self, latents_BCHW: torch.Tensor) -> torch.Tensor:
        return ((F.pixel_shuffle(latents_BCHW.float(), self.factor) + 1) / 2).clamp(0, 1)

    def save(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "latent_codec.json").write_text(json.dumps({"kind": self.kind, "factor": self.factor}) + "\n")


class QwenImageVAECodec:
    """diffusers' `AutoencoderKLQwenImage` (a video VAE used on single frames), normalised latents."""

    kind = "qwen_image_vae"

    def __init__(self, vae):
        self.vae = vae
        cfg = vae.config
        self._mean = torch.tensor(cfg.latents_mean).view(1, -1, 1, 1, 1)
        self._std = torch.tensor(cfg.latents_std).view(1, -1, 1, 1, 1)

    @property
    def latent_channels(self) -> int:
        return self.vae.config.z_dim

    @property
    def downsample(self) -> int:
        return 2 ** len(self.vae.temperal_downsample)

    def encode(self, images_B3HW: torch.Tensor) -> torch.Tensor:
        x = (images_B3HW * 2 - 1).to(self.vae.dtype)[:, :, None]
        z = self.vae.encode(x).latent_dist.mean
        return ((z - self._mean.to(z)) / self._std.to(z))[:, :, 0]

    def decode(self, latents_BCHW: torch.Tensor) -> torch.Tensor:
        z = latents_BCHW.to(self.vae.dtype)[:, :, None]
        z = z * self._std.to(z) + self._mean.to(z)
        images = self.vae.decode(z, return_dict=False)[0][:, :, 0]
        return ((images.float() + 1) / 2).clamp(0, 1)


def load_codec(model_path: Path, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """The codec of a model folder: `vae/` (diffusers) or `latent_codec.json` (tiny models)."""
    if (model_path / "vae").is_dir():
        from diffusers import AutoencoderKLQwenImage

        vae = AutoencoderKLQwenImage.from_pretrained(model_path / "vae", torch_dtype=dtype).to(device)
        vae.requires_grad_(False)
        return QwenImageVAECodec(vae.eval())
    spec_file = model_path / "latent_codec.json"
    if spec_file.is_file():
        spec = json.loads(spec_file.read_text())
        if spec.get("kind") != PixelShuffleCodec.kind:
            raise ValueError(f"{spec_file}: unknown codec kind {spec.get('kind')!r}; expected 'pixel_shuffle'")
        return PixelShuffleCodec(int(spec["factor"]))
    raise ValueError(f"{model_path}: no 'vae/' folder and no 'latent_codec.json': not a Qwen-Image model folder")
