"""The `spotlight` command end to end with tiny budgets, resume exactness, and bad input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from spotlight.cli import main
from spotlight.core.checkpoint import load_checkpoint
from spotlight.core.tracking import read_metrics


def tiny_overrides(model_dir: Path, iterations: int = 2) -> list[str]:
    return [
        f"model.path={model_dir}",
        "model.height=32",
        "model.width=32",
        "sample.num_steps=3",
        "sample.eval_num_steps=3",
        f"train.num_iterations={iterations}",
        "train.prompts_per_iteration=2",
        "train.group_size=4",
        "train.minibatch_size=4",
        "log.checkpoint_every=2",
        "log.images_every=2",
        "eval.num_seeds=1",
        "data.num_heldout=8",
    ]


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, WANDB_MODE="offline")
    return subprocess.run(
        [sys.executable, "-m", "spotlight.cli", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def without_time(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "cost/"))} for r in rows]


def test_train_eval_sample_end_to_end(tiny_model_dir, tmp_path):
    """The real entry point as a subprocess: train, then eval the run and sample a grid."""
    run_dir = tmp_path / "run"
    proc = run_cli("train", "configs/dit/tiny-shapes.yaml", *tiny_overrides(tiny_model_dir), "--run-dir", str(run_dir))
    assert proc.returncode == 0, proc.stderr
    assert "spotlight train" in proc.stdout  # the closing summary
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(0.0 <= r["reward/mean"] <= 1.0 for r in rows)
    ckpt = load_checkpoint(run_dir)
    assert ckpt.step == 2
    assert "num_iterations: 2" in (run_dir / "config.yaml").read_text()
    assert (run_dir / "images" / "rollout-000002.png").is_file()
    assert list((run_dir / "wandb").glob("offline-run-*"))

    proc = run_cli("eval", *tiny_overrides(tiny_model_dir), "--checkpoint", str(run_dir), "--json")
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) == 1
    result = json.loads(lines[0])
    assert result["num_prompts"] == 8 and result["step"] == 2
    assert 0.0 <= result["mean_reward"] <= 1.0

    out = tmp_path / "grid.png"
    proc = run_cli(
        "sample",
        *tiny_overrides(tiny_model_dir),
        "--prompt",
        "two red circles",
        "--seeds",
        "1",
        "2",
        "--checkpoint",
        str(run_dir),
        "--out",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr
    from PIL import Image

    # Upscaled 4x to 128 px tiles, with the prompt and seed written under each (a band of text).
    with Image.open(out) as grid:
        assert grid.width == 2 * 128 + 2 and grid.height > 128 + 14
        band = np.asarray(grid.convert("L"))[130:, :128]
        assert (band < 128).any() and (band == 255).mean() > 0.5  # dark text on white


@pytest.mark.parametrize(
    "objective", [[], ["train.objective=flow_grpo", "sample.noise_level=1.2"]], ids=["nft", "flow_grpo"]
)
def test_resume_is_exact(tiny_model_dir, tmp_path, objective):
    """Interrupted after 2 iterations and resumed == 4 uninterrupted iterations (metrics and weights).
    The run is stopped at 2 by asking for 2 iterations, so the end-of-run cooldown (which follows
    num_iterations; tested in test_time_budget) is off here."""
    objective = [*objective, "train.lr_cooldown=0"]
    full, split = tmp_path / "full", tmp_path / "split"
    assert main(["train", *tiny_overrides(tiny_model_dir, 4), *objective, "--run-dir", str(full), "--quiet"]) == 0
    assert main(["train", *tiny_overrides(tiny_model_dir, 2), *objective, "--run-dir", str(split), "--quiet"]) == 0
    assert main(["train", *tiny_overrides(tiny_model_dir, 4), *objective, "--run-dir", str(split), "--quiet"]) == 0
    assert without_time(read_metrics(split)) == without_time(read_metrics(full))
    a, b = load_checkpoint(full), load_checkpoint(split)
    assert a.step == b.step == 4
    for key, value in a.tensors["trainable"].items():
        assert torch.equal(value, b.tensors["trainable"][key]), key


def test_a_run_shorter_than_images_every_still_logs_its_images(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    assert (
        main(["train", *tiny_overrides(tiny_model_dir, 1), "log.images_every=10", "--run-dir", str(run_dir), "--quiet"])
        == 0
    )
    assert sorted(p.name for p in (run_dir / "images").iterdir()) == ["rollout-000001.png"]


def test_periodic_held_out_eval_during_training(tiny_model_dir, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert (
        main(["train", *tiny_overrides(tiny_model_dir, 2), "eval.every=2", "--run-dir", str(run_dir), "--quiet"]) == 0
    )
    rows = read_metrics(run_dir)
    assert "eval/mean_reward" not in rows[0]
    assert 0.0 <= rows[1]["eval/mean_reward"] <= 1.0
    capsys.readouterr()
    # The same number `spotlight eval` reports for that checkpoint.
    assert main(["eval", *tiny_overrides(tiny_model_dir), "--checkpoint", str(run_dir), "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["mean_reward"] == pytest.approx(rows[1]["eval/mean_reward"], abs=1e-6)


def test_ema_weights_are_saved_resumed_and_evaluated(tiny_model_dir, tmp_path, capsys):
    """train.ema_decay: checkpoints hold the moving average beside the weights; the held-out eval
    during training, `spotlight eval` (auto) and `--weights ema` score it, `--weights raw` the
    trained weights; an interrupted run resumes it exactly."""
    ema = ["train.ema_decay=0.5", "eval.every=2", "train.lr_cooldown=0"]  # stopped at 2 by num_iterations (above)
    full, split = tmp_path / "full", tmp_path / "split"
    assert main(["train", *tiny_overrides(tiny_model_dir, 4), *ema, "--run-dir", str(full), "--quiet"]) == 0
    assert main(["train", *tiny_overrides(tiny_model_dir, 2), *ema, "--run-dir", str(split), "--quiet"]) == 0
    assert main(["train", *tiny_overrides(tiny_model_dir, 4), *ema, "--run-dir", str(split), "--quiet"]) == 0
    a, b = load_checkpoint(full), load_checkpoint(split)
    assert set(a.tensors) == {"trainable", "ema"}
    for group in ("trainable", "ema"):
        for key, value in a.tensors[group].items():
            assert torch.equal(value, b.tensors[group][key]), (group, key)
    assert any(not torch.equal(v, a.tensors["trainable"][k]) for k, v in a.tensors["ema"].items())

    rows = read_metrics(full)
    capsys.readouterr()
    scores = {}
    for weights in ("auto", "ema", "raw"):
        assert (
            main(["eval", *tiny_overrides(tiny_model_dir), "--checkpoint", str(full), "--weights", weights, "--json"])
            == 0
        )
        result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert result["weights"] == ("raw" if weights == "raw" else "ema")
        scores[weights] = result["mean_reward"]
    assert scores["auto"] == scores["ema"] == pytest.approx(rows[3]["eval/mean_reward"], abs=1e-6)

    # A run without the moving average: auto and raw score its weights; ema is refused, by name.
    plain = tmp_path / "plain"
    assert (
        main(["train", *tiny_overrides(tiny_model_dir, 2), "train.ema_decay=0", "--run-dir", str(plain), "--quiet"])
        == 0
    )
    assert set(load_checkpoint(plain).tensors) == {"trainable"}
    assert (
        main(["eval", *tiny_overrides(tiny_model_dir), "--checkpoint", str(plain), "--weights", "ema", "--json"]) == 2
    )
    err = capsys.readouterr().err
    assert "has no moving average" in err and "train.ema_decay" in err and "--weights raw" in err


def test_ctrl_c_keeps_last_checkpoint_and_resumes(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    args = [*tiny_overrides(tiny_model_dir, 200), "log.checkpoint_every=1", "--run-dir", str(run_dir), "--quiet"]
    # As from a terminal: a test runner started in the background (`cmd &`) ignores SIGINT, and so
    # would the child, which then never sees the Ctrl-C. The default disposition comes back on exec.
    proc = subprocess.Popen(
        [sys.executable, "-m", "spotlight.cli", "train", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    latest = run_dir / "checkpoints" / "latest"
    deadline = time.monotonic() + 180
    while not latest.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    assert latest.exists(), proc.stderr.read() if proc.poll() is not None else "no checkpoint in time"
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "interrupted" in err
    step = load_checkpoint(run_dir).step  # verified checksums: intact
    assert step >= 1
    # The same command resumes from there.
    assert main(["train", *tiny_overrides(tiny_model_dir, step + 1), "--run-dir", str(run_dir), "--quiet"]) == 0
    assert load_checkpoint(run_dir).step == step + 1


def test_malformed_prompt_file_names_file_and_line(tiny_model_dir, tmp_path, capsys):
    bad = tmp_path / "prompts.txt"
    bad.write_text("two red circles\n# a comment\n\nfive purple hexagons\n")
    code = main(["eval", *tiny_overrides(tiny_model_dir), "--prompts", str(bad), "--json"])
    err = capsys.readouterr().err
    assert code == 2 and f"{bad}:4:" in err and "five" in err


def test_missing_model_path_names_path_and_field(tmp_path, capsys):
    missing = tmp_path / "no-such-model"
    code = main(["eval", f"model.path={missing}", "--json"])
    err = capsys.readouterr().err
    assert code == 2 and "model.path" in err and str(missing) in err


def test_corrupt_checkpoint_is_refused(tiny_model_dir, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["train", *tiny_overrides(tiny_model_dir, 2), "--run-dir", str(run_dir), "--quiet"]) == 0
    weights = next((run_dir / "checkpoints").glob("step-*/trainable.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-10] ^= 0xFF
    weights.write_bytes(bytes(data))
    code = main(["eval", *tiny_overrides(tiny_model_dir), "--checkpoint", str(run_dir), "--json"])
    err = capsys.readouterr().err
    assert code == 2 and "trainable.safetensors" in err and "sha256" in err


def test_config_errors_name_key_and_suggestion(capsys):
    assert main(["config", "configs/dit/tiny-shapes.yaml", "train.lrr=1e-3"]) == 2
    err = capsys.readouterr().err
    assert "train.lrr" in err and "train.lr" in err
    assert main(["config", "train.lr=fast"]) == 2
    assert "train.lr" in capsys.readouterr().err


def test_tiny_shapes_recipe_is_the_embedded_default():
    from spotlight.config import DiTRecipe
    from spotlight.core.config_io import load_config

    assert load_config(DiTRecipe, "configs/dit/tiny-shapes.yaml") == DiTRecipe()


@pytest.mark.parametrize(
    "overrides,names",
    [
        (["train.objective=flow_grpo", "sample.noise_level=0"], ["train.objective", "sample.noise_level"]),
        (["sample.sde_type=cps", "sample.noise_level=0.5"], ["sde_type", "sde_window_size"]),
        (["sample.sde_type=cps", "sample.noise_level=1.5", "sample.sde_window_size=2"], ["noise_level", "eta"]),
        (["train.nft_num_timesteps=0"], ["train.nft_num_timesteps"]),
        (
            ["train.objective=flow_grpo", "sample.noise_level=1.2", "sample.autocast=bfloat16"],
            ["sample.autocast", "train.objective"],
        ),
    ],
)
def test_objective_and_step_mismatches_name_the_fields(capsys, overrides, names):
    assert main(["config", "configs/dit/tiny-shapes.yaml", *overrides]) == 2
    err = capsys.readouterr().err
    assert all(name in err for name in names), err


REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted(str(p.relative_to(REPO)) for p in (REPO / "configs/dit").glob("*.yaml"))


def test_the_recipes_are_found():
    assert {"configs/dit/tiny-shapes.yaml", "configs/dit/qwen-image.yaml", "configs/dit/tiny-pretrain.yaml"} <= set(
        RECIPES
    )


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_loads_and_its_prompt_files_are_shipped(recipe, monkeypatch):
    from spotlight.config import DiTRecipe, PretrainConfig
    from spotlight.core.config_io import load_config
    from spotlight.prompts import train_and_eval_prompts

    monkeypatch.chdir(REPO)  # the README's commands run from the repository root
    cfg = load_config(PretrainConfig if "pretrain" in recipe else DiTRecipe, recipe)
    if isinstance(cfg, DiTRecipe):
        train, evals = train_and_eval_prompts(cfg.data, cfg.reward.weights)  # files exist, and each line passes
        assert train and evals


def test_pretrain_command_builds_a_loadable_model(tmp_path, capsys):
    out = tmp_path / "base"
    args = [
        "pretrain",
        "configs/dit/tiny-pretrain.yaml",
        "model.num_layers=1",
        "model.num_heads=2",
        "model.head_dim=16",
        "model.text_hidden=32",
        "num_steps=3",
        "batch_size=4",
        "--out",
        str(out),
        "--quiet",
    ]
    assert main(args) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["steps"] == 3
    from spotlight.policy import DiTPolicy

    policy = DiTPolicy.load(out, height=32, width=32, max_text_tokens=16)
    assert policy.latent_shape == (64, 48)


def test_pretrain_caption_dropout_trains_some_images_on_the_empty_prompt(tmp_path, monkeypatch):
    """caption_dropout: that share of captions becomes the sampler's default negative prompt " "
    (what true CFG subtracts); the rest stay their images' captions."""
    from spotlight.config import PretrainConfig, SampleConfig
    from spotlight.core.config_io import load_config
    from spotlight.policy import DiTPolicy
    from spotlight.pretrain import pretrain
    from spotlight.rewards.shapes import parse_prompt

    seen: list[str] = []
    encode = DiTPolicy.encode_prompts
    monkeypatch.setattr(
        DiTPolicy, "encode_prompts", lambda self, prompts: (seen.extend(prompts), encode(self, prompts))[1]
    )
    small = [
        "model.num_layers=1",
        "model.num_heads=2",
        "model.head_dim=16",
        "model.text_hidden=32",
        "num_steps=4",
        "batch_size=16",
    ]
    pretrain(load_config(PretrainConfig, None, [*small, "caption_dropout=0.5"]), tmp_path / "a", progress=False)
    dropped = [p for p in seen if p == SampleConfig().negative_prompt]
    assert len(seen) == 64 and 16 <= len(dropped) <= 48, len(dropped)
    assert all(parse_prompt(p) for p in seen if p not in dropped)
    seen.clear()
    pretrain(load_config(PretrainConfig, None, small), tmp_path / "b", progress=False)
    assert len(seen) == 64 and SampleConfig().negative_prompt not in seen
    with pytest.raises(ValueError, match="caption_dropout must be in"):
        pretrain(load_config(PretrainConfig, None, [*small, "caption_dropout=1.5"]), tmp_path / "c", progress=False)
    # An existing --out is never replaced by mistake; --force replaces it, and no lock file stays beside it.
    before = (tmp_path / "b" / "transformer" / "config.json").read_bytes()
    with pytest.raises(ValueError, match=r"--out .*b exists; pass --force"):
        pretrain(load_config(PretrainConfig, None, small), tmp_path / "b", progress=False)
    assert (tmp_path / "b" / "transformer" / "config.json").read_bytes() == before
    pretrain(load_config(PretrainConfig, None, small), tmp_path / "b", progress=False, force=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]


