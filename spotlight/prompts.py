"""Prompt lists: prompt files (one prompt per line) and the shapes grammar's train / held-out split."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from spotlight.config import DataConfig
from spotlight.rewards import shapes


def read_prompt_file(path: str | Path, *, check: Callable[[str], object] | None = None, field: str = "") -> list[str]:
    """Prompts of a text file: one per line; blank lines and lines starting with '#' are skipped.

    Args:
        path: the file.
        check: called on every prompt; a ValueError it raises is reported with the file and line.
        field: the config field that named the file, for the error message.

    Raises:
        ValueError: naming the file (and line) when it is missing, unreadable, empty or malformed.
    """
    path = Path(path)
    where = f" (from {field})" if field else ""
    if not path.is_file():
        raise ValueError(f"prompt file {str(path)!r}{where} does not exist")
    raw = path.read_bytes()
    prompts = []
    for number, line in enumerate(raw.split(b"\n"), start=1):
        try:
            text = line.decode("utf-8").strip()
        except UnicodeDecodeError as err:
            raise ValueError(f"{path}:{number}: not UTF-8 text ({err.reason})") from None
        if not text or text.startswith("#"):
            continue
        check_prompt(text, check, f"{path}:{number}")
        prompts.append(text)
    if not prompts:
        raise ValueError(f"prompt file {path!s}{where} holds no prompts")
    return prompts


def check_prompt(text: str, check: Callable[[str], object] | None, where: str) -> None:
    """Raise a ValueError starting with `where` when `text` is not one line of prompt text or
    fails `check` (see `prompt_check`)."""
    if not text.strip():
        raise ValueError(f"{where}: empty prompt; a prompt is one non-empty line of text")
    if any(ord(c) < 32 for c in text):
        raise ValueError(f"{where}: control character in prompt {text!r}")
    if check is not None:
        try:
            check(text)
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None


def prompt_check(reward_names) -> Callable[[str], object] | None:
    """The check prompts must pass for these rewards: the shapes grammar when `shapes` (or one of its diagnostics)
    scores them."""
    return shapes.parse_prompt if set(reward_names) & set(shapes.GRAMMAR_REWARDS) else None


def train_and_eval_prompts(data: DataConfig, reward_names) -> tuple[list[str], list[str]]:
    """(train, eval) prompts: files when configured, else the shapes grammar's split."""
    check = prompt_check(reward_names)
    grammar_train, grammar_heldout = shapes.split_prompts(data.split_seed, data.num_heldout)
    train = (
        read_prompt_file(data.train_prompts, check=check, field="data.train_prompts")
        if data.train_prompts
        else grammar_train
    )
    evals = (
        read_prompt_file(data.eval_prompts, check=check, field="data.eval_prompts")
        if data.eval_prompts
        else grammar_heldout
    )
    return train, evals
