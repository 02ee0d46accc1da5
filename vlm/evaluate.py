"""Held-out accuracy of a VLM policy on the shapes task: greedy answers, checked by the rewards."""

from __future__ import annotations

import time
from collections import defaultdict

import torch

from spotlight.core.distributed import DataParallel
from vlm.config import TaskConfig
from vlm.policy import VLMPolicy
from vlm.rewards import accuracy_reward, format_reward
from vlm.rollout import HFRolloutEngine
from vlm.task import Example, example_image, heldout_examples


def evaluate(
    policy: VLMPolicy,
    task: TaskConfig,
    *,
    examples: list[Example] | None = None,
    batch_size: int = 128,
    max_new_tokens: int = 6,
    synced_gpus: bool = False,
    dp: DataParallel | None = None,
) -> dict:
    """Greedy-decode every held-out example and score it.

    With data parallelism (`dp`; every rank calls this) each rank decodes a contiguous slice of the
    examples, under FSDP padded to the same count (every forward is a collective, and `synced_gpus`
    keeps the ranks' decode steps in step), and the per-example scores are gathered: every rank
    returns the summary of all examples. Fewer examples than ranks: every rank decodes all of them.

    Args:
        policy: the policy.
        task: the task (its held-out split is used unless `examples` is given).
        examples: the examples to score instead of the held-out split.
        batch_size: examples per generate call.
        max_new_tokens: most tokens per answer.
        synced_gpus: the model is FSDP-sharded: every rank must call this (`HFRolloutEngine`).
        dp: the process group's layout; None: one process decodes everything.

    Returns:
        {"accuracy", "format_rate", "accuracy/<question type>", "num_examples", "seconds"}.
    """
    began = time.monotonic()
    examples = heldout_examples(task) if examples is None else examples
    dp = dp if dp is not None and len(examples) >= dp.world_size else DataParallel()
    lo, hi = dp.shard(len(examples))
    mine = dp.padded_shard(examples)  # under FSDP, repeats of its last example; not scored
    engine = HFRolloutEngine(policy, batch_size=batch_size, synced_gpus=synced_gpus)
    texts: list[str] = []
    for start in range(0, len(mine), batch_size):
        part = mine[start : start + batch_size]
        prompts = policy.encode([e.question for e in part], [example_image(e, task) for e in part])
        texts += engine.generate(prompts, 1, max_new_tokens, 0.0, seed=0).texts
    texts = texts[: hi - lo]
    answers = [e.answer for e in examples[lo:hi]]
    # (correct, well formatted) per example, gathered in rank order: the examples' order.
    scores = torch.stack([accuracy_reward(texts, answers), format_reward(texts, answers)], dim=1).float()
    scores = dp.all_gather_rows(scores)
    correct, formatted = scores[:, 0], scores[:, 1]
    by_type: dict[str, list[float]] = defaultdict(list)
    for e, c in zip(examples, correct.tolist()):
        by_type[e.question_type].append(c)
    return {
        "accuracy": float(correct.mean()),
        "format_rate": float(formatted.mean()),
        **{f"accuracy/{k}": sum(v) / len(v) for k, v in sorted(by_type.items())},
        "num_examples": len(examples),
        "seconds": round(time.monotonic() - began, 1),
        # This rank's first responses (rank 0's are the first examples').
        "samples": [
            {"question": e.question, "answer": e.answer, "response": t}
            for e, t in list(zip(examples[lo:hi], texts))[:4]
        ],
    }
