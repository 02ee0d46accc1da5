"""VLM GRPO for Qwen2.5-VL / Qwen3-VL with the Rollplex schedule (the Rollplex paper).

Empty so far: the VLM path is its own issue. The package exists now so that the layout of
docs/architecture.md holds from the start.
"""
