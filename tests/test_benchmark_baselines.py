"""Every benchmark that prints JSON names its baseline: what a user would pick instead, or null
with a reason where it compares nothing (README, "Benchmarks")."""

from __future__ import annotations

import ast
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _prints_json(tree: ast.AST) -> bool:
    return any(
        isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "dumps" for n in ast.walk(tree)
    )


def _keys(tree: ast.AST) -> set[str]:
    """Constant keys of dict displays, and of subscript assignments (`out["baseline"] = ...`)."""
    keys = {k.value for n in ast.walk(tree) if isinstance(n, ast.Dict) for k in n.keys if isinstance(k, ast.Constant)}
    for n in ast.walk(tree):
        if isinstance(n, ast.Assign):
            keys |= {
                t.slice.value for t in n.targets if isinstance(t, ast.Subscript) and isinstance(t.slice, ast.Constant)
            }
    return keys


def test_every_benchmark_json_names_its_baseline():
    scripts = sorted(BENCHMARKS.glob("*.py"))
    assert len(scripts) >= 15, scripts  # the folder is where we think it is
    missing = []
    for path in scripts:
        tree = ast.parse(path.read_text(), filename=str(path))
        if _prints_json(tree) and "baseline" not in _keys(tree):
            missing.append(path.name)
    assert not missing, f"benchmarks whose JSON names no baseline: {missing}"