def test_shipped_base_model_is_the_default():
    from spotlight.config import DiTRecipe
    from spotlight.policy import default_model_path, load_policy

    assert (default_model_path() / "transformer" / "config.json").is_file()
    policy = load_policy(DiTRecipe().model, trainable=False)
    assert policy.latent_shape == (64, 48)
    assert sum(p.numel() for p in policy.transformer.parameters()) > 1_000_000


def test_heldout_prompt_file_is_disjoint_from_training():
    from spotlight.config import DataConfig
    from spotlight.prompts import read_prompt_file, train_and_eval_prompts

    train, heldout = train_and_eval_prompts(DataConfig(), ["shapes"])
    shipped = read_prompt_file("configs/prompts/shapes-heldout.txt")
    assert shipped == heldout and len(shipped) == 64
    assert not set(shipped) & set(train)


def test_lora_run_evaluates_with_its_adapter(tiny_model_dir, tmp_path, capsys):
    """A LoRA run saves only the adapter; eval rebuilds it from the checkpoint, whatever the recipe says."""
    run_dir = tmp_path / "lora"
    overrides = tiny_overrides(tiny_model_dir, 2)
    assert main(["train", *overrides, "model.lora_rank=4", "--run-dir", str(run_dir), "--quiet"]) == 0
    saved = load_checkpoint(run_dir).tensors["trainable"]
    assert saved and all("lora" in key for key in saved)
    capsys.readouterr()
    assert main(["eval", *overrides, "--checkpoint", str(run_dir), "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["step"] == 2 and 0.0 <= result["mean_reward"] <= 1.0


def test_vlm_commands_live_under_spotlight(capsys):
    """`spotlight vlm ...` reaches the VLM path's commands (vlm/cli.py)."""
    assert main(["vlm", "config", "configs/vlm/tiny-count.yaml", "train.lr=1e-4"]) == 0
    out = capsys.readouterr().out
    assert "lr: 0.0001" in out
    assert main(["vlm", "config", "configs/vlm/tiny-count.yaml", "train.lrr=1e-4"]) == 2


def test_eval_states_the_standard_errors_of_its_mean():
    from spotlight.evaluate import _standard_errors

    # 2 prompts x 3 seeds, prompt-major: seed variances 1 and 0, prompt means 1 and 1.
    se = _standard_errors(torch.tensor([0.0, 1.0, 2.0, 1.0, 1.0, 1.0]), 2)
    assert se["stderr"] == pytest.approx((1 / 3) ** 0.5 / 2) and se["stderr_prompts"] == 0.0
    # A failed (NaN) sample leaves its prompt with fewer seeds; prompt means 1 and 3.
    se = _standard_errors(torch.tensor([0.0, 2.0, float("nan"), 3.0, 3.0, 3.0]), 2)
    assert se["stderr"] == pytest.approx((2 / 2) ** 0.5 / 2) and se["stderr_prompts"] == pytest.approx(2**0.5 / 2**0.5)
