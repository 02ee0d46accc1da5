"""Rollplex against the serial schedule on a tiny Qwen2.5-VL: equality, vision calls, step time, memory.

One GRPO step (rollout, reference log-probs, update; on-policy, frozen vision tower, beta > 0) of
each schedule from the same weights, with the same seeded rollout and fixed advantages:

- loss_max_abs_diff, grad_max_abs_diff: |serial - rollplex| of the loss and of every gradient.
- vision_encoder_calls_per_prompt: images the towers really encoded (forward hooks) / prompts.
- step_time_ratio_serial_over_rollplex: median step time of serial / rollplex, measured side by
  side (alternating, after a warm-up). The model and image are sized so the prompt prefix is most
  of each sequence (`prefix_fraction`; real VLM workloads: 79-98%, the Rollplex paper).
- peak_mem (MiB): live tensor bytes per phase (`vlm.memory.TensorLedger`: every storage from its
  allocation to its last reference) on top of the permanent state (weights, reference copy, AdamW
  moments). naive_colocation keeps every engine's working set resident at once: a rollout copy of
  the weights plus the peaks of the rollout, reference and update phases, added.

    .venv/bin/python benchmarks/rollplex.py --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from spotlight.core.config_io import load_config
from vlm.config import TaskConfig, TinyVLMConfig, VLMRecipe
from vlm.driver import make_schedule
from vlm.memory import TensorLedger, state_bytes
from vlm.policy import load_policy
from vlm.rollout import HFRolloutEngine
from vlm.rollplex import RollplexSchedule, VisionCounter
from vlm.task import CELL_PX, TrainStream, corpus, example_image
from vlm.tiny import build_tiny_vlm
from vlm.update import Reference

MIB = 2**20


def build(folder: Path, args) -> VLMRecipe:
    task = TaskConfig(grid_size=args.grid_size, max_shapes=4)
    spec = TinyVLMConfig(
        text_hidden=args.hidden,
        text_layers=args.layers,
        text_heads=4,
        vision_hidden=args.hidden,
        vision_depth=args.vision_depth,
        vision_heads=4,
    )
    build_tiny_vlm(folder, spec, corpus(task), image_px=args.grid_size * CELL_PX)
    overrides = [
        f"model.path={folder}",
        "model.train_vision=false",
        f"task.grid_size={args.grid_size}",
        "task.max_shapes=4",
        f"train.prompts_per_iteration={args.prompts}",
        f"train.group_size={args.group_size}",
        f"rollout.max_new_tokens={args.max_new_tokens}",
        "train.beta=0.04",
        "log.wandb_mode=disabled",
    ]
    return load_config(VLMRecipe, None, overrides)


class Runner:
    """One schedule on its own copy of the policy (same initial weights for every schedule)."""

    def __init__(self, cfg: VLMRecipe, name: str, ledger: TensorLedger | None = None, *, overlap: bool = True):
        self.cfg, self.name = cfg, name
        self.policy = load_policy(cfg.model)
        self.reference = Reference(self.policy, cfg.train.beta)
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():  # away from the reference, so the KL term has a gradient
            for p in self.policy.model.parameters():
                if p.requires_grad:
                    p.add_(0.02 * torch.randn(p.shape, generator=gen))
        self.params = [p for p in self.policy.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=1e-4)
        self.grads: list[list[torch.Tensor]] = []
        self.optimizer.register_step_pre_hook(lambda *_: self.grads.append([p.grad.clone() for p in self.params]))
        engine = HFRolloutEngine(self.policy)
        if name == "rollplex":
            self.schedule = RollplexSchedule(
                self.policy, engine, self.reference, self.optimizer, cfg, ledger=ledger, overlap=overlap
            )
        else:
            self.schedule = make_schedule(name, self.policy, engine, self.reference, self.optimizer, cfg)
        P = cfg.train.prompts_per_iteration
        examples = TrainStream(cfg.task, seed=0).batch(0, P)
        self.prompts = self.policy.encode(
            [e.question for e in examples], [example_image(e, cfg.task) for e in examples]
        )
        self.adv_B = torch.randn(P * cfg.train.group_size, generator=torch.Generator().manual_seed(2))

    def step(self, ledger: TensorLedger | None = None) -> dict:
        import contextlib

        phase = ledger.phase if ledger is not None else (lambda name: contextlib.nullcontext())
        s, rows = self.schedule, list(range(self.adv_B.shape[0]))
        t0 = time.perf_counter()
        with phase("rollout"):
            ro = s.rollout(self.prompts, seed=5)
        with phase("reference"):
            ref = s.reference_logprobs(ro, rows)
        boundary = s.boundary_bytes() if self.name == "rollplex" else 0
        with phase("update"):
            stats = s.update(ro, rows, self.adv_B, None, ref, 0)
        return {"seconds": time.perf_counter() - t0, "loss": stats["loss"], "ro": ro, "boundary": boundary}


def measure_memory(cfg: VLMRecipe, name: str) -> dict:
    ledger = TensorLedger()
    runner = Runner(cfg, name, ledger)
    runner.step()  # creates the AdamW moments: permanent state, counted below
    permanent = state_bytes(runner.policy.model, runner.optimizer, runner.reference.copy)
    with ledger.mode():
        out = runner.step(ledger)
    runner.schedule.close()
    base = sum(permanent.values())
    phases = {k: round((base + v) / MIB, 3) for k, v in ledger.peaks.items()}
    result = {**phases, "peak": max(phases.values()), "permanent": {k: round(v / MIB, 3) for k, v in permanent.items()}}
    if name == "rollplex":
        result["boundary"] = round(out["boundary"] / MIB, 3)
    return result, ledger.peaks, permanent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON line (the default output too)")
    parser.add_argument("--grid-size", type=int, default=6, help="image side in cells (one vision token per cell)")
    parser.add_argument(
        "--hidden", type=int, default=128, help="hidden size of the language model and the vision tower"
    )
    parser.add_argument("--layers", type=int, default=2, help="decoder layers")
    parser.add_argument("--vision-depth", type=int, default=4, help="vision transformer blocks")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step (P)")
    parser.add_argument("--group-size", type=int, default=8, help="samples per prompt (G)")
    parser.add_argument("--max-new-tokens", type=int, default=6, help="response length limit")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per schedule (alternating)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        cfg = build(Path(tmp) / "model", args)
        P = cfg.train.prompts_per_iteration
        # 1. Equality and vision calls: one step of each schedule from the same weights.
        runners, images, first = {}, {}, {}
        for name in ("serial", "rollplex"):
            runners[name] = Runner(cfg, name)
            towers = [runners[name].policy.base_model.model.visual, runners[name].reference.copy.model.visual]
            counter = VisionCounter(towers)
            first[name] = runners[name].step()
            counter.close()
            images[name] = counter.images / P
        a, b = runners["serial"], runners["rollplex"]
        assert torch.equal(first["serial"]["ro"].response_ids_BT, first["rollplex"]["ro"].response_ids_BT)
        grad_diff = max((x - y).abs().max().item() for x, y in zip(a.grads[0], b.grads[0]))
        ro = first["serial"]["ro"]
        prompt_tokens_B = ro.prompts.attention_mask_BL.sum(dim=1).float()
        prefix_fraction = float((prompt_tokens_B / (prompt_tokens_B + ro.response_mask_BT.sum(dim=1))).mean())

        # 2. Step time, side by side: alternate the schedules (rotating the order), median of the repeats.
        #    rollplex_serialized: the same prefix and suffix passes, the prefixes before the decode.
        runners["rollplex_serialized"] = Runner(cfg, "rollplex", overlap=False)
        runners["rollplex_serialized"].step()
        names = list(runners)
        times = {name: [] for name in names}
        for i in range(args.repeats):
            for name in names[i % 3 :] + names[: i % 3]:
                times[name].append(runners[name].step()["seconds"])
        for r in runners.values():
            r.schedule.close()
        median = {k: statistics.median(v) for k, v in times.items()}

        # 3. Peak memory per phase.
        serial_mem, serial_peaks, permanent = measure_memory(cfg, "serial")
        rollplex_mem, _, _ = measure_memory(cfg, "rollplex")
        naive = sum(permanent.values()) + permanent["weights"] + sum(serial_peaks.values())

    print(
        json.dumps(
            {
                "baseline": "train.schedule=serial: the reference and actor passes after the rollout, same batch",
                "loss_max_abs_diff": abs(first["serial"]["loss"] - first["rollplex"]["loss"]),
                "grad_max_abs_diff": grad_diff,
                "vision_encoder_calls_per_prompt": images,
                "step_time_ratio_serial_over_rollplex": round(median["serial"] / median["rollplex"], 3),
                "step_time_ratio_serialized_prefix_over_rollplex": round(
                    median["rollplex_serialized"] / median["rollplex"], 3
                ),
                "step_seconds_median": {k: round(v, 4) for k, v in median.items()},
                "prefix_fraction": round(prefix_fraction, 3),
                "peak_mem": {
                    "unit": "MiB",
                    "naive_colocation": round(naive / MIB, 3),
                    "serial": serial_mem,
                    "rollplex": rollplex_mem,
                },
                "setup": {
                    "prompts": P,
                    "group_size": cfg.train.group_size,
                    "grid_size": args.grid_size,
                    "hidden": args.hidden,
                    "layers": args.layers,
                    "vision_depth": args.vision_depth,
                    "repeats": args.repeats,
                    "torch_threads": torch.get_num_threads(),
                    "vision_tower": "frozen",
                    "dtype": "float32",
                },
            }
        )
    )


if __name__ == "__main__":
    main()
