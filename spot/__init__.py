"""Capacity that can vanish: node pools, preemption signals, trace replay, the pull scheduler,
the S3 weight store, cost accounting (design.md §4).

Empty so far: the spot runtime is its own issue. Until then the DiT path runs in one process and
keeps its checkpoints on local disk (`spotlight.checkpoint`).
"""
