"""Latent packing and both codecs (the real Qwen-Image VAE class at a tiny size)."""

from __future__ import annotations

import torch

from spotlight.latents import PixelShuffleCodec, QwenImageVAECodec, load_codec, pack_latents, unpack_latents


def test_pack_unpack_round_trip_and_layout():
    x = torch.randn(2, 4, 6, 8)
    packed = pack_latents(x)
    assert packed.shape == (2, 12, 16)
    assert torch.equal(unpack_latents(packed, 6, 8), x)
    # Token 0 holds the top-left 2x2 patch of every channel, channel-major (as diffusers packs).
    assert torch.equal(packed[0, 0, :4], x[0, 0, :2, :2].reshape(-1))


def test_pixel_shuffle_codec_is_exact(tmp_path):
    codec = PixelShuffleCodec(2)
    images = torch.rand(3, 3, 32, 32)
    latents = codec.encode(images)
    assert latents.shape == (3, 12, 16, 16) and latents.min() >= -1 and latents.max() <= 1
    torch.testing.assert_close(codec.decode(latents), images)
    codec.save(tmp_path)
    assert load_codec(tmp_path).factor == 2


def test_qwen_image_vae_codec_from_folder(tmp_path):
    from diffusers import AutoencoderKLQwenImage

    torch.manual_seed(0)
    vae = AutoencoderKLQwenImage(
        base_dim=24,
        z_dim=4,
        dim_mult=[1, 2, 4],
        num_res_blocks=1,
        temperal_downsample=[False, True],
        latents_mean=[0.1] * 4,
        latents_std=[2.0] * 4,
    )
    vae.save_pretrained(tmp_path / "vae")
    codec = load_codec(tmp_path)
    assert isinstance(codec, QwenImageVAECodec) and codec.downsample == 4 and codec.latent_channels == 4
    images = torch.rand(2, 3, 32, 32)
    with torch.no_grad():
        latents = codec.encode(images)
        decoded = codec.decode(latents)
    assert latents.shape == (2, 4, 8, 8)
    assert decoded.shape == (2, 3, 32, 32) and decoded.min() >= 0 and decoded.max() <= 1
    # Normalisation: encode returns (z - mean) / std of the VAE's latent distribution mean.
    with torch.no_grad():
        raw = vae.encode((images * 2 - 1)[:, :, None]).latent_dist.mean[:, :, 0]
    torch.testing.assert_close(latents, (raw - 0.1) / 2.0)
