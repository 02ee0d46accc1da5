"""Capacity that can vanish: node pools, preemption signals, trace replay, the pull scheduler,
the S3 weight store, cost accounting (docs/spot.md).

So far:
    store, s3    `open_store(url)`: checkpoints and weights in a local directory or on S3, folders
                 published atomically (manifest last) and verified by sha256 on fetch
    metadata     IMDSv2 watcher for spot interruption and rebalance notices (fake_imds: a test server)
    traces       spot-capacity traces in four public formats, plus a synthetic generator
    jobqueue     the pull scheduler's queue: leases, idempotent commits, exactly-once results (pure)
    scheduler    denoising jobs pulled by workers on spot nodes, committed every m steps and on
                 notice, resumed elsewhere bit for bit; the push baseline
    replay       a local Ray cluster driven by a trace (nodes join, get notices, are killed)

Not yet: node pools as a cluster file (configs/cluster/aws-spot.yaml), the cost ledger, a queue
persisted to the store. The DiT path still runs in one process and
keeps its checkpoints on local disk (`spotlight.core.checkpoint`).
"""
