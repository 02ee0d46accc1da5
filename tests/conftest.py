"""Shared fixtures: tiny real models built from config (no downloads), quiet libraries."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("WANDB_MODE", "offline")
# Ray reads this when it is imported, and some test modules import ray at collection: every Ray node
# a test starts must bind to 127.0.0.1 (docs/spot.md; spot.localray.import_ray_on_loopback).
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ.setdefault("WANDB_SILENT", "true")


@pytest.fixture(scope="session", autouse=True)
def _quiet():
    import diffusers
    import transformers

    diffusers.utils.logging.disable_progress_bar()
    diffusers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()


@pytest.fixture(autouse=True)
def _torch_threads(request):
    """Give every test the process's torch thread count back: a test that leaves it changed makes
    later in-process runs round differently from the same run in a subprocess (it is warned about)."""
    import warnings

    import torch

    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        warnings.warn(
            f"{request.node.nodeid} left torch at {torch.get_num_threads()} thread(s), not {threads}: restored",
            stacklevel=1,
        )
        torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random Qwen-Image folder: 32x32 images, 16 tokens, one transformer block."""
    from spotlight.config import TinyModelConfig
    from spotlight.rewards.shapes import all_prompts
    from spotlight.tiny import build_tiny_model

    spec = TinyModelConfig(image_size=32, codec_factor=4, num_layers=1, num_heads=2, head_dim=16, text_hidden=32)
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", spec, all_prompts())


@pytest.fixture()
def tiny_policy(tiny_model_dir):
    from spotlight.policy import DiTPolicy

    return DiTPolicy.load(tiny_model_dir, height=32, width=32, max_text_tokens=16)


@pytest.fixture(scope="module")
def ray_address():
    """A local Ray cluster (head + 2 spot nodes, 127.0.0.1) for a module's explorer tests."""
    from spot.cluster import LocalCluster

    cluster = LocalCluster(2)
    yield cluster.address
    cluster.shutdown()
