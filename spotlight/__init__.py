"""spotlight: GRPO post-training of Qwen-Image DiTs (Flow-GRPO family), built to run part of the
work on preemptible GPUs. See docs/architecture.md for the layout and the data flow."""

__version__ = "0.1.0"
