"""Every user mistake is one line on stderr and exit code 2, naming the path or field, and loses
nothing: one table of (entry point, bad input, what the message must say), run through the real
`spotlight` entry point (`spotlight.cli.main`, the console script's function).

Each case builds what it needs in a scratch directory (`Scene`); `lost` checks afterwards that the
files a case must not touch are byte for byte as before, and that a run directory the failed
command would have created does not exist.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from test_cli import tiny_overrides

from spotlight.cli import main
from spotlight.core.checkpoint import save_checkpoint
from spotlight.core.runlock import RunLock


@dataclass
class Scene:
    root: Path
    model: Path
    keep: dict[Path, bytes] = field(default_factory=dict)
    """Files that must be unchanged afterwards."""
    absent: list[Path] = field(default_factory=list)
    """Paths that must not exist afterwards (a failed start leaves nothing behind)."""
    held: list = field(default_factory=list)

    def file(self, name: str, data: bytes) -> Path:
        path = self.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        self.keep[path] = data
        return path

    def run_dir(self, name: str = "run", kind: str = "dit") -> Path:
        """A run directory with one metrics row and one intact checkpoint."""
        run = self.root / name
        save_checkpoint(
            run,
            1,
            tensors={"trainable": {"w": torch.ones(2)}},
            optimizer_state=None,
            rng_state={},
            meta={"kind": kind, "step": 1},
            config_yaml="name: x\n",
            keep_last=1,
        )
        self.file(f"{name}/metrics.jsonl", b'{"step": 1, "reward/mean": 0.5}\n')
        for f in (run / "checkpoints").rglob("*"):
            if f.is_file():
                self.keep[f] = f.read_bytes()
        return run


BINARY = bytes(range(128, 256)) * 3


def lock_held(s: Scene) -> list[str]:
    run = s.run_dir()
    s.held.append(RunLock(run, "spotlight train"))
    return ["train", *tiny_overrides(s.model), "--run-dir", str(run)]


def all_damaged(s: Scene) -> list[str]:
    run = s.run_dir()
    f = next((run / "checkpoints" / "step-00000001").glob("*.safetensors"))
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF
    f.write_bytes(bytes(data))
    s.keep = {p: d for p, d in s.keep.items() if "checkpoints" not in p.parts}  # moved aside, not lost
    return ["train", *tiny_overrides(s.model), "--run-dir", str(run)]


def report_unwritable(s: Scene) -> list[str]:
    run = s.run_dir()
    s.file("run/report", b"a file where the report folder would go\n")
    return ["report", str(run)]


def new_run(s: Scene, *extra: str) -> list[str]:
    run = s.root / "new-run"
    s.absent.append(run)
    return ["train", *tiny_overrides(s.model), *extra, "--run-dir", str(run)]


# (id, build the argv, what stderr must contain)
CASES: list[tuple[str, Callable[[Scene], list[str]], str]] = [
    ("run-dir is a file", lambda s: ["train", "--run-dir", str(s.file("afile", b"x"))], "is a file, not a directory"),
    (
        "run-dir unwritable",
        lambda s: ["train", "--run-dir", str(s.file("afile", b"x") / "sub")],
        "choose a writable --run-dir",
    ),
    ("run-dir held by another trainer", lock_held, "is in use by `spotlight train`"),
    ("every checkpoint damaged", all_damaged, "no intact checkpoint"),
    ("binary recipe", lambda s: ["train", str(s.file("bin.yaml", BINARY))], "bin.yaml: not a text file"),
    ("missing recipe", lambda s: ["train", str(s.root / "nope.yaml")], "nope.yaml' not found"),
    ("unknown field", lambda s: ["train", "train.lrr=1"], "did you mean 'train.lr'"),
    ("negative lr", lambda s: new_run(s, "train.lr=-1"), "train.lr must be >= 0"),
    ("zero iterations", lambda s: new_run(s, "train.num_iterations=0"), "train.num_iterations must be >= 1"),
    ("missing model path", lambda s: new_run(s, f"model.path={s.root / 'no-model'}"), "model.path"),
    (
        "VLM recipe to DiT train",
        lambda s: ["train", "configs/vlm/tiny-count.yaml"],
        "is a recipe for `spotlight vlm train`",
    ),
    (
        "DiT recipe to vlm train",
        lambda s: ["vlm", "train", "configs/dit/tiny-shapes.yaml"],
        "is a recipe for `spotlight train`",
    ),
    (
        "pretrain recipe to train",
        lambda s: ["train", "configs/dit/tiny-pretrain.yaml"],
        "is a recipe for `spotlight pretrain`",
    ),
    (
        "VLM checkpoint to DiT eval",
        lambda s: ["eval", "--checkpoint", str(s.run_dir(kind="vlm"))],
        "is a VLM checkpoint",
    ),
    ("DiT checkpoint to vlm eval", lambda s: ["vlm", "eval", "--checkpoint", str(s.run_dir())], "is a DIT checkpoint"),
    ("missing checkpoint", lambda s: ["eval", "--checkpoint", str(s.root / "none")], "no such file or directory"),
    ("missing prompt file", lambda s: ["eval", "--prompts", str(s.root / "p.txt")], "does not exist"),
    ("binary prompt file", lambda s: ["eval", "--prompts", str(s.file("p.txt", BINARY))], "not UTF-8"),
    (
        "prompt outside the grammar",
        lambda s: ["sample", "--prompt", "seventeen purple hexagons"],
        "--prompt 'seventeen purple hexagons'",
    ),
    ("empty prompt", lambda s: ["sample", "--prompt", " "], "empty prompt"),
    (
        "pretrain over an existing model",
        lambda s: ["pretrain", "--out", str(s.file("base/model_index.json", b"{}").parent)],
        "pass --force",
    ),
    ("report of a non-run", lambda s: ["report", str(s.root)], "no metrics.jsonl"),
    ("report into an unwritable folder", report_unwritable, "pass --out DIR"),
    (
        "cost of a damaged ledger",
        lambda s: ["cost", str(s.file("c/cost.json", b'{"version": 1, "po').parent)],
        "not a valid cost ledger",
    ),
    (
        "sample into an unwritable path",
        lambda s: [
            "sample",
            "--prompt",
            "one red circle",
            "--seeds",
            "0",
            "--out",
            str(s.file("afile", b"x") / "g.png"),
        ],
        "cannot write the image",
    ),
    (
        "vlm warmstart over a file",
        lambda s: ["vlm", "warmstart", "--out", str(s.file("afile", b"x"))],
        "(a file); pass --force",
    ),
    (
        "vlm warmstart over a model",
        lambda s: ["vlm", "warmstart", "--out", str(s.file("vlm/config.json", b"{}").parent)],
        "exists; pass --force",
    ),
    ("binary recipe to memory", lambda s: ["memory", str(s.file("bin.yaml", BINARY))], "bin.yaml: not a text file"),
    (
        "binary simulator profile",
        lambda s: ["simulate", "--synthetic", "--profile", str(s.file("p.yaml", BINARY))],
        "p.yaml: not a text file",
    ),
    ("binary trace", lambda s: ["simulate", "--trace", str(s.file("t.csv", BINARY))], "t.csv: not a text file"),
    ("missing trace", lambda s: ["simulate", "--trace", str(s.root / "t.csv")], "t.csv: no such file"),
]


@pytest.mark.parametrize("build, expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_mistake_is_one_line_exit_2_and_loses_nothing(build, expected, tiny_model_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(Path(__file__).resolve().parents[1])  # the recipes' relative paths
    scene = Scene(tmp_path, tiny_model_dir)
    argv = build(scene)
    capsys.readouterr()
    try:
        code = main(argv)
    finally:
        for lock in scene.held:
            lock.release()
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1, err
    assert expected in err, err
    for path, data in scene.keep.items():
        assert path.is_file() and path.read_bytes() == data, f"{path} changed or lost"
    for path in scene.absent:
        assert not path.exists(), f"{path} was left behind: {sorted(p.name for p in path.iterdir())}"
