"""Held-out gain of the README command over several splits of the shapes grammar.

For each split s (`data.split_seed=s`: which 64 grammar prompts are held out), run the README's
main command as written, plus the split, on its own run directory:

    spotlight train configs/dit/tiny-shapes.yaml data.split_seed=s --run-dir OUT/split-s

then score the base model and the trained checkpoint on that split's held-out prompts with
`spotlight eval` (the recipe's eval seeds, `eval.num_seeds` per prompt), and report the gain
(trained - base) per split, their mean and range, each evaluation's standard error (`stderr`, the
seeds' noise with the prompts fixed), the iterations and minutes each run took, and the host's CPU.

The runs go one after another: the recipe is time-budgeted (`train.max_minutes`), so two at once
on a small host would each train less. Anything else running on the host lowers the figures too.

The JSON states, per split, the fraction of its held-out prompts that were pretraining captions
("heldout_seen_by_base"): the shipped base (configs/dit/tiny-pretrain.yaml) left the held-out prompts
of splits 0, 1 and 2 out of pretraining, so it is 0 there; another split or base may differ.

Prints one JSON line; progress goes to stderr. `--keep` reuses finished runs in OUT. Example:

    .venv/bin/python benchmarks/heldout_gain.py --splits 0 1 2 --out runs/heldout-gain --keep
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from spotlight.config import PretrainConfig
from spotlight.core.checkpoint import find_latest_checkpoint
from spotlight.core.config_io import load_config
from spotlight.core.tracking import read_metrics
from spotlight.pretrain import pretrain_prompts
from spotlight.rewards import shapes

RECIPE = "configs/dit/tiny-shapes.yaml"
SPOTLIGHT = [sys.executable, "-m", "spotlight.cli"]


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def evaluate(split: int, checkpoint: Path | None, extra: list[str]) -> dict:
    cmd = [*SPOTLIGHT, "eval", RECIPE, f"data.split_seed={split}", *extra, "--json"]
    if checkpoint is not None:
        cmd += ["--checkpoint", str(checkpoint)]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def seen_by_base(split: int, num_heldout: int, pretrain_config: Path) -> float:
    pre = load_config(PretrainConfig, pretrain_config)
    pretrain_captions = set(pretrain_prompts(pre))
    heldout = shapes.split_prompts(split, num_heldout)[1]
    return round(sum(p in pretrain_captions for p in heldout) / len(heldout), 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--splits", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "heldout-gain")
    parser.add_argument("--keep", action="store_true", help="reuse a split's finished run in --out")
    parser.add_argument(
        "--pretrain-config",
        type=Path,
        default=REPO / "configs/dit/tiny-pretrain.yaml",
        help="the `spotlight pretrain` recipe that made the base (with model.path=..., the one that made that folder)",
    )
    parser.add_argument("overrides", nargs="*", help="extra recipe overrides for train and eval (key=value)")
    args = parser.parse_args()

    rows = []
    for split in args.splits:
        run_dir = args.out / f"split-{split}"
        done = args.keep and (run_dir / "checkpoints").is_dir() and find_latest_checkpoint(run_dir) is not None
        if not done:
            if run_dir.exists():
                sys.exit(f"{run_dir} exists; pass --keep to reuse it, or remove it")
            print(f"split {split}: training (the README command, data.split_seed={split})", file=sys.stderr)
            t0 = time.monotonic()
            cmd = [
                *SPOTLIGHT,
                "train",
                RECIPE,
                f"data.split_seed={split}",
                *args.overrides,
                "--run-dir",
                str(run_dir),
                "--quiet",
            ]
            subprocess.run(cmd, cwd=REPO, check=True)
            print(f"split {split}: trained in {(time.monotonic() - t0) / 60:.1f} min", file=sys.stderr)
        metrics = read_metrics(run_dir)
        base = evaluate(split, None, args.overrides)
        trained = evaluate(split, run_dir, args.overrides)
        row = {
            "split": split,
            "base": round(base["mean_reward"], 4),
            "trained": round(trained["mean_reward"], 4),
            "gain": round(trained["mean_reward"] - base["mean_reward"], 4),
            "stderr_base": round(base["stderr"], 4),
            "stderr_trained": round(trained["stderr"], 4),
            "iterations": metrics[-1]["step"] if metrics else 0,
            "train_minutes": round(metrics[-1].get("time/run_s", 0.0) / 60, 2) if metrics else 0.0,
            "heldout_seen_by_base": seen_by_base(split, base["num_prompts"], args.pretrain_config),
            "eval_samples": trained["num_samples"],
        }
        print(f"split {split}: {json.dumps(row)}", file=sys.stderr)
        rows.append(row)

    gains = [r["gain"] for r in rows]
    print(
        json.dumps(
            {
                "benchmark": "heldout_gain",
                "baseline": "the base model before GRPO, on the same held-out prompts and eval seeds",
                "command": f"spotlight train {RECIPE} data.split_seed=S"
                + (" " + " ".join(args.overrides) if args.overrides else ""),
                "host_cpu": cpu_model(),
                "cores": len(os.sched_getaffinity(0)),
                "gain_mean": round(statistics.fmean(gains), 4),
                "gain_min": min(gains),
                "gain_max": max(gains),
                "splits": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
