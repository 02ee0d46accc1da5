"""`spotlight report RUN_DIR`: one self-contained HTML page (plus its PNGs) for a run directory.

The page reads only what a run writes (see `driver.py`): `metrics.jsonl` (`tracking.read_metrics`),
`images/<key>-<step>.png`, `explore.jsonl` (`explore.LOG_FILE`), `cost.json` (`spotlight.core.cost`),
`config.yaml` and `checkpoints/`. It needs no network to be read: the CSS is inline and every
picture is embedded as a base64 `data:` URI (and also written as a PNG file next to the page, for
slides and notes). There is no script.

Sections, each with a stable HTML id (tests and links rely on them):

    rewards      reward/mean (+- reward/std) and each reward component, per step
    validation   eval/mean_reward on held-out prompts (eval.every)
    timing       where an iteration's time goes: rollout, reward, update, exploration
    images       the logged image grids over time (at most 8 steps per key, first and last kept)
    planner      exploration budget and allocations, fallbacks, variance captured (explore/*),
                 and the candidates the planner gave each prompt slot (explore.jsonl)
    preemptions  live explorers, deaths and respawns per step; spot and on-demand GPUs held over
                 wall-clock time (cost.json usage intervals): the node timeline
    cost         the cost ledger per pool, the saving over on-demand only, cost per step
    config       the resolved config.yaml and the checkpoints on disk

A section whose data the run lacks (no exploration, no eval, no ledger) stays on the page and says
"not recorded in this run" with the reason, so that two reports always have the same shape.
"""

from __future__ import annotations

import base64
import html
import io
import json
import logging
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import yaml
from matplotlib.figure import Figure  # a Figure renders with Agg by itself: no pyplot, no global backend
from matplotlib.ticker import MaxNLocator

from spotlight.core.cost import COST_FILE, read_ledger, summarize
from spotlight.core.tracking import IMAGES_DIR, METRICS_FILE, read_metrics
from spotlight.explore import LOG_FILE
from spotlight.seed_selection import FALLBACK_CAUSES

logger = logging.getLogger(__name__)

REPORT_DIR = "report"
NOT_RECORDED = "not recorded in this run"
SECTIONS = ("rewards", "validation", "timing", "images", "planner", "preemptions", "cost", "config")
MAX_IMAGE_STEPS = 8
_IMAGE_RE = re.compile(r"(?P<key>.+)-(?P<step>\d{6,})\.png")
_TIME_KEYS = ("time/rollout_s", "time/reward_s", "time/update_s", "time/explore_s")
_REWARD_STATS = ("reward/mean", "reward/std", "reward/num_failed")

_CSS = """
body { font: 15px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 0; color: #1d2329; background: #fff; }
header { background: #1d2f45; color: #fff; padding: 18px 32px; }
header h1 { margin: 0 0 4px; font-size: 22px; }
nav { padding: 8px 32px; background: #eef2f6; border-bottom: 1px solid #d5dde5; }
nav a { margin-right: 16px; color: #1d4f8a; text-decoration: none; }
main { padding: 0 32px 40px; max-width: 1100px; }
section { border-bottom: 1px solid #e3e8ee; padding: 12px 0 20px; }
h2 { font-size: 19px; margin: 14px 0 8px; }
h3 { font-size: 15px; margin: 12px 0 6px; }
table { border-collapse: collapse; margin: 6px 0 10px; }
td, th { border: 1px solid #d5dde5; padding: 3px 10px; text-align: right; }
td:first-child, th:first-child { text-align: left; }
th { background: #f3f6f9; }
img.plot { display: block; max-width: 100%; margin: 6px 0; }
figure { display: inline-block; margin: 4px 10px 10px 0; vertical-align: top; }
figure img { image-rendering: pixelated; border: 1px solid #d5dde5; }
figcaption { font-size: 13px; color: #56636f; }
p.missing { color: #8a5300; background: #fff6e5; padding: 6px 10px; border-left: 3px solid #e0a030; }
pre { background: #f6f8fa; padding: 10px; overflow-x: auto; font-size: 12.5px; }
.summary td { text-align: left; }
"""


