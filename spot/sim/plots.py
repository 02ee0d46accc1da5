"""The simulator's outputs: one JSON document and PNG plots (matplotlib, Agg: no display needed)."""

from __future__ import annotations

import json
from pathlib import Path

from spot.sim.policies import PolicyResult, Setup, compare


def write_outputs(
    out_dir: str | Path, results: dict[str, PolicyResult], setup: Setup, *, extra: dict | None = None
) -> dict:
    """Write `simulation.json` and the plots under `out_dir`; returns the JSON document."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    doc = {
        "profile": setup.profile.to_dict(),
        "trace": setup.trace.summary() if setup.trace is not None else None,
        "trainer_gpus": setup.trainer_gpus,
        "baseline_gpus": setup.baseline_gpus,
        "spot_gpus_peak": setup.trace.num_nodes_max if setup.trace is not None else 0,
        "on_demand_usd_per_gpu_hour": setup.on_demand_usd_per_gpu_hour,
        "spot_discount": None if setup.spot_prices else setup.spot_discount,
        "planner": setup.planner,
        "planner_family": setup.planner_family,
        "elastic": setup.elastic,
        "reward_table": setup.table.source,
        "policies": compare(results),
        **(extra or {}),
    }
    (out / "simulation.json").write_text(json.dumps(doc, indent=2) + "\n")

    target = setup.profile.iterations_to_target
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in results.items():
        ends = [0.0] + [t / 3600 for t in r.series["iteration_end_s"]]
        ax.plot(ends, [0.0] + [min(1.0, x / target) for x in r.series["progress"]], label=name)
    ax.set(xlabel="hours", ylabel="progress to target", title=f"{setup.profile.name}: time to target")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "progress.png", dpi=110)
    plt.close(fig)

    names = list(results)
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    axes[0].bar(names, [results[n].cost_usd for n in names], color="tab:blue")
    axes[0].set(ylabel="USD to target", title="cost")
    axes[1].bar(names, [results[n].wall_s / 3600 for n in names], color="tab:orange")
    axes[1].set(ylabel="hours to target", title="time")
    for ax in axes:
        ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(out / "cost_time.png", dpi=110)
    plt.close(fig)

    spot = [n for n in names if results[n].series["spot_timeline"]]
    if spot:
        fig, axes = plt.subplots(len(spot), 1, figsize=(8, 2.4 * len(spot)), squeeze=False)
        for ax, name in zip(axes[:, 0], spot):
            tl = results[name].series["spot_timeline"]
            ts = [t / 3600 for t, _, _ in tl]
            ax.step(ts, [h for _, h, _ in tl], where="post", label="spot GPUs held")
            ax.step(ts, [w for _, _, w in tl], where="post", label="in ready workers")
            ax.set(ylabel="GPUs", title=f"{name}: spot pool")
            ax.legend(loc="upper right", fontsize=8)
        axes[-1, 0].set_xlabel("hours")
        fig.tight_layout()
        fig.savefig(out / "spot_timeline.png", dpi=110)
        plt.close(fig)
    return doc
