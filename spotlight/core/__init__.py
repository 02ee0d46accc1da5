"""The core both paths build on (the DiT path in `spotlight/`, the VLM path in `vlm/`); it imports
nothing else of ours, and `vlm/` imports nothing of ours but it (tests/test_layers.py).

    config_io.py     recipes: YAML and dotted overrides into dataclasses, errors that name the field
    seeds.py         derive_seed, seeded weight inits
    advantages.py    group-relative advantages (GRPO)
    rewards.py       a batch's rewards (`RewardResult`) and their all-gather across ranks
    distributed.py   data parallelism and FSDP: process groups, shards, sharded state to rank 0
    checkpoint.py    atomic checkpoints with manifests, RNG state, resume
    export.py        the output folder and the policy rebuilt from a checkpoint (`spotlight export`)
    optim.py         learning-rate warmup and cooldown
    time_budget.py   the iteration budget that ends a run on time
    tracking.py      wandb + metrics.jsonl + image grids
    runlock.py       one writer per run directory and store
    cost.py          the cost ledger: GPU-seconds per pool x price (`spotlight cost`)
    aws.py           credentials masked in AWS clients' logs
    files.py         fsync, JSON-lines readers that survive a torn last line, the store's errors
    memory_plan.py   the memory estimate's primitives (`spotlight memory`)
"""
