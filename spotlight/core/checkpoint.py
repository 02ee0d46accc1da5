"""Atomic, verified training checkpoints.

Layout of a run directory::

    run_dir/checkpoints/
        latest                   text file naming the newest step dir, e.g. "step-00000120"
        step-00000120/
            <group>.safetensors  one per entry of `tensors` ("transformer", "lora", ...)
            optimizer.safetensors, optimizer.json   (only when an optimizer state is saved)
            rng.json, meta.json, config.yaml
            manifest.json        written last: sha256 and size of every other file

A checkpoint is built in a `.tmp-*` sibling, every file fsynced, and renamed into place only once
`manifest.json` is on disk, so a preempted save leaves either the old checkpoint or the new one,
never half of one. Loading re-hashes every file before deserializing anything: a checkpoint that
was truncated by a full disk or flipped by a bad copy is refused rather than silently resumed.

RNG states are stored as JSON lists of ints (`rng.json`): they are a few KiB, and JSON keeps them
readable and independent of the tensor format.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from spotlight.core.files import fsync_path

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
_STEP_DIR_RE = re.compile(r"step-(\d{8,})")
_GROUP_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
_RESERVED_GROUPS = {"optimizer"}
_TMP_PREFIX = ".tmp-"


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete or corrupt; the message names the path and reason."""


@dataclass
class Checkpoint:
    """A verified checkpoint, loaded onto the CPU."""

    path: Path
    """The step directory it was read from."""
    step: int
    """Training step at which it was saved."""
    tensors: dict[str, dict[str, torch.Tensor]]
    """Group name ("transformer", "lora", ...) to state dict."""
    optimizer_state: dict | None
    """A torch optimizer `state_dict()`, ready for `load_state_dict`, or None if none was saved."""
    rng_state: dict
    """What `capture_rng_state()` returned at save time; pass it to `restore_rng_state`."""
    meta: dict
    """Free-form JSON saved with the checkpoint (metrics, sample counters, ...)."""
    config_yaml: str
    """The resolved run config, as YAML text."""


def capture_rng_state() -> dict:
    """The global RNG states of python `random`, numpy, torch CPU and (if present) CUDA.

    Returns:
        A JSON-serializable dict of lists of numbers; `save_checkpoint` stores it as `rng.json`.
    """
    version, mt_state, gauss_next = random.getstate()
    kind, keys, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": [version, list(mt_state), gauss_next],
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached_gaussian)],
        "torch_cpu": torch.get_rng_state().tolist(),
    }
    if torch.cuda.is_available():
        state["torch_cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng_state(state: dict) -> None:
    """Set the global RNGs to a state returned by `capture_rng_state`.

    CUDA states are restored for the devices present both now and at capture; a mismatch (resuming
    on a different number of GPUs, or on CPU) is logged, not fatal, because per-sample seeds and not
    the global CUDA RNG fix the rollouts.
    """
    version, mt_state, gauss_next = state["python"]
    random.setstate((version, tuple(mt_state), gauss_next))
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(torch.tensor(state["torch_cpu"], dtype=torch.uint8))
    saved_cuda = state.get("torch_cuda", [])
    num_now = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if len(saved_cuda) != num_now:
        logger.warning(
            "RNG state has %d CUDA device(s), this process sees %d; restoring the first %d",
            len(saved_cuda),
            num_now,
            min(len(saved_cuda), num_now),
        )
    for device, s in enumerate(saved_cuda[:num_now]):
        torch.cuda.set_rng_state(torch.tensor(s, dtype=torch.uint8), device)


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def _encode(value: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    """JSON form of a nested value; tensors go to `tensors` under their dotted path.

    Tuples and dicts with non-string keys are tagged so that decoding gives back the same types:
    torch matches `state` entries to parameters by *int* key, and a stringified key is silently
    ignored by `Optimizer.load_state_dict`.
    """
    if isinstance(value, torch.Tensor):
        tensors[path] = value
        return {"__tensor__": path}
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v, _join(path, i), tensors) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(v, _join(path, i), tensors) for i, v in enumerate(value)]
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in value):
            return {k: _encode(v, _join(path, k), tensors) for k, v in value.items()}
        return {"__items__": [[k, _encode(v, _join(path, k), tensors)] for k, v in value.items()]}
    return value


