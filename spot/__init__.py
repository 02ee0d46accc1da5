"""Capacity that can vanish: node pools, preemption signals, trace replay, the pull scheduler,
the S3 weight store, cost accounting (design.md §4).

So far:
    store, s3    `open_store(url)`: checkpoints and weights in a local directory or on S3, folders
                 published atomically (manifest last) and verified by sha256 on fetch
    metadata     IMDSv2 watcher for spot interruption and rebalance notices (fake_imds: a test server)
    traces       spot-capacity traces in four public formats, plus a synthetic generator

Not yet: node pools, the pull scheduler, the cost ledger. The DiT path still runs in one process and
keeps its checkpoints on local disk (`spotlight.checkpoint`).
"""
