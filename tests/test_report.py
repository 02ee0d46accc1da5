"""`spotlight report`: a real tiny stale-exploration run rendered in headless Chromium, missing data, errors.

The browser test needs Debian's chromium (/usr/bin/chromium): it fails under CI (CI=true; `.ci/run`
installs it) and is skipped elsewhere. It takes a screenshot, reads the DOM Chromium built, and
records every request the page makes through the DevTools protocol (over a pipe, no port).
"""

from __future__ import annotations

import base64
import io
import json
import os
import re
import select
import subprocess
import sys
import time
from html.parser import HTMLParser
from pathlib import Path

import pytest
from PIL import Image

from spotlight.cli import main
from spotlight.config import DiTRecipe
from spotlight.core.config_io import save_config
from spotlight.core.cost import CostConfig, CostLedger
from spotlight.core.tracking import Tracker
from spotlight.report import NOT_RECORDED, SECTIONS, write_report

REPO = Path(__file__).resolve().parents[1]
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def chromium() -> str:
    if CHROMIUM.is_file():
        return str(CHROMIUM)
    why = f"Debian's chromium is not installed ({CHROMIUM}; apt-get install -y chromium)"
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"{why}: CI must install it (see .ci/run)")
    pytest.skip(why)


class Page(HTMLParser):
    """Section ids and their text, and every src/href of a page."""

    def __init__(self, text: str):
        super().__init__()
        self.sections: dict[str, str] = {}
        self.images: list[str] = []
        self.links: list[str] = []
        self._section: str | None = None
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "section":
            self._section = attrs["id"]
            self.sections[self._section] = ""
        if tag == "img":
            self.images.append(attrs["src"])
        self.links += [attrs[a] for a in ("src", "href") if a in attrs and tag != "img"]

    def handle_endtag(self, tag):
        if tag == "section":
            self._section = None

    def handle_data(self, data):
        if self._section is not None:
            self.sections[self._section] += data