def _decode(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of `_encode`."""
    if isinstance(value, list):
        return [_decode(v, tensors) for v in value]
    if not isinstance(value, dict):
        return value
    if "__tensor__" in value:
        return tensors[value["__tensor__"]]
    if "__tuple__" in value:
        return tuple(_decode(v, tensors) for v in value["__tuple__"])
    if "__items__" in value:
        return {k: _decode(v, tensors) for k, v in value["__items__"]}
    return {k: _decode(v, tensors) for k, v in value.items()}


def _write_text(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _write_tensors(path: Path, state_dict: dict[str, torch.Tensor]) -> None:
    """Save a state dict as safetensors: contiguous CPU tensors, shared storage cloned.

    safetensors refuses tensors that share memory (tied weights, views); cloning the second and
    later users of a storage stores each tensor in full, which is what a reload needs anyway.
    """
    seen_storages: set[int] = set()
    prepared = {}
    for name, t in state_dict.items():
        t = t.detach().cpu().contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen_storages and t.numel() > 0:
            t = t.clone()
        seen_storages.add(t.untyped_storage().data_ptr())
        prepared[name] = t
    save_file(prepared, str(path))
    fsync_path(path)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _write_manifest(step_dir: Path, step: int, groups: list[str], has_optimizer: bool) -> None:
    files = {p.name: {"size": p.stat().st_size, "sha256": _sha256(p)} for p in step_dir.iterdir()}
    manifest = {
        "format_version": FORMAT_VERSION,
        "step": step,
        "tensor_groups": groups,
        "has_optimizer": has_optimizer,
        "files": files,
    }
    _write_text(step_dir / "manifest.json", json.dumps(manifest, indent=1))


def _to_json(value: Any, what: str) -> str:
    try:
        return json.dumps(value, indent=1)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{what} must be JSON-serializable (numbers, str, list, dict): {e}") from e


def step_of(path: Path) -> int | None:
    """The step of a step dir named `step-<N>`, else None."""
    match = _STEP_DIR_RE.fullmatch(path.name)
    return int(match.group(1)) if match else None


def _complete_step_dirs(ckpt_dir: Path) -> list[Path]:
    """Step dirs that have a manifest, sorted by step."""
    dirs = [p for p in ckpt_dir.iterdir() if step_of(p) is not None]
    return sorted((p for p in dirs if (p / "manifest.json").is_file()), key=step_of)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def save_checkpoint(
    run_dir: str | os.PathLike,
    step: int,
    *,
    tensors: dict[str, dict[str, torch.Tensor]],
    optimizer_state: dict | None,
    rng_state: dict,
    meta: dict,
    config_yaml: str,
    keep_last: int = 3,
) -> Path:
    """Write `run_dir/checkpoints/step-{step:08d}/` atomically and point `latest` at it.

    Step dirs with a step above `step` are removed: they belong to a timeline that this run,
    resumed from an earlier checkpoint, has replaced (as `Tracker` drops their metrics). Of the
    rest, the `keep_last` newest are kept.

    Args:
        run_dir: The run directory.
        step: Training step, >= 0.
        tensors: Group name to state dict; each group becomes `<name>.safetensors`.
        optimizer_state: A torch optimizer `state_dict()`, or None.
        rng_state: What `capture_rng_state()` returned.
        meta: JSON-serializable extras (metrics, counters).
        config_yaml: The resolved run config as YAML text.
        keep_last: How many step dirs to keep, >= 1.

    Returns:
        The step directory.
    """
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}; use 1 to keep only the newest")
    for name in tensors:
        if not _GROUP_RE.fullmatch(name) or name in _RESERVED_GROUPS:
            raise ValueError(
                f"tensor group name {name!r} must be a plain file name ([A-Za-z0-9_.-]) and not "
                f"one of {sorted(_RESERVED_GROUPS)}; rename the group"
            )
    # Serialize every JSON part before touching the disk, so a bad `meta` fails fast.
    opt_tensors: dict[str, torch.Tensor] = {}
    json_parts = {"meta.json": _to_json(meta, "meta"), "rng.json": _to_json(rng_state, "rng_state")}
    if optimizer_state is not None:
        encoded = _encode(optimizer_state, "", opt_tensors)
        json_parts["optimizer.json"] = _to_json(encoded, "optimizer_state")

    ckpt_dir = Path(run_dir) / "checkpoints"
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    # Leftovers of a crashed save: never renamed into place, so nothing points at them.
    for leftover in ckpt_dir.glob(f"{_TMP_PREFIX}*"):
        _remove(leftover)

    final = ckpt_dir / f"step-{step:08d}"
    tmp = ckpt_dir / f"{_TMP_PREFIX}{final.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    for name, state_dict in tensors.items():
        _write_tensors(tmp / f"{name}.safetensors", state_dict)
    if optimizer_state is not None:
        _write_tensors(tmp / "optimizer.safetensors", opt_tensors)
    for file_name, text in json_parts.items():
        _write_text(tmp / file_name, text)
    _write_text(tmp / "config.yaml", config_yaml)
    _write_manifest(tmp, step, sorted(tensors), optimizer_state is not None)
    fsync_path(tmp)
    _rename_into_place(tmp, final)

    set_latest(final)
    _prune(ckpt_dir, step, keep_last)
    return final


def _rename_into_place(tmp: Path, final: Path) -> None:
    """Rename the written step dir `tmp` to `final`, replacing one already there, durably.

    A directory cannot be os.replace'd over a non-empty one: the old one moves aside first. It is
    named `.tmp-*`, so a crash between the two renames leaves it to be cleaned by the next save.
    """
    if final.exists():
        old = final.parent / f"{_TMP_PREFIX}replaced-{final.name}-{uuid.uuid4().hex[:8]}"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old)
    else:
        os.replace(tmp, final)
    fsync_path(final.parent)


def _prune(ckpt_dir: Path, step: int, keep_last: int) -> None:
    """Remove the step dirs above `step` (a replaced timeline) and all but the `keep_last` newest."""
    older = []
    for p in ckpt_dir.iterdir():
        s = step_of(p)
        if s is not None and s > step:
            logger.info("removing %s: newer than the checkpoint just saved at step %d", p, step)
            _remove(p)
        elif s is not None and s < step:
            older.append(p)
    for p in sorted(older, key=step_of)[: max(0, len(older) - (keep_last - 1))]:
        _remove(p)


def set_latest(step_dir: Path) -> None:
    """Point `checkpoints/latest` at `step_dir` (a complete step dir in that folder), atomically."""
    ckpt_dir = step_dir.parent
    latest_tmp = ckpt_dir / f"{_TMP_PREFIX}latest-{uuid.uuid4().hex[:8]}"
    _write_text(latest_tmp, step_dir.name + "\n")
    os.replace(latest_tmp, ckpt_dir / "latest")
    fsync_path(ckpt_dir)


def find_latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The step dir named by `run_dir/checkpoints/latest`, else the highest complete one, else None.

    A complete step dir above the one `latest` names wins: a save killed after its rename into
    place and before `latest` moved left it whole. A step dir counts as complete when it has a
    manifest; its files are verified only on load.
    """
    ckpt_dir = Path(run_dir) / "checkpoints"
    if not ckpt_dir.is_dir():
        return None
    complete = _complete_step_dirs(ckpt_dir)
    latest = ckpt_dir / "latest"
    if latest.is_file():
        name = latest.read_text(encoding="utf-8").strip()
        if _STEP_DIR_RE.fullmatch(name) and (ckpt_dir / name).is_dir():
            named = ckpt_dir / name
            return complete[-1] if complete and step_of(complete[-1]) > step_of(named) else named
        logger.warning("%s names %r, not a step dir; using the highest complete one", latest, name)
    return complete[-1] if complete else None


DAMAGED_DIR = "damaged"
"""Subfolder of `checkpoints/` where `newest_intact_checkpoint` moves damaged step dirs (never deleted)."""


def newest_intact_checkpoint(run_dir: str | os.PathLike) -> Checkpoint | None:
    """The newest checkpoint of `run_dir` that verifies, loaded; None when the run has none.

    The step dir `find_latest_checkpoint` picks is tried first, then the others from the newest down. A
    damaged one (truncated, flipped bytes, a cut or missing manifest) is moved to
    `checkpoints/damaged/` with a warning naming it and why, never deleted, and `latest` then names
    the checkpoint resumed from. A run thus resumes from an older intact checkpoint (its metrics
    after that step are dropped and recomputed, as after any resume) instead of stopping.

    Raises:
        CheckpointError: step dirs exist but none verifies (all moved aside): the message says so.
    """
    ckpt_dir = Path(run_dir) / "checkpoints"
    if not ckpt_dir.is_dir():
        return None
    _recover_replaced(ckpt_dir)
    named = find_latest_checkpoint(run_dir)
    others = sorted(
        (p for p in ckpt_dir.iterdir() if step_of(p) is not None and p.is_dir() and p != named),
        key=step_of,
        reverse=True,
    )
    damaged: list[str] = []
    for step_dir in ([named] if named is not None else []) + others:
        try:
            ckpt = load_checkpoint(step_dir)
        except CheckpointError as err:
            aside = _set_aside(step_dir)
            logger.warning("checkpoint %s is damaged (%s): moved to %s; trying the previous one", step_dir, err, aside)
            damaged.append(f"{step_dir.name} ({err})")
            continue
        if damaged:
            set_latest(step_dir)
            logger.warning(
                "resuming from %s, the newest intact checkpoint (%d damaged one(s) set aside)", step_dir, len(damaged)
            )
        return ckpt
    if damaged:
        raise CheckpointError(
            f"{ckpt_dir}: no intact checkpoint, every one is damaged and was moved to {ckpt_dir / DAMAGED_DIR}: "
            + "; ".join(damaged)
            + ". Start over with --no-resume, or restore a copy"
        )
    return None


def _recover_replaced(ckpt_dir: Path) -> None:
    """Put back a step dir that a save of the same step moved aside (`.tmp-replaced-*`) and was
    killed before the new one took its place; the next save would otherwise delete it."""
    for old in sorted(ckpt_dir.glob(f"{_TMP_PREFIX}replaced-step-*")):
        name = old.name[len(f"{_TMP_PREFIX}replaced-") :].rsplit("-", 1)[0]
        if _STEP_DIR_RE.fullmatch(name) and not (ckpt_dir / name).exists():
            os.replace(old, ckpt_dir / name)
            logger.warning("%s: put back %s, which a save killed midway had moved aside", ckpt_dir, name)
    fsync_path(ckpt_dir)


def _set_aside(step_dir: Path) -> Path:
    """Move a damaged step dir into `checkpoints/damaged/` under a name no other holds there."""
    dest_dir = step_dir.parent / DAMAGED_DIR
    dest_dir.mkdir(exist_ok=True)
    dest = dest_dir / step_dir.name
    n = 1
    while dest.exists():
        dest, n = dest_dir / f"{step_dir.name}.{n}", n + 1
    os.replace(step_dir, dest)
    fsync_path(step_dir.parent)
    return dest


def pick_weights(ckpt: Checkpoint, weights: str) -> tuple[dict, str]:
    """The checkpoint's raw or moving-average weights (`--weights raw|ema|auto`; auto: the average
    where saved) and which it took, "raw" or "ema"."""
    which = "ema" if weights == "ema" or (weights == "auto" and "ema" in ckpt.tensors) else "raw"
    if which == "ema" and "ema" not in ckpt.tensors:
        raise ValueError(
            f"--weights ema: {ckpt.path} has no moving average (train with train.ema_decay > 0); use --weights raw"
        )
    return ckpt.tensors["ema" if which == "ema" else "trainable"], which


def checkpoint_kind(ckpt: Checkpoint) -> str:
    """ "dit" or "vlm": which trainer saved `ckpt` (its meta's "kind", else its config's sections);
    "" when neither tells."""
    kind = ckpt.meta.get("kind") if isinstance(ckpt.meta, dict) else None
    if kind in ("dit", "vlm"):
        return kind
    import yaml

    try:
        sections = set(yaml.safe_load(ckpt.config_yaml) or {})
    except (yaml.YAMLError, TypeError):
        return ""
    return "vlm" if {"rollout", "task"} <= sections else "dit" if "sample" in sections else ""


def expect_kind(ckpt: Checkpoint, kind: str) -> None:
    """Raise a one-line ValueError when `ckpt` was saved by the other trainer than `kind`."""
    found = checkpoint_kind(ckpt)
    if found and found != kind:
        command = {"dit": "spotlight eval / sample", "vlm": "spotlight vlm eval"}[found]
        raise ValueError(
            f"{ckpt.path} is a {found.upper()} checkpoint, not a {kind.upper()} one; "
            f"use it with `{command} --checkpoint {ckpt.path}`"
        )


def _resolve_step_dir(path: Path) -> Path:
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or directory")
    if step_of(path) is not None or (path / "manifest.json").exists():
        return path
    is_ckpt_dir = path.name == "checkpoints" and not (path / "checkpoints").is_dir()
    run_dir = path.parent if is_ckpt_dir else path
    found = find_latest_checkpoint(run_dir)
    if found is None:
        raise CheckpointError(f"{path}: no checkpoint found (no {run_dir / 'checkpoints'}/step-*)")
    return found


def _verify(step_dir: Path) -> dict:
    """Check the manifest against the files on disk; returns the manifest."""
    manifest_path = step_dir / "manifest.json"
    if not manifest_path.is_file():
        raise CheckpointError(f"{step_dir}: incomplete checkpoint, manifest.json is missing")
    manifest = _read_text(manifest_path, parse_json=True)
    required = {"format_version", "step", "tensor_groups", "has_optimizer", "files"}
    if not isinstance(manifest, dict) or not required <= manifest.keys():
        raise CheckpointError(f"{manifest_path}: malformed manifest, needs keys {sorted(required)}")
    if manifest["format_version"] != FORMAT_VERSION:
        raise CheckpointError(
            f"{manifest_path}: format_version {manifest['format_version']!r}, this spotlight reads {FORMAT_VERSION}"
        )
    try:
        files = {name: (int(e["size"]), str(e["sha256"])) for name, e in manifest["files"].items()}
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        raise CheckpointError(f"{manifest_path}: malformed manifest file entry ({e!r})") from e
    for name, (expected_size, expected_sha256) in files.items():
        file = step_dir / name
        if not file.is_file():
            raise CheckpointError(f"{file}: listed in the manifest but missing")
        size = file.stat().st_size
        if size != expected_size:
            raise CheckpointError(f"{file}: size {size} bytes, manifest says {expected_size}")
        if _sha256(file) != expected_sha256:
            raise CheckpointError(f"{file}: sha256 does not match the manifest (file is corrupt)")
    return manifest


def _read_tensors(file: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(file), device="cpu")
    except Exception as e:  # safetensors raises its own SafetensorError and OSError variants
        raise CheckpointError(f"{file}: unreadable safetensors file ({e})") from e


def _read_text(file: Path, *, parse_json: bool = False) -> Any:
    try:
        text = file.read_text(encoding="utf-8")
        return json.loads(text) if parse_json else text
    except (OSError, ValueError) as e:  # ValueError covers JSON and UTF-8 decoding errors
        raise CheckpointError(f"{file}: unreadable ({e})") from e


def load_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Verify and load a checkpoint onto the CPU.

    Args:
        path: A run directory (uses `checkpoints/latest`, or the highest complete step dir if
            `latest` is missing), its `checkpoints` directory, or one step directory.

    Raises:
        CheckpointError: No checkpoint was found, or it is incomplete or corrupt.
    """
    step_dir = _resolve_step_dir(Path(path))
    manifest = _verify(step_dir)
    tensors = {g: _read_tensors(step_dir / f"{g}.safetensors") for g in manifest["tensor_groups"]}
    optimizer_state = None
    if manifest["has_optimizer"]:
        opt_tensors = _read_tensors(step_dir / "optimizer.safetensors")
        encoded = _read_text(step_dir / "optimizer.json", parse_json=True)
        optimizer_state = _decode(encoded, opt_tensors)
    return Checkpoint(
        path=step_dir,
        step=manifest["step"],
        tensors=tensors,
        optimizer_state=optimizer_state,
        rng_state=_read_text(step_dir / "rng.json", parse_json=True),
        meta=_read_text(step_dir / "meta.json", parse_json=True),
        config_yaml=_read_text(step_dir / "config.yaml"),
    )
