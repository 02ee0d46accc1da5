"""Ulysses sequence parallelism: real gloo processes against the single-process stock transformer.

Four forked gloo processes run the whole elastic scenario on one model object per process (weights
never reloaded): degree 4 on the world group, degree 2 on two pairs formed in place, degree 1 on
singleton groups, degree 4 again, a 3-rank group (heads 4 not divisible: ValueError), then ranks 2
and 3 leave and ranks 0 and 1 start a fresh 2-rank world (new FileStore) and run degree 2 in it.
Each process compares every output with the stock forward it computed itself before installing
the processors. The image has 21 tokens (3x7), so degrees 2 and 4 both pad; prompts are padded.
"""

from __future__ import annotations

import json
import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from spotlight.parallel import SPContext, UlyssesAttnProcessor, install_ulysses, ulysses_forward

TOL = 1e-5
WORLD = 4


def _tiny_model_and_inputs():
    """The tiny real transformer (same seed everywhere), float32, and one batch of padded prompts."""
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(0)
    model = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=16,
        out_channels=4,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=4,
        joint_attention_dim=24,
        axes_dims_rope=(4, 6, 6),
    ).eval()
    height, width = 3, 7  # 21 image tokens: not divisible by 2 or 4
    latents = torch.randn(2, height * width, 16)
    embeds = torch.randn(2, 9, 24)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[0, 6:] = 0
    mask[1, 4:] = 0
    sigma = torch.tensor([0.3, 0.9])
    return model, (latents, embeds, mask, sigma, [[(1, height, width)]] * 2)


def _stock(model, inputs) -> torch.Tensor:
    latents, embeds, mask, sigma, shapes = inputs
    with torch.no_grad():
        return model(
            hidden_states=latents,
            encoder_hidden_states=embeds,
            encoder_hidden_states_mask=mask,
            timestep=sigma,
            img_shapes=shapes,
            return_dict=False,
        )[0]


def _init(rank: int, world: int, store_file: Path) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{store_file}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )


def _elastic_worker(rank: int, tmp: str) -> None:
    torch.set_num_threads(1)
    tmp_path = Path(tmp)
    _init(rank, WORLD, tmp_path / "store_world4")
    model, inputs = _tiny_model_and_inputs()
    reference = _stock(model, inputs)
    ctx = install_ulysses(model)
    report = {"pid": os.getpid(), "phases": []}

    def run(phase: str, group) -> None:
        ctx.set_group(group)
        out = ulysses_forward(model, ctx, *inputs)
        err = (out - reference).abs().max().item()
        report["phases"].append({"phase": phase, "degree": ctx.degree, "err": err, "pid": os.getpid()})

    run("world", dist.group.WORLD)
    first = rank - rank % 2
    run("pairs", dist.new_group([first, first + 1], use_local_synchronization=True))
    run("singletons", dist.new_group([rank], use_local_synchronization=True))
    run("world_again", dist.group.WORLD)
    if rank < 3:
        trio = dist.new_group([0, 1, 2], use_local_synchronization=True)
        try:
            ctx.set_group(trio)
        except ValueError as e:
            report["set_group_error"] = str(e)
        # Without the model's head count the context cannot check early; the processor still must.
        bare = SPContext()
        bare.set_group(trio)
        model.set_attn_processor(UlyssesAttnProcessor(bare))
        try:
            ulysses_forward(model, bare, *inputs)
        except ValueError as e:
            report["processor_error"] = str(e)
        install_ulysses(model, ctx)
    dist.barrier()
    dist.destroy_process_group()
    # Ranks 2 and 3 are gone (preempted); 0 and 1 form a fresh world with a new store, same processes.
    if rank < 2:
        _init(rank, 2, tmp_path / "store_world2")
        run("fresh_world", dist.group.WORLD)
        dist.destroy_process_group()
    (tmp_path / f"report{rank}.json").write_text(json.dumps(report))


@pytest.fixture(scope="module")
def elastic_reports(tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("ulysses")
    # fork: the workers inherit the imported torch/diffusers (spawn re-imports them: ~5 s CPU each).
    mp.start_processes(_elastic_worker, args=(str(tmp),), nprocs=WORLD, join=True, start_method="fork")
    return [json.loads((tmp / f"report{r}.json").read_text()) for r in range(WORLD)]


def _phase(report: dict, name: str) -> dict:
    (found,) = [p for p in report["phases"] if p["phase"] == name]
    return found


def test_degree_1_without_group_matches_stock_and_needs_no_collective():
    assert not dist.is_initialized()  # any collective would raise here
    model, inputs = _tiny_model_and_inputs()
    reference = _stock(model, inputs)
    ctx = install_ulysses(model)
    assert ctx.degree == 1 and ctx.group is None
    assert (ulysses_forward(model, ctx, *inputs) - reference).abs().max().item() <= TOL


@pytest.mark.parametrize("phase,degree", [("world", 4), ("pairs", 2), ("singletons", 1)])
def test_sp_forward_matches_stock(elastic_reports, phase, degree):
    for report in elastic_reports:
        result = _phase(report, phase)
        assert result["degree"] == degree
        assert result["err"] <= TOL, (phase, result)


def test_regroup_in_place_keeps_processes_and_matches(elastic_reports):
    for rank, report in enumerate(elastic_reports):
        names = [p["phase"] for p in report["phases"]]
        expected = ["world", "pairs", "singletons", "world_again"] + (["fresh_world"] if rank < 2 else [])
        assert names == expected
        assert {p["pid"] for p in report["phases"]} == {report["pid"]}
        assert _phase(report, "world_again")["degree"] == 4
        assert _phase(report, "world_again")["err"] <= TOL
        if rank < 2:
            assert _phase(report, "fresh_world")["degree"] == 2
            assert _phase(report, "fresh_world")["err"] <= TOL


def test_heads_not_divisible_by_degree_raise(elastic_reports):
    for report in elastic_reports[:3]:
        for key in ("set_group_error", "processor_error"):
            assert "4 heads" in report[key] and "degree 3" in report[key], report
