"""Checkpoints: round trips, exact resume of AdamW training, refusal of corrupt or partial saves."""

from __future__ import annotations

import copy
import json
import random

import numpy as np
import pytest
import torch

from spotlight.core import checkpoint as ckpt
from spotlight.core.checkpoint import (
    CheckpointError,
    capture_rng_state,
    find_latest_checkpoint,
    load_checkpoint,
    restore_rng_state,
    save_checkpoint,
)

CONFIG = "train:\n  lr: 0.001\n"


def _save(run_dir, step, **overrides):
    kwargs = dict(
        tensors={"model": {"w": torch.full((2, 3), float(step))}},
        optimizer_state=None,
        rng_state=capture_rng_state(),
        meta={"step": step},
        config_yaml=CONFIG,
    )
    kwargs.update(overrides)
    return save_checkpoint(run_dir, step, **kwargs)


def test_round_trip_tensors_meta_config(tmp_path):
    weight = torch.randn(4, 6)
    tensors = {
        "transformer": {
            "w": weight,
            "w_t": weight.t(),  # a non-contiguous view sharing storage with "w"
            "tied": weight,  # the same tensor under two names (tied weights)
            "half": torch.randn(3, dtype=torch.bfloat16),
            "scalar": torch.tensor(7, dtype=torch.int64),
        },
        "lora": {"A": torch.randn(2, 5), "B": torch.zeros(5, 2)},
    }
    meta = {"step": 12, "metrics": {"reward": 0.5}, "samples_seen": [1, 2]}
    path = save_checkpoint(
        tmp_path,
        12,
        tensors=tensors,
        optimizer_state=None,
        rng_state=capture_rng_state(),
        meta=meta,
        config_yaml=CONFIG,
    )
    assert path == tmp_path / "checkpoints" / "step-00000012"
    loaded = load_checkpoint(path)
    assert loaded.step == 12 and loaded.path == path
    assert loaded.meta == meta and loaded.config_yaml == CONFIG and loaded.optimizer_state is None
    assert loaded.tensors.keys() == tensors.keys()
    for group, state in tensors.items():
        assert loaded.tensors[group].keys() == state.keys()
        for name, t in state.items():
            assert loaded.tensors[group][name].dtype == t.dtype
            assert torch.equal(loaded.tensors[group][name], t)
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["step"] == 12 and manifest["format_version"] == ckpt.FORMAT_VERSION
    assert set(manifest["files"]) == {p.name for p in path.iterdir()} - {"manifest.json"}


def _make_model_and_opt():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return model, opt


def _train(model, opt, num_steps):
    for _ in range(num_steps):
        # Data drawn from the global RNG, so the resumed run matches only if RNG state is restored.
        x, y = torch.randn(8, 4), torch.randn(8, 3)
        loss = ((model(x) - y) ** 2).mean() + 0.01 * np.random.rand() + 0.01 * random.random()
        opt.zero_grad()
        loss.backward()
        opt.step()


def _assert_same_structure(got, expected):
    """Equal values and equal types all the way down (int keys, tuples, tensor dtypes)."""
    assert type(got) is type(expected)
    if isinstance(expected, torch.Tensor):
        assert got.dtype == expected.dtype and torch.equal(got, expected)
    elif isinstance(expected, dict):
        assert list(got) == list(expected)
        for k in expected:
            _assert_same_structure(got[k], expected[k])
    elif isinstance(expected, (list, tuple)):
        assert len(got) == len(expected)
        for g, e in zip(got, expected):
            _assert_same_structure(g, e)
    else:
        assert got == expected