def page_requests(browser: str, url: str, user_data_dir: Path, timeout_s: float = 120) -> list[str]:
    """URLs of every request `url` makes while it loads, from the DevTools protocol over a pipe.

    Chromium's own background traffic (update checks and the like) belongs to no page, so only the
    page's Network.requestWillBeSent events are counted.
    """
    to_chrome_r, to_chrome_w = os.pipe()
    from_chrome_r, from_chrome_w = os.pipe()

    def fds_3_and_4() -> None:  # --remote-debugging-pipe reads fd 3 and writes fd 4
        os.dup2(to_chrome_r, 3)
        os.dup2(from_chrome_w, 4)

    cmd = [browser, *CHROMIUM_FLAGS, f"--user-data-dir={user_data_dir}", "--remote-debugging-pipe", "about:blank"]
    proc = subprocess.Popen(
        cmd, pass_fds=(3, 4), preexec_fn=fds_3_and_4, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    os.close(to_chrome_r)
    os.close(from_chrome_w)
    deadline = time.monotonic() + timeout_s
    buf, events, next_id = b"", [], 0

    def call(method: str, params: dict | None = None, session: str | None = None) -> dict:
        nonlocal next_id
        next_id += 1
        msg = {"id": next_id, "method": method, "params": params or {}, **({"sessionId": session} if session else {})}
        os.write(to_chrome_w, json.dumps(msg).encode() + b"\0")
        return wait_for(lambda m: m.get("id") == next_id)

    def wait_for(pred) -> dict:
        nonlocal buf
        while time.monotonic() < deadline:
            while b"\0" in buf:
                raw, buf = buf.split(b"\0", 1)
                events.append(json.loads(raw))
                if pred(events[-1]):
                    return events[-1]
            if select.select([from_chrome_r], [], [], 0.5)[0]:
                chunk = os.read(from_chrome_r, 1 << 20)
                assert chunk, "chromium closed the DevTools pipe"
                buf += chunk
        raise TimeoutError(f"no answer from chromium within {timeout_s} s")

    try:
        target = call("Target.createTarget", {"url": "about:blank"})["result"]["targetId"]
        session = call("Target.attachToTarget", {"targetId": target, "flatten": True})["result"]["sessionId"]
        call("Network.enable", session=session)
        call("Page.enable", session=session)
        call("Page.navigate", {"url": url}, session=session)
        wait_for(lambda m: m.get("method") == "Page.loadEventFired" and m.get("sessionId") == session)
        os.write(to_chrome_w, json.dumps({"id": 0, "method": "Browser.close"}).encode() + b"\0")
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(to_chrome_w)
        os.close(from_chrome_r)
    return [
        e["params"]["request"]["url"]
        for e in events
        if e.get("method") == "Network.requestWillBeSent" and e.get("sessionId") == session
    ]


@pytest.fixture(scope="module")
def browser() -> str:
    """Chromium's path; requested before `stale_run`, so that a skip does not train first."""
    return chromium()


@pytest.fixture(scope="module")
def stale_run(tiny_model_dir, tmp_path_factory) -> Path:
    """A real 4-iteration run with stale exploration on a local Ray cluster, eval and image grids."""
    run_dir = tmp_path_factory.mktemp("report") / "run"
    overrides = [
        f"model.path={tiny_model_dir}",
        "sample.num_steps=3",
        "sample.eval_num_steps=3",
        "sample.batch_size=16",
        "train.num_iterations=4",
        "train.prompts_per_iteration=2",
        "train.group_size=4",
        "train.num_inner_epochs=4",
        "train.minibatch_size=2",
        "reward.weights={jpeg_compressibility: 1.0}",
        "train.max_minutes=0",
        "log.wandb_mode=disabled",
        "log.images_every=2",
        "log.checkpoint_every=4",
        "data.num_heldout=8",
        "eval.every=2",
        "eval.num_seeds=1",
        "explore.mode=stale",
        "explore.planner=uniform",
        "explore.max_candidates=8",
        "explore.budget_fraction=1.0",
    ]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "spotlight.cli",
            "train",
            "configs/dit/tiny-shapes.yaml",
            *overrides,
            "--run-dir",
            str(run_dir),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=REPO,
        env=dict(os.environ, WANDB_MODE="disabled"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


def test_report_of_a_real_run_renders_in_headless_chromium(browser, stale_run, tmp_path):
    """`spotlight report RUN_DIR`: every section with data, PNGs embedded and on disk, no network."""
    proc = subprocess.run(
        [sys.executable, "-m", "spotlight.cli", "report", str(stale_run)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    index = stale_run / "report" / "index.html"
    assert proc.stdout.strip().splitlines()[-1] == str(index)
    url = index.resolve().as_uri()

    shot = tmp_path / "shot.png"
    run = [browser, *CHROMIUM_FLAGS]
    subprocess.run(
        [*run, f"--user-data-dir={tmp_path / 'profile-shot'}", f"--screenshot={shot}", "--window-size=1280,4000", url],
        capture_output=True,
        timeout=120,
        check=True,
    )
    with Image.open(shot) as im:
        assert im.size == (1280, 4000)
        colours = im.convert("RGB").getcolors(maxcolors=1 << 20)
    assert len(colours) > 100, "the screenshot is (nearly) one colour"

    dom = subprocess.run(
        [*run, f"--user-data-dir={tmp_path / 'profile-dom'}", "--dump-dom", url],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    page = Page(dom)
    assert list(page.sections) == list(SECTIONS)
    for sid in ("rewards", "validation", "timing", "images", "planner", "cost", "config"):
        assert NOT_RECORDED not in page.sections[sid], (sid, page.sections[sid][:300])
    assert "rollout (2 grid(s), 2 shown)" in page.sections["images"]
    assert "planner uniform, mode stale" in page.sections["planner"]
    assert "0 explorer death(s)" in page.sections["preemptions"]
    assert "spot" in page.sections["cost"] and "saved" in page.sections["cost"]
    assert "explore:\n  mode: stale" in page.sections["config"] and "step-00000004 (latest)" in page.sections["config"]

    # Every picture is an embedded PNG, and the same bytes lie next to the page.
    prefix = "data:image/png;base64,"
    assert len(page.images) >= 11 and all(src.startswith(prefix) for src in page.images)
    embedded = {base64.b64decode(src[len(prefix) :], validate=True) for src in page.images}
    for data in embedded:
        Image.open(io.BytesIO(data)).verify()
    assert embedded == {p.read_bytes() for p in index.parent.rglob("*.png")}
    assert all(link.startswith("#") for link in page.links), page.links

    requests = page_requests(browser, url, tmp_path / "profile-cdp")
    assert url in requests and len(requests) > len(embedded) / 2
    assert all(r.startswith(("file:", "data:")) for r in requests), [
        r[:80] for r in requests if not r.startswith("data:")
    ]


def make_run(run_dir: Path, rows: list[dict]) -> None:
    """A run directory written by the run's own writers (Tracker, save_config), without training."""
    save_config(DiTRecipe(), run_dir / "config.yaml")
    with Tracker(run_dir, project="test", run_name="test", mode="disabled", config={}) as tracker:
        for step, row in enumerate(rows, start=1):
            tracker.log(row, step=step)


def test_a_run_without_exploration_eval_images_or_cost_keeps_every_section(tmp_path):
    run_dir = tmp_path / "run"
    make_run(
        run_dir,
        [{"reward/mean": 0.1 * k, "reward/std": 0.05, "time/rollout_s": 1.0, "time/update_s": 2.0} for k in range(3)],
    )
    out = write_report(run_dir, tmp_path / "out")
    assert out == tmp_path / "out" / "index.html"
    page = Page(out.read_text())
    assert list(page.sections) == list(SECTIONS)
    for sid in ("validation", "images", "planner", "preemptions", "cost"):
        assert NOT_RECORDED in page.sections[sid], sid
    assert "eval.every = 0" in page.sections["validation"]
    assert "explore.mode = none" in page.sections["planner"] and "explore.mode = none" in page.sections["preemptions"]
    assert "no cost.json" in page.sections["cost"] and "no cost.json" in page.sections["preemptions"]
    for sid in ("rewards", "timing", "config"):
        assert NOT_RECORDED not in page.sections[sid], sid
    assert sorted(p.name for p in out.parent.glob("*.png")) == ["rewards.png", "timing.png"]
    assert len(page.images) == 2


def test_a_damaged_ledger_leaves_out_the_cost_and_says_why(tmp_path):
    run_dir = tmp_path / "run"
    make_run(
        run_dir,
        [{"reward/mean": 0.1 * k, "reward/std": 0.05, "time/rollout_s": 1.0, "time/update_s": 2.0} for k in range(3)],
    )
    (run_dir / "cost.json").write_text('{"version": 1, "pools": {"on_dem')  # cut mid-write
    page = Page(write_report(run_dir, tmp_path / "out").read_text())
    assert "cost.json is damaged" in page.sections["cost"] and NOT_RECORDED in page.sections["cost"]
    assert "cost.json is damaged" in page.sections["preemptions"]


def test_deaths_and_the_ledger_reach_the_page(tmp_path):
    """Explorer deaths per step and a ledger whose spot pool lost a node show up in their sections."""
    run_dir = tmp_path / "run"
    live, deaths = [2, 1, 2], [0, 1, 0]
    make_run(
        run_dir,
        [
            {
                "reward/mean": 0.5,
                "explore/num_explorers": n,
                "explore/explorer_deaths": d,
                "explore/explorer_respawns_total": k // 2,
                "explore/candidates_planned": 8,
                "explore/fallback_died": d,
            }
            for k, (n, d) in enumerate(zip(live, deaths))
        ],
    )
    ledger = CostLedger(run_dir, CostConfig(), resume=False, now=1000.0)
    for t, spot in ((1060.0, 2), (1120.0, 1), (1180.0, 2)):
        ledger.charge(spot_gpus=spot, now=t)
    page = Page(write_report(run_dir).read_text())
    assert "1 explorer death(s) at step(s) 2; 1 respawn(s); 1 prompt(s) fell back" in page.sections["preemptions"]
    assert NOT_RECORDED not in page.sections["cost"] and "on_demand" in page.sections["cost"]
    assert "explore.jsonl absent" in page.sections["planner"]
    assert (run_dir / "report" / "nodes.png").is_file() and (run_dir / "report" / "preemptions.png").is_file()


def test_errors_name_the_run_directory(tmp_path, capsys):
    with pytest.raises(ValueError, match=re.escape(str(tmp_path / "nope"))):
        write_report(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'empty'}: no metrics.jsonl")):
        write_report(tmp_path / "empty")
    assert main(["report", str(tmp_path / "empty")]) == 2
    assert str(tmp_path / "empty") in capsys.readouterr().err