@dataclass
class _Page:
    """The output folder and what goes into the page: sections in order, PNGs written as they come."""

    out_dir: Path
    sections: list[tuple[str, str, str]] = field(default_factory=list)  # (id, title, body html)
    files: list[Path] = field(default_factory=list)

    def png(self, name: str, data: bytes, alt: str, css_class: str = "plot", width: int | None = None) -> str:
        """Write `data` as out_dir/name and return an <img> that embeds it as a data URI."""
        path = self.out_dir / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        self.files.append(path)
        uri = "data:image/png;base64," + base64.b64encode(data).decode("ascii")
        size = f' width="{width}"' if width else ""
        return f'<img class="{css_class}" src="{uri}" alt="{_esc(alt)}"{size}>'

    def figure(self, name: str, fig: Figure, alt: str) -> str:
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
        return self.png(name, buf.getvalue(), alt)


def write_report(run_dir: str | os.PathLike, out_dir: str | os.PathLike | None = None) -> Path:
    """Write `index.html` and its PNGs for a run directory; return the HTML path.

    Args:
        run_dir: a run directory with a `metrics.jsonl` (what `spotlight train` writes).
        out_dir: where to write; default `run_dir/report`.

    Raises:
        ValueError: the run directory does not exist or holds no metrics.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ValueError(f"{run_dir}: no such run directory")
    if not (run_dir / METRICS_FILE).is_file():
        raise ValueError(f"{run_dir}: no {METRICS_FILE} there; is it a `spotlight train` run directory?")
    rows = read_metrics(run_dir)
    if not rows:
        raise ValueError(f"{run_dir / METRICS_FILE}: no metrics rows yet (the run logged no iteration)")
    config_text = (run_dir / "config.yaml").read_text(encoding="utf-8") if (run_dir / "config.yaml").is_file() else None
    config = yaml.safe_load(config_text) if config_text else {}
    ledger, ledger_problem = None, f"no {COST_FILE} in the run directory"
    if (run_dir / COST_FILE).is_file():
        try:
            ledger = read_ledger(run_dir)
        except ValueError as err:  # damaged: the page goes without its cost, and says why
            logger.warning("%s; the report has no cost section", err)
            ledger_problem = f"{COST_FILE} is damaged: {err}"
    explore_log = _read_jsonl(run_dir / LOG_FILE)

    page = _Page(Path(out_dir) if out_dir is not None else run_dir / REPORT_DIR)
    try:
        page.out_dir.mkdir(parents=True, exist_ok=True)
        return _write(page, run_dir, rows, config, config_text, ledger, ledger_problem, explore_log)
    except OSError as err:
        hint = "; pass --out DIR to write it elsewhere" if out_dir is None else ""
        raise ValueError(
            f"cannot write the report into {page.out_dir} ({err.strerror}: {err.filename}){hint}"
        ) from None


def _write(page: _Page, run_dir: Path, rows, config, config_text, ledger, ledger_problem, explore_log) -> Path:
    _rewards(page, rows)
    _validation(page, rows, config)
    _timing(page, rows)
    _images(page, run_dir, config)
    _planner(page, rows, config, explore_log)
    _preemptions(page, rows, config, ledger, ledger_problem)
    _cost(page, rows, ledger, ledger_problem)
    _config(page, run_dir, config_text)
    assert [s[0] for s in page.sections] == list(SECTIONS)

    out = page.out_dir / "index.html"
    out.write_text(_html(run_dir, config, rows, ledger, page), encoding="utf-8")
    return out


# -- sections ---------------------------------------------------------------------------------------


def _rewards(page: _Page, rows: list[dict]) -> None:
    steps, mean = _series(rows, "reward/mean")
    if not steps:
        page.sections.append(("rewards", "Reward", _missing("reward/mean")))
        return
    _, std = _series(rows, "reward/std", steps)
    fig, ax = _axes("training reward per step", "reward")
    ax.plot(steps, mean, marker=".", label="reward/mean")
    if not np.all(np.isnan(std)):
        ax.fill_between(steps, mean - std, mean + std, alpha=0.2, label="+- reward/std")
    for key in sorted(k for k in _keys(rows, "reward/") if k not in _REWARD_STATS):
        ax.plot(*_series(rows, key), linestyle="--", label=key)
    ax.legend(fontsize=8)
    body = page.figure("rewards.png", fig, "training reward per step")
    failed = sum(r.get("reward/num_failed", 0) for r in rows)
    body += _table(
        ["", "first step", "last step", "best"],
        [["reward/mean", _fmt(mean[0]), _fmt(mean[-1]), _fmt(np.nanmax(mean))]],
    )
    body += f"<p>{len(steps)} step(s); {failed:g} sample(s) failed to score (dropped).</p>"
    page.sections.append(("rewards", "Reward", body))


def _validation(page: _Page, rows: list[dict], config: dict) -> None:
    steps, reward = _series(rows, "eval/mean_reward")
    if not steps:
        every = config.get("eval", {}).get("every")
        why = f"eval.every = {every}" if every is not None else "no eval/mean_reward metric"
        page.sections.append(("validation", "Validation", _missing(f"held-out reward ({why})")))
        return
    fig, ax = _axes("held-out reward (fixed seeds)", "eval/mean_reward")
    ax.plot(steps, reward, marker="o", color="C2")
    body = page.figure("validation.png", fig, "held-out reward per step")
    body += _table(
        ["", "first", "last", "best (step)"],
        [
            [
                "eval/mean_reward",
                _fmt(reward[0]),
                _fmt(reward[-1]),
                f"{_fmt(np.nanmax(reward))} ({steps[int(np.nanargmax(reward))]})",
            ]
        ],
    )
    page.sections.append(("validation", "Validation", body))


def _timing(page: _Page, rows: list[dict]) -> None:
    keys = [k for k in _TIME_KEYS if any(k in r for r in rows)]
    if not keys:
        page.sections.append(("timing", "Time per iteration", _missing("time/* metrics")))
        return
    steps = [r["step"] for r in rows]
    fig, ax = _axes("where an iteration's time goes", "seconds")
    bottom = np.zeros(len(steps))
    for key in keys:
        _, y = _series(rows, key, steps)
        y = np.nan_to_num(y)
        ax.bar(steps, y, bottom=bottom, label=key, width=0.8)
        bottom += y
    ax.legend(fontsize=8)
    body = page.figure("timing.png", fig, "time per iteration by phase")
    totals = [k for k in [*keys, "time/iteration_s"] if any(k in r for r in rows)]
    table_rows = [[k, _fmt(np.nansum(_series(rows, k, steps)[1]), 2)] for k in totals]
    body += _table(["phase", "total seconds"], table_rows)
    page.sections.append(("timing", "Time per iteration", body))


def _images(page: _Page, run_dir: Path, config: dict) -> None:
    by_key: dict[str, list[tuple[int, Path]]] = {}
    for path in sorted((run_dir / IMAGES_DIR).glob("*.png")):
        match = _IMAGE_RE.fullmatch(path.name)
        if match:
            by_key.setdefault(match["key"], []).append((int(match["step"]), path))
    if not by_key:
        every = config.get("log", {}).get("images_every")
        why = f"log.images_every = {every}" if every is not None else f"no {IMAGES_DIR}/*.png"
        page.sections.append(("images", "Images over time", _missing(f"image grids ({why})")))
        return
    body = ""
    for key, items in by_key.items():
        items.sort()
        picks = sorted({round(i * (len(items) - 1) / (MAX_IMAGE_STEPS - 1)) for i in range(MAX_IMAGE_STEPS)})
        shown = [items[i] for i in picks] if len(items) > MAX_IMAGE_STEPS else items
        body += f"<h3>{_esc(key)} ({len(items)} grid(s), {len(shown)} shown)</h3>"
        for step, path in shown:
            data = path.read_bytes()
            width = _png_width(data)
            # Tiny grids (32 px images) are drawn 2-3x larger, pixelated, so that shapes are visible.
            scale = max(1, min(3, 300 // max(width, 1)))
            img = page.png(
                f"{IMAGES_DIR}/{path.name}", data, f"{key} at step {step}", css_class="grid", width=width * scale
            )
            body += f"<figure>{img}<figcaption>step {step}</figcaption></figure>"
    page.sections.append(("images", "Images over time", body))


def _planner(page: _Page, rows: list[dict], config: dict, explore_log: list[dict]) -> None:
    explore_cfg = config.get("explore", {})
    if not _keys(rows, "explore/"):
        why = f"explore.mode = {explore_cfg.get('mode', 'none')}: no exploration"
        page.sections.append(("planner", "Exploration planner", _missing(f"planner allocations and variance ({why})")))
        return
    steps = [r["step"] for r in rows]
    body = (
        "<p>"
        + ", ".join(f"{k} <b>{_esc(explore_cfg.get(k, '?'))}</b>" for k in ("planner", "mode", "selection"))
        + ".</p>"
    )

    fig, (ax1, ax2) = _axes("exploration budget and allocation", "candidates", ncols=2)
    for key in ("explore/budget_samples", "explore/candidates_planned", "explore/candidates_scored"):
        ax1.plot(*_series(rows, key), marker=".", label=key.removeprefix("explore/"))
    ax1.legend(fontsize=8)
    bottom = np.zeros(len(steps))
    for key in ["explore/prompts_selected", *(f"explore/fallback_{c}" for c in FALLBACK_CAUSES)]:
        y = np.nan_to_num(_series(rows, key, steps)[1])
        ax2.bar(steps, y, bottom=bottom, label=key.removeprefix("explore/"))
        bottom += y
    ax2.set_title("planned prompts: selected or fallback", fontsize=10)
    ax2.set_ylabel("prompts")
    ax2.legend(fontsize=8)
    body += page.figure("planner_allocation.png", fig, "exploration budget, allocation and fallbacks per step")

    fig, ax = _axes("variance captured: group reward variance, selected vs default seeds", "variance")
    for key, style in (
        ("var_selected_stale", "-"),
        ("var_default_stale", "--"),
        ("var_selected_fresh", "-"),
        ("var_default_fresh", "--"),
    ):
        s, y = _series(rows, f"explore/{key}")
        if s:
            ax.plot(s, y, linestyle=style, marker="o", label=key)
    if ax.lines:
        ax.legend(fontsize=8)
    body += page.figure("planner_variance.png", fig, "variance captured per step")

    totals = [
        [key.removeprefix("explore/"), _fmt(np.nansum(_series(rows, key, steps)[1]), 0)]
        for key in [
            "explore/candidates_planned",
            "explore/candidates_scored",
            "explore/prompts_planned",
            "explore/prompts_selected",
            *(f"explore/fallback_{c}" for c in FALLBACK_CAUSES),
        ]
    ]
    body += "<h3>Totals over the run</h3>" + _table(["", "total"], totals)
    ratios = []
    for when in ("stale", "fresh"):
        sel = _series(rows, f"explore/var_selected_{when}", steps)[1]
        dflt = _series(rows, f"explore/var_default_{when}", steps)[1]
        both = ~np.isnan(sel) & ~np.isnan(dflt)  # the ratio compares the same steps only
        ratio = _mean(sel[both]) / _mean(dflt[both]) if _mean(dflt[both]) > 0 else math.nan
        ratios.append([f"{when} rewards", _fmt(_mean(sel)), _fmt(_mean(dflt)), _fmt(ratio, 2)])
    body += "<h3>Variance captured</h3>" + _table(
        ["", "selected groups", "default seeds", "ratio (same steps)"], ratios
    )
    body += (
        "<p>stale: under the explorers' (older) weights, the default seeds of the same prompts; fresh: "
        "the rollout's rewards, selected groups vs groups that trained on default seeds.</p>"
    )

    body += "<h3>Candidates per prompt slot</h3>" + _slot_allocations(page, explore_log)
    page.sections.append(("planner", "Exploration planner", body))


def _slot_allocations(page: _Page, explore_log: list[dict]) -> str:
    """Heat map of the candidates the planner gave each prompt slot of each batch (explore.jsonl)."""
    if not explore_log:
        return _missing(f"per-prompt allocations ({LOG_FILE} absent)")
    iters = [row["iteration"] for row in explore_log]
    num_slots = max(len(row["slots"]) for row in explore_log)
    planned_SI = np.zeros((num_slots, len(iters)))
    for j, row in enumerate(explore_log):
        for p, slot in enumerate(row["slots"]):
            planned_SI[p, j] = slot["planned"]
    fig, ax = _axes(f"candidates planned per prompt slot ({LOG_FILE})", "prompt slot")
    im = ax.imshow(
        planned_SI,
        aspect="auto",
        cmap="viridis",
        origin="lower",
        vmin=0,
        vmax=max(1.0, planned_SI.max()),
        extent=(iters[0] - 0.5, iters[-1] + 0.5, -0.5, num_slots - 0.5),
    )
    ax.set_xlabel("iteration (batch)")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(False)
    fig.colorbar(im, ax=ax, label="candidates")
    return page.figure("planner_slots.png", fig, "candidates planned per prompt slot and iteration")


def _preemptions(page: _Page, rows: list[dict], config: dict, ledger: dict | None, ledger_problem: str) -> None:
    body = "<h3>Explorers per step</h3>"
    steps, live = _series(rows, "explore/num_explorers")
    if not steps:
        mode = config.get("explore", {}).get("mode", "none")
        body += _missing(f"explorer count, deaths and respawns (explore.mode = {mode}: no explorers)")
    else:
        _, deaths = _series(rows, "explore/explorer_deaths", steps)
        _, respawns = _series(rows, "explore/explorer_respawns_total", steps)
        fig, ax = _axes("explorers: live, deaths (preemptions), respawns", "explorers")
        ax.step(steps, live, where="mid", label="live explorers")
        ax.bar(steps, np.nan_to_num(deaths), color="C3", alpha=0.7, width=0.6, label="deaths this step")
        ax.plot(steps, respawns, color="C2", linestyle="--", marker=".", label="respawns (total)")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
        body += page.figure("preemptions.png", fig, "live explorers, deaths and respawns per step")
        hit = [s for s, d in zip(steps, deaths) if d > 0]
        died = sum(r.get("explore/fallback_died", 0) for r in rows)
        body += (
            f"<p>{np.nansum(deaths):g} explorer death(s) at step(s) {', '.join(map(str, hit)) or 'none'}; "
            f"{_fmt(respawns[-1], 0)} respawn(s); {died:g} prompt(s) fell back to default seeds "
            "because their explorer died.</p>"
        )
    body += "<h3>Node timeline (GPUs held, from the cost ledger)</h3>"
    if ledger is None:
        body += _missing(f"GPUs held over time ({ledger_problem})")
    else:
        pools = ledger["pools"]
        t0 = min([u[0] for p in pools.values() for u in p["usage"]], default=0.0)
        fig, ax = _axes("GPUs held per pool over wall-clock time", "GPUs")
        for name, pool in pools.items():
            edges, values = _stairs(pool["usage"], t0)
            if values:
                ax.stairs(values, edges, label=name, linewidth=2, baseline=None)
        ax.set_xlabel("minutes since the ledger's first charge")
        ax.set_ylim(bottom=0)
        if ax.patches or ax.lines:
            ax.legend(fontsize=8)
        body += page.figure("nodes.png", fig, "GPUs held per pool over time")
        body += (
            "<p>A drop in the spot pool is a lost spot node (or a session gap: time the trainer was down is "
            "not charged).</p>"
        )
    page.sections.append(("preemptions", "Preemptions and nodes", body))


def _cost(page: _Page, rows: list[dict], ledger: dict | None, problem: str) -> None:
    if ledger is None:
        page.sections.append(("cost", "Cost", _missing(f"cost ledger ({problem})")))
        return
    s = summarize(ledger)
    table_rows = [
        [name, f"{p['gpu_s']:,.0f}", f"{p['gpu_s'] / 3600:,.3f}", _esc(p["source"]), f"{p['usd']:,.4f}"]
        for name, p in s["pools"].items()
    ]
    table_rows += [
        [
            "<b>total</b>",
            f"{s['gpu_s_total']:,.0f}",
            f"{s['gpu_s_total'] / 3600:,.3f}",
            "",
            f"<b>{s['usd_total']:,.4f}</b>",
        ],
        ["on-demand only", "", "", "every GPU-second at the on-demand price", f"{s['usd_on_demand_only']:,.4f}"],
        ["saved", "", "", f"{s['saved_fraction']:.1%} of on-demand only", f"{s['usd_saved']:,.4f}"],
    ]
    body = _table(["pool", "GPU-seconds", "GPU-hours", "price source", "USD"], table_rows, escape=False)
    body += f"<p>Charged from {s['first']} to {s['last']} (UTC).</p>"
    steps, total = _series(rows, "cost/usd_total")
    if steps:
        fig, ax = _axes("cumulative cost per step", "USD")
        ax.plot(steps, total, marker=".", label="total (on-demand + spot)")
        for key in ("cost/usd_spot", "cost/usd_on_demand_only"):
            ax.plot(*_series(rows, key), linestyle="--", label=key.removeprefix("cost/"))
        ax.legend(fontsize=8)
        body += page.figure("cost.png", fig, "cumulative cost per step")
    page.sections.append(("cost", "Cost", body))


def _config(page: _Page, run_dir: Path, config_text: str | None) -> None:
    body = _missing("resolved config (no config.yaml)") if config_text is None else f"<pre>{_esc(config_text)}</pre>"
    ckpt_dir = run_dir / "checkpoints"
    names = sorted(p.name for p in ckpt_dir.glob("step-*") if p.is_dir()) if ckpt_dir.is_dir() else []
    latest = (ckpt_dir / "latest").read_text(encoding="utf-8").strip() if (ckpt_dir / "latest").is_file() else None
    listed = ", ".join(f"{n} (latest)" if n == latest else n for n in names)
    body += f"<h3>Checkpoints</h3><p>{_esc(listed) if names else 'none on disk'}</p>"
    page.sections.append(("config", "Resolved config", body))


# -- page and helpers --------------------------------------------------------------------------------


def _html(run_dir: Path, config: dict, rows: list[dict], ledger: dict | None, page: _Page) -> str:
    name = config.get("name") or run_dir.name
    last = rows[-1]
    facts = [
        ("run directory", str(run_dir.resolve())),
        ("steps logged", f"{len(rows)} (last step {last['step']})"),
        ("reward/mean, last step", _fmt(last.get("reward/mean", math.nan))),
        ("exploration", str(config.get("explore", {}).get("mode", NOT_RECORDED))),
        ("cost (USD)", _fmt(summarize(ledger)["usd_total"]) if ledger is not None else NOT_RECORDED),
    ]
    nav = "".join(f'<a href="#{sid}">{_esc(title)}</a>' for sid, title, _ in page.sections)
    sections = "".join(
        f'<section id="{sid}"><h2>{_esc(title)}</h2>{body}</section>' for sid, title, body in page.sections
    )
    return (
        "<!DOCTYPE html>\n"
        f'<html lang="en"><head><meta charset="utf-8"><title>spotlight report: {_esc(name)}</title>'
        f"<style>{_CSS}</style></head><body>"
        f"<header><h1>spotlight report: {_esc(name)}</h1>"
        '<table class="summary">'
        + "".join(f"<tr><td>{_esc(k)}</td><td>{_esc(v)}</td></tr>" for k, v in facts)
        + "</table></header>"
        f"<nav>{nav}</nav><main>{sections}</main></body></html>\n"
    )


def _missing(what: str) -> str:
    return f'<p class="missing">{_esc(what)}: {NOT_RECORDED}.</p>'


def _read_jsonl(path: Path) -> list[dict]:
    """Rows of a JSON-lines file ([] if missing); a cut-off last line (killed mid-write) is skipped."""
    if not path.is_file():
        return []
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    rows = []
    for i, line in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            if i < len(lines) - 1:
                raise ValueError(f"{path}:{i + 1} is not JSON ({e})") from e
    return rows


def _mean(x: np.ndarray) -> float:
    """Mean of the non-NaN values; NaN if there are none (np.nanmean would warn)."""
    x = x[~np.isnan(x)]
    return float(x.mean()) if x.size else math.nan


def _keys(rows: list[dict], prefix: str) -> list[str]:
    return sorted({k for r in rows for k in r if k.startswith(prefix)})


def _series(rows: list[dict], key: str, steps: list[int] | None = None):
    """(steps, values) of the rows that have `key`; with `steps`, values at those steps (NaN where absent)."""
    if steps is None:
        have = [r for r in rows if key in r]
        return [r["step"] for r in have], np.array([r[key] for r in have], dtype=float)
    by_step = {r["step"]: r.get(key, math.nan) for r in rows}
    return steps, np.array([by_step.get(s, math.nan) for s in steps], dtype=float)


def _stairs(usage: list[list[float]], t0: float) -> tuple[list[float], list[float]]:
    """Edges (minutes since t0) and GPU counts of a pool's usage intervals; gaps between them hold 0."""
    edges: list[float] = []
    values: list[float] = []
    for start, end, gpus in sorted(usage):
        start, end = (start - t0) / 60, (end - t0) / 60
        if edges and start > edges[-1]:
            values.append(0.0)
            edges.append(start)
        start = max(start, edges[-1]) if edges else start
        if end <= start:
            continue
        if not edges:
            edges.append(start)
        values.append(gpus)
        edges.append(end)
    return edges, values


def _axes(title: str, ylabel: str, ncols: int = 1):
    fig = Figure(figsize=(5.5 * ncols if ncols > 1 else 9, 3.4), layout="constrained")
    axes = fig.subplots(1, ncols)
    for ax in np.atleast_1d(axes):
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    first = np.atleast_1d(axes)[0]
    first.set_title(title, fontsize=10)
    return fig, axes


def _table(header: list[str], rows: list[list[str]], escape: bool = True) -> str:
    cell = _esc if escape else str
    head = "".join(f"<th>{_esc(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{cell(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _fmt(x: float, digits: int = 4) -> str:
    """`digits` decimals; small values (variances) in scientific notation, NaN as n/a."""
    if x is None or math.isnan(x):
        return "n/a"
    if digits > 0 and x != 0 and abs(x) < 10**-digits:  # would print as 0.000
        return f"{float(x):.2e}"
    return f"{float(x):.{digits}f}"


def _esc(text: str) -> str:
    return html.escape(str(text), quote=True)


def _png_width(data: bytes) -> int:
    # The IHDR chunk follows the 8-byte signature: length (4), type (4), width (4, big endian).
    return int.from_bytes(data[16:20], "big")