def test_adamw_resume_is_bit_identical(tmp_path):
    model, opt = _make_model_and_opt()
    _train(model, opt, 3)
    save_checkpoint(
        tmp_path,
        3,
        tensors={"model": model.state_dict()},
        optimizer_state=opt.state_dict(),
        rng_state=capture_rng_state(),
        meta={},
        config_yaml=CONFIG,
    )
    opt_state_at_save = copy.deepcopy(opt.state_dict())
    before = [p.detach().clone() for p in model.parameters()]
    _train(model, opt, 2)
    expected = [p.detach().clone() for p in model.parameters()]
    assert not all(torch.equal(a, b) for a, b in zip(before, expected))

    torch.manual_seed(123)  # a fresh process would start from some other RNG state
    fresh_model = torch.nn.Linear(4, 3)
    fresh_opt = torch.optim.AdamW(fresh_model.parameters(), lr=1e-2, weight_decay=0.1)
    loaded = load_checkpoint(tmp_path)
    _assert_same_structure(loaded.optimizer_state, opt_state_at_save)
    fresh_model.load_state_dict(loaded.tensors["model"])
    fresh_opt.load_state_dict(loaded.optimizer_state)
    restore_rng_state(loaded.rng_state)
    _train(fresh_model, fresh_opt, 2)
    for a, b in zip(fresh_model.parameters(), expected):
        assert torch.equal(a, b)


def test_rng_round_trip():
    state = capture_rng_state()
    json.dumps(state)  # the documented format: plain JSON
    first = (random.random(), np.random.rand(3).tolist(), torch.randn(3).tolist())
    random.random(), np.random.rand(5), torch.rand(7)  # advance everything
    restore_rng_state(json.loads(json.dumps(state)))
    assert (random.random(), np.random.rand(3).tolist(), torch.randn(3).tolist()) == first


def test_flipped_byte_is_refused_naming_the_file(tmp_path):
    path = _save(tmp_path, 1, tensors={"model": {"w": torch.randn(64)}})
    file = path / "model.safetensors"
    data = bytearray(file.read_bytes())
    data[-5] ^= 0x01
    file.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="model.safetensors.*sha256"):
        load_checkpoint(tmp_path)


def test_truncated_file_is_refused(tmp_path):
    path = _save(tmp_path, 1)
    file = path / "meta.json"
    file.write_text(file.read_text()[:-2])
    with pytest.raises(CheckpointError, match="meta.json.*size"):
        load_checkpoint(path)


def test_missing_manifest_is_refused(tmp_path):
    path = _save(tmp_path, 1)
    (path / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="incomplete.*manifest"):
        load_checkpoint(path)
    # `latest` still names it, so loading the run is refused too rather than silently older.
    with pytest.raises(CheckpointError, match="incomplete"):
        load_checkpoint(tmp_path)


def test_no_checkpoint_in_run_dir(tmp_path):
    assert find_latest_checkpoint(tmp_path) is None
    with pytest.raises(CheckpointError, match="no checkpoint"):
        load_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="no such"):
        load_checkpoint(tmp_path / "missing")


def test_leftover_tmp_dir_is_ignored_and_cleaned(tmp_path):
    _save(tmp_path, 1)
    leftover = tmp_path / "checkpoints" / ".tmp-step-00000009-deadbeef"
    leftover.mkdir()
    (leftover / "model.safetensors").write_bytes(b"partial")
    (tmp_path / "checkpoints" / "latest").unlink()
    assert find_latest_checkpoint(tmp_path).name == "step-00000001"
    assert load_checkpoint(tmp_path).step == 1
    _save(tmp_path, 2)
    assert not leftover.exists()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step-00000001", "step-00000002"]


def test_keep_last_and_latest_pointer(tmp_path):
    for step in range(1, 6):
        _save(tmp_path, step, keep_last=2)
        latest = (tmp_path / "checkpoints" / "latest").read_text().strip()
        assert latest == f"step-{step:08d}"
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*")) == ["step-00000004", "step-00000005"]
    with pytest.raises(ValueError, match="keep_last"):
        _save(tmp_path, 6, keep_last=0)


def test_load_from_run_dir_checkpoints_dir_and_step_dir(tmp_path):
    _save(tmp_path, 1)
    _save(tmp_path, 2)
    ckpt_dir = tmp_path / "checkpoints"
    assert load_checkpoint(tmp_path).step == 2
    assert load_checkpoint(ckpt_dir).step == 2
    assert load_checkpoint(ckpt_dir / "step-00000001").step == 1
    assert torch.equal(load_checkpoint(str(ckpt_dir / "step-00000001")).tensors["model"]["w"], torch.full((2, 3), 1.0))
    # Without `latest`, the highest complete step dir is used.
    (ckpt_dir / "latest").unlink()
    assert load_checkpoint(tmp_path).step == 2


