"""Seeds: one 63-bit seed per (run seed, iteration, index, ...) tuple, and seeded weight inits.

Both paths draw every random number from a seed derived here, so a resumed or re-run iteration
draws the same ones (docs/architecture.md).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    # SplitMix64 finaliser (Steele et al., "Fast splittable pseudorandom number generators"):
    # decorrelates neighbouring (seed, step) pairs before they seed torch's Mersenne Twister.
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def derive_seed(*parts: int) -> int:
    """A 63-bit seed derived from integers (run seed, iteration, index, ...)."""
    h = 0
    for p in parts:
        h = _splitmix64(h ^ (int(p) & _MASK64))
    return h >> 1


LORA_INIT_STREAM = 0x10A1
"""`derive_seed` stream of a LoRA adapter's initial weights (`seeded_init`)."""


@contextmanager
def seeded_init(seed: int | None, device: str | torch.device):
    """torch's generators (CPU, and `device`'s if a GPU) seeded from `seed` for a weight init, then restored.

    peft draws a LoRA adapter's initial weights from torch's global generators, which torch seeds
    at random in every process: seeded here from the run's seed, the same recipe starts from the
    same adapter (and the rest of the run's randomness is left as it was). None: no seeding.
    """
    if seed is None:
        yield
        return
    device = torch.device(device)
    gpus = [torch.cuda.current_device() if device.index is None else device.index] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=gpus):
        torch.manual_seed(derive_seed(seed, LORA_INIT_STREAM))  # seeds the GPUs' generators too
        yield