def test_resave_same_step_replaces_it(tmp_path):
    _save(tmp_path, 3, meta={"version": 1})
    _save(tmp_path, 3, meta={"version": 2})
    assert load_checkpoint(tmp_path).meta == {"version": 2}
    assert [p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".")] == []


def test_resume_from_earlier_step_drops_later_timeline(tmp_path):
    for step in (1, 2, 3):
        _save(tmp_path, step)
    _save(tmp_path, 2, meta={"branch": "resumed"})
    assert find_latest_checkpoint(tmp_path).name == "step-00000002"
    assert not (tmp_path / "checkpoints" / "step-00000003").exists()
    assert load_checkpoint(tmp_path).meta == {"branch": "resumed"}


@pytest.mark.parametrize("crash_in", ["_write_manifest", "_write_tensors"])
def test_crash_mid_save_keeps_previous_checkpoint(tmp_path, monkeypatch, crash_in):
    _save(tmp_path, 1)
    real = getattr(ckpt, crash_in)
    calls = []

    def crash_after_first_call(*args, **kwargs):
        calls.append(args)
        if len(calls) > 1 or crash_in == "_write_manifest":
            raise RuntimeError("simulated preemption")
        return real(*args, **kwargs)

    monkeypatch.setattr(ckpt, crash_in, crash_after_first_call)
    two_groups = {"model": {"w": torch.ones(3)}, "lora": {"a": torch.ones(2)}}
    with pytest.raises(RuntimeError, match="simulated"):
        _save(tmp_path, 2, tensors=two_groups)
    monkeypatch.undo()

    ckpt_dir = tmp_path / "checkpoints"
    assert (ckpt_dir / "latest").read_text().strip() == "step-00000001"
    assert not (ckpt_dir / "step-00000002").exists()
    assert [p for p in ckpt_dir.iterdir() if p.name.startswith(".tmp-")]  # the crash left debris
    assert load_checkpoint(tmp_path).step == 1
    _save(tmp_path, 2)
    assert not [p for p in ckpt_dir.iterdir() if p.name.startswith(".tmp-")]


def test_bad_arguments_are_value_errors(tmp_path):
    with pytest.raises(ValueError, match="meta must be JSON"):
        _save(tmp_path, 1, meta={"x": object()})
    with pytest.raises(ValueError, match="group name"):
        _save(tmp_path, 1, tensors={"optimizer": {}})
    with pytest.raises(ValueError, match="group name"):
        _save(tmp_path, 1, tensors={"../evil": {}})
    assert not (tmp_path / "checkpoints").exists() or not any((tmp_path / "checkpoints").iterdir())


def test_unreadable_safetensors_is_refused(tmp_path):
    # A file whose hash matches the manifest but is not safetensors (e.g. written by a buggy tool).
    path = _save(tmp_path, 1)
    file = path / "model.safetensors"
    file.write_bytes(b"not a safetensors file")
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"]["model.safetensors"] = {"size": file.stat().st_size, "sha256": ckpt._sha256(file)}
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="model.safetensors.*unreadable"):
        load_checkpoint(path)


def test_malformed_manifest_is_refused(tmp_path):
    path = _save(tmp_path, 1)
    manifest = json.loads((path / "manifest.json").read_text())
    (path / "manifest.json").write_text(json.dumps({"format_version": ckpt.FORMAT_VERSION}))
    with pytest.raises(CheckpointError, match="malformed manifest"):
        load_checkpoint(path)
    manifest["files"]["meta.json"] = {"size": 3}
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="malformed manifest"):
        load_checkpoint(path)
    manifest["format_version"] = 99
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="format_version 99"):
        load_checkpoint(path)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_rng_round_trip():
    state = capture_rng_state()
    assert len(state["torch_cuda"]) == torch.cuda.device_count()
    first = torch.randn(3, device="cuda").tolist()
    torch.randn(11, device="cuda")
    restore_rng_state(json.loads(json.dumps(state)))
    assert torch.randn(3, device="cuda").tolist() == first
